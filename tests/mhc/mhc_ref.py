"""Device-free PyTorch references of the mHC primitives (docs/ops/mhc.md).

Each ``*_ref`` function follows the op's contract: same arguments (buffers the op writes are written
here too), accumulation orders where the contract fixes them, fp32 arithmetic. The ``*_model``
functions are the differentiable maths (any float dtype) used to check the references' backward
formulas against autograd in float64.
"""

import torch

HC_MULT = 4


def _f(t: torch.Tensor) -> torch.Tensor:
    """fp32 view of an op input; float64 stays float64 (the autograd cross-checks run in float64)."""
    return t if t.dtype == torch.float64 else t.float()


def m3(m: int = HC_MULT) -> int:
    return m * (m + 2)


# --- B.2.1 expand --------------------------------------------------------------------------------------


def expand_to_mhc_forward_ref(x, out) -> None:
    out.copy_(x.unsqueeze(1).expand(out.shape))


def expand_to_mhc_backward_ref(grad_out, grad_x) -> None:
    acc = _f(grad_out[:, 0])
    for i in range(1, grad_out.shape[1]):
        acc = acc + _f(grad_out[:, i])
    grad_x.copy_(acc.to(grad_x.dtype))


# --- B.2.2 normw merge ---------------------------------------------------------------------------------


def mhc_fn_normw_merge_forward_ref(fn, normw, out_fn) -> None:
    out_fn.copy_(fn * normw)


def mhc_fn_normw_merge_backward_ref(fn, normw, grad_out_fn, grad_fn, grad_normw) -> None:
    grad_fn += grad_out_fn * normw
    row_sum = torch.zeros_like(normw)
    for r in range(fn.shape[0]):
        row_sum = row_sum + grad_out_fn[r] * fn[r]
    grad_normw += row_sum


# --- B.2.3 pre-norm GEMM with sum of squares ----------------------------------------------------------------


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 (10 mantissa bits), rounding half away from zero on the 13 dropped bits."""
    bits = t.float().contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & ~0x1FFF
    keep = torch.isfinite(t.float())
    return torch.where(keep, rounded.view(torch.float32), t.float())


def split_ranges(k: int, n_splits: int) -> list[tuple[int, int]]:
    """Column ranges of the split-K partials: ``K/64`` blocks, split ``s`` gets ``nb // S`` blocks plus
    one when ``s < nb % S``, in order."""
    blocks = k // 64
    ranges, start = [], 0
    for s in range(n_splits):
        count = blocks // n_splits + (1 if s < blocks % n_splits else 0)
        ranges.append((start * 64, (start + count) * 64))
        start += count
    return ranges


def mhc_gemm_with_sqrsum_forward_ref(x, fn, n_splits):
    """Returns ``(out_mul_part (S, T, M3), sqrsum_part (S, T))``: TF32 ``fn`` (x is exact), fp64
    accumulation rounded to fp32 (the tolerance-tested oracle)."""
    xd = x.double()
    fd = tf32_round(fn).double()
    parts, sqs = [], []
    for lo, hi in split_ranges(x.shape[1], n_splits):
        parts.append((xd[:, lo:hi] @ fd[:, lo:hi].T).float())
        sqs.append(xd[:, lo:hi].square().sum(-1).float())
    return torch.stack(parts).contiguous(), torch.stack(sqs).contiguous()


def mhc_gemm_with_sqrsum_backward_ref(grad_out_mul, grad_sqrsum, x, fn, grad_x):
    """Accumulates into ``grad_x`` (bf16 read-modify-write); returns ``grad_fn (M3, K)`` fp32."""
    xf = x.double()
    g = grad_out_mul.double()
    delta = g @ fn.double() + 2 * xf * grad_sqrsum.double().unsqueeze(-1)
    acc = torch.float64 if grad_x.dtype == torch.float64 else torch.float32  # float64 in the autograd check
    grad_x.copy_((grad_x.to(acc) + delta.to(acc)).to(grad_x.dtype))
    return (g.T @ xf).to(grad_out_mul.dtype).contiguous()


# --- B.2.4 reduce partials + RMSNorm -------------------------------------------------------------------------


def mhc_reduce_partials_and_rmsnorm_forward_ref(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out,
                                                rms_group_size, rms_eps, n_splits) -> None:
    om = out_mul_splitted[0].clone()
    sq = sqrsum_splitted[0].clone()
    for s in range(1, n_splits):
        om = om + out_mul_splitted[s]
        sq = sq + sqrsum_splitted[s]
    r = torch.rsqrt(sq / rms_group_size + rms_eps)
    res = torch.zeros_like(out)
    for g in range(om.shape[1]):
        res = res + om[:, g] * r[:, g : g + 1]
    out_mul.copy_(om)
    sqrsum.copy_(sq)
    out.copy_(res)


def mhc_reduce_partials_and_rmsnorm_backward_ref(grad_out, out_mul, sqrsum, grad_out_mul, grad_sqrsum,
                                                 rms_group_size, rms_eps) -> None:
    r = torch.rsqrt(sqrsum / rms_group_size + rms_eps)
    grad_out_mul.copy_(grad_out.unsqueeze(1) * r.unsqueeze(-1))
    rho = (grad_out.unsqueeze(1) * out_mul).sum(-1)
    grad_sqrsum.copy_(-rho * r / (2 * (sqrsum + rms_eps * rms_group_size)))


def reduce_rmsnorm_model(out_mul, sqrsum, rms_group_size, rms_eps):
    r = torch.rsqrt(sqrsum / rms_group_size + rms_eps)
    return (out_mul * r.unsqueeze(-1)).sum(1)


# --- B.2.5 split mixes ------------------------------------------------------------------------------------


def _segments(m, device):
    seg = torch.full((m3(m),), 2, dtype=torch.long, device=device)
    seg[:m] = 0
    seg[m : 2 * m] = 1
    return seg


def mhc_pre_split_mixes_forward_ref(input_mixes, mhc_scale, mhc_base, pre, post, comb, post_mult_value,
                                    pre_eps) -> None:
    m = pre.shape[1]
    z = input_mixes * mhc_scale[_segments(m, input_mixes.device)] + mhc_base
    pre.copy_(torch.sigmoid(z[:, :m]) + pre_eps)
    post.copy_(torch.sigmoid(z[:, m : 2 * m]) * post_mult_value)
    comb.copy_(z[:, 2 * m :])


def mhc_pre_split_mixes_backward_ref(grad_pre, grad_post, grad_comb, input_mixes, post, mhc_scale, mhc_base,
                                     grad_input_mixes, grad_mhc_scale, grad_mhc_base, post_mult_value) -> None:
    m = grad_pre.shape[1]
    seg = _segments(m, input_mixes.device)
    z = input_mixes * mhc_scale[seg] + mhc_base
    s = torch.sigmoid(z[:, :m])
    dz = torch.cat([grad_pre * s * (1 - s), grad_post * post * (1 - post / post_mult_value), grad_comb], dim=1)
    grad_input_mixes.copy_(dz * mhc_scale[seg])
    grad_mhc_base.copy_(dz.sum(0))
    prod = (dz * input_mixes).sum(0)
    grad_mhc_scale.copy_(torch.stack([prod[seg == c].sum() for c in range(3)]))


def split_mixes_model(input_mixes, mhc_scale, mhc_base, m, post_mult_value, pre_eps):
    z = input_mixes * mhc_scale[_segments(m, input_mixes.device)] + mhc_base
    return torch.sigmoid(z[:, :m]) + pre_eps, torch.sigmoid(z[:, m : 2 * m]) * post_mult_value, z[:, 2 * m :]


# --- B.2.6 Sinkhorn ------------------------------------------------------------------------------------------


def sinkhorn_model(x, repeat, eps):
    """The forward as differentiable torch ops (also the fp32 reference)."""
    y = torch.softmax(x, dim=-1) + eps
    y = y / (y.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        y = y / (y.sum(-1, keepdim=True) + eps)
        y = y / (y.sum(-2, keepdim=True) + eps)
    return y


def mhc_sinkhorn_forward_ref(comb, comb_out, repeat, eps) -> None:
    comb_out.copy_(sinkhorn_model(comb, repeat, eps))


def mhc_sinkhorn_backward_ref(grad_comb_out, comb, grad_comb, repeat, eps) -> None:
    """The recompute backward of B.2.6 (explicit per-step formulas)."""
    p = torch.softmax(comb, dim=-1)
    y = p + eps
    steps = []  # (axis, input, raw sum)
    axes = [-2] + [a for _ in range(repeat - 1) for a in (-1, -2)]
    for axis in axes:
        total = y.sum(axis, keepdim=True)
        steps.append((axis, y, total))
        y = y / (total + eps)
    g = grad_comb_out
    for axis, u, total in reversed(steps):
        denom = total + eps
        g = (g - (g * u).sum(axis, keepdim=True) / denom) / denom
    grad_comb.copy_((g - (g * p).sum(-1, keepdim=True)) * p)


# --- B.2.7 pre apply mix -----------------------------------------------------------------------------------


def mhc_pre_apply_mix_forward_ref(x, mix, out) -> None:
    acc = mix[:, 0:1] * _f(x[:, 0])
    for i in range(1, x.shape[1]):
        acc = acc + mix[:, i : i + 1] * _f(x[:, i])
    out.copy_(acc.to(out.dtype))


def mhc_pre_apply_mix_backward_ref(grad_out, x, mix, grad_x):
    og = _f(grad_out)
    grad_x.copy_((_f(grad_x) + mix.unsqueeze(-1) * og.unsqueeze(1)).to(grad_x.dtype))
    return (og.unsqueeze(1) * _f(x)).sum(-1)


def apply_mix_model(x, mix):
    return (mix.unsqueeze(-1) * x).sum(1)


# --- B.2.8 post --------------------------------------------------------------------------------------------


def mhc_post_forward_ref(x, residual, post_layer_mix, comb_res_mix):
    acc = post_layer_mix.unsqueeze(-1) * x.float().unsqueeze(1)
    for i in range(residual.shape[1]):
        acc = acc + comb_res_mix[:, i, :].unsqueeze(-1) * residual[:, i].float().unsqueeze(1)
    return acc.to(torch.bfloat16)


def mhc_post_forward_out_ref(x, residual, post_layer_mix, comb_res_mix, out) -> None:
    out.copy_(mhc_post_forward_ref(x, residual, post_layer_mix, comb_res_mix))


def mhc_post_backward_ref(x, residual, post_layer_mix, comb_res_mix, grad_out):
    do = grad_out.float()
    grad_x = (do * post_layer_mix.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    grad_residual = torch.einsum("nio,nod->nid", comb_res_mix, do).to(torch.bfloat16)
    grad_post = (do * x.float().unsqueeze(1)).sum(-1)
    grad_comb = torch.einsum("nid,nod->nio", residual.float(), do)
    return grad_x, grad_residual, grad_post, grad_comb


def post_model(x, residual, post_layer_mix, comb_res_mix):
    return post_layer_mix.unsqueeze(-1) * x.unsqueeze(1) + torch.einsum("nio,nid->nod", comb_res_mix, residual)


# --- B.2.9 head mix ----------------------------------------------------------------------------------------


def mhc_head_compute_mix_forward_ref(input_mix, mhc_scale, mhc_base, output_mix, pre_eps) -> None:
    output_mix.copy_(torch.sigmoid(input_mix * mhc_scale[0] + mhc_base) + pre_eps)


def worker_ranges(tokens: int, partials: int) -> list[tuple[int, int]]:
    per = -(-tokens // partials) if tokens else 0
    return [(min(p * per, tokens), min((p + 1) * per, tokens)) for p in range(partials)]


def mhc_head_compute_mix_backward_ref(grad_output_mix, input_mix, mhc_scale, mhc_base, grad_input_mix,
                                      grad_mhc_scale_partial, grad_mhc_base_partial) -> None:
    s = torch.sigmoid(input_mix * mhc_scale[0] + mhc_base)
    dz = grad_output_mix * s * (1 - s)
    grad_input_mix.copy_(dz * mhc_scale[0])
    for p, (lo, hi) in enumerate(worker_ranges(input_mix.shape[0], grad_mhc_scale_partial.shape[0])):
        grad_mhc_scale_partial[p, 0] = (dz[lo:hi] * input_mix[lo:hi]).sum()
        grad_mhc_base_partial[p] = dz[lo:hi].sum(0)


def head_mix_model(input_mix, mhc_scale, mhc_base, pre_eps):
    return torch.sigmoid(input_mix * mhc_scale[0] + mhc_base) + pre_eps


# --- fused ops: the chains they must equal bit for bit ------------------------------------------------------


def mhc_pre_big_fuse_ref(gemm_out_mul, gemm_out_sqrsum, mhc_scale, mhc_base, residual, post_mix, comb_mix,
                         layer_input, rms_eps, pre_eps, sinkhorn_eps, post_mult_value, sinkhorn_repeat,
                         n_splits=16) -> None:
    splits, tokens, mixes_n = gemm_out_mul.shape
    m, hidden = residual.shape[1:]
    new = lambda *shape: gemm_out_mul.new_empty(shape)  # noqa: E731
    out_mul, sqrsum, mixes = new(tokens, 1, mixes_n), new(tokens, 1), new(tokens, mixes_n)
    mhc_reduce_partials_and_rmsnorm_forward_ref(gemm_out_mul.view(splits, tokens, 1, mixes_n),
                                                gemm_out_sqrsum.view(splits, tokens, 1), out_mul, sqrsum, mixes,
                                                m * hidden, rms_eps, splits)
    pre, comb_logits = new(tokens, m), new(tokens, m * m)
    mhc_pre_split_mixes_forward_ref(mixes, mhc_scale, mhc_base, pre, post_mix, comb_logits, post_mult_value, pre_eps)
    mhc_sinkhorn_forward_ref(comb_logits.view(tokens, m, m), comb_mix.view(tokens, m, m), sinkhorn_repeat,
                             sinkhorn_eps)
    mhc_pre_apply_mix_forward_ref(residual, pre, layer_input)


def mhc_multilayer_recompute_ref(initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list,
                                 layer_input_list, residual_list) -> None:
    residual = initial_residual
    for layer, pre in enumerate(pre_mix_list):
        mhc_pre_apply_mix_forward_ref(residual, pre, layer_input_list[layer])
        if layer < len(layer_output_list):
            residual = mhc_post_forward_ref(layer_output_list[layer], residual, post_mix_list[layer],
                                            comb_mix_list[layer])
            residual_list[layer].copy_(residual)
