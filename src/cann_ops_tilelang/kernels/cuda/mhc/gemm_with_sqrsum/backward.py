"""CUDA kernels of ``mhc_gemm_with_sqrsum_backward`` (docs/ops/mhc.md#gemm_with_sqrsum).

``grad_x[t, k] = bf16(f32(grad_x[t, k]) + (sum_j g[t, j] * fn[j, k] + 2 * f32(x[t, k]) * sg[t]))``
(read-modify-write) and ``grad_fn[j, k] = sum_t g[t, j] * f32(x[t, k])``, both products on the bf16 tensor
cores: ``g`` and ``fn`` are split into bf16 pairs ``hi = bf16(v)``, ``lo = bf16(v - hi)`` (``hi + lo`` is ``v``
within 2^-17 relative, exact for the TF32-rounded ``fn`` the forward saves), ``x`` is bf16, so every product
``x * hi``, ``hi * lo``... is exact in the fp32 accumulator: each product is within ~2^-16 of the fp32 one (a TF32
rounding of ``g``, 2^-11, would exceed the bf16 ``grad_x`` tolerance near zero against the fp64 reference), at no
cost in bytes.

Grid ``(K / BK, P)``: CTA ``(cb, p)`` owns ``BK`` columns and the token tiles ``[p * per, min((p + 1) * per,
tiles))`` of ``BT`` tokens, ``per = ceil(tiles / P)``, ``P`` chosen per call by the launcher (a kernel
argument through the partials' shape, never a compile key). One pass over x and grad_x: per tile (x, g, sg,
grad_x in a ``PLAN.stages`` cp.async pipeline; with one stage, the next tile's x, g, sg load under the tile's
grad_x store and its grad_x under the next products) one shared tile ``G = [g_hi 0 g_lo 0]`` (``BT x 64``, each half
padded to 32 columns) is the A operand of all three WGMMAs:

* ``grad_x tile (BT x BK) = G @ [fn_hi; 0; fn_hi; 0] + G @ [fn_lo; 0; fn_lo; 0]`` (``64 x BK`` each), then
  ``+ 2 x sg`` and the prior ``grad_x``, one bf16 rounding, written back into grad_x's stage and stored from
  there with 16-byte stores;
* ``acc (64 x BK) += G^T (64 x BT) @ x (BT x BK)`` (rows ``j`` and ``32 + j``), issued with the grad_x products
  and waited for after the epilogue; summed ``hi + lo`` once at the end into the CTA's grad_fn partial row ``p``.

Token tiles run in ascending order in every CTA; with ``P > 1`` a second kernel sums the ``P`` partials in
ascending ``p``. Fixed partition, fixed order, no atomics: grad_fn is bitwise reproducible for a given ``T``.
Rows past ``T`` (never loaded: predicated cp.async) are zeroed in the x and g tiles: they add exact zeros.
"""

import dataclasses

import torch

from .....chips import H200
from .....limits import MHC_GEMM_BLOCK
from ...._kernel import Kernel, compile_key, public_names
from .._common import GemmWeightKey, check_gemm_weight


_PAD = 32  # each of g_hi / g_lo padded to 32 columns of G (M3 <= 32): the 64-row A^T of the grad_fn product


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The backward's tuning: ``block_t`` tokens per pipeline step (the M of the grad_x product, the K of the
    grad_fn product), ``block_k`` columns per CTA, ``threads`` per CTA, ``stages`` of the x / grad_x / g
    pipeline; ``resident_per_sm`` such CTAs share an SM, ``single_stage_per_sm`` single-stage ones (46 KiB of
    shared memory); at most ``max_partials`` token partitions and at least ``min_tiles_per_partial`` token
    tiles per partition (each partition writes an ``M3 x K`` fp32 partial, ``2 * 4 * M3`` bytes per column
    written and read, against ``6 * 64`` per tile of x / grad_x). Where one wave of two-stage CTAs does not
    take the column CTAs: a single partition of single-stage CTAs up to ``single_stage_max_tiles`` token
    tiles, above that about ``ctas_per_sm`` two-stage CTAs per SM over several waves; ``reduce_threads`` of
    the partial reduction."""

    block_t: int
    block_k: int
    threads: int
    stages: int
    resident_per_sm: int
    single_stage_per_sm: int
    max_partials: int
    min_tiles_per_partial: int
    single_stage_max_tiles: int
    ctas_per_sm: int
    reduce_threads: int


# NOTE 64 x 64 tiles (22 KiB of x, grad_x, g, sg per stage), one warpgroup, 2 stages: 69 KiB of shared memory,
# 115 registers, so that 3 CTAs share an SM (occupancy is what bounds it). Where 3 per SM take the column CTAs in
# one wave (H <= 6336) the grid is that wave, with as many token partitions as keep it one (one from H = 3200).
# Beyond it (H = 7168) a single partition of single-stage CTAs (4 per SM) takes them in one wave up to
# T = 2048; at larger T the H200 streams faster with ~16 two-stage CTAs per SM over several waves (the H100 does
# not: tuned for the H200) (docs/perf/h200/mhc.md, 2026-12-02 .. 2026-12-06).
PLAN = BackwardPlan(block_t=64, block_k=MHC_GEMM_BLOCK, threads=128, stages=2, resident_per_sm=3,
                    single_stage_per_sm=4, max_partials=32, min_tiles_per_partial=4, single_stage_max_tiles=32,
                    ctas_per_sm=16, reduce_threads=128)


def mhc_gemm_with_sqrsum_backward_partials(num_tokens: int, cols: int) -> int:
    """Number ``P`` of token partitions of the backward for ``T = num_tokens`` at ``K = cols`` (1: no second
    pass), every partition but the last at least ``PLAN.min_tiles_per_partial`` token tiles and none empty, at
    most ``PLAN.max_partials``. Where ``PLAN.resident_per_sm`` CTAs per H200 SM take the ``K / BK`` column CTAs
    in one wave: the most that keep the ``P * K / BK`` CTAs in that wave (1 from H = 3200 for any T; 4 at
    T = 8192, H = 1280). Beyond it: 1 up to ``PLAN.single_stage_max_tiles`` token tiles (single-stage CTAs,
    one wave), else about ``PLAN.ctas_per_sm`` CTAs per SM (5 at H = 7168 from T = 2049)."""
    tiles = -(-num_tokens // PLAN.block_t)
    col_ctas = cols // PLAN.block_k
    cap = min(PLAN.max_partials, tiles // PLAN.min_tiles_per_partial)
    if col_ctas <= PLAN.resident_per_sm * H200.sms:
        p = max(1, min(PLAN.resident_per_sm * H200.sms // col_ctas, cap))
    elif tiles <= PLAN.single_stage_max_tiles:
        p = 1
    else:
        p = min(-(-PLAN.ctas_per_sm * H200.sms // col_ctas), cap)  # tiles > 32: cap >= 8
    per = -(-tiles // p) if tiles else 1
    return max(1, -(-tiles // per))


def mhc_gemm_with_sqrsum_backward_stages(num_partials: int, cols: int) -> int:
    """Pipeline stages of the main kernel for ``P = num_partials`` (:func:`mhc_gemm_with_sqrsum_backward_partials`):
    ``PLAN.stages``, or 1 where a single partition's column CTAs fit in one wave only at
    ``PLAN.single_stage_per_sm`` per SM (T <= 2048 at H > 6336)."""
    one_wave = cols // PLAN.block_k <= PLAN.resident_per_sm * H200.sms
    return PLAN.stages if one_wave or num_partials > 1 else 1


@compile_key
class BackwardKey:
    """Compile-time key of the main kernel: ``K = cols``, ``M3 = rows`` and the pipeline ``stages``
    (:func:`mhc_gemm_with_sqrsum_backward_stages`' two choices), never the token count nor the partition count."""

    cols: int
    rows: int
    stages: int


def _key(fn: torch.Tensor, num_partials: int) -> BackwardKey:
    rows, cols = (int(s) for s in fn.shape)
    check_gemm_weight("mhc_gemm_with_sqrsum_backward", rows, cols)
    return BackwardKey(cols, rows, mhc_gemm_with_sqrsum_backward_stages(num_partials, cols))


def _bf16_pair(v):
    """``(hi, lo)`` bf16 expressions with ``hi = bf16(v)``, ``lo = bf16(v - hi)`` (``v - hi`` is exact in fp32):
    ``hi + lo`` is ``v`` within ``2**-17`` relative, exactly ``v`` for a TF32 value (<= 11 significant bits)."""
    from tilelang import language as T

    hi = T.cast(v, T.bfloat16)
    return hi, T.cast(v - T.cast(hi, T.float32), T.bfloat16)


def build_mhc_gemm_with_sqrsum_backward(cols: int, rows: int, stages: int = PLAN.stages):
    """Builds the backward main kernel (see the module docstring).

    Args:
        cols: ``K`` (multiple of 64).
        rows: ``M3`` (multiple of 8, <= 32).
        stages: pipeline stages (``PLAN.stages``; 1 where the launcher wants 4 CTAs per SM).

    Returns:
        ``T.prim_func(grad_out_mul (T, M3) f32, grad_sqrsum (T,) f32, x (T, K) bf16, fn (M3, K) f32,
        grad_x (T, K) bf16, grad_fn_part (P, M3, K) f32)``; ``T`` and ``P`` are dynamic (``P == 1``: the
        caller passes ``grad_fn`` itself).
    """
    from tilelang import language as T
    from tilelang.layout import make_swizzled_layout

    check_gemm_weight("mhc_gemm_with_sqrsum_backward", rows, cols)
    K, M3 = cols, rows
    BT, BK, TH, NS = PLAN.block_t, PLAN.block_k, PLAN.threads, stages
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")
    num_partials = T.dynamic("num_partials")

    @T.macro
    def load_operands(x, grad_out_mul, grad_sqrsum, x_s, gf_s, sg_s, stage, t0, c0):
        # one tile's x, g and sg rows by cp.async (rows past T are skipped), one group each
        T.async_copy(x[t0 : t0 + BT, c0 : c0 + BK], x_s[stage, :, :])
        T.async_copy(grad_out_mul[t0 : t0 + BT, 0:M3], gf_s[stage, :, :])
        T.async_copy(grad_sqrsum[t0 : t0 + BT], sg_s[stage, :])

    @T.macro
    def load(x, grad_x, grad_out_mul, grad_sqrsum, x_s, xg_s, gf_s, sg_s, stage, t0, c0):
        # ... and its grad_x rows, the last of the tile's 4 groups
        load_operands(x, grad_out_mul, grad_sqrsum, x_s, gf_s, sg_s, stage, t0, c0)
        T.async_copy(grad_x[t0 : t0 + BT, c0 : c0 + BK], xg_s[stage, :, :])

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_cuda(
        grad_out_mul: T.Tensor((num_tokens, M3), f32),
        grad_sqrsum: T.Tensor((num_tokens,), f32),
        x: T.Tensor((num_tokens, K), bf16),
        fn: T.Tensor((M3, K), f32),
        grad_x: T.Tensor((num_tokens, K), bf16),
        grad_fn_part: T.Tensor((num_partials, M3, K), f32),
    ):
        with T.Kernel(K // BK, num_partials, threads=TH) as (cb, p):
            x_s = T.alloc_shared((NS, BT, BK), bf16)
            xg_s = T.alloc_shared((NS, BT, BK), bf16)
            gf_s = T.alloc_shared((NS, BT, M3), f32)
            sg_s = T.alloc_shared((NS, BT), f32)
            fh_s = T.alloc_shared((2 * _PAD, BK), bf16)  # [fn_hi; 0; fn_hi; 0] of the CTA's columns
            fl_s = T.alloc_shared((2 * _PAD, BK), bf16)  # [fn_lo; 0; fn_lo; 0]
            gt_s = T.alloc_shared((BT, 2 * _PAD), bf16)  # [g_hi 0 g_lo 0]: A of both products
            r_s = T.alloc_shared((2 * _PAD, BK), f32)
            acc_x = T.alloc_fragment((BT, BK), f32)
            acc_f = T.alloc_fragment((2 * _PAD, BK), f32)
            # grad_x's stage is read and rewritten in the accumulator's fragment layout (two bf16 per thread,
            # 8 rows per warp access): 128-byte swizzled, as x's stage is for the WGMMA, not 8-way conflicted
            T.annotate_layout({xg_s: make_swizzled_layout(xg_s)})
            sg2 = T.alloc_fragment((BT,), f32)  # 2 sg of the tile's rows, in acc_x's row layout
            # the partition's first tile and tile count, the tile's first token: scalars, computed once
            b0 = T.alloc_var(T.int32)
            n = T.alloc_var(T.int32)
            t0 = T.alloc_var(T.int32)
            c0 = cb * BK
            tiles = T.ceildiv(num_tokens, BT)
            per = T.ceildiv(tiles, num_partials)
            b0 = T.min(p * per, tiles)
            n = T.min(p * per + per, tiles) - b0
            T.clear(gt_s)
            T.clear(fh_s)
            T.clear(fl_s)
            T.clear(acc_f)
            # Prologue: tiles 0 .. max(NS-2, 0) of the partition in flight (4 cp.async groups per tile: x, g,
            # sg, grad_x; empty groups where the partition is shorter, so the wait count below stays constant).
            for st in T.unroll(max(NS - 1, 1)):
                if st < n:
                    load(x, grad_x, grad_out_mul, grad_sqrsum, x_s, xg_s, gf_s, sg_s, st, (b0 + st) * BT, c0)
                else:
                    for _ in T.unroll(4):
                        T.ptx_commit_group()
            # the weights once per CTA, straight from global memory, while the prologue's tiles are in flight
            T.sync_threads()
            for j, c in T.Parallel(M3, BK):
                hi, lo = _bf16_pair(fn[j, c0 + c])
                fh_s[j, c] = hi
                fh_s[_PAD + j, c] = hi
                fl_s[j, c] = lo
                fl_s[_PAD + j, c] = lo
            for it in T.serial(n):
                if NS > 1:
                    # Tile it + NS - 1 goes into the stage consumed at it - 1 (released by the closing barrier).
                    if it + NS - 1 < n:
                        load(x, grad_x, grad_out_mul, grad_sqrsum, x_s, xg_s, gf_s, sg_s, (it + NS - 1) % NS,
                             (b0 + it + NS - 1) * BT, c0)
                    else:
                        for _ in T.unroll(4):
                            T.ptx_commit_group()
                # one stage: x, g and sg suffice up to the products; grad_x (the last group) may still land
                T.ptx_wait_group(4 * (NS - 1) if NS > 1 else 1)
                T.sync_threads()
                t0 = (b0 + it) * BT
                if t0 + BT > num_tokens:
                    # the last tile's rows past T were not loaded: zeros, so that they add exact zeros
                    for i, c in T.Parallel(BT, BK):
                        if t0 + i >= num_tokens:
                            x_s[it % NS, i, c] = T.bfloat16(0)
                    for i, j in T.Parallel(BT, M3):
                        if t0 + i >= num_tokens:
                            gf_s[it % NS, i, j] = T.float32(0)
                    T.sync_threads()
                for i in T.Parallel(BT):
                    sg2[i] = 2.0 * sg_s[it % NS, i]
                for i, j in T.Parallel(BT, M3):
                    hi, lo = _bf16_pair(gf_s[it % NS, i, j])
                    gt_s[i, j] = hi
                    gt_s[i, _PAD + j] = lo
                T.fence_proxy_async()  # the generic-proxy writes above are read by the WGMMAs below
                T.sync_threads()
                # All three issued at once; the epilogue waits for the two grad_x products only: the grad_fn
                # product (it reads x's stage and gt_s, which nothing writes before the closing wait) runs under it.
                T.wgmma_gemm(gt_s, fh_s, acc_x, clear_accum=True)
                T.wgmma_gemm(gt_s, fl_s, acc_x)
                T.wgmma_gemm(gt_s, x_s[it % NS, :, :], acc_f, transpose_A=True)
                if NS == 1:
                    T.ptx_wait_group(0)
                    T.sync_threads()
                T.wait_wgmma(1)
                T.warpgroup_fence_operand(acc_x, num_regs=BT * BK // TH)  # the epilogue's reads stay after the wait
                for i, c in T.Parallel(BT, BK):  # in place: each element read and written by one thread
                    xg_s[it % NS, i, c] = T.cast(
                        T.cast(xg_s[it % NS, i, c], f32)
                        + (acc_x[i, c] + T.cast(x_s[it % NS, i, c], f32) * sg2[i]),
                        bf16,
                    )
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc_f, num_regs=2 * _PAD * BK // TH)
                T.sync_threads()
                if NS == 1 and it + 1 < n:
                    # one stage: the next tile's x, g, sg load under this tile's grad_x store, its grad_x after
                    load_operands(x, grad_out_mul, grad_sqrsum, x_s, gf_s, sg_s, 0, t0 + BT, c0)
                for i, c in T.Parallel(BT, BK):
                    if t0 + i < num_tokens:
                        grad_x[t0 + i, c0 + c] = xg_s[it % NS, i, c]
                T.sync_threads()
                if NS == 1 and it + 1 < n:
                    T.async_copy(grad_x[t0 + BT : t0 + 2 * BT, c0 : c0 + BK], xg_s[0, :, :])
            T.copy(acc_f, r_s)
            T.sync_threads()
            for j, c in T.Parallel(M3, BK):
                grad_fn_part[p, j, c0 + c] = r_s[j, c] + r_s[_PAD + j, c]

    return mhc_gemm_with_sqrsum_backward_cuda


def build_mhc_gemm_with_sqrsum_backward_reduce(cols: int, rows: int):
    """Builds the fixed-order partial reduction ``grad_fn[j, k] = sum_{p=0..P-1} part[p, j, k]`` (``P``
    dynamic, ascending ``p``).

    Returns:
        ``T.prim_func(grad_fn_part (P, M3 * K) f32, grad_fn (M3 * K,) f32)``.
    """
    from tilelang import language as T

    K, M3 = cols, rows
    threads = PLAN.reduce_threads
    nq = M3 * K // 4
    f32 = T.float32
    num_partials = T.dynamic("num_partials")

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_reduce_cuda(
        grad_fn_part: T.Tensor((num_partials, M3 * K), f32), grad_fn: T.Tensor((M3 * K,), f32)
    ):
        # one float4 per thread, the P partials added in ascending p
        with T.Kernel(T.ceildiv(nq, threads), threads=threads) as bx:
            tid = T.get_thread_binding()
            v = T.alloc_local((4,), f32)
            a = T.alloc_local((4,), f32)
            if bx * threads + tid < nq:
                for k in T.vectorized(4):
                    a[k] = grad_fn_part[0, (bx * threads + tid) * 4 + k]
                for pp in T.serial(1, num_partials):
                    for k in T.vectorized(4):
                        v[k] = grad_fn_part[pp, (bx * threads + tid) * 4 + k]
                    for k in T.unroll(4):
                        a[k] += v[k]
                for k in T.vectorized(4):
                    grad_fn[(bx * threads + tid) * 4 + k] = a[k]

    return mhc_gemm_with_sqrsum_backward_reduce_cuda


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """The main kernel (its token partition count is a launch argument) and its single-stage variant ``_1stage``."""
    k, m3 = hc_mult * hidden_size, hc_mult * (hc_mult + 2)
    return {"mhc_gemm_with_sqrsum_backward": BackwardKey(k, m3, PLAN.stages),
            "mhc_gemm_with_sqrsum_backward_1stage": BackwardKey(k, m3, 1)}


BACKWARD = Kernel("mhc_gemm_with_sqrsum_backward", BackwardKey, build_mhc_gemm_with_sqrsum_backward, derive=_key,
                  cases=_cases)
# the reduction of the partitions' partials (its key from the backward's launcher)
BACKWARD_REDUCE = Kernel(
    "mhc_gemm_with_sqrsum_backward_reduce", GemmWeightKey, build_mhc_gemm_with_sqrsum_backward_reduce,
    cases=lambda hidden_size, hc_mult: GemmWeightKey(hc_mult * hidden_size, hc_mult * (hc_mult + 2)))


def mhc_gemm_with_sqrsum_backward(
    grad_out_mul: torch.Tensor,
    grad_sqrsum: torch.Tensor,
    x: torch.Tensor,
    fn: torch.Tensor,
    grad_x: torch.Tensor,
    grad_fn: torch.Tensor,
) -> None:
    """Launches the pre-norm GEMM backward on the current stream (inputs validated upstream).

    Args:
        grad_out_mul: ``(T, M3)`` f32 (a ``(T, 1, M3)`` view is accepted), ``T > 0``.
        grad_sqrsum: ``(T,)`` f32 (``(T, 1)`` accepted).
        x: ``(T, K)`` bf16 (the saved residual viewed flat).
        fn: ``(M3, K)`` f32 (the saved, TF32-rounded projection; any fp32 values work).
        grad_x: ``(T, K)`` bf16, accumulated in place (bf16 read-modify-write).
        grad_fn: ``(M3, K)`` f32, overwritten (the op's new output). With ``P > 1`` partitions
            (:func:`mhc_gemm_with_sqrsum_backward_partials`) the launcher allocates the ``(P, M3, K)`` f32
            partials with torch on the current stream.
    """
    n = x.shape[0]
    num_partials = mhc_gemm_with_sqrsum_backward_partials(n, int(fn.shape[1]))
    key = BACKWARD.key(fn, num_partials)
    cols, rows = key.cols, key.rows
    args = (grad_out_mul.reshape(n, rows), grad_sqrsum.reshape(n), x.view(n, cols), fn, grad_x.view(n, cols))
    if num_partials == 1:
        BACKWARD.compiled(key)(*args, grad_fn.view(1, rows, cols))
        return
    part = torch.empty((num_partials, rows, cols), dtype=torch.float32, device=fn.device)
    BACKWARD.compiled(key)(*args, part)
    BACKWARD_REDUCE.compiled(GemmWeightKey(cols, rows))(part.view(num_partials, rows * cols), grad_fn.view(-1))


__all__ = public_names(__name__)
