"""Constants and range checks shared by the Ascend 950 mHC kernels (m = 4 streams, 64-lane fp32 vectors).

Ranges come from :mod:`cann_ops_tilelang.limits`, chip facts from :mod:`cann_ops_tilelang.chips`; a builder
or key function called with a value outside a range raises :class:`~cann_ops_tilelang.limits.LimitError`.
"""

from .... import limits
from ....policy import ASCEND_CASE_CORES

__all__ = [
    "CASE_MHC_MULT3",
    "CASE_NUM_CORES",
    "LANES",
    "M",
    "M2",
    "M3",
    "require_hc_mult",
    "require_m3",
    "require_mixes",
    "require_streams_and_hidden",
    "require_width",
    "width_range",
]

LANES = 64  # fp32 lanes of one 256-byte vector register (also 64 bf16 per UNPK_B16 load)
M = limits.MHC_HC_MULT.high  # the one hc_mult of every kernel (m = 4)
M2 = M * M
M3 = limits.MHC_MIX  # m * (m + 2) = 24 mixes

# lowering cases only (no NPU here; device policy): launchers read the real vector core count
CASE_NUM_CORES = ASCEND_CASE_CORES
CASE_MHC_MULT3 = limits.MHC_MIX


def width_range(block: int) -> limits.IntRange:
    """K = m * H of the declared ranges, in whole ``block``-column blocks (every H % 64 == 0 with m = 4
    is a multiple of 256)."""
    low = limits.MHC_HC_MULT.low * limits.MHC_HIDDEN.low
    high = limits.MHC_HC_MULT.high * limits.MHC_HIDDEN.high
    return limits.IntRange("K = hc_mult * hidden size", low, high, multiple_of=block)


def require_hc_mult(where: str, hc_mult) -> int:
    return limits.MHC_HC_MULT.require(where, int(hc_mult))


def require_streams_and_hidden(where: str, hidden_size, hc_mult) -> tuple[int, int]:
    """(H, m) when both are in the declared ranges, else :class:`LimitError`."""
    return limits.MHC_HIDDEN.require(where, int(hidden_size)), require_hc_mult(where, hc_mult)


def require_width(where: str, numel, block: int) -> int:
    return width_range(block).require(where, int(numel))


def require_mixes(where: str, mhc_mult3, high: int) -> int:
    """M3 (mixes per token) in [1, high]: what a kernel's padded row holds."""
    return limits.IntRange("M3 (mixes per token)", 1, high).require(where, int(mhc_mult3))


def require_m3(where: str, mhc_mult3) -> int:
    """M3 = m * (m + 2) of the declared hc_mult (24): the kernels' fixed block layouts."""
    return limits.IntRange("M3 (mixes per token)", M3, M3).require(where, int(mhc_mult3))
