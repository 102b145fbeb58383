"""The Engram gate operators (OPS.md §B.1) as ``cann_ops_tilelang::*`` custom ops.

Ops: ``engram_fused_weight``, ``engram_gate_fwd`` (plus the in-place variant
``engram_gate_fwd_inplace``), ``engram_gate_bwd``, ``engram_grad_w_reduce``. Kernels: CUDA
(``kernels/cuda/engram``) and Ascend 950 (``kernels/ascend/engram``).
"""

from typing import Optional

from torch import Tensor

from .._library import declare
from ..fakes import engram as fakes
from .validation import check_engram_gate_fwd

__all__ = [
    "engram_fused_weight",
    "engram_gate_bwd",
    "engram_gate_fwd",
    "engram_gate_fwd_inplace",
    "engram_grad_w_reduce",
]

_FAMILY = "engram"

# vector_args: the arguments the kernels access in 16-byte vectors (bf16 rows, fp32 weights; in the weight-
# gradient reduction the partials); masks and statistics are read per element, and so are the reduction's
# weights and fp32 gradient buffers unless its launcher finds them aligned for its vector kernel
_GATE_VECTORS = {"hidden_states": 16, "kv": 16, "weight_fused": 16}

engram_fused_weight = declare(
    "engram_fused_weight", family=_FAMILY, vector_args={"weight_hidden": 16, "weight_embed": 16}
)(fakes.engram_fused_weight)


@engram_fused_weight.launch
def _(kernels, out, weight_hidden, weight_embed):
    if out.numel():
        kernels.engram_fused_weight(weight_hidden, weight_embed, out)


_engram_gate_fwd = declare("engram_gate_fwd", family=_FAMILY, vector_args=_GATE_VECTORS)(fakes.engram_gate_fwd)


@_engram_gate_fwd.launch
def _(kernels, outs, hidden_states, kv, weight_fused, eps, clamp_value, save_for_backward, image_token_mask):
    out, *stats = outs
    if hidden_states.shape[0] == 0:
        return
    dot, gate_score, rstd_x, rstd_k = stats if save_for_backward else (None,) * 4
    kernels.engram_gate_fwd(
        hidden_states, kv, weight_fused, image_token_mask, eps, clamp_value, out, dot, gate_score, rstd_x, rstd_k
    )


engram_gate_fwd_inplace = declare(
    "engram_gate_fwd_inplace", family=_FAMILY, mutates_args=("hidden_states",), vector_args=_GATE_VECTORS
)(fakes.engram_gate_fwd_inplace)


@engram_gate_fwd_inplace.launch
def _(kernels, _none, hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask):
    if hidden_states.shape[0] == 0:
        return
    kernels.engram_gate_fwd(
        hidden_states, kv, weight_fused, image_token_mask, eps, clamp_value, hidden_states, None, None, None, None
    )


engram_gate_bwd = declare(
    "engram_gate_bwd", family=_FAMILY, vector_args={"grad_out": 16, **_GATE_VECTORS}
)(fakes.engram_gate_bwd)


@engram_gate_bwd.launch
def _(kernels, outs, grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value,
      image_token_mask):
    grad_x, grad_kv, grad_w_partial = outs
    if grad_out.shape[0] == 0:
        # No tokens: the partials are still a defined zero gradient.
        grad_w_partial.zero_()
        return
    kernels.engram_gate_bwd(
        grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, image_token_mask, clamp_value,
        grad_x, grad_kv, grad_w_partial,
    )


engram_grad_w_reduce = declare(
    "engram_grad_w_reduce", family=_FAMILY, mutates_args=("grad_weight_hidden", "grad_weight_embed"),
    vector_args={"grad_w_partial": 16},
)(fakes.engram_grad_w_reduce)


@engram_grad_w_reduce.launch
def _(kernels, _none, grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed):
    if grad_w_partial.shape[0] == 0:
        return
    kernels.engram_grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)


def engram_gate_fwd(
    hidden_states: Tensor,
    kv: Tensor,
    weight_fused: Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
    image_token_mask: Optional[Tensor] = None,
    inplace: bool = False,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Engram gate forward (OPS.md B.1.2).

    Per token ``t`` and stream ``h``, with ``k = kv[t, h]``, ``v = kv[t, m]`` and sums over the hidden
    dim in fp32: ``raw = sum x*wf*k``, ``rstd_x = (sum x^2 / H + eps)^-1/2`` (``rstd_k`` alike),
    ``z = raw*rstd_x*rstd_k/sqrt(H)``, ``g = sigmoid(copysign(sqrt(max(|z|, clamp_value)), z))``,
    ``output = bf16(x + g*v)``. At exactly ``z = +0`` the signed sqrt is ``+sqrt(clamp_value)``
    (copysign, as the kernels compute it).

    Args:
        hidden_states: ``(T, m, H)`` bf16, contiguous (``m == 4``; ``H`` a multiple of 256 in
            [512, 8192]; any ``T >= 0``).
        kv: ``(T, m + 1, H)`` bf16, contiguous; keys in rows ``0..m-1``, the value in row ``m``.
        weight_fused: ``(m, H)`` fp32 from :func:`engram_fused_weight`.
        eps: RMSNorm epsilon (>= 0).
        clamp_value: signed-sqrt clamp (> 0).
        save_for_backward: return the statistics needed by :func:`engram_gate_bwd`.
        image_token_mask: ``(T,)`` bool or None. Masked tokens get ``output == hidden_states``
            bit-exactly and zero statistics.
        inplace: write the output into ``hidden_states`` (and return it). Not allowed together
            with ``save_for_backward``.

    Returns:
        ``(output, dot, gate_score, rstd_x, rstd_k)``: output ``(T, m, H)`` bf16 (a new tensor, or
        ``hidden_states`` when ``inplace``); the raw weighted dot, the gate and the two inverse RMS
        values, each ``(T, m)`` fp32, or four ``None`` when not saving. The output is bitwise the
        same whether statistics are saved or the op runs in place.
    """
    if inplace:
        if save_for_backward:
            # The combination is an argument error; the op's validation names it.
            check_engram_gate_fwd(
                hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask,
                save_for_backward=True, inplace=True,
            )
        engram_gate_fwd_inplace(hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask)
        return hidden_states, None, None, None, None
    out, dot, gate_score, rstd_x, rstd_k = _engram_gate_fwd(
        hidden_states, kv, weight_fused, eps, clamp_value, save_for_backward, image_token_mask
    )
    if not save_for_backward:
        return out, None, None, None, None
    return out, dot, gate_score, rstd_x, rstd_k
