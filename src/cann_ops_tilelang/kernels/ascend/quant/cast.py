"""Ascend 950 kernel of ``cast`` (docs/ops/quant.md#cast): element-wise narrowing, fp32 -> bf16 / e4m3, bf16 -> e4m3.

Scheme: ``x`` flat as rows of 256 elements, tiles of ``rows`` rows handed to the vector cores by a persistent loop
(multi-buffered: the next tile's load and the last one's store overlap this one's vector work), each row 64 lanes
at a time in fp32 (bf16 widened exactly). The last ``N % 256`` elements go through one zero-padded staging row
launched at the counter of its first element (copies only: the same arithmetic, bit for bit).

Round to nearest even: ``vcvt`` ``ROUND_R``; bf16 without saturation (overflow to inf, as ``Tensor.to``); e4m3
after a clamp to +-448 (the contract's ``Q``; NaN selected through). Stochastic rounding
(docs/ops/quant.md#stochastic_rounding), uint32 vector operations only (``vmuls`` / ``vxor`` / ``vshrs``): the
counters' low words ``n_lo = offset_lo + i`` come from an index ramp (``vci``), the key of each lane is one of the
two the launcher hashed (the second where ``n_lo`` wrapped: ``n_lo < offset_lo``), ``r = fmix32((n_lo *
0x9E3779B1) ^ key)``. bf16: ``~r >> 16`` added to the magnitude's bits, the low half cut (a carry rounds up exactly
when ``r < frac32``). e4m3: the contract's integer recipe, ``q = M >> s`` and ``frac32`` by vector shifts, the
value ``(q + [r < frac32]) * 2^G`` clamped to 448 with ``v``'s sign, then the exact ``vcvt``.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES
from ....quant.cast import COUNTER_MUL, FMIX, sr_scalars
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores

LANES = 64  # fp32 lanes of one 256-byte vector register
ROW = 256  # elements per row of the flat view
_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
CONVERSIONS = {"float32": ("bfloat16", "float8_e4m3fn"), "bfloat16": ("float8_e4m3fn",)}
_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float8_e4m3fn": "float8_e4m3fn"}
E4M3_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class RowTilePlan:
    """Tiles of ``rows`` rows of 256 elements, ``stages`` UB versions of the x and output tiles."""

    rows: int
    stages: int


# 32 rows: 32 KiB of fp32 x (16 KiB bf16) per tile, two stages (load / compute / store overlap) in under 100 KiB of
# UB. Not measured yet: no Ascend 950 here (docs/perf/ascend950/quant.md to come).
CAST_PLAN = RowTilePlan(rows=32, stages=2)


@compile_key
class CastKey:
    """Compile-time key of the cast: input and output dtypes, the rounding and the vector cores of the persistent
    grid (never the element count)."""

    in_dtype: str
    out_dtype: str
    stochastic: bool
    num_cores: int


def check_key(where: str, in_dtype: str, out_dtype: str, stochastic: bool, num_cores: int) -> None:
    """:class:`limits.LimitError` unless the key is a narrowing cast of the contract on ``num_cores >= 1`` cores."""
    limits.IntRange("num_cores", 1).require(where, int(num_cores))
    if out_dtype not in CONVERSIONS.get(in_dtype, ()):
        raise limits.LimitError(f"{where}: {in_dtype} -> {out_dtype} is not a narrowing cast of the contract")


def tile_ub_bytes(in_dtype: str, out_dtype: str) -> int:
    """UB bytes of the x and output tiles, every stage."""
    return CAST_PLAN.stages * CAST_PLAN.rows * ROW * (_BYTES[in_dtype] + _BYTES[out_dtype])


def build_cast(in_dtype: str, out_dtype: str, stochastic: bool, num_cores: int):
    """prim_func(x (R, 256), out (R, 256)[, offset_lo, key0, key1 int32]): ``R`` dynamic; the stochastic variant
    takes the counter scalars of :func:`cann_ops_tilelang.quant.cast.sr_scalars`."""
    check_key("cast", in_dtype, out_dtype, stochastic, num_cores)
    tr, stages, cores = CAST_PLAN.rows, CAST_PLAN.stages, int(num_cores)
    chunks = ROW // LANES
    rows = T.dynamic("num_rows")
    u32, f32 = T.uint32, T.float32
    to_bf16 = out_dtype == "bfloat16"

    def load_f32(x_ub, r, c):
        """64 elements of row ``r`` from ``c`` as fp32 (bf16 widened exactly)."""
        if in_dtype == "bfloat16":
            return S.vcvt(S.vld(x_ub[r, c], dist="UNPK_B16"), f32, part=0)
        return S.vld(x_ub[r, c])

    def dup(value):
        return S.vdup(T.uint32(value), u32)

    def counts(v):
        return T.reinterpret(v, "int32x64")

    @T.macro
    def random_words(base, off, k0, k1):
        """``r`` of the 64 counters whose low words start at ``base``."""
        n = T.reinterpret(S.vci(T.reinterpret(base, T.int32), T.int32), "uint32x64")
        h = S.vxor(S.vmuls(n, T.uint32(COUNTER_MUL)), S.vsel(k1, k0, S.vcmp(n, off, op="lt")))
        h = S.vxor(h, S.vshrs(h, 16))
        h = S.vmuls(h, T.uint32(FMIX[0]))
        h = S.vxor(h, S.vshrs(h, 13))
        h = S.vmuls(h, T.uint32(FMIX[1]))
        return S.vxor(h, S.vshrs(h, 16))

    @T.macro
    def sr_bf16(v, h):
        """bf16 bits (in the low half of each lane) of ``v`` rounded by the words ``h``; NaN stays NaN."""
        bits = T.reinterpret(v, "uint32x64")
        mag = S.vand(bits, dup(0x7FFFFFFF))
        rounded = S.vor(S.vshrs(S.vadd(mag, S.vshrs(S.vnot(h), 16)), 16), S.vand(S.vshrs(bits, 16), dup(0x8000)))
        return S.vsel(dup(0x7FFF), rounded, S.vcmp(mag, dup(0x7F800000), op="gt"))

    @T.macro
    def sr_e4m3(v, h):
        """``v`` rounded by ``h`` onto the e4m3 grid, as fp32 (clamped to 448; NaN stays NaN)."""
        bits = T.reinterpret(v, "uint32x64")
        mag = S.vand(bits, dup(0x7FFFFFFF))
        eb = S.vshrs(mag, 23)
        # M the 24-bit significand; s = 20 + t, t = max(eb, 121) - max(eb, 1) (docs/ops/quant.md#stochastic_rounding)
        m = S.vor(S.vand(bits, dup(0x7FFFFF)), S.vsel(dup(0x800000), dup(0), S.vcmps(eb, T.uint32(0), op="ne")))
        ebh = S.vmaxs(eb, T.uint32(121))
        t = S.vsub(ebh, S.vmaxs(eb, T.uint32(1)))
        # vector shifts take int32 counts (asc_shiftleft / asc_shiftright), here 0..31; logical on uint32
        q = S.vshr(m, counts(S.vmins(S.vadds(t, T.uint32(20)), T.uint32(31))))
        frac = S.vsel(S.vshl(m, counts(S.vsub(dup(12), S.vmins(t, T.uint32(12))))),
                      S.vshr(m, counts(S.vmins(S.vsub(S.vmaxs(t, T.uint32(12)), dup(12)), T.uint32(31)))),
                      S.vcmps(t, T.uint32(12), op="le"))
        q = S.vadd(q, S.vsel(dup(1), dup(0), S.vcmp(h, frac, op="lt")))
        # (q + up) * 2^G, G = max(eb, 121) - 130: exact; clamped to the e4m3 max, then v's sign
        val = S.vmins(S.vmul(S.vcvt(T.reinterpret(q, "int32x64"), f32),
                             T.reinterpret(S.vshls(S.vsub(ebh, dup(3)), 23), "float32x64")), E4M3_MAX)
        signed = T.reinterpret(S.vor(T.reinterpret(val, "uint32x64"), S.vand(bits, dup(0x80000000))), "float32x64")
        return S.vsel(v, signed, S.vcmp(mag, dup(0x7F800000), op="gt"))

    @T.macro
    def rne_e4m3(v):
        """``v`` clamped to +-448 (NaN selected through): the saturating Q before the RNE conversion."""
        mag = S.vand(T.reinterpret(v, "uint32x64"), dup(0x7FFFFFFF))
        return S.vsel(v, S.vmaxs(S.vmins(v, E4M3_MAX), -E4M3_MAX), S.vcmp(mag, dup(0x7F800000), op="gt"))

    @T.macro
    def cast_vf(x_ub, o_ub, n, r0, offset_lo, key0, key1):
        with T.SimdVF():
            off = S.vdup(T.cast(offset_lo, u32), u32)
            k0 = S.vdup(T.cast(key0, u32), u32)
            k1 = S.vdup(T.cast(key1, u32), u32)
            for r in T.serial(n):
                for c in T.unroll(chunks, explicit=True):
                    v = load_f32(x_ub, r, c * LANES)
                    if stochastic:
                        # the low word of the counter of lane 0: offset_lo + its element index, mod 2**32
                        h = random_words(T.cast(offset_lo, u32) + T.cast((r0 + r) * ROW + c * LANES, u32), off, k0,
                                         k1)
                        if to_bf16:
                            S.vsts(o_ub[r, c * LANES], T.reinterpret(sr_bf16(v, h), "bfloat16x128"), dist="PK_B32")
                        else:
                            S.vsts(o_ub[r, c * LANES], S.vcvt(sr_e4m3(v, h), T.float8_e4m3fn, part=0),
                                   dist="PK4_B32")
                    elif to_bf16:
                        S.vsts(o_ub[r, c * LANES], S.vcvt(v, T.bfloat16, sat=False), dist="PK_B32")
                    else:
                        S.vsts(o_ub[r, c * LANES], S.vcvt(rne_e4m3(v), T.float8_e4m3fn, part=0), dist="PK4_B32")

    @T.macro
    def body(x, out, offset_lo, key0, key1):
        with T.Kernel(cores) as core_id:
            x_ub = T.alloc_shared((tr, ROW), in_dtype)
            o_ub = T.alloc_shared((tr, ROW), out_dtype)
            T.annotate_buffer_versions({x_ub: stages, o_ub: stages})
            for (tile,) in T.Persistent([T.ceildiv(rows, tr)], cores, core_id, group_size=1, num_stages=stages):
                r0 = tile * tr
                n = T.min(tr, rows - r0)
                T.copy(x[r0 : r0 + n, :], x_ub[:n, :])
                cast_vf(x_ub, o_ub, n, r0, offset_lo, key0, key1)
                T.copy(o_ub[:n, :], out[r0 : r0 + n, :])

    if stochastic:
        @T.prim_func
        def cast_sr_asc(x: T.Tensor[(rows, ROW), in_dtype], out: T.Tensor[(rows, ROW), out_dtype], offset_lo: T.int32,
                        key0: T.int32, key1: T.int32):
            body(x, out, offset_lo, key0, key1)

        return cast_sr_asc

    @T.prim_func
    def cast_asc(x: T.Tensor[(rows, ROW), in_dtype], out: T.Tensor[(rows, ROW), out_dtype]):
        body(x, out, 0, 0, 0)

    return cast_asc


def cast_key(x, dtype, seed, num_cores: int) -> CastKey:
    """The key of a launch (``limits.LimitError`` outside the contract's conversions)."""
    key = CastKey(_DTYPE_NAMES.get(str(x.dtype), str(x.dtype)), _DTYPE_NAMES.get(str(dtype), str(dtype)),
                  seed is not None, int(num_cores))
    check_key("cast", key.in_dtype, key.out_dtype, key.stochastic, key.num_cores)
    return key


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Every conversion, round to nearest and stochastic, on the Ascend 950's vector cores (the kernel is flat:
    the hidden size does not matter)."""
    del hidden_size, hc_mult
    short = {"float32": "f32", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}
    return {f"cast_{short[i]}_{short[o]}_{'sr' if sr else 'rne'}": CastKey(i, o, sr, ASCEND_CASE_CORES)
            for i, outs in CONVERSIONS.items() for o in outs for sr in (False, True)}


CAST = Kernel("cast", CastKey, build_cast, cases=_cases,
              derive=lambda x, dtype, seed: cast_key(x, dtype, seed, num_vector_cores()))


def cast(x, dtype, seed, offset, out) -> None:
    """x (any shape, N elements) bf16|fp32 -> out (x's shape, ``dtype``), read flat; current stream, no sync. The
    whole 256-element rows in place, the last ``N % 256`` through a zero-padded staging row launched at the
    counter ``offset + (N - N % 256)``."""
    key = CAST.key(x, dtype, seed)
    limits.QUANT_ELEMENTS.require("cast", x.numel())
    kernel = CAST.compiled(key)
    xf, of = x.view(-1), out.view(-1)
    numel = xf.numel()
    main = numel - numel % ROW

    def launch(x2, o2, start):
        if key.stochastic:
            kernel(x2, o2, *sr_scalars(int(seed), int(offset) + start))
        else:
            kernel(x2, o2)

    if main:
        launch(xf[:main].view(-1, ROW), of[:main].view(-1, ROW), 0)
    if main < numel:
        x_row, o_row = xf.new_zeros((1, ROW)), of.new_empty((1, ROW))
        x_row[0, : numel - main].copy_(xf[main:])
        launch(x_row, o_row, main)
        of[main:].copy_(o_row[0, : numel - main])


KERNELS, lowering_cases, __all__ = kernel_module(__name__, CAST)
