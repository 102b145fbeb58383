"""Argument factories of the mHC ops for the tests: ``make_args(op, tokens, hidden)`` returns the op's
arguments in schema order, drawn as the device tests need them (buffers an op accumulates into start with
random content so that the tests see the prior content used)."""

import torch

M = 4
M3 = M * (M + 2)
EPS = 1e-6
SPLITS = 16
PARTIALS = 8
SINKHORN_REPEAT = 10
RECOMPUTE_LAYERS = (3, 2)  # (L, Lp)


def _maker(gen, device):
    def randn(*shape, dtype=torch.float32, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=gen) * scale + shift
        return t.to(device=device, dtype=dtype)

    return randn


def make_args(op: str, tokens: int, hidden: int, *, seed: int = 0, device="cpu", repeat: int = SINKHORN_REPEAT,
              splits: int = SPLITS, logit_offset: float = 0.0, sinkhorn_eps: float = EPS):
    gen = torch.Generator().manual_seed(seed)
    randn = _maker(gen, device)
    k = M * hidden
    bf16 = torch.bfloat16

    def residual():
        # streams of slightly different scale, as the design's tests draw them
        scale = (1 + 0.01 * torch.arange(M, dtype=torch.float32)).view(1, M, 1).to(device)
        return (randn(tokens, M, hidden) * scale).to(bf16)

    def positive_sq(*shape):
        return (randn(*shape).abs() + 0.5) * k

    if op == "expand_to_mhc_forward":
        return [randn(tokens, hidden, dtype=bf16), torch.empty(tokens, M, hidden, dtype=bf16, device=device)]
    if op == "expand_to_mhc_backward":
        return [randn(tokens, M, hidden, dtype=bf16), torch.empty(tokens, hidden, dtype=bf16, device=device)]
    if op == "mhc_fn_normw_merge_forward":
        return [randn(M3, k, scale=1e-4), randn(k, scale=0.1, shift=1.0), torch.empty(M3, k, device=device)]
    if op == "mhc_fn_normw_merge_backward":
        return [randn(M3, k, scale=1e-4), randn(k, scale=0.1, shift=1.0), randn(M3, k), randn(M3, k), randn(k)]
    if op == "mhc_gemm_with_sqrsum_forward":
        return [residual().view(tokens, k), randn(M3, k, scale=1e-2), splits]
    if op == "mhc_gemm_with_sqrsum_backward":
        return [randn(tokens, M3), randn(tokens, scale=1e-3), residual().view(tokens, k), randn(M3, k, scale=1e-2),
                randn(tokens, k, dtype=bf16)]
    if op == "mhc_reduce_partials_and_rmsnorm_forward":
        return [randn(splits, tokens, 1, M3), positive_sq(splits, tokens, 1) / splits,
                torch.empty(tokens, 1, M3, device=device), torch.empty(tokens, 1, device=device),
                torch.empty(tokens, M3, device=device), k, EPS, splits]
    if op == "mhc_reduce_partials_and_rmsnorm_backward":
        return [randn(tokens, M3), randn(tokens, 1, M3), positive_sq(tokens, 1),
                torch.empty(tokens, 1, M3, device=device), torch.empty(tokens, 1, device=device), k, EPS]
    if op == "mhc_pre_split_mixes_forward":
        return [randn(tokens, M3), randn(3), randn(M3), torch.empty(tokens, M, device=device),
                torch.empty(tokens, M, device=device), torch.empty(tokens, M * M, device=device), 2.0, 1e-2]
    if op == "mhc_pre_split_mixes_backward":
        mixes, scale, base = randn(tokens, M3), randn(3), randn(M3)
        z = mixes[:, M : 2 * M] * scale[1] + base[M : 2 * M]
        post = torch.sigmoid(z) * 2.0
        return [randn(tokens, M), randn(tokens, M), randn(tokens, M * M), mixes, post, scale, base,
                torch.empty(tokens, M3, device=device), randn(3), randn(M3), 2.0]
    if op == "mhc_sinkhorn_forward":
        return [randn(tokens, M, M, shift=logit_offset), torch.empty(tokens, M, M, device=device), repeat,
                sinkhorn_eps]
    if op == "mhc_sinkhorn_backward":
        return [randn(tokens, M, M), randn(tokens, M, M, shift=logit_offset), torch.empty(tokens, M, M, device=device),
                repeat, sinkhorn_eps]
    if op == "mhc_pre_apply_mix_forward":
        return [torch.sigmoid(randn(tokens, M, hidden)).to(bf16), torch.softmax(randn(tokens, M), -1),
                torch.empty(tokens, hidden, dtype=bf16, device=device)]
    if op == "mhc_pre_apply_mix_backward":
        return [randn(tokens, hidden, dtype=bf16), torch.sigmoid(randn(tokens, M, hidden)).to(bf16),
                torch.softmax(randn(tokens, M), -1), randn(tokens, M, hidden, dtype=bf16)]
    if op in ("mhc_post_forward", "mhc_post_forward_out", "mhc_post_backward"):
        args = [randn(tokens, hidden, dtype=bf16), residual(), randn(tokens, M), randn(tokens, M, M)]
        if op == "mhc_post_forward_out":
            args.append(torch.empty(tokens, M, hidden, dtype=bf16, device=device))
        if op == "mhc_post_backward":
            args.append(randn(tokens, M, hidden, dtype=bf16))
        return args
    if op == "mhc_head_compute_mix_forward":
        return [randn(tokens, M), randn(1), randn(M), torch.empty(tokens, M, device=device), 1e-2]
    if op == "mhc_head_compute_mix_backward":
        return [randn(tokens, M), randn(tokens, M), randn(1), randn(M), torch.empty(tokens, M, device=device),
                torch.empty(PARTIALS, 1, device=device), torch.empty(PARTIALS, M, device=device)]
    if op == "mhc_pre_big_fuse":
        return [randn(splits, tokens, M3), positive_sq(splits, tokens) / splits, randn(3, scale=0.1),
                randn(M3, scale=0.1), residual(), torch.empty(tokens, M, device=device),
                torch.empty(tokens, M * M, device=device), torch.empty(tokens, hidden, dtype=bf16, device=device),
                EPS, EPS, sinkhorn_eps, 2.0, repeat, splits]
    if op == "mhc_multilayer_recompute":
        layers, kept = RECOMPUTE_LAYERS
        return [residual(), [torch.softmax(randn(tokens, M), -1) for _ in range(layers)],
                [randn(tokens, hidden, dtype=bf16) for _ in range(kept)],
                [torch.sigmoid(randn(tokens, M)) * 2 for _ in range(kept)],
                [torch.softmax(randn(tokens, M, M), -1) for _ in range(kept)],
                [torch.empty(tokens, hidden, dtype=bf16, device=device) for _ in range(layers)],
                [torch.empty(tokens, M, hidden, dtype=bf16, device=device) for _ in range(kept)]]
    raise KeyError(op)


OPS = [
    "expand_to_mhc_forward", "expand_to_mhc_backward", "mhc_fn_normw_merge_forward", "mhc_fn_normw_merge_backward",
    "mhc_gemm_with_sqrsum_forward", "mhc_gemm_with_sqrsum_backward", "mhc_reduce_partials_and_rmsnorm_forward",
    "mhc_reduce_partials_and_rmsnorm_backward", "mhc_pre_split_mixes_forward", "mhc_pre_split_mixes_backward",
    "mhc_sinkhorn_forward", "mhc_sinkhorn_backward", "mhc_pre_apply_mix_forward", "mhc_pre_apply_mix_backward",
    "mhc_post_forward", "mhc_post_forward_out", "mhc_post_backward", "mhc_head_compute_mix_forward",
    "mhc_head_compute_mix_backward", "mhc_pre_big_fuse", "mhc_multilayer_recompute",
]

# fused ops: held to the chains they replace, bit for bit (tests/mhc/test_mhc_fused_device.py)
FUSED_OPS = {"mhc_pre_big_fuse", "mhc_multilayer_recompute"}

# token-independent ops (weights only)
WEIGHT_OPS = {"mhc_fn_normw_merge_forward", "mhc_fn_normw_merge_backward"}
