"""Root conftest of the cann_ops_tilelang tests: loads the plugins in tests/_plugins (see its README.md).

The device binding runs first, at import of this file, so that an xdist worker sees one device before any
plugin or test module can import TileLang or torch_npu.
"""

import sys
from pathlib import Path

import pytest

_TESTS_ROOT = Path(__file__).resolve().parent
if str(_TESTS_ROOT) not in sys.path:  # `_plugins` importable whatever directory pytest starts from
    sys.path.insert(0, str(_TESTS_ROOT))

pytest.register_assert_rewrite("_plugins")  # imported below, before pytest_plugins would mark it
from _plugins.device import bind_once  # noqa: E402

bind_once()

pytest_plugins = [
    "_plugins.device",
    "_plugins.levels",
    "_plugins.seed",
    "_plugins.memprofile",
    "_plugins.benchmark",
    "_plugins.references",
    "pytester",  # for tests/test_plugins
]


def pytest_configure(config):
    from _plugins.paths import set_tests_root

    set_tests_root(config, _TESTS_ROOT)
