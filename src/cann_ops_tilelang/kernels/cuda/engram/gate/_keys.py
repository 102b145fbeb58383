"""The compile-time keys of the gate's kernels (:mod:`.forward`, :mod:`.backward`) and their lowering cases."""

from .....policy import bwd_plan, grad_w_partials
from ...._kernel import compile_key, public_names


@compile_key
class FwdKey:
    """Compile-time key of the forward (never the token count; saving the statistics or not is the same kernel,
    see :func:`.forward.engram_gate_forward`)."""

    hidden_size: int
    hc_mult: int
    has_mask: bool
    inplace: bool
    residual: bool = True


@compile_key
class BwdKey:
    """Compile-time key of the backward (never the token count): ``num_partials`` is ``P``, the workers."""

    hidden_size: int
    hc_mult: int
    num_partials: int
    has_mask: bool
    residual: bool = True


def forward_cases(hidden_size: int, hc_mult: int) -> dict:
    """``engram_gate_forward_{mask,nomask}``, ``engram_gate_forward_mask_inplace`` (the CUDA forward always writes the
    statistics: the Ascend backend's ``save``/``nosave`` part is absent) and the same without the residual as
    ``engram_gate_forward_noresidual_{mask,nomask}`` (no in-place one)."""
    cases = {}
    for residual, infix in ((True, ""), (False, "noresidual_")):
        for mask in (False, True):
            cases[f"engram_gate_forward_{infix}{'mask' if mask else 'nomask'}"] = FwdKey(
                hidden_size, hc_mult, mask, False, residual)
    cases["engram_gate_forward_mask_inplace"] = FwdKey(hidden_size, hc_mult, True, True)
    return cases


def backward_cases(pipelined: bool):
    """``engram_gate_backward[_noresidual][_pipelined]_{mask,nomask}`` at the CUDA partial count ``P`` of
    ``policy.grad_w_partials`` (the pipelined ones where the schedule has that variant)."""

    def cases(hidden_size: int, hc_mult: int) -> dict:
        if pipelined and not bwd_plan(hidden_size, hc_mult).pipe:
            return {}
        partials, tag = grad_w_partials("cuda", hidden_size, hc_mult), "pipelined_" if pipelined else ""
        return {f"engram_gate_backward_{infix}{tag}{mask}":
                BwdKey(hidden_size, hc_mult, partials, mask == "mask", residual)
                for residual, infix in ((True, ""), (False, "noresidual_")) for mask in ("nomask", "mask")}

    return cases


__all__ = public_names(__name__)
