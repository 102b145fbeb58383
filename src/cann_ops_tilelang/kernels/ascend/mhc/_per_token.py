"""Helpers of the per-token mHC kernels (reduce + RMSNorm, split mixes, Sinkhorn, head mix), m = 4.

Numerics shared with the fused paths (``mhc_pre_big_fuse`` must use the same sequences to be bitwise
equal): every op is fp32; ``sigma(z) = 1/(1 + exp(0 - z))`` as ``vdiv(1, vadds(vexpdif(0, z), 1))``
(correctly rounded division); the affine map is ``z = x*scale + base`` with two roundings (``vmul`` then
``vadd``, no fused multiply-add). The kernels move whole token blocks with one contiguous DMA each way and
compute on 64-lane fp32 vectors. Ragged token tails: the DMA of the last block is clamped to the valid
rows by TileLang (lanes of absent tokens hold stale UB data, are computed but never stored) and
parameter-gradient accumulations mask them with a per-lane token predicate.

The forward stages that ``mhc_pre_big_fuse`` runs too are macros here, written once for both: the ordered split
sums (:func:`split_sums`), the RMS normalization with its lane -> token table (:func:`rms_vf`,
:func:`token_table_vf`) and the split mixes (:func:`split_mixes_vf`).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ..._kernel import compile_key, public_names
from ._common import LANES, M, M3

TOK = 64  # tokens per block of the per-token kernels: one lane per token in the SoA layouts


@dataclasses.dataclass(frozen=True)
class TokenPlan:
    """Pipeline of a per-token kernel: ``tokens`` per block, ``stages`` UB versions of the block tiles."""

    tokens: int = TOK
    stages: int = 2


@compile_key
class CoresKey:
    """Compile-time key of a per-token kernel of ``m = hc_mult`` on ``num_cores`` vector cores (never the token
    count)."""

    hc_mult: int
    num_cores: int


@dataclasses.dataclass(frozen=True)
class SplitSumPlan(TokenPlan):
    """The splits of one token block arrive in equal DMAs of at most ``max_splits_per_copy`` splits."""

    max_splits_per_copy: int = 8

    def split_chunk(self, n_splits: int) -> int:
        """Largest divisor of S that is <= ``max_splits_per_copy``: S/chunk equal DMAs per block."""
        for c in range(min(n_splits, self.max_splits_per_copy), 0, -1):
            if n_splits % c == 0:
                return c
        return 1


# Eight splits per DMA: S = 16 takes ~134 KiB of UB in the reduce forward (docs/perf/ascend950/mhc.md, 2026-11-30 —
# reduce_partials_and_rmsnorm: UB); the fused pre stage sums in the same chunks (from +0.0 when S > 8).
SPLIT_SUMS = SplitSumPlan()


def u32(v):
    """Reinterpret an int32 index vector as the uint32 offsets that gather/scatter take."""
    return T.reinterpret(v, "uint32x64")


def sigmoid(z, zero, one):
    """sigma(z) = 1/(1 + exp(0 - z)) (the formulation of every Ascend mHC kernel; the CUDA head-mix
    forward alone uses the MUFU exp and reciprocal)."""
    return S.vdiv(one, S.vadds(S.vexpdif(zero, z), 1.0))


def token_table_vf(nv: int):
    """``T.macro(tok_ub)``: the lane -> token table of the compact (64, 24) block of ``nv`` vectors: the token of
    element e = 64v + lane is floor(e/24) = ((e >> 3) * 171) >> 9 (exact for e < 1536), the multiply as shifts and
    adds."""

    @T.macro
    def vf(tok_ub):
        with T.SimdVF():
            lane = S.vci(0, T.int32)
            for v in T.unroll(nv, explicit=True):
                e8 = S.vshrs(S.vadds(lane, v * LANES), 3)
                p = S.vadd(S.vadd(S.vshls(e8, 7), S.vshls(e8, 5)), S.vadd(S.vshls(e8, 3), S.vadd(S.vshls(e8, 1), e8)))
                S.vsts(tok_ub[v, 0], S.vshrs(p, 9))

    return vf


def split_sums(block: int, n_splits: int, plan: SplitSumPlan = SPLIT_SUMS):
    """``T.macro(mul, sqrsum, t0, part_ub, sqp_ub, acc_ub, sq_ub)``: the ordered sums over the ``n_splits`` splits of
    the (S, T, 24) partials ``mul`` and (S, T) ``sqrsum`` for the ``block`` tokens from ``t0`` into ``acc_ub`` /
    ``sq_ub`` (the reduce forward's, in ``plan.split_chunk(S)``-split DMAs: from split 0 where one DMA takes them
    all, ``0 + v`` being ``v``; else from +0.0)."""
    sc = plan.split_chunk(n_splits)
    n_chunks = n_splits // sc
    nv = block * M3 // LANES  # 24 vectors per block in the compact layout

    @T.macro
    def sums(mul, sqrsum, t0, part_ub, sqp_ub, acc_ub, sq_ub):
        if n_chunks == 1:
            T.copy(mul[:, t0 : t0 + block, :], part_ub)
            T.copy(sqrsum[:, t0 : t0 + block], sqp_ub)
            with T.SimdVF():
                a = S.alloc_local((1,), T.float32)
                for v in T.unroll(nv, explicit=True):
                    a[0] = S.vld(part_ub[0, (v * LANES) // M3, (v * LANES) % M3])
                    for s in T.serial(1, sc):  # fixed order: s ascending
                        a[0] = S.vadd(a[0], S.vld(part_ub[s, (v * LANES) // M3, (v * LANES) % M3]))
                    S.vsts(acc_ub[(v * LANES) // M3, (v * LANES) % M3], a[0])
                a[0] = S.vld(sqp_ub[0, 0])
                for s in T.serial(1, sc):
                    a[0] = S.vadd(a[0], S.vld(sqp_ub[s, 0]))
                S.vsts(sq_ub[0], a[0])
        else:
            with T.SimdVF():
                zero = S.vdup(0.0, T.float32)
                for v in T.unroll(nv, explicit=True):
                    S.vsts(acc_ub[(v * LANES) // M3, (v * LANES) % M3], zero)
                S.vsts(sq_ub[0], zero)
            for c in T.serial(n_chunks):
                T.copy(mul[c * sc : c * sc + sc, t0 : t0 + block, :], part_ub)
                T.copy(sqrsum[c * sc : c * sc + sc, t0 : t0 + block], sqp_ub)
                with T.SimdVF():
                    a = S.alloc_local((1,), T.float32)
                    for v in T.unroll(nv, explicit=True):
                        a[0] = S.vld(acc_ub[(v * LANES) // M3, (v * LANES) % M3])
                        for s in T.serial(sc):  # fixed order: s ascending
                            a[0] = S.vadd(a[0], S.vld(part_ub[s, (v * LANES) // M3, (v * LANES) % M3]))
                        S.vsts(acc_ub[(v * LANES) // M3, (v * LANES) % M3], a[0])
                    a[0] = S.vld(sq_ub[0])
                    for s in T.serial(sc):
                        a[0] = S.vadd(a[0], S.vld(sqp_ub[s, 0]))
                    S.vsts(sq_ub[0], a[0])

    return sums


def rms_vf(nv: int):
    """``T.macro(acc_ub, sq_ub, tok_ub, out_ub, inv_group, rms_eps)``: ``r = 1/sqrt(sq*inv_group + eps)`` per token,
    spread over the ``nv`` vectors of the compact block by the lane -> token table, ``out = om*r``."""

    @T.macro
    def vf(acc_ub, sq_ub, tok_ub, out_ub, inv_group, rms_eps):
        with T.SimdVF():
            one = S.vdup(1.0, T.float32)
            r = S.vdiv(one, S.vsqrt(S.vadds(S.vmuls(S.vld(sq_ub[0]), inv_group), rms_eps)))
            for v in T.unroll(nv, explicit=True):
                om = S.vld(acc_ub[(v * LANES) // M3, (v * LANES) % M3])
                rv = S.vselr(r, S.vld(tok_ub[v, 0]))
                S.vsts(out_ub[(v * LANES) // M3, (v * LANES) % M3], S.vmul(om, rv))

    return vf


def split_mixes_vf(block: int):
    """``T.macro(x_ub, scale_ub, base_ub, pre_ub, post_ub, comb_ub, post_mult_value, pre_eps)``: the split mixes of a
    (``block``, 24) mixes tile ``x_ub``, read with ``vgather2`` straight into the pre/post layouts (4 vectors of 16
    tokens x 4) and the comb layout (16 vectors of 4 tokens x 16): ``z = x*scale + base``, pre = sigma(z) + pre_eps,
    post = sigma(z)*post_mult_value, comb = z."""

    @T.macro
    def vf(x_ub, scale_ub, base_ub, pre_ub, post_ub, comb_ub, post_mult_value, pre_eps):
        with T.SimdVF():
            zero = S.vdup(0.0, T.float32)
            one = S.vdup(1.0, T.float32)
            lane = S.vci(0, T.int32)
            q4 = S.vshrs(lane, 2)
            c4 = S.vand(lane, S.vdup(3, T.int32))
            q16 = S.vshrs(lane, 4)
            c16 = S.vand(lane, S.vdup(15, T.int32))
            src4 = S.vadd(S.vadd(S.vshls(q4, 4), S.vshls(q4, 3)), c4)  # 24*(l//4) + l%4
            src16 = S.vadd(S.vadd(S.vshls(q16, 4), S.vshls(q16, 3)), S.vadds(c16, 2 * M))
            base_pre = S.vgather2(base_ub[0], u32(c4))
            base_post = S.vgather2(base_ub[0], u32(S.vadds(c4, M)))
            base_comb = S.vgather2(base_ub[0], u32(S.vadds(c16, 2 * M)))
            s_pre = S.vld(scale_ub[0], dist="BRC_B32")
            s_post = S.vld(scale_ub[1], dist="BRC_B32")
            s_comb = S.vld(scale_ub[2], dist="BRC_B32")
            for k in T.unroll(block // 16, explicit=True):
                xp = S.vgather2(x_ub[0, 0], u32(S.vadds(src4, 16 * M3 * k)))
                zp = S.vadd(S.vmul(xp, s_pre), base_pre)
                S.vsts(pre_ub[16 * k, 0], S.vadds(sigmoid(zp, zero, one), pre_eps))
                xq = S.vgather2(x_ub[0, 0], u32(S.vadds(src4, 16 * M3 * k + M)))
                zq = S.vadd(S.vmul(xq, s_post), base_post)
                S.vsts(post_ub[16 * k, 0], S.vmuls(sigmoid(zq, zero, one), post_mult_value))
            for k in T.unroll(block // 4, explicit=True):
                xc = S.vgather2(x_ub[0, 0], u32(S.vadds(src16, 4 * M3 * k)))
                S.vsts(comb_ub[4 * k, 0], S.vadd(S.vmul(xc, s_comb), base_comb))

    return vf


def token_block_range(p, num_parts, num_tokens, block):
    """Token blocks [lo, hi) of partial row p: the ceil(T/block) blocks split into num_parts contiguous,
    balanced ranges (fixed for a given T and P, so the partials are deterministic)."""
    n_blk = T.ceildiv(num_tokens, block)
    return (p * n_blk) // num_parts, ((p + 1) * n_blk) // num_parts


__all__ = public_names(__name__)
