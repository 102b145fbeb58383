"""LayerNorm with an optional fused residual add and per-token cast, forward and backward
(docs/ops/norm.md#layer_norm).

Ops: ``layer_norm_forward(x, weight, bias, eps, residual=None, layout=None, with_y=False) -> (y, mean, rstd,
residual_out, data, sf)`` and ``layer_norm_backward(grad_y, x, weight, mean, rstd, grad_weight=None,
grad_bias=None, grad_residual_out=None) -> grad_x`` (accumulating the weight and bias gradients in place).
"""

from typing import Optional

from torch import Tensor

from .._checks import OpError, check_bool, check_float
from .._library import declare
from ._common import (F32, absent_cast, cast_outputs, check_cast_layout, check_grad_buffer, check_like, check_param,
                      check_rows, check_stat)

__all__ = ["layer_norm_backward", "layer_norm_forward"]


def _empty(x: Tensor) -> Tensor:
    """An absent output (docs/ops/norm.md#conventions)."""
    return x.new_empty((0,))


@declare("layer_norm_forward", vector_args={"x": 16, "residual": 16, "weight": 16, "bias": 16}, tokens="x",
         outputs=("y", "mean", "rstd", "residual_out", "data", "sf"))
def layer_norm_forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                       residual: Optional[Tensor] = None, layout: Optional[str] = None,
                       with_y: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """LayerNorm of each row, fp32 statistics (two-pass over the row), optionally after a residual add and
    followed by a per-token cast of the result (docs/ops/norm.md#layer_norm).

    ``r = x + residual`` rounded to x's dtype (``r = x`` without a residual), ``mean = mean(f32(r))``,
    ``rstd = rsqrt(mean((f32(r) - mean)^2) + eps)``, ``y = round((f32(r) - mean) * rstd * w + b)``.

    Args:
        x: ``(..., H)`` bf16 or fp32, ``H`` a multiple of 64 in [64, 32768]; rows may be strided (one row stride,
            a multiple of 16 bytes); any number of rows ``T`` (the product of the leading dims), 0 included.
        weight: None or ``(H,)`` of x's dtype.
        bias: None or ``(H,)`` of x's dtype.
        eps: added to the variance, a positive float finite in fp32.
        residual: None or a tensor of x's shape and dtype (rows as x's).
        layout: None or a per-token ScaleLayout spec whose group divides ``H``: the fused cast of ``y``.
        with_y: with a layout, whether ``y`` is returned too (always returned without a layout).

    Returns:
        ``(y, mean, rstd, residual_out, data, sf)``: ``y`` of x's shape and dtype (contiguous) or an empty
        ``(0,)`` tensor (a layout without ``with_y``); ``mean`` and ``rstd`` fp32 of shape ``x.shape[:-1]``;
        ``residual_out`` ``r`` of x's shape and dtype with a residual, else empty; ``data`` / ``sf`` the
        per-token cast of ``y``'s ``(T, H)`` rows in ``layout`` (its data and scale shapes for x's backend),
        else empty.
    """
    err = OpError("layer_norm_forward")
    tokens, hidden = check_rows(err, "x", x)
    check_param(err, "weight", weight, x, hidden)
    check_param(err, "bias", bias, x, hidden)
    check_float(err, "eps", eps, minimum=0.0, inclusive=False)
    if residual is not None:
        check_like(err, "residual", residual, x)
    check_bool(err, "with_y", with_y)
    spec = None if layout is None else check_cast_layout(err, "layout", layout, hidden, x)
    stats = tuple(x.shape[:-1])
    mean, rstd = x.new_empty(stats, dtype=F32), x.new_empty(stats, dtype=F32)
    residual_out = _empty(x) if residual is None else x.new_empty(x.shape)
    y = x.new_empty(x.shape) if spec is None or with_y else _empty(x)
    if spec is None:
        return y, mean, rstd, residual_out, *absent_cast(x)
    return y, mean, rstd, residual_out, *cast_outputs(spec, tokens, hidden, x)


@declare("layer_norm_backward", mutates_args=("grad_weight", "grad_bias"),
         vector_args={"grad_y": 16, "x": 16, "weight": 16, "grad_residual_out": 16}, tokens="x", outputs=("grad_x",))
def layer_norm_backward(grad_y: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                        grad_weight: Optional[Tensor] = None, grad_bias: Optional[Tensor] = None,
                        grad_residual_out: Optional[Tensor] = None) -> Tensor:
    """The gradient of :func:`layer_norm_forward` with respect to its normalized input, and the weight and bias
    gradients accumulated in a fixed order (docs/ops/norm.md#layer_norm).

    ``g = f32(grad_y)``, ``xhat = (f32(x) - mean) * rstd``, ``w = f32(weight)`` (1 without a weight):
    ``grad_x = round(rstd * (w g - mean(w g) - xhat * mean(xhat w g)) + grad_residual_out)``;
    ``grad_weight += sum_t xhat g``, ``grad_bias += sum_t g`` (per-partition partials over fixed token ranges,
    summed in ascending partition order: bitwise reproducible, no atomics).

    Args:
        grad_y: the gradient of ``y``, x's shape and dtype (rows as x's).
        x: ``(..., H)`` bf16 or fp32, the forward's normalized input (its ``residual_out`` with a residual).
        weight: None or ``(H,)`` of x's dtype.
        mean, rstd: the forward's fp32 statistics, shape ``x.shape[:-1]``, contiguous.
        grad_weight: None or an ``(H,)`` fp32 buffer (only with a weight), accumulated.
        grad_bias: None or an ``(H,)`` fp32 buffer, accumulated.
        grad_residual_out: None or the gradient of ``residual_out``, x's shape and dtype, added to ``grad_x``.

    Returns:
        ``grad_x`` of x's shape and dtype (contiguous): the gradient of ``x`` (and, with a residual, of the
        forward's ``residual`` too).
    """
    err = OpError("layer_norm_backward")
    tokens, hidden = check_rows(err, "x", x)
    check_like(err, "grad_y", grad_y, x)
    check_param(err, "weight", weight, x, hidden)
    check_stat(err, "mean", mean, x)
    check_stat(err, "rstd", rstd, x)
    check_grad_buffer(err, "grad_weight", grad_weight, weight, "weight", hidden, x)
    check_grad_buffer(err, "grad_bias", grad_bias, None, None, hidden, x)  # no bias argument: needs none
    if grad_residual_out is not None:
        check_like(err, "grad_residual_out", grad_residual_out, x)
    del tokens
    return x.new_empty(x.shape)


# DTensor sharding (docs/distributed.md): rows are tokens (S0), the weight and bias replicated; the weight and bias
# gradients are sums over tokens, so each rank's sum over its own rows accumulates into Partial buffers.
layer_norm_forward.sharding({"x": "S0", "weight": "R", "bias": "R", "residual": "S0",
                             "returns": ("S0", "S0", "S0", "S0", "S0", "S0")})
layer_norm_backward.sharding({"grad_y": "S0", "x": "S0", "weight": "R", "mean": "S0", "rstd": "S0",
                              "grad_weight": "P", "grad_bias": "P", "grad_residual_out": "S0", "returns": "S0"})
