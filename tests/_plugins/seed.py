"""Per-test seeds: ``(--seed + int(sha256(node id relative to tests/))) % 2**31``.

The node id is made relative to the tests root, so a test gets the same seed whichever directory pytest
starts from and whichever xdist worker runs it. An autouse fixture seeds torch, random and numpy
(when installed) before every test; the ``seed`` fixture returns the value. A failing test's report
shows its seed.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from _plugins.paths import relative_nodeid, tests_root

_SEED = pytest.StashKey[int]()


def seed_for(base: int, rel_nodeid: str) -> int:
    """The seed of the test whose tests-root-relative node id is ``rel_nodeid``."""
    return (base + int(hashlib.sha256(rel_nodeid.encode()).hexdigest(), 16)) % 2**31


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("cann_ops_tilelang").addoption(
        "--seed", type=int, default=0, help="base of every test's seed (default 0); seed = base + sha256(node id)"
    )


def item_seed(item: pytest.Item) -> int:
    s = item.stash.get(_SEED, None)
    if s is None:
        s = seed_for(item.config.getoption("seed"), relative_nodeid(item, tests_root(item.config)))
        item.stash[_SEED] = s
    return s


@pytest.fixture(autouse=True)
def _ops_tilelang_seed_everything(request: pytest.FixtureRequest) -> None:
    s = item_seed(request.node)
    random.seed(s)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(s)
    import torch

    torch.manual_seed(s)  # also seeds every CUDA/NPU generator (lazily)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """This test's seed (an int in [0, 2**31))."""
    return item_seed(request.node)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    if report.failed:
        report.sections.append(
            ("seed", f"seed={item_seed(item)} (--seed={item.config.getoption('seed')}, "
                     f"node id {relative_nodeid(item, tests_root(item.config))})")
        )
    return report
