"""Arithmetic shared by the quant family's CUDA kernels (TileLang expressions; docs/ops/quant.md#conventions).

``e2m1_encode`` is the e2m1 rounding of the per-token cast's kernel under a public name (the same comparisons with
the grid's midpoints), for the kernels that narrow and widen in one pass; the decoders widen e2m1 codes and UE8M0
bytes to fp32 exactly.
"""

import struct

__all__ = ["E2M1_MIDPOINTS", "e2m1_decode", "e2m1_encode", "f32_bits", "ue8m0_decode"]

# the e2m1 grid's midpoints, each with whether a tie there rounds up (to the even code above it)
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def f32_bits(value: float) -> int:
    """The bits of ``value`` rounded to fp32."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def e2m1_encode(T, v):
    """The e2m1 code (uint8 0..15) of an fp32 value: round to nearest even on the grid by comparisons with its
    midpoints (a tie goes to the even code), saturating at 6 (inf too); NaN gives 7; the sign bit is ``v``'s."""
    mag = T.abs(v)
    code = T.uint8(0)
    for mid, tie_up in E2M1_MIDPOINTS:
        code = code + T.cast(mag >= T.float32(mid) if tie_up else mag > T.float32(mid), T.uint8)
    code = T.if_then_else(T.isnan(v), T.uint8(7), code)
    return code | T.cast((T.reinterpret(v, T.uint32) >> T.uint32(31)) << T.uint32(3), T.uint8)


def e2m1_decode(T, code):
    """The fp32 value of an e2m1 code (uint32 0..15), exactly, built on the bits: magnitude codes 0 and 1 are 0 and
    0.5 (``m * 0x3F000000``), codes ``m >= 2`` are ``(m + 252) << 22`` (1, 1.5, 2, 3, 4, 6); bit 3 is the sign."""
    mag = code & T.uint32(7)
    bits = T.if_then_else(mag < T.uint32(2), mag * T.uint32(0x3F000000), (mag + T.uint32(252)) << T.uint32(22))
    return T.reinterpret(bits | ((code & T.uint32(8)) << T.uint32(28)), T.float32)


def ue8m0_decode(T, byte):
    """The fp32 scale of a UE8M0 byte ``e`` (uint8): the bits ``e << 23`` (0 gives 0.0, 255 gives inf)."""
    return T.reinterpret(T.cast(byte, T.uint32) << T.uint32(23), T.float32)
