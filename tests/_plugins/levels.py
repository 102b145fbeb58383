"""Test levels: ``OPS_TILELANG_TEST_LEVEL`` = 0 (quick), 1 (default), 2 (full) chooses how many shapes run.

In an op test::

    from _plugins.levels import level_choice

    TOKENS = level_choice([1, 128], [1, 7, 128, 4096], [1, 7, 128, 4096, 65536])

    @pytest.mark.parametrize("tokens", TOKENS)
    def test_op(tokens): ...

An invalid value stops pytest with a usage error.
"""

from __future__ import annotations

import os
from typing import TypeVar

import pytest

LEVEL_ENV = "OPS_TILELANG_TEST_LEVEL"
DEFAULT_LEVEL = 1
_NAMES = {0: "quick", 1: "default", 2: "full"}

T = TypeVar("T")


def test_level() -> int:
    """The current level from ``OPS_TILELANG_TEST_LEVEL`` (unset or empty: 1).

    Raises:
        ValueError: the variable is not 0, 1 or 2.
    """
    raw = os.environ.get(LEVEL_ENV, "").strip()
    if raw == "":
        return DEFAULT_LEVEL
    if raw not in ("0", "1", "2"):
        raise ValueError(f"{LEVEL_ENV}={raw!r} is invalid: use 0 (quick), 1 (default) or 2 (full)")
    return int(raw)


test_level.__test__ = False  # type: ignore[attr-defined]  # importing it into a test module must not collect it
current_level = test_level


def level_choice(level0: list[T], level1: list[T], level2: list[T] | None = None) -> list[T]:
    """The list for the current level: ``level0`` at 0, ``level1`` at 1, ``level2`` (default ``level1``) at 2."""
    return [level0, level1, level1 if level2 is None else level2][test_level()]


def pytest_configure(config: pytest.Config) -> None:
    try:
        test_level()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config: pytest.Config) -> str:
    lvl = test_level()
    return f"cann_ops_tilelang test level: {lvl} ({_NAMES[lvl]}; {LEVEL_ENV})"
