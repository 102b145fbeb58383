"""CPU tier of the mHC primitives: validation, fakes vs references, opcheck, a torch.compile trace of
the pre/post chain without recompilation, and the references' backward against float64 autograd."""

import pytest
import torch
from torch.utils._pytree import tree_map_only
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from mhc_cases import M, M3, OPS, make_args
from torch._subclasses.fake_tensor import FakeTensorMode

import mhc_ref as ref
import cann_ops_tilelang as ops

TOKENS = level_choice([0, 1, 9], [0, 1, 9, 33], [0, 1, 9, 33, 130])
HIDDEN = 256


def namespace_op(name):
    return getattr(torch.ops.cann_ops_tilelang, name).default


def meta_of(value):
    return (tuple(value.shape), value.dtype, value.stride()) if isinstance(value, torch.Tensor) else value


def as_tuple(result):
    if result is None:
        return ()
    return result if isinstance(result, tuple) else (result,)


# --- validation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_wrong_dtype_of_every_tensor_argument(name):
    args = make_args(name, 3, HIDDEN)
    for index, value in enumerate(args):
        if not isinstance(value, torch.Tensor):
            continue
        bad = list(args)
        bad[index] = value.to(torch.float16)
        with pytest.raises(TypeError) as info:
            namespace_op(name)(*bad)
        message = str(info.value)
        assert f"cann_ops_tilelang::{name}" in message and "float16" in message, message


@pytest.mark.parametrize("name", OPS)
def test_wrong_shape_of_every_tensor_argument(name):
    args = make_args(name, 3, HIDDEN)
    for index, value in enumerate(args):
        if not isinstance(value, torch.Tensor):
            continue
        bad = list(args)
        bad[index] = torch.zeros((*value.shape, 2), dtype=value.dtype)
        with pytest.raises(ValueError) as info:
            namespace_op(name)(*bad)
        assert f"cann_ops_tilelang::{name}" in str(info.value)


@pytest.mark.parametrize("name", OPS)
def test_nothing_written_on_bad_input(name):
    args = make_args(name, 5, HIDDEN)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    bad = list(args)
    first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    bad[first] = args[first].to(torch.float16)
    with pytest.raises(TypeError):
        namespace_op(name)(*bad)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor) and a.dtype.is_floating_point and a.numel():
            assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_multilayer_recompute_refuses_more_layers_than_its_kernels_take():
    t, h = 2, HIDDEN
    layers = 65  # limits.MHC_RECOMPUTE_LAYERS: one kernel parameter per list element
    lists = [[torch.zeros(t, M) for _ in range(layers)], [torch.zeros(t, h, dtype=torch.bfloat16)] * layers,
             [torch.zeros(t, M)] * layers, [torch.zeros(t, M, M)] * layers,
             [torch.zeros(t, h, dtype=torch.bfloat16) for _ in range(layers)],
             [torch.zeros(t, M, h, dtype=torch.bfloat16) for _ in range(layers)]]
    with pytest.raises(ValueError, match=r"mhc_multilayer_recompute: argument 'pre_mix_list': expected layers L in "
                                         r"\[1, 64\], got 65"):
        ops.mhc_multilayer_recompute(torch.zeros(t, M, h, dtype=torch.bfloat16), *lists)


@pytest.mark.parametrize("hidden", [100, 192, 8256])
def test_unsupported_hidden_size(hidden):
    x = torch.zeros(2, M, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hidden size"):
        ops.mhc_pre_apply_mix_forward(x, torch.zeros(2, M), torch.zeros(2, hidden, dtype=torch.bfloat16))


@pytest.mark.parametrize("m", [2, 3, 8])
def test_unsupported_hc_mult(m):
    with pytest.raises(ValueError, match="hc_mult"):
        ops.mhc_sinkhorn_forward(torch.zeros(2, m, m), torch.zeros(2, m, m), 10, 1e-6)
    with pytest.raises(ValueError, match="hc_mult"):
        ops.expand_to_mhc_forward(torch.zeros(2, 512, dtype=torch.bfloat16),
                                  torch.zeros(2, m, 512, dtype=torch.bfloat16))


def test_split_and_group_arguments():
    x, fn, _ = make_args("mhc_gemm_with_sqrsum_forward", 4, HIDDEN)
    with pytest.raises(ValueError, match="n_splits"):
        ops.mhc_gemm_with_sqrsum_forward(x, fn, 0)
    with pytest.raises(ValueError, match="n_splits"):
        ops.mhc_gemm_with_sqrsum_forward(x, fn, 4 * HIDDEN // 64 + 1)
    with pytest.raises(ValueError, match="repeat"):
        ops.mhc_sinkhorn_forward(torch.zeros(2, M, M), torch.zeros(2, M, M), 0, 1e-6)
    # a float (or a bool) for an int argument is refused before the dispatcher converts it, naming the argument
    with pytest.raises(TypeError, match="mhc_sinkhorn_forward: argument 'repeat': expected an int, got bool"):
        ops.mhc_sinkhorn_forward(torch.zeros(2, M, M), torch.zeros(2, M, M), True, 1e-6)
    with pytest.raises(TypeError, match="mhc_sinkhorn_forward: argument 'repeat': expected an int, got float"):
        ops.mhc_sinkhorn_forward(torch.zeros(2, M, M), torch.zeros(2, M, M), 2.5, 1e-6)
    args = make_args("mhc_reduce_partials_and_rmsnorm_forward", 4, HIDDEN)
    args[-1] = 3  # n_splits disagreeing with the partials
    with pytest.raises(ValueError, match="n_splits"):
        ops.mhc_reduce_partials_and_rmsnorm_forward(*args)


@pytest.mark.parametrize("name", OPS)
def test_cpu_tensors_have_no_kernel(name):
    with without_cpu_references(), pytest.raises(RuntimeError) as info:
        namespace_op(name)(*make_args(name, 2, HIDDEN))
    assert f"cann_ops_tilelang::{name}" in str(info.value) and "'cpu'" in str(info.value)


# --- fakes and opcheck --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", OPS)
def test_fakes_match_references(name, tokens, seed):
    args = make_args(name, tokens, HIDDEN, seed=seed)
    real = as_tuple(namespace_op(name)(*tree_map_only(torch.Tensor, torch.clone, args)))
    mode = FakeTensorMode()
    with mode:
        fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
        fake = as_tuple(namespace_op(name)(*fake_args))
    assert [meta_of(t) for t in fake] == [meta_of(t) for t in real]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, tokens, seed):
    torch.library.opcheck(namespace_op(name), tuple(make_args(name, tokens, HIDDEN, seed=seed)))


# --- torch.compile: the pre chain and post, dynamic token count ---------------------------------------------------


def pre_post_chain(residual, fn, scale, base, y):
    tokens, m, hidden = residual.shape
    parts, sq_parts = ops.mhc_gemm_with_sqrsum_forward(residual.view(tokens, m * hidden), fn, 4)
    out_mul = parts.new_empty(tokens, 1, M3)
    sqrsum = parts.new_empty(tokens, 1)
    mixes = parts.new_empty(tokens, M3)
    ops.mhc_reduce_partials_and_rmsnorm_forward(parts.view(4, tokens, 1, M3), sq_parts.view(4, tokens, 1), out_mul,
                                                sqrsum, mixes, m * hidden, 1e-6, 4)
    pre = mixes.new_empty(tokens, m)
    post = mixes.new_empty(tokens, m)
    comb_logits = mixes.new_empty(tokens, m * m)
    ops.mhc_pre_split_mixes_forward(mixes, scale, base, pre, post, comb_logits, 2.0, 1e-6)
    comb = mixes.new_empty(tokens, m, m)
    ops.mhc_sinkhorn_forward(comb_logits.view(tokens, m, m), comb, 20, 1e-6)
    layer_input = residual.new_empty(tokens, hidden)
    ops.mhc_pre_apply_mix_forward(residual, pre, layer_input)
    return layer_input, ops.mhc_post_forward(y + layer_input, residual, post, comb)


def test_compile_pre_post_chain_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(pre_post_chain, backend="aot_eager", fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(seed)
    fn = torch.randn(M3, M * HIDDEN, generator=gen) * 1e-2
    scale, base = torch.randn(3, generator=gen), torch.randn(M3, generator=gen)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (7, 13, 30):
            residual = torch.randn(tokens, M, HIDDEN, generator=gen).bfloat16()
            y = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
            for a, b in zip(compiled(residual, fn, scale, base, y), pre_post_chain(residual, fn, scale, base, y)):
                assert torch.equal(a, b)


# --- the references' backward against float64 autograd ---------------------------------------------------------


def f64(t):
    return t.detach().double().requires_grad_()


def close(got, want):
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("repeat", [1, 10, 20])
def test_sinkhorn_backward_vs_autograd(repeat, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(17, M, M, generator=gen, dtype=torch.float64)
    g = torch.randn(17, M, M, generator=gen, dtype=torch.float64)
    xa = x.clone().requires_grad_()
    ref.sinkhorn_model(xa, repeat, 1e-6).backward(g)
    got = torch.empty_like(x)
    ref.mhc_sinkhorn_backward_ref(g, x, got, repeat, 1e-6)
    close(got, xa.grad)


def test_split_mixes_backward_vs_autograd(seed):
    args = [a.double() if isinstance(a, torch.Tensor) else a for a in make_args("mhc_pre_split_mixes_backward", 19,
                                                                                 HIDDEN, seed=seed)]
    pre_g, post_g, comb_g, mixes, _, scale, base, grad_mixes, grad_scale, grad_base, mult = args
    leaves = [f64(mixes), f64(scale), f64(base)]
    pre, post, comb = ref.split_mixes_model(*leaves, M, mult, 1e-2)
    torch.autograd.backward([pre, post, comb], [pre_g, post_g, comb_g])
    ref.mhc_pre_split_mixes_backward_ref(pre_g, post_g, comb_g, mixes, post.detach(), scale, base, grad_mixes,
                                         grad_scale, grad_base, mult)
    for got, leaf in zip((grad_mixes, grad_scale, grad_base), leaves):
        close(got, leaf.grad)


def test_reduce_rmsnorm_backward_vs_autograd(seed):
    grad_out, out_mul, sqrsum, omg, sqg, rg, eps = [
        a.double() if isinstance(a, torch.Tensor) else a
        for a in make_args("mhc_reduce_partials_and_rmsnorm_backward", 21, HIDDEN, seed=seed)]
    leaves = [f64(out_mul), f64(sqrsum)]
    ref.reduce_rmsnorm_model(*leaves, rg, eps).backward(grad_out)
    ref.mhc_reduce_partials_and_rmsnorm_backward_ref(grad_out, out_mul, sqrsum, omg, sqg, rg, eps)
    close(omg, leaves[0].grad)
    close(sqg, leaves[1].grad)


def test_gemm_backward_vs_autograd(seed):
    omg, sqg, x, fn, _ = make_args("mhc_gemm_with_sqrsum_backward", 11, HIDDEN, seed=seed)
    xa, fa = f64(x.float()), f64(fn)
    (xa @ fa.T).backward(omg.double(), retain_graph=True)
    xa.square().sum(-1).backward(sqg.double())
    grad_x = torch.zeros(x.shape, dtype=torch.float64)
    grad_fn = ref.mhc_gemm_with_sqrsum_backward_ref(omg.double(), sqg.double(), x.double(), fn.double(), grad_x)
    close(grad_x, xa.grad)
    close(grad_fn, fa.grad)


def _cube_backward_model(g, sg, x, fn, grad_x, width, block_t):
    """The Ascend Cube backward's data flow on the CPU: per W-column tile and BT-token block (ascending), fp32
    MADs on zero-padded (BT, 32) g / (32, W) fn / (BT, W) x tiles (grad_fn accumulated over the blocks,
    as in L0C), then the vector epilogue ``bf16(fma(2*sg, x, f32(grad_x) + g @ fn))``."""
    tokens, k = x.shape
    m3 = g.shape[1]
    grad_fn = torch.empty(m3, k)
    for c0 in range(0, k, width):
        fn_tile = torch.zeros(32, width)
        fn_tile[:m3] = fn[:, c0:c0 + width]
        acc_fg = torch.zeros(32, width)
        for t0 in range(0, tokens, block_t):
            n = min(block_t, tokens - t0)
            g_blk = torch.zeros(block_t, 32)
            g_blk[:n, :m3] = g[t0:t0 + n]
            x_blk = torch.zeros(block_t, width)
            x_blk[:n] = x[t0:t0 + n, c0:c0 + width].float()
            acc_fg = acc_fg + g_blk.T @ x_blk
            r = grad_x[t0:t0 + n, c0:c0 + width].float() + (g_blk @ fn_tile)[:n]
            fma = r.double() + (2 * sg[t0:t0 + n]).double()[:, None] * x_blk[:n].double()  # one rounding below
            grad_x[t0:t0 + n, c0:c0 + width] = fma.float().to(torch.bfloat16)
        grad_fn[:, c0:c0 + width] = acc_fg[:m3]
    return grad_fn


@pytest.mark.parametrize("tokens", [1, 509])
def test_gemm_backward_cube_model_meets_the_device_tolerances(tokens, seed):
    """Precision of the Ascend backward's design (Cube in plain fp32, g and fn unrounded): the CPU model of its
    tiles and order of operations meets the device test's tolerances against the float64 reference (an HF32
    model of g misses the bf16 grad_x tolerance near zero: docs/perf/ascend950/mhc.md, 2026-12-03)."""
    gemm = pytest.importorskip("cann_ops_tilelang.kernels.ascend.mhc.gemm_with_sqrsum")
    from cann_ops_tilelang import chips

    args = make_args("mhc_gemm_with_sqrsum_backward", tokens, HIDDEN, seed=seed)
    want_args = [a.clone() for a in args]
    want = ref.mhc_gemm_with_sqrsum_backward_ref(*want_args)
    plan = gemm.BACKWARD_PLAN
    width = plan.width(M * HIDDEN, chips.ASCEND_950.vector_cores // 2)
    got = _cube_backward_model(*args, width, plan.block_t)
    torch.testing.assert_close(args[4], want_args[4], rtol=1.6e-2, atol=1e-5)  # test_mhc_device.bf16_close
    torch.testing.assert_close(got, want, rtol=1e-3, atol=3e-2)


def test_apply_mix_post_head_normw_backward_vs_autograd(seed):
    gen = torch.Generator().manual_seed(seed)
    t, h = 9, HIDDEN
    x = torch.randn(t, M, h, generator=gen, dtype=torch.float64)
    mix = torch.randn(t, M, generator=gen, dtype=torch.float64)
    og = torch.randn(t, h, generator=gen, dtype=torch.float64)
    xa, ma = f64(x), f64(mix)
    ref.apply_mix_model(xa, ma).backward(og)
    grad_x = torch.zeros_like(x)
    grad_mix = ref.mhc_pre_apply_mix_backward_ref(og, x, mix, grad_x)
    close(grad_x, xa.grad)
    close(grad_mix, ma.grad)

    y = torch.randn(t, h, generator=gen, dtype=torch.float64)
    post = torch.randn(t, M, generator=gen, dtype=torch.float64)
    comb = torch.randn(t, M, M, generator=gen, dtype=torch.float64)
    d_o = torch.randn(t, M, h, generator=gen, dtype=torch.float64)
    leaves = [f64(y), f64(x), f64(post), f64(comb)]
    ref.post_model(*leaves).backward(d_o)
    d_x = (d_o * post.unsqueeze(-1)).sum(1)
    d_res = torch.einsum("nio,nod->nid", comb, d_o)
    d_post = (d_o * y.unsqueeze(1)).sum(-1)
    d_comb = torch.einsum("nid,nod->nio", x, d_o)
    for got, leaf in zip((d_x, d_res, d_post, d_comb), leaves):
        close(got, leaf.grad)
    # the fp32 reference backward computes the same quantities (up to its bf16 outputs)
    yb, xb, db = y.bfloat16(), x.bfloat16(), d_o.bfloat16()
    got32 = ref.mhc_post_backward_ref(yb, xb, post.float(), comb.float(), db)
    leaves = [f64(yb.float()), f64(xb.float()), f64(post), f64(comb)]
    ref.post_model(*leaves).backward(db.double())
    for got, leaf in zip(got32, leaves):
        torch.testing.assert_close(got.double(), leaf.grad, rtol=1.6e-2 if got.dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)

    inp = torch.randn(t, M, generator=gen, dtype=torch.float64)
    scale = torch.randn(1, generator=gen, dtype=torch.float64)
    base = torch.randn(M, generator=gen, dtype=torch.float64)
    g = torch.randn(t, M, generator=gen, dtype=torch.float64)
    leaves = [f64(inp), f64(scale), f64(base)]
    ref.head_mix_model(*leaves, 1e-2).backward(g)
    grad_in = torch.empty_like(inp)
    sp = torch.empty(3, 1, dtype=torch.float64)
    bp = torch.empty(3, M, dtype=torch.float64)
    ref.mhc_head_compute_mix_backward_ref(g, inp, scale, base, grad_in, sp, bp)
    close(grad_in, leaves[0].grad)
    close(sp.sum(0), leaves[1].grad)
    close(bp.sum(0), leaves[2].grad)

    fn = torch.randn(M3, M * h, generator=gen, dtype=torch.float64)
    normw = torch.randn(M * h, generator=gen, dtype=torch.float64)
    gout = torch.randn(M3, M * h, generator=gen, dtype=torch.float64)
    leaves = [f64(fn), f64(normw)]
    (leaves[0] * leaves[1]).backward(gout)
    grad_fn = torch.zeros_like(fn)
    grad_normw = torch.zeros_like(normw)
    ref.mhc_fn_normw_merge_backward_ref(fn, normw, gout, grad_fn, grad_normw)
    close(grad_fn, leaves[0].grad)
    close(grad_normw, leaves[1].grad)


def test_expand_backward_vs_autograd(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, HIDDEN, generator=gen, dtype=torch.float64)
    g = torch.randn(6, M, HIDDEN, generator=gen, dtype=torch.float64)
    xa = f64(x)
    xa.unsqueeze(1).expand(6, M, HIDDEN).backward(g)
    got = torch.empty_like(x)
    ref.expand_to_mhc_backward_ref(g, got)
    close(got, xa.grad)


def test_gemm_reference_splits_and_tf32():
    assert ref.split_ranges(1024, 16) == [(64 * i, 64 * (i + 1)) for i in range(16)]
    # K = 1280: 20 blocks over 16 splits, the first 20 % 16 = 4 splits get one more block
    assert ref.split_ranges(1280, 16)[:6] == [(0, 128), (128, 256), (256, 384), (384, 512), (512, 576), (576, 640)]
    assert ref.split_ranges(1280, 16)[-1] == (1216, 1280)
    one = torch.tensor([1.0 + 2 ** -11, 1.0 + 2 ** -12, -(1.0 + 2 ** -11)])
    # TF32 keeps 10 mantissa bits: 1 + 2^-11 is a tie and rounds away from zero; 1 + 2^-12 rounds down
    assert ref.tf32_round(one).tolist() == [1.0 + 2 ** -10, 1.0, -(1.0 + 2 ** -10)]
