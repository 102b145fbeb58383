"""CUDA kernels of ``mhc_fn_normw_merge_forward`` / ``_backward`` (docs/ops/mhc.md#fn_normw_merge).

Forward: ``out_fn[r, k] = fn[r, k] * normw[k]`` over the fp32 ``(M3, K)`` projection, ``nv`` float4 column
groups per thread, the ``M3`` rows of a column block in consecutive CTAs (they share the ``normw`` block).
Backward: both outputs accumulate in place, deterministically (no atomics): ``grad_fn += grad_out_fn * normw``
and ``grad_normw += sum_r grad_out_fn * fn`` (rows in order, the products rounded before the sum as the
reference rounds them). ``K`` a multiple of 4 (the column tail is guarded).
"""

import dataclasses

import torch

from ....limits import IntRange
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import min_blocks

# the kernels' float4 column groups
WIDTH = IntRange("K", 4, None, multiple_of=4)


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """Forward: ``threads`` threads of ``vectors`` float4 column groups each. Backward: CTAs of ``row_groups``
    x ``col_groups`` threads (64 columns and all ``M3`` rows per CTA, every thread's loads issued at once)."""

    threads: int
    vectors: int
    row_groups: int
    col_groups: int


# 128 threads x 4 float4 in the forward; 8 row groups x 16 float4 column groups in the backward, which puts
# the whole (24, K) problem in flight at once (docs/perf/h200/mhc.md, 2026-12-01 and 2026-11-30).
PLAN = MergePlan(threads=128, vectors=4, row_groups=8, col_groups=16)


@compile_key
class MergeKey:
    """Compile-time key of both kernels: the ``(M3, K)`` projection's ``rows`` and ``cols``."""

    rows: int
    cols: int


def _key(op: str, fn: torch.Tensor) -> MergeKey:
    rows, cols = (int(s) for s in fn.shape)
    return MergeKey(rows, WIDTH.require(op, cols))


def _cases(hidden_size: int, hc_mult: int) -> MergeKey:
    return MergeKey(rows=hc_mult * (hc_mult + 2), cols=hc_mult * hidden_size)  # M3 = m(m+2), K = m * H


def build_mhc_fn_normw_merge_forward(rows: int, cols: int):
    """Builds ``out_fn[r, k] = fn[r, k] * normw[k]``.

    Args:
        rows: ``M3``.
        cols: ``K`` (multiple of 4; the column tail is guarded).

    Returns:
        ``T.prim_func(fn (M3, K) f32, normw (K,) f32, out_fn (M3, K) f32)``.
    """
    from tilelang import language as T

    M3, K = rows, cols
    threads, nv = PLAN.threads, PLAN.vectors
    nq = K // 4
    f32 = T.float32

    @T.prim_func
    def mhc_fn_normw_merge_forward_cuda(fn: T.Tensor((M3, K), f32), normw: T.Tensor((K,), f32), out_fn: T.Tensor((M3, K), f32)):
        # (M3, K) is at most 24 x 32768 floats (3 MiB); CTA (bx, r) = bid (rows fastest) owns the
        # nv float4 column groups bx * nv * threads + j * threads + tid (j < nv) of row r.
        with T.Kernel(T.ceildiv(nq, threads * nv) * M3, threads=threads) as bid:
            T.annotate_min_blocks_per_sm(min_blocks(threads, 64))
            r = bid % M3
            bx = bid // M3
            tid = T.get_thread_binding()
            a = T.alloc_local((nv, 4), f32)
            w = T.alloc_local((nv, 4), f32)
            for j in T.unroll(nv):
                q = (bx * nv + j) * threads + tid  # float4 column group
                if q < nq:
                    for k in T.vectorized(4):
                        a[j, k] = fn[r, q * 4 + k]
                    for k in T.vectorized(4):
                        w[j, k] = normw[q * 4 + k]
            for j in T.unroll(nv):
                q = (bx * nv + j) * threads + tid
                if q < nq:
                    for k in T.vectorized(4):
                        out_fn[r, q * 4 + k] = a[j, k] * w[j, k]

    return mhc_fn_normw_merge_forward_cuda


FORWARD = Kernel("mhc_fn_normw_merge_forward", MergeKey, build_mhc_fn_normw_merge_forward, cases=_cases,
                 derive=lambda fn, normw, out_fn: _key("mhc_fn_normw_merge_forward", fn))


def mhc_fn_normw_merge_forward(fn: torch.Tensor, normw: torch.Tensor, out_fn: torch.Tensor) -> None:
    """Launches ``out_fn = fn * normw`` (row broadcast) on the current stream.

    Args:
        fn: ``(M3, K)`` f32, ``K % 4 == 0``.
        normw: ``(K,)`` f32.
        out_fn: ``(M3, K)`` f32, written.
    """
    FORWARD.compiled(FORWARD.key(fn, normw, out_fn))(fn, normw, out_fn)


def build_mhc_fn_normw_merge_backward(rows: int, cols: int):
    """Builds the merge backward (both outputs accumulate in place).

    ``grad_fn[r, k] += grad_out_fn[r, k] * normw[k]``;
    ``grad_normw[k] += sum_{r=0..M3-1} grad_out_fn[r, k] * fn[r, k]`` (rows in order, added once).
    Deterministic, no atomics.

    A CTA covers ``4 * PLAN.col_groups`` columns and all ``M3`` rows, split over
    ``PLAN.row_groups`` thread groups so that every thread issues all its loads
    (``ceil(M3 / PLAN.row_groups)`` rows x 3 float4) at once; each thread updates ``grad_fn``
    (product rounded before the add, as the reference does) and parks the rounded products
    ``grad_out_fn * fn`` in shared memory; after one barrier, one thread per column
    sums the ``M3`` products in row order and adds the sum to ``grad_normw``.

    Args:
        rows: ``M3``.
        cols: ``K`` (multiple of 4; the column tail is guarded).

    Returns:
        ``T.prim_func(fn, normw, grad_out_fn, grad_fn, grad_normw)`` (shapes as the forward).
    """
    from tilelang import language as T

    M3, K = rows, cols
    nq = K // 4
    f32 = T.float32
    row_groups, col_groups = PLAN.row_groups, PLAN.col_groups
    threads = row_groups * col_groups
    rpg = -(-M3 // row_groups)  # rows per thread group (contiguous block)
    ragged = rpg * row_groups != M3
    ncols = 4 * col_groups

    @T.prim_func
    def mhc_fn_normw_merge_backward_cuda(
        fn: T.Tensor((M3, K), f32),
        normw: T.Tensor((K,), f32),
        grad_out_fn: T.Tensor((M3, K), f32),
        grad_fn: T.Tensor((M3, K), f32),
        grad_normw: T.Tensor((K,), f32),
    ):
        # (24, K) with K <= 32768 is at most 9 MiB in all: with every thread's loads issued up
        # front, the whole problem is in flight at once (K / ncols CTAs, ~1-2 per SM).
        with T.Kernel(T.ceildiv(nq, col_groups), threads=threads) as bx:
            tid = T.get_thread_binding()
            lane = tid % col_groups
            rg = tid // col_groups
            w = T.alloc_local((4,), f32)
            g = T.alloc_local((rpg, 4), f32)
            a = T.alloc_local((rpg, 4), f32)
            fg = T.alloc_local((rpg, 4), f32)
            acc = T.alloc_local((1,), f32)
            prod = T.alloc_shared((M3, ncols), f32)
            if bx * col_groups + lane < nq:
                for u in T.unroll(rpg):
                    if (not ragged) or (rg * rpg + u < M3):
                        for k in T.vectorized(4):
                            g[u, k] = grad_out_fn[rg * rpg + u, (bx * col_groups + lane) * 4 + k]
                        for k in T.vectorized(4):
                            a[u, k] = fn[rg * rpg + u, (bx * col_groups + lane) * 4 + k]
                        for k in T.vectorized(4):
                            fg[u, k] = grad_fn[rg * rpg + u, (bx * col_groups + lane) * 4 + k]
                for k in T.vectorized(4):
                    w[k] = normw[(bx * col_groups + lane) * 4 + k]
                for u in T.unroll(rpg):
                    if (not ragged) or (rg * rpg + u < M3):
                        # results formed in registers first so that both stores stay 16-byte vectors
                        for k in T.unroll(4):
                            fg[u, k] = fg[u, k] + T.ieee_mul(g[u, k], w[k])
                            a[u, k] = T.ieee_mul(g[u, k], a[u, k])
                        for k in T.vectorized(4):
                            grad_fn[rg * rpg + u, (bx * col_groups + lane) * 4 + k] = fg[u, k]
                        for k in T.vectorized(4):
                            prod[rg * rpg + u, lane * 4 + k] = a[u, k]
            T.sync_threads()
            if tid < ncols:
                if bx * ncols + tid < K:
                    acc[0] = prod[0, tid]
                    for r in T.unroll(1, M3):
                        acc[0] += prod[r, tid]
                    grad_normw[bx * ncols + tid] = grad_normw[bx * ncols + tid] + acc[0]

    return mhc_fn_normw_merge_backward_cuda


BACKWARD = Kernel("mhc_fn_normw_merge_backward", MergeKey, build_mhc_fn_normw_merge_backward, cases=_cases,
                  derive=lambda fn, normw, grad_out_fn: _key("mhc_fn_normw_merge_backward", fn))


def mhc_fn_normw_merge_backward(
    fn: torch.Tensor, normw: torch.Tensor, grad_out_fn: torch.Tensor, grad_fn: torch.Tensor, grad_normw: torch.Tensor
) -> None:
    """Launches the merge backward on the current stream; ``grad_fn`` and ``grad_normw`` accumulate (``+=``).

    Args:
        fn: ``(M3, K)`` f32.
        normw: ``(K,)`` f32.
        grad_out_fn: ``(M3, K)`` f32.
        grad_fn: ``(M3, K)`` f32, updated in place.
        grad_normw: ``(K,)`` f32, updated in place.
    """
    BACKWARD.compiled(BACKWARD.key(fn, normw, grad_out_fn))(fn, normw, grad_out_fn, grad_fn, grad_normw)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
