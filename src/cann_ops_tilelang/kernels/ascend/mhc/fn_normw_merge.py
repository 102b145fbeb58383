"""Ascend 950 kernels of ``mhc_fn_normw_merge_forward`` / ``_backward`` (docs/ops/mhc.md#fn_normw_merge).

* ``mhc_fn_normw_merge_forward(fn, normw, out_fn)``: ``out_fn[r, k] = fn[r, k] * normw[k]``.
* ``mhc_fn_normw_merge_backward(fn, normw, grad_out_fn, grad_fn, grad_normw)``: ``grad_fn += og * normw``,
  ``grad_normw += sum_r og[r] * fn[r]`` (row sum in a register accumulator, rows ascending, added once).

A persistent loop over column blocks of ``K = m*H`` (each block owned by one task, no atomics) with
multi-buffered UB tiles; K must be a multiple of 256 (every H % 64 == 0 with m = 4).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._common import CASE_MHC_MULT3, CASE_NUM_CORES, LANES, require_mixes, require_width


_BLOCK = 256  # every width below divides a K that is a multiple of 256


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """Column blocks of W fp32 columns: the widest of ``widths`` that divides K and still gives every
    vector core a block (else the narrowest dividing one); ``stages`` UB versions of every tile."""

    widths: tuple[int, ...]
    stages: int = 2

    def width(self, numel: int, num_cores: int) -> int:
        fitting = [w for w in self.widths if numel % w == 0]
        for w in fitting:
            if numel // w >= num_cores:
                return w
        return fitting[-1]


# The widest blocks whose two stages fit the UB at M3 = 24: 512 columns forward (196 KiB), 256 backward
# (148 KiB) (docs/perf/ascend950/mhc.md, 2026-11-30 — fn_normw_merge: column block widths).
FORWARD_PLAN = MergePlan(widths=(512, 256))
BACKWARD_PLAN = MergePlan(widths=(256,))


def _check(where: str, mhc_mult3: int, numel: int) -> tuple[int, int]:
    return require_mixes(where, mhc_mult3, limits.MHC_MIX), require_width(where, numel, _BLOCK)


@compile_key
class MergeKey:
    """Compile-time key of both kernels: the ``(M3, K)`` projection on ``num_cores`` vector cores."""

    mhc_mult3: int
    numel: int
    num_cores: int


def _key(fn) -> MergeKey:
    return MergeKey(int(fn.shape[0]), int(fn.shape[1]), int(num_vector_cores()))


def _cases(hidden_size: int, hc_mult: int) -> MergeKey:
    return MergeKey(CASE_MHC_MULT3, hc_mult * hidden_size, CASE_NUM_CORES)  # K = m*H


def build_mhc_fn_normw_merge_forward(mhc_mult3: int, numel: int, num_cores: int):
    """prim_func(fn (M3,K) f32, normw (K,) f32, out_fn (M3,K) f32): ``out_fn = fn * normw`` (exact)."""
    M3, K = _check("mhc_fn_normw_merge_forward", mhc_mult3, numel)
    W = FORWARD_PLAN.width(K, num_cores)
    n_blocks = K // W
    n_chunks = W // LANES
    stages = FORWARD_PLAN.stages

    @T.prim_func
    def mhc_fn_normw_merge_forward_asc(
        fn: T.Tensor[(M3, K), T.float32],
        normw: T.Tensor[(K,), T.float32],
        out_fn: T.Tensor[(M3, K), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            fn_ub = T.alloc_shared((M3, W), T.float32)
            nw_ub = T.alloc_shared((W,), T.float32)
            out_ub = T.alloc_shared((M3, W), T.float32)
            T.annotate_buffer_versions({fn_ub: stages, nw_ub: stages, out_ub: stages})
            for (blk,) in T.Persistent([n_blocks], num_cores, core_id, group_size=1, num_stages=stages):
                base = blk * W
                T.copy(fn[:, base : base + W], fn_ub)
                T.copy(normw[base : base + W], nw_ub)
                with T.SimdVF():
                    for c in T.serial(n_chunks):
                        d = c * LANES
                        nw = S.vld(nw_ub[d])
                        for r in T.serial(M3):
                            S.vsts(out_ub[r, d], S.vmul(S.vld(fn_ub[r, d]), nw))
                T.copy(out_ub, out_fn[:, base : base + W])

    return mhc_fn_normw_merge_forward_asc


FORWARD = Kernel("mhc_fn_normw_merge_forward", MergeKey, build_mhc_fn_normw_merge_forward, derive=_key, cases=_cases)


def mhc_fn_normw_merge_forward(fn, normw, out_fn) -> None:
    """fn (M3,K) f32, normw (K,) f32 -> out_fn (M3,K) f32 (overwritten). Current stream, no sync."""
    kernel = FORWARD.compiled(FORWARD.key(fn))
    kernel(fn, normw, out_fn)


def build_mhc_fn_normw_merge_backward(mhc_mult3: int, numel: int, num_cores: int):
    """prim_func(fn (M3,K) f32, normw (K,) f32, grad_out_fn (M3,K) f32, grad_fn (M3,K) f32 in/out,
    grad_normw (K,) f32 in/out).

    ``grad_fn[r] += og[r] * normw`` (fused multiply-add); ``s = og[0]*fn[0]``, ``s += og[r]*fn[r]`` for
    r = 1..M3-1 (fused), then ``grad_normw += s`` once. Each column block is owned by one task.
    """
    M3, K = _check("mhc_fn_normw_merge_backward", mhc_mult3, numel)
    W = BACKWARD_PLAN.width(K, num_cores)
    n_blocks = K // W
    n_chunks = W // LANES
    stages = BACKWARD_PLAN.stages

    @T.prim_func
    def mhc_fn_normw_merge_backward_asc(
        fn: T.Tensor[(M3, K), T.float32],
        normw: T.Tensor[(K,), T.float32],
        grad_out_fn: T.Tensor[(M3, K), T.float32],
        grad_fn: T.Tensor[(M3, K), T.float32],
        grad_normw: T.Tensor[(K,), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            fn_ub = T.alloc_shared((M3, W), T.float32)
            og_ub = T.alloc_shared((M3, W), T.float32)
            fg_ub = T.alloc_shared((M3, W), T.float32)
            nw_ub = T.alloc_shared((W,), T.float32)
            ng_ub = T.alloc_shared((W,), T.float32)
            T.annotate_buffer_versions({fn_ub: stages, og_ub: stages, fg_ub: stages, nw_ub: stages, ng_ub: stages})
            for (blk,) in T.Persistent([n_blocks], num_cores, core_id, group_size=1, num_stages=stages):
                base = blk * W
                T.copy(fn[:, base : base + W], fn_ub)
                T.copy(grad_out_fn[:, base : base + W], og_ub)
                T.copy(grad_fn[:, base : base + W], fg_ub)
                T.copy(normw[base : base + W], nw_ub)
                T.copy(grad_normw[base : base + W], ng_ub)
                with T.SimdVF():
                    acc = S.alloc_local((2,), T.float32)  # [row sum | grad_fn row]
                    for c in T.serial(n_chunks):
                        d = c * LANES
                        nw = S.vld(nw_ub[d])
                        og0 = S.vld(og_ub[0, d])
                        acc[0] = S.vmul(og0, S.vld(fn_ub[0, d]))
                        acc[1] = S.vld(fg_ub[0, d])
                        S.vmula(acc[1], og0, nw)
                        S.vsts(fg_ub[0, d], acc[1])
                        for r in T.serial(1, M3):
                            og = S.vld(og_ub[r, d])
                            S.vmula(acc[0], og, S.vld(fn_ub[r, d]))
                            acc[1] = S.vld(fg_ub[r, d])
                            S.vmula(acc[1], og, nw)
                            S.vsts(fg_ub[r, d], acc[1])
                        S.vsts(ng_ub[d], S.vadd(S.vld(ng_ub[d]), acc[0]))
                T.copy(fg_ub, grad_fn[:, base : base + W])
                T.copy(ng_ub, grad_normw[base : base + W])

    return mhc_fn_normw_merge_backward_asc


BACKWARD = Kernel("mhc_fn_normw_merge_backward", MergeKey, build_mhc_fn_normw_merge_backward, derive=_key,
                  cases=_cases)


def mhc_fn_normw_merge_backward(fn, normw, grad_out_fn, grad_fn, grad_normw) -> None:
    """fn, grad_out_fn (M3,K) f32, normw (K,) f32; grad_fn (M3,K) and grad_normw (K,) f32 updated in
    place (+=). Current stream, no sync."""
    kernel = BACKWARD.compiled(BACKWARD.key(fn))
    kernel(fn, normw, grad_out_fn, grad_fn, grad_normw)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
