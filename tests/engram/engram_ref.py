"""Device-free PyTorch references of the Engram gate family (docs/ops/engram.md).

They are the numerical oracle of the tests (never part of the package): the fp32 forward and
backward with the ops' exact output contracts (masked tokens, zero statistics, per-worker weight
partials), and a differentiable float64 model of the gate used to check the backward formulas
against autograd.
"""

import math

import torch

HC_MULT = 4


def calc_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative squared error in float64, ``sum((a - b)^2) / sum(a^2 + b^2)`` (0 for two zero tensors): the
    peer's test metric."""
    a, b = a.double(), b.double()
    denominator = (a.square() + b.square()).sum()
    return 0.0 if denominator == 0 else ((a - b).square().sum() / denominator).item()


def engram_fused_weight_ref(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """``f32(wh) * f32(we)``: exact in fp32 (8-bit by 8-bit significands)."""
    return weight_hidden.float() * weight_embed.float()


def _signed_sqrt(z: torch.Tensor, clamp_value: float) -> torch.Tensor:
    # copysign semantics: z = +0 gives +sqrt(clamp), as the kernels compute it (decision 6).
    return torch.copysign(torch.sqrt(torch.clamp_min(z.abs(), clamp_value)), z)


def engram_gate_forward_ref(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
    image_token_mask: torch.Tensor | None = None,
    residual: bool = True,
):
    """fp32 reference of ``engram_gate_forward`` with the op's output contract.

    Returns:
        ``(output bf16 (T, m, H), dot, gate_score, rstd_x, rstd_k)``; the statistics are ``(T, m)``
        fp32 (zeros on masked tokens) or empty ``(0,)`` tensors when not saving. ``residual=False``:
        the output is ``bf16(g*v)``, zeros on masked tokens.
    """
    tokens, m, hidden = hidden_states.shape
    x = hidden_states.float()
    k = kv[:, :m].float()
    v = kv[:, m].float()
    raw = (x * weight_fused.float() * k).sum(-1)
    rstd_x = torch.rsqrt(x.square().sum(-1) / hidden + eps)
    rstd_k = torch.rsqrt(k.square().sum(-1) / hidden + eps)
    z = raw * rstd_x * rstd_k * (hidden ** -0.5)
    gate = torch.sigmoid(_signed_sqrt(z, clamp_value))
    gated = gate.unsqueeze(-1) * v.unsqueeze(1)
    out = (x + gated if residual else gated).to(torch.bfloat16)
    stats = [raw, gate, rstd_x, rstd_k]
    if image_token_mask is not None:
        keep = image_token_mask.view(tokens, 1, 1)
        out = torch.where(keep, hidden_states if residual else torch.zeros_like(out), out)
        stats = [torch.where(image_token_mask.view(tokens, 1), torch.zeros_like(s), s) for s in stats]
    if not save_for_backward:
        stats = [x.new_empty((0,)) for _ in stats]
    return (out.contiguous(), *[s.contiguous() for s in stats])


def engram_gate_forward_inplace_ref(hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask=None) -> None:
    """In-place variant: writes the reference output into ``hidden_states``."""
    out = engram_gate_forward_ref(hidden_states, kv, weight_fused, eps, clamp_value, False, image_token_mask)[0]
    hidden_states.copy_(out)


def worker_ranges(tokens: int, partials: int) -> list[tuple[int, int]]:
    """The fixed token partition of the weight-gradient partials: worker ``p`` owns
    ``[p*ceil(T/P), min((p+1)*ceil(T/P), T))`` (possibly empty)."""
    per = -(-tokens // partials) if tokens else 0
    return [(min(p * per, tokens), min((p + 1) * per, tokens)) for p in range(partials)]


def engram_gate_backward_ref(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
    image_token_mask: torch.Tensor | None = None,
    residual: bool = True,
    partials: int = 1,
    outputs=None,
):
    """fp32 reference of ``engram_gate_backward`` from the closed-form gradients (docs/ops/engram.md#gate); with
    the op's ``outputs``, its partial rows as they are allocated.

    Computes in the dtype of ``dot`` (fp32 normally; float64 in the autograd cross-check).
    ``residual=False`` (the forward wrote ``g*v`` alone): ``grad_x`` without ``grad_out``, zeros on masked
    tokens.

    Returns:
        ``(grad_x (T, m, H), grad_kv (T, m + 1, H), grad_w_partial (partials, m, H))``; bf16
        gradients when the inputs are bf16, else in the compute dtype.
    """
    tokens, m, hidden = hidden_states.shape
    ct = dot.dtype
    go = grad_out.to(ct)
    x = hidden_states.to(ct)
    k = kv[:, :m].to(ct)
    v = kv[:, m].to(ct)
    wf = weight_fused.to(ct)
    scale = hidden ** -0.5
    big_g = (go * v.unsqueeze(1)).sum(-1)
    c = scale * rstd_x * rstd_k
    active = dot.abs() * c >= clamp_value
    safe = torch.where(active, dot.abs(), torch.ones_like(dot))
    beta = torch.where(active, big_g * gate_score * (1 - gate_score) * 0.5 * torch.sqrt(c / safe), torch.zeros_like(dot))
    alpha_x = dot * rstd_x.square() / hidden
    alpha_k = dot * rstd_k.square() / hidden
    b = beta.unsqueeze(-1)
    grad_x = b * (k * wf - x * alpha_x.unsqueeze(-1))
    if residual:
        grad_x = go + grad_x
    grad_k = b * (x * wf - k * alpha_k.unsqueeze(-1))
    grad_v = (go * gate_score.unsqueeze(-1)).sum(1)
    contrib = b * x * k
    if image_token_mask is not None:
        masked = image_token_mask.view(tokens, 1, 1)
        grad_x = torch.where(masked, go if residual else torch.zeros_like(grad_x), grad_x)
        grad_k = torch.where(masked, torch.zeros_like(grad_k), grad_k)
        grad_v = torch.where(image_token_mask.view(tokens, 1), torch.zeros_like(grad_v), grad_v)
        contrib = torch.where(masked, torch.zeros_like(contrib), contrib)
    out_dtype = grad_out.dtype
    grad_kv = torch.cat([grad_k, grad_v.unsqueeze(1)], dim=1)
    if outputs is not None:
        partials = outputs[2].shape[0]
    partial = torch.stack([contrib[lo:hi].sum(0) for lo, hi in worker_ranges(tokens, partials)])
    if out_dtype == torch.bfloat16:
        # f32 of a bf16 value converts back exactly, so masked rows stay bit-equal to grad_out.
        grad_x = grad_x.to(out_dtype)
        grad_kv = grad_kv.to(out_dtype)
    return grad_x.contiguous(), grad_kv.contiguous(), partial.to(dot.dtype).contiguous()


def engram_grad_w_reduce_ref(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed) -> None:
    """In place: ``gw = sum_p partial[p]`` (p ascending, fp32), then the two ``+=`` updates."""
    gw = grad_w_partial.new_zeros(grad_w_partial.shape[1:]) if grad_w_partial.shape[0] == 0 else \
        grad_w_partial[0].clone()
    for p in range(1, grad_w_partial.shape[0]):
        gw += grad_w_partial[p]
    grad_weight_hidden += gw * weight_embed.float()
    grad_weight_embed += gw * weight_hidden.float()


def gate_model(hidden_states, kv, weight_hidden, weight_embed, eps, clamp_value, image_token_mask=None,
               residual=True):
    """The gate as a differentiable function of ``x, kv, wh, we`` (any float dtype, no rounding):
    ``out = x + sigmoid(signed_sqrt(<RMSNorm(x; wh), RMSNorm(k; we)> / sqrt(H))) * v`` (without ``x`` when
    not ``residual``; masked tokens then 0)."""
    tokens, m, hidden = hidden_states.shape
    x, k, v = hidden_states, kv[:, :m], kv[:, m]
    xn = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight_hidden
    kn = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps) * weight_embed
    z = (xn * kn).sum(-1) / math.sqrt(hidden)
    gate = torch.sigmoid(_signed_sqrt(z, clamp_value))
    out = gate.unsqueeze(-1) * v.unsqueeze(1)
    if residual:
        out = x + out
    if image_token_mask is not None:
        out = torch.where(image_token_mask.view(tokens, 1, 1), x if residual else torch.zeros_like(out), out)
    return out


def make_inputs(tokens: int, hidden: int, *, device="cpu", masked: bool = False, generator=None):
    """Random gate inputs as the tests draw them: randn bf16 ``x, kv, wh, we``; mask ``t % 4 < 2``."""
    m = HC_MULT

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    x = randn(tokens, m, hidden)
    kv = randn(tokens, m + 1, hidden)
    wh = randn(m, hidden)
    we = randn(m, hidden)
    mask = (torch.arange(tokens, device=device) % 4 < 2) if masked else None
    return x, kv, wh, we, mask


# ---- Engram Sinkhorn optimizer ops (cann_ops_tilelang.engram.sinkhorn) ----------------------------------


def engram_sinkhorn_momentum_update_ref(grad, momentum_buffer, beta1, nesterov):
    """``m = f32(buf) * beta1 + f32(grad) * (1 - beta1)`` in fp32 with every product and sum rounded on its own,
    stored into ``momentum_buffer`` (in place); returns the Nesterov look-ahead ``m * beta1 + g * (1 - beta1)``
    or ``m`` (fp32, new). Torch multiplies an fp32 tensor by a Python float in fp32 (the scalar rounded once),
    exactly as the kernels do with their two fp32 scalars."""
    g = grad.float()
    m = momentum_buffer.float() * beta1 + g * (1.0 - beta1)
    momentum_buffer.copy_(m)
    if nesterov:
        return m * beta1 + g * (1.0 - beta1)
    return m.clone()


def sinkhorn_worker_rows(rows: int, partials: int) -> list[tuple[int, int]]:
    """The contiguous row range ``[p * ceil(R / P), (p + 1) * ceil(R / P))`` of each worker, clipped to R."""
    per = -(-rows // partials) if rows else 0
    return [(min(p * per, rows), min((p + 1) * per, rows)) for p in range(partials)]


def engram_sinkhorn_step_ref(matrix, row_scale, col_scale, eps, outputs=None):
    """One row-normalization step of ``diag(row_scale) A diag(col_scale)``; ``row_scale`` updated in place.
    Returns ``(row_norm, col_sumsq_partial)``: the partial rows are the worker partition of the op (``P`` from
    the op's allocated outputs, else the CUDA count 528), each the column sum of squares of the normalized
    rows it owns."""
    partials = outputs[1].shape[0] if outputs is not None else 528
    x = (row_scale.unsqueeze(1) * matrix) * col_scale
    row_norm = x.square().sum(1).sqrt()
    row_scale.copy_(row_scale / (row_norm + eps))
    y2 = ((row_scale.unsqueeze(1) * matrix) * col_scale).square()
    partial = matrix.new_zeros((partials, matrix.shape[1]))
    for p, (lo, hi) in enumerate(sinkhorn_worker_rows(matrix.shape[0], partials)):
        if hi > lo:
            partial[p] = y2[lo:hi].sum(0)
    return row_norm, partial


def _f32(x):
    """``x`` (a number or tensor) rounded to fp32, returned in float64: a float64 sum, product, quotient or
    square root of fp32 values rounded this way is the correctly rounded fp32 operation (53 >= 2 * 24 + 2
    bits: no double-rounding error), the IEEE arithmetic the kernels use. Torch's own fp32 CPU kernels are not
    all correctly rounded (its vectorized fp32 ``sqrt`` is not), so the bitwise references go through this."""
    if isinstance(x, torch.Tensor):
        return x.float().double()
    return torch.tensor(x, dtype=torch.float32).double()


def engram_sinkhorn_step_reduce_ref(col_sumsq_partial, col_sumsq, col_scale, rows, eps):
    """``col_sumsq = sum_p partial[p]``, p ascending from row 0, one fp32 rounding per addition (the kernels'
    order: bitwise); then ``balance = f32(D) / f32(rows)`` and ``col_scale <- col_scale / (sqrt(col_sumsq *
    balance) + eps)`` where ``col_sumsq > 0`` (in place; torch rounds ``eps`` to fp32 and each operation once,
    IEEE square root and division, as the kernels do)."""
    if col_sumsq_partial.shape[0] == 0:
        col_sumsq.zero_()
        return
    acc = col_sumsq_partial[0].clone()
    for p in range(1, col_sumsq_partial.shape[0]):
        acc = acc + col_sumsq_partial[p]
    col_sumsq.copy_(acc)
    balance = _f32(_f32(col_sumsq.shape[0]) / _f32(rows))
    norm = _f32(_f32(_f32(acc.double() * balance).sqrt()) + _f32(eps))
    col_scale.copy_(torch.where(acc > 0, _f32(col_scale.double() / norm).float(), col_scale))


def engram_sinkhorn_finalize_ref(matrix, row_scale, col_scale, eps, alpha):
    """``x = (row_scale * A) * col_scale``; ``out = x * (alpha / (||x_i|| + eps))`` per row (fp32, new)."""
    x = (row_scale.unsqueeze(1) * matrix) * col_scale
    norm = x.square().sum(1).sqrt()
    return x * (alpha / (norm + eps)).unsqueeze(1)


def engram_sinkhorn_finalize_out_ref(matrix, row_scale, col_scale, eps, alpha, out):
    out.copy_(engram_sinkhorn_finalize_ref(matrix, row_scale, col_scale, eps, alpha))


def engram_sinkhorn_finalize_apply_ref(matrix, row_scale, col_scale, eps, alpha, param, lr, decay):
    """``param <- (f32(param) * decay) - (U * lr)`` in place, ``U`` the finalize's result; each product and the
    difference rounded to fp32 on its own (the scalars rounded to fp32), one cast back to bf16."""
    u = engram_sinkhorn_finalize_ref(matrix, row_scale, col_scale, eps, alpha)
    param.copy_(_f32(_f32(param.double() * _f32(decay)) - _f32(u.double() * _f32(lr))).float())


def engram_sinkhorn_update_model(grad, momentum, beta1, nesterov, iters, eps, alpha):
    """The optimizer's update direction written plainly in fp32 (explicit iterate, no scales): momentum as above,
    then ``iters`` times {rows to unit norm; columns to the balanced norm sqrt(R / D)}, then rows to norm
    ``alpha`` — the explicit iterate instead of the implicit scales (tests compare within fp32 tolerance)."""
    g = grad.float()
    m = momentum.float() * beta1 + g * (1.0 - beta1)
    x = (m * beta1 + g * (1.0 - beta1)) if nesterov else m.clone()
    rows, cols = x.shape
    for _ in range(iters):
        x = x / (x.norm(dim=1, keepdim=True) + eps)
        cn = x.norm(dim=0) * math.sqrt(cols / rows)
        x = torch.where(cn > 0, x / (cn + eps), x)
    return alpha * x / (x.norm(dim=1, keepdim=True) + eps), m


def engram_hash_ref(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask=None):
    """Reference of ``engram_hash`` (docs/ops/engram.md#hash), in int64 as written: for layer ``l``, order
    ``n = j + 2`` and table ``e``, ``h = XOR_{k<n} int64(id_k) * multipliers[l, k]`` (wrapping products),
    ``torch.remainder(h, vocab_sizes[l, j, e])`` (the sign of the size), plus ``offsets[l, j*E + e]``, kept to
    the low 32 bits (int32 wrap-around); masked tokens give -1.

    Returns:
        ``(L, T, (N-1)*E)`` int32.
    """
    layers, orders, tables = vocab_sizes.shape
    ids = ngram_token_ids.to(torch.int64)
    columns = []
    for j in range(orders):
        # (L, T): the XOR of the first j + 2 products
        h = ids[:, 0].unsqueeze(0) * multipliers[:, 0:1]
        for k in range(1, j + 2):
            h = torch.bitwise_xor(h, ids[:, k].unsqueeze(0) * multipliers[:, k : k + 1])
        rows = torch.remainder(h.unsqueeze(-1), vocab_sizes[:, j].to(torch.int64).unsqueeze(1))  # (L, T, E)
        columns.append(rows + offsets[:, j * tables : (j + 1) * tables].to(torch.int64).unsqueeze(1))
    wide = torch.cat(columns, dim=-1) if columns else ids.new_empty((layers, ids.shape[0], 0))
    # two's complement low 32 bits: x - 2**32 where bit 31 is set
    low = torch.bitwise_and(wide, 0xFFFFFFFF)
    out = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
    if image_token_mask is not None:
        out = out.masked_fill(image_token_mask.view(1, -1, 1), -1)
    return out.contiguous()


def make_hash_inputs(tokens: int, ngram: int = 3, layers: int = 2, tables: int = 8, *, device="cpu",
                     masked: bool = False, generator=None, extreme: bool = False):
    """Random ``engram_hash`` inputs: ids in ``[0, 2**31)`` (``extreme``: the whole int32 range with the
    edges), multipliers in ``[1, 2**62)`` (``extreme``: the whole int64 range), table sizes log-uniform in
    ``[1, 2**31)`` (``extreme``: near ``2**31 - 1``, and ``1``, ``2``), offsets the int32 exclusive prefix sum
    (wrapping); mask ``t % 4 < 2``."""
    i32 = torch.iinfo(torch.int32)
    i64 = torch.iinfo(torch.int64)
    if extreme:
        ids = torch.randint(i32.min, i32.max + 1, (tokens, ngram), generator=generator, dtype=torch.int64)
        edge = torch.tensor([i32.min, i32.max, -1, 0, 1, i32.min + 1], dtype=torch.int64)
        ids.view(-1)[: min(ids.numel(), edge.numel())] = edge[: min(ids.numel(), edge.numel())]
        mult = torch.randint(i64.min, i64.max, (layers, ngram), generator=generator, dtype=torch.int64)
        mult.view(-1)[:3] = torch.tensor([i64.max, i64.min, -1])[: min(3, mult.numel())]
        sizes = torch.randint(2**31 - 1000, 2**31, (layers, ngram - 1, tables), generator=generator)
        sizes.view(-1)[:2] = torch.tensor([1, 2])[: min(2, sizes.numel())]
    else:
        ids = torch.randint(0, 2**31, (tokens, ngram), generator=generator, dtype=torch.int64)
        mult = torch.randint(1, 2**62, (layers, ngram), generator=generator, dtype=torch.int64)
        # log-uniform in [1, 2**31): every magnitude of table size (the layer's primes are ~10**5 - 10**7)
        bits = torch.rand((layers, ngram - 1, tables), generator=generator, dtype=torch.float64) * 31
        sizes = torch.exp2(bits).floor().clamp(1, 2**31 - 1).to(torch.int64)
    ids, sizes = ids.to(torch.int32), sizes.to(torch.int32)
    flat = sizes.view(layers, -1).to(torch.int64)
    prefix = torch.cumsum(flat, dim=1) - flat  # exclusive; kept to int32 by wrapping
    low = torch.bitwise_and(prefix, 0xFFFFFFFF)
    offsets = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
    mask = (torch.arange(tokens) % 4 < 2) if masked else None
    return [None if t is None else t.to(device) for t in (ids, mult, sizes, offsets, mask)]


def engram_layer_model(hidden_states, hash_ids, table, kv_weight, kv_bias, weight_hidden, weight_embed,
                       conv_norm_weight, conv_weight, *, max_ngram_size, gate_eps, conv_eps, clamp_value=1e-6,
                       stored=None):
    """The Engram layer of DeepSeek's demo (deepseek-ai/Engram ``engram_demo_v1.py``: ``Engram.forward`` plus
    the ``TransformerBlock`` residual), written out in plain PyTorch for autograd in any float dtype.

    ``hidden_states (B, L, m, H)``, ``hash_ids (B, L, J)`` (rows of the concatenated table), ``table (rows, D)``,
    ``kv_weight ((m+1)·H, J·D)`` / ``kv_bias ((m+1)·H,)`` (key projection of stream h in rows h·H..(h+1)·H, the
    value projection last), the gate's norm weights ``weight_hidden`` (the demo's ``norm2``, on the hidden
    stream) and ``weight_embed`` (``norm1``, on the key), ``conv_norm_weight (m, H)`` (``ShortConv.norms``),
    ``conv_weight (m·H, 1, K)``. The signed square root uses the demo's ``sign`` (0 at exactly 0).

    ``stored``: None, or the dtype in which an implementation stores the projections ``k, v`` and the gated
    value ``g·v`` (bf16): their values are rounded to it in the forward and the gradients pass through
    unchanged (the math stays the demo's; only the points the gate reads are moved to representable values,
    where the signed square root's 1/sqrt|z| slope would otherwise amplify storage rounding)."""
    batch, length, m, hidden = hidden_states.shape

    def store(t):
        return t if stored is None else t + (t.to(stored).to(t.dtype) - t).detach()

    def rms_norm(t, weight, eps):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * weight

    memory = table[hash_ids].flatten(-2)
    gates = []
    for h in range(m):
        key = store(memory @ kv_weight[h * hidden:(h + 1) * hidden].T + kv_bias[h * hidden:(h + 1) * hidden])
        dot = (rms_norm(key, weight_embed[h], gate_eps) * rms_norm(hidden_states[:, :, h], weight_hidden[h], gate_eps)).sum(-1)
        z = dot / math.sqrt(hidden)
        gates.append(torch.sigmoid(z.abs().clamp_min(clamp_value).sqrt() * z.sign()).unsqueeze(-1))
    value = store(memory @ kv_weight[m * hidden:].T + kv_bias[m * hidden:])
    gated = store(torch.stack(gates, dim=2) * value.unsqueeze(2))
    # ShortConv: per-stream RMSNorm, channels stream-major, depthwise conv padded (K-1)·dilation on both
    # sides and cut to the first L outputs (causal), SiLU
    normed = torch.cat([rms_norm(gated[:, :, h], conv_norm_weight[h], conv_eps) for h in range(m)], dim=-1)
    taps = conv_weight.shape[-1]
    conv = torch.nn.functional.conv1d(normed.transpose(1, 2), conv_weight, padding=(taps - 1) * max_ngram_size,
                                      dilation=max_ngram_size, groups=m * hidden)[..., :length]
    short = torch.nn.functional.silu(conv).transpose(1, 2).reshape(batch, length, m, hidden)
    return (gated + short) + hidden_states
