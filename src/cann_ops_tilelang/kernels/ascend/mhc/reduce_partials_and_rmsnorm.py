"""Ascend 950 kernels of ``mhc_reduce_partials_and_rmsnorm_forward`` / ``_backward``
(docs/ops/mhc.md#reduce_partials_and_rmsnorm), G = 1; forward M3 = 24, backward M3 <= 32, any number of
splits S.

``r = 1/sqrt(sq*(1/Rg) + eps)`` is the Ascend form of ``rsqrt(sq/Rg + eps)``: ``vmuls(sq, fp32(1/Rg))``,
``vadds(eps)``, ``vsqrt``, correctly rounded ``vdiv(1, .)``. Layouts (numerics and tails: :mod:`._per_token`):

* Forward: the (64, 24) block is 24 vectors in the compact token-major layout; the per-token ``r`` (one
  64-lane vector for the block) is spread over the mixes with ``vselr`` and a constant lane -> token
  table built once per core.
* Backward: rows padded to 32 floats in UB (two tokens per vector); the row sums ``rho`` come from
  ``vcgadd`` (8-lane group sums) and a two-round ``vdintlv`` transpose of the group sums.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._common import CASE_NUM_CORES, LANES, M3, require_m3, require_mixes
from ._per_token import SPLIT_SUMS, TokenPlan, rms_vf, split_sums, token_table_vf


_ROW_PAD = 32  # backward UB row of one token: M3 <= 32 floats, so two tokens per vector register
_SPLITS = limits.IntRange("n_splits", 1)


# Forward: eight splits per DMA (_per_token.SPLIT_SUMS, shared with the fused pre stage), ~134 KiB of UB at S = 16;
# the backward ~50 KiB (docs/perf/ascend950/mhc.md, 2026-11-30 — reduce_partials_and_rmsnorm: UB).
FORWARD_PLAN = SPLIT_SUMS
BACKWARD_PLAN = TokenPlan()


@compile_key
class ForwardKey:
    """Compile-time key of the forward: ``S = n_splits`` and the vector cores (never T; ``rms_group_size`` and
    ``rms_eps`` are runtime scalars)."""

    n_splits: int
    num_cores: int


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``M3`` and the vector cores."""

    mhc_mult3: int
    num_cores: int


def build_mhc_reduce_partials_and_rmsnorm_forward(n_splits: int, num_cores: int):
    """prim_func(out_mul_splitted (S,T,24) f32, sqrsum_splitted (S,T) f32, out_mul (T,24) f32,
    sqrsum (T,) f32, out (T,24) f32, inv_group f32 = fp32(1/Rg), rms_eps f32); T is a dynamic dim.

    ``sq = sum_s sq_s`` and ``om = sum_s om_s`` in split order (from 0: ``0 + v`` is ``v``),
    ``r = 1/sqrt(sq*inv_group + eps)``, ``out = om*r``.
    """
    S_ = _SPLITS.require("mhc_reduce_partials_and_rmsnorm_forward", int(n_splits))
    B, stages = FORWARD_PLAN.tokens, FORWARD_PLAN.stages
    NV = B * M3 // LANES  # 24 vectors per block in the compact layout
    SC = FORWARD_PLAN.split_chunk(S_)
    sums, rms, token_table = split_sums(B, S_, FORWARD_PLAN), rms_vf(NV), token_table_vf(NV)
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_reduce_partials_and_rmsnorm_forward_asc(
        out_mul_splitted: T.Tensor[(S_, num_tokens, M3), T.float32],
        sqrsum_splitted: T.Tensor[(S_, num_tokens), T.float32],
        out_mul: T.Tensor[(num_tokens, M3), T.float32],
        sqrsum: T.Tensor[(num_tokens,), T.float32],
        out: T.Tensor[(num_tokens, M3), T.float32],
        inv_group: T.float32,
        rms_eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            part_ub = T.alloc_shared((SC, B, M3), T.float32)
            sqp_ub = T.alloc_shared((SC, B), T.float32)
            acc_ub = T.alloc_shared((B, M3), T.float32)
            sq_ub = T.alloc_shared((B,), T.float32)
            out_ub = T.alloc_shared((B, M3), T.float32)
            tok_ub = T.alloc_shared((NV, LANES), T.int32)  # lane -> token of vector v
            T.annotate_buffer_versions(
                {part_ub: stages, sqp_ub: stages, acc_ub: stages, sq_ub: stages, out_ub: stages}
            )
            token_table(tok_ub)
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=stages):
                t0 = blk * B
                sums(out_mul_splitted, sqrsum_splitted, t0, part_ub, sqp_ub, acc_ub, sq_ub)
                rms(acc_ub, sq_ub, tok_ub, out_ub, inv_group, rms_eps)
                with T.Task():
                    T.copy(acc_ub, out_mul[t0 : t0 + B, :])
                    T.copy(sq_ub, sqrsum[t0 : t0 + B])
                    T.copy(out_ub, out[t0 : t0 + B, :])

    return mhc_reduce_partials_and_rmsnorm_forward_asc


# per-token kernels, independent of hidden_size and hc_mult: S = 1, 3 and 16 forward (M3 = 24)
FORWARD = Kernel("mhc_reduce_partials_and_rmsnorm_forward", ForwardKey, build_mhc_reduce_partials_and_rmsnorm_forward,
                 derive=lambda out_mul_splitted: ForwardKey(int(out_mul_splitted.shape[0]), int(num_vector_cores())),
                 cases=lambda hidden_size, hc_mult: {f"mhc_reduce_partials_and_rmsnorm_forward_s{s}": ForwardKey(
                     s, CASE_NUM_CORES) for s in (1, 3, 16)})


def mhc_reduce_partials_and_rmsnorm_forward(
    out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out, rms_group_size, rms_eps, n_splits
) -> None:
    """out_mul_splitted (S,T,1,24) f32, sqrsum_splitted (S,T,1) f32 -> out_mul (T,1,24), sqrsum (T,1),
    out (T,24) (all f32, written). G must be 1 and M3 24 (validated by the op layer). Current stream."""
    s, t = int(out_mul_splitted.shape[0]), int(out_mul_splitted.shape[1])
    m3 = require_m3("mhc_reduce_partials_and_rmsnorm_forward", out_mul_splitted.shape[-1])
    if s != int(n_splits):
        raise limits.LimitError(
            f"mhc_reduce_partials_and_rmsnorm_forward: out_mul_splitted holds {s} splits, n_splits is {n_splits}"
        )
    kernel = FORWARD.compiled(FORWARD.key(out_mul_splitted))
    kernel(
        out_mul_splitted.view(s, t, m3), sqrsum_splitted.view(s, t), out_mul.view(t, m3), sqrsum.view(t),
        out.view(t, m3), float(1.0 / int(rms_group_size)), float(rms_eps),
    )


def build_mhc_reduce_partials_and_rmsnorm_backward(mhc_mult3: int, num_cores: int):
    """prim_func(grad_out (T,M3) f32, out_mul (T,M3) f32, sqrsum (T,) f32, grad_out_mul (T,M3) f32,
    grad_sqrsum (T,) f32, inv_group f32 = fp32(1/Rg), rms_eps f32, eps_group f32 = fp32(eps*Rg)).

    ``r = 1/sqrt(sq*inv_group + eps)``, ``grad_out_mul = og*r``, ``rho = sum_j og*om``,
    ``grad_sqrsum = ((rho*r) / (sq + eps*Rg)) * -0.5`` (= -rho*r/(2(sq + eps*Rg)), the halving is exact).
    """
    # the M3 <= 32 mixes of a token fill half a vector
    M3 = require_mixes("mhc_reduce_partials_and_rmsnorm_backward", mhc_mult3, _ROW_PAD)
    B, stages = BACKWARD_PLAN.tokens, BACKWARD_PLAN.stages
    n_pairs = B // 2
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_reduce_partials_and_rmsnorm_backward_asc(
        grad_out: T.Tensor[(num_tokens, M3), T.float32],
        out_mul: T.Tensor[(num_tokens, M3), T.float32],
        sqrsum: T.Tensor[(num_tokens,), T.float32],
        grad_out_mul: T.Tensor[(num_tokens, M3), T.float32],
        grad_sqrsum: T.Tensor[(num_tokens,), T.float32],
        inv_group: T.float32,
        rms_eps: T.float32,
        eps_group: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            og_ub = T.alloc_shared((B, _ROW_PAD), T.float32)
            om_ub = T.alloc_shared((B, _ROW_PAD), T.float32)
            omg_ub = T.alloc_shared((B, _ROW_PAD), T.float32)
            sq_ub = T.alloc_shared((B,), T.float32)
            sqg_ub = T.alloc_shared((B,), T.float32)
            gs_ub = T.alloc_shared((4 * B,), T.float32)  # (token, 8-lane group) sums of og*om
            T.annotate_buffer_versions({og_ub: stages, om_ub: stages, omg_ub: stages, sq_ub: stages, sqg_ub: stages})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=stages):
                t0 = blk * B
                T.copy(grad_out[t0 : t0 + B, :], og_ub[:, 0:M3])
                T.copy(out_mul[t0 : t0 + B, :], om_ub[:, 0:M3])
                T.copy(sqrsum[t0 : t0 + B], sq_ub)
                with T.SimdVF():
                    one = S.vdup(1.0, T.float32)
                    vl8 = S.pset(32, "PAT_VL8")
                    lane = S.vci(0, T.int32)
                    half = S.vshrs(lane, 5)  # 0: token 2p, 1: token 2p + 1
                    col_ok = S.vcmps(S.vand(lane, S.vdup(_ROW_PAD - 1, T.int32)), M3, op="lt")
                    sq = S.vld(sq_ub[0])
                    r = S.vdiv(one, S.vsqrt(S.vadds(S.vmuls(sq, inv_group), rms_eps)))
                    for pr in T.unroll(n_pairs, explicit=True):
                        g = S.vld(og_ub[2 * pr, 0])
                        rp = S.vselr(r, S.vadds(half, 2 * pr))
                        S.vsts(omg_ub[2 * pr, 0], S.vmul(g, rp))
                        # padding lanes (column >= M3) are zeroed by the predicated multiply
                        prod = S.vmul(g, S.vld(om_ub[2 * pr, 0]), col_ok)
                        S.vsts(gs_ub[8 * pr], S.vcgadd(prod), vl8, extent=8)
                    S.mem_bar("VST_VLD")
                    # gs_ub[4t + k] = group k of token t; two deinterleave rounds give one register
                    # per group k with the 64 tokens in lane order.
                    e01, o01 = S.vdintlv(S.vld(gs_ub[0]), S.vld(gs_ub[LANES]))
                    e23, o23 = S.vdintlv(S.vld(gs_ub[2 * LANES]), S.vld(gs_ub[3 * LANES]))
                    g0, g2 = S.vdintlv(e01, e23)
                    g1, g3 = S.vdintlv(o01, o23)
                    rho = S.vadd(S.vadd(S.vadd(g0, g1), g2), g3)
                    den = S.vadds(sq, eps_group)
                    S.vsts(sqg_ub[0], S.vmuls(S.vdiv(S.vmul(rho, r), den), -0.5))
                with T.Task():
                    T.copy(omg_ub[:, 0:M3], grad_out_mul[t0 : t0 + B, :])
                    T.copy(sqg_ub, grad_sqrsum[t0 : t0 + B])

    return mhc_reduce_partials_and_rmsnorm_backward_asc


# the backward at M3 = 24 and at its largest M3, 32
BACKWARD = Kernel("mhc_reduce_partials_and_rmsnorm_backward", BackwardKey,
                  build_mhc_reduce_partials_and_rmsnorm_backward,
                  derive=lambda grad_out: BackwardKey(int(grad_out.shape[-1]), int(num_vector_cores())),
                  cases=lambda hidden_size, hc_mult: {f"mhc_reduce_partials_and_rmsnorm_backward_m3_{m3}": BackwardKey(
                      m3, CASE_NUM_CORES) for m3 in (24, 32)})


def mhc_reduce_partials_and_rmsnorm_backward(
    grad_out, out_mul, sqrsum, grad_out_mul, grad_sqrsum, rms_group_size, rms_eps
) -> None:
    """grad_out (T,M3), out_mul (T,1,M3), sqrsum (T,1) -> grad_out_mul (T,1,M3), grad_sqrsum (T,1)
    (all f32, written). G must be 1 and M3 <= 32. Current stream."""
    t, m3 = int(grad_out.shape[0]), int(grad_out.shape[-1])
    kernel = BACKWARD.compiled(BACKWARD.key(grad_out))
    group = int(rms_group_size)
    kernel(
        grad_out, out_mul.view(t, m3), sqrsum.view(t), grad_out_mul.view(t, m3), grad_sqrsum.view(t),
        float(1.0 / group), float(rms_eps), float(rms_eps) * group,
    )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
