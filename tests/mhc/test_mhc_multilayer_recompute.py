"""``mhc_multilayer_recompute`` (docs/ops/mhc.md#multilayer_recompute): validation (more layers than its kernels
take refused), fakes against the reference and opcheck (CPU tier). Its Ascend 950 kernel (lowering, no bisheng; CPU
tier): every lowering case within the UB budget at the model sizes H in {4096, 7168} (and 1280 from test level 1)
and at the range's edges 256 and 8192, with the token count a dynamic dimension; one apply-mix and one post vector
function per layer, each the unfused kernel's; one buffer parameter per list element; the launcher's chained
launches (at most ``PLAN.layers_per_kernel`` layers each) giving the unfused chain's result; the declared ranges
(``limits.LimitError``), both edges of the layer range and the longest launch at H = 8192. Its CUDA kernel (CPU
tier): sm_90a cubins within the CTA limits at the edge, guarded and model hidden sizes (which tests/test_limits.py
leaves to this file), its parameters the list elements in the launcher's order with one dynamic token count, the
16-byte accesses the op declares, out-of-range builds refused, and fp32 arithmetic of the contraction shape of the
chain it replaces (``mhc_pre_apply_mix_forward`` then ``mhc_post_forward``). On the device (device tier): equal bit
for bit to that chain, and opcheck there."""

import re
import subprocess
import tempfile

import mhc_ref as ref
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
    HIDDEN,
    M,
    _lowered,
    _lowered_prim_func,
    _unfused_vector_functions,
    check_fused_lowers_within_ub,
    check_fused_token_count_is_dynamic,
    check_out_of_range_raises_limit_error,
    cuda_mhc,
    fused_lowering_cases,
    op_module_tests,
    ops_of,
    vector_functions,
)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.kernels.ascend.mhc import multilayer_recompute, post, pre_apply_mix
from cann_ops_tilelang.kernels.cuda import _build as cuda_build
from cann_ops_tilelang.kernels.cuda.mhc import multilayer_recompute as mr
from cann_ops_tilelang.limits import MHC_RECOMPUTE_LAYERS, LimitError

OPS = ops_of("multilayer_recompute")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("multilayer_recompute"))


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


# --- the Ascend 950 kernel (CPU tier) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden,module,case", fused_lowering_cases("multilayer_recompute"))
def test_lowers_within_ub(hidden, module, case):
    check_fused_lowers_within_ub(hidden, module, case)


@pytest.mark.parametrize("module", ["multilayer_recompute"])
def test_token_count_is_dynamic(module):
    check_fused_token_count_is_dynamic(module)


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


ASCEND_OUT_OF_RANGE = {
    "recompute layers 0": lambda: multilayer_recompute.build_mhc_multilayer_recompute(1280, M, 0, 0, CORES),
    "recompute layers": lambda: multilayer_recompute.build_mhc_multilayer_recompute(
        1280, M, limits.MHC_RECOMPUTE_LAYERS.high + 1, limits.MHC_RECOMPUTE_LAYERS.high + 1, CORES),
    "recompute post layers": lambda: multilayer_recompute.build_mhc_multilayer_recompute(1280, M, 3, 1, CORES),
    "recompute hidden": lambda: multilayer_recompute.build_mhc_multilayer_recompute(200, M, 3, 3, CORES),
    "recompute hc_mult": lambda: multilayer_recompute.build_mhc_multilayer_recompute(1280, 2, 3, 3, CORES),
    "recompute key lists": lambda: multilayer_recompute.KERNEL.key(
        torch.empty(2, M, 1280), [None] * 3, [None] * 2, [None] * 2, [None] * 2, [None] * 3, [None] * 3),
}


@pytest.mark.parametrize("what", sorted(ASCEND_OUT_OF_RANGE))
def test_out_of_range_raises_limit_error(what):
    check_out_of_range_raises_limit_error(ASCEND_OUT_OF_RANGE[what])


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


# --- the CUDA kernel (CPU tier) ---------------------------------------------------------------------------------------

LAYERS = [(1, 1), (3, 2), (3, 3), (10, 9), (10, 10)]
# the sizes that matter: the range's edges, a guarded layout (H / 8 = 40 vectors: 64 threads, the last 24 slots
# guarded) and the model sizes
CUDA_HIDDEN = [256, 320, 4096, 7168, 8192]


def test_lowering_cases_cover_the_layer_counts():
    cases = mr.lowering_cases(4096)
    assert sorted(cases) == sorted(f"mhc_multilayer_recompute_l{l}_p{p}" for l, p in LAYERS)
    assert all(name.startswith("mhc_multilayer_recompute") for name in cases)
    family = cuda_mhc.lowering_cases(4096)
    assert {f"multilayer_recompute/{name}" for name in cases} <= set(family)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden", CUDA_HIDDEN)
@pytest.mark.parametrize("name", sorted(mr.lowering_cases(4096)))
def test_compiles_to_sm90a_cubin(hidden, name):
    built = cuda_build.compile_cubin(mr.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
    assert built.fits, (name, hidden, built.smem_bytes, built.budget_bytes, built.threads)
    assert built.threads == mr.recompute_layout(hidden).threads
    layers, post_layers = (int(v) for v in re.search(r"_l(\d+)_p(\d+)", name).groups())
    # the per-layer scalar table and the threads' slots of the layer outputs in flight (16 bytes each)
    slots = min(mr.PLAN.y_stages, post_layers) * built.threads * 16
    assert built.smem_bytes == layers * 24 * 4 + slots
    assert not undeclared(f"multilayer_recompute/{name}", built.source, declared_vector_args())


def test_widest_chain_lowers():
    """L = Lp = 64 (the top of limits.MHC_RECOMPUTE_LAYERS): 385 parameters, within the CTA limits."""
    high = MHC_RECOMPUTE_LAYERS.high
    prim_func = mr.build_mhc_multilayer_recompute(8192, 4, high, high)
    assert len(prim_func.params) == 6 * high + 1
    assert 6 * high * 8 + 8 + 4 <= 4096  # pointers and the token count in the classic kernel parameter space
    assert cuda_build.lower(prim_func).fits


@pytest.mark.parametrize("layers,post_layers", LAYERS + [(1, 0), (7, 6)])
def test_parameters_are_the_list_elements_in_launcher_order(layers, post_layers):
    from tvm import tirx

    prim_func = mr.build_mhc_multilayer_recompute(1280, 4, layers, post_layers)
    names = [prim_func.buffer_map[p].name for p in prim_func.params]
    assert names == mr.kernel_arguments(layers, post_layers)
    assert names[0] == "initial_residual"
    assert sum(n.startswith("pre_mix_list_") for n in names) == layers
    assert sum(n.startswith("residual_list_") for n in names) == post_layers
    # one dynamic token count shared by every buffer
    dims = {prim_func.buffer_map[p].shape[0] for p in prim_func.params}
    assert len(dims) == 1 and isinstance(dims.pop(), tirx.Var)
    # every parameter maps to its op argument
    assert all(mr.ARGUMENTS.get(n, n) in {"initial_residual", *(name for name, _ in mr.LISTS)} for n in names)


def test_arguments_cover_every_layer():
    high = MHC_RECOMPUTE_LAYERS.high
    for name, _ in mr.LISTS:
        assert mr.ARGUMENTS[f"{name}_0"] == name and mr.ARGUMENTS[f"{name}_{high - 1}"] == name
        assert f"{name}_{high}" not in mr.ARGUMENTS


def test_vector_accesses():
    """16-byte vectors on the (T, ., H) tensors of every layer; the mixes are read by scalar loads."""
    source = cuda_build.lower_source(mr.build_mhc_multilayer_recompute(4096, 4, 3, 2))
    accesses = vector_accesses(source)
    expected = {"initial_residual": 16, "layer_output_list_0": 16, "layer_output_list_1": 16,
                **{f"layer_input_list_{l}": 16 for l in range(3)}, "residual_list_0": 16, "residual_list_1": 16}
    assert accesses == expected


def test_key_and_launch_order(monkeypatch):
    """The key is (H, m, L, Lp), never T; the launcher passes the lists unpacked in the kernel's parameter order."""
    tokens, hidden, layers, post_layers = 3, 256, 3, 2
    bf16, f32 = torch.bfloat16, torch.float32
    named = {"initial_residual": torch.zeros(tokens, 4, hidden, dtype=bf16)}
    shapes = {"pre_mix_list": ((tokens, 4), f32), "layer_output_list": ((tokens, hidden), bf16),
              "post_mix_list": ((tokens, 4), f32), "comb_mix_list": ((tokens, 4, 4), f32),
              "layer_input_list": ((tokens, hidden), bf16), "residual_list": ((tokens, 4, hidden), bf16)}
    lists = {}
    for name, count in mr.LISTS:
        shape, dtype = shapes[name]
        lists[name] = [torch.zeros(shape, dtype=dtype) for _ in range(layers if count == "L" else post_layers)]
        named.update({f"{name}_{l}": t for l, t in enumerate(lists[name])})
    calls = []
    monkeypatch.setattr(mr.KERNEL, "compiled", lambda key: lambda *args: calls.append((key, args)))
    mr.mhc_multilayer_recompute(named["initial_residual"], **lists)
    (key, args), = calls
    assert key == mr.RecomputeKey(hidden, 4, layers, post_layers)
    expected = [named[n] for n in mr.kernel_arguments(layers, post_layers)]
    assert len(args) == len(expected) and all(a is e for a, e in zip(args, expected))


@pytest.mark.parametrize("args", [
    (4096, 4, 0, 0),  # no layer
    (4096, 4, MHC_RECOMPUTE_LAYERS.high + 1, MHC_RECOMPUTE_LAYERS.high + 1),
    (4096, 4, 3, 1),  # Lp must be L - 1 or L
    (4096, 4, 3, 4),
    (4000, 4, 3, 3),  # H not a multiple of 64
    (128, 4, 3, 3),  # H below the range
    (4096, 2, 3, 3),  # m != 4
])
def test_out_of_range_builds_raise_limit_error(args):
    with pytest.raises(LimitError):
        mr.build_mhc_multilayer_recompute(*args)


def _ptx_float_ops(prim_func) -> dict:
    """Counts of the fp32 multiply, add and fused multiply-add instructions in the PTX of ``prim_func``."""
    from tilelang.contrib.nvcc import default_compile_options

    source = cuda_build.lower_source(prim_func)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/kernel.cu"
        with open(path, "w") as f:
            f.write(source)
        subprocess.run(["nvcc", "--ptx", "-O3", "-arch=sm_90a", "-w", *default_compile_options(), "-o",
                        f"{tmp}/kernel.ptx", path], check=True, capture_output=True)
        with open(f"{tmp}/kernel.ptx") as f:
            ptx = f.read()
    return {op: len(re.findall(rf"^\s*{op}(?:\.rn)?\.f32\s", ptx, re.M)) for op in ("mul", "add", "fma")}


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build PTX here")
def test_arithmetic_has_the_chains_contraction_shape():
    """Per output element, the chain's kernels leave exactly one product unfused (rounded) and fuse the rest into
    FMAs (m - 1 for a sublayer input, m for a residual), with no separate add; the fused kernel does exactly the
    same per layer, so nvcc gave it the same fp32 sequences (checked bitwise on an H200 as well)."""
    # the CUDA kernels (this file's module-level post and pre_apply_mix are the Ascend ones)
    from cann_ops_tilelang.kernels.cuda.mhc import _common, post, pre_apply_mix

    hidden, m, layers, post_layers = 4096, 4, 3, 2
    apply_vectors = _common.row_chunk(pre_apply_mix.forward_layout(hidden).nv)  # vectors per thread
    post_vectors = _common.row_chunk(post.forward_layout(hidden).nv)
    apply_ops = _ptx_float_ops(pre_apply_mix.build_mhc_pre_apply_mix_forward(hidden, m))
    post_ops = _ptx_float_ops(post.build_mhc_post_forward(hidden, m))
    ours = _ptx_float_ops(mr.build_mhc_multilayer_recompute(hidden, m, layers, post_layers))
    vec = _common.VEC
    assert apply_ops == {"mul": apply_vectors * vec, "add": 0, "fma": apply_vectors * vec * (m - 1)}
    assert post_ops == {"mul": post_vectors * m * vec, "add": 0, "fma": post_vectors * m * vec * m}
    assert ours == {op: layers * apply_ops[op] // apply_vectors + post_layers * post_ops[op] // post_vectors
                    for op in ("mul", "add", "fma")}


# --- on the device (device tier) --------------------------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("layers,kept", [(1, 1), (3, 2), (3, 3), (10, 9), (10, 10)])
@pytest.mark.parametrize("hidden", level_choice([1280], [1280, 4096, 7168], [1280, 2560, 4096, 7168]))
@pytest.mark.parametrize("tokens", level_choice([509], [0, 1, 509, 8192], [0, 1, 509, 1021, 8192]))
def test_multilayer_recompute_equals_the_apply_mix_post_chain(layers, kept, tokens, hidden, device, seed):
    import mhc_cases

    saved = mhc_cases.RECOMPUTE_LAYERS
    mhc_cases.RECOMPUTE_LAYERS = (layers, kept)
    try:
        args = make_args("mhc_multilayer_recompute", tokens, hidden, seed=seed, device=device)
    finally:
        mhc_cases.RECOMPUTE_LAYERS = saved
    residual0, pres, outputs, posts, combs, inputs, residuals = args
    ops.mhc_multilayer_recompute(*args)
    r = residual0
    for layer in range(layers):
        li = torch.empty_like(inputs[layer])
        ops.mhc_pre_apply_mix_forward(r, pres[layer], li)
        assert torch.equal(inputs[layer], li), layer
        if layer < kept:
            r = ops.mhc_post_forward(outputs[layer], r, posts[layer], combs[layer])
            assert torch.equal(residuals[layer], r), layer

