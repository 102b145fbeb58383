"""CUDA kernels of the op module ``gate`` (docs/ops/engram.md#gate): ``engram_gate_fwd`` (also launched by
``engram_gate_fwd_inplace``) in :mod:`.forward`, ``engram_gate_bwd`` in :mod:`.backward` (its schedule plan
in :mod:`._plan`).

Supported sizes: ``limits.ENGRAM_HIDDEN`` and ``limits.ENGRAM_HC_MULT`` (a builder raises
``limits.LimitError`` outside them); any token count (a dynamic dimension of every kernel). Where the
backward cannot hold its weight-gradient accumulators in registers, even split over a 2-CTA cluster, it
keeps an ``m * H`` fp32 tile in shared memory: at most 124 KiB, at m = 4 and H = 7936.
"""

from ..... import config
from ._plan import BwdPlan, bwd_plan, num_partials
from .backward import build_engram_gate_bwd, engram_gate_bwd, engram_gate_bwd_key, get_engram_gate_bwd_kernel
from .forward import build_engram_gate_fwd, engram_gate_fwd, engram_gate_fwd_key, fwd_layout, get_engram_gate_fwd_kernel

__all__ = [
    "ARGUMENTS",
    "BwdPlan",
    "build_engram_gate_bwd",
    "build_engram_gate_fwd",
    "bwd_plan",
    "engram_gate_bwd",
    "engram_gate_bwd_key",
    "engram_gate_fwd",
    "engram_gate_fwd_key",
    "fwd_layout",
    "get_engram_gate_bwd_kernel",
    "get_engram_gate_fwd_kernel",
    "lowering_cases",
    "num_partials",
]

# kernel parameters named differently from the op argument they receive (the forward's; the backward's
# parameters carry the op's names)
ARGUMENTS = {"x": "hidden_states", "wf": "weight_fused", "mask": "image_token_mask", "clamp": "clamp_value"}


def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every kernel variant of the gate at ``hidden_size``, as un-compiled prim_funcs (for the CPU build tests).

    Cases: ``engram_gate_fwd_{mask,nomask}``, ``engram_gate_fwd_mask_inplace`` (the CUDA forward always writes
    the statistics, see :func:`engram_gate_fwd`: the Ascend backend's ``save``/``nosave`` part is absent),
    ``engram_gate_bwd_{mask,nomask}`` plus ``engram_gate_bwd_pipelined_{mask,nomask}`` where the backward
    has that variant, the backward at the CUDA partial count ``P`` of ``config.grad_w_partials``; the same
    without the residual (``residual=False``) as ``engram_gate_{fwd,bwd}_noresidual_*`` (no in-place one).

    Returns:
        ``{case name: T.prim_func}``.
    """
    H, m = hidden_size, hc_mult
    partials = config.grad_w_partials("cuda", H, m)
    cases = {}
    for mask in (False, True):
        cases[f"engram_gate_fwd_{'mask' if mask else 'nomask'}"] = build_engram_gate_fwd(H, m, mask, False)
    cases["engram_gate_fwd_mask_inplace"] = build_engram_gate_fwd(H, m, True, True)
    for mask in (False, True):
        cases[f"engram_gate_bwd_{'mask' if mask else 'nomask'}"] = build_engram_gate_bwd(H, m, partials, mask)
        if bwd_plan(H, m).pipe:
            cases[f"engram_gate_bwd_pipelined_{'mask' if mask else 'nomask'}"] = build_engram_gate_bwd(
                H, m, partials, mask, pipelined=True
            )
    for mask in (False, True):
        tag = "mask" if mask else "nomask"
        cases[f"engram_gate_fwd_noresidual_{tag}"] = build_engram_gate_fwd(H, m, mask, False, residual=False)
        cases[f"engram_gate_bwd_noresidual_{tag}"] = build_engram_gate_bwd(H, m, partials, mask, residual=False)
        if bwd_plan(H, m).pipe:
            cases[f"engram_gate_bwd_noresidual_pipelined_{tag}"] = build_engram_gate_bwd(
                H, m, partials, mask, pipelined=True, residual=False
            )
    return cases
