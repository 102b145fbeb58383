"""Device binding for xdist workers and device helpers for tests.

Binding: an xdist worker ``gwN`` sees exactly one accelerator, device ``N % count``, through
``CUDA_VISIBLE_DEVICES`` (CUDA) or ``ASCEND_RT_VISIBLE_DEVICES`` (NPU). It happens when tests/conftest.py
is imported (before any plugin or test module can import TileLang or torch_npu) and never calls a
torch.cuda / torch.npu API: devices are counted from the visibility variable if already set,
``/proc/driver/nvidia/gpus``, ``nvidia-smi -L``, ``/dev/davinci<N>`` or ``npu-smi info -l``.
A pre-set visibility list is respected: worker N binds to its ``N % len``-th entry.

Helpers for test modules::

    from _plugins.device import device_type, requires_cuda, requires_npu, requires_device

    @requires_device            # skip unless an accelerator is usable; also marks the test `device`
    def test_x(device): ...     # `device` fixture: torch.device("cuda") / torch.device("npu")
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import pytest

#: env var that overrides the detected platform ("cuda", "npu" or "none").
KIND_ENV = "OPS_TILELANG_TEST_DEVICE_KIND"
#: env var that overrides the detected device count.
COUNT_ENV = "OPS_TILELANG_TEST_DEVICE_COUNT"
VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}

requires_cuda = pytest.mark.requires_cuda
requires_npu = pytest.mark.requires_npu
requires_device = pytest.mark.requires_device
_REQUIRES = ("requires_cuda", "requires_npu", "requires_device")


# ----------------------------------------------------------------------------- detection (no runtime init)
def _visible_list(value: str | None) -> list[str] | None:
    """Entries of a visibility variable; None when unset, [] when it hides every device."""
    if value is None:
        return None
    entries = [e.strip() for e in value.split(",") if e.strip()]
    # CUDA stops at the first invalid entry such as -1.
    out: list[str] = []
    for e in entries:
        if e.startswith("-"):
            break
        out.append(e)
    return out


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _count_cuda_hw() -> int:
    gpus = glob.glob("/proc/driver/nvidia/gpus/*")
    if gpus:
        return len(gpus)
    return sum(1 for line in _run(["nvidia-smi", "-L"]).splitlines() if line.startswith("GPU "))


def _count_npu_hw() -> int:
    devs = [p for p in glob.glob("/dev/davinci*") if re.fullmatch(r"davinci\d+", os.path.basename(p))]
    if devs:
        return len(devs)
    m = re.search(r"Total Count\s*:\s*(\d+)", _run(["npu-smi", "info", "-l"]))
    return int(m.group(1)) if m else 0


def detect_platform(environ: Mapping[str, str] | None = None) -> str | None:
    """'cuda', 'npu' or None, from the environment and the host only (initializes no runtime)."""
    env = os.environ if environ is None else environ
    forced = env.get(KIND_ENV, "").strip().lower()
    if forced in ("cuda", "npu"):
        return forced
    if forced in ("none", "cpu"):
        return None
    if forced:
        raise ValueError(f"{KIND_ENV} must be cuda, npu, none or cpu (or unset), got {env[KIND_ENV]!r}")
    if "ASCEND_RT_VISIBLE_DEVICES" in env:
        return "npu"
    if _count_npu_hw():
        return "npu"
    if "CUDA_VISIBLE_DEVICES" in env:
        return "cuda"
    if _count_cuda_hw():
        return "cuda"
    return None


def visible_devices(kind: str | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The device ids this process may use (pre-set visibility list, else 0..count-1)."""
    env = os.environ if environ is None else environ
    if kind is None:
        return []
    pre = _visible_list(env.get(VISIBLE_ENV[kind]))
    forced = env.get(COUNT_ENV, "").strip()
    if forced and not forced.isdigit():
        raise ValueError(f"{COUNT_ENV} must be a device count (an int >= 0), got {env[COUNT_ENV]!r}")
    if pre is not None:
        return pre[: int(forced)] if forced else pre
    if forced:
        return [str(i) for i in range(int(forced))]
    n = _count_cuda_hw() if kind == "cuda" else _count_npu_hw()
    return [str(i) for i in range(n)]


def device_count(environ: Mapping[str, str] | None = None) -> int:
    """Number of accelerators visible to this process, without initializing a runtime."""
    return len(visible_devices(detect_platform(environ), environ))


@dataclass(frozen=True)
class Binding:
    worker: str | None  # e.g. "gw3"; None outside xdist workers
    kind: str | None  # "cuda" / "npu" / None
    variable: str | None  # the env var set, e.g. "CUDA_VISIBLE_DEVICES"
    value: str | None  # what it was set to, e.g. "3"
    reason: str  # human-readable summary


# visibility variable -> its value before this process bound its device (None: it was unset)
_BEFORE_BIND: dict[str, str | None] = {}


def unbound_environ() -> dict[str, str]:
    """A copy of ``os.environ`` as it was before this worker's device binding: for a subprocess that uses
    every device of the run (e.g. a 2-GPU data-parallel test inside a one-GPU xdist worker)."""
    env = dict(os.environ)
    for var, value in _BEFORE_BIND.items():
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    return env


def bind_worker_device(environ: MutableMapping[str, str] | None = None) -> Binding:
    """Bind an xdist worker ``gwN`` to one device by setting its visibility variable.

    Idempotent: a second call sees a one-entry list and keeps it. Does nothing outside xdist workers,
    on hosts without accelerators, or when ``OPS_TILELANG_TEST_DEVICE_KIND=none``.
    """
    env = os.environ if environ is None else environ
    worker = env.get("PYTEST_XDIST_WORKER")
    m = re.fullmatch(r"gw(\d+)", worker or "")
    if m is None:
        return Binding(None, detect_platform(env), None, None, "not an xdist worker: all visible devices")
    kind = detect_platform(env)
    if kind is None:
        return Binding(worker, None, None, None, "no accelerator detected: nothing bound")
    devices = visible_devices(kind, env)
    var = VISIBLE_ENV[kind]
    if not devices:
        return Binding(worker, kind, None, None, f"no {kind} device visible: nothing bound")
    value = devices[int(m.group(1)) % len(devices)]
    if environ is None and env.get(var) != value:
        _warn_if_initialized(kind)
    if environ is None:
        _BEFORE_BIND.setdefault(var, env.get(var))  # the first call's: what unbound_environ() restores
    env[var] = value
    return Binding(worker, kind, var, value, f"{worker} -> {var}={value} (of {len(devices)})")


def _warn_if_initialized(kind: str) -> None:
    torch = sys.modules.get("torch")
    if kind == "cuda" and torch is not None and torch.cuda.is_initialized():
        warnings.warn("CUDA was initialized before the device binding; CUDA_VISIBLE_DEVICES has no effect")
    if kind == "npu" and "torch_npu" in sys.modules:
        warnings.warn("torch_npu was imported before the device binding; ASCEND_RT_VISIBLE_DEVICES may have no effect")


# ----------------------------------------------------------------------------- runtime helpers (lazy)
_UNSET = object()
_DEVICE_TYPE: object = _UNSET


def device_type() -> str | None:
    """'npu' if torch_npu imports and has a device, else 'cuda' if CUDA is available, else None.

    Imports torch_npu on first call (only then), so call it from tests/fixtures, not at plugin import.
    """
    global _DEVICE_TYPE
    if _DEVICE_TYPE is _UNSET:
        _DEVICE_TYPE = _probe_device_type()
    return _DEVICE_TYPE  # type: ignore[return-value]


def _probe_device_type() -> str | None:
    import torch

    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():
                return "npu"
        except Exception:  # a broken CANN install must not break CPU or CUDA tests
            pass
    if torch.cuda.is_available():
        return "cuda"
    return None


def torch_device():
    """``torch.device`` of the accelerator this process uses (index 0 after binding), or None."""
    kind = device_type()
    if kind is None:
        return None
    import torch

    return torch.device(kind, 0)


def _skip_reason(marker: str) -> str | None:
    kind = device_type()
    if marker == "requires_cuda" and kind != "cuda":
        return f"requires a CUDA device (device_type()={kind!r})"
    if marker == "requires_npu" and kind != "npu":
        return f"requires an Ascend NPU with torch_npu (device_type()={kind!r})"
    if marker == "requires_device" and kind is None:
        return "requires an accelerator (CUDA or NPU); none usable"
    return None


# ----------------------------------------------------------------------------- pytest hooks
_BINDING: Binding | None = None


def bind_once() -> Binding:
    """Bind at most once per process (called by tests/conftest.py at import)."""
    global _BINDING
    if _BINDING is None:
        _BINDING = bind_worker_device()
    return _BINDING


def pytest_configure(config: pytest.Config) -> None:
    bind_once()  # no-op if conftest already did it
    config.addinivalue_line("markers", "device: test runs kernels on an accelerator")
    config.addinivalue_line("markers", "requires_cuda: skip unless a CUDA device is usable (implies device)")
    config.addinivalue_line("markers", "requires_npu: skip unless an Ascend NPU (torch_npu) is usable (implies device)")
    config.addinivalue_line("markers", "requires_device: skip unless a CUDA or NPU device is usable (implies device)")


def pytest_report_header(config: pytest.Config) -> str:
    b = _BINDING
    return f"cann_ops_tilelang device binding: {b.reason if b else 'not run'}"


def pytest_itemcollected(item: pytest.Item) -> None:
    # Tests that demand a device run kernels on it: give them the `device` marker as each is collected, so that
    # every collection hook (memprofile's large_npu_mem, -m deselection) sees it.
    if item.get_closest_marker("device") is None and (
        any(item.get_closest_marker(m) for m in _REQUIRES)
        or any(f in getattr(item, "fixturenames", ()) for f in ("device", *_REQUIRES))
    ):
        item.add_marker("device")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for name in _REQUIRES:
        if item.get_closest_marker(name) is not None:
            reason = _skip_reason(name)
            if reason:
                pytest.skip(reason)


@pytest.fixture(name="requires_cuda")
def _requires_cuda_fixture() -> None:
    """Skip the requesting test unless a CUDA device is usable."""
    if reason := _skip_reason("requires_cuda"):
        pytest.skip(reason)


@pytest.fixture(name="requires_npu")
def _requires_npu_fixture() -> None:
    """Skip the requesting test unless an Ascend NPU is usable."""
    if reason := _skip_reason("requires_npu"):
        pytest.skip(reason)


@pytest.fixture(name="requires_device")
def _requires_device_fixture() -> None:
    """Skip the requesting test unless an accelerator is usable."""
    if reason := _skip_reason("requires_device"):
        pytest.skip(reason)


@pytest.fixture(name="device")
def _device_fixture():
    """The accelerator as a ``torch.device`` (``cuda:0``/``npu:0`` after binding); skips without one."""
    if reason := _skip_reason("requires_device"):
        pytest.skip(reason)
    return torch_device()
