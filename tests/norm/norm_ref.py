"""Device-free PyTorch references of the norm family (docs/ops/norm.md).

The ``<op>_ref`` of a declared op takes the op's arguments and returns its outputs (writing its buffers): the
test plugin registers it as the op's CPU kernel. fp32 arithmetic in the contract's order where the kernels are
compared bitwise (the fused cast's bytes), float64 oracles (``*_f64``) for the tolerances of docs/ops/norm.md.
"""

import torch

F32, F64 = torch.float32, torch.float64


def quant_reference():
    """tests/quant/quant_ref.py, its directory put on ``sys.path`` (the fused casts' bytes are its per-token cast of
    the rounded output)."""
    import importlib
    import sys
    from pathlib import Path

    path = str(Path(__file__).resolve().parent.parent / "quant")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("quant_ref")


# --- rms_norm (docs/ops/norm.md#rms_norm) ---------------------------------------------------------------------


def rms_norm_rows(x):
    """``x (..., W)`` as its ``(T, W)`` rows (the fused cast's input)."""
    return x.reshape(-1, x.shape[-1])


def rms_norm_forward_ref(x, weight, eps, residual=None, out_scale=1.0, layout=None, with_y=False):
    """The op ``rms_norm_forward``: fp32 arithmetic in the contract's order, ``y = fl(fl(r * rstd) * fl(w *
    out_scale))`` rounded once; the cast is the quant reference's per-token cast of the rounded ``y``."""
    r = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    rf = r.float()
    rstd = torch.rsqrt(rf.square().sum(-1) / x.shape[-1] + eps)
    w = torch.ones(x.shape[-1]) if weight is None else weight.float()
    y = ((rf * rstd[..., None]) * (w * float(out_scale))).to(x.dtype)
    empty = x.new_empty((0,))
    residual_out = r.clone() if residual is not None else empty
    if layout is None:
        return y, rstd, residual_out, x.new_empty((0,), dtype=torch.float8_e4m3fn), x.new_empty((0,), dtype=F32)
    data, sf = quant_reference().per_token_cast_ref(rms_norm_rows(y), layout)
    return (y if with_y else empty), rstd, residual_out, data, sf


def rms_norm_backward_ref(grad_y, x, weight, rstd, grad_weight=None, grad_residual_out=None, out_scale=1.0):
    """The op ``rms_norm_backward`` (fp32, the contract's order per element; the sums in torch's order): returns
    ``grad_x`` and adds the weight gradient into ``grad_weight``."""
    g = grad_y.float() * float(out_scale)
    w = torch.ones(x.shape[-1]) if weight is None else weight.float()
    xhat = x.float() * rstd[..., None]
    wg = w * g
    mean = (xhat * wg).sum(-1, keepdim=True) / x.shape[-1]
    grad_x = (wg - xhat * mean) * rstd[..., None]
    if grad_residual_out is not None:
        grad_x = grad_x + grad_residual_out.float()
    if grad_weight is not None:
        grad_weight += rms_norm_rows(xhat * g).sum(0)
    return grad_x.to(x.dtype)


def rms_norm_forward_f64(x, weight, eps, residual=None, out_scale=1.0):
    """float64 oracle of ``(y, rstd)`` from the rounded residual sum ``r`` (the op's ``residual_out``)."""
    r = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    rd = r.to(F64)
    rstd = torch.rsqrt(rd.square().mean(-1) + eps)
    w = torch.ones(x.shape[-1], dtype=F64) if weight is None else weight.to(F64)
    return rd * rstd[..., None] * (w * out_scale), rstd


def rms_norm_backward_f64(grad_y, x, weight, rstd, out_scale=1.0):
    """float64 oracle of ``(grad_x without grad_residual_out, the weight gradient's sum, its sum of |terms|)``
    from the given ``rstd``."""
    g = grad_y.to(F64) * out_scale
    w = torch.ones(x.shape[-1], dtype=F64) if weight is None else weight.to(F64)
    xhat = x.to(F64) * rstd.to(F64)[..., None]
    wg = w * g
    grad_x = (wg - xhat * (xhat * wg).mean(-1, keepdim=True)) * rstd.to(F64)[..., None]
    terms = rms_norm_rows(xhat * g)
    return grad_x, terms.sum(0), terms.abs().sum(0)


# --- layer_norm (docs/ops/norm.md#layer_norm) ---------------------------------------------------------------------


def layer_norm_residual(x, residual):
    """``r = x + residual`` rounded to x's dtype (``x`` itself without a residual)."""
    return x if residual is None else (x.to(F32) + residual.to(F32)).to(x.dtype)


def layer_norm_forward_ref(x, weight, bias, eps, residual=None, layout=None, with_y=False):
    """The op ``layer_norm_forward``: fp32 two-pass statistics of ``r``, ``y`` rounded once to x's dtype, the fused
    cast the quant reference's bytes of the rounded ``y`` rows (the backend of x's device)."""
    from cann_ops_tilelang import policy

    r = layer_norm_residual(x, residual)
    rf = r.to(F32)
    mean = rf.mean(-1)
    centered = rf - mean[..., None]
    rstd = torch.rsqrt((centered * centered).mean(-1) + eps)
    yf = centered * rstd[..., None]
    if weight is not None:
        yf = yf * weight.to(F32)
    if bias is not None:
        yf = yf + bias.to(F32)
    y = yf.to(x.dtype)
    empty = x.new_empty((0,))
    residual_out = empty if residual is None else r.contiguous()
    if layout is None:
        return y, mean, rstd, residual_out, empty, empty
    q = quant_reference().per_token_quantize_ref(y.reshape(-1, y.shape[-1]), layout,
                                             backend=policy.kernel_backend(x.device.type))
    return y if with_y else empty, mean, rstd, residual_out, q.data, q.sf


def layer_norm_backward_ref(grad_y, x, weight, mean, rstd, grad_weight=None, grad_bias=None, grad_residual_out=None):
    """The op ``layer_norm_backward``: fp32 arithmetic from the given statistics; the weight and bias gradients
    accumulated once into their buffers (the kernels' partition order is not reproduced: tolerances)."""
    g = grad_y.to(F32)
    xhat = (x.to(F32) - mean[..., None]) * rstd[..., None]
    wg = g if weight is None else g * weight.to(F32)
    grad = rstd[..., None] * (wg - wg.mean(-1, keepdim=True) - xhat * (xhat * wg).mean(-1, keepdim=True))
    if grad_residual_out is not None:
        grad = grad + grad_residual_out.to(F32)
    if grad_weight is not None:
        grad_weight += (xhat * g).reshape(-1, g.shape[-1]).sum(0)
    if grad_bias is not None:
        grad_bias += g.reshape(-1, g.shape[-1]).sum(0)
    return grad.to(x.dtype)


def layer_norm_forward_f64(x, weight, bias, eps, residual=None):
    """float64 oracle of the forward: ``(y, mean, rstd)`` of ``torch.nn.functional.layer_norm`` on the rounded
    ``r`` (mean and rstd from float64 moments)."""
    r = layer_norm_residual(x, residual).to(F64)
    w = None if weight is None else weight.to(F64)
    b = None if bias is None else bias.to(F64)
    y = torch.nn.functional.layer_norm(r, (r.shape[-1],), w, b, eps)
    mean = r.mean(-1)
    rstd = torch.rsqrt(r.var(-1, unbiased=False) + eps)
    return y, mean, rstd


def layer_norm_backward_f64(grad_y, x, weight, eps, grad_residual_out=None, bias=True):
    """float64 oracle of the backward by autograd through ``torch.nn.functional.layer_norm`` (its statistics
    recomputed in float64 from ``x``): ``(grad_x, grad_weight, grad_bias)``, the parameter gradients None where
    there is no weight (no bias with ``bias=False``)."""
    xd = x.detach().to(F64).requires_grad_(True)
    wd = None if weight is None else weight.detach().to(F64).requires_grad_(True)
    bd = torch.zeros(x.shape[-1], dtype=F64, requires_grad=True) if bias else None
    y = torch.nn.functional.layer_norm(xd, (x.shape[-1],), wd, bd, eps)
    y.backward(grad_y.to(F64))
    grad_x = xd.grad if grad_residual_out is None else xd.grad + grad_residual_out.to(F64)
    return grad_x, None if wd is None else wd.grad, None if bd is None else bd.grad
