"""Helpers for the plugins' own tests (tests/test_plugins): an inner pytester tree loading the plugins."""

import textwrap
from pathlib import Path

import pytest

from _plugins import device as _device

TESTS_DIR = Path(__file__).resolve().parent.parent

INNER_CONFTEST = """
import sys
from pathlib import Path
sys.path.insert(0, {tests_dir!r})
import pytest
pytest.register_assert_rewrite("_plugins")
from _plugins.device import bind_once
bind_once()
pytest_plugins = ["_plugins.device", "_plugins.levels", "_plugins.seed", "_plugins.memprofile", "_plugins.benchmark"]

def pytest_configure(config):
    from _plugins.paths import set_tests_root
    set_tests_root(config, Path(__file__).resolve().parent)
{extra}
"""

ENV_VARS = ("OPS_TILELANG_TEST_LEVEL", "OPS_TILELANG_LARGE_MEM_MB", "OPS_TILELANG_BENCH_CHIP",
             _device.KIND_ENV, _device.COUNT_ENV, "PYTEST_XDIST_WORKER", "CUDA_VISIBLE_DEVICES",
             "ASCEND_RT_VISIBLE_DEVICES", "PYTEST_ADDOPTS")


def write_inner_tree(pytester: pytest.Pytester, extra: str = "") -> None:
    pytester.makeconftest(INNER_CONFTEST.format(tests_dir=str(TESTS_DIR), extra=textwrap.dedent(extra)))
    pytester.makeini("[pytest]\n")


INNER_ARGS = ("-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "no:randomly", "-p", "no:hypothesispytest")
