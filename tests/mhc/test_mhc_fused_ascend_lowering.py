"""CPU tier: the Ascend 950 kernels of the fused mHC ops (``mhc_pre_big_fuse``, ``mhc_multilayer_recompute``).

No NPU runs here, so the checks are on the lowering (TileLang -> AscendC, no bisheng) and on the launchers:

* every lowering case lowers within the UB budget at the model sizes H in {4096, 7168} (and 1280 from test level 1)
  and at the range's edges 256 and 8192 (which tests/test_limits.py leaves to this file), with the token count a
  dynamic dimension;
* the bitwise contract at the instruction level: the fused kernels' vector functions are the unfused
  kernels' ones (reduce + RMSNorm, split mixes, Sinkhorn, apply mix; apply mix and post), the same
  instructions on the same registers, up to UB addresses and the hidden tile's loop count;
* the recompute takes one buffer parameter per list element, and its launcher's chained launches (at most
  ``PLAN.layers_per_kernel`` layers each) give the unfused chain's result (kernels replaced by the reference
  of one launch); the fused pre launcher passes the reduce launcher's fp32(1/(m*H));
* values outside the declared ranges raise ``limits.LimitError``; the pre kernel's per-core token ranges cover
  ragged token counts exactly once.
"""

import functools
import re

import pytest
import torch
from _plugins.levels import level_choice

pytest.importorskip("tilelang")

import mhc_ref as ref  # noqa: E402

from cann_ops_tilelang import chips, limits  # noqa: E402
from cann_ops_tilelang.kernels import _family  # noqa: E402
from cann_ops_tilelang.kernels.ascend import _build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import mhc as ascend_mhc  # noqa: E402
from cann_ops_tilelang.kernels.ascend.mhc import (  # noqa: E402
    multilayer_recompute,
    post,
    pre_apply_mix,
    pre_big_fuse,
    pre_split_mixes,
    reduce_partials_and_rmsnorm,
    sinkhorn,
)

CORES = chips.ASCEND_950.vector_cores
M = limits.MHC_HC_MULT.high
# The sizes that matter: every case at the model sizes (4096, 7168) and at the range's edges (256, 8192; not lowered
# again by tests/test_limits.py); 1280 as well from test level 1. The 10-layer recompute chains (40-65 s each to
# lower, the rest a few seconds) at 4096 alone below level 1: their hidden tile and UB are those of the 3-layer cases
# (bytes per column depend on min(L, 2) and min(Lp, 2)), which every size lowers. The vector-function contracts
# below compare at 4096 (and 7168 from level 1, where the fused kernels' hidden tiles differ from the unfused ones').
HIDDEN = level_choice([4096, 7168], [1280, 4096, 7168])
LONG_CHAINS = level_choice([4096], [*HIDDEN, *limits.MHC_HIDDEN.edges()])
CONTRACT_HIDDEN = level_choice([4096], [4096, 7168])
MODULES = {"pre_big_fuse": pre_big_fuse, "multilayer_recompute": multilayer_recompute}


def _cases():
    out = [(h, module, case) for h in [*HIDDEN, *limits.MHC_HIDDEN.edges()] for module in MODULES
           for case in sorted(MODULES[module].lowering_cases(h)) if h in LONG_CHAINS or "_l10_" not in case]
    # tests of one hidden size share an xdist worker (and so the lowered sources cached below)
    return [pytest.param(h, module, case, marks=pytest.mark.xdist_group(f"ascend-fused-h{h}"))
            for h, module, case in out]


@functools.cache
def _lowered(hidden: int, module: str, case: str) -> _build.LoweredAscend:
    return _build.lower_ascendc(MODULES[module].lowering_cases(hidden)[case])


@functools.cache
def _lowered_prim_func(build, *key) -> _build.LoweredAscend:
    return _build.lower_ascendc(build(*key))


def test_aggregator_lists_the_fused_kernels():
    assert {"pre_big_fuse", "multilayer_recompute"} <= set(_family.op_modules(ascend_mhc.__name__))
    names = set(pre_big_fuse.lowering_cases(1280)) | set(multilayer_recompute.lowering_cases(1280))
    assert names == {f"mhc_pre_big_fuse_s{s}_r{r}" for s in (1, 16) for r in (10, 20)} | {
        f"mhc_multilayer_recompute_l{layers}_lp{p}" for layers, p in ((1, 1), (3, 2), (3, 3), (10, 9), (10, 10))}


@pytest.mark.parametrize("hidden,module,case", _cases())
def test_lowers_within_ub(hidden, module, case):
    lowered = _lowered(hidden, module, case)
    assert "__aicore__" in lowered.source or "__global__" in lowered.source
    assert not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (case, hidden, lowered.ub_bytes, lowered.budget_bytes)
    if module == "pre_big_fuse":
        splits = int(re.search(r"_s(\d+)_", case).group(1))
        assert lowered.ub_bytes == pre_big_fuse.mhc_pre_big_fuse_ub_bytes(hidden, M, splits)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_token_count_is_dynamic(module):
    from tvm import tirx

    for case, prim_func in MODULES[module].lowering_cases(1280).items():
        buffers = [prim_func.buffer_map[p] for p in prim_func.params if p in prim_func.buffer_map]
        dims = {d for b in buffers for d in b.shape if isinstance(d, tirx.Var)}
        assert [str(d.name) for d in dims] == ["num_tokens"], (case, dims)
        (tokens,) = dims
        params = {str(b.name) for b in buffers if not any(d.same_as(tokens) for d in b.shape)}
        assert params <= {"mhc_scale", "mhc_base"}, (case, params)


# --- the bitwise contract, instruction by instruction ------------------------------------------------------

_VF = re.compile(r"__simd_vf__ inline void \w+\([^)]*\) \{\n(.*?)\n\}\n", re.S)


def vector_functions(source: str) -> list[str]:
    """Bodies of the SimdVF functions of a generated AscendC source, with the UB addresses (``buf_dyn_shmem``
    subscripts) and the trip counts of their loops blanked: what is left is the instruction sequence, its
    operands and its registers."""
    bodies = []
    for body in _VF.findall(source):
        body = re.sub(r"buf_dyn_shmem\)\[[^\[\]]*\]", "buf_dyn_shmem)[]", body)
        bodies.append(re.sub(r"(for \(int32_t (\w+) = \d+; \2 < )\d+;", r"\1N;", body))
    return bodies


def _unfused_vector_functions(*builds) -> set[str]:
    out = set()
    for build, *key in builds:
        out |= set(vector_functions(_lowered_prim_func(build, *key).source))
    return out


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


@pytest.mark.parametrize("hidden", [pytest.param(h, marks=pytest.mark.xdist_group(f"ascend-fused-h{h}"))
                                    for h in CONTRACT_HIDDEN])
@pytest.mark.parametrize("layers,post_layers", [(1, 1), (3, 2)])
def test_multilayer_recompute_runs_the_unfused_vector_functions(hidden, layers, post_layers):
    """One apply-mix VF per layer and one post VF per post layer, each the unfused kernel's."""
    case = f"mhc_multilayer_recompute_l{layers}_lp{post_layers}"
    fused = vector_functions(_lowered(hidden, "multilayer_recompute", case).source)
    apply_vf = _unfused_vector_functions((pre_apply_mix.build_mhc_pre_apply_mix_forward, hidden, M, CORES))
    post_vf = _unfused_vector_functions((post.build_mhc_post_forward, hidden, M, CORES))
    assert len(apply_vf) == len(post_vf) == 1
    assert sorted(fused) == sorted([*apply_vf] * layers + [*post_vf] * post_layers)


# --- lists of tensors and the launchers ----------------------------------------------------------------------


@pytest.mark.parametrize("layers,post_layers", [(1, 0), (3, 2), (4, 4)])
def test_recompute_takes_one_parameter_per_list_element(layers, post_layers):
    prim_func = multilayer_recompute.build_mhc_multilayer_recompute(1280, M, layers, post_layers, CORES)
    names = [str(prim_func.buffer_map[p].name) for p in prim_func.params if p in prim_func.buffer_map]
    assert names == multilayer_recompute.kernel_arguments(layers, post_layers)
    assert len(names) == 1 + 2 * layers + 4 * post_layers
    assert set(names[1:]) <= set(multilayer_recompute.ARGUMENTS)
    buffers = [prim_func.buffer_map[p] for p in prim_func.params]
    shapes = {str(b.name): [str(d) for d in b.shape] for b in buffers}
    if post_layers:
        assert shapes["comb_mix_list_0"] == ["num_tokens", "4", "4"]
        assert shapes[f"residual_list_{post_layers - 1}"] == ["num_tokens", "4", "1280"]
    assert shapes[f"layer_input_list_{layers - 1}"] == ["num_tokens", "1280"]


def _recompute_args(tokens, hidden, layers, post_layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    bf16 = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return dict(
        initial_residual=bf16(tokens, M, hidden),
        pre_mix_list=[torch.rand(tokens, M, generator=g) for _ in range(layers)],
        layer_output_list=[bf16(tokens, hidden) for _ in range(post_layers)],
        post_mix_list=[2 * torch.rand(tokens, M, generator=g) for _ in range(post_layers)],
        comb_mix_list=[torch.rand(tokens, M, M, generator=g) for _ in range(post_layers)],
        layer_input_list=[torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(layers)],
        residual_list=[torch.full((tokens, M, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(post_layers)],
    )


@pytest.mark.parametrize("layers,post_layers", [(1, 0), (1, 1), (3, 3), (7, 6), (7, 7), (9, 8)])
def test_recompute_launches_chain_to_the_unfused_result(layers, post_layers, monkeypatch):
    """With 3 layers per kernel, the launcher's launches (each replaced by the reference of one launch, read
    through the kernel's parameter names) give the reference chain's every output bit for bit."""
    launches = []

    def compiled(key):
        run, post_run = key.layers, key.post_layers
        names = multilayer_recompute.kernel_arguments(run, post_run)

        def kernel(*tensors):
            assert len(tensors) == len(names)
            named = dict(zip(names, tensors))
            lists = {name: [named[f"{name}_{i}"] for i in range({"L": run, "Lp": post_run}[count])]
                     for name, count in multilayer_recompute.LISTS}
            launches.append((run, post_run))
            ref.mhc_multilayer_recompute_ref(named["initial_residual"], **lists)

        return kernel

    monkeypatch.setattr(multilayer_recompute, "PLAN", multilayer_recompute.RecomputePlan(stages=2, layers_per_kernel=3))
    monkeypatch.setattr(multilayer_recompute.KERNEL, "compiled", compiled)
    monkeypatch.setattr(multilayer_recompute, "num_vector_cores", lambda: CORES)
    args = _recompute_args(5, 256, layers, post_layers)
    expected = _recompute_args(5, 256, layers, post_layers)
    multilayer_recompute.mhc_multilayer_recompute(**args)
    ref.mhc_multilayer_recompute_ref(**expected)
    assert launches == [(run, post_run) for _, run, post_run in multilayer_recompute.PLAN.chunks(layers, post_layers)]
    for name in ("layer_input_list", "residual_list"):
        for got, want in zip(args[name], expected[name], strict=True):
            assert torch.equal(got, want), name


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


# --- declared ranges -----------------------------------------------------------------------------------------

OUT_OF_RANGE = {
    "fuse hidden": lambda: pre_big_fuse.build_mhc_pre_big_fuse(limits.MHC_HIDDEN.high + 64, M, 16, 20, CORES),
    "fuse hidden step": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280 + 32, M, 16, 20, CORES),
    "fuse hc_mult": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, 3, 16, 20, CORES),
    "fuse n_splits 0": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 0, 20, CORES),
    "fuse n_splits > K/64": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 4 * 1280 // 64 + 1, 20, CORES),
    "fuse repeat 0": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 16, 0, CORES),
    "fuse repeat": lambda: pre_big_fuse.build_mhc_pre_big_fuse(1280, M, 16, sinkhorn.REPEAT.high + 1, CORES),
    "fuse key splits": lambda: pre_big_fuse.KERNEL.key(torch.empty(8, 2, 24), torch.empty(2, M, 1280), 20, 16),
    "recompute layers 0": lambda: multilayer_recompute.build_mhc_multilayer_recompute(1280, M, 0, 0, CORES),
    "recompute layers": lambda: multilayer_recompute.build_mhc_multilayer_recompute(
        1280, M, limits.MHC_RECOMPUTE_LAYERS.high + 1, limits.MHC_RECOMPUTE_LAYERS.high + 1, CORES),
    "recompute post layers": lambda: multilayer_recompute.build_mhc_multilayer_recompute(1280, M, 3, 1, CORES),
    "recompute hidden": lambda: multilayer_recompute.build_mhc_multilayer_recompute(200, M, 3, 3, CORES),
    "recompute hc_mult": lambda: multilayer_recompute.build_mhc_multilayer_recompute(1280, 2, 3, 3, CORES),
    "recompute key lists": lambda: multilayer_recompute.KERNEL.key(
        torch.empty(2, M, 1280), [None] * 3, [None] * 2, [None] * 2, [None] * 2, [None] * 3, [None] * 3),
}


@pytest.mark.parametrize("what", sorted(OUT_OF_RANGE))
def test_out_of_range_raises_limit_error(what):
    with pytest.raises(limits.LimitError, match=r"mhc_(pre_big_fuse|multilayer_recompute)"):
        OUT_OF_RANGE[what]()


@pytest.mark.parametrize("layers", limits.MHC_RECOMPUTE_LAYERS.edges())
def test_recompute_layer_range_edges_build(layers):
    """Both edges of the declared layer range build (the launcher runs the high one as
    ``layers / PLAN.layers_per_kernel`` launches, each lowered by the L = 16 case)."""
    for post_layers in (layers - 1, layers):
        prim_func = multilayer_recompute.build_mhc_multilayer_recompute(1280, M, layers, post_layers, CORES)
        assert len(prim_func.params) == 1 + 2 * layers + 4 * post_layers


@pytest.mark.xdist_group("ascend-fused-h8192")
def test_recompute_largest_launch_lowers_within_ub():
    """The longest run the launcher compiles (``PLAN.layers_per_kernel`` layers, Lp = L - 1) at H = 8192."""
    run = multilayer_recompute.PLAN.layers_per_kernel
    lowered = _lowered_prim_func(multilayer_recompute.build_mhc_multilayer_recompute, 8192, M, run, run - 1, CORES)
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes
    assert len(vector_functions(lowered.source)) == 2 * run - 1
