"""Device-free PyTorch references of the norm family (docs/ops/norm.md).

The ``<op>_ref`` of a declared op takes the op's arguments and returns its outputs (writing its buffers): the
test plugin registers it as the op's CPU kernel. fp32 arithmetic in the contract's order where the kernels are
compared bitwise (the fused cast's bytes), float64 oracles (``*_f64``) for the tolerances of docs/ops/norm.md.
"""

import torch

F32, F64 = torch.float32, torch.float64


# --- rms_norm (docs/ops/norm.md#rms_norm) ---------------------------------------------------------------------


def quant_reference():
    """tests/quant/quant_ref.py (the fused casts' bytes are its per-token cast of the rounded output)."""
    import importlib
    import sys
    from pathlib import Path

    path = str(Path(__file__).resolve().parent.parent / "quant")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("quant_ref")


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
