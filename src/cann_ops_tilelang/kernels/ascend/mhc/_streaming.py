"""Helpers of the bandwidth-bound mHC streaming kernels (expand, pre apply mix, post), m = 4.

Common scheme: a persistent loop over (token, hidden tile) tasks (``T.Persistent`` with multi-buffered
UB tiles so the GM->UB loads of task n+1 and the UB->GM stores of task n-1 overlap the vector math of
task n); bf16 loads are widened to fp32 64 lanes at a time (``UNPK_B16`` + ``vcvt``), all arithmetic is
fp32, and each output is rounded to bf16 once at the store (``PK_B32``). Chains written "a + b*c" use the
fused multiply-add ``vmula`` (one rounding); a sum "sum_i a_i*b_i" starts with the product ``vmul`` of
term 0 (``0 + p`` is ``p``) and adds terms 1.. with ``vmula`` in ascending order. Reductions over the
hidden dimension (mix_grad, d_post, d_comb) are owned by one task per token (no atomics, deterministic):
64-lane partial sums accumulated across the hidden tiles of the token, then one lane reduction.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from .. import _build
from ._common import LANES, require_streams_and_hidden

__all__ = ["PAD", "SLACK", "StreamingPlan", "bf16_to_f32", "check", "mhc_streaming_hidden_tile", "to_bf16"]

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


def check(where: str, hidden_size: int, hc_mult: int) -> tuple[int, int]:
    """(H, m) of a streaming kernel, in the declared ranges (else :class:`LimitError`)."""
    return require_streams_and_hidden(where, hidden_size, hc_mult)


def bf16_to_f32(ref):
    return S.vcvt(S.vld(ref, dist="UNPK_B16"), T.float32, part=0)


def to_bf16(value):
    return S.vcvt(value, T.bfloat16)
