"""CUDA kernels of ``mhc_gemm_with_sqrsum_forward`` (docs/ops/mhc.md#gemm_with_sqrsum).

``out_mul_part[s, t, j] = sum_{k in K_s} f32(x[t, k]) * tf32(fn[j, k])`` and ``sqrsum_part[s, t] = sum_{k in
K_s} f32(x[t, k])**2``, ``K`` cut into 64-column blocks, split ``s`` owning ``nb // S`` blocks plus one for
``s < nb % S``, in order. TF32 products on bf16 tensor cores: ``fn`` is rounded to TF32 (half a TF32 ulp added
to the bit pattern, the low 13 bits cleared) and split exactly into bf16 ``hi + lo``, rows ``j`` and ``M3 + j``
of the B operand; ``x * hi`` and ``x * lo`` are exact in the fp32 accumulator. A CTA is one warpgroup on
64-token tiles: per step of ``BK`` columns (128 where every split owns an even number of blocks, else 64) one
asynchronous ``64 x 2M3 x BK`` WGMMA, the sum of squares on the CUDA cores from the same shared tile while it
runs, the x tiles of the next steps in flight (raw-offset 16-byte cp.async checked against the token count
only). Two schedules, the same arithmetic in the same order (bitwise equal results):

* resident (a split's hi/lo weights fit in shared memory next to at least ``PLAN.resident_min_stages`` x
  stages, and the splits fill ``PLAN.resident_min_fill`` of the SMs): ``S * C`` persistent CTAs, ``C =
  min(SMs // S, tiles)``, CTA ``b`` owning split ``b % S``; it converts its split's f32 weights itself during
  its first tile and keeps the x pipeline running across tiles;
* streaming (otherwise): a preparation kernel converts ``fn`` into a ``(2 M3, K)`` bf16 workspace; one CTA per
  (split, 64-token tile), each step's weight tile loaded with its x tile.
"""

import dataclasses

import torch

from ..... import config
from .....chips import H200
from .....limits import MHC_GEMM_BLOCK, IntRange, LimitError, mhc_gemm_splits
from ...._kernel import Kernel, compile_key, public_names
from ..._cp_async import PRELUDE as CP_ASYNC_PRELUDE
from .._common import GemmWeightKey, check_gemm_weight


_BLOCK_K = MHC_GEMM_BLOCK  # split granularity (the interface's 64-column blocks) and the narrow K step
KERNEL_SPLITS = IntRange("n_splits", 1)  # what the kernels take (the ops: limits.mhc_gemm_splits(K))


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """The forward's tuning: ``block_t`` tokens per CTA (one WGMMA M = 64 warpgroup of ``threads``); x stages of
    the streaming schedule with 64- / 128-column steps; the resident schedule's x stages (of 128 columns, twice
    as many of 64) and the SM fill it needs; the ``fn`` preparation's ``split_threads`` x ``split_vectors``
    float4."""

    block_t: int
    threads: int
    streaming_stages_64: int
    streaming_stages_128: int
    resident_min_fill: float
    resident_min_stages: int
    resident_max_stages: int
    split_threads: int
    split_vectors: int

    def streaming_stages(self, block_k: int) -> int:
        return self.streaming_stages_128 if block_k == 2 * _BLOCK_K else self.streaming_stages_64


# Streaming: 128-column steps, 3 stages, 2 CTAs per SM, split-major grid. Resident where it fits 5-7 stages and
# fills 90 % of the SMs: no per-tile weight reads, the SMs' instruction issue (not DRAM) bounds it. fn
# preparation: 128 threads x 4 float4 (docs/perf/h200/mhc.md, 2026-11-30 and 2026-12-01).
PLAN = ForwardPlan(
    block_t=64,
    threads=128,
    streaming_stages_64=6,
    streaming_stages_128=3,
    resident_min_fill=0.9,
    resident_min_stages=5,
    resident_max_stages=7,
    split_threads=128,
    split_vectors=4,
)


def mhc_gemm_with_sqrsum_forward_block_k(cols: int, n_splits: int) -> int:
    """Columns per pipeline step of the forward at ``K = cols`` and ``S = n_splits``: 128 where every
    split owns the same even number of 64-column blocks (so a step never straddles a split boundary),
    else 64."""
    nb = cols // _BLOCK_K
    return 2 * _BLOCK_K if nb % n_splits == 0 and (nb // n_splits) % 2 == 0 else _BLOCK_K


def mhc_gemm_with_sqrsum_forward_resident_stages(cols: int, rows: int, n_splits: int, block_k: int, num_sms: int) -> int:
    """x stages of the resident forward schedule at ``(K, M3, S, BK)`` on a GPU of ``num_sms`` SMs (see
    the module docstring), or 0 where it does not apply: a split's hi/lo weights, the x stages and the
    output tile must fit in one CTA's shared memory with at least ``PLAN.resident_min_stages`` stages (twice
    as many of 64 columns), every split must own a block, and ``S * (num_sms // S)`` CTAs must keep at
    least ``PLAN.resident_min_fill`` of the SMs busy (else the streaming schedule fills the GPU better)."""
    nb, g = cols // _BLOCK_K, block_k // _BLOCK_K
    q, r = divmod(nb, n_splits)
    if q == 0 or n_splits * (num_sms // n_splits) < PLAN.resident_min_fill * num_sms:
        return 0
    slots = (q + (1 if r else 0)) // g  # steps of the largest split (g > 1 only where r == 0, q % g == 0)
    fixed = slots * 2 * rows * block_k * 2 + PLAN.block_t * 2 * rows * 4
    per_128 = 2 * _BLOCK_K // block_k
    budget = H200.arch.smem_per_cta
    stages = min(PLAN.resident_max_stages * per_128, (budget - fixed) // (PLAN.block_t * block_k * 2))
    return stages if stages >= PLAN.resident_min_stages * per_128 else 0


@compile_key
class ForwardKey:
    """Compile-time key of the forward's main kernel: ``K = cols``, ``M3 = rows``, ``S = n_splits``, the pipeline
    step ``block_k`` and ``resident_stages`` (0: the streaming schedule), never the token count."""

    cols: int
    rows: int
    n_splits: int
    block_k: int
    resident_stages: int


def forward_key(cols: int, rows: int, n_splits: int, num_sms: int) -> ForwardKey:
    """The forward's key from the sizes and the SM count, for any ``n_splits >= 1`` the kernels take (splits past
    ``K / 64`` own no block and write zeros; the op refuses them)."""
    check_gemm_weight("mhc_gemm_with_sqrsum_forward", rows, cols)
    KERNEL_SPLITS.require("mhc_gemm_with_sqrsum_forward", n_splits)
    block_k = mhc_gemm_with_sqrsum_forward_block_k(cols, n_splits)
    stages = mhc_gemm_with_sqrsum_forward_resident_stages(cols, rows, n_splits, block_k, num_sms)
    return ForwardKey(cols, rows, n_splits, block_k, stages)


def _key(x: torch.Tensor, fn: torch.Tensor, n_splits: int) -> ForwardKey:
    """The key on ``x``'s CUDA device (its SM count)."""
    rows, cols = (int(s) for s in fn.shape)
    mhc_gemm_splits(cols).require("mhc_gemm_with_sqrsum_forward", n_splits)
    return forward_key(cols, rows, int(n_splits), config.num_sms(x.device.index))


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Schedules as on the H200's SMs: ``_s16`` (the CUDA default split count; resident up to H = 5632, streaming
    at 7168), ``_s1`` (streaming), ``_s7`` (uneven splits: resident at H = 1280, else streaming), ``_s80`` (many
    splits, streaming; one block per split at H = 1280)."""
    k, m3 = hc_mult * hidden_size, hc_mult * (hc_mult + 2)
    return {f"mhc_gemm_with_sqrsum_forward_s{s}": forward_key(k, m3, s, H200.sms) for s in (16, 1, 7, 80)}


def _tf32_split_macro():
    """``T.macro(v, rb, hi, lo, k)``: rounds the f32 value ``v`` to TF32 and splits it exactly into
    ``hi[k] + lo[k]`` (bf16; ``rb``: a uint32 local scratch, element ``k``), the one conversion of both
    forward schedules (see the module docstring)."""
    from tilelang import language as T

    f32, bf16, u32 = T.float32, T.bfloat16, T.uint32

    @T.macro
    def tf32_split(v, rb, hi, lo, k):
        # TF32: add half a TF32 ulp to the bit pattern, clear the low 13 bits (round half away); hi keeps
        # the top 8 significand bits, lo the remaining <= 3 (both exact).
        rb[k] = T.reinterpret(v, u32) + T.cast(0x1000, u32)
        hi[k] = T.cast(T.reinterpret(rb[k] & T.cast(0xFFFF0000, u32), f32), bf16)
        lo[k] = T.cast(T.reinterpret(rb[k] & T.cast(0xFFFFE000, u32), f32) - T.reinterpret(rb[k] & T.cast(0xFFFF0000, u32), f32), bf16)

    return tf32_split


def _x_tile_macro(cols: int, block_k: int, num_tokens):
    """``T.macro(x, x_s, stage, tile, col, tid)``: one step's ``BT x block_k`` x tile (tokens from
    ``tile * BT``, columns from ``col``) into ``x_s[stage]``, the x loads of both forward schedules. Each
    thread issues its 16-byte chunks (rows ``TH / (block_k / 8)`` apart, one column chunk) by raw-offset
    cp.async (``ops_cp_async16``, the kernel needs ``_cp_async.PRELUDE``), checked against the token count
    only: rows past it are not loaded (their results are never stored). Commits no group."""
    from tilelang import language as T

    K, BT, BK, TH = cols, PLAN.block_t, block_k, PLAN.threads
    XC = BK // 8  # chunks per x row of a step
    XR = TH // XC  # rows covered by one chunk per thread
    XV = BT // XR  # chunks of a step per thread

    @T.macro
    def load_x(x, x_s, stage, tile, col, tid):
        for i in T.unroll(XV):
            T.call_extern(
                "void",
                "ops_cp_async16",
                T.address_of(x_s[stage, i * XR + tid // XC, tid % XC * 8]),
                T.address_of(x[0, 0]),
                (T.cast(tile * BT + i * XR + tid // XC, T.int64) * K + col + tid % XC * 8) * 2,
                tile * BT + i * XR + tid // XC < num_tokens,
            )

    return load_x


def build_mhc_gemm_fn_split(cols: int, rows: int):
    """Builds the ``fn`` preparation of the forward: ``fhl[j] = hi(tf32(fn[j]))`` and
    ``fhl[M3 + j] = lo(tf32(fn[j]))`` (see the module docstring), ``(2 * M3, K)`` bf16.

    One pass over the ``M3 x K`` weight (1.5 MiB at K = 16384) so that the streaming schedule's CTAs,
    which read each weight block once per token tile, load ready bf16 operands and need no conversion
    step (the resident schedule converts its split's weights itself, once per CTA).
    """
    from tilelang import language as T

    K, M3 = cols, rows
    f32, bf16, u32 = T.float32, T.bfloat16, T.uint32
    threads, nv = PLAN.split_threads, PLAN.split_vectors
    per_cta = threads * nv * 4
    tf32_split = _tf32_split_macro()

    @T.prim_func
    def mhc_gemm_fn_split_cuda(fn: T.Tensor((M3, K), f32), fhl: T.Tensor((2 * M3, K), bf16)):
        # CTA bx owns the nv consecutive 4-element groups (bx * nv + j) * threads + tid, j < nv, of the
        # flat (M3 * K) weight: every j is one coalesced float4 pass of the CTA, all nv loads in flight.
        with T.Kernel(T.ceildiv(M3 * K, per_cta), threads=threads) as bx:
            tid = T.get_thread_binding()
            v = T.alloc_local((nv, 4), f32)
            rb = T.alloc_local((4,), u32)
            hi = T.alloc_local((4,), bf16)
            lo = T.alloc_local((4,), bf16)
            for j in T.unroll(nv):
                base = ((bx * nv + j) * threads + tid) * 4
                if base < M3 * K:
                    for k in T.vectorized(4):
                        v[j, k] = fn[(base + k) // K, (base + k) % K]
            for j in T.unroll(nv):
                base = ((bx * nv + j) * threads + tid) * 4
                if base < M3 * K:
                    for k in T.unroll(4):
                        tf32_split(v[j, k], rb, hi, lo, k)
                    for k in T.vectorized(4):
                        fhl[(base + k) // K, (base + k) % K] = hi[k]
                    for k in T.vectorized(4):
                        fhl[M3 + (base + k) // K, (base + k) % K] = lo[k]

    return mhc_gemm_fn_split_cuda


def build_mhc_gemm_with_sqrsum_forward(cols: int, rows: int, n_splits: int, block_k: int = _BLOCK_K):
    """Builds the split-K forward main kernel, streaming schedule (one CTA per split and token tile).

    Args:
        cols: ``K`` (multiple of 64).
        rows: ``M3`` (multiple of 8, <= 32).
        n_splits: ``S``.
        block_k: columns per pipeline step (64, or 128 when every split owns an even number of
            64-column blocks, see :func:`mhc_gemm_with_sqrsum_forward_block_k`).

    Returns:
        ``T.prim_func(x (T, K) bf16, fhl (2 M3, K) bf16, out_mul_part (S, T, M3) f32, sqrsum_part (S, T) f32)``
        with ``fhl`` from :func:`build_mhc_gemm_fn_split`; ``T`` is dynamic.
    """
    from tilelang import language as T

    K, M3, S = cols, rows, n_splits
    BT, BK, TH = PLAN.block_t, block_k, PLAN.threads
    NS = PLAN.streaming_stages(BK)
    g = BK // _BLOCK_K
    nb = K // _BLOCK_K
    q, r = nb // S, nb % S
    if g > 1 and (r != 0 or q % g != 0):
        raise LimitError(f"mhc_gemm_with_sqrsum_forward: block_k {BK} needs equal splits of a multiple of {g} blocks")
    HALF = 64  # the sum of squares is kept per (token, column mod 64)
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")
    load_x = _x_tile_macro(K, BK, num_tokens)

    @T.prim_func
    def mhc_gemm_with_sqrsum_forward_cuda(
        x: T.Tensor((num_tokens, K), bf16),
        fhl: T.Tensor((2 * M3, K), bf16),
        out_mul_part: T.Tensor((S, num_tokens, M3), f32),
        sqrsum_part: T.Tensor((S, num_tokens), f32),
    ):
        # split-major grid: the S CTAs of one token tile are launched together and read whole rows of x
        with T.Kernel(S, T.ceildiv(num_tokens, BT), threads=TH, prelude=CP_ASYNC_PRELUDE) as (s, bt):
            tid = T.get_thread_binding()
            x_s = T.alloc_shared((NS, BT, BK), bf16)
            f_s = T.alloc_shared((NS, 2 * M3, BK), bf16)
            acc = T.alloc_fragment((BT, 2 * M3), f32)
            sq = T.alloc_fragment((BT, HALF), f32)
            sq_row = T.alloc_fragment((BT,), f32)
            o_s = T.alloc_shared((BT, 2 * M3), f32)  # hi and lo products, summed on the way out
            T.clear(acc)
            T.clear(sq)
            cnt = T.if_then_else(s < r, q + 1, q) // g
            col0 = (s * q + T.min(s, r)) * _BLOCK_K
            # Prologue: steps 0 .. NS-2 in flight (an empty group where the split has fewer steps, so
            # that the group count below stays uniform).
            for st in T.unroll(NS - 1):
                if st < cnt:
                    load_x(x, x_s, st, bt, col0 + st * BK, tid)
                    T.ptx_commit_group()
                    T.async_copy(fhl[0 : 2 * M3, col0 + st * BK : col0 + st * BK + BK], f_s[st, :, :])
                else:
                    T.ptx_commit_group()
                    T.ptx_commit_group()
            for kb in T.serial(cnt):
                # Step kb + NS - 1 goes into the stage consumed at kb - 1 (released by the barrier that
                # closed iteration kb - 1).
                if kb + NS - 1 < cnt:
                    load_x(x, x_s, (kb + NS - 1) % NS, bt, col0 + (kb + NS - 1) * BK, tid)
                    T.ptx_commit_group()
                    T.async_copy(
                        fhl[0 : 2 * M3, col0 + (kb + NS - 1) * BK : col0 + (kb + NS - 1) * BK + BK],
                        f_s[(kb + NS - 1) % NS, :, :],
                    )
                else:
                    T.ptx_commit_group()
                    T.ptx_commit_group()
                T.ptx_wait_group(2 * (NS - 1))
                T.sync_threads()
                # one 64 x 2M3 x BK product (columns 0..M3-1 take hi, M3..2M3-1 lo), asynchronous: the sum
                # of squares of the same tile runs meanwhile; both done before the stage is released
                T.wgmma_gemm(x_s[kb % NS, :, :], f_s[kb % NS, :, :], acc, transpose_B=True)
                for h in T.unroll(g):
                    for i, k in T.Parallel(BT, HALF):
                        sq[i, k] += T.cast(x_s[kb % NS, i, h * HALF + k], f32) * T.cast(x_s[kb % NS, i, h * HALF + k], f32)
                T.wait_wgmma(0)
                T.sync_threads()
            T.reduce_sum(sq, sq_row, dim=1)
            T.copy(acc, o_s)
            T.sync_threads()
            for i, j in T.Parallel(BT, M3):
                if bt * BT + i < num_tokens:
                    out_mul_part[s, bt * BT + i, j] = o_s[i, j] + o_s[i, M3 + j]
            for i in T.Parallel(BT):
                if bt * BT + i < num_tokens:
                    sqrsum_part[s, bt * BT + i] = sq_row[i]

    return mhc_gemm_with_sqrsum_forward_cuda


def build_mhc_gemm_with_sqrsum_forward_resident(cols: int, rows: int, n_splits: int, block_k: int, stages: int):
    """Builds the split-K forward main kernel, resident schedule (see the module docstring): it takes
    ``fn`` itself and converts the split's weights once per CTA, with no preparation kernel.

    Args:
        cols: ``K`` (multiple of 64).
        rows: ``M3`` (multiple of 8, <= 32).
        n_splits: ``S`` (each split owns at least one 64-column block).
        block_k: columns per pipeline step (see :func:`mhc_gemm_with_sqrsum_forward_block_k`).
        stages: x stages (see :func:`mhc_gemm_with_sqrsum_forward_resident_stages`).

    Returns:
        ``T.prim_func(x, fn, out_mul_part, sqrsum_part, ctas_per_split: int32)``: ``fn`` ``(M3, K)`` f32,
        the other buffers as in :func:`build_mhc_gemm_with_sqrsum_forward`; ``ctas_per_split`` ``C >= 1``
        sets the grid ``S * C`` (``C <= tiles``; one wave where ``S * C`` is at most the SM count).
    """
    from tilelang import language as T

    K, M3, S = cols, rows, n_splits
    BT, BK, NS, TH = PLAN.block_t, block_k, stages, PLAN.threads
    g = BK // _BLOCK_K
    nb = K // _BLOCK_K
    q, r = nb // S, nb % S
    if q == 0 or (g > 1 and (r != 0 or q % g != 0)) or NS < 3:
        raise LimitError(f"mhc_gemm_with_sqrsum_forward: no resident schedule for K={K}, S={S}, block_k={BK}, stages={NS}")
    slots = (q + (1 if r else 0)) // g
    HALF = 64
    CH = BK // 4  # 16-byte (4 x f32) chunks per fn row of a step
    NV = M3 * BK // (4 * TH)  # chunks of a step per thread (M3 % 8 == 0: whole)
    f32, bf16, i32, u32 = T.float32, T.bfloat16, T.int32, T.uint32
    num_tokens = T.dynamic("num_tokens")
    tf32_split = _tf32_split_macro()
    load_x = _x_tile_macro(K, BK, num_tokens)

    @T.macro
    def issue_next(x, fn, x_s, w_f, o_f, ld, b0, b1, cnt, blk0, stage, tid):
        # The loads of step ld = (tile, step) into x stage ``stage`` as two cp.async groups (the x tile,
        # an empty group past the CTA's last tile; during the first tile the step's f32 weights into the
        # next slot's bytes, the last step's into o_s, else an empty group: the waits count uniformly),
        # then ld advances.
        if ld[0] < b1[0]:
            load_x(x, x_s, stage, ld[0], blk0[0] * 64 + ld[1] * BK, tid)
        T.ptx_commit_group()
        if ld[0] == b0[0]:
            for i in T.unroll(NV):
                if ld[1] + 1 < cnt[0]:
                    T.ptx_cp_async(
                        T.access_ptr(w_f[ld[1] + 1, (i * TH + tid) // CH, (i * TH + tid) % CH * 4], "w", 4),
                        T.access_ptr(fn[(i * TH + tid) // CH, blk0[0] * 64 + ld[1] * BK + (i * TH + tid) % CH * 4], "r", 4),
                        4,
                    )
                else:
                    T.ptx_cp_async(
                        T.access_ptr(o_f[(i * TH + tid) // CH, (i * TH + tid) % CH * 4], "w", 4),
                        T.access_ptr(fn[(i * TH + tid) // CH, blk0[0] * 64 + ld[1] * BK + (i * TH + tid) % CH * 4], "r", 4),
                        4,
                    )
        T.ptx_commit_group()
        ld[1] += 1
        if ld[1] == cnt[0]:
            ld[1] = 0
            ld[0] += 1

    @T.macro
    def convert(w_f, o_f, w_s, wr, rb, hi, lo, s, cnt, tid):
        # Slot s's f32 weights (landed and visible) sit one slot over (the last slot's in o_s): every
        # thread reads its chunks, then writes their hi / lo into slot s, whose bytes no thread reads here.
        for i in T.unroll(NV):
            if s + 1 < cnt[0]:
                for c in T.vectorized(4):
                    wr[i, c] = w_f[s + 1, (i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c]
            else:
                for c in T.vectorized(4):
                    wr[i, c] = o_f[(i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c]
        for i in T.unroll(NV):
            for c in T.unroll(4):
                tf32_split(wr[i, c], rb, hi, lo, c)
            for c in T.vectorized(4):
                w_s[s, (i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c] = hi[c]
            for c in T.vectorized(4):
                w_s[s, M3 + (i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c] = lo[c]

    @T.prim_func
    def mhc_gemm_with_sqrsum_forward_resident_cuda(
        x: T.Tensor((num_tokens, K), bf16),
        fn: T.Tensor((M3, K), f32),
        out_mul_part: T.Tensor((S, num_tokens, M3), f32),
        sqrsum_part: T.Tensor((S, num_tokens), f32),
        ctas_per_split: i32,
    ):
        # CTA b: split b % S, token tiles [b0, b1) of that split's ctas_per_split CTAs
        with T.Kernel(S * ctas_per_split, threads=TH, prelude=CP_ASYNC_PRELUDE) as b:
            x_s = T.alloc_shared((NS, BT, BK), bf16)
            w_s = T.alloc_shared((slots, 2 * M3, BK), bf16)  # the split's hi / lo weights, step by step
            acc = T.alloc_fragment((BT, 2 * M3), f32)
            sq = T.alloc_fragment((BT, HALF), f32)
            sq_row = T.alloc_fragment((BT,), f32)
            o_s = T.alloc_shared((BT, 2 * M3), f32)
            # The same bytes as f32 (a slot's 2 M3 x BK bf16 = M3 x BK f32): during the first tile, step s's
            # fn columns land in slot s + 1 (the last step's in the output tile, free until the first
            # tile's end) and are converted from there into slot s's hi / lo.
            w_f = T.view(w_s, shape=(slots, M3, BK), dtype=f32)
            o_f = T.view(o_s, shape=(M3, 2 * BT), dtype=f32)
            wr = T.alloc_local((NV, 4), f32)
            rb = T.alloc_local((4,), u32)
            hi = T.alloc_local((4,), bf16)
            lo = T.alloc_local((4,), bf16)
            # Per-CTA scalars, computed once (the index expressions below stay free of divisions):
            # first and end tile, steps per tile, first 64-column block of the split; the (tile, step)
            # of the next load to issue; the (tile, step) being consumed.
            b0 = T.alloc_local((1,), i32)
            b1 = T.alloc_local((1,), i32)
            cnt = T.alloc_local((1,), i32)
            blk0 = T.alloc_local((1,), i32)
            ld = T.alloc_local((2,), i32)
            cs = T.alloc_local((2,), i32)
            tid = T.get_thread_binding()
            tiles = T.ceildiv(num_tokens, BT)
            b0[0] = (b // S) * tiles // ctas_per_split
            b1[0] = (b // S + 1) * tiles // ctas_per_split
            cnt[0] = T.if_then_else(b % S < r, q + 1, q) // g
            blk0[0] = (b % S) * q + T.min(b % S, r)
            ld[0] = b0[0]
            ld[1] = 0
            cs[0] = b0[0]
            cs[1] = 0
            T.clear(acc)
            T.clear(sq)
            for st in T.unroll(NS - 1):
                issue_next(x, fn, x_s, w_f, o_f, ld, b0, b1, cnt, blk0, st, tid)
            for n in T.serial((b1[0] - b0[0]) * cnt[0]):
                T.ptx_wait_group(2 * (NS - 2))  # step n landed (steps n + 1 .. n + NS - 2 in flight)
                T.sync_threads()
                if cs[0] == b0[0]:
                    # first tile: convert the step's weight slot; the WGMMA reads it through the async proxy
                    convert(w_f, o_f, w_s, wr, rb, hi, lo, cs[1], cnt, tid)
                    T.fence_proxy_async()
                    T.sync_threads()
                T.wgmma_gemm(x_s[n % NS, :, :], w_s[cs[1], :, :], acc, transpose_B=True)
                for h in T.unroll(g):
                    for i, k in T.Parallel(BT, HALF):
                        sq[i, k] += T.cast(x_s[n % NS, i, h * HALF + k], f32) * T.cast(x_s[n % NS, i, h * HALF + k], f32)
                # Step n - 1's WGMMA is done in every warp after this wait and barrier: its stage
                # ((n - 1) % NS) takes step n + NS - 1.
                T.wait_wgmma(1)
                T.sync_threads()
                issue_next(x, fn, x_s, w_f, o_f, ld, b0, b1, cnt, blk0, (n + NS - 1) % NS, tid)
                cs[1] += 1
                if cs[1] == cnt[0]:
                    # last step of tile cs[0]: write its partials, restart the accumulators
                    T.wait_wgmma(0)
                    T.reduce_sum(sq, sq_row, dim=1)
                    T.copy(acc, o_s)
                    T.sync_threads()
                    for i, j in T.Parallel(BT, M3):
                        if cs[0] * BT + i < num_tokens:
                            out_mul_part[b % S, cs[0] * BT + i, j] = o_s[i, j] + o_s[i, M3 + j]
                    for i in T.Parallel(BT):
                        if cs[0] * BT + i < num_tokens:
                            sqrsum_part[b % S, cs[0] * BT + i] = sq_row[i]
                    T.clear(acc)
                    T.clear(sq)
                    cs[0] += 1
                    cs[1] = 0
                    T.sync_threads()

    return mhc_gemm_with_sqrsum_forward_resident_cuda


def build_mhc_gemm_with_sqrsum_forward_main(cols: int, rows: int, n_splits: int, block_k: int, resident_stages: int):
    """The forward main kernel of a key (see :func:`mhc_gemm_with_sqrsum_forward_key`): resident schedule
    where ``resident_stages > 0``, else streaming."""
    if resident_stages:
        return build_mhc_gemm_with_sqrsum_forward_resident(cols, rows, n_splits, block_k, resident_stages)
    return build_mhc_gemm_with_sqrsum_forward(cols, rows, n_splits, block_k)


# the streaming schedule's fn preparation (its key from the forward's launcher)
FN_SPLIT = Kernel("mhc_gemm_fn_split", GemmWeightKey, build_mhc_gemm_fn_split, cases=lambda hidden_size, hc_mult: {
    "mhc_gemm_with_sqrsum_forward_fn_split": GemmWeightKey(hc_mult * hidden_size, hc_mult * (hc_mult + 2))})
FORWARD = Kernel("mhc_gemm_with_sqrsum_forward", ForwardKey, build_mhc_gemm_with_sqrsum_forward_main, derive=_key,
                 cases=_cases)


def mhc_gemm_with_sqrsum_forward_ctas_per_split(num_tokens: int, n_splits: int, num_sms: int) -> int:
    """CTAs per split ``C`` of the resident forward schedule: as many as one wave of ``num_sms`` CTAs
    allows, at most one per 64-token tile, at least one."""
    return max(1, min(num_sms // n_splits, -(-num_tokens // PLAN.block_t)))


def mhc_gemm_with_sqrsum_forward(
    x: torch.Tensor, fn: torch.Tensor, n_splits: int, out_mul_part: torch.Tensor, sqrsum_part: torch.Tensor
) -> None:
    """Launches the split-K pre-norm GEMM forward on the current stream (inputs validated upstream):
    the key's schedule, resident (one kernel on ``fn`` itself, ``S * C`` CTAs, ``C = min(SMs // S,
    tiles)``) or streaming (the ``fn`` preparation into a ``(2 M3, K)`` bf16 workspace, allocated with
    torch on the current stream, then the main kernel).

    Args:
        x: ``(T, K)`` bf16 (the residual ``(T, m, H)`` viewed flat), ``T > 0``, ``K % 64 == 0``.
        fn: ``(M3, K)`` f32 (rounded to TF32 here; idempotent on pre-rounded input).
        n_splits: ``S`` in ``limits.mhc_gemm_splits(K)``.
        out_mul_part: ``(S, T, M3)`` f32, written.
        sqrsum_part: ``(S, T)`` f32, written.
    """
    key = FORWARD.key(x, fn, n_splits)
    x2 = x.view(x.shape[0], -1)
    if key.resident_stages:  # resident schedule: fn itself, the CTAs per split (one wave)
        ctas = mhc_gemm_with_sqrsum_forward_ctas_per_split(x.shape[0], key.n_splits, config.num_sms(x.device.index))
        FORWARD.compiled(key)(x2, fn, out_mul_part, sqrsum_part, ctas)
        return
    fhl = torch.empty((2 * key.rows, key.cols), dtype=torch.bfloat16, device=fn.device)
    FN_SPLIT.compiled(GemmWeightKey(key.cols, key.rows))(fn, fhl)
    FORWARD.compiled(key)(x2, fhl, out_mul_part, sqrsum_part)


__all__ = public_names(__name__)
