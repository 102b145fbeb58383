"""Fake (meta) implementations of the Engram gate ops.

Each function is the op's *prepare* step (see ``_library.declare``): its annotations are the op's
schema; it validates (metadata only) and allocates contiguous outputs with ``new_empty``. It never
imports TileLang, never compiles and never queries a device. The real kernels call the same
function before launching, so fake and real outputs have identical metadata.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import config
from ..engram.validation import (
    check_engram_fused_weight,
    check_engram_gate_bwd,
    check_engram_gate_fwd,
    check_engram_grad_w_reduce,
)


def engram_fused_weight(weight_hidden: Tensor, weight_embed: Tensor) -> Tensor:
    """Fused RMSNorm weight ``wf = f32(weight_hidden) * f32(weight_embed)`` (bit-exact).

    Args:
        weight_hidden: ``(m, H)`` bf16, contiguous; RMSNorm weight of the hidden streams.
        weight_embed: ``(m, H)`` bf16, contiguous, same shape; RMSNorm weight of the keys.
            Any 2-D shape works whose non-empty element count is divisible by 256.

    Returns:
        ``(m, H)`` fp32, a new tensor. The inputs are never modified.
    """
    check_engram_fused_weight(weight_hidden, weight_embed)
    return weight_hidden.new_empty(weight_hidden.shape, dtype=torch.float32)


def engram_gate_fwd(
    hidden_states: Tensor,
    kv: Tensor,
    weight_fused: Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
    image_token_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Engram gate forward, out of place (the op behind ``cann_ops_tilelang.engram_gate_fwd``).

    Args:
        hidden_states: ``(T, m, H)`` bf16, the multi-stream residual ``x``.
        kv: ``(T, m + 1, H)`` bf16; rows ``0..m-1`` are the keys, row ``m`` the value.
        weight_fused: ``(m, H)`` fp32 from ``engram_fused_weight``.
        eps: RMSNorm epsilon (>= 0).
        clamp_value: signed-sqrt clamp (> 0).
        save_for_backward: also write the statistics.
        image_token_mask: ``(T,)`` bool or None; True tokens pass through unchanged.

    Returns:
        ``(output, dot, gate_score, rstd_x, rstd_k)``: output ``(T, m, H)`` bf16; the four
        statistics ``(T, m)`` fp32 when saving, else empty ``(0,)`` fp32 tensors (the Python API
        turns those into None).
    """
    check_engram_gate_fwd(
        hidden_states,
        kv,
        weight_fused,
        eps,
        clamp_value,
        image_token_mask,
        save_for_backward=save_for_backward,
        inplace=False,
    )
    out = hidden_states.new_empty(hidden_states.shape)
    stat_shape = hidden_states.shape[:2] if save_for_backward else (0,)
    stats = [hidden_states.new_empty(stat_shape, dtype=torch.float32) for _ in range(4)]
    return out, stats[0], stats[1], stats[2], stats[3]


def engram_gate_fwd_inplace(
    hidden_states: Tensor,
    kv: Tensor,
    weight_fused: Tensor,
    eps: float,
    clamp_value: float,
    image_token_mask: Optional[Tensor] = None,
) -> None:
    """Engram gate forward written into ``hidden_states`` (no statistics saved).

    Same arguments and math as ``engram_gate_fwd``; the result is bitwise equal to its output.
    """
    check_engram_gate_fwd(
        hidden_states,
        kv,
        weight_fused,
        eps,
        clamp_value,
        image_token_mask,
        save_for_backward=False,
        inplace=True,
    )


def engram_gate_bwd(
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
) -> tuple[Tensor, Tensor, Tensor]:
    """Engram gate backward (OPS.md B.1.3).

    Args:
        grad_out: ``(T, m, H)`` bf16.
        hidden_states, kv, weight_fused: the forward's inputs.
        dot, gate_score, rstd_x, rstd_k: ``(T, m)`` fp32 statistics saved by the forward.
        clamp_value: the forward's clamp.
        image_token_mask: ``(T,)`` bool or None, as in the forward.

    Returns:
        ``(grad_hidden_states (T, m, H) bf16, grad_kv (T, m + 1, H) bf16,
        grad_w_partial (P, m, H) fp32)``; ``grad_w_partial`` holds per-worker partial sums of the
        gradient of ``weight_fused`` (P is fixed per device type and ``(H, m)``:
        ``config.grad_w_partials``);
        reduce it with ``engram_grad_w_reduce``.
    """
    check_engram_gate_bwd(
        grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, clamp_value, image_token_mask
    )
    partials = config.grad_w_partials(grad_out.device.type, grad_out.shape[2], grad_out.shape[1])
    grad_x = grad_out.new_empty(grad_out.shape)
    grad_kv = kv.new_empty(kv.shape)
    grad_w_partial = weight_fused.new_empty((partials, *weight_fused.shape))
    return grad_x, grad_kv, grad_w_partial


def engram_grad_w_reduce(
    grad_w_partial: Tensor,
    weight_hidden: Tensor,
    weight_embed: Tensor,
    grad_weight_hidden: Tensor,
    grad_weight_embed: Tensor,
) -> None:
    """Reduces the weight-gradient partials and accumulates into the two fp32 buffers in place.

    ``gw = sum_p grad_w_partial[p]`` (p ascending), then ``grad_weight_hidden += gw * f32(weight_embed)``
    and ``grad_weight_embed += gw * f32(weight_hidden)``.

    Args:
        grad_w_partial: ``(P, m, H)`` fp32.
        weight_hidden, weight_embed: ``(m, H)`` bf16.
        grad_weight_hidden, grad_weight_embed: ``(m, H)`` fp32, updated in place (Megatron
            ``main_grad`` buffers, or zeros).
    """
    check_engram_grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
