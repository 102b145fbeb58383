"""CPU tier: every mHC kernel lowers for both targets (Ascend 950: AscendC within the UB budget and the
Cube's L1 / L0 capacities; CUDA: an sm_90a cubin within the per-CTA shared-memory and thread limits, when nvcc
is present), the per-token kernels once, the hidden-size-dependent ones at the model sizes H in {4096, 7168} (the
range's edges in tests/test_limits.py); and the token count is never part of a compile key."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared

pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import mhc as ascend_mhc  # noqa: E402
from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda import mhc as cuda_mhc  # noqa: E402

# The sizes that matter: the model sizes H = 4096 and 7168 here (CUDA: sm_90a cubins, their vector accesses checked
# against the ops' declarations; budgets checked at the largest, 7168); the range's edges (256, 8192) are lowered on
# both backends with their budgets by tests/test_limits.py. The four CUDA GEMM forward schedules (resident / streaming
# x 64- / 128-column steps) all occur at {256, 4096, 7168, 8192}; the schedule tests below cover every size unlowered.
HIDDEN = [4096, 7168]
HAVE_NVCC = shutil.which("nvcc") is not None
# op modules of the per-token kernels, which do not depend on H
PER_TOKEN = ("reduce_partials_and_rmsnorm/", "pre_split_mixes/", "sinkhorn/", "head_compute_mix/")
# the fused ops' kernels are lowered and checked by their own files (test_mhc_fused_ascend_lowering.py,
# test_mhc_pre_big_fuse_cuda_lowering.py, test_mhc_multilayer_recompute_cuda_lowering.py)
FUSED = ("pre_big_fuse/", "multilayer_recompute/")


def cases(module):
    """(H, case) pairs: per-token cases only at the first H, they do not depend on it."""
    out = []
    for h in HIDDEN:
        names = sorted(module.lowering_cases(h))
        out += [(h, name) for name in names
                if not name.startswith(FUSED) and (h == HIDDEN[0] or not name.startswith(PER_TOKEN))]
    return out


@pytest.mark.parametrize("hidden,name", cases(ascend_mhc))
def test_ascend_lowers_within_ub(hidden, name):
    lowered = ascend_build.lower_ascendc(ascend_mhc.lowering_cases(hidden)[name])
    assert "__aicore__" in lowered.source or "__global__" in lowered.source
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (name, hidden, lowered.ub_bytes, lowered.budget_bytes)
    assert lowered.cube_fits, (name, hidden, lowered.cube_bytes)  # L1 / L0A / L0B / L0C of a Cube core


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


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", cases(cuda_mhc))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    built = cuda_build.compile_cubin(cuda_mhc.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
    assert built.fits, (name, hidden, built.smem_bytes, built.budget_bytes, built.threads)
    # every argument its ops pass in and the kernel accesses in vectors is declared (op helper's alignment check)
    assert not undeclared(name, built.source, declared_vector_args())


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


def test_cuda_post_backward_ring_fits_its_annotated_occupancy():
    """The post backward's cp.async ring (every H % 64 == 0 up to 16384): used exactly where the layout is
    unguarded with >= 2 vectors per thread, never staging past the row (stages - 1 <= nv), and the CTAs
    per SM annotated on the kernel fit the SM's shared memory with the ring (1 KiB reserved per CTA) and
    the 128-register budget; at H = 2560 / 4096 the lowered kernel's shared memory is the ring's."""
    from cann_ops_tilelang.chips import H200
    from cann_ops_tilelang.kernels.cuda._build import compile_cubin
    from cann_ops_tilelang.kernels.cuda.mhc import _common, post

    m = 4
    for hidden in range(64, 16385, 64):
        schedule = post.backward_schedule(hidden, m)
        threads, nv, guarded = schedule.threads, schedule.nv, schedule.guarded
        stages, slots, blocks = schedule.stages, schedule.slots, schedule.blocks
        assert (stages > 0) == (not guarded and nv > 1), (hidden, stages)
        ring = slots * (2 * m + 1) * threads * 8 * 2
        if stages:
            assert 2 <= stages <= nv + 1 and slots == min(stages, nv), (hidden, stages, slots, nv)
        assert 1 <= blocks <= _common.min_blocks(threads, 128), (hidden, blocks)
        assert blocks * (ring + 1024) <= H200.arch.smem_per_sm == 228 * 1024, (hidden, blocks, ring)
    for hidden in (2560, 4096):
        schedule = post.backward_schedule(hidden, m)
        threads, slots = schedule.threads, schedule.slots
        build = compile_cubin(post.build_mhc_post_backward(hidden, m), arch="sm_90a")
        assert build.smem_bytes == slots * (2 * m + 1) * threads * 8 * 2, (hidden, build.smem_bytes)
