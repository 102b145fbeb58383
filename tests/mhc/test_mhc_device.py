"""Device tier of the mHC primitives (CUDA GPU or Ascend NPU; skipped without one): every op against
its fp32 reference with the tolerances of docs/ops/mhc.md#conventions, buffers that ops accumulate into
start with random content (the contract's use of the prior content is checked), Sinkhorn also with large
logits and R in {1, 10, 20}, and opcheck on the device."""

import pytest
import torch
from _plugins.device import requires_cuda, requires_device
from _plugins.levels import level_choice
from mhc_cases import FUSED_OPS, OPS, make_args

import mhc_ref as ref

pytestmark = requires_device

TOKENS = level_choice([1, 509], [0, 1, 509, 1001, 8192], [0, 1, 509, 1001, 4096, 8192, 16384])
HIDDEN_SIZES = level_choice([1280, 4096], [1280, 2560, 4096, 7168], [1280, 2560, 4096, 5120, 7168])
HIDDEN = [pytest.param(h, marks=pytest.mark.xdist_group(f"mhc-H{h}")) for h in HIDDEN_SIZES]
PER_TOKEN_OPS = [op for op in OPS if any(k in op for k in ("split_mixes", "sinkhorn", "head", "reduce_partials"))]
STREAMING_OPS = [op for op in OPS if op not in PER_TOKEN_OPS and op not in FUSED_OPS]


def calc_diff(x, y):
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(((x - y) ** 2).sum() / denominator)


def bf16_close(got, want):
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


def run_both(name, args):
    """Runs the op on the device and the reference on copies; returns (op result, op args, ref result, ref args)."""
    ours_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ours = getattr(torch.ops.cann_ops_tilelang, name).default(*ours_args)
    want = getattr(ref, f"{name.removesuffix('_out')}_ref")(*(ref_args[:-1] if name.endswith("_out") else ref_args))
    if name.endswith("_out"):
        ref_args[-1].copy_(want)
    return ours, ours_args, want, ref_args


def check(name, ours, oa, want, ra, tokens):
    """The per-op comparison (docs/ops/mhc.md#conventions)."""
    if name == "expand_to_mhc_forward":
        assert torch.equal(oa[1], ra[1])  # a copy: bitwise
    elif name == "expand_to_mhc_backward":
        bf16_close(oa[1], ra[1])
    elif name.startswith("mhc_fn_normw_merge"):
        for i in range(2, len(oa)):
            assert calc_diff(oa[i], ra[i]) < 1e-8
    elif name == "mhc_gemm_with_sqrsum_forward":
        for got, ref in zip(ours, want):  # out_mul_part, sqrsum_part: every split's partial, and their sum
            assert got.shape == ref.shape
            assert calc_diff(got.sum(0), ref.sum(0)) < 1e-8
            if got.device.type == "cuda":
                assert calc_diff(got, ref) < 1e-8
            else:  # Ascend: one split (docs/ops/mhc.md#gemm_with_sqrsum): the sums in split 0, zeros after
                assert not got[1:].any() and calc_diff(got[0], ref.sum(0)) < 1e-8
    elif name == "mhc_gemm_with_sqrsum_backward":
        bf16_close(oa[4], ra[4])
        torch.testing.assert_close(ours, want, rtol=1e-3, atol=3e-2)
    elif name == "mhc_reduce_partials_and_rmsnorm_forward":
        for i in (2, 3, 4):
            torch.testing.assert_close(oa[i], ra[i], rtol=1e-5, atol=1e-5)
    elif name == "mhc_reduce_partials_and_rmsnorm_backward":
        for i in (3, 4):
            assert calc_diff(oa[i], ra[i]) < 1e-8
    elif name.startswith("mhc_pre_split_mixes"):
        for i in range(len(oa)):
            if isinstance(oa[i], torch.Tensor):
                torch.testing.assert_close(oa[i], ra[i], rtol=1e-5, atol=2e-5)
    elif name.startswith("mhc_sinkhorn"):
        torch.testing.assert_close(oa[2 if name.endswith("backward") else 1], ra[2 if name.endswith("backward") else 1])
    elif name == "mhc_pre_apply_mix_forward":
        torch.testing.assert_close(oa[2], ra[2], rtol=1e-3, atol=1e-2)
    elif name == "mhc_pre_apply_mix_backward":
        torch.testing.assert_close(oa[3], ra[3], rtol=1e-3, atol=1e-2)
        torch.testing.assert_close(ours, want, rtol=1e-3, atol=1e-2)
    elif name in ("mhc_post_forward", "mhc_post_forward_out"):
        bf16_close(ours if name == "mhc_post_forward" else oa[4], want if name == "mhc_post_forward" else ra[4])
    elif name == "mhc_post_backward":
        bf16_close(ours[0], want[0])
        bf16_close(ours[1], want[1])
        torch.testing.assert_close(ours[2], want[2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours[3], want[3], rtol=1e-4, atol=1e-4)
    elif name == "mhc_head_compute_mix_forward":
        torch.testing.assert_close(oa[3], ra[3], rtol=1e-4, atol=1e-5)
    elif name == "mhc_head_compute_mix_backward":
        torch.testing.assert_close(oa[4], ra[4], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(oa[5].sum(0), ra[5].sum(0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(oa[6].sum(0), ra[6].sum(0), rtol=1e-4, atol=1e-5)
    else:
        raise KeyError(name)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", STREAMING_OPS)
def test_streaming_op_vs_reference(name, tokens, hidden, device, seed):
    args = make_args(name, tokens, hidden, seed=seed, device=device)
    check(name, *run_both(name, args), tokens)


@pytest.mark.parametrize("hidden", [1280, 4096, 7168])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("splits", [1, 7, 80])
def test_gemm_forward_split_counts(splits, tokens, hidden, device, seed):
    """Split counts other than the default 16: one split, uneven splits (7) and many splits (80: one
    64-column block each at H = 1280). On the H200 these take both forward schedules (resident at S = 7,
    H = 1280, with 64-column steps; else streaming)."""
    name = "mhc_gemm_with_sqrsum_forward"
    args = make_args(name, tokens, hidden, seed=seed, device=device, splits=splits)
    check(name, *run_both(name, args), tokens)


@requires_cuda
@pytest.mark.parametrize("hidden", [1280, 2560, 4096, 5120])
def test_cuda_gemm_forward_schedules_agree_bitwise(hidden, device, seed):
    """The resident and streaming schedules of the CUDA GEMM forward run the same arithmetic in the same
    order: their partials are bitwise equal (at the default 16 splits, where the launcher takes the
    resident one; H = 5120 runs 5 x stages), token counts with a partial last tile and with several
    tiles per CTA, the launcher's CTAs per split and others (1; 3, which divides no tile count here).
    The resident kernel converts ``fn`` itself, the streaming one takes the preparation kernel's hi / lo
    split, so this also holds the two conversions equal (signed zeros, a subnormal and values that round
    up across a TF32 binade among the weights)."""
    from cann_ops_tilelang import config
    from cann_ops_tilelang.kernels.cuda._build import jit_compile
    from cann_ops_tilelang.kernels.cuda.mhc._common import GemmWeightKey
    from cann_ops_tilelang.kernels.cuda.mhc.gemm_with_sqrsum import forward as gemm

    k, splits = 4 * hidden, 16
    key = gemm.forward_key(k, 24, splits, config.num_sms())
    cols, rows, block_k = key.cols, key.rows, key.block_k
    assert key.resident_stages > 0
    resident = gemm.FORWARD.compiled(key)
    streaming = jit_compile("streaming", (k,), gemm.build_mhc_gemm_with_sqrsum_forward(cols, rows, splits, block_k))
    gen = torch.Generator(device=device).manual_seed(seed)
    fn = torch.randn(rows, cols, generator=gen, device=device)
    fn[0, :6] = torch.tensor([0.0, -0.0, 1e-40, 3.0000002, -7.999999, 1.9999999], device=device)
    fhl = torch.empty(2 * rows, cols, dtype=torch.bfloat16, device=device)
    gemm.FN_SPLIT.compiled(GemmWeightKey(cols, rows))(fn, fhl)
    for tokens in (1, 63, 509, 4097, 16384):
        x = torch.randn(tokens, cols, generator=gen, device=device).bfloat16()
        nan = float("nan")
        want = (torch.full((splits, tokens, rows), nan, device=device), torch.full((splits, tokens), nan, device=device))
        streaming(x, fhl, *want)
        launcher_ctas = gemm.mhc_gemm_with_sqrsum_forward_ctas_per_split(tokens, splits, config.num_sms())
        for ctas in sorted({launcher_ctas, 1, min(3, -(-tokens // 64))}):
            got = (torch.full_like(want[0], nan), torch.full_like(want[1], nan))
            resident(x, fn, *got, ctas)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (tokens, ctas)


@pytest.mark.parametrize("hidden", [1280, 7168])
@pytest.mark.parametrize("tokens", [0, 1, 509, 8192])
def test_gemm_backward_is_reproducible_bitwise(tokens, hidden, device, seed):
    """grad_fn (token partitions summed in a fixed order, no atomics) and grad_x are bitwise identical from
    run to run and within the reference's tolerances; grad_fn is zero for T = 0 (H = 1280: one token partition at
    T = 1, two at 509, four at 8192; H = 7168: one single-stage partition at T <= 509, five two-stage ones at
    8192)."""
    name = "mhc_gemm_with_sqrsum_backward"
    args = make_args(name, tokens, hidden, seed=seed, device=device)
    op = getattr(torch.ops.cann_ops_tilelang, name).default
    runs = []
    for _ in range(3):
        run_args = [a.clone() for a in args]
        runs.append((op(*run_args), run_args[4]))
    for grad_fn, grad_x in runs[1:]:
        assert torch.equal(grad_fn, runs[0][0]) and torch.equal(grad_x, runs[0][1])
    if tokens == 0:
        assert not runs[0][0].any()
    ref_args = [a.clone() for a in args]
    want = ref.mhc_gemm_with_sqrsum_backward_ref(*ref_args)
    bf16_close(runs[0][1], ref_args[4])
    torch.testing.assert_close(runs[0][0], want, rtol=1e-3, atol=3e-2)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", PER_TOKEN_OPS)
def test_per_token_op_vs_reference(name, tokens, device, seed):
    args = make_args(name, tokens, 4096, seed=seed, device=device)
    check(name, *run_both(name, args), tokens)


@pytest.mark.parametrize("repeat", [1, 10, 20])
@pytest.mark.parametrize("name", ["mhc_sinkhorn_forward", "mhc_sinkhorn_backward"])
def test_sinkhorn_repeats(name, repeat, device, seed):
    args = make_args(name, 1001, 4096, seed=seed, device=device, repeat=repeat)
    check(name, *run_both(name, args), 1001)


@pytest.mark.parametrize("offset", [-100.0, 100.0])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
@pytest.mark.parametrize("name", ["mhc_sinkhorn_forward", "mhc_sinkhorn_backward"])
def test_sinkhorn_large_logits(name, offset, eps, device, seed):
    args = make_args(name, 1024, 4096, seed=seed, device=device, logit_offset=offset, sinkhorn_eps=eps)
    _, oa, _, ra = run_both(name, args)
    out = 2 if name.endswith("backward") else 1
    assert torch.isfinite(oa[out]).all()
    torch.testing.assert_close(oa[out], ra[out], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mhc_fn_normw_merge_backward", "mhc_gemm_with_sqrsum_backward",
                                  "mhc_pre_apply_mix_backward"])
def test_accumulating_ops_use_the_prior_content(name, device, seed):
    """grad_x / grad_fn / grad_normw are read-modify-write: a zero start and a random start differ by the
    random start (within the output precision)."""
    args = make_args(name, 509, 2560, seed=seed, device=device)
    buffers = {"mhc_fn_normw_merge_backward": [3, 4], "mhc_gemm_with_sqrsum_backward": [4],
               "mhc_pre_apply_mix_backward": [3]}[name]
    zero_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for i in buffers:
        zero_args[i].zero_()
    op = getattr(torch.ops.cann_ops_tilelang, name).default
    prior = [args[i].clone() for i in buffers]
    op(*args)
    op(*zero_args)
    for i, start in zip(buffers, prior):
        got = args[i].float() - zero_args[i].float()
        tol = dict(rtol=2e-2, atol=2e-2) if args[i].dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, start.float(), **tol)


@pytest.mark.parametrize("name", OPS)
def test_opcheck_on_device(name, device, seed):
    torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, name).default,
                          tuple(make_args(name, 37, 1280, seed=seed, device=device)))
