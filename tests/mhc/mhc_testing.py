"""What the mHC op files (``test_mhc_<op module>.py``) share: not a test module.

Each op file parametrizes its tests over its own ops (:func:`ops_of`) or lowering cases and calls the checks
below, which hold the bodies of the tests every op module runs the same way: validation, fakes and opcheck (CPU
tier), lowering of both backends (CPU tier), the device tests against the fp32 references with their per-op
tolerances (:func:`check`, docs/ops/mhc.md#conventions) and opcheck on the device; also the helpers the two
fused ops' files share (the Ascend lowering cache, the SimdVF bodies, the unfused pre chain, which
tests/mhc/test_mhc_benchmark.py times as well). tests/mhc/conftest.py has pytest rewrite its asserts.
"""

import functools
import re
import shutil

import mhc_ref as ref
import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from mhc_cases import M3, OPS, make_args
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

import cann_ops_tilelang as ops
from cann_ops_tilelang import chips, limits
from cann_ops_tilelang.kernels.ascend import _build as ascend_build
from cann_ops_tilelang.kernels.ascend import mhc as ascend_mhc
from cann_ops_tilelang.kernels.ascend.mhc import multilayer_recompute, pre_big_fuse
from cann_ops_tilelang.kernels.cuda import _build as cuda_build
from cann_ops_tilelang.kernels.cuda import mhc as cuda_mhc

HAVE_NVCC = shutil.which("nvcc") is not None


def ops_of(module: str) -> list[str]:
    """The registered ops of the op module ``cann_ops_tilelang.mhc.<module>``, in registration order."""
    registered = ops.registered_ops()
    return [name for name in OPS if registered[name].declaration.module == module]


# --- CPU tier: validation, fakes and opcheck of every op --------------------------------------------------------------

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


def check_wrong_dtype_of_every_tensor_argument(name):
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


def check_wrong_shape_of_every_tensor_argument(name):
    args = make_args(name, 3, HIDDEN)
    for index, value in enumerate(args):
        if not isinstance(value, torch.Tensor):
            continue
        bad = list(args)
        bad[index] = torch.zeros((*value.shape, 2), dtype=value.dtype)
        with pytest.raises(ValueError) as info:
            namespace_op(name)(*bad)
        assert f"cann_ops_tilelang::{name}" in str(info.value)


def check_nothing_written_on_bad_input(name):
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


def check_cpu_tensors_have_no_kernel(name):
    with without_cpu_references(), pytest.raises(RuntimeError) as info:
        namespace_op(name)(*make_args(name, 2, HIDDEN))
    assert f"cann_ops_tilelang::{name}" in str(info.value) and "'cpu'" in str(info.value)


def check_fakes_match_references(name, tokens, seed):
    args = make_args(name, tokens, HIDDEN, seed=seed)
    real = as_tuple(namespace_op(name)(*tree_map_only(torch.Tensor, torch.clone, args)))
    mode = FakeTensorMode()
    with mode:
        fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
        fake = as_tuple(namespace_op(name)(*fake_args))
    assert [meta_of(t) for t in fake] == [meta_of(t) for t in real]


def check_opcheck(name, tokens, seed):
    torch.library.opcheck(namespace_op(name), tuple(make_args(name, tokens, HIDDEN, seed=seed)))


# --- CPU tier: the references' backward against float64 autograd ------------------------------------------------------


def f64(t):
    return t.detach().double().requires_grad_()


def close(got, want):
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-9, atol=1e-11)


# --- CPU tier: every kernel of the unfused ops lowers for both targets ------------------------------------------------

# The sizes that matter: the model sizes H = 4096 and 7168 here (CUDA: sm_90a cubins, their vector accesses checked
# against the ops' declarations; budgets checked at the largest, 7168); the range's edges (256, 8192) are lowered on
# both backends with their budgets by tests/test_limits.py. The four CUDA GEMM forward schedules (resident / streaming
# x 64- / 128-column steps) all occur at {256, 4096, 7168, 8192}; the schedule tests in test_mhc_gemm_with_sqrsum.py
# cover every size unlowered.
LOWERING_HIDDEN = [4096, 7168]
# op modules of the per-token kernels, which do not depend on H
PER_TOKEN = ("reduce_partials_and_rmsnorm/", "pre_split_mixes/", "sinkhorn/", "head_compute_mix/")
# the fused ops' kernels are lowered and checked by their own files (test_mhc_pre_big_fuse.py,
# test_mhc_multilayer_recompute.py)
FUSED = ("pre_big_fuse/", "multilayer_recompute/")


@functools.cache
def _family_case_names(family, hidden):
    return sorted(family.lowering_cases(hidden))


def lowering_cases(family, module):
    """(H, case) pairs of the op module ``module`` in ``family`` (``ascend_mhc`` or ``cuda_mhc``): per-token cases
    only at the first H, they do not depend on it."""
    out = []
    for h in LOWERING_HIDDEN:
        names = _family_case_names(family, h)
        out += [(h, name) for name in names if name.startswith(f"{module}/")
                and not name.startswith(FUSED) and (h == LOWERING_HIDDEN[0] or not name.startswith(PER_TOKEN))]
    return out


def check_ascend_lowers_within_ub(hidden, name):
    lowered = ascend_build.lower_ascendc(ascend_mhc.lowering_cases(hidden)[name])
    assert "__aicore__" in lowered.source or "__global__" in lowered.source
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (name, hidden, lowered.ub_bytes, lowered.budget_bytes)
    assert lowered.cube_fits, (name, hidden, lowered.cube_bytes)  # L1 / L0A / L0B / L0C of a Cube core


def check_cuda_compiles_to_sm90a_cubin(hidden, name):
    built = cuda_build.compile_cubin(cuda_mhc.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
    assert built.fits, (name, hidden, built.smem_bytes, built.budget_bytes, built.threads)
    # every argument its ops pass in and the kernel accesses in vectors is declared (op helper's alignment check)
    assert not undeclared(name, built.source, declared_vector_args())


def check_values_outside_the_declared_ranges_raise_limit_error(call):
    with pytest.raises(limits.LimitError, match=r"must be"):
        call()


# --- CPU tier: the Ascend 950 kernels of the fused ops ----------------------------------------------------------------

CORES = chips.ASCEND_950.vector_cores
M = limits.MHC_HC_MULT.high
# The sizes that matter: every case at the model sizes (4096, 7168) and at the range's edges (256, 8192; not lowered
# again by tests/test_limits.py); 1280 as well from test level 1. The 10-layer recompute chains (40-65 s each to
# lower, the rest a few seconds) at 4096 alone below level 1: their hidden tile and UB are those of the 3-layer cases
# (bytes per column depend on min(L, 2) and min(Lp, 2)), which every size lowers. The vector-function contracts
# compare at 4096 (and 7168 from level 1, where the fused kernels' hidden tiles differ from the unfused ones').
FUSED_HIDDEN = level_choice([4096, 7168], [1280, 4096, 7168])
LONG_CHAINS = level_choice([4096], [*FUSED_HIDDEN, *limits.MHC_HIDDEN.edges()])
CONTRACT_HIDDEN = level_choice([4096], [4096, 7168])
MODULES = {"pre_big_fuse": pre_big_fuse, "multilayer_recompute": multilayer_recompute}


def fused_lowering_cases(module):
    """(H, module, case) params of one fused op module's Ascend lowering cases."""
    out = [(h, module, case) for h in [*FUSED_HIDDEN, *limits.MHC_HIDDEN.edges()]
           for case in sorted(MODULES[module].lowering_cases(h)) if h in LONG_CHAINS or "_l10_" not in case]
    # tests of one hidden size share an xdist worker (and so the lowered sources cached below)
    return [pytest.param(h, module, case, marks=pytest.mark.xdist_group(f"ascend-fused-h{h}"))
            for h, module, case in out]


@functools.cache
def _lowered(hidden: int, module: str, case: str) -> ascend_build.LoweredAscend:
    return ascend_build.lower_ascendc(MODULES[module].lowering_cases(hidden)[case])


@functools.cache
def _lowered_prim_func(build, *key) -> ascend_build.LoweredAscend:
    return ascend_build.lower_ascendc(build(*key))


def check_fused_lowers_within_ub(hidden, module, case):
    lowered = _lowered(hidden, module, case)
    assert "__aicore__" in lowered.source or "__global__" in lowered.source
    assert not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (case, hidden, lowered.ub_bytes, lowered.budget_bytes)
    if module == "pre_big_fuse":
        splits = int(re.search(r"_s(\d+)_", case).group(1))
        assert lowered.ub_bytes == pre_big_fuse.mhc_pre_big_fuse_ub_bytes(hidden, M, splits)


def check_fused_token_count_is_dynamic(module):
    from tvm import tirx

    for case, prim_func in MODULES[module].lowering_cases(1280).items():
        buffers = [prim_func.buffer_map[p] for p in prim_func.params if p in prim_func.buffer_map]
        dims = {d for b in buffers for d in b.shape if isinstance(d, tirx.Var)}
        assert [str(d.name) for d in dims] == ["num_tokens"], (case, dims)
        (tokens,) = dims
        params = {str(b.name) for b in buffers if not any(d.same_as(tokens) for d in b.shape)}
        assert params <= {"mhc_scale", "mhc_base"}, (case, params)


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


def check_out_of_range_raises_limit_error(call):
    with pytest.raises(limits.LimitError, match=r"mhc_(pre_big_fuse|multilayer_recompute)"):
        call()


# --- device tier: every op against its fp32 reference -----------------------------------------------------------------

DEVICE_TOKENS = level_choice([1, 509], [0, 1, 509, 1001, 8192], [0, 1, 509, 1001, 4096, 8192, 16384])
DEVICE_HIDDEN_SIZES = level_choice([1280, 4096], [1280, 2560, 4096, 7168], [1280, 2560, 4096, 5120, 7168])
DEVICE_HIDDEN = [pytest.param(h, marks=pytest.mark.xdist_group(f"mhc-H{h}")) for h in DEVICE_HIDDEN_SIZES]


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


def check_streaming_op_vs_reference(name, tokens, hidden, device, seed):
    args = make_args(name, tokens, hidden, seed=seed, device=device)
    check(name, *run_both(name, args), tokens)


def check_per_token_op_vs_reference(name, tokens, device, seed):
    args = make_args(name, tokens, 4096, seed=seed, device=device)
    check(name, *run_both(name, args), tokens)


def check_accumulating_ops_use_the_prior_content(name, device, seed):
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


def check_opcheck_on_device(name, device, seed):
    torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, name).default,
                          tuple(make_args(name, 37, 1280, seed=seed, device=device)))


# --- device tier: the fused pre against the chain of primitives it replaces -------------------------------------------


def unfused_pre(gemm_out_mul, gemm_out_sqrsum, scale, base, residual, rms_eps, pre_eps, sinkhorn_eps, post_mult,
                repeat, splits):
    tokens, m, hidden = residual.shape
    new = lambda *shape: torch.empty(shape, device=residual.device)  # noqa: E731
    out_mul, sqrsum, mixes = new(tokens, 1, M3), new(tokens, 1), new(tokens, M3)
    ops.mhc_reduce_partials_and_rmsnorm_forward(gemm_out_mul.view(splits, tokens, 1, M3),
                                                gemm_out_sqrsum.view(splits, tokens, 1), out_mul, sqrsum, mixes,
                                                m * hidden, rms_eps, splits)
    pre, post, logits = new(tokens, m), new(tokens, m), new(tokens, m * m)
    ops.mhc_pre_split_mixes_forward(mixes, scale, base, pre, post, logits, post_mult, pre_eps)
    comb = new(tokens, m, m)
    ops.mhc_sinkhorn_forward(logits.view(tokens, m, m), comb, repeat, sinkhorn_eps)
    layer_input = residual.new_empty(tokens, hidden)
    ops.mhc_pre_apply_mix_forward(residual, pre, layer_input)
    return post, comb.view(tokens, m * m), layer_input


def op_module_tests(module: str) -> dict:
    """The tests every op file runs alike over the ops of ``cann_ops_tilelang.mhc.<module>``: validation (wrong
    dtype and shape of every tensor argument, nothing written on bad input, no CPU kernel), fakes against the
    references, opcheck, and opcheck on the device. An op file takes them in with
    ``globals().update(op_module_tests("<module>"))``; their node ids are those of tests written in the file."""
    from _plugins.device import requires_device

    by_name = pytest.mark.parametrize("name", ops_of(module))
    by_tokens = pytest.mark.parametrize("tokens", TOKENS)

    @by_name
    def test_wrong_dtype_of_every_tensor_argument(name):
        check_wrong_dtype_of_every_tensor_argument(name)

    @by_name
    def test_wrong_shape_of_every_tensor_argument(name):
        check_wrong_shape_of_every_tensor_argument(name)

    @by_name
    def test_nothing_written_on_bad_input(name):
        check_nothing_written_on_bad_input(name)

    @by_name
    def test_cpu_tensors_have_no_kernel(name):
        check_cpu_tensors_have_no_kernel(name)

    @by_tokens
    @by_name
    def test_fakes_match_references(name, tokens, seed):
        check_fakes_match_references(name, tokens, seed)

    @by_tokens
    @by_name
    def test_opcheck(name, tokens, seed):
        check_opcheck(name, tokens, seed)

    @requires_device
    @by_name
    def test_opcheck_on_device(name, device, seed):
        check_opcheck_on_device(name, device, seed)

    return {name: test for name, test in locals().items() if name.startswith("test_")}
