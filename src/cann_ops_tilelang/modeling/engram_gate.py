"""Differentiable Engram gate (docs/ops/engram.md#modeling) built from the four Engram primitives.

Forward: ``engram_fused_weight`` then ``engram_gate_fwd(save_for_backward=True)``. Backward:
``engram_gate_bwd`` then ``engram_grad_w_reduce`` into the weights' fp32 gradient buffers: a
Megatron-style ``main_grad`` attribute when the parameter has one (eager mode; the weight then gets
no ``.grad``), else fresh zeros returned as the gradient.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from .. import limits
from .._checks import OpError, check_float, check_int
from ..engram import engram_fused_weight, engram_gate_bwd, engram_gate_fwd, engram_grad_w_reduce
from ._buffers import grad_buffers, reduced

__all__ = ["EngramGate", "engram_gate"]

_OP = "modeling.engram_gate"


def _main_grad(weight: Tensor) -> Optional[Tensor]:
    # main_grad is a Python attribute: only honoured in eager mode (a compiled graph sees tensors only), and only
    # where the weight requires a gradient (a frozen one gets none, there either).
    if torch.compiler.is_compiling() or not weight.requires_grad:
        return None
    buffer = getattr(weight, "main_grad", None)
    if buffer is None:
        return None
    err = OpError(_OP)
    if not isinstance(buffer, Tensor):
        raise err.type("main_grad", f"expected a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.float32 or buffer.shape != weight.shape or buffer.device != weight.device:
        raise err.value("main_grad", f"expected an fp32 buffer of the weight's shape {tuple(weight.shape)} on "
                                     f"{weight.device}, got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")
    if not buffer.is_contiguous():
        raise err.value("main_grad", f"expected a contiguous buffer, got strides {tuple(buffer.stride())}")
    return buffer


def _check_shapes(hidden_states, kv, image_token_mask) -> None:
    """Leading dims and widths before any reshape: a wrong shape with the right element count must not be
    reinterpreted."""
    err = OpError(_OP)
    for arg, value in (("hidden_states", hidden_states), ("kv", kv)):
        if not isinstance(value, Tensor):
            raise err.type(arg, f"expected a torch.Tensor, got {type(value).__name__}")
    if image_token_mask is not None and not isinstance(image_token_mask, Tensor):
        raise err.type("image_token_mask", f"expected a torch.Tensor or None, got {type(image_token_mask).__name__}")
    if hidden_states.dim() < 2:
        raise err.value("hidden_states", f"expected (*, m, H), got shape {tuple(hidden_states.shape)}")
    lead = tuple(hidden_states.shape[:-2])
    m, hidden = hidden_states.shape[-2:]
    if tuple(kv.shape) != lead + ((m + 1) * hidden,):
        raise err.value("kv", f"expected shape {lead + ((m + 1) * hidden,)} (the leading dims of hidden_states "
                              f"{tuple(hidden_states.shape)}, then (m + 1) * H), got {tuple(kv.shape)}")
    if image_token_mask is not None and tuple(image_token_mask.shape) != lead:
        raise err.value("image_token_mask", f"expected shape {lead} (the leading dims of hidden_states), got "
                                            f"{tuple(image_token_mask.shape)}")


class _EngramGateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, kv, weight_hidden, weight_embed, clamp_value, eps, image_token_mask,
                main_grad_hidden, main_grad_embed, residual=True):
        weight_fused = engram_fused_weight(weight_hidden, weight_embed)
        out, dot, gate_score, rstd_x, rstd_k = engram_gate_fwd(
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
        grad_x, grad_kv, grad_w_partial = engram_gate_bwd(
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

    Args:
        hidden_states: ``(*, m, H)`` bf16 (``m == 4``).
        kv: ``(*, (m + 1) * H)`` bf16: per token the ``m`` keys then the value, flat.
        weight_hidden: ``(m, H)`` bf16 parameter (RMSNorm weight of the hidden streams).
        weight_embed: ``(m, H)`` bf16 parameter (RMSNorm weight of the keys).
        clamp_value: signed-sqrt clamp.
        eps: RMSNorm epsilon (the production value is not published; expose it).
        image_token_mask: ``(*)`` bool or None; True tokens pass through unchanged.
        residual: add ``hidden_states`` (True) or return the gated value ``g*v`` alone (False; masked
            tokens 0), both from one kernel and one rounding.

    Returns:
        ``(*, m, H)`` bf16. Gradients flow to ``hidden_states``, ``kv`` and both weights; a weight
        with an fp32 ``main_grad`` attribute gets its gradient accumulated there (eager mode only).
    """
    _check_shapes(hidden_states, kv, image_token_mask)
    lead = hidden_states.shape[:-2]
    m, hidden = hidden_states.shape[-2:]
    x = hidden_states.reshape(-1, m, hidden)
    kv3 = kv.reshape(-1, m + 1, hidden)
    mask = None if image_token_mask is None else image_token_mask.reshape(-1)
    out = _EngramGateFunction.apply(
        x.contiguous(), kv3.contiguous(), weight_hidden, weight_embed, clamp_value, eps, mask,
        _main_grad(weight_hidden), _main_grad(weight_embed), residual,
    )
    return out.view(*lead, m, hidden)


def check_gate_config(err: OpError, hidden_size: int, hc_mult: int, clamp_value: float, eps: float, dtype,
                      eps_arg: str = "eps") -> None:
    """A gate module's configuration, refused at construction where the gate op would refuse it at its first
    call (``eps_arg``: the caller's name of the RMSNorm epsilon)."""
    limits.ENGRAM_HIDDEN.check(err, "hidden_size", check_int(err, "hidden_size", hidden_size))
    limits.ENGRAM_HC_MULT.check(err, "hc_mult", check_int(err, "hc_mult", hc_mult))
    if dtype != torch.bfloat16:
        raise err.type("dtype", f"expected torch.bfloat16 (the gate's dtype), got {dtype}")
    check_float(err, "clamp_value", clamp_value, minimum=0.0, inclusive=False)
    check_float(err, eps_arg, eps, minimum=0.0)


class EngramGate(nn.Module):
    """Holds the two ``(m, H)`` bf16 RMSNorm weights of an Engram gate (initialized to ones).

    Args:
        hidden_size: ``H`` (a multiple of 256 in [512, 8192]).
        hc_mult: number of residual streams ``m`` (4).
        clamp_value: signed-sqrt clamp (1e-6).
        eps: RMSNorm epsilon (1e-6).
    """

    def __init__(self, hidden_size: int, hc_mult: int = 4, clamp_value: float = 1e-6, eps: float = 1e-6,
                 device=None, dtype=torch.bfloat16):
        super().__init__()
        check_gate_config(OpError("modeling.EngramGate"), hidden_size, hc_mult, clamp_value, eps, dtype)
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.clamp_value = clamp_value
        self.eps = eps
        self.weight_hidden = nn.Parameter(torch.ones(hc_mult, hidden_size, device=device, dtype=dtype))
        self.weight_embed = nn.Parameter(torch.ones(hc_mult, hidden_size, device=device, dtype=dtype))

    def forward(self, hidden_states: Tensor, kv: Tensor, image_token_mask: Optional[Tensor] = None) -> Tensor:
        """``hidden_states (*, m, H)`` bf16, ``kv (*, (m + 1) * H)`` bf16 → ``(*, m, H)`` bf16."""
        return engram_gate(hidden_states, kv, self.weight_hidden, self.weight_embed, self.clamp_value, self.eps,
                           image_token_mask)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, hc_mult={self.hc_mult}, clamp_value={self.clamp_value}, eps={self.eps}"
