"""Ascend 950 kernels of ``mhc_head_compute_mix_forward`` / ``_backward``
(docs/ops/mhc.md#head_compute_mix), m = 4.

``output_mix = sigma(x*scale + base[i]) + pre_eps``; the backward writes the caller's P partial rows of
the scale/base gradients (the caller sums them). Numerics and ragged tails: :mod:`._per_token`; the
blocks are read in their token-major layout (16 tokens x 4 per vector, ``vgather2`` of the base) and the
parameter-gradient partials accumulate per lane, reduced across lanes once per partial row.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._common import CASE_NUM_CORES, LANES, M, require_hc_mult
from ._per_token import CoresKey, TokenPlan, sigmoid, token_block_range, u32


_PARTIALS = limits.MHC_HEAD_MIX_PARTIALS["ascend"]

# Forward blocks of 128 tokens ((128, 4) f32 = 2 KiB, 8 vectors of 16 tokens), backward 64; two stages:
# 8 / ~7 KiB of UB (docs/perf/ascend950/mhc.md, 2026-11-30 — head_compute_mix: UB).
FORWARD_PLAN = TokenPlan(tokens=128)
BACKWARD_PLAN = TokenPlan()


def build_mhc_head_compute_mix_forward(hc_mult: int, num_cores: int):
    """prim_func(input_mix (T,4) f32, mhc_scale (1,) f32, mhc_base (4,) f32, output_mix (T,4) f32,
    pre_eps f32): ``output_mix = sigma(x*scale + base[i]) + pre_eps``."""
    require_hc_mult("mhc_head_compute_mix_forward", hc_mult)
    B, stages = FORWARD_PLAN.tokens, FORWARD_PLAN.stages
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_head_compute_mix_forward_asc(
        input_mix: T.Tensor[(num_tokens, M), T.float32],
        mhc_scale: T.Tensor[(1,), T.float32],
        mhc_base: T.Tensor[(M,), T.float32],
        output_mix: T.Tensor[(num_tokens, M), T.float32],
        pre_eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((LANES,), T.float32)
            x_ub = T.alloc_shared((B, M), T.float32)
            o_ub = T.alloc_shared((B, M), T.float32)
            T.annotate_buffer_versions({x_ub: stages, o_ub: stages})
            T.copy(mhc_scale[0:1], scale_ub[0:1])
            T.copy(mhc_base[0:M], base_ub[0:M])
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=stages):
                t0 = blk * B
                T.copy(input_mix[t0 : t0 + B, :], x_ub)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    one = S.vdup(1.0, T.float32)
                    c4 = S.vand(S.vci(0, T.int32), S.vdup(3, T.int32))
                    bv = S.vgather2(base_ub[0], u32(c4))
                    sv = S.vld(scale_ub[0], dist="BRC_B32")
                    for k in T.unroll(B * M // LANES, explicit=True):
                        z = S.vadd(S.vmul(S.vld(x_ub[16 * k, 0]), sv), bv)
                        S.vsts(o_ub[16 * k, 0], S.vadds(sigmoid(z, zero, one), pre_eps))
                T.copy(o_ub, output_mix[t0 : t0 + B, :])

    return mhc_head_compute_mix_forward_asc


FORWARD = Kernel(
    "mhc_head_compute_mix_forward", CoresKey, build_mhc_head_compute_mix_forward,
    derive=lambda input_mix: CoresKey(require_hc_mult("mhc_head_compute_mix_forward", input_mix.shape[-1]),
                                      int(num_vector_cores())),
    cases=lambda hidden_size, hc_mult: CoresKey(hc_mult, CASE_NUM_CORES))


def mhc_head_compute_mix_forward(input_mix, mhc_scale, mhc_base, output_mix, pre_eps) -> None:
    """input_mix (T,4) f32, mhc_scale (1,), mhc_base (4,) -> output_mix (T,4) f32 (written). Current stream."""
    kernel = FORWARD.compiled(FORWARD.key(input_mix))
    kernel(input_mix, mhc_scale, mhc_base, output_mix, float(pre_eps))


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``m``, ``P`` (rows of the caller's partial buffers), the vector cores."""

    hc_mult: int
    num_partials: int
    num_cores: int


def _backward_key(input_mix, grad_mhc_scale_partial) -> BackwardKey:
    require_hc_mult("mhc_head_compute_mix_backward", input_mix.shape[-1])
    return BackwardKey(M, int(grad_mhc_scale_partial.shape[0]), int(num_vector_cores()))


def _backward_cases(hidden_size: int, hc_mult: int) -> dict:
    """At P = one row per core and at P = 2 * cores + 3 (rows beyond the grid)."""
    cores = CASE_NUM_CORES
    return {f"mhc_head_compute_mix_backward_p{p}": BackwardKey(hc_mult, p, cores) for p in (cores, 2 * cores + 3)}


def build_mhc_head_compute_mix_backward(hc_mult: int, num_partials: int, num_cores: int):
    """prim_func(grad_output_mix (T,4), input_mix (T,4), mhc_scale (1,), mhc_base (4,),
    grad_input_mix (T,4), scale_partial (P,1), base_partial (P,4)); all f32.

    ``dz = g*(sigma*(1 - sigma))``, ``grad_input_mix = dz*scale``. Partial row p sums ``dz*x`` (scale)
    and ``dz`` per column (base) over the p-th contiguous range of 64-token blocks; the grid has
    ``G = min(P, cores)`` cores, core q owning rows q, q + G, ...; every row is written (zeros for an
    empty range).
    """
    require_hc_mult("mhc_head_compute_mix_backward", hc_mult)
    B, stages = BACKWARD_PLAN.tokens, BACKWARD_PLAN.stages
    P = _PARTIALS.require("mhc_head_compute_mix_backward", int(num_partials))
    G = max(1, min(P, int(num_cores)))
    rows_max = (P + G - 1) // G
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_head_compute_mix_backward_asc(
        grad_output_mix: T.Tensor[(num_tokens, M), T.float32],
        input_mix: T.Tensor[(num_tokens, M), T.float32],
        mhc_scale: T.Tensor[(1,), T.float32],
        mhc_base: T.Tensor[(M,), T.float32],
        grad_input_mix: T.Tensor[(num_tokens, M), T.float32],
        grad_mhc_scale_partial: T.Tensor[(P, 1), T.float32],
        grad_mhc_base_partial: T.Tensor[(P, M), T.float32],
    ):
        with T.Kernel(G) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((LANES,), T.float32)
            acc_ub = T.alloc_shared((2, LANES), T.float32)  # per-lane sums of dz*x, dz
            srow_ub = T.alloc_shared((8,), T.float32)
            brow_ub = T.alloc_shared((8,), T.float32)
            g_ub = T.alloc_shared((B, M), T.float32)
            x_ub = T.alloc_shared((B, M), T.float32)
            xg_ub = T.alloc_shared((B, M), T.float32)
            T.annotate_buffer_versions({g_ub: stages, x_ub: stages, xg_ub: stages})
            T.copy(mhc_scale[0:1], scale_ub[0:1])
            T.copy(mhc_base[0:M], base_ub[0:M])
            for i in T.serial(rows_max):
                p = core_id + i * G
                lo_p, hi_p = token_block_range(T.min(p, P - 1), P, num_tokens, B)
                lo = T.if_then_else(p < P, lo_p, 0)  # a core without a row p < P runs an empty range
                hi = T.if_then_else(p < P, hi_p, 0)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    S.vsts(acc_ub[0, 0], zero)
                    S.vsts(acc_ub[1, 0], zero)
                for blk in T.Pipelined(lo, hi, num_stages=stages):
                    t0 = blk * B
                    T.copy(grad_output_mix[t0 : t0 + B, :], g_ub)
                    T.copy(input_mix[t0 : t0 + B, :], x_ub)
                    with T.SimdVF():
                        zero = S.vdup(0.0, T.float32)
                        one = S.vdup(1.0, T.float32)
                        lane = S.vci(0, T.int32)
                        q4 = S.vshrs(lane, 2)
                        c4 = S.vand(lane, S.vdup(3, T.int32))
                        bv = S.vgather2(base_ub[0], u32(c4))
                        sv = S.vld(scale_ub[0], dist="BRC_B32")
                        valid = T.min(B, num_tokens - t0)
                        acc = S.alloc_local((2,), T.float32)
                        acc[0] = S.vld(acc_ub[0, 0])
                        acc[1] = S.vld(acc_ub[1, 0])
                        for k in T.unroll(B * M // LANES, explicit=True):
                            live = S.vcmps(q4, valid - 16 * k, op="lt")
                            xv = S.vld(x_ub[16 * k, 0])
                            sg = sigmoid(S.vadd(S.vmul(xv, sv), bv), zero, one)
                            dz = S.vmul(S.vld(g_ub[16 * k, 0]), S.vmul(sg, S.vsub(one, sg)))
                            S.vsts(xg_ub[16 * k, 0], S.vmul(dz, sv))
                            acc[0] = S.vadd(acc[0], S.vsel(S.vmul(dz, xv), zero, live))
                            acc[1] = S.vadd(acc[1], S.vsel(dz, zero, live))
                        S.vsts(acc_ub[0, 0], acc[0])
                        S.vsts(acc_ub[1, 0], acc[1])
                    T.copy(xg_ub, grad_input_mix[t0 : t0 + B, :])
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    lane = S.vci(0, T.int32)
                    c4 = S.vand(lane, S.vdup(3, T.int32))
                    ab = S.vld(acc_ub[1, 0])
                    brow = S.alloc_local((1,), T.float32)
                    brow[0] = zero
                    for j in T.unroll(M, explicit=True):
                        brow[0] = S.vsel(
                            S.vdupv(S.vcadd(S.vsel(ab, zero, S.vcmps(c4, j, op="eq")))), brow[0], S.vcmps(lane, j, op="eq")
                        )
                    S.vsts(brow_ub[0], brow[0], extent=8)
                    S.vsts(srow_ub[0], S.vcadd(S.vld(acc_ub[0, 0])), dist="ONEPT_B32")
                if rows_max * G == P or p < P:
                    with T.Task():
                        T.copy(srow_ub[0:1], grad_mhc_scale_partial[p, :])
                        T.copy(brow_ub[0:M], grad_mhc_base_partial[p, :])

    return mhc_head_compute_mix_backward_asc


BACKWARD = Kernel("mhc_head_compute_mix_backward", BackwardKey, build_mhc_head_compute_mix_backward,
                  derive=_backward_key, cases=_backward_cases)


def mhc_head_compute_mix_backward(
    grad_output_mix, input_mix, mhc_scale, mhc_base, grad_input_mix, grad_mhc_scale_partial, grad_mhc_base_partial
) -> None:
    """grad_output_mix (T,4), input_mix (T,4), scale (1,), base (4,) -> grad_input_mix (T,4) written and
    every row of grad_mhc_scale_partial (P,1) / grad_mhc_base_partial (P,4) written (the caller sums
    them). Current stream."""
    kernel = BACKWARD.compiled(BACKWARD.key(input_mix, grad_mhc_scale_partial))
    kernel(grad_output_mix, input_mix, mhc_scale, mhc_base, grad_input_mix, grad_mhc_scale_partial, grad_mhc_base_partial)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
