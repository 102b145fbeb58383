"""Device-free PyTorch references of the norm family (docs/ops/norm.md).

The ``<op>_ref`` of a declared op takes the op's arguments and returns its outputs (writing its buffers): the
test plugin registers it as the op's CPU kernel. fp32 arithmetic in the contract's order where the kernels are
compared bitwise (the fused cast's bytes), float64 oracles (``*_f64``) for the tolerances of docs/ops/norm.md.
"""

import torch

F32, F64 = torch.float32, torch.float64


# --- swiglu ---------------------------------------------------------------------------------------------------

def quant_ref_module():
    """tests/quant/quant_ref.py (the fused casts' bytes are its per-token cast of the rounded result)."""
    import sys
    from pathlib import Path

    path = str(Path(__file__).resolve().parent.parent / "quant")
    if path not in sys.path:
        sys.path.insert(0, path)
    import quant_ref

    return quant_ref


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
        return quant_ref_module().cast_back_ref(x, x_sf, x_layout, F32)
    return x.reshape(-1, x.shape[-1]).float()


def _swiglu_cast(rows2d, layout):
    q = quant_ref_module().per_token_cast_ref(rows2d, layout)
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
