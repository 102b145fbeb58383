"""The mHC tests whose one body covers several op modules at once, so that no op file
(``test_mhc_<op module>.py``) can hold them whole; each op's own tests are in its file.

* validation: an hc_mult other than 4 refused by ``mhc_sinkhorn_forward`` and ``expand_to_mhc_forward``; the split,
  group and repeat arguments of the GEMM, Sinkhorn and reduce ops (CPU tier);
* the pre chain and post (GEMM, reduce + RMSNorm, split mixes, Sinkhorn, apply mix, post) under torch.compile with
  a dynamic token count and no recompilation (CPU tier);
* the references' backward of apply mix, post, the head mix and the normw merge against float64 autograd, in one
  test (CPU tier);
* every kernel of the family (both backends' aggregated lowering cases, a loop over all of them): the token count a
  dynamic dimension; the CUDA streaming kernels' row layouts (apply mix and post, the apply-mix forward falling back
  to the post forward's); the Ascend chip facts the UB and Cube budgets rest on; no assert in the Ascend kernel
  modules; the Ascend aggregator listing both fused kernels (CPU tier);
* both fused ops refusing out-of-range arguments on the device (device tier)."""

import ast
import pathlib

import mhc_ref as ref
import pytest
import torch
from _plugins.device import requires_device
from mhc_cases import M3, M, make_args
from mhc_testing import HIDDEN, ascend_mhc, close, cuda_mhc, f64

import cann_ops_tilelang as ops
from cann_ops_tilelang import chips, limits
from cann_ops_tilelang.kernels import _family
from cann_ops_tilelang.kernels.ascend import _build
from cann_ops_tilelang.kernels.ascend.mhc import multilayer_recompute, pre_big_fuse, sinkhorn

# --- validation (CPU tier) --------------------------------------------------------------------------------------------


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


# --- torch.compile: the pre chain and post, dynamic token count (CPU tier) --------------------------------------------


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


# --- the references' backward against float64 autograd (CPU tier) -----------------------------------------------------


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


# --- every kernel of the family (CPU tier) ----------------------------------------------------------------------------


@pytest.mark.parametrize("module", [ascend_mhc, cuda_mhc], ids=["ascend", "cuda"])
def test_token_count_is_dynamic(module):
    from tvm import tirx

    for name, prim_func in module.lowering_cases(2560).items():
        dims = [prim_func.buffer_map[p].shape[0] for p in prim_func.params if p in prim_func.buffer_map]
        if "normw" in name or "fn_split" in name or name.endswith("_reduce"):
            continue  # weight-only kernels and second-stage reductions of partials: no token dimension
        assert any(isinstance(d, tirx.Var) for d in dims) or any(
            any(isinstance(s, tirx.Var) for s in prim_func.buffer_map[p].shape)
            for p in prim_func.params if p in prim_func.buffer_map
        ), f"{name}: no dynamic dim in {dims}"


def test_cuda_streaming_row_layouts_cover_the_row():
    """The one-token CTA layouts of the CUDA streaming kernels (apply-mix forward 128 threads where the row
    allows, else as the post forward; post forward up to 256, apply-mix backward up to 512, post backward
    128 where H % 1024 == 0) are whole warps within the CTA limit and cover the row's H / 8 vectors exactly
    once, guarding the last slots exactly when they overrun (every H % 64 == 0 up to 16384); the forwards'
    column chunks split a row's vectors per thread evenly (all of them up to 2, else one per chunk)."""
    from cann_ops_tilelang.kernels.cuda.mhc import _common, post, pre_apply_mix

    for hidden in range(64, 16385, 64):
        nvec = hidden // 8
        layouts = {
            "apply_mix_fwd": pre_apply_mix.forward_layout(hidden),
            "post_fwd": post.forward_layout(hidden),
            "apply_mix_bwd": pre_apply_mix.backward_layout(hidden),
            "post_bwd": post.backward_layout(hidden),
        }
        for name, layout in layouts.items():
            threads, nv, guarded = layout.threads, layout.nv, layout.guarded
            assert threads % 32 == 0 and 32 <= threads <= 1024, (hidden, name, threads)
            assert threads * nv >= nvec and (threads * nv > nvec) == guarded, (hidden, name, threads, nv)
            assert threads * (nv - 1) < nvec, (hidden, name, threads, nv)  # no slot wholly past the row
        assert layouts["post_bwd"].threads == 128 or hidden % 1024 != 0, hidden
        assert layouts["apply_mix_bwd"].threads <= 512, hidden
        assert layouts["post_fwd"].threads <= 256, hidden
        # apply-mix forward: up to 128 threads, never fewer (then the post forward's layout)
        assert layouts["apply_mix_fwd"].threads == 128 or layouts["apply_mix_fwd"] == layouts["post_fwd"], hidden
        for name in ("apply_mix_fwd", "post_fwd"):
            nv = layouts[name].nv
            nvc = _common.row_chunk(nv)
            assert nv % nvc == 0 and (nvc == nv if nv <= 2 else nvc == 1), (hidden, name, nv, nvc)


def test_ub_budgets_are_the_chip_facts():
    assert _build.UB_BUDGET_BYTES == chips.ASCEND_950.ub_bytes
    assert _build.UB_BUDGET_SIMT_BYTES == chips.ASCEND_950.ub_bytes_simt


def test_cube_capacities_are_the_chip_facts():
    assert chips.ASCEND_950.cube_bytes == {"l1": 512 * 1024, "l0a": 64 * 1024, "l0b": 64 * 1024, "l0c": 256 * 1024}


def test_no_assert_in_the_kernel_modules():
    """Ranges are checked with limits.LimitError, never with an assert (stripped under ``python -O``)."""
    package = pathlib.Path(sinkhorn.__file__).parent
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, (path.name, asserts)


def test_aggregator_lists_the_fused_kernels():
    assert {"pre_big_fuse", "multilayer_recompute"} <= set(_family.op_modules(ascend_mhc.__name__))
    names = set(pre_big_fuse.lowering_cases(1280)) | set(multilayer_recompute.lowering_cases(1280))
    assert names == {f"mhc_pre_big_fuse_s{s}_r{r}" for s in (1, 16) for r in (10, 20)} | {
        f"mhc_multilayer_recompute_l{layers}_lp{p}" for layers, p in ((1, 1), (3, 2), (3, 3), (10, 9), (10, 10))}


# --- the fused ops on the device (device tier) ------------------------------------------------------------------------


@requires_device
def test_fused_ops_refuse_out_of_range_arguments_on_the_device(device):
    args = make_args("mhc_pre_big_fuse", 4, 1280, device=device)
    args[12] = limits.MHC_SINKHORN_REPEAT.of(device.type).high + 1
    with pytest.raises(ValueError, match="mhc_pre_big_fuse: argument 'sinkhorn_repeat'"):
        ops.mhc_pre_big_fuse(*args)
    args = make_args("mhc_multilayer_recompute", 4, 1280, device=device)
    args[2] = args[2] + [args[2][0]] * 2  # Lp = L + 1
    with pytest.raises(ValueError, match="mhc_multilayer_recompute: argument 'layer_output_list'"):
        ops.mhc_multilayer_recompute(*args)
    assert M == 4
