"""``mhc_gemm_with_sqrsum_forward`` / ``_backward`` (docs/ops/mhc.md#gemm_with_sqrsum): validation, fakes against
the references and opcheck, the reference backward against float64 autograd, a CPU model of the Ascend Cube
backward against the device tolerances, the reference's split ranges and TF32 rounding (CPU tier); both kernels
lowered for both targets (Ascend 950 within the UB and the Cube's L1 / L0 capacities, CUDA sm_90a cubins), the
Ascend backward on the Cube and its plan's budget and column tiles, the CUDA schedules (forward: resident or
streaming, pipeline step, CTAs per split; backward: token partitions, stages, occupancy, cp.async order) and the
builders' declared ranges (CPU tier); both ops against their references on the device at several split counts,
the CUDA forward schedules bitwise equal, the backward reproducible bitwise and accumulating into its prior
grad_x, and opcheck there (device tier)."""

import mhc_ref as ref
import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda, requires_device
from mhc_cases import M, make_args
from mhc_testing import (
    CORES,
    DEVICE_HIDDEN,
    DEVICE_TOKENS,
    HAVE_NVCC,
    HIDDEN,
    ascend_mhc,
    bf16_close,
    check,
    check_accumulating_ops_use_the_prior_content,
    check_ascend_lowers_within_ub,
    check_cuda_compiles_to_sm90a_cubin,
    check_streaming_op_vs_reference,
    check_values_outside_the_declared_ranges_raise_limit_error,
    close,
    cuda_mhc,
    f64,
    lowering_cases,
    op_module_tests,
    ops_of,
    run_both,
)

from cann_ops_tilelang import chips, limits
from cann_ops_tilelang.kernels.ascend import _build
from cann_ops_tilelang.kernels.ascend import _build as ascend_build
from cann_ops_tilelang.kernels.ascend.mhc import gemm_with_sqrsum
from cann_ops_tilelang.kernels.cuda import _build as cuda_build

OPS = ops_of("gemm_with_sqrsum")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("gemm_with_sqrsum"))


# --- the reference's backward against float64 autograd (CPU tier) -----------------------------------------------------


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
    torch.testing.assert_close(args[4], want_args[4], rtol=1.6e-2, atol=1e-5)  # mhc_testing.bf16_close
    torch.testing.assert_close(got, want, rtol=1e-3, atol=3e-2)


def test_gemm_reference_splits_and_tf32():
    assert ref.split_ranges(1024, 16) == [(64 * i, 64 * (i + 1)) for i in range(16)]
    # K = 1280: 20 blocks over 16 splits, the first 20 % 16 = 4 splits get one more block
    assert ref.split_ranges(1280, 16)[:6] == [(0, 128), (128, 256), (256, 384), (384, 512), (512, 576), (576, 640)]
    assert ref.split_ranges(1280, 16)[-1] == (1216, 1280)
    one = torch.tensor([1.0 + 2 ** -11, 1.0 + 2 ** -12, -(1.0 + 2 ** -11)])
    # TF32 keeps 10 mantissa bits: 1 + 2^-11 is a tie and rounds away from zero; 1 + 2^-12 rounds down
    assert ref.tf32_round(one).tolist() == [1.0 + 2 ** -10, 1.0, -(1.0 + 2 ** -10)]


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "gemm_with_sqrsum"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "gemm_with_sqrsum"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


@pytest.mark.parametrize("hidden", [1280, 4096, 7168])  # column tiles W = 64, 256, 128
def test_ascend_gemm_with_sqrsum_backward_runs_on_the_cube(hidden):
    """Both products of the backward are Cube MADs in plain fp32 (HF32 off), g^T @ x through transposed
    L1 -> L0 loads; the g @ fn block goes L0C -> UB (both vector cores) for the grad_x epilogue and grad_fn
    leaves L0C once per column tile (accumulated over all token blocks in order: no atomics, no partials).
    The merged UB and Cube pools are exactly the plan's budget arithmetic, within the chip's capacities."""
    from cann_ops_tilelang import chips
    from cann_ops_tilelang.kernels.ascend.mhc import gemm_with_sqrsum as gemm

    case = "gemm_with_sqrsum/mhc_gemm_with_sqrsum_backward"
    lowered = ascend_build.lower_ascendc(ascend_mhc.lowering_cases(hidden)[case])
    src = lowered.source
    assert "__mix__(1, 2)" in src and "if ASC_IS_AIC" in src and "if ASC_IS_AIV" in src
    assert src.count("asc_mmad(") == 2
    assert "asc_copy_l12l0a_transpose(" in src and "asc_copy_l12l0b_transpose(" in src
    assert src.count("asc_copy_l0c2ub(") == 1 and "asc_dual_dst_mode>(1)" in src  # M-split over the two AIVs
    assert src.count("asc_copy_l0c2gm(") == 1  # grad_fn
    assert "asc_disable_hf32()" in src and "enable_hf32" not in src
    assert "atomic" not in src.lower()
    plan = gemm.BACKWARD_PLAN
    width = plan.width(4 * hidden, chips.ASCEND_950.vector_cores // 2)
    budget = plan.budget(width, chips.ASCEND_950.l0b_bytes)
    assert lowered.ub_bytes == budget.pop("ub") <= lowered.budget_bytes
    assert lowered.cube_bytes == budget and lowered.cube_fits, (hidden, width, lowered.cube_bytes)


@pytest.mark.parametrize(
    "case", ["gemm_with_sqrsum/mhc_gemm_with_sqrsum_forward_s16", "gemm_with_sqrsum/mhc_gemm_with_sqrsum_forward_s1"]
)
def test_gemm_forward_x_loads_are_seen_by_the_vector_check(case):
    """Both GEMM forward schedules (resident at S = 16, streaming at S = 1 on the H200's 132 SMs) load x
    through the package's raw-offset cp.async helper; the source reading behind the alignment declarations
    sees those 16-byte loads, and reports x if the op declared it narrower."""
    from _plugins.cuda_vectors import vector_accesses

    source = cuda_build.lower_source(cuda_mhc.lowering_cases(4096)[case])
    assert "ops_cp_async16(" in source
    assert vector_accesses(source).get("x") == 16
    declared = declared_vector_args()
    assert not undeclared(case, source, declared)
    declared["mhc_gemm_with_sqrsum_forward"]["vector_args"] = {"x": 8, "fn": 16}
    assert undeclared(case, source, declared) == [
        f"{case}: mhc_gemm_with_sqrsum_forward argument 'x' is accessed in 16-byte vectors, declared 8"
    ]


@pytest.mark.parametrize("splits", [1, 2, 7, 16, 24, 100, 448, 1000])
@pytest.mark.parametrize("hidden", [256, 1280, 2560, 4096, 7168, 8192])
def test_cuda_gemm_forward_step_never_straddles_a_split(hidden, splits):
    """The CUDA GEMM forward's pipeline step (64 or 128 columns) tiles every split's 64-column blocks
    exactly (docs/ops/mhc.md#gemm_with_sqrsum split contract), and the wider step is taken whenever it can be."""
    from cann_ops_tilelang.kernels.cuda.mhc.gemm_with_sqrsum import mhc_gemm_with_sqrsum_forward_block_k

    k = 4 * hidden
    nb = k // 64
    bk = mhc_gemm_with_sqrsum_forward_block_k(k, splits)
    counts = [nb // splits + (1 if s < nb % splits else 0) for s in range(splits)]
    assert bk in (64, 128)
    assert all(c * 64 % bk == 0 for c in counts)
    assert (bk == 128) == all(c % 2 == 0 for c in counts)


@pytest.mark.parametrize("hidden", [256, 1280, 2560, 4096, 5120, 5632, 7168, 8192])
def test_cuda_gemm_forward_schedule_choice(hidden):
    """The CUDA GEMM forward takes the resident schedule exactly where a split's hi / lo weights, the x
    stages (5-7 of 128 columns, twice as many of 64) and the output tile fit in one CTA's 227 KiB, every
    split owns a block and S * (SMs // S) CTAs keep at least 90 % of the SMs busy; its CTAs per split
    fill at most one wave (at least one CTA, at most one per 64-token tile)."""
    from cann_ops_tilelang.kernels.cuda.mhc.gemm_with_sqrsum import forward as gemm

    k = 4 * hidden
    nb = k // 64
    for sms in (132, 114, 8):
        for splits in sorted({1, 2, 7, 16, 24, 40, 50, 80, 100, 128, 129, nb}):
            if splits > nb:
                continue
            key = gemm.forward_key(k, 24, splits, sms)
            bk, stages = key.block_k, key.resident_stages
            per128 = 128 // bk
            slots = -(-nb // splits) * 64 // bk
            fits = lambda ns: ns * 64 * bk * 2 + slots * 48 * bk * 2 + 64 * 48 * 4 <= 227 * 1024
            busy = splits * (sms // splits) >= 0.9 * sms
            if stages:
                assert busy and 5 * per128 <= stages <= 7 * per128 and fits(stages), (hidden, sms, splits, stages)
                assert stages == 7 * per128 or not fits(stages + 1), (hidden, sms, splits, stages)
            else:
                assert not busy or not fits(5 * per128), (hidden, sms, splits)
    assert gemm.forward_key(16384, 24, 16, 132).resident_stages == 7
    assert gemm.forward_key(28672, 24, 16, 132).resident_stages == 0
    assert gemm.forward_key(16384, 24, 80, 132).resident_stages == 0  # 80 CTAs would leave 52 of 132 SMs idle
    for tokens in (1, 63, 64, 65, 512, 8192, 100000):
        tiles = -(-tokens // 64)
        for splits, sms in ((16, 132), (1, 132), (7, 132), (80, 132), (128, 132), (16, 8), (200, 132)):
            c = gemm.mhc_gemm_with_sqrsum_forward_ctas_per_split(tokens, splits, sms)
            assert c == max(1, min(sms // splits, tiles)), (tokens, splits, sms, c)
    assert gemm.mhc_gemm_with_sqrsum_forward_ctas_per_split(8192, 16, 132) == 8


@pytest.mark.parametrize("hidden", [256, 1280, 2560, 4096, 7168, 8192])
def test_cuda_gemm_backward_token_partitions(hidden):
    """The CUDA GEMM backward's token partitions (a launch argument, never a compile key): none empty, each but
    the last at least 4 tiles of 64 tokens, at most 32, one for T <= 64 (no reduction pass). Where 3 CTAs per SM
    take the column CTAs in one wave (H <= 6336): all CTAs in that wave unless there is a single partition, one
    from H = 3200 for any T, 4 at T = 8192 for H = 1280. Beyond it: a single partition of single-stage CTAs up
    to T = 2048 (4 per SM take them up to H = 8192), above it 5 partitions of two-stage CTAs."""
    from cann_ops_tilelang.chips import H200
    from cann_ops_tilelang.kernels.cuda.mhc.gemm_with_sqrsum import backward as gemm

    k = 4 * hidden
    assert k // 64 <= gemm.PLAN.single_stage_per_sm * H200.sms
    three = k // 64 <= gemm.PLAN.resident_per_sm * H200.sms
    for tokens in (0, 1, 63, 64, 65, 255, 256, 509, 512, 1001, 2048, 2049, 4096, 8192, 16384, 100000):
        p = gemm.mhc_gemm_with_sqrsum_backward_partials(tokens, k)
        tiles = -(-tokens // 64)
        per = -(-tiles // p)
        assert 1 <= p <= 32 and (p - 1) * per < max(tiles, 1), (hidden, tokens, p)  # the last partition has a tile
        assert p == 1 or per >= 4, (hidden, tokens, p)
        assert tiles > 1 or p == 1
        if three:
            assert p == 1 or p * (k // 64) <= gemm.PLAN.resident_per_sm * H200.sms, (hidden, tokens, p)
            assert hidden < 3200 or p == 1, (hidden, tokens, p)
        else:
            assert p == (1 if tokens <= 2048 else 5), (hidden, tokens, p)
        # one stage only for a single partition whose column CTAs need 4 per SM to fit one wave
        stages = gemm.mhc_gemm_with_sqrsum_backward_stages(p, k)
        assert stages == (1 if p == 1 and not three else gemm.PLAN.stages), (hidden, tokens, stages)
    assert gemm.mhc_gemm_with_sqrsum_backward_partials(8192, 4 * 1280) == 4
    assert gemm.mhc_gemm_with_sqrsum_backward_partials(509, 4 * 1280) == 2
    assert gemm.mhc_gemm_with_sqrsum_backward_partials(8192, 4 * 7168) == 5
    assert gemm.mhc_gemm_with_sqrsum_backward_stages(1, 4 * 7168) == 1
    assert gemm.mhc_gemm_with_sqrsum_backward_stages(5, 4 * 7168) == 2
    assert gemm.mhc_gemm_with_sqrsum_backward_stages(1, 4 * 4096) == 2
    assert gemm.mhc_gemm_with_sqrsum_backward_stages(4, 4 * 1280) == 2
    assert gemm.BACKWARD.key(torch.empty(24, 64), 1) == gemm.BackwardKey(cols=64, rows=24, stages=2)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
def test_cuda_gemm_forward_tightest_resident_case_fits():
    """The resident GEMM forward with the least shared memory to spare at the default 16 splits (H = 5632:
    11 weight slots of 128 columns and 5 x stages, 224 KiB) builds within the sm_90a budget."""
    from cann_ops_tilelang.kernels.cuda.mhc.gemm_with_sqrsum import forward as gemm

    key = gemm.forward_key(4 * 5632, 24, 16, 132)
    assert (key.block_k, key.resident_stages) == (128, 5)
    built = cuda_build.compile_cubin(gemm.FORWARD.prim_func(key), arch="sm_90a")
    assert built.fits and built.smem_bytes > 220 * 1024, built.smem_bytes


def test_cuda_gemm_backward_single_stage_loads_x_grad_last():
    """The single-stage GEMM backward waits for all cp.async groups but the newest before the products: that
    group must be grad_x's, in the prologue and in the loop, as generated (TileLang orders adjacent copies
    itself). In the loop, x, g and sg go out only after the WGMMAs are waited for and a barrier, and grad_x only
    after the tile's grad_x store and a barrier: no copy overwrites a stage still being read."""
    import re

    case = "gemm_with_sqrsum/mhc_gemm_with_sqrsum_backward_1stage"
    src = cuda_build.lower_source(cuda_mhc.lowering_cases(7168)[case])
    pattern = (r"cp_async_gs_conditional<\d+>\(\(&\(\(\(\w+\*\)(\w+)\)"  # a cp.async: its destination
               r"|cp_async_(commit)\(\)|cp_async_wait<(\d)>|wait_wgmma<(\d)>"
               r"|\*\(uint4\*\)\((grad_x) \+|(__syncthreads)")  # ... an grad_x store, a barrier
    names = (None, "commit", "wait", "wgmma", "store", "sync")  # a copy is named by its buffer
    events = [next(v if n is None else (n + v if v.isdigit() else n) for n, v in zip(names, m) if v)
              for m in re.findall(pattern, src)]
    groups, pending, waits = [], set(), []
    for i, e in enumerate(events):
        if e == "commit":
            groups.append(pending)
            pending = set()
        elif e.startswith("wait"):
            waits.append((int(e[4:]), len(groups), i))
        elif e.endswith("_s"):
            pending.add(e)
    assert not pending and [w for w, _, _ in waits] == [1, 0], waits
    prologue = [g for g in groups[: waits[0][1]] if g]
    loop = [g for g in groups[waits[1][1]:] if g]
    for issued in (prologue, loop):
        assert issued[-1] == {"xg_s"}, issued
        assert set().union(*issued[:-1]) == {"x_s", "gf_s", "sg_s"}, issued
    tail = events[waits[1][2]:]
    first_x, last_xg = tail.index("x_s"), len(tail) - 1 - tail[::-1].index("xg_s")
    assert "sync" in tail[tail.index("wgmma0") : first_x], tail
    last_store = len(tail) - 1 - tail[::-1].index("store")
    assert first_x < last_store < last_xg and "sync" in tail[last_store:last_xg], tail


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden", [1280, 7168])
def test_cuda_gemm_backward_keeps_three_ctas_per_sm(hidden):
    """The CUDA GEMM backward's shared memory (two stages of x, grad_x, g and sg, the split weights and G) lets
    3 CTAs share an SM of sm_90a, with their reservations: the occupancy its speed rests on
    (docs/perf/h200/mhc.md, 2026-12-03)."""
    from cann_ops_tilelang.chips import cuda_arch
    from cann_ops_tilelang.kernels.cuda.mhc.gemm_with_sqrsum import backward as gemm

    arch = cuda_arch("sm_90a")
    # the plan's partition rule counts on these: 3 CTAs per SM with PLAN.stages, 4 with one stage
    for stages, resident in ((gemm.PLAN.stages, 3), (1, 4)):
        built = cuda_build.compile_cubin(gemm.build_mhc_gemm_with_sqrsum_backward(4 * hidden, 24, stages),
                                         arch="sm_90a")
        assert built.threads == 128
        assert resident == (gemm.PLAN.resident_per_sm if stages > 1 else gemm.PLAN.single_stage_per_sm)
        assert resident * (built.smem_bytes + arch.smem_reserved_per_cta) <= arch.smem_per_sm, built.smem_bytes


@pytest.mark.parametrize("width", gemm_with_sqrsum.BACKWARD_PLAN.widths)
def test_gemm_backward_plan_fits_the_cube_and_ub_at_every_width(width):
    """The Cube backward's budget (UB per vector core, L1 / L0A / L0B / L0C per Cube core) fits at every
    column tile the plan may pick; the lowering equals this arithmetic
    (test_ascend_gemm_with_sqrsum_backward_runs_on_the_cube)."""
    plan = gemm_with_sqrsum.BACKWARD_PLAN
    budget = plan.budget(width, chips.ASCEND_950.l0b_bytes)
    assert budget.pop("ub") <= _build.UB_BUDGET_BYTES
    for scope, size in budget.items():
        assert 0 < size <= chips.ASCEND_950.cube_bytes[scope], (width, scope, size)


@pytest.mark.parametrize("hidden", [limits.MHC_HIDDEN.low, 1280, 2560, 4096, 7168, limits.MHC_HIDDEN.high])
def test_gemm_backward_width_is_the_shortest_critical_path(hidden):
    """Every Cube core sweeps all tokens of its column tiles: W minimizes the columns of the busiest Cube core
    (ties to the widest) and divides K."""
    plan, k, cores = gemm_with_sqrsum.BACKWARD_PLAN, 4 * hidden, CORES // 2
    width = plan.width(k, cores)
    assert k % width == 0
    busiest = {w: -(-(k // w) // cores) * w for w in plan.widths if k % w == 0}
    shortest = min(busiest.values())
    assert busiest[width] == shortest and width == max(w for w, c in busiest.items() if c == shortest)


OUT_OF_RANGE = {
    "gemm M3": lambda: gemm_with_sqrsum.build_mhc_gemm_with_sqrsum_backward(33, 4 * 2560, CORES),
    "gemm n_splits": lambda: gemm_with_sqrsum.build_mhc_gemm_with_sqrsum_forward(24, 4 * 2560, 0, CORES // 2),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_values_outside_the_declared_ranges_raise_limit_error(case):
    check_values_outside_the_declared_ranges_raise_limit_error(OUT_OF_RANGE[case])


# --- on the device (device tier) --------------------------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("name", OPS)
def test_streaming_op_vs_reference(name, tokens, hidden, device, seed):
    check_streaming_op_vs_reference(name, tokens, hidden, device, seed)


@requires_device
@pytest.mark.parametrize("hidden", [1280, 4096, 7168])
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("splits", [1, 7, 80])
def test_gemm_forward_split_counts(splits, tokens, hidden, device, seed):
    """Split counts other than the default 16: one split, uneven splits (7) and many splits (80: one
    64-column block each at H = 1280). On the H200 these take both forward schedules (resident at S = 7,
    H = 1280, with 64-column steps; else streaming)."""
    name = "mhc_gemm_with_sqrsum_forward"
    args = make_args(name, tokens, hidden, seed=seed, device=device, splits=splits)
    check(name, *run_both(name, args), tokens)


@requires_device
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


@requires_device
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


@requires_device
@pytest.mark.parametrize("name", ["mhc_gemm_with_sqrsum_backward"])
def test_accumulating_ops_use_the_prior_content(name, device, seed):
    check_accumulating_ops_use_the_prior_content(name, device, seed)

