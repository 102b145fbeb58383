"""The Engram gate forward and backward (docs/ops/engram.md#gate).

Ops: ``engram_gate_forward`` (out of place, optionally saving the statistics of the backward),
``engram_gate_forward_inplace`` (written into ``hidden_states``), ``engram_gate_backward``; the Python function
:func:`engram_gate_forward` chooses between the two forwards.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import _deprecated, config
from .._checks import OpError, check_bool, check_float, check_same_device, check_tensor
from .._library import declare
from ._common import BF16, F32, check_hc_hidden, check_mask

__all__ = ["engram_gate_backward", "engram_gate_forward", "engram_gate_forward_inplace"]

# the kernels access the bf16 rows and the fp32 fused weight in 16-byte vectors; the mask and the
# statistics one element at a time
_GATE_VECTORS = {"hidden_states": 16, "kv": 16, "weight_fused": 16}


def _check_forward(op: str, hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask) -> None:
    err = OpError(op)
    x = check_tensor(err, "hidden_states", hidden_states, dtype=BF16, ndim=3)
    tokens, m, hidden = x.shape
    check_hc_hidden(err, "hidden_states", m, hidden)
    kv_t = check_tensor(err, "kv", kv, dtype=BF16, shape=(tokens, m + 1, hidden))
    wf = check_tensor(err, "weight_fused", weight_fused, dtype=F32, shape=(m, hidden))
    check_float(err, "eps", eps, minimum=0.0)
    check_float(err, "clamp_value", clamp_value, minimum=0.0, inclusive=False)
    mask = check_mask(err, image_token_mask, tokens)
    check_same_device(err, [("hidden_states", x), ("kv", kv_t), ("weight_fused", wf), ("image_token_mask", mask)])


@declare("engram_gate_forward", vector_args=_GATE_VECTORS, tokens="hidden_states",
         outputs=("out", "dot", "gate_score", "rstd_x", "rstd_k"))
def _engram_gate_forward(
    hidden_states: Tensor,
    kv: Tensor,
    weight_fused: Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
    image_token_mask: Optional[Tensor] = None,
    residual: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Engram gate forward, out of place (the op behind :func:`engram_gate_forward`).

    Args: as :func:`engram_gate_forward` (without ``inplace``).

    Returns:
        ``(output, dot, gate_score, rstd_x, rstd_k)``: output ``(T, m, H)`` bf16; the four statistics
        ``(T, m)`` fp32 when saving, else empty ``(0,)`` fp32 tensors.
    """
    _check_forward("engram_gate_forward", hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask)
    check_bool(OpError("engram_gate_forward"), "save_for_backward", save_for_backward)
    check_bool(OpError("engram_gate_forward"), "residual", residual)
    out = hidden_states.new_empty(hidden_states.shape)
    stat_shape = hidden_states.shape[:2] if save_for_backward else (0,)
    stats = [hidden_states.new_empty(stat_shape, dtype=F32) for _ in range(4)]
    return out, stats[0], stats[1], stats[2], stats[3]


# its own binding: the kernel takes no save_for_backward; without it the statistics are None
@_engram_gate_forward.launch
def _(kernels, outs, hidden_states, kv, weight_fused, eps, clamp_value, save_for_backward, image_token_mask,
      residual):
    out, *stats = outs
    dot, gate_score, rstd_x, rstd_k = stats if save_for_backward else (None,) * 4
    kernels.engram_gate_forward(hidden_states=hidden_states, kv=kv, weight_fused=weight_fused,
                            image_token_mask=image_token_mask, eps=eps, clamp_value=clamp_value, out=out, dot=dot,
                            gate_score=gate_score, rstd_x=rstd_x, rstd_k=rstd_k, residual=residual)


@declare("engram_gate_forward_inplace", mutates_args=("hidden_states",), vector_args=_GATE_VECTORS,
         tokens="hidden_states", kernel="engram_gate_forward")
def engram_gate_forward_inplace(
    hidden_states: Tensor,
    kv: Tensor,
    weight_fused: Tensor,
    eps: float,
    clamp_value: float,
    image_token_mask: Optional[Tensor] = None,
) -> None:
    """Engram gate forward written into ``hidden_states`` (no statistics saved).

    Same arguments and math as :func:`engram_gate_forward`; the result is bitwise equal to its output.
    ``hidden_states`` must share no memory with ``kv`` or the other arguments.
    """
    _check_forward("engram_gate_forward_inplace", hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask)


# its own binding: hidden_states is also the kernel's out, and no statistics are written
@engram_gate_forward_inplace.launch
def _(kernels, _none, hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask):
    kernels.engram_gate_forward(hidden_states=hidden_states, kv=kv, weight_fused=weight_fused,
                            image_token_mask=image_token_mask, eps=eps, clamp_value=clamp_value, out=hidden_states,
                            dot=None, gate_score=None, rstd_x=None, rstd_k=None)


@declare("engram_gate_backward", vector_args={"grad_out": 16, **_GATE_VECTORS}, tokens="grad_out",
         outputs=("grad_hidden_states", "grad_kv", "grad_w_partial"))
def engram_gate_backward(
    grad_out: Tensor,
    hidden_states: Tensor,
    kv: Tensor,
    weight_fused: Tensor,
    dot: Tensor,
    gate_score: Tensor,
    rstd_x: Tensor,
    rstd_k: Tensor,
    clamp_value: float,
    image_token_mask: Optional[Tensor] = None,
    residual: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Engram gate backward.

    Args:
        grad_out: ``(T, m, H)`` bf16, the gradient of the forward's output.
        hidden_states: ``(T, m, H)`` bf16, kv ``(T, m + 1, H)`` bf16, weight_fused ``(m, H)`` fp32: the
            forward's inputs.
        dot, gate_score, rstd_x, rstd_k: ``(T, m)`` fp32 statistics saved by the forward.
        clamp_value: the forward's clamp (> 0).
        image_token_mask: ``(T,)`` bool or None, as in the forward (masked tokens: gradient passes through
            to ``hidden_states``, nothing to ``kv`` or the weight).
        residual: the forward's ``residual``: True, ``grad_hidden_states`` includes ``grad_out`` (the
            residual path); False (the forward wrote ``g * v`` alone), only the gate's term (masked tokens 0).

    Returns:
        ``(grad_hidden_states (T, m, H) bf16, grad_kv (T, m + 1, H) bf16, grad_w_partial (P, m, H) fp32)``;
        ``grad_w_partial`` holds per-worker partial sums of the gradient of ``weight_fused``, zeros for
        ``T = 0`` (``P`` is fixed per device type and ``(H, m)``: ``config.grad_w_partials``); reduce it
        with ``engram_grad_w_reduce``.
    """
    err = OpError("engram_gate_backward")
    go = check_tensor(err, "grad_out", grad_out, dtype=BF16, ndim=3)
    tokens, m, hidden = go.shape
    check_hc_hidden(err, "grad_out", m, hidden)
    x = check_tensor(err, "hidden_states", hidden_states, dtype=BF16, shape=(tokens, m, hidden))
    kv_t = check_tensor(err, "kv", kv, dtype=BF16, shape=(tokens, m + 1, hidden))
    wf = check_tensor(err, "weight_fused", weight_fused, dtype=F32, shape=(m, hidden))
    stats = [(arg, check_tensor(err, arg, value, dtype=F32, shape=(tokens, m)))
             for arg, value in (("dot", dot), ("gate_score", gate_score), ("rstd_x", rstd_x), ("rstd_k", rstd_k))]
    check_float(err, "clamp_value", clamp_value, minimum=0.0, inclusive=False)
    mask = check_mask(err, image_token_mask, tokens)
    check_bool(err, "residual", residual)
    check_same_device(err, [("grad_out", go), ("hidden_states", x), ("kv", kv_t), ("weight_fused", wf), *stats,
                            ("image_token_mask", mask)])
    partials = config.grad_w_partials(grad_out.device.type, hidden, m)
    return (grad_out.new_empty(grad_out.shape), kv.new_empty(kv.shape),
            weight_fused.new_empty((partials, *weight_fused.shape)))


def engram_gate_forward(
    hidden_states: Tensor,
    kv: Tensor,
    weight_fused: Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
    image_token_mask: Optional[Tensor] = None,
    inplace: bool = False,
    residual: bool = True,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Engram gate forward (docs/ops/engram.md#gate).

    Per token ``t`` and stream ``h``, with ``k = kv[t, h]``, ``v = kv[t, m]`` and sums over the hidden
    dim in fp32: ``raw = sum x*wf*k``, ``rstd_x = (sum x^2 / H + eps)^-1/2`` (``rstd_k`` alike),
    ``z = raw*rstd_x*rstd_k/sqrt(H)``, ``g = sigmoid(copysign(sqrt(max(|z|, clamp_value)), z))``,
    ``output = bf16(x + g*v)`` (``residual=False``: ``bf16(g*v)``). At exactly ``z = +0`` the signed sqrt
    is ``+sqrt(clamp_value)``.

    Args:
        hidden_states: ``(T, m, H)`` bf16, contiguous (``m == 4``; ``H`` a multiple of 256 in
            [512, 8192]; any ``T >= 0``).
        kv: ``(T, m + 1, H)`` bf16, contiguous; keys in rows ``0..m-1``, the value in row ``m``.
        weight_fused: ``(m, H)`` fp32 from :func:`engram_fused_weight`.
        eps: RMSNorm epsilon (>= 0, finite in fp32).
        clamp_value: signed-sqrt clamp (> 0, a normal fp32 number).
        save_for_backward: return the statistics needed by :func:`engram_gate_backward`.
        image_token_mask: ``(T,)`` bool or None. Masked tokens get ``output == hidden_states``
            bit-exactly (zeros when ``residual=False``) and zero statistics.
        inplace: write the output into ``hidden_states`` (and return it). Not allowed together
            with ``save_for_backward`` or ``residual=False``.
        residual: add ``hidden_states`` (True) or write the gated value ``g*v`` alone (False: one
            rounding of ``g*v``, so a caller needing ``g*v`` never subtracts ``x`` in bf16); the backward
            takes the same flag.

    Returns:
        ``(output, dot, gate_score, rstd_x, rstd_k)``: output ``(T, m, H)`` bf16 (a new tensor, or
        ``hidden_states`` when ``inplace``); the raw weighted dot, the gate and the two inverse RMS
        values, each ``(T, m)`` fp32, or four ``None`` when not saving. The output is bitwise the
        same whether statistics are saved or the op runs in place.
    """
    err = OpError("engram_gate_forward")
    check_bool(err, "inplace", inplace)
    check_bool(err, "save_for_backward", save_for_backward)
    check_bool(err, "residual", residual)
    if inplace:
        if not residual:
            raise err.value("inplace", "inplace=True cannot be combined with residual=False (the output g*v "
                                       "would overwrite hidden_states, which the gate reads)")
        if save_for_backward:
            raise err.value("inplace", "inplace=True cannot be combined with save_for_backward=True (the backward "
                                       "needs the original hidden_states)")
        engram_gate_forward_inplace(hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask)
        return hidden_states, None, None, None, None
    out, dot, gate_score, rstd_x, rstd_k = _engram_gate_forward(
        hidden_states, kv, weight_fused, eps, clamp_value, save_for_backward, image_token_mask, residual
    )
    if not save_for_backward:
        return out, None, None, None, None
    return out, dot, gate_score, rstd_x, rstd_k


engram_gate_forward.op = _engram_gate_forward.op

# DTensor sharding (docs/distributed.md): per token, weight_fused replicated; the weight-gradient partial
# rows are sums over each rank's tokens, so grad_w_partial is Partial (reduced by engram_grad_w_reduce).
_TOKEN_ARGS = ("hidden_states", "kv", "image_token_mask")
_engram_gate_forward.sharding({**dict.fromkeys(_TOKEN_ARGS, "S0"), "returns": ("S0",) * 5})
engram_gate_forward_inplace.sharding(dict.fromkeys(_TOKEN_ARGS, "S0"))
engram_gate_backward.sharding({**dict.fromkeys(("grad_out", "dot", "gate_score", "rstd_x", "rstd_k", *_TOKEN_ARGS),
                                               "S0"),
                          "returns": ("S0", "S0", "P")})

__getattr__ = _deprecated.module_getattr(__name__, globals())  # the names renamed in 0.2, for one release
