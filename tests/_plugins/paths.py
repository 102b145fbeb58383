"""Where the tests live: the tests root and per-test-file locations shared by the plugins."""

from __future__ import annotations

from pathlib import Path

import pytest

_TESTS_ROOT = pytest.StashKey[Path]()


def set_tests_root(config: pytest.Config, root: Path) -> None:
    """Record the tests root (the directory of the conftest.py that loads the plugins)."""
    config.stash[_TESTS_ROOT] = Path(root).resolve()


def tests_root(config: pytest.Config) -> Path:
    """The tests root; defaults to ``<rootdir>/tests`` when present, else the rootdir."""
    root = config.stash.get(_TESTS_ROOT, None)
    if root is None:
        candidate = config.rootpath / "tests"
        root = candidate if candidate.is_dir() else config.rootpath
        config.stash[_TESTS_ROOT] = root
    return root


def test_name_in_file(item: pytest.Item) -> str:
    """The node id without its file part, e.g. ``TestX::test_y[bf16-128]``.

    pytest-xdist's ``--dist loadgroup`` appends ``@<group>`` to the node id of a test marked
    ``xdist_group``; that suffix is dropped, so a test has one name (one seed, one memory-profile entry)
    however it is run.
    """
    parts = item.nodeid.split("::", 1)
    name = parts[1] if len(parts) == 2 else item.name
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        suffix = "@" + str(group.args[0] if group.args else group.kwargs.get("name", ""))
        name = name.removesuffix(suffix)
    return name


test_name_in_file.__test__ = False  # type: ignore[attr-defined]  # not a test if imported into a test module


def relative_nodeid(item: pytest.Item, root: Path) -> str:
    """The node id with its file part relative to ``root`` (posix separators).

    Independent of the directory pytest was started from and of the rootdir.
    """
    path = Path(item.path).resolve()
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        rel = path.as_posix()
    return f"{rel}::{test_name_in_file(item)}"
