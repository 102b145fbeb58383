"""``mhc_pre_big_fuse`` (docs/ops/mhc.md#pre_big_fuse): validation, fakes against the reference and opcheck (CPU
tier). Its Ascend 950 kernel (lowering, no bisheng; CPU tier): every lowering case within the UB budget at the model
sizes H in {4096, 7168} (and 1280 from test level 1) and at the range's edges 256 and 8192 (which
tests/test_limits.py leaves to this file), with the token count a dynamic dimension; its vector functions the
unfused kernels' ones (reduce + RMSNorm, split mixes, Sinkhorn, apply mix), the same instructions on the same
registers up to UB addresses and the hidden tile's loop count; the launcher passing the reduce launcher's
fp32(1/(m*H)); per-core token ranges covering ragged token counts exactly once; values outside the declared ranges
raising ``limits.LimitError``. Its CUDA kernel (CPU tier): sm_90a cubins within the CTA limits at the model sizes,
lowered within them at the guarded and edge hidden sizes, the token count dynamic and never in the compile key, the
16-byte accesses the op declares, out-of-range builds refused, the launcher's argument order and ``rms_group_size =
m*H``, the alternative Sinkhorn-warps schedule. On the device (device tier): equal bit for bit to the chain of
primitives it replaces, and opcheck there."""

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared, vector_accesses
from _plugins.device import requires_device
from _plugins.levels import level_choice
from mhc_cases import make_args
from mhc_testing import (
    CONTRACT_HIDDEN,
    CORES,
    HAVE_NVCC,
    M,
    _lowered,
    _unfused_vector_functions,
    check_fused_lowers_within_ub,
    check_fused_token_count_is_dynamic,
    check_out_of_range_raises_limit_error,
    cuda_mhc,
    fused_lowering_cases,
    op_module_tests,
    ops_of,
    unfused_pre,
    vector_functions,
)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.kernels.ascend.mhc import (
    pre_apply_mix,
    pre_big_fuse,
    pre_split_mixes,
    reduce_partials_and_rmsnorm,
    sinkhorn,
)
from cann_ops_tilelang.kernels.cuda import _build as cuda_build
from cann_ops_tilelang.kernels.cuda.mhc import pre_big_fuse as pbf
from cann_ops_tilelang.limits import MHC_SINKHORN_REPEAT, LimitError

OPS = ops_of("pre_big_fuse")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("pre_big_fuse"))


# --- the Ascend 950 kernel (CPU tier) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden,module,case", fused_lowering_cases("pre_big_fuse"))
def test_lowers_within_ub(hidden, module, case):
    check_fused_lowers_within_ub(hidden, module, case)


@pytest.mark.parametrize("module", ["pre_big_fuse"])
def test_token_count_is_dynamic(module):
    check_fused_token_count_is_dynamic(module)


@pytest.mark.parametrize("hidden", [pytest.param(h, marks=pytest.mark.xdist_group(f"ascend-fused-h{h}"))
                                    for h in CONTRACT_HIDDEN])
@pytest.mark.parametrize("splits,repeat", [(1, 10), (16, 20)])
def test_pre_big_fuse_runs_the_unfused_vector_functions(hidden, splits, repeat):
    """Reduce + RMSNorm (the split sum from the first split at S = 1, from +0.0 in chunks of 8 at S = 16),
    split mixes, Sinkhorn and apply mix: each of their vector functions is one of the fused kernel's, and the
    fused kernel has no other (at H = 7168 its hidden tile is half the apply-mix kernel's)."""
    fused = vector_functions(_lowered(hidden, "pre_big_fuse", f"mhc_pre_big_fuse_s{splits}_r{repeat}").source)
    unfused = _unfused_vector_functions(
        (reduce_partials_and_rmsnorm.build_mhc_reduce_partials_and_rmsnorm_forward, splits, CORES),
        (pre_split_mixes.build_mhc_pre_split_mixes_forward, M, CORES),
        (sinkhorn.build_mhc_sinkhorn_forward, repeat, CORES),
        (pre_apply_mix.build_mhc_pre_apply_mix_forward, hidden, M, CORES),
    )
    assert len(fused) == len(set(fused)) == len(unfused)
    assert set(fused) == unfused


def test_pre_big_fuse_launcher_passes_the_unfused_scalars(monkeypatch):
    """The fused launcher passes the tensors in the kernel's parameter order and the reduce launcher's
    fp32(1/Rg) for Rg = m*H (a double rounded once to fp32 by the kernel's float parameter)."""
    tokens, hidden, splits = 7, 1280, 16
    calls = {}
    recorder = lambda name: (lambda key: (lambda *args: calls.setdefault(name, args)))  # noqa: E731
    monkeypatch.setattr(pre_big_fuse.KERNEL, "compiled", recorder("fused"))
    monkeypatch.setattr(pre_big_fuse, "num_vector_cores", lambda: CORES)
    red = reduce_partials_and_rmsnorm
    monkeypatch.setattr(red.FORWARD, "compiled", recorder("reduce"))
    monkeypatch.setattr(red, "num_vector_cores", lambda: CORES)
    gemm_out_mul, gemm_out_sqrsum = torch.zeros(splits, tokens, 24), torch.zeros(splits, tokens)
    tensors = dict(gemm_out_mul=gemm_out_mul, gemm_out_sqrsum=gemm_out_sqrsum, mhc_scale=torch.zeros(3),
                   mhc_base=torch.zeros(24), residual=torch.zeros(tokens, M, hidden, dtype=torch.bfloat16),
                   post_mix=torch.zeros(tokens, M), comb_mix=torch.zeros(tokens, M * M),
                   layer_input=torch.zeros(tokens, hidden, dtype=torch.bfloat16))
    pre_big_fuse.mhc_pre_big_fuse(**tensors, rms_eps=1e-6, pre_eps=1e-2, sinkhorn_eps=1e-6, post_mult_value=2.0,
                                  sinkhorn_repeat=20, n_splits=splits)
    red.mhc_reduce_partials_and_rmsnorm_forward(
        gemm_out_mul.view(splits, tokens, 1, 24), gemm_out_sqrsum.view(splits, tokens, 1), torch.zeros(tokens, 1, 24),
        torch.zeros(tokens, 1), torch.zeros(tokens, 24), M * hidden, 1e-6, splits)
    prim_func = pre_big_fuse.build_mhc_pre_big_fuse(hidden, M, splits, 20, CORES)
    buffers = [str(prim_func.buffer_map[p].name) for p in prim_func.params if p in prim_func.buffer_map]
    assert buffers == list(tensors)
    fused = calls["fused"]
    assert len(fused) == len(prim_func.params) == len(tensors) + 5
    for name, arg in zip(tensors, fused):
        assert arg.data_ptr() == tensors[name].data_ptr() and arg.numel() == tensors[name].numel(), name
    # inv_group, rms_eps, pre_eps, post_mult_value, sinkhorn_eps
    assert fused[len(tensors):] == (calls["reduce"][5], 1e-6, 1e-2, 2.0, 1e-6)
    assert calls["reduce"][5] == float(1.0 / (M * hidden))


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 509, 1021, 8192])
@pytest.mark.parametrize("cores", [CORES, 48, 7, 1])
def test_pre_big_fuse_token_ranges_cover_ragged_tails(tokens, cores):
    """The kernel's per-core ranges (its own ``core_token_range``) in chunks of up to 64 tokens cover every
    token exactly once, in order, whatever T."""
    seen = []
    for core in range(cores):
        lo, hi = pre_big_fuse.core_token_range(core, cores, tokens)
        assert hi - lo in (tokens // cores, -(-tokens // cores))
        for chunk in range(-(-(hi - lo) // pre_big_fuse.PLAN.tokens)):
            t0 = lo + chunk * pre_big_fuse.PLAN.tokens
            seen += range(t0, t0 + min(pre_big_fuse.PLAN.tokens, hi - t0))
    assert seen == list(range(tokens))


ASCEND_OUT_OF_RANGE = {
    "fuse hidden": lambda: pre_big_fuse.build_mhc_pre_big_fuse(limits.MHC_HIDDEN.high + 64, M, 16, 20, CORES),
    "fuse hidden step": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280 + 32, M, 16, 20, CORES),
    "fuse hc_mult": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, 3, 16, 20, CORES),
    "fuse n_splits 0": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 0, 20, CORES),
    "fuse n_splits > K/64": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 4 * 1280 // 64 + 1, 20, CORES),
    "fuse repeat 0": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 16, 0, CORES),
    "fuse repeat": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 16, sinkhorn.REPEAT.high + 1, CORES),
    "fuse key splits": lambda: pre_big_fuse.KERNEL.key(torch.empty(8, 2, 24), torch.empty(2, M, 1280), 20, 16),
}


@pytest.mark.parametrize("what", sorted(ASCEND_OUT_OF_RANGE))
def test_out_of_range_raises_limit_error(what):
    check_out_of_range_raises_limit_error(ASCEND_OUT_OF_RANGE[what])


# --- the CUDA kernel (CPU tier) ---------------------------------------------------------------------------------------

# The sizes that matter: the model sizes (cubins) and the range's edges plus a guarded layout (H / 8 = 40 vectors:
# 64 streaming threads, the last 24 slots guarded), lowered with the CTA limits; other sizes take the same paths.
CUDA_HIDDEN = [4096, 7168]

EDGE_HIDDEN = [256, 320, 8192]
PARAMS = ["gemm_out_mul", "gemm_out_sqrsum", "mhc_scale", "mhc_base", "residual", "post_mix", "comb_mix",
          "layer_input", "rms_group_size", "rms_eps", "pre_eps", "sinkhorn_eps", "post_mult_value"]


def _case_names(hidden):
    return sorted(pbf.lowering_cases(hidden))


def test_lowering_cases_are_named_after_the_launcher_and_aggregated():
    cases = pbf.lowering_cases(4096)
    most = 4 * 4096 // 64
    assert sorted(cases) == sorted(["mhc_pre_big_fuse_s16_r10", "mhc_pre_big_fuse_s16_r20", "mhc_pre_big_fuse_s1_r20",
                                    f"mhc_pre_big_fuse_s{most}_r1"])
    family = cuda_mhc.lowering_cases(4096)
    assert {f"pre_big_fuse/{name}" for name in cases} <= set(family)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden", CUDA_HIDDEN)
@pytest.mark.parametrize("index", range(4))
def test_compiles_to_sm90a_cubin(hidden, index):
    name = _case_names(hidden)[index]
    built = cuda_build.compile_cubin(pbf.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
    assert built.fits, (name, hidden, built.smem_bytes, built.budget_bytes, built.threads)
    threads, tokens, _ = pbf.grid_layout(hidden)
    assert built.threads == threads
    layout = pbf.stream_layout(hidden)
    assert built.smem_bytes >= pbf.plan_for(hidden).stages * 4 * layout.threads * 16 + tokens * 4 * 4  # ring + pre table
    assert not undeclared(f"pre_big_fuse/{name}", built.source, declared_vector_args())


@pytest.mark.parametrize("hidden", EDGE_HIDDEN)
def test_edge_and_guarded_hidden_sizes_lower_within_the_cta_limits(hidden):
    for name, prim_func in pbf.lowering_cases(hidden).items():
        built = cuda_build.lower(prim_func)
        assert built.fits, (name, hidden, built.smem_bytes, built.threads)
        assert built.threads == pbf.grid_layout(hidden)[0]


def test_parameters_and_vector_accesses():
    """The kernel takes the launcher's tensors under their op names (no ARGUMENTS needed) plus ``rms_group_size``,
    reads ``residual`` (cp.async) and writes ``layer_input`` in 16-byte vectors, every mix by scalar accesses."""
    prim_func = pbf.build_mhc_pre_big_fuse(16, 4096, 4, 20)
    names = [prim_func.buffer_map[p].name if p in prim_func.buffer_map else p.name for p in prim_func.params]
    assert names == PARAMS
    source = cuda_build.lower_source(prim_func)
    assert vector_accesses(source) == {"residual": 16, "layer_input": 16}
    assert not hasattr(pbf, "ARGUMENTS")


@pytest.mark.parametrize("hidden", [1280, 4096])
def test_token_count_is_dynamic_and_never_in_the_key(hidden):
    from tvm import tirx

    prim_func = pbf.build_mhc_pre_big_fuse(16, hidden, 4, 10)
    dims = {prim_func.buffer_map[p].shape[0] for p in prim_func.params
            if p in prim_func.buffer_map and len(prim_func.buffer_map[p].shape) == 3}
    assert any(isinstance(d, tirx.Var) for d in dims)
    assert isinstance(prim_func.buffer_map[prim_func.params[1]].shape[1], tirx.Var)  # gemm_out_sqrsum (S, T)

    def key(tokens):
        gemm_out_mul = torch.empty(16, tokens, 24, device="meta")
        residual = torch.empty(tokens, 4, hidden, dtype=torch.bfloat16, device="meta")
        return pbf.KERNEL.key(gemm_out_mul, residual, 10, 16)

    assert key(1) == key(509) == key(8192) == pbf.BigFuseKey(n_splits=16, hidden_size=hidden, hc_mult=4, repeat=10)


@pytest.mark.parametrize("args", [
    (16, 4000, 4, 10),  # H not a multiple of 64
    (16, 192, 4, 10),  # H below the range
    (16, 8256, 4, 10),  # H above the range
    (0, 4096, 4, 10),  # no split
    (4 * 4096 // 64 + 1, 4096, 4, 10),  # more splits than 64-column blocks
    (16, 4096, 4, 0),  # no Sinkhorn iteration
    (16, 4096, 4, MHC_SINKHORN_REPEAT["cuda"].high + 1),
    (16, 4096, 2, 10),  # m != 4
])
def test_out_of_range_builds_raise_limit_error(args):
    with pytest.raises(LimitError):
        pbf.build_mhc_pre_big_fuse(*args)


def test_key_refuses_a_split_count_that_is_not_the_partials():
    gemm_out_mul = torch.empty(8, 3, 24, device="meta")
    residual = torch.empty(3, 4, 4096, dtype=torch.bfloat16, device="meta")
    with pytest.raises(LimitError):
        pbf.KERNEL.key(gemm_out_mul, residual, 10, 16)


def test_launch_order(monkeypatch):
    """The key is (S, H, m, R); the launcher passes the tensors in the kernel's order (``comb_mix`` as (T, m*m)),
    ``rms_group_size = m*H`` and the scalars as floats."""
    tokens, hidden, splits = 3, 256, 4
    f32, bf16 = torch.float32, torch.bfloat16
    tensors = dict(gemm_out_mul=torch.zeros(splits, tokens, 24), gemm_out_sqrsum=torch.zeros(splits, tokens),
                   mhc_scale=torch.zeros(3), mhc_base=torch.zeros(24),
                   residual=torch.zeros(tokens, 4, hidden, dtype=bf16), post_mix=torch.zeros(tokens, 4, dtype=f32),
                   comb_mix=torch.zeros(tokens, 16), layer_input=torch.zeros(tokens, hidden, dtype=bf16))
    calls = []
    monkeypatch.setattr(pbf.KERNEL, "compiled", lambda key: lambda *args: calls.append((key, args)))
    pbf.mhc_pre_big_fuse(**tensors, rms_eps=1e-6, pre_eps=1e-2, sinkhorn_eps=1e-6, post_mult_value=2,
                         sinkhorn_repeat=20, n_splits=splits)
    (key, args), = calls
    assert key == pbf.BigFuseKey(n_splits=splits, hidden_size=hidden, hc_mult=4, repeat=20)
    assert len(args) == len(PARAMS)
    for name, arg in zip(PARAMS[:8], args[:8]):
        assert arg.data_ptr() == tensors[name].data_ptr() and arg.shape == tensors[name].shape, name
    assert args[8:] == (4.0 * hidden, 1e-6, 1e-2, 1e-6, 2.0)
    assert all(type(a) is float for a in args[8:])


@pytest.mark.parametrize("hidden,warps,threads", [(1280, 1, 224), (1280, 4, 320), (4096, 4, 192), (7168, 1, 192)])
def test_sinkhorn_warps_plan_lowers(hidden, warps, threads):
    """The alternative schedule with Sinkhorn warps of their own (up to one per pass left to the CTA after sharing
    the group's passes out over its chunks): within the CTA limits, a named barrier for the pre warp and streams."""
    import dataclasses

    plan = dataclasses.replace(pbf.PLAN, sinkhorn_warps=warps)
    assert pbf.grid_layout(hidden, plan)[0] == threads
    built = cuda_build.lower(pbf.build_mhc_pre_big_fuse(16, hidden, 4, 20, plan))
    assert built.fits and built.threads == threads
    assert "__sync_thread_partial(1, " in built.source and "__syncthreads()" not in built.source


# --- on the device (device tier) --------------------------------------------------------------------------------------

CHAIN_TOKENS = level_choice([1, 509], [0, 1, 509, 512, 1021, 8192], [0, 1, 509, 512, 1021, 8192])
CHAIN_HIDDEN = level_choice([1280, 4096], [1280, 2560, 4096, 5120, 7168], [1280, 2560, 4096, 5120, 7168])
CHAIN_REPEATS = level_choice([10], [1, 10, 20], [1, 10, 20])


@requires_device
@pytest.mark.parametrize("repeat", CHAIN_REPEATS)
@pytest.mark.parametrize("hidden", CHAIN_HIDDEN)
@pytest.mark.parametrize("tokens", CHAIN_TOKENS)
def test_pre_big_fuse_equals_the_unfused_chain(tokens, hidden, repeat, device, seed):
    splits = 16 if device.type == "cuda" else 1
    args = make_args("mhc_pre_big_fuse", tokens, hidden, seed=seed, device=device, repeat=repeat, splits=splits)
    gemm_out_mul, gemm_out_sqrsum, scale, base, residual, post, comb, layer_input = args[:8]
    rms_eps, pre_eps, sinkhorn_eps, post_mult = args[8:12]
    for t in (post, comb):
        t.fill_(float("nan"))  # every element must be written
    layer_input.fill_(float("nan"))
    ops.mhc_pre_big_fuse(*args)
    want = unfused_pre(gemm_out_mul, gemm_out_sqrsum, scale, base, residual, rms_eps, pre_eps, sinkhorn_eps,
                       post_mult, repeat, splits)
    for got, ref in zip((post, comb, layer_input), want):
        assert torch.equal(got, ref)

