"""Helpers of the bandwidth-bound mHC streaming kernels (expand, pre apply mix, post), m = 4.

Common scheme: a persistent loop over (token, hidden tile) tasks (``T.Persistent`` with multi-buffered
UB tiles so the GM->UB loads of task n+1 and the UB->GM stores of task n-1 overlap the vector math of
task n); bf16 loads are widened to fp32 64 lanes at a time (``UNPK_B16`` + ``vcvt``), all arithmetic is
fp32, and each output is rounded to bf16 once at the store (``PK_B32``). Chains written "a + b*c" use the
fused multiply-add ``vmula`` (one rounding); a sum "sum_i a_i*b_i" starts with the product ``vmul`` of
term 0 (``0 + p`` is ``p``) and adds terms 1.. with ``vmula`` in ascending order. Reductions over the
hidden dimension (grad_mix, grad_post, grad_comb) are owned by one task per token (no atomics, deterministic):
64-lane partial sums accumulated across the hidden tiles of the token, then one lane reduction.

The forwards' vector functions that the fused kernels (``mhc_pre_big_fuse``, ``mhc_multilayer_recompute``) run as
well are written once here: :func:`apply_mix_vf` and :func:`post_vf`.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ..._kernel import compile_key, public_names
from .. import _build
from ._common import CASE_NUM_CORES, LANES, require_streams_and_hidden

PAD = 8  # small per-token vectors (mix, post) padded to one 32-byte DMA block of fp32
# 32-byte alignment of every buffer version in the merged UB pool and the small per-token buffers (mix,
# accumulators) that the tile formulas do not count
SLACK = 8 * 1024


def mhc_streaming_hidden_tile(hidden_size: int, bytes_per_column: int, stages: int) -> int:
    """Largest hidden tile ``h_blk`` (a divisor of H, multiple of 64) with
    ``stages * bytes_per_column * h_blk <= UB budget - 8 KiB``.

    ``bytes_per_column`` is the UB bytes one hidden column costs in one pipeline stage (sum over the
    multi-buffered tiles of the kernel). Tiles are divisors of H so that no task has a column tail.
    """
    H = limits.MHC_HIDDEN.require("mhc_streaming_hidden_tile", int(hidden_size))
    limit = _build.UB_BUDGET_BYTES - SLACK
    for blk in range(H, 0, -LANES):
        if H % blk == 0 and stages * bytes_per_column * blk <= limit:
            return blk
    raise ValueError(f"H={H}: no hidden tile of {bytes_per_column} bytes per column x {stages} stages fits the UB")


@dataclasses.dataclass(frozen=True)
class StreamingPlan:
    """Pipeline of a streaming kernel: ``stages`` UB versions of every tile (loads of the next task and
    stores of the previous one overlap the math of this one)."""

    stages: int

    def hidden_tile(self, hidden_size: int, bytes_per_column: int) -> int:
        """The hidden tile of a kernel whose tiles cost ``bytes_per_column`` per column and stage."""
        return mhc_streaming_hidden_tile(hidden_size, bytes_per_column, self.stages)


@compile_key
class StreamKey:
    """Compile-time key of a streaming kernel: ``H``, ``m`` and the vector cores of its persistent grid (never
    the token count)."""

    hidden_size: int
    hc_mult: int
    num_cores: int


def stream_key(hidden_size, hc_mult, num_cores) -> StreamKey:
    """The :class:`StreamKey` of a launch (its builder checks the ranges)."""
    return StreamKey(int(hidden_size), int(hc_mult), int(num_cores))


def stream_cases(hidden_size: int, hc_mult: int) -> StreamKey:
    """The lowering case of a streaming kernel at ``hidden_size``: the Ascend 950's vector cores."""
    return StreamKey(hidden_size, hc_mult, CASE_NUM_CORES)


def check(where: str, hidden_size: int, hc_mult: int) -> tuple[int, int]:
    """(H, m) of a streaming kernel, in the declared ranges (else :class:`LimitError`)."""
    return require_streams_and_hidden(where, hidden_size, hc_mult)


def bf16_to_f32(ref):
    return S.vcvt(S.vld(ref, dist="UNPK_B16"), T.float32, part=0)


def to_bf16(value):
    return S.vcvt(value, T.bfloat16)


def apply_mix_vf(hc_mult: int, n_chunks: int):
    """``T.macro(x_ub, mix_ub, tok, o_ub)``: the VF of the apply-mix forward on one hidden tile of ``n_chunks``
    64-column chunks, ``o = bf16(sum_i mix_i * f32(x_i))``: ``vmul`` of i = 0, then ``vmula`` for i ascending, one
    rounding to bf16 at the store. The weights are ``mix_ub[i]`` (``tok`` None) or ``mix_ub[tok, i]`` (the
    parameter keeps the name of the fused kernel's token variable, which the generated source may take from it)."""
    m = hc_mult

    @T.macro
    def vf(x_ub, mix_ub, tok, o_ub):
        with T.SimdVF():
            w = S.alloc_local((m,), T.float32)
            for i in T.unroll(m, explicit=True):
                if tok is None:
                    w[i] = S.vld(mix_ub[i], dist="BRC_B32")
                else:
                    w[i] = S.vld(mix_ub[tok, i], dist="BRC_B32")
            acc = S.alloc_local((1,), T.float32)
            for c in T.serial(n_chunks):
                d = c * LANES
                acc[0] = S.vmul(bf16_to_f32(x_ub[0, d]), w[0])
                for i in T.unroll(1, m, explicit=True):
                    S.vmula(acc[0], bf16_to_f32(x_ub[i, d]), w[i])
                S.vsts(o_ub[d], to_bf16(acc[0]), dist="PK_B32")

    return vf


def post_vf(hc_mult: int, n_chunks: int):
    """``T.macro(x_ub, res_ub, post_ub, comb_ub, out_ub)``: the VF of the post forward on one hidden tile of
    ``n_chunks`` 64-column chunks, ``out[o] = bf16(post[o]*x + sum_i comb[i,o]*res[i])``: ``vmul`` of the post
    term, then ``vmula`` for i ascending (the instruction sequence every bit-exact Ascend path repeats)."""
    m = hc_mult

    @T.macro
    def vf(x_ub, res_ub, post_ub, comb_ub, out_ub):
        with T.SimdVF():
            pw = S.alloc_local((m,), T.float32)
            cw = S.alloc_local((m * m,), T.float32)
            for o in T.unroll(m, explicit=True):
                pw[o] = S.vld(post_ub[o], dist="BRC_B32")
            for i in T.unroll(m, explicit=True):
                for o in T.unroll(m, explicit=True):
                    cw[i * m + o] = S.vld(comb_ub[i, o], dist="BRC_B32")
            rf = S.alloc_local((m,), T.float32)
            acc = S.alloc_local((m,), T.float32)
            for c in T.serial(n_chunks):
                d = c * LANES
                xf = bf16_to_f32(x_ub[d])
                for i in T.unroll(m, explicit=True):
                    rf[i] = bf16_to_f32(res_ub[i, d])
                for o in T.unroll(m, explicit=True):
                    acc[o] = S.vmul(pw[o], xf)
                    for i in T.unroll(m, explicit=True):
                        S.vmula(acc[o], cw[i * m + o], rf[i])
                    S.vsts(out_ub[o, d], to_bf16(acc[o]), dist="PK_B32")

    return vf


__all__ = public_names(__name__)
