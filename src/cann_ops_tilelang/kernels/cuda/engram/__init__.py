"""CUDA (TileLang) kernels of the Engram gate family.

Launch pattern (uniform across the four kernels): ``<op>_key(...)`` computes the compile-time key from
tensor metadata and flags (never the token count, which is a dynamic dimension of the kernels);
``get_<op>_kernel(*key)`` (``functools.lru_cache``) compiles ``build_<op>(*key)`` once and logs it;
``<op>(...)`` launches on the current torch stream into caller-allocated outputs. The backward's key holds
two kernels where its split schedule has a token-pipelined variant (both compiled with the key; the
launcher picks one by tokens per worker, see :mod:`.gate_bwd`).

Supported sizes: ``H % 256 == 0`` and ``512 <= H <= 8192`` (where the backward cannot hold its weight-gradient
accumulators in registers, even split over a 2-CTA cluster, it keeps an ``m * H`` fp32 tile in shared memory:
at most 124 KiB, at m = 4 and H = 7936); any token count; ``m = 4`` (other ``m`` build too, untuned).
"""

from .fused_weight import build_engram_fused_weight, engram_fused_weight, engram_fused_weight_key, get_engram_fused_weight_kernel
from .gate_bwd import bwd_plan, build_engram_gate_bwd, engram_gate_bwd, engram_gate_bwd_key, get_engram_gate_bwd_kernel
from .gate_fwd import build_engram_gate_fwd, engram_gate_fwd, engram_gate_fwd_key, get_engram_gate_fwd_kernel
from .grad_w_reduce import (
    VECTOR_MAX_PARTIALS,
    VECTOR_UPDATE_WIDTHS,
    build_engram_grad_w_reduce,
    engram_grad_w_reduce,
    engram_grad_w_reduce_key,
    get_engram_grad_w_reduce_kernel,
)

__all__ = [
    "LAUNCHER_CHECKED",
    "VECTOR_MAX_PARTIALS",
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

# lowering cases whose launcher checks the alignment of some op arguments itself, launching another kernel
# where one is not aligned: {case: {argument: bytes}} (these need not be declared in the op's vector_args)
LAUNCHER_CHECKED = {"grad_w_reduce_vector": dict(VECTOR_UPDATE_WIDTHS)}


def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every kernel variant at ``hidden_size``, as un-compiled prim_funcs (for the CPU build tests).

    Case names: ``fused_weight``, ``gate_fwd_{mask,nomask}``, ``gate_fwd_mask_inplace``,
    ``gate_bwd_{mask,nomask}`` (plus ``gate_bwd_pipelined_{mask,nomask}`` where the backward has that
    variant), ``grad_w_reduce`` and ``grad_w_reduce_vector``, the Ascend backend's names without its
    ``save``/``nosave`` part (the CUDA forward always writes the statistics, see
    :func:`engram_gate_fwd`); the backward and the TMA reduction at the CUDA partial count ``P`` of
    ``config.grad_w_partials``, the vector reduction (aligned buffers) at ``min(P, VECTOR_MAX_PARTIALS)``.

    Returns:
        ``{case name: T.prim_func}``.
    """
    from ....config import grad_w_partials

    H, m = hidden_size, hc_mult
    num_partials = grad_w_partials("cuda", H, m)
    cases = {"fused_weight": build_engram_fused_weight(m * H)}
    for mask in (False, True):
        cases[f"gate_fwd_{'mask' if mask else 'nomask'}"] = build_engram_gate_fwd(H, m, mask, False)
    cases["gate_fwd_mask_inplace"] = build_engram_gate_fwd(H, m, True, True)
    for mask in (False, True):
        cases[f"gate_bwd_{'mask' if mask else 'nomask'}"] = build_engram_gate_bwd(H, m, num_partials, mask)
        if bwd_plan(H, m)["pipe"]:
            cases[f"gate_bwd_pipelined_{'mask' if mask else 'nomask'}"] = build_engram_gate_bwd(
                H, m, num_partials, mask, pipelined=True
            )
    cases["grad_w_reduce"] = build_engram_grad_w_reduce(H, m, num_partials)
    vector_partials = min(num_partials, VECTOR_MAX_PARTIALS)
    cases["grad_w_reduce_vector"] = build_engram_grad_w_reduce(H, m, vector_partials, vector=True)
    return cases
