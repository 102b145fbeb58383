"""Differentiable Engram gate (docs/ops/engram.md#modeling) built from the four Engram primitives.

Forward: ``engram_fused_weight`` then ``engram_gate_forward(save_for_backward=True)``. Backward:
``engram_gate_backward`` then ``engram_grad_w_reduce`` into the weights' fp32 gradient buffers: a
Megatron-style ``main_grad`` attribute when the parameter has one (eager mode; the weight then gets
no ``.grad``), else fresh zeros returned as the gradient.

Every argument is checked under the caller's names before any internal tensor (the fused weight, the flat
token views) is built. DTensors whose sharding does not flatten into a ``Shard(0)`` of the tokens (a ``kv``
sharded on its last dim, uneven or non-first leading dims) are gathered on those mesh dims first and the output
sliced back to ``hidden_states``' placements (:func:`._buffers.flat_tokens`, docs/distributed.md).
"""

from typing import Optional

import torch
from torch import Tensor, nn

from .. import limits
from .._checks import OpError, check_bool, check_float, check_int, describe
from ..engram import engram_fused_weight, engram_gate_backward, engram_gate_forward, engram_grad_w_reduce
from ._buffers import (check_device, check_main_grads, flat_tokens, grad_buffers, honoured_main_grad, reduced,
                       restore)

__all__ = ["EngramGate", "engram_gate"]

_OP = "modeling.engram_gate"
_BF16 = torch.bfloat16


def _check_call(err: OpError, hidden_states, kv, weight_hidden, weight_embed, clamp_value, eps, image_token_mask,
                residual) -> tuple[tuple, int, int, float, float, bool]:
    """Every argument of :func:`engram_gate` under its own name, before anything is built from it (a wrong shape
    with the right element count must not be reinterpreted, and a wrong weight must not be reported as the fused
    weight made from it). Returns the leading dims, ``m``, ``H`` and the scalars as Python numbers."""
    if not isinstance(hidden_states, Tensor):
        raise err.type("hidden_states", f"expected a torch.Tensor, got {describe(hidden_states)}")
    if hidden_states.dtype != _BF16:
        raise err.type("hidden_states", f"expected torch.bfloat16, got {hidden_states.dtype}")
    shape = tuple(hidden_states.shape)
    if hidden_states.dim() < 2:
        raise err.value("hidden_states", f"expected shape (*, m, H): m = hc_mult hidden streams (those of the mHC "
                                         f"residual) of H, got shape {shape}")
    lead, (m, hidden) = shape[:-2], shape[-2:]
    if not torch.compiler.is_compiling():  # traced: the ops check the sizes (Dynamo cannot trace the ranges)
        if m not in limits.ENGRAM_HC_MULT:
            raise err.value("hidden_states", f"expected shape (*, m, H) with m = hc_mult = "
                                             f"{limits.ENGRAM_HC_MULT.describe()} hidden streams (those of the mHC "
                                             f"residual) in dim -2, got shape {shape} (m = {m}); a hidden state "
                                             f"without streams (*, H) needs them made first, e.g. "
                                             f"modeling.expand_from_embedding")
        if hidden not in limits.ENGRAM_HIDDEN:
            raise err.value("hidden_states", f"expected shape (*, m, H) with H {limits.ENGRAM_HIDDEN.what} "
                                             f"{limits.ENGRAM_HIDDEN.describe()}, got shape {shape} (H = {hidden})")
    if not isinstance(kv, Tensor):
        raise err.type("kv", f"expected a torch.Tensor, got {describe(kv)}")
    if kv.dtype != _BF16:
        raise err.type("kv", f"expected torch.bfloat16, got {kv.dtype}")
    want = lead + ((m + 1) * hidden,)
    if tuple(kv.shape) != want:
        hint = " (a (*, m + 1, H) kv: pass kv.flatten(-2))" if tuple(kv.shape) == lead + (m + 1, hidden) else ""
        raise err.value("kv", f"expected shape {want}, i.e. (*, (m + 1)·H): per token the m = {m} keys then the "
                              f"value, flat, with the leading dims of hidden_states {shape}; got "
                              f"{tuple(kv.shape)}{hint}")
    for arg, weight in (("weight_hidden", weight_hidden), ("weight_embed", weight_embed)):
        if not isinstance(weight, Tensor):
            raise err.type(arg, f"expected a torch.Tensor (an (m, H) bf16 RMSNorm weight), got "
                                f"{describe(weight)}")
        if weight.dtype != _BF16:
            raise err.type(arg, f"expected torch.bfloat16, got {weight.dtype}")
        if tuple(weight.shape) != (m, hidden):
            raise err.value(arg, f"expected shape {(m, hidden)} (m, H of hidden_states {shape}), got "
                                 f"{tuple(weight.shape)}")
        if not weight.is_contiguous():
            raise err.value(arg, f"expected a contiguous tensor, got strides {tuple(weight.stride())}")
    if image_token_mask is not None:
        if not isinstance(image_token_mask, Tensor):
            raise err.type("image_token_mask", f"expected a torch.Tensor or None, got "
                                               f"{describe(image_token_mask)}")
        if image_token_mask.dtype != torch.bool:
            raise err.type("image_token_mask", f"expected torch.bool, got {image_token_mask.dtype}")
        if tuple(image_token_mask.shape) != lead:
            raise err.value("image_token_mask", f"expected shape {lead} (the leading dims of hidden_states {shape}), "
                                                f"got {tuple(image_token_mask.shape)}")
    for arg, value in (("kv", kv), ("weight_hidden", weight_hidden), ("weight_embed", weight_embed),
                       ("image_token_mask", image_token_mask)):
        if value is not None and value.device != hidden_states.device:
            raise err.value(arg, f"expected a tensor on {hidden_states.device} (hidden_states'), got {value.device}")
    if not torch.compiler.is_compiling():  # traced: the ops check the scalars (Dynamo cannot trace the fp32 test)
        clamp_value = check_float(err, "clamp_value", clamp_value, minimum=0.0, inclusive=False)
        eps = check_float(err, "eps", eps, minimum=0.0)
    residual = check_bool(err, "residual", residual)
    return lead, m, hidden, clamp_value, eps, residual


class _EngramGateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, kv, weight_hidden, weight_embed, clamp_value, eps, image_token_mask,
                main_grad_hidden, main_grad_embed, residual=True):
        weight_fused = engram_fused_weight(weight_hidden, weight_embed)
        out, dot, gate_score, rstd_x, rstd_k = engram_gate_forward(
            hidden_states, kv, weight_fused, eps, clamp_value, True, image_token_mask, residual=residual
        )
        ctx.save_for_backward(hidden_states, kv, weight_hidden, weight_embed, weight_fused, dot, gate_score,
                              rstd_x, rstd_k, image_token_mask)
        ctx.clamp_value = clamp_value
        ctx.residual = residual
        ctx.main_grads = (main_grad_hidden, main_grad_embed)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, kv, wh, we, wf, dot, gate_score, rstd_x, rstd_k, mask = ctx.saved_tensors
        grad_x, grad_kv, grad_w_partial = engram_gate_backward(
            grad_out.contiguous(), x, kv, wf, dot, gate_score, rstd_x, rstd_k, ctx.clamp_value, mask, ctx.residual
        )
        main_hidden, main_embed = ctx.main_grads
        grad_wh, grad_we = grad_buffers(x, (wh, we), ctx.main_grads)
        engram_grad_w_reduce(grad_w_partial, wh, we, grad_wh, grad_we)
        return (
            grad_x,
            grad_kv,
            None if main_hidden is not None else reduced(grad_wh, wh.dtype),
            None if main_embed is not None else reduced(grad_we, we.dtype),
            None, None, None, None, None, None,
        )


def engram_gate(
    hidden_states: Tensor,
    kv: Tensor,
    weight_hidden: Tensor,
    weight_embed: Tensor,
    clamp_value: float = 1e-6,
    eps: float = 1e-6,
    image_token_mask: Optional[Tensor] = None,
    residual: bool = True,
) -> Tensor:
    """Engram gate with autograd: ``x + sigmoid(signed_sqrt(<RMSNorm(x; wh), RMSNorm(k; we)> / sqrt(H))) * v``.

    The gate works on the ``m`` hidden streams of a multi-stream (mHC) residual: ``m = hc_mult``, and 4 is the only
    value with kernels (``limits.ENGRAM_HC_MULT``). Each stream ``h`` has its own key ``k_h``; the one value ``v``
    is shared. It has no single-stream mode: a plain ``(B, S, H)`` hidden state is refused (its ``S`` would be
    read as ``m``); make the streams first, e.g. ``modeling.expand_from_embedding(x)`` (``m`` copies).

    Unlike the op ``engram_gate_forward``, which takes ``(T, m, H)`` and ``kv (T, m + 1, H)``, the leading dims are
    free and ``kv`` is flat per token (what one projection of width ``(m + 1)·H`` gives):

    Args:
        hidden_states: ``(*, m, H)`` bf16, ``m == 4`` streams, ``H`` a multiple of 256 in [512, 8192].
        kv: ``(*, (m + 1)·H)`` bf16 with the leading dims of ``hidden_states``: per token the ``m`` keys, then
            the value, flat (a ``(*, m + 1, H)`` tensor: pass ``kv.flatten(-2)``).
        weight_hidden: ``(m, H)`` bf16 parameter (RMSNorm weight of the hidden streams).
        weight_embed: ``(m, H)`` bf16 parameter (RMSNorm weight of the keys).
        clamp_value: signed-sqrt clamp (> 0; a Python or numpy number).
        eps: RMSNorm epsilon (>= 0; the production value is not published; expose it).
        image_token_mask: ``(*)`` bool or None; True tokens pass through unchanged.
        residual: a bool: add ``hidden_states`` (True) or return the gated value ``g*v`` alone (False; masked
            tokens 0), both from one kernel and one rounding.

    Returns:
        ``(*, m, H)`` bf16. Gradients flow to ``hidden_states``, ``kv`` and both weights; a weight
        with an fp32 ``main_grad`` attribute gets its gradient accumulated there (eager mode only; the two
        buffers must not overlap each other, a weight or an input; a DTensor weight's is a replicated DTensor).

    Raises:
        TypeError, ValueError: naming ``modeling.engram_gate`` and the argument, before anything runs.
    """
    err = OpError(_OP)
    lead, m, hidden, clamp_value, eps, residual = _check_call(
        err, hidden_states, kv, weight_hidden, weight_embed, clamp_value, eps, image_token_mask, residual)
    mains = (None, None)
    if torch.is_grad_enabled():
        weights = (("weight_hidden", weight_hidden), ("weight_embed", weight_embed))
        mains = tuple(honoured_main_grad(w, _OP, name) for name, w in weights)
        check_main_grads(_OP, weights, mains, (("hidden_states", hidden_states), ("kv", kv)))
    # only now the internal tensors: flat token views (DTensors gathered where they do not flatten; whole rows:
    # kv is split into m + 1 rows of H per token)
    x, back = flat_tokens(hidden_states, lead, m, hidden, whole_rows=True)
    kv3, _ = flat_tokens(kv, lead, m + 1, hidden, whole_rows=True)
    mask, _ = flat_tokens(image_token_mask, lead, whole_rows=True)
    out = _EngramGateFunction.apply(
        x, kv3, weight_hidden, weight_embed, clamp_value, eps, mask, *mains, residual,
    )
    return restore(out.view(*lead, m, hidden), back)


def check_gate_config(err: OpError, hidden_size: int, hc_mult: int, clamp_value: float, eps: float, dtype,
                      eps_arg: str = "eps") -> tuple[int, int, float, float]:
    """A gate module's configuration, refused at construction where the gate op would refuse it at its first
    call (``eps_arg``: the caller's name of the RMSNorm epsilon). Returns ``hidden_size``, ``hc_mult``,
    ``clamp_value`` and ``eps`` as Python numbers (numpy scalars are taken as the ops take them)."""
    hidden_size = limits.ENGRAM_HIDDEN.check(err, "hidden_size", check_int(err, "hidden_size", hidden_size))
    hc_mult = limits.ENGRAM_HC_MULT.check(err, "hc_mult", check_int(err, "hc_mult", hc_mult))
    if dtype != torch.bfloat16:
        raise err.type("dtype", f"expected torch.bfloat16 (the gate's dtype), got {dtype}")
    clamp_value = check_float(err, "clamp_value", clamp_value, minimum=0.0, inclusive=False)
    return hidden_size, hc_mult, clamp_value, check_float(err, eps_arg, eps, minimum=0.0)


def check_gate_inputs(op: str, hidden_states: object, kv: object, hc_mult: int, hidden_size: int) -> None:
    """A module's ``hidden_states (*, m, H)`` and ``kv (*, (m + 1)·H)`` against its own ``hc_mult`` and
    ``hidden_size``, named by the module (the rest is checked by :func:`engram_gate`)."""
    err, m, hidden = OpError(op), hc_mult, hidden_size
    if isinstance(hidden_states, Tensor) and hidden_states.dim() >= 2 and \
            tuple(hidden_states.shape[-2:]) != (m, hidden):
        got_m, got_h = hidden_states.shape[-2:]
        hint = "; a hidden state without streams (*, H) needs them made first, e.g. modeling.expand_from_embedding"
        raise err.value("hidden_states", f"expected shape (*, {m}, {hidden}): the module's hc_mult = {m} hidden "
                                         f"streams of its hidden size {hidden}, got shape "
                                         f"{tuple(hidden_states.shape)} ({got_m} streams of hidden size {got_h})"
                                         f"{hint if got_m != m else ''}")
    if isinstance(kv, Tensor) and kv.dim() >= 1 and kv.shape[-1] != (m + 1) * hidden:
        hint = " (a (*, m + 1, H) kv: pass kv.flatten(-2))" if tuple(kv.shape[-2:]) == (m + 1, hidden) else ""
        raise err.value("kv", f"expected shape (*, {(m + 1) * hidden}): per token the module's {m} keys then the "
                              f"value of its hidden size {hidden}, flat ((hc_mult + 1)·hidden_size), got shape "
                              f"{tuple(kv.shape)}{hint}")


class EngramGate(nn.Module):
    """Holds the two ``(m, H)`` bf16 RMSNorm weights of an Engram gate (initialized to ones) and calls
    :func:`engram_gate` with them.

    ``m`` is ``hc_mult``: the number of hidden streams of the multi-stream (mHC) residual the gate adds to, 4 (the
    only value with kernels). The input is ``hidden_states (*, m, H)``, not a plain ``(*, H)`` hidden state (make
    the streams first, e.g. ``modeling.expand_from_embedding``), and ``kv (*, (m + 1)·H)``: per token the ``m``
    keys then the value, flat (the op ``engram_gate_forward`` takes them ``(T, m + 1, H)``; this module flattens the
    leading dims itself).

    Args:
        hidden_size: ``H`` (a multiple of 256 in [512, 8192]).
        hc_mult: number of residual streams ``m`` (4).
        clamp_value: signed-sqrt clamp (1e-6).
        eps: RMSNorm epsilon (1e-6).
        device, dtype: of the weights (bf16, the gate's dtype).

    Numbers may be numpy scalars (kept as Python numbers). An input whose ``(m, H)`` is not the module's is
    refused naming ``modeling.EngramGate``; other errors name :func:`engram_gate`.
    """

    def __init__(self, hidden_size: int, hc_mult: int = 4, clamp_value: float = 1e-6, eps: float = 1e-6,
                 device=None, dtype=torch.bfloat16):
        super().__init__()
        err = OpError("modeling.EngramGate")
        hidden_size, hc_mult, clamp_value, eps = check_gate_config(err, hidden_size, hc_mult, clamp_value, eps, dtype)
        device = check_device(err, device)
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.clamp_value = clamp_value
        self.eps = eps
        self.weight_hidden = nn.Parameter(torch.ones(hc_mult, hidden_size, device=device, dtype=dtype))
        self.weight_embed = nn.Parameter(torch.ones(hc_mult, hidden_size, device=device, dtype=dtype))

    def forward(self, hidden_states: Tensor, kv: Tensor, image_token_mask: Optional[Tensor] = None) -> Tensor:
        """``hidden_states (*, m, H)`` bf16, ``kv (*, (m + 1)·H)`` bf16 → ``(*, m, H)`` bf16 (``m``, ``H``: the
        module's ``hc_mult`` and ``hidden_size``)."""
        check_gate_inputs("modeling.EngramGate", hidden_states, kv, self.hc_mult, self.hidden_size)
        return engram_gate(hidden_states, kv, self.weight_hidden, self.weight_embed, self.clamp_value, self.eps,
                           image_token_mask)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, hc_mult={self.hc_mult}, clamp_value={self.clamp_value}, eps={self.eps}"
