"""Environment detection, core counts and debug switches.

Everything here is lazy: importing this module (and so the package) touches no device and imports
neither TileLang nor torch_npu. Each query is computed on first use and cached.

Environment variables (all optional; see the README for the full table):

* ``OPS_TILELANG_DEBUG`` (bool, default off): log every op call on a device (op, backend, argument
  shapes and dtypes) at DEBUG level on the ``cann_ops_tilelang`` logger (no effect on results).
* ``OPS_TILELANG_NUM_SMS`` (int, default: the device's count): override the number of CUDA SMs used
  to size persistent grids.
* ``OPS_TILELANG_NUM_VEC_CORES`` (int, default: the NPU's count, else 64): override the number of
  Ascend vector cores used to size persistent grids.
"""

import functools
import importlib.util
import logging
import os

from .policy import grad_w_partials

__all__ = [
    "debug_enabled",
    "env_flag",
    "env_int",
    "grad_w_partials",
    "has_torch_npu",
    "npu_available",
    "cuda_available",
    "num_sms",
    "num_vec_cores",
    "supported_device_types",
]

logger = logging.getLogger("cann_ops_tilelang")

# `grad_w_partials` (rows of engram_gate_backward's weight-gradient partials per device type, fixed so that fakes
# need no device) is the device policy of policy.py, re-exported here.


def env_flag(name: str, default: bool = False) -> bool:
    """Reads a boolean environment variable (1/true/yes/on vs 0/false/no/off)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name} must be a boolean (1/0/true/false), got {raw!r}")


def env_int(name: str, default: int | None = None) -> int | None:
    """Reads a positive integer environment variable, or returns ``default`` when unset."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"environment variable {name} must be positive, got {value}")
    return value


@functools.cache
def debug_enabled() -> bool:
    """Whether ``OPS_TILELANG_DEBUG`` is on (read once, on first use)."""
    return env_flag("OPS_TILELANG_DEBUG")


@functools.cache
def has_torch_npu() -> bool:
    """Whether torch_npu is installed (found without importing it)."""
    return importlib.util.find_spec("torch_npu") is not None


def npu_available() -> bool:
    """Whether an Ascend NPU is usable. Imports torch_npu on first call (never at package import)."""
    if not has_torch_npu():
        return False
    try:
        import torch_npu  # noqa: F401
        import torch

        return bool(torch.npu.is_available())
    except Exception as exc:  # a broken CANN install must not break CPU/CUDA users
        logger.debug("torch_npu present but unusable: %s", exc)
        return False


def cuda_available() -> bool:
    """Whether a CUDA device is usable."""
    import torch

    return torch.cuda.is_available()


def supported_device_types() -> tuple[str, ...]:
    """Device types that have kernels in this package (the names users see)."""
    return ("cuda", "npu")


@functools.cache
def _cuda_sms(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device_index: int | None = None) -> int:
    """Number of streaming multiprocessors of a CUDA device (``OPS_TILELANG_NUM_SMS`` overrides)."""
    override = env_int("OPS_TILELANG_NUM_SMS")
    if override is not None:
        return override
    import torch

    index = torch.cuda.current_device() if device_index is None else device_index
    return _cuda_sms(index)


def num_vec_cores() -> int:
    """Number of Ascend vector cores available to the current stream.

    Prefers the current stream's core limit (what npugraph_ex captures with), then the device's
    count (or twice the cube cores); 64 (2 vector cores x 32 AI cores, Ascend 950) when torch_npu does
    not say. ``OPS_TILELANG_NUM_VEC_CORES`` overrides.
    """
    override = env_int("OPS_TILELANG_NUM_VEC_CORES")
    if override is not None:
        return override
    return _npu_vec_cores()


@functools.cache
def _npu_vec_cores() -> int:
    try:
        import torch
        import torch_npu  # noqa: F401

        npu = torch.npu
        for getter in ("get_stream_limit", "get_device_limit"):
            fn = getattr(npu, getter, None)
            if fn is None:
                continue
            try:
                limits = fn(npu.current_stream()) if getter == "get_stream_limit" else fn(npu.current_device())
            except Exception:
                continue
            cores = limits.get("vector_core_num") if isinstance(limits, dict) else None
            if cores:
                return int(cores)
        props = npu.get_device_properties(npu.current_device())
        cores = getattr(props, "vector_core_num", None) or 2 * getattr(props, "cube_core_num", 0)
        if cores:
            return int(cores)
    except Exception as exc:
        logger.debug("could not read the NPU vector core count: %s", exc)
    return 64
