"""Registers the device-free PyTorch references as the CPU kernels of the custom ops.

The package has no CPU kernels: a CPU tensor normally gets a RuntimeError. For the CPU test tier
(opcheck, compile traces, autograd wrappers) every op gets a CPU kernel here that runs the op's own
prepare step (the same validation and allocation the device kernels use) and fills the outputs from
the reference. Tests that need the package's real CPU behaviour disable it with
``op.op.set_kernel_enabled("cpu", False)`` (see :func:`without_cpu_references`).
"""

import contextlib
import inspect
import sys
from pathlib import Path

_FAMILY_DIRS = ["engram", "mhc"]
_TESTS = Path(__file__).resolve().parent.parent
for family in _FAMILY_DIRS:
    path = str(_TESTS / family)
    if path not in sys.path:
        sys.path.insert(0, path)

import cann_ops_tilelang as ops  # noqa: E402
import mhc_ref  # noqa: E402
from engram_gate_ref import (  # noqa: E402
    fused_weight_ref,
    gate_bwd_ref,
    gate_fwd_inplace_ref,
    gate_fwd_ref,
    grad_w_reduce_ref,
)

_registered = False


def _copy_all(outputs, results):
    if isinstance(outputs, tuple):
        for out, res in zip(outputs, results):
            out.copy_(res)
    else:
        outputs.copy_(results)


def _gate_bwd(outputs, *args):
    res = gate_bwd_ref(*args, partials=outputs[2].shape[0])  # the partition the prepare step allocated
    _copy_all(outputs, res)


_KERNELS = {
    "engram_fused_weight": lambda outs, *a: _copy_all(outs, fused_weight_ref(*a)),
    "engram_gate_fwd": lambda outs, *a: _copy_all(outs, gate_fwd_ref(*a)),
    "engram_gate_fwd_inplace": lambda outs, *a: gate_fwd_inplace_ref(*a),
    "engram_gate_bwd": _gate_bwd,
    "engram_grad_w_reduce": lambda outs, *a: grad_w_reduce_ref(*a),
}

# mHC: ops that only write their buffer arguments run the reference as is; ops with new outputs get
# the reference's results copied into the outputs the prepare step allocated.
_MHC_IN_PLACE = [
    "expand_to_mhc_forward", "expand_to_mhc_backward", "mhc_fn_normw_merge_forward", "mhc_fn_normw_merge_backward",
    "mhc_reduce_partials_and_rmsnorm_forward", "mhc_reduce_partials_and_rmsnorm_backward",
    "mhc_pre_split_mixes_forward", "mhc_pre_split_mixes_backward", "mhc_sinkhorn_forward", "mhc_sinkhorn_backward",
    "mhc_pre_apply_mix_forward", "mhc_head_compute_mix_forward", "mhc_head_compute_mix_backward",
]
_MHC_RETURNING = [
    "mhc_gemm_with_sqrsum_forward", "mhc_gemm_with_sqrsum_backward", "mhc_pre_apply_mix_backward",
    "mhc_post_forward", "mhc_post_backward",
]
for _name in _MHC_IN_PLACE:
    _KERNELS[_name] = (lambda ref: lambda outs, *a: ref(*a))(getattr(mhc_ref, f"{_name}_ref"))
for _name in _MHC_RETURNING:
    _KERNELS[_name] = (lambda ref: lambda outs, *a: _copy_all(outs, ref(*a)))(getattr(mhc_ref, f"{_name}_ref"))
_KERNELS["mhc_post_forward_out"] = lambda outs, *a: a[-1].copy_(mhc_ref.mhc_post_forward_ref(*a[:-1]))


def register() -> None:
    """Registers every reference once per process."""
    global _registered
    if _registered:
        return
    declared = ops.registered_ops()
    missing = sorted(set(declared) - set(_KERNELS))
    if missing:
        raise RuntimeError(f"no CPU reference kernel for: {missing}")
    for name, compute in _KERNELS.items():
        public = declared[name]
        public.op.register_kernel("cpu", _positional(public, compute))
    _registered = True


def _positional(public, compute):
    """A CPU kernel: the op's prepare step (validation, allocation), then the reference; arguments
    are bound to the op's signature with defaults applied so references get them in order."""
    signature = inspect.signature(public.prepare)

    def kernel(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        outputs = public.prepare(*bound.args, **bound.kwargs)
        compute(outputs, *bound.args)
        return outputs

    return kernel


@contextlib.contextmanager
def without_cpu_references():
    """Disables the CPU reference kernels inside the block (the package's own CPU behaviour)."""
    with contextlib.ExitStack() as stack:
        for public in ops.registered_ops().values():
            stack.enter_context(public.op.set_kernel_enabled("cpu", False))
        yield


def pytest_configure(config):  # noqa: ARG001 - pytest hook signature
    register()
