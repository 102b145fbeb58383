"""CUDA kernels of ``mhc_gemm_with_sqrsum_backward`` (docs/ops/mhc.md#gemm_with_sqrsum).

``x_grad[t, k] = bf16(f32(x_grad[t, k]) + sum_j g[t, j] * fn[j, k] + 2 * f32(x[t, k]) * sg[t])``
(read-modify-write) and ``fn_grad[j, k] = sum_t g[t, j] * f32(x[t, k])`` in fp32 FMA. Grid ``(K / 64, P)``:
CTA ``(cb, p)`` owns 64 columns and the fixed token range ``[p * ceil(T/P), min((p+1) * ceil(T/P), T))``; per
iteration warp ``w`` takes 8 consecutive tokens of the next 32 of the range, each lane 2 columns with the
``M3`` ``fn`` values of its columns in registers; the 4 warp partials are summed in ascending warp order, then
(``P > 1``) a second kernel sums the ``P`` partial rows in ascending ``p``. Deterministic, no atomics.
"""

import dataclasses
import functools

import torch

from .....chips import H200
from .....limits import MHC_GEMM_BLOCK
from ..._build import jit_compile
from .._common import check_gemm_weight

__all__ = [
    "PLAN",
    "build_mhc_gemm_with_sqrsum_backward",
    "build_mhc_gemm_with_sqrsum_backward_reduce",
    "get_mhc_gemm_with_sqrsum_backward_kernel",
    "get_mhc_gemm_with_sqrsum_backward_reduce_kernel",
    "mhc_gemm_with_sqrsum_backward",
    "mhc_gemm_with_sqrsum_backward_key",
    "mhc_gemm_with_sqrsum_backward_partials",
]

_BLOCK_K = MHC_GEMM_BLOCK  # columns per CTA (the interface's 64-column blocks)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The backward's tuning: ``threads`` per CTA (a warp row covers the CTA's 64 columns, 2 per lane);
    ``unroll`` consecutive tokens per warp and iteration; the grid's ``ctas_per_sm`` target over all waves,
    at most ``max_partials`` token partitions; ``reduce_threads`` of the partial reduction."""

    threads: int
    unroll: int
    ctas_per_sm: int
    max_partials: int
    reduce_threads: int


# 4 warps of 8 tokens each: 16 x 4-byte x / x_grad loads per lane in flight (16 registers), the g rows of the 32
# tokens staged in 3 KiB of shared memory; ~8 CTAs per H200 SM over all waves keeps the last wave's tail short.
PLAN = BackwardPlan(threads=128, unroll=8, ctas_per_sm=8, max_partials=64, reduce_threads=128)


def mhc_gemm_with_sqrsum_backward_partials(cols: int) -> int:
    """Number ``P`` of token partitions of the backward at ``K = cols`` (1: no second pass): ``K / 64`` column
    CTAs times ``P`` is at least ``PLAN.ctas_per_sm`` per H200 SM (``P = 3`` at K = 28672, 14 at K = 5120)."""
    target = PLAN.ctas_per_sm * H200.sms
    return max(1, min(PLAN.max_partials, -(-target // (cols // _BLOCK_K))))


def mhc_gemm_with_sqrsum_backward_key(x: torch.Tensor, fn: torch.Tensor) -> tuple:
    """Compile-time key ``(K, M3, P)`` (never the token count)."""
    rows, cols = (int(s) for s in fn.shape)
    check_gemm_weight("mhc_gemm_with_sqrsum_backward", rows, cols)
    return (cols, rows, mhc_gemm_with_sqrsum_backward_partials(cols))


def build_mhc_gemm_with_sqrsum_backward(cols: int, rows: int, num_partials: int):
    """Builds the backward main kernel.

    Args:
        cols: ``K`` (multiple of 64).
        rows: ``M3``.
        num_partials: ``P``; with ``P == 1`` the kernel writes ``fn_grad`` directly.

    Returns:
        ``T.prim_func(out_mul_grad (T, M3) f32, sqrsum_grad (T,) f32, x (T, K) bf16, fn (M3, K) f32,
        x_grad (T, K) bf16, fn_grad_part (P, M3, K) f32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    K, M3, P = cols, rows, num_partials
    threads, unroll = PLAN.threads, PLAN.unroll
    nwarps = threads // 32
    tt = nwarps * unroll  # tokens per CTA iteration
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_cuda(
        out_mul_grad: T.Tensor((num_tokens, M3), f32),
        sqrsum_grad: T.Tensor((num_tokens,), f32),
        x: T.Tensor((num_tokens, K), bf16),
        fn: T.Tensor((M3, K), f32),
        x_grad: T.Tensor((num_tokens, K), bf16),
        fn_grad_part: T.Tensor((P, M3, K), f32),
    ):
        with T.Kernel(K // _BLOCK_K, P, threads=threads) as (cb, p):
            # 48 fp32 registers of fn + 48 of fn_grad partials + 24 of g per lane (~150 in all)
            # -> 3 CTAs of 4 warps per SM; the warp-partial exchange uses 24 KiB of shared memory.
            T.annotate_min_blocks_per_sm(3)
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            fr = T.alloc_local((M3, 2), f32)
            acc = T.alloc_local((M3, 2), f32)
            g = T.alloc_local((M3,), f32)
            xr = T.alloc_local((unroll, 2), bf16)
            xgr = T.alloc_local((unroll, 2), bf16)
            dx = T.alloc_local((2,), f32)
            sg = T.alloc_local((1,), f32)
            g_s = T.alloc_shared((tt, M3), f32)
            sg_s = T.alloc_shared((tt,), f32)
            red = T.alloc_shared((nwarps, M3, _BLOCK_K), f32)
            for j in T.unroll(M3):
                for c in T.vectorized(2):
                    fr[j, c] = fn[j, cb * _BLOCK_K + lane * 2 + c]
                for c in T.unroll(2):
                    acc[j, c] = 0.0
            per = T.ceildiv(num_tokens, P)
            t_begin = T.min(per * p, num_tokens)
            t_end = T.min(per * p + per, num_tokens)
            for it in T.serial(T.ceildiv(t_end - t_begin, tt)):
                # Stage the g / sg rows of the tt tokens (cooperative, 16-byte loads) and issue every
                # x / x_grad load of the warp's ``unroll`` tokens before the barrier, so that they
                # are all in flight together.
                for e in T.unroll(-(-(tt * M3 // 4) // threads)):
                    if (e * threads + tid < tt * M3 // 4) and (t_begin + it * tt + (e * threads + tid) // (M3 // 4) < t_end):
                        for c in T.vectorized(4):
                            g_s[(e * threads + tid) // (M3 // 4), ((e * threads + tid) % (M3 // 4)) * 4 + c] = out_mul_grad[
                                t_begin + it * tt + (e * threads + tid) // (M3 // 4), ((e * threads + tid) % (M3 // 4)) * 4 + c
                            ]
                if tid < tt:
                    if t_begin + it * tt + tid < t_end:
                        sg_s[tid] = sqrsum_grad[t_begin + it * tt + tid]
                for u in T.unroll(unroll):
                    if t_begin + it * tt + wid * unroll + u < t_end:
                        for c in T.vectorized(2):
                            xr[u, c] = x[t_begin + it * tt + wid * unroll + u, cb * _BLOCK_K + lane * 2 + c]
                        for c in T.vectorized(2):
                            xgr[u, c] = x_grad[t_begin + it * tt + wid * unroll + u, cb * _BLOCK_K + lane * 2 + c]
                T.sync_threads()
                for u in T.unroll(unroll):
                    if t_begin + it * tt + wid * unroll + u < t_end:
                        for j in T.vectorized(M3):
                            g[j] = g_s[wid * unroll + u, j]
                        sg[0] = sg_s[wid * unroll + u]
                        for c in T.unroll(2):
                            dx[c] = g[0] * fr[0, c]
                            for j in T.unroll(1, M3):
                                dx[c] += g[j] * fr[j, c]
                            dx[c] = T.cast(xgr[u, c], f32) + dx[c]
                            dx[c] = dx[c] + 2.0 * T.cast(xr[u, c], f32) * sg[0]
                        for c in T.vectorized(2):
                            x_grad[t_begin + it * tt + wid * unroll + u, cb * _BLOCK_K + lane * 2 + c] = T.cast(dx[c], bf16)
                        for j in T.unroll(M3):
                            for c in T.unroll(2):
                                acc[j, c] += g[j] * T.cast(xr[u, c], f32)
                T.sync_threads()
            for j in T.unroll(M3):
                for c in T.vectorized(2):
                    red[wid, j, lane * 2 + c] = acc[j, c]
            T.sync_threads()
            # Warp partials summed in ascending warp order; thread tid owns elements tid, tid + 128, ...
            for e in T.unroll(M3 * _BLOCK_K // threads):
                sg[0] = red[0, (e * threads + tid) // _BLOCK_K, (e * threads + tid) % _BLOCK_K]
                for w in T.unroll(1, nwarps):
                    sg[0] += red[w, (e * threads + tid) // _BLOCK_K, (e * threads + tid) % _BLOCK_K]
                fn_grad_part[p, (e * threads + tid) // _BLOCK_K, cb * _BLOCK_K + (e * threads + tid) % _BLOCK_K] = sg[0]

    return mhc_gemm_with_sqrsum_backward_cuda


def build_mhc_gemm_with_sqrsum_backward_reduce(cols: int, rows: int, num_partials: int):
    """Builds the fixed-order partial reduction ``fn_grad[j, k] = sum_{p=0..P-1} part[p, j, k]``.

    Returns:
        ``T.prim_func(fn_grad_part (P, M3, K) f32, fn_grad (M3, K) f32)``.
    """
    from tilelang import language as T

    K, M3, P = cols, rows, num_partials
    threads = PLAN.reduce_threads
    nq = M3 * K // 4
    f32 = T.float32

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_reduce_cuda(fn_grad_part: T.Tensor((P, M3 * K), f32), fn_grad: T.Tensor((M3 * K,), f32)):
        # one float4 per thread, all P partial loads issued before the ascending-p sum.
        with T.Kernel(T.ceildiv(nq, threads), threads=threads) as bx:
            tid = T.get_thread_binding()
            v = T.alloc_local((P, 4), f32)
            a = T.alloc_local((4,), f32)
            if bx * threads + tid < nq:
                for pp in T.unroll(P):
                    for k in T.vectorized(4):
                        v[pp, k] = fn_grad_part[pp, (bx * threads + tid) * 4 + k]
                for k in T.unroll(4):
                    a[k] = v[0, k]
                    for pp in T.unroll(1, P):
                        a[k] += v[pp, k]
                for k in T.vectorized(4):
                    fn_grad[(bx * threads + tid) * 4 + k] = a[k]

    return mhc_gemm_with_sqrsum_backward_reduce_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_with_sqrsum_backward_kernel(*key):
    """Compiled main kernel for ``key`` (see :func:`mhc_gemm_with_sqrsum_backward_key`), built once per key."""
    return jit_compile("mhc_gemm_with_sqrsum_backward", key, build_mhc_gemm_with_sqrsum_backward(*key))


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_with_sqrsum_backward_reduce_kernel(*key):
    """Compiled partial reduction for ``key`` (see :func:`mhc_gemm_with_sqrsum_backward_key`)."""
    return jit_compile("mhc_gemm_with_sqrsum_backward_reduce", key, build_mhc_gemm_with_sqrsum_backward_reduce(*key))


def mhc_gemm_with_sqrsum_backward(
    out_mul_grad: torch.Tensor,
    sqrsum_grad: torch.Tensor,
    x: torch.Tensor,
    fn: torch.Tensor,
    x_grad: torch.Tensor,
    fn_grad: torch.Tensor,
) -> None:
    """Launches the pre-norm GEMM backward on the current stream (inputs validated upstream).

    Args:
        out_mul_grad: ``(T, M3)`` f32 (a ``(T, 1, M3)`` view is accepted), ``T > 0``.
        sqrsum_grad: ``(T,)`` f32 (``(T, 1)`` accepted).
        x: ``(T, K)`` bf16 (the saved residual viewed flat).
        fn: ``(M3, K)`` f32 (the saved, TF32-rounded projection).
        x_grad: ``(T, K)`` bf16, accumulated in place (bf16 read-modify-write).
        fn_grad: ``(M3, K)`` f32, overwritten (the op's new output). With ``P > 1`` partitions the
            launcher allocates the ``(P, M3, K)`` f32 partials with torch on the current stream.
    """
    key = mhc_gemm_with_sqrsum_backward_key(x, fn)
    cols, rows, num_partials = key
    n = x.shape[0]
    args = (out_mul_grad.reshape(n, rows), sqrsum_grad.reshape(n), x.view(n, cols), fn, x_grad.view(n, cols))
    if num_partials == 1:
        get_mhc_gemm_with_sqrsum_backward_kernel(*key)(*args, fn_grad.view(1, rows, cols))
        return
    part = torch.empty((num_partials, rows, cols), dtype=torch.float32, device=fn.device)
    get_mhc_gemm_with_sqrsum_backward_kernel(*key)(*args, part)
    get_mhc_gemm_with_sqrsum_backward_reduce_kernel(*key)(part.view(num_partials, rows * cols), fn_grad.view(-1))
