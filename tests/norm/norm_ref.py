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


# --- swiglu (docs/ops/norm.md#swiglu) -----------------------------------------------------------------------------


def swiglu_rows_valid(tokens: int, expert_offsets, alignment: int, device=None) -> torch.Tensor:
    """bool ``(T,)``: the rows of the expert segments, ``[align(offsets[e - 1], alignment), offsets[e])`` (all rows
    without ``expert_offsets``)."""
    if expert_offsets is None:
        return torch.ones(tokens, dtype=torch.bool, device=device)
    valid = torch.zeros(tokens, dtype=torch.bool, device=device)
    previous = 0
    for end in expert_offsets.cpu().tolist():
        start = -(-previous // alignment) * alignment
        if end > start:
            valid[start:min(end, tokens)] = True
        previous = end
    return valid


def _swiglu_halves(x2, clamp, dtype=F32):
    hidden = x2.shape[1] // 2
    g, u = x2[:, :hidden].to(dtype), x2[:, hidden:].to(dtype)
    if clamp is not None:
        c = torch.tensor(clamp, dtype=F32).to(dtype)
        g, u = torch.minimum(g, c), torch.clamp(u, -c, c)
    return g, u


def _swiglu_weight(tokens, routing_weight, routed_scaling_factor, dtype=F32):
    """The per-row factor ``fl(w * f)`` (fp32), or None without a routing weight."""
    if routing_weight is None:
        return None
    w = routing_weight.reshape(tokens).float() * torch.tensor(routed_scaling_factor, dtype=F32)
    return w.to(dtype)


def _swiglu_x_rows(x, x_sf=None, x_layout=None):
    """``x``'s ``(T, 2 H)`` fp32 rows (a quantized ``x`` dequantized as ``cast_back`` does)."""
    if x_sf is not None:
        return quant_reference().cast_back_ref(x, x_sf, x_layout, F32)
    return x.reshape(-1, x.shape[-1]).float()


def _swiglu_cast(rows2d, layout):
    q = quant_reference().per_token_cast_ref(rows2d, layout)
    return q[0], q[1]


def swiglu_forward_ref(x, routing_weight=None, routed_scaling_factor=1.0, clamp=None, clamped_count=None,
                       expert_offsets=None, alignment=128, layout=None, with_y=False):
    """The op ``swiglu_forward`` on the CPU: fp32 ``fl(fl(fl(g / fl(1 + exp(-g))) * u) * fl(w * f))`` rounded once
    to ``x``'s dtype, padding rows zero; the counters of the rows of the segments; the per-token cast of the
    rounded ``y``."""
    x2 = _swiglu_x_rows(x)
    tokens, hidden = x2.shape[0], x2.shape[1] // 2
    valid = swiglu_rows_valid(tokens, expert_offsets, alignment)
    g, u = _swiglu_halves(x2, None)
    if clamped_count is not None:
        c = torch.tensor(clamp, dtype=F32)
        counts = [(g > c)[valid].sum(), (u > c)[valid].sum(), (u < -c)[valid].sum(), valid.sum() * hidden]
        clamped_count += torch.stack(counts).to(clamped_count.dtype)
    g, u = _swiglu_halves(x2, clamp)
    act = g / (1 + torch.exp(-g)) * u
    w = _swiglu_weight(tokens, routing_weight, routed_scaling_factor)
    if w is not None:
        act = act * w[:, None]
    y2 = torch.where(valid[:, None], act, torch.zeros((), dtype=F32)).to(x.dtype)
    y = y2.reshape(*x.shape[:-1], hidden)
    if layout is None:
        return y, x.new_empty((0,)), x.new_empty((0,))
    data, sf = _swiglu_cast(y2, layout)
    return (y if with_y else x.new_empty((0,))), data, sf


def swiglu_backward_ref(grad_y, x, routing_weight=None, routed_scaling_factor=1.0, clamp=None, expert_offsets=None,
                        alignment=128, recompute=False, x_sf=None, x_layout=None, layout=None):
    """The op ``swiglu_backward`` on the CPU, fp32: ``s = fl(1 / fl(1 + exp(-g)))``, ``d = fl(fl(dy * w) * s)``,
    ``grad_g = fl(fl(d * u) * fl(1 + fl(g * fl(1 - s))))``, ``grad_u = fl(d * g)`` (zero where clamped),
    ``grad_routing_weight = fl(f * sum_h fl(dy * fl(silu(g) * u)))``, padding rows zero; the recomputed ``y`` as
    :func:`swiglu_forward_ref`'s; the per-token cast of the rounded ``grad_x``."""
    x2 = _swiglu_x_rows(x, x_sf, x_layout)
    tokens, hidden = x2.shape[0], x2.shape[1] // 2
    dtype = grad_y.dtype
    valid = swiglu_rows_valid(tokens, expert_offsets, alignment)
    g0, u0 = _swiglu_halves(x2, None)
    g, u = _swiglu_halves(x2, clamp)
    dy = grad_y.reshape(tokens, hidden).float()
    w = _swiglu_weight(tokens, routing_weight, routed_scaling_factor)
    e1 = 1 + torch.exp(-g)
    s = 1 / e1
    d = (dy * w[:, None] if w is not None else dy) * s
    grad_g = d * u * (1 + g * (1 - s))
    grad_u = d * g
    if clamp is not None:
        c = torch.tensor(clamp, dtype=F32)
        grad_g = torch.where(g0 > c, torch.zeros((), dtype=F32), grad_g)
        grad_u = torch.where((u0 > c) | (u0 < -c), torch.zeros((), dtype=F32), grad_u)
    zero = torch.zeros((), dtype=F32)
    grad_x2 = torch.where(valid[:, None], torch.cat([grad_g, grad_u], 1), zero).to(dtype)
    act = g / e1 * u
    lead = tuple(grad_y.shape[:-1])
    grad_x = grad_x2.reshape(*lead, 2 * hidden)
    empty = grad_y.new_empty((0,))
    grad_w = empty
    if w is not None:
        grad_w = torch.where(valid, (dy * act).sum(1) * torch.tensor(routed_scaling_factor, dtype=F32), zero)
    y = empty
    if recompute:
        yr = act * w[:, None] if w is not None else act
        y = torch.where(valid[:, None], yr, zero).to(dtype).reshape(*lead, hidden)
    if layout is None:
        return grad_x, grad_w, y, grad_y.new_empty((0,)), grad_y.new_empty((0,))
    data, sf = _swiglu_cast(grad_x2, layout)
    return grad_x, grad_w, y, data, sf


def swiglu_forward_f64(x, routing_weight=None, routed_scaling_factor=1.0, clamp=None, expert_offsets=None,
                       alignment=128) -> torch.Tensor:
    """The float64 oracle of ``y`` ``(T, H)`` (unrounded) from the same inputs."""
    x2 = x.reshape(-1, x.shape[-1]).to(F64)
    tokens = x2.shape[0]
    g, u = _swiglu_halves(x2, clamp, F64)
    act = g * torch.sigmoid(g) * u
    w = _swiglu_weight(tokens, routing_weight, routed_scaling_factor, F64)
    if w is not None:
        act = act * w[:, None]
    valid = swiglu_rows_valid(tokens, expert_offsets, alignment)
    return torch.where(valid[:, None], act, torch.zeros((), dtype=F64))


def swiglu_backward_f64(grad_y, x2, routing_weight=None, routed_scaling_factor=1.0, clamp=None, expert_offsets=None,
                        alignment=128):
    """The float64 oracle from ``x``'s fp32 rows ``x2`` (dequantized already): ``(grad_x (T, 2 H), the magnitude of
    grad_x's terms (T, 2 H): |d u| (1 + |g| (1 - s)) and |d g|, grad_routing_weight (T,) or None, the magnitude of
    its terms f sum_h |dy act| (T,))``, the magnitudes scaling the tolerances of docs/ops/norm.md#swiglu."""
    tokens, hidden = x2.shape[0], x2.shape[1] // 2
    x2 = x2.to(F64)
    g0, u0 = _swiglu_halves(x2, None, F64)
    g, u = _swiglu_halves(x2, clamp, F64)
    dy = grad_y.reshape(tokens, hidden).to(F64)
    w = _swiglu_weight(tokens, routing_weight, routed_scaling_factor, F64)
    s = torch.sigmoid(g)
    d = dy * w[:, None] * s if w is not None else dy * s
    grad_g = d * u * (1 + g * (1 - s))
    grad_u = d * g
    size = torch.cat([(d * u).abs() * (1 + g.abs() * (1 - s)), (d * g).abs()], 1)
    if clamp is not None:
        grad_g = torch.where(g0 > clamp, 0.0, grad_g)
        grad_u = torch.where((u0 > clamp) | (u0 < -clamp), 0.0, grad_u)
    valid = swiglu_rows_valid(tokens, expert_offsets, alignment)[:, None]
    grad_x = torch.where(valid, torch.cat([grad_g, grad_u], 1), 0.0)
    terms = dy * g * s * u
    grad_w = None
    if w is not None:
        grad_w = torch.where(valid[:, 0], terms.sum(1) * routed_scaling_factor, 0.0)
    return grad_x, torch.where(valid, size, 0.0), grad_w, terms.abs().sum(1) * abs(routed_scaling_factor)
