"""Arithmetic shared by the quant family's CUDA kernels (TileLang expressions; docs/ops/quant.md#conventions).

``e2m1_encode`` is the e2m1 rounding (comparisons with the grid's midpoints); the decoders widen e2m1 codes and
UE8M0 bytes to fp32 exactly. ``group_scale``, ``stored_scale``, ``sf_param`` and ``sf_index`` are the per-token
group's scale and its storage, shared by ``per_token_cast`` and the kernels that fuse a per-token cast (norm,
SwiGLU); ``sf_view`` is the launch-side view of a scale tensor that those kernels take.
"""

import struct

import torch

from ....quant import AMAX_CLAMP, FORMATS

__all__ = ["E2M1_MIDPOINTS", "e2m1_decode", "e2m1_encode", "f32_bits", "group_scale", "sf_index", "sf_param",
           "sf_view", "stored_scale", "ue8m0_decode"]

# the e2m1 grid's midpoints, each with whether a tie there rounds up (to the even code above it)
E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def f32_bits(value: float) -> int:
    """The bits of ``value`` rounded to fp32."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def sf_view(sf: torch.Tensor, storage: str, kind: str) -> torch.Tensor:
    """The buffer a kernel takes for a scale tensor (the parameter of ``sf_param``): col_tma through the transposed
    (padded) buffer, UE8M0 words as their bytes."""
    view = sf.t() if storage == "col_tma" else sf
    return view.view(torch.uint8) if kind == "ue8m0" else view


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


def group_scale(T, fmt: str, sf: str, round_sf: bool):
    """A ``T.macro`` ``(scale, amax)`` writing ``scale[0..3] = a, a / max, s, inv`` of a group whose ``|max|`` is
    ``amax`` (fp32): ``a = max(amax, clamp)``, ``s`` the stored scale's fp32 value (``a / max`` rounded up to a power
    of two under ``round_sf``, or to e4m3) and ``inv`` the factor of the data (``1 / s``, or ``max / a`` for an
    unrounded fp32 scale), each an IEEE operation as in the reference (docs/ops/quant.md#layout)."""
    fmax, clamp_bits = FORMATS[fmt].max, f32_bits(AMAX_CLAMP[fmt, sf == "e4m3"])
    f32, u32 = T.float32, T.uint32

    @T.macro
    def scale_of(scale, amax):
        # every slot written once: TileLang's codegen may reuse a reinterpret of a slot across a store
        scale[0] = T.max(amax, T.reinterpret(T.uint32(clamp_bits), f32))  # a
        scale[1] = T.ieee_fdiv(scale[0], T.float32(fmax))  # a / max
        if round_sf:
            scale[2] = T.reinterpret((T.reinterpret(scale[1], u32) + T.uint32(0x7FFFFF)) & T.uint32(0x7F800000),
                                     f32)  # 2^ceil(log2(a / max))
            scale[3] = T.ieee_fdiv(T.float32(1.0), scale[2])
        elif sf == "e4m3":
            scale[2] = T.cast(T.cast(T.min(scale[1], T.float32(448.0)), T.float8_e4m3fn), f32)
            scale[3] = T.ieee_fdiv(T.float32(1.0), scale[2])
        else:
            scale[2] = scale[1]
            scale[3] = T.ieee_fdiv(T.float32(fmax), scale[0])

    return scale_of


def stored_scale(T, s, sf: str):
    """The stored form of a group's scale ``s`` (fp32): itself, its e4m3 value, or its UE8M0 exponent byte."""
    if sf == "ue8m0":
        return T.cast((T.reinterpret(s, T.uint32) >> T.uint32(23)) & T.uint32(0xFF), T.uint8)
    if sf == "e4m3":
        return T.cast(s, T.float8_e4m3fn)
    return s


def sf_param(T, storage: str, sf: str, nk: int, num_tokens, stride_name: str):
    """The prim_func parameter of the scales of ``nk`` per-token groups: ``(T, nk)`` fp32 / e4m3 (row) or its
    transpose ``(nk, T)`` with a dynamic row stride ``stride_name`` (col_tma); UE8M0 as bytes, ``(T, 4 W)`` (row)
    or ``(W, 4 T)`` strided (col_tma), ``W = ceil(nk / 4)`` int32 words per token."""
    words = -(-nk // 4)
    sf_dtype = {"fp32": T.float32, "e4m3": T.float8_e4m3fn, "ue8m0": T.uint8}[sf]
    if storage == "row":
        return T.Tensor((num_tokens, 4 * words if sf == "ue8m0" else nk), sf_dtype)
    shape = (words, 4 * num_tokens) if sf == "ue8m0" else (nk, num_tokens)
    return T.StridedTensor(shape, (T.dynamic(stride_name), 1), sf_dtype)


def sf_index(storage: str, sf: str, token, g):
    """Where the scale of (token, group ``g``) is in the parameter of :func:`sf_param`."""
    if storage == "row":
        return token, g
    if sf == "ue8m0":
        return g // 4, token * 4 + g % 4
    return g, token
