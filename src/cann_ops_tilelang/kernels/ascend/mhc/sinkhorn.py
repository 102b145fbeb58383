"""Ascend 950 kernels of ``mhc_sinkhorn_forward`` / ``_backward`` (docs/ops/mhc.md#sinkhorn), m = 4.

The repeat count R is compile-time, in ``limits.MHC_SINKHORN_REPEAT["ascend"]`` (1..22: the backward
recomputes the forward from the logits and keeps every normalization's input and denominator in UB).
Sums run in index order ``((a0 + a1) + a2) + a3`` and every normalization is a correctly rounded division
by ``sum + eps`` (the first row normalization by the plain softmax sum); numerics shared with the other
per-token kernels: :mod:`._per_token`.

Layout: the (64, 16) block is transposed to "one register per matrix entry, one token per lane" with a
four-round ``vdintlv`` network (and back with ``vintlv``), so every row/column sum is three plain vector
adds over 64 tokens and no cross-lane operation is needed.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._common import CASE_NUM_CORES, LANES, M, M2, require_hc_mult
from ._per_token import TokenPlan
from ._sinkhorn import sinkhorn_forward_vf, soa_load, soa_store, softmax_rows


REPEAT = limits.MHC_SINKHORN_REPEAT["ascend"]
# alignment of the merged UB pool (every buffer version is 32-byte aligned) and the small staging
# buffers that the backward's UB estimate does not count
_SLACK = 4 * 1024

# 64-token blocks, two stages: 16 KiB of UB forward; the backward's UB grows with R up to 243 KiB at
# R = 22 (docs/perf/ascend950/mhc.md, 2026-11-30 — sinkhorn: backward UB and the repeat limit).
FORWARD_PLAN = TokenPlan()
BACKWARD_PLAN = TokenPlan()


def _check(where: str, matrix_shape, repeat) -> int:
    """R, after checking that the matrices are m x m with m = 4 and R is in the declared range."""
    require_hc_mult(where, matrix_shape[-1])
    require_hc_mult(where, matrix_shape[-2])
    return REPEAT.require(where, int(repeat))


@compile_key
class SinkhornKey:
    """Compile-time key of both kernels: the repeat count ``R`` and the vector cores (never the token count;
    eps is a runtime scalar)."""

    repeat: int
    num_cores: int


def _key(op: str, matrices, repeat) -> SinkhornKey:
    return SinkhornKey(_check(op, matrices.shape, repeat), int(num_vector_cores()))


def _cases(op: str):
    """R = 1, 10, 20 (per-token kernels, independent of ``hidden_size`` and ``hc_mult``)."""
    return lambda hidden_size, hc_mult: {f"{op}_r{r}": SinkhornKey(r, CASE_NUM_CORES) for r in (1, 10, 20)}


def build_mhc_sinkhorn_forward(repeat: int, num_cores: int):
    """prim_func(comb (T,16) f32 logits, comb_out (T,16) f32, eps f32); comb[t, 4i + o] = x[t, i, o].

    softmax over o (max-subtracted), +eps, column normalization, then R-1 times (row, column)
    normalizations with ``+eps`` denominators (docs/ops/mhc.md#sinkhorn). The matrices live in 16 + 16
    vector registers (entries, transpose scratch).
    """
    R = REPEAT.require("mhc_sinkhorn_forward", int(repeat))
    B, E, stages = FORWARD_PLAN.tokens, M2, FORWARD_PLAN.stages
    sinkhorn_vf = sinkhorn_forward_vf(R)
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_sinkhorn_forward_asc(
        comb: T.Tensor[(num_tokens, E), T.float32],
        comb_out: T.Tensor[(num_tokens, E), T.float32],
        eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            in_ub = T.alloc_shared((B, E), T.float32)
            out_ub = T.alloc_shared((B, E), T.float32)
            T.annotate_buffer_versions({in_ub: stages, out_ub: stages})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=stages):
                t0 = blk * B
                T.copy(comb[t0 : t0 + B, :], in_ub)
                sinkhorn_vf(in_ub, out_ub, eps)
                T.copy(out_ub, comb_out[t0 : t0 + B, :])

    return mhc_sinkhorn_forward_asc


FORWARD = Kernel("mhc_sinkhorn_forward", SinkhornKey, build_mhc_sinkhorn_forward, cases=_cases("mhc_sinkhorn_forward"),
                 derive=lambda comb, repeat: _key("mhc_sinkhorn_forward", comb, repeat))


def mhc_sinkhorn_forward(comb, comb_out, repeat, eps) -> None:
    """comb (T,4,4) f32 logits -> comb_out (T,4,4) f32 (written). Current stream."""
    kernel = FORWARD.compiled(FORWARD.key(comb, repeat))
    t = int(comb.shape[0])
    kernel(comb.view(t, M2), comb_out.view(t, M2), float(eps))


def mhc_sinkhorn_backward_ub_bytes(repeat: int) -> int:
    """UB estimate of the backward kernel: per normalization step (2R - 1 of them) 16 input and 4
    denominator vectors of the block, the softmax P, the three token tiles and slack; it fits the UB up
    to R = 22, the declared limit (docs/perf/ascend950/mhc.md, 2026-11-30 — sinkhorn: backward UB and
    the repeat limit)."""
    steps = 2 * int(repeat) - 1
    return steps * 20 * 256 + 16 * 256 + 3 * 4096 * BACKWARD_PLAN.stages + _SLACK


def mhc_sinkhorn_max_repeat() -> int:
    """Largest repeat count of the Ascend kernels: the high end of ``limits.MHC_SINKHORN_REPEAT["ascend"]``
    (22, the largest whose backward fits the UB; a lowering test checks that they agree)."""
    return REPEAT.high


def build_mhc_sinkhorn_backward(repeat: int, num_cores: int):
    """prim_func(grad_comb_out (T,16) f32, x (T,16) f32 logits, grad_comb (T,16) f32, eps f32).

    Recompute: P = softmax_row(x), U_1 = P + eps (column step), then R-1 x (row, column) steps; step
    n keeps its input U_n and its denominator Sigma_n + eps in UB (index s = n - 1: s = 0 column,
    odd s row, even s > 0 column). Backward, s = 2R-2 .. 0:
    ``g <- (g - sum_a(g*U_s) / d_s) / d_s``; then ``grad_comb = (g - sum_o g*P) * P``.
    """
    R = REPEAT.require("mhc_sinkhorn_backward", int(repeat))
    B, E, stages = BACKWARD_PLAN.tokens, M2, BACKWARD_PLAN.stages
    n_steps = 2 * R - 1
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_sinkhorn_backward_asc(
        grad_comb_out: T.Tensor[(num_tokens, E), T.float32],
        x: T.Tensor[(num_tokens, E), T.float32],
        grad_comb: T.Tensor[(num_tokens, E), T.float32],
        eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((B, E), T.float32)
            g_ub = T.alloc_shared((B, E), T.float32)
            gi_ub = T.alloc_shared((B, E), T.float32)
            u_ub = T.alloc_shared((n_steps, E, LANES), T.float32)  # U_n, SoA
            d_ub = T.alloc_shared((n_steps, M, LANES), T.float32)  # Sigma_n + eps per row/column
            p_ub = T.alloc_shared((E, LANES), T.float32)  # softmax P, SoA
            T.annotate_buffer_versions({x_ub: stages, g_ub: stages, gi_ub: stages})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=stages):
                t0 = blk * B
                T.copy(x[t0 : t0 + B, :], x_ub)
                T.copy(grad_comb_out[t0 : t0 + B, :], g_ub)
                with T.SimdVF():
                    y = S.alloc_local((E,), T.float32)
                    tmp = S.alloc_local((E,), T.float32)
                    # ---- recompute the forward, keeping every step's input and denominator ----
                    soa_load(y, tmp, x_ub)
                    softmax_rows(y)
                    for e in T.unroll(E, explicit=True):
                        S.vsts(p_ub[e, 0], y[e])
                        y[e] = S.vadds(y[e], eps)
                    for o in T.unroll(M, explicit=True):  # step s = 0: columns of U_1 = P + eps
                        dc = S.vadds(S.vadd(S.vadd(S.vadd(y[o], y[4 + o]), y[8 + o]), y[12 + o]), eps)
                        S.vsts(d_ub[0, o, 0], dc)
                        for i in T.unroll(M, explicit=True):
                            S.vsts(u_ub[0, 4 * i + o, 0], y[4 * i + o])
                            y[4 * i + o] = S.vdiv(y[4 * i + o], dc)
                    for r in T.serial(R - 1):
                        for i in T.unroll(M, explicit=True):  # step s = 2r + 1: rows
                            dr = S.vadds(S.vadd(S.vadd(S.vadd(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3]), eps)
                            S.vsts(d_ub[2 * r + 1, i, 0], dr)
                            for o in T.unroll(M, explicit=True):
                                S.vsts(u_ub[2 * r + 1, 4 * i + o, 0], y[4 * i + o])
                                y[4 * i + o] = S.vdiv(y[4 * i + o], dr)
                        for o in T.unroll(M, explicit=True):  # step s = 2r + 2: columns
                            dc2 = S.vadds(S.vadd(S.vadd(S.vadd(y[o], y[4 + o]), y[8 + o]), y[12 + o]), eps)
                            S.vsts(d_ub[2 * r + 2, o, 0], dc2)
                            for i in T.unroll(M, explicit=True):
                                S.vsts(u_ub[2 * r + 2, 4 * i + o, 0], y[4 * i + o])
                                y[4 * i + o] = S.vdiv(y[4 * i + o], dc2)
                    S.mem_bar("VST_VLD")
                    # ---- backward through the normalizations, last step first ----
                    soa_load(y, tmp, g_ub)
                    u = S.alloc_local((M,), T.float32)
                    for k in T.serial(R - 1):
                        sc = 2 * (R - 1 - k)  # column step s = 2r + 2 with r = R - 2 - k
                        for o in T.unroll(M, explicit=True):
                            for i in T.unroll(M, explicit=True):
                                u[i] = S.vld(u_ub[sc, 4 * i + o, 0])
                            tc = S.vadd(S.vadd(S.vadd(S.vmul(y[o], u[0]), S.vmul(y[4 + o], u[1])), S.vmul(y[8 + o], u[2])), S.vmul(y[12 + o], u[3]))
                            dc3 = S.vld(d_ub[sc, o, 0])
                            qc = S.vdiv(tc, dc3)
                            for i in T.unroll(M, explicit=True):
                                y[4 * i + o] = S.vdiv(S.vsub(y[4 * i + o], qc), dc3)
                        sr = sc - 1  # row step
                        for i in T.unroll(M, explicit=True):
                            for o in T.unroll(M, explicit=True):
                                u[o] = S.vld(u_ub[sr, 4 * i + o, 0])
                            tr = S.vadd(S.vadd(S.vadd(S.vmul(y[4 * i], u[0]), S.vmul(y[4 * i + 1], u[1])), S.vmul(y[4 * i + 2], u[2])), S.vmul(y[4 * i + 3], u[3]))
                            dr2 = S.vld(d_ub[sr, i, 0])
                            qr = S.vdiv(tr, dr2)
                            for o in T.unroll(M, explicit=True):
                                y[4 * i + o] = S.vdiv(S.vsub(y[4 * i + o], qr), dr2)
                    for o in T.unroll(M, explicit=True):  # step s = 0 (columns)
                        for i in T.unroll(M, explicit=True):
                            u[i] = S.vld(u_ub[0, 4 * i + o, 0])
                        t1 = S.vadd(S.vadd(S.vadd(S.vmul(y[o], u[0]), S.vmul(y[4 + o], u[1])), S.vmul(y[8 + o], u[2])), S.vmul(y[12 + o], u[3]))
                        d1 = S.vld(d_ub[0, o, 0])
                        q1 = S.vdiv(t1, d1)
                        for i in T.unroll(M, explicit=True):
                            y[4 * i + o] = S.vdiv(S.vsub(y[4 * i + o], q1), d1)
                    # softmax backward per row: (g - sum_o g*P) * P
                    for i in T.unroll(M, explicit=True):
                        for o in T.unroll(M, explicit=True):
                            u[o] = S.vld(p_ub[4 * i + o, 0])
                        ts = S.vadd(S.vadd(S.vadd(S.vmul(y[4 * i], u[0]), S.vmul(y[4 * i + 1], u[1])), S.vmul(y[4 * i + 2], u[2])), S.vmul(y[4 * i + 3], u[3]))
                        for o in T.unroll(M, explicit=True):
                            y[4 * i + o] = S.vmul(S.vsub(y[4 * i + o], ts), u[o])
                    soa_store(y, tmp, gi_ub)
                T.copy(gi_ub, grad_comb[t0 : t0 + B, :])

    return mhc_sinkhorn_backward_asc


BACKWARD = Kernel("mhc_sinkhorn_backward", SinkhornKey, build_mhc_sinkhorn_backward,
                  cases=_cases("mhc_sinkhorn_backward"),
                  derive=lambda x, repeat: _key("mhc_sinkhorn_backward", x, repeat))


def mhc_sinkhorn_backward(grad_comb_out, comb, grad_comb, repeat, eps) -> None:
    """grad_comb_out (T,4,4) f32, comb (T,4,4) f32 logits -> grad_comb (T,4,4) f32 (written). Current stream."""
    kernel = BACKWARD.compiled(BACKWARD.key(comb, repeat))
    t = int(comb.shape[0])
    kernel(grad_comb_out.view(t, M2), comb.view(t, M2), grad_comb.view(t, M2), float(eps))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
