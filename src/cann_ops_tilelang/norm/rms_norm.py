"""RMSNorm with an optional fused residual add and fused per-token cast, and its backward
(docs/ops/norm.md#rms_norm).

Ops: ``rms_norm_forward(x, weight, eps, residual=None, out_scale=1.0, layout=None, with_y=False) -> (y, rstd,
residual_out, data, sf)`` and ``rms_norm_backward(grad_y, x, weight, rstd, grad_weight=None,
grad_residual_out=None, out_scale=1.0) -> grad_x`` (``grad_weight`` accumulated in place, in a fixed order).
"""

from typing import Optional

import torch
from torch import Tensor

from .._checks import OpError, check_bool, check_float
from .._library import declare
from ._common import (F32, absent_cast, cast_outputs, check_cast_layout, check_grad_buffer, check_like, check_param,
                      check_rows, check_stat)

__all__ = ["rms_norm_backward", "rms_norm_forward"]


@declare("rms_norm_forward", vector_args={"x": 16, "weight": 16, "residual": 16}, tokens="x",
         outputs=("y", "rstd", "residual_out", "data", "sf"))
def rms_norm_forward(x: Tensor, weight: Optional[Tensor], eps: float, residual: Optional[Tensor] = None,
                     out_scale: float = 1.0, layout: Optional[str] = None,
                     with_y: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """RMSNorm of the rows of ``x`` (plus ``residual``), optionally cast per token (docs/ops/norm.md#rms_norm).

    ``r = x + residual`` rounded to x's dtype (``r = x`` without residual), ``rstd = rsqrt(mean(f32(r)^2) + eps)``,
    ``y = dtype(fl(fl(f32(r) * rstd) * fl(f32(weight) * out_scale)))``; with ``layout`` the per-token cast of the
    rows of the rounded ``y``, bitwise ``per_token_cast(rows(y), layout)``.

    Args:
        x: ``(..., H)`` bf16 or fp32, ``H`` a multiple of 64 in [64, 32768] (``limits.NORM_HIDDEN``), rows as
            docs/ops/norm.md#conventions allows (strided, unit column stride).
        weight: ``(H,)`` of x's dtype, contiguous, or None (a weight of ones).
        eps: a finite float > 0.
        residual: None or a tensor of x's shape and dtype (rows as for x).
        out_scale: a finite float multiplying the weight.
        layout: None or a per-token ScaleLayout spec whose group divides ``H`` (docs/ops/quant.md#layout).
        with_y: with a layout, also return ``y`` (without a layout ``y`` is always returned).

    Returns:
        ``(y, rstd, residual_out, data, sf)``: ``y`` of x's shape and dtype (a ``(0,)`` empty with a layout and
        not ``with_y``); ``rstd`` fp32 ``x.shape[:-1]``; ``residual_out`` ``r`` with a residual, else a ``(0,)``
        empty; ``data`` / ``sf`` the cast of the ``(T, H)`` rows in the layout for x's backend, else ``(0,)``
        empties (float8_e4m3fn, fp32).
    """
    err = OpError("rms_norm_forward")
    tokens, hidden = check_rows(err, "x", x)
    check_param(err, "weight", weight, x, hidden)
    check_float(err, "eps", eps, minimum=0.0, inclusive=False)
    if residual is not None:
        check_like(err, "residual", residual, x)
    check_float(err, "out_scale", out_scale, minimum=-float("inf"))
    check_bool(err, "with_y", with_y)
    cast = None if layout is None else check_cast_layout(err, "layout", layout, hidden, x)
    empty = x.new_empty((0,))
    y = x.new_empty(x.shape) if cast is None or with_y else empty
    rstd = x.new_empty(x.shape[:-1], dtype=F32)
    residual_out = x.new_empty(x.shape) if residual is not None else x.new_empty((0,))
    if cast is None:
        return y, rstd, residual_out, *absent_cast(x)
    return y, rstd, residual_out, *cast_outputs(cast, tokens, hidden, x)


# DTensor sharding (docs/distributed.md): token-wise; the weight is replicated. Absent outputs are (0,) empties.
rms_norm_forward.sharding({"x": "S0", "residual": "S0", "returns": ("S0", "S0", "S0", "S0", "S0")})


@declare("rms_norm_backward", mutates_args=("grad_weight",),
         vector_args={"grad_y": 16, "x": 16, "weight": 16, "grad_weight": 16, "grad_residual_out": 16},
         tokens="grad_y", outputs=("grad_x",))
def rms_norm_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor,
                      grad_weight: Optional[Tensor] = None, grad_residual_out: Optional[Tensor] = None,
                      out_scale: float = 1.0) -> Tensor:
    """The gradients of :func:`rms_norm_forward` (docs/ops/norm.md#rms_norm): with ``g = fl(f32(grad_y) *
    out_scale)``, ``w = f32(weight)`` (1 without weight), ``xhat = fl(f32(x) * rstd)``,
    ``grad_x = dtype((w g - xhat mean(xhat w g)) rstd + grad_residual_out)`` and
    ``grad_weight += sum_t fl(xhat_t * g_t)``, summed per partition of tokens then over the partitions in
    ascending order (deterministic, no atomics).

    Args:
        grad_y: ``(..., H)`` bf16 or fp32, rows as for ``x``.
        x: the forward's norm input (its ``residual_out`` when it had a residual), grad_y's shape and dtype.
        weight: ``(H,)`` of x's dtype, or None.
        rstd: the forward's ``rstd``, fp32 ``x.shape[:-1]``, contiguous.
        grad_weight: None, or a contiguous fp32 ``(H,)`` buffer, accumulated (only with a weight).
        grad_residual_out: None, or the gradient of ``residual_out`` (x's shape and dtype), added to ``grad_x``.
        out_scale: the forward's ``out_scale``.

    Returns:
        ``grad_x`` of x's shape and dtype.
    """
    err = OpError("rms_norm_backward")
    tokens, hidden = check_rows(err, "grad_y", grad_y)
    check_like(err, "x", x, grad_y, "grad_y")
    check_param(err, "weight", weight, x, hidden)
    check_stat(err, "rstd", rstd, x)
    check_grad_buffer(err, "grad_weight", grad_weight, weight, "weight", hidden, x)
    if grad_residual_out is not None:
        check_like(err, "grad_residual_out", grad_residual_out, x)
    check_float(err, "out_scale", out_scale, minimum=-float("inf"))
    del tokens
    return x.new_empty(x.shape)


# Sums over tokens are Partial: each rank adds its own tokens' weight gradient into its Partial buffer.
rms_norm_backward.sharding({"grad_y": "S0", "x": "S0", "rstd": "S0", "grad_weight": "P", "grad_residual_out": "S0",
                            "returns": "S0"})
