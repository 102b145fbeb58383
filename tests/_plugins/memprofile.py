"""Peak device memory per test and the automatic ``large_npu_mem`` marker.

Profiles: ``<test dir>/npu_mem_profiles/<test file stem>.json`` (NPU) or
``<test dir>/cuda_mem_profiles/<test file stem>.json`` (CUDA), a JSON object
``{test name within the file: peak bytes}`` with sorted keys.

Classification (at collection): a test marked ``device`` whose profile entry exceeds
``--large-mem-threshold`` MiB (default ``OPS_TILELANG_LARGE_MEM_MB`` or 16384), or that has no entry, gets
``large_npu_mem``; tests without the ``device`` marker never do.

``--refresh-mem-profiles``: every ``device`` test that passes records its peak memory (peak statistics reset
before setup, ``max_memory_allocated`` read after the call) and the profile files are rewritten at the end
of the session, merged per test. Under xdist every worker sends its measurements to the controller, which
alone writes the files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from _plugins import device as _device
from _plugins.paths import test_name_in_file

THRESHOLD_ENV = "OPS_TILELANG_LARGE_MEM_MB"
DEFAULT_THRESHOLD_MB = 16384
PROFILE_DIRS = {"npu": "npu_mem_profiles", "cuda": "cuda_mem_profiles"}

_PEAK = pytest.StashKey[dict[str, dict[str, int]]]()  # profile path -> {test name: bytes}
_KIND = pytest.StashKey[str]()

#: Tests may replace the memory backend: an object with reset() and peak() -> int, and a `kind` attribute.
backend_override: Any = None


class _TorchBackend:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def _mod(self):
        import torch

        return torch.cuda if self.kind == "cuda" else torch.npu

    def reset(self) -> None:
        self._mod().reset_peak_memory_stats()

    def peak(self) -> int:
        return int(self._mod().max_memory_allocated())


def _backend():
    if backend_override is not None:
        return backend_override
    kind = _device.device_type()
    return _TorchBackend(kind) if kind else None


def profile_kind(config: pytest.Config) -> str:
    """Which profile family applies: the usable device, else the detected platform, else 'npu'."""
    kind = config.stash.get(_KIND, None)
    if kind is None:
        if backend_override is not None:
            kind = backend_override.kind
        else:
            kind = _device.device_type() or _device.detect_platform() or "npu"
        config.stash[_KIND] = kind
    return kind


def profile_path(test_file: Path, kind: str) -> Path:
    test_file = Path(test_file)
    return test_file.parent / PROFILE_DIRS[kind] / f"{test_file.stem}.json"


def load_profile(path: Path) -> dict[str, int]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise pytest.UsageError(f"memory profile {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise pytest.UsageError(f"memory profile {path} must be a JSON object {{test: peak_bytes}}")
    return data


def write_profile(path: Path, updates: dict[str, int]) -> None:
    """Merge ``updates`` into the profile at ``path`` and write it with sorted keys."""
    path = Path(path)
    merged = load_profile(path)
    merged.update({k: int(v) for k, v in updates.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
    tmp.replace(path)


def threshold_bytes(config: pytest.Config) -> int:
    mb = config.getoption("large_mem_threshold")
    if mb is None:
        raw = os.environ.get(THRESHOLD_ENV, "").strip()
        try:
            mb = float(raw) if raw else DEFAULT_THRESHOLD_MB
        except ValueError:
            raise pytest.UsageError(f"{THRESHOLD_ENV}={raw!r} is not a number of MiB") from None
    return int(float(mb) * 2**20)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("cann_ops_tilelang")
    g.addoption("--refresh-mem-profiles", action="store_true", default=False,
                help="record each device test's peak memory and rewrite <test dir>/{npu,cuda}_mem_profiles/*.json")
    g.addoption("--large-mem-threshold", type=float, default=None, metavar="MIB",
                help=f"device tests above this peak (or without a profile) get large_npu_mem "
                     f"(default ${THRESHOLD_ENV} or {DEFAULT_THRESHOLD_MB})")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "large_npu_mem: added automatically: device test whose peak memory profile is large or missing")
    config.stash[_PEAK] = {}
    threshold_bytes(config)  # validate early


@pytest.hookimpl(tryfirst=True)  # before -m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    limit = threshold_bytes(config)
    kind = profile_kind(config)
    cache: dict[Path, dict[str, int]] = {}
    for item in items:
        if item.get_closest_marker("device") is None:
            continue
        path = profile_path(item.path, kind)
        if path not in cache:
            cache[path] = load_profile(path)
        peak = cache[path].get(test_name_in_file(item))
        if peak is None or int(peak) > limit:
            item.add_marker("large_npu_mem")


def _recording(item: pytest.Item) -> bool:
    return item.config.getoption("refresh_mem_profiles") and item.get_closest_marker("device") is not None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _recording(item) and (b := _backend()) is not None:
        b.reset()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    if call.when == "call" and report.passed and _recording(item) and (b := _backend()) is not None:
        path = str(profile_path(item.path, profile_kind(item.config)))
        item.config.stash[_PEAK].setdefault(path, {})[test_name_in_file(item)] = b.peak()
    return report


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # xdist controller: collect a worker's measurements
    data = getattr(node, "workeroutput", {}).get("ops_tilelang_mem", {})
    peaks = node.config.stash[_PEAK]
    for path, tests in data.items():
        peaks.setdefault(path, {}).update(tests)


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("refresh_mem_profiles"):
        return
    peaks = config.stash[_PEAK]
    if hasattr(config, "workerinput"):  # xdist worker: the controller writes
        config.workeroutput["ops_tilelang_mem"] = peaks
        return
    for path, tests in sorted(peaks.items()):
        write_profile(Path(path), tests)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if config.getoption("refresh_mem_profiles") and not hasattr(config, "workerinput"):
        peaks = config.stash[_PEAK]
        n = sum(len(t) for t in peaks.values())
        terminalreporter.write_sep("-", "cann_ops_tilelang memory profiles")
        terminalreporter.write_line(f"recorded {n} test(s) into {len(peaks)} profile file(s)")
        for path in sorted(peaks):
            terminalreporter.write_line(f"  {path}")
