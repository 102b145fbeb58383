"""The Sinkhorn passes of a block of 64 tokens in vector registers (Ascend 950, m = 4), shared by the Sinkhorn
kernels (:mod:`.sinkhorn`) and the fused pre stage (:mod:`.pre_big_fuse`), so both run the same instructions (their
bitwise contract; the arithmetic: :mod:`.sinkhorn`'s docstring).

Layout: the (64, 16) block is transposed to "one register per matrix entry, one token per lane" with a four-round
``vdintlv`` network (:func:`soa_load`, back with ``vintlv``: :func:`soa_store`), so every row/column sum is three
plain vector adds over 64 tokens and no cross-lane operation is needed.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ..._kernel import public_names
from ._common import M, M2


@T.macro
def soa_load(y, tmp, src):
    """(64 tokens, 16) AoS tile -> y[e] = entry e of the 64 tokens (lane = token).

    Each round deinterleaves consecutive register pairs (a stable split of the 1024-element sequence
    by its lowest index bit); four rounds rotate the index bits by four, n = 16t + e -> 64e + t.
    """
    for k in T.unroll(M2, explicit=True):
        y[k] = S.vld(src[4 * k, 0])
    for _rnd in T.unroll(2, explicit=True):
        for j in T.unroll(8, explicit=True):
            ev, od = S.vdintlv(y[2 * j], y[2 * j + 1])
            tmp[j] = ev
            tmp[j + 8] = od
        for j in T.unroll(8, explicit=True):
            ev2, od2 = S.vdintlv(tmp[2 * j], tmp[2 * j + 1])
            y[j] = ev2
            y[j + 8] = od2


@T.macro
def soa_store(y, tmp, dst):
    """Inverse of :func:`soa_load` (four ``vintlv`` rounds), then 16 stores into the AoS tile."""
    for _rnd in T.unroll(2, explicit=True):
        for j in T.unroll(8, explicit=True):
            lo, hi = S.vintlv(y[j], y[j + 8])
            tmp[2 * j] = lo
            tmp[2 * j + 1] = hi
        for j in T.unroll(8, explicit=True):
            lo2, hi2 = S.vintlv(tmp[j], tmp[j + 8])
            y[2 * j] = lo2
            y[2 * j + 1] = hi2
    for k in T.unroll(M2, explicit=True):
        S.vsts(dst[4 * k, 0], y[k])


@T.macro
def softmax_rows(y):
    """y <- softmax over o of y[4i + o] (max-subtracted, exact division by the sum), in place."""
    for i in T.unroll(M, explicit=True):
        mx = S.vmax(S.vmax(S.vmax(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3])
        for o in T.unroll(M, explicit=True):
            y[4 * i + o] = S.vexpdif(y[4 * i + o], mx)
        ssum = S.vadd(S.vadd(S.vadd(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3])
        for o in T.unroll(M, explicit=True):
            y[4 * i + o] = S.vdiv(y[4 * i + o], ssum)


@T.macro
def norm_rows(y, eps):
    """y[4i + o] <- y[4i + o] / (sum_o y[4i + o] + eps)."""
    for i in T.unroll(M, explicit=True):
        d = S.vadds(S.vadd(S.vadd(S.vadd(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3]), eps)
        for o in T.unroll(M, explicit=True):
            y[4 * i + o] = S.vdiv(y[4 * i + o], d)


@T.macro
def norm_cols(y, eps):
    """y[4i + o] <- y[4i + o] / (sum_i y[4i + o] + eps)."""
    for o in T.unroll(M, explicit=True):
        d = S.vadds(S.vadd(S.vadd(S.vadd(y[o], y[4 + o]), y[8 + o]), y[12 + o]), eps)
        for i in T.unroll(M, explicit=True):
            y[4 * i + o] = S.vdiv(y[4 * i + o], d)


def sinkhorn_forward_vf(repeat: int):
    """``T.macro(in_ub, out_ub, eps)``: the Sinkhorn forward's VF on one (64, 16) logits block ``in_ub`` into
    ``out_ub``: row softmax, ``+eps``, column normalization, then ``repeat - 1`` (row, column) normalizations."""

    @T.macro
    def vf(in_ub, out_ub, eps):
        with T.SimdVF():
            y = S.alloc_local((M2,), T.float32)
            tmp = S.alloc_local((M2,), T.float32)
            soa_load(y, tmp, in_ub)
            softmax_rows(y)
            for e in T.unroll(M2, explicit=True):
                y[e] = S.vadds(y[e], eps)
            norm_cols(y, eps)
            for _r in T.serial(repeat - 1):
                norm_rows(y, eps)
                norm_cols(y, eps)
            soa_store(y, tmp, out_ub)

    return vf


__all__ = public_names(__name__)
