"""What the quant family's Ascend 950 kernels share (docs/ops/quant.md#layout): fp32 constants and the scale of a
block from its amax, on 64 fp32 lanes, as the reference computes it operation by operation."""

import struct

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ....quant import ScaleLayout

__all__ = ["f32", "scale_macro"]


def f32(value: float) -> float:
    """``value`` rounded to fp32 (a constant the kernel uses as fp32)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def scale_macro(layout: ScaleLayout, *, fp32_scales: bool = False):
    """``scale_of(amax)``, a macro giving ``(stored, inv)`` of 64 block amaxes: ``a = max(amax, clamp)``; with
    ``round_sf`` the power of two from ``fl(a * fl(1 / max))``'s exponent bits (UE8M0: the exponent bytes as
    uint32 lanes), e4m3 scales ``s8 = e4m3(min(a / max, 448))`` and ``inv = 1 / f32(s8)``, else ``a / max`` and
    ``max / a``. ``fp32_scales``: the stored form is always the fp32 scale (for kernels that store none)."""
    clamp, fmax = f32(layout.amax_clamp), float(layout.fmax)
    inv_fmax = f32(1.0 / fmax)  # fl(1 / max): the round_sf recipe
    sf, round_sf = layout.sf, layout.round_sf
    bytes_out = sf == "ue8m0" and not fp32_scales

    @T.macro
    def scale_of(amax):
        a = S.vmaxs(amax, clamp)
        if round_sf:
            bits = T.reinterpret(S.vmuls(a, inv_fmax), "uint32x64")
            e = S.vadds(S.vshrs(S.vsub(bits, S.vdup(1, T.uint32)), 23), 1)
            inv = T.reinterpret(S.vshls(S.vsub(S.vdup(254, T.uint32), e), 23), "float32x64")
            if bytes_out:
                return e, inv
            return T.reinterpret(S.vshls(e, 23), "float32x64"), inv
        fm = S.vdup(fmax, T.float32)
        if sf == "e4m3":
            s8 = S.vcvt(S.vmins(S.vdiv(a, fm), 448.0), T.float8_e4m3fn, part=0)
            s = S.vcvt(s8, T.float32, part=0)
            return (s if fp32_scales else s8), S.vdiv(S.vdup(1.0, T.float32), s)
        return S.vdiv(a, fm), S.vdiv(fm, a)

    return scale_of
