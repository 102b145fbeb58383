"""Differentiable RMSNorm, LayerNorm and SwiGLU over the norm family's ops (docs/ops/norm.md#modeling).

Each function is an autograd Function over its op pair: the forward op saves the norm's input (``x``, or the
residual sum ``x + residual``) and the fp32 statistics; the backward op gives the input gradient and accumulates
the weight (and bias) gradient into an fp32 buffer: the parameter's Megatron-style ``main_grad`` when it has one
(eager mode; the parameter then gets no ``.grad``), else fresh zeros returned as the gradient in the parameter's
dtype. With a residual the sum's gradient is the input gradient of both ``x`` and ``residual`` (and the gradient
that reaches ``residual_out`` is added to it by the backward op). The ops take any leading dims, so nothing is
flattened here; the ops' validation names the op and the argument.
"""

from typing import Optional

import torch
from torch import Tensor, nn

from .._checks import OpError, check_float, describe
from ..norm import (layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward, swiglu_backward,
                    swiglu_forward)
from ._buffers import check_device, check_main_grads, grad_buffers, honoured_main_grad, reduced

__all__ = ["LayerNorm", "RMSNorm", "SwiGLU", "add_rms_norm", "layer_norm", "rms_norm", "swiglu"]


def _mains(op: str, params: tuple, inputs: tuple) -> tuple:
    """The honoured ``main_grad`` of each ``(name, parameter)`` (None where there is none or no gradient is
    recorded), checked not to overlap each other or the call's tensors."""
    if not torch.is_grad_enabled():
        return tuple(None for _ in params)
    mains = tuple(honoured_main_grad(p, op, name) for name, p in params)
    check_main_grads(op, params, mains, inputs)
    return mains


def _grad_buffers(tokens: Tensor, params: tuple, mains: tuple, needs: tuple) -> list:
    """The fp32 buffers the backward op accumulates into: a parameter's ``main_grad`` or fresh zeros, None for an
    absent parameter or one that needs no gradient."""
    wanted = [(p, m) for p, m, need in zip(params, mains, needs) if p is not None and need]
    made = iter(grad_buffers(tokens, [p for p, _ in wanted], [m for _, m in wanted]))
    return [next(made) if p is not None and need else None for p, need in zip(params, needs)]


def _param_grads(params: tuple, mains: tuple, buffers: list) -> list:
    """What autograd gets for the parameters once the backward op has run: each buffer's sum in its parameter's
    dtype, None where a ``main_grad`` took it (or none was asked for)."""
    return [None if b is None or m is not None else reduced(b, p.dtype) for p, m, b in zip(params, mains, buffers)]


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, out_scale, main_grad):
        y, rstd, residual_out, _, _ = rms_norm_forward(x, weight, eps, residual, out_scale)
        normed = x if residual is None else residual_out
        ctx.save_for_backward(normed, weight, rstd)
        ctx.out_scale, ctx.main_grad, ctx.has_residual = out_scale, main_grad, residual is not None
        if residual is None:
            return y
        return y, residual_out

    @staticmethod
    def backward(ctx, grad_y, grad_residual_out=None):
        normed, weight, rstd = ctx.saved_tensors
        buffers = _grad_buffers(normed, (weight,), (ctx.main_grad,), (ctx.needs_input_grad[2],))
        grad_y = normed.new_zeros(normed.shape) if grad_y is None else grad_y.contiguous()
        if grad_residual_out is not None:
            grad_residual_out = grad_residual_out.contiguous()
        grad_x = rms_norm_backward(grad_y, normed, weight, rstd, buffers[0], grad_residual_out, ctx.out_scale)
        (weight_grad,) = _param_grads((weight,), (ctx.main_grad,), buffers)
        return grad_x, grad_x if ctx.has_residual else None, weight_grad, None, None, None


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *, residual: Optional[Tensor] = None,
             out_scale: float = 1.0):
    """RMSNorm with autograd: ``y = r · rsqrt(mean(r²) + eps) · weight · out_scale``, ``r = x`` or ``x + residual``
    (docs/ops/norm.md#rms_norm).

    Args:
        x: ``(*, H)`` bf16 or fp32, ``H`` a multiple of 64 in [64, 32768].
        weight: ``(H,)`` of ``x``'s dtype, or None (no affine weight).
        eps: added to the mean square (> 0).
        residual: ``(*, H)`` like ``x``, or None.
        out_scale: a constant factor of the output.

    Returns:
        ``y`` of ``x``'s shape and dtype; with a residual ``(y, residual_out)``, ``residual_out = x + residual``
        (the next residual stream). Gradients flow to ``x``, ``residual`` and ``weight`` (into its fp32
        ``main_grad`` when it has one, eager mode).
    """
    op = "modeling.rms_norm"
    mains = _mains(op, (("weight", weight),), (("x", x), ("residual", residual)))
    return _RMSNormFunction.apply(x, residual, weight, eps, out_scale, mains[0])


def add_rms_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6,
                 out_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """The fused residual add and RMSNorm: ``(rms_norm(x + residual), x + residual)`` (torch_npu's
    ``npu_add_rms_norm`` without its rstd), one pass over the rows; see :func:`rms_norm`."""
    if residual is None:
        raise OpError("modeling.add_rms_norm").type("residual", f"expected a torch.Tensor, got {describe(residual)}")
    return rms_norm(x, weight, eps, residual=residual, out_scale=out_scale)


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, main_weight, main_bias):
        y, mean, rstd, residual_out, _, _ = layer_norm_forward(x, weight, bias, eps, residual)
        normed = x if residual is None else residual_out
        ctx.save_for_backward(normed, weight, bias, mean, rstd)
        ctx.mains, ctx.has_residual = (main_weight, main_bias), residual is not None
        if residual is None:
            return y
        return y, residual_out

    @staticmethod
    def backward(ctx, grad_y, grad_residual_out=None):
        normed, weight, bias, mean, rstd = ctx.saved_tensors
        buffers = _grad_buffers(normed, (weight, bias), ctx.mains, (ctx.needs_input_grad[2], ctx.needs_input_grad[3]))
        grad_y = normed.new_zeros(normed.shape) if grad_y is None else grad_y.contiguous()
        if grad_residual_out is not None:
            grad_residual_out = grad_residual_out.contiguous()
        grad_x = layer_norm_backward(grad_y, normed, weight, mean, rstd, *buffers, grad_residual_out)
        weight_grad, bias_grad = _param_grads((weight, bias), ctx.mains, buffers)
        return grad_x, grad_x if ctx.has_residual else None, weight_grad, bias_grad, None, None, None


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5, *,
               residual: Optional[Tensor] = None):
    """LayerNorm over the last dim with autograd (``torch.nn.functional.layer_norm``'s math, fp32 statistics;
    docs/ops/norm.md#layer_norm), optionally of ``x + residual``.

    Args:
        x: ``(*, H)`` bf16 or fp32, ``H`` a multiple of 64 in [64, 32768].
        weight, bias: ``(H,)`` of ``x``'s dtype, or None.
        eps: added to the variance (> 0).
        residual: ``(*, H)`` like ``x``, or None.

    Returns:
        ``y`` of ``x``'s shape and dtype; with a residual ``(y, x + residual)``. Gradients flow to every tensor
        argument (``weight`` / ``bias`` into their fp32 ``main_grad`` when they have one, eager mode).
    """
    op = "modeling.layer_norm"
    mains = _mains(op, (("weight", weight), ("bias", bias)), (("x", x), ("residual", residual)))
    return _LayerNormFunction.apply(x, residual, weight, bias, eps, *mains)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, routing_weight, routed_scaling_factor, clamp):
        y, _, _ = swiglu_forward(x, routing_weight, routed_scaling_factor, clamp)
        ctx.save_for_backward(x, routing_weight)
        ctx.routed_scaling_factor, ctx.clamp = routed_scaling_factor, clamp
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, routing_weight = ctx.saved_tensors
        grad_x, grad_routing_weight, _, _, _ = swiglu_backward(
            grad_y.contiguous(), x, routing_weight, ctx.routed_scaling_factor, ctx.clamp)
        if routing_weight is None or not ctx.needs_input_grad[1]:
            grad_routing_weight = None
        return grad_x, grad_routing_weight, None, None


def swiglu(x: Tensor, routing_weight: Optional[Tensor] = None, routed_scaling_factor: float = 1.0,
           clamp: Optional[float] = None) -> Tensor:
    """SwiGLU with autograd: ``x = [gate | up]`` ``(*, 2H)`` gives ``silu(gate) · up · routing_weight ·
    routed_scaling_factor`` ``(*, H)`` (docs/ops/norm.md#swiglu); ``clamp`` is DeepSeek-V4's (``gate <= c``,
    ``|up| <= c``, clamped elements get no gradient). Gradients flow to ``x`` and the fp32 ``(T,)``
    ``routing_weight``."""
    return _SwiGLUFunction.apply(x, routing_weight, routed_scaling_factor, clamp)


def _normalized_size(err: OpError, normalized_shape) -> int:
    """``H`` of a ``normalized_shape`` (an int or a one-element sequence: the ops normalize the last dim)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1 or isinstance(shape[0], bool) or not isinstance(shape[0], int):
        raise err.value("normalized_shape", f"expected an int H or a one-element shape (H,) (the last dim is "
                                            f"normalized), got {normalized_shape!r}")
    return shape[0]


class RMSNorm(nn.Module):
    """A drop-in for ``torch.nn.RMSNorm`` over the last dim (the same arguments, the parameter ``weight`` and its
    state_dict key), running :func:`rms_norm`; ``forward(x, residual=None)`` also takes the fused residual add and
    then returns ``(y, x + residual)``. ``eps=None`` is ``torch.finfo(x.dtype).eps``, as torch's."""

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        err = OpError("modeling.RMSNorm")
        size = _normalized_size(err, normalized_shape)
        if eps is not None:
            eps = check_float(err, "eps", eps, minimum=0.0, inclusive=False)
        self.normalized_shape = (size,)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(size, device=check_device(err, device), dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(nn.Module):
    """A drop-in for ``torch.nn.LayerNorm`` over the last dim (the same arguments, parameters ``weight`` and
    ``bias`` and state_dict keys), running :func:`layer_norm`; ``forward(x, residual=None)`` also takes the fused
    residual add and then returns ``(y, x + residual)``."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        err = OpError("modeling.LayerNorm")
        size = _normalized_size(err, normalized_shape)
        self.normalized_shape = (size,)
        self.eps = check_float(err, "eps", eps, minimum=0.0, inclusive=False)
        self.elementwise_affine = elementwise_affine
        device = check_device(err, device)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(size, device=device, dtype=dtype)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class SwiGLU(nn.Module):
    """The SwiGLU activation as a module (no parameters): ``(*, 2H) -> (*, H)``, :func:`swiglu` with an optional
    ``clamp``; ``forward(x, routing_weight=None)`` for routed experts."""

    def __init__(self, clamp: Optional[float] = None, routed_scaling_factor: float = 1.0):
        super().__init__()
        err = OpError("modeling.SwiGLU")
        self.clamp = None if clamp is None else check_float(err, "clamp", clamp, minimum=0.0, inclusive=False)
        self.routed_scaling_factor = check_float(err, "routed_scaling_factor", routed_scaling_factor, minimum=0.0)

    def forward(self, x: Tensor, routing_weight: Optional[Tensor] = None) -> Tensor:
        return swiglu(x, routing_weight, self.routed_scaling_factor, self.clamp)

    def extra_repr(self) -> str:
        return f"clamp={self.clamp}, routed_scaling_factor={self.routed_scaling_factor}"
