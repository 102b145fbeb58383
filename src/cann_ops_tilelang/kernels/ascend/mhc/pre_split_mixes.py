"""Ascend 950 kernels of ``mhc_pre_split_mixes_forward`` / ``_backward`` (docs/ops/mhc.md#pre_split_mixes),
m = 4.

The backward writes deterministic per-core partials of the scale/base gradients, then a one-core kernel
sums them in core order and overwrites ``grad_mhc_scale`` / ``grad_mhc_base``. Numerics and ragged
tails: :mod:`._per_token`.

Layouts: the (64, 24) input block is read with ``vgather2`` straight into the layouts of the pre/post
outputs (4 vectors of 16 tokens x 4: lane l -> token 16k + l//4, column l%4) and the comb output (16
vectors of 4 tokens x 16: lane l -> token 4k + l//16, column l%16); the source offset in the input block
is 24*token + column (+4 post, +8 comb). The backward scatters ``dz*scale`` back with ``vscatter``.
Parameter-gradient partials accumulate per lane and are reduced across lanes once per partial row.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._common import CASE_NUM_CORES, LANES, M, M2, M3, require_hc_mult, require_m3, require_mixes
from ._per_token import CoresKey, TokenPlan, sigmoid, split_mixes_vf, token_block_range, u32


# Partial-row layout of the backward (one 256-byte row per vector core):
# columns [0, M3) = base gradient, [32, 35) = scale gradient, the rest zero.
_SPLIT_ROW = 64
_SPLIT_SCALE_COL = 32
_PARTIALS = limits.IntRange("num_partials", 1)

# 64-token blocks, two stages: < 26 KiB of UB forward, ~41 KiB backward
# (docs/perf/ascend950/mhc.md, 2026-11-30 — pre_split_mixes: UB).
FORWARD_PLAN = TokenPlan()
BACKWARD_PLAN = TokenPlan()


def _key(op: str, input_mixes) -> CoresKey:
    """m = 4 (the mixes' M3 = 24 checked) on the launch's vector cores: one partial row per core backward."""
    require_m3(op, input_mixes.shape[-1])
    return CoresKey(M, int(num_vector_cores()))


def _cases(hidden_size: int, hc_mult: int) -> CoresKey:
    return CoresKey(hc_mult, CASE_NUM_CORES)


def build_mhc_pre_split_mixes_forward(hc_mult: int, num_cores: int):
    """prim_func(input_mixes (T,24) f32, mhc_scale (3,) f32, mhc_base (24,) f32, pre (T,4) f32,
    post (T,4) f32, comb (T,16) f32, post_mult_value f32, pre_eps f32).

    ``z = x*scale[seg] + base``; pre = sigma(z) + pre_eps, post = sigma(z)*post_mult_value, comb = z.
    """
    require_hc_mult("mhc_pre_split_mixes_forward", hc_mult)
    B, stages = FORWARD_PLAN.tokens, FORWARD_PLAN.stages
    split_mixes = split_mixes_vf(B)
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_split_mixes_forward_asc(
        input_mixes: T.Tensor[(num_tokens, M3), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(M3,), T.float32],
        pre: T.Tensor[(num_tokens, M), T.float32],
        post: T.Tensor[(num_tokens, M), T.float32],
        comb: T.Tensor[(num_tokens, M2), T.float32],
        post_mult_value: T.float32,
        pre_eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((LANES,), T.float32)
            x_ub = T.alloc_shared((B, M3), T.float32)
            pre_ub = T.alloc_shared((B, M), T.float32)
            post_ub = T.alloc_shared((B, M), T.float32)
            comb_ub = T.alloc_shared((B, M2), T.float32)
            T.annotate_buffer_versions({x_ub: stages, pre_ub: stages, post_ub: stages, comb_ub: stages})
            T.copy(mhc_scale[0:3], scale_ub[0:3])
            T.copy(mhc_base[0:M3], base_ub[0:M3])
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=stages):
                t0 = blk * B
                T.copy(input_mixes[t0 : t0 + B, :], x_ub)
                split_mixes(x_ub, scale_ub, base_ub, pre_ub, post_ub, comb_ub, post_mult_value, pre_eps)
                with T.Task():
                    T.copy(pre_ub, pre[t0 : t0 + B, :])
                    T.copy(post_ub, post[t0 : t0 + B, :])
                    T.copy(comb_ub, comb[t0 : t0 + B, :])

    return mhc_pre_split_mixes_forward_asc


FORWARD = Kernel("mhc_pre_split_mixes_forward", CoresKey, build_mhc_pre_split_mixes_forward, cases=_cases,
                 derive=lambda input_mixes: _key("mhc_pre_split_mixes_forward", input_mixes))


def mhc_pre_split_mixes_forward(input_mixes, mhc_scale, mhc_base, pre, post, comb, post_mult_value, pre_eps) -> None:
    """input_mixes (T,24) f32, mhc_scale (3,), mhc_base (24,) -> pre (T,4), post (T,4), comb (T,16) f32
    (written). Current stream."""
    kernel = FORWARD.compiled(FORWARD.key(input_mixes))
    t = int(input_mixes.shape[0])
    kernel(input_mixes, mhc_scale, mhc_base, pre, post, comb.view(t, M2), float(post_mult_value), float(pre_eps))


def build_mhc_pre_split_mixes_backward(hc_mult: int, num_cores: int):
    """prim_func(grad_pre (T,4), grad_post (T,4), grad_comb (T,16), input_mixes (T,24), post (T,4),
    mhc_scale (3,), mhc_base (24,), grad_input_mixes (T,24), partial (P,64), post_mult_value f32); all
    f32, P = num_cores.

    Core p owns the p-th contiguous range of 64-token blocks and writes partial row p:
    ``[0, 24)`` = sum_t dz, ``[32, 35)`` = sum_t sum_{j in seg} dz*x, other columns 0.
    """
    require_hc_mult("mhc_pre_split_mixes_backward", hc_mult)
    B, stages = BACKWARD_PLAN.tokens, BACKWARD_PLAN.stages
    P = _PARTIALS.require("mhc_pre_split_mixes_backward", int(num_cores))
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_split_mixes_backward_asc(
        grad_pre: T.Tensor[(num_tokens, M), T.float32],
        grad_post: T.Tensor[(num_tokens, M), T.float32],
        grad_comb: T.Tensor[(num_tokens, M2), T.float32],
        input_mixes: T.Tensor[(num_tokens, M3), T.float32],
        post: T.Tensor[(num_tokens, M), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(M3,), T.float32],
        grad_input_mixes: T.Tensor[(num_tokens, M3), T.float32],
        partial: T.Tensor[(P, _SPLIT_ROW), T.float32],
        post_mult_value: T.float32,
    ):
        with T.Kernel(P) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((LANES,), T.float32)
            acc_ub = T.alloc_shared((6, LANES), T.float32)  # per-lane sums: dz (pre, post, comb), dz*x (same)
            row_ub = T.alloc_shared((_SPLIT_ROW,), T.float32)
            pg_ub = T.alloc_shared((B, M), T.float32)
            qg_ub = T.alloc_shared((B, M), T.float32)
            cg_ub = T.alloc_shared((B, M2), T.float32)
            x_ub = T.alloc_shared((B, M3), T.float32)
            po_ub = T.alloc_shared((B, M), T.float32)
            xg_ub = T.alloc_shared((B, M3), T.float32)
            T.annotate_buffer_versions(
                {pg_ub: stages, qg_ub: stages, cg_ub: stages, x_ub: stages, po_ub: stages, xg_ub: stages}
            )
            T.copy(mhc_scale[0:3], scale_ub[0:3])
            T.copy(mhc_base[0:M3], base_ub[0:M3])
            with T.SimdVF():
                zero = S.vdup(0.0, T.float32)
                for a in T.unroll(6, explicit=True):
                    S.vsts(acc_ub[a, 0], zero)
            lo, hi = token_block_range(core_id, P, num_tokens, B)
            for blk in T.Pipelined(lo, hi, num_stages=stages):
                t0 = blk * B
                T.copy(grad_pre[t0 : t0 + B, :], pg_ub)
                T.copy(grad_post[t0 : t0 + B, :], qg_ub)
                T.copy(grad_comb[t0 : t0 + B, :], cg_ub)
                T.copy(input_mixes[t0 : t0 + B, :], x_ub)
                T.copy(post[t0 : t0 + B, :], po_ub)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    one = S.vdup(1.0, T.float32)
                    pmv = S.vdup(post_mult_value, T.float32)
                    lane = S.vci(0, T.int32)
                    q4 = S.vshrs(lane, 2)
                    c4 = S.vand(lane, S.vdup(3, T.int32))
                    q16 = S.vshrs(lane, 4)
                    c16 = S.vand(lane, S.vdup(15, T.int32))
                    src4 = S.vadd(S.vadd(S.vshls(q4, 4), S.vshls(q4, 3)), c4)
                    src16 = S.vadd(S.vadd(S.vshls(q16, 4), S.vshls(q16, 3)), S.vadds(c16, 2 * M))
                    base_pre = S.vgather2(base_ub[0], u32(c4))
                    s_pre = S.vld(scale_ub[0], dist="BRC_B32")
                    s_post = S.vld(scale_ub[1], dist="BRC_B32")
                    s_comb = S.vld(scale_ub[2], dist="BRC_B32")
                    valid = T.min(B, num_tokens - t0)
                    acc = S.alloc_local((6,), T.float32)
                    for a in T.unroll(6, explicit=True):
                        acc[a] = S.vld(acc_ub[a, 0])
                    for k in T.unroll(B // 16, explicit=True):
                        live = S.vcmps(q4, valid - 16 * k, op="lt")  # lanes of tokens < T
                        off_pre = S.vadds(src4, 16 * M3 * k)
                        off_post = S.vadds(src4, 16 * M3 * k + M)
                        xp = S.vgather2(x_ub[0, 0], u32(off_pre))
                        sg = sigmoid(S.vadd(S.vmul(xp, s_pre), base_pre), zero, one)
                        dzp = S.vmul(S.vld(pg_ub[16 * k, 0]), S.vmul(sg, S.vsub(one, sg)))
                        S.vscatter(S.vmul(dzp, s_pre), xg_ub[0, 0], u32(off_pre))
                        acc[0] = S.vadd(acc[0], S.vsel(dzp, zero, live))
                        acc[3] = S.vadd(acc[3], S.vsel(S.vmul(dzp, xp), zero, live))
                        xq = S.vgather2(x_ub[0, 0], u32(off_post))
                        pv = S.vld(po_ub[16 * k, 0])
                        dzq = S.vmul(S.vmul(S.vld(qg_ub[16 * k, 0]), pv), S.vsub(one, S.vdiv(pv, pmv)))
                        S.vscatter(S.vmul(dzq, s_post), xg_ub[0, 0], u32(off_post))
                        acc[1] = S.vadd(acc[1], S.vsel(dzq, zero, live))
                        acc[4] = S.vadd(acc[4], S.vsel(S.vmul(dzq, xq), zero, live))
                    for k in T.unroll(B // 4, explicit=True):
                        live = S.vcmps(q16, valid - 4 * k, op="lt")
                        off_comb = S.vadds(src16, 4 * M3 * k)
                        xc = S.vgather2(x_ub[0, 0], u32(off_comb))
                        dzc = S.vld(cg_ub[4 * k, 0])
                        S.vscatter(S.vmul(dzc, s_comb), xg_ub[0, 0], u32(off_comb))
                        acc[2] = S.vadd(acc[2], S.vsel(dzc, zero, live))
                        acc[5] = S.vadd(acc[5], S.vsel(S.vmul(dzc, xc), zero, live))
                    for a in T.unroll(6, explicit=True):
                        S.vsts(acc_ub[a, 0], acc[a])
                T.copy(xg_ub, grad_input_mixes[t0 : t0 + B, :])
            # lane reduction of the six accumulators into the partial row
            with T.SimdVF():
                zero = S.vdup(0.0, T.float32)
                lane = S.vci(0, T.int32)
                c4 = S.vand(lane, S.vdup(3, T.int32))
                c16 = S.vand(lane, S.vdup(15, T.int32))
                row = S.alloc_local((1,), T.float32)
                row[0] = zero
                a_pre = S.vld(acc_ub[0, 0])
                a_post = S.vld(acc_ub[1, 0])
                a_comb = S.vld(acc_ub[2, 0])
                for j in T.unroll(M, explicit=True):
                    sel = S.vcmps(c4, j, op="eq")
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vsel(a_pre, zero, sel))), row[0], S.vcmps(lane, j, op="eq"))
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vsel(a_post, zero, sel))), row[0], S.vcmps(lane, M + j, op="eq"))
                for j in T.unroll(M2, explicit=True):
                    sel = S.vcmps(c16, j, op="eq")
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vsel(a_comb, zero, sel))), row[0], S.vcmps(lane, 2 * M + j, op="eq"))
                for c in T.unroll(3, explicit=True):
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vld(acc_ub[3 + c, 0]))), row[0], S.vcmps(lane, _SPLIT_SCALE_COL + c, op="eq"))
                S.vsts(row_ub[0], row[0])
            T.copy(row_ub, partial[core_id, :])

    return mhc_pre_split_mixes_backward_asc


def build_mhc_pre_split_mixes_backward_reduce(num_partials: int, mhc_mult3: int = M3):
    """prim_func(partial (P,64) f32, grad_mhc_scale (3,) f32, grad_mhc_base (M3,) f32): one core sums
    the P rows in row order (p = 0, 1, ...) and overwrites both gradients."""
    where = "mhc_pre_split_mixes_backward_reduce"
    P = _PARTIALS.require(where, int(num_partials))
    M3 = require_mixes(where, mhc_mult3, _SPLIT_SCALE_COL)  # the base gradient columns precede the scale's

    @T.prim_func
    def mhc_pre_split_mixes_backward_reduce_asc(
        partial: T.Tensor[(P, _SPLIT_ROW), T.float32],
        grad_mhc_scale: T.Tensor[(3,), T.float32],
        grad_mhc_base: T.Tensor[(M3,), T.float32],
    ):
        with T.Kernel(1) as _core:
            part_ub = T.alloc_shared((P, _SPLIT_ROW), T.float32)
            sum_ub = T.alloc_shared((_SPLIT_ROW,), T.float32)
            T.copy(partial, part_ub)
            with T.SimdVF():
                s = S.alloc_local((1,), T.float32)
                s[0] = S.vld(part_ub[0, 0])
                for p in T.serial(1, P):  # fixed order: p ascending
                    s[0] = S.vadd(s[0], S.vld(part_ub[p, 0]))
                S.vsts(sum_ub[0], s[0])
            with T.Task():
                T.copy(sum_ub[0:M3], grad_mhc_base[0:M3])
                T.copy(sum_ub[_SPLIT_SCALE_COL : _SPLIT_SCALE_COL + 3], grad_mhc_scale[0:3])

    return mhc_pre_split_mixes_backward_reduce_asc


BACKWARD = Kernel("mhc_pre_split_mixes_backward", CoresKey, build_mhc_pre_split_mixes_backward, cases=_cases,
                  derive=lambda input_mixes: _key("mhc_pre_split_mixes_backward", input_mixes))


@compile_key
class ReduceKey:
    """Compile-time key of the backward's reduction: ``P = num_partials`` partial rows of ``M3`` mixes."""

    num_partials: int
    mhc_mult3: int


# the backward's reduction, with its launch's P = num_cores partial rows (its key from the backward's launcher)
BACKWARD_REDUCE = Kernel("mhc_pre_split_mixes_backward_reduce", ReduceKey, build_mhc_pre_split_mixes_backward_reduce,
                         cases=lambda hidden_size, hc_mult: ReduceKey(CASE_NUM_CORES, M3))


def mhc_pre_split_mixes_backward(
    grad_pre, grad_post, grad_comb, input_mixes, post, mhc_scale, mhc_base,
    grad_input_mixes, grad_mhc_scale, grad_mhc_base, post_mult_value,
) -> None:
    """Grads (T,4), (T,4), (T,16), input_mixes (T,24), post (T,4), scale (3,), base (24,) -> grad_input_mixes
    (T,24) written; grad_mhc_scale (3,) and grad_mhc_base (24,) overwritten (deterministic: per-core
    partials over fixed token ranges, then a fixed-order sum). Two launches on the current stream."""
    import torch

    key = BACKWARD.key(input_mixes)
    kernel = BACKWARD.compiled(key)
    P = key.num_cores
    partial = torch.empty((P, _SPLIT_ROW), dtype=torch.float32, device=input_mixes.device)
    t = int(input_mixes.shape[0])
    kernel(
        grad_pre.view(t, M), grad_post.view(t, M), grad_comb.view(t, M2), input_mixes, post.view(t, M),
        mhc_scale, mhc_base, grad_input_mixes, partial, float(post_mult_value),
    )
    BACKWARD_REDUCE.compiled(ReduceKey(P, M3))(partial, grad_mhc_scale, grad_mhc_base)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD, BACKWARD_REDUCE)
