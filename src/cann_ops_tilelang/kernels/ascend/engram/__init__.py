"""Ascend 950 kernels of the Engram gate family (OPS.md B.1), hc_mult = 4.

Uniform structure per op: ``<op>_key(...) -> tuple`` (compile-time parameters from metadata, never the
token count), ``get_<op>_kernel(*key)`` (lru-cached JIT compile for target ``ascend``, first compile
logged at INFO), ``build_<op>(*key) -> prim_func`` (token count is a dynamic dim) and the launcher
``<op>(...)`` (validated tensors in, pre-allocated outputs, current stream, no synchronization).
"""

from .fused_weight import build_engram_fused_weight, engram_fused_weight, engram_fused_weight_key, get_engram_fused_weight_kernel
from .gate_bwd import build_engram_gate_bwd, engram_gate_bwd, engram_gate_bwd_key, get_engram_gate_bwd_kernel
from .gate_fwd import build_engram_gate_fwd, engram_gate_fwd, engram_gate_fwd_key, get_engram_gate_fwd_kernel
from .grad_w_reduce import (
    build_engram_grad_w_reduce,
    engram_grad_w_reduce,
    engram_grad_w_reduce_key,
    get_engram_grad_w_reduce_kernel,
)

__all__ = [
    "build_engram_fused_weight",
    "build_engram_gate_bwd",
    "build_engram_gate_fwd",
    "build_engram_grad_w_reduce",
    "engram_fused_weight",
    "engram_fused_weight_key",
    "engram_gate_bwd",
    "engram_gate_bwd_key",
    "engram_gate_fwd",
    "engram_gate_fwd_key",
    "engram_grad_w_reduce",
    "engram_grad_w_reduce_key",
    "get_engram_fused_weight_kernel",
    "get_engram_gate_bwd_kernel",
    "get_engram_gate_fwd_kernel",
    "get_engram_grad_w_reduce_kernel",
    "lowering_cases",
]

# NOTE: defaults used only to build lowering cases on a machine without an NPU.
_CASE_NUM_CORES = 64
_CASE_NUM_PARTIALS = 16


def lowering_cases(hidden_size: int, hc_mult: int = 4, num_cores: int = _CASE_NUM_CORES, num_partials: int = _CASE_NUM_PARTIALS) -> dict:
    """Every kernel variant at ``hidden_size`` -> prim_func (for CPU lowering checks)."""
    H, m = hidden_size, hc_mult
    cases = {"fused_weight": build_engram_fused_weight(m * H, num_cores)}
    for save in (True, False):
        for mask in (False, True):
            name = f"gate_fwd_{'save' if save else 'nosave'}_{'mask' if mask else 'nomask'}"
            cases[name] = build_engram_gate_fwd(H, m, save, mask, False, num_cores)
    # in place only changes the masked path (no copy); in place never saves (OPS.md B.1.2)
    cases["gate_fwd_nosave_mask_inplace"] = build_engram_gate_fwd(H, m, False, True, True, num_cores)
    for mask in (False, True):
        cases[f"gate_bwd_{'mask' if mask else 'nomask'}"] = build_engram_gate_bwd(H, m, mask, num_partials, num_cores)
    cases["grad_w_reduce"] = build_engram_grad_w_reduce(num_partials, m * H, num_cores)
    return cases
