"""Ascend 950 kernel of ``cast_back`` (docs/ops/quant.md#cast_back): ``out = out_dtype(fl(f32(data) * s))``.

Scheme: a persistent loop over (token tile, hidden tile) tasks of ``BM`` tokens by ``hk`` channels, multi-buffered
(the next task's loads and the previous one's store overlap this one's vector work). ``BM`` is 32 tokens for
per-token layouts and the block's rows (32 or 128) for per-block and per-channel ones, so that a tile holds whole
block rows; ragged token tails clamp the DMAs to the valid rows (and block rows). Per task the data tile, the
scales the tile needs (as stored: fp32, e4m3 or int16 UE8M0 words; ``row`` ``[block row, group]`` or ``col_tma``
``[group, block row]``, the scale tensor's own orientation) come in by DMA, then 64 values at a time:

* the data widened exactly: e4m3 by an ``UNPK4_B8`` load and ``vcvt`` to fp32; e2m1 128 at a time by an
  ``UNPK4_B8`` load, ``vcvt`` to bf16 and an interleave with zeros (the bf16 bits in the high half: its fp32);
* the scale of each lane: a broadcast load of its group's entry (``vsel`` of two or four for 32- and 16-channel
  groups); e4m3 scales widened to an fp32 tile first; a UE8M0 word broadcast as 16 bits to both halves of each
  32-bit lane and shifted left by ``23 - 8 b`` (``b`` the byte of the lane's group), masked to the exponent field:
  the fp32 ``2^(e - 127)``; per-channel scales are 64 consecutive entries of the block row (UE8M0: 64 words, byte
  ``i % 2`` of block row ``i``);
* one fp32 product, rounded once to bf16 by ``vcvt`` (or kept fp32), into the out tile.

Scale tensors: ``row`` as stored; ``col_tma`` is the transposed view of a ``(cols, rows)`` row-major buffer on
Ascend (no padding), which the launcher passes as that buffer (``sf.t()``).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES
from ....quant import ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores

LANES = 64  # fp32 lanes of one 256-byte vector register
SLACK = 8 * 1024  # UB kept free of the tile formula's count (alignment of the buffer versions)
DMA_ROW_BYTES = 32  # a UB tile row is a multiple of 32 bytes
OUT_DTYPES = {"bfloat16": 2, "float32": 4}
_SF_BYTES = {"fp32": 4, "e4m3": 1, "ue8m0": 2}  # the stored element on Ascend (UE8M0: int16 words of two)


@dataclasses.dataclass(frozen=True)
class CastBackTilePlan:
    """``tokens`` rows per tile of a per-token layout (per-block and per-channel tiles are one block row) and
    ``stages`` UB versions of the data, scale and out tiles; the hidden tile is the widest that fits
    (:func:`tiling`)."""

    tokens: int
    stages: int


# 32 tokens (the per-token cast's row plan), two stages (load / compute / store overlap). Not measured yet: no
# Ascend 950 here (docs/perf/ascend950/quant.md to come).
PLAN = CastBackTilePlan(tokens=32, stages=2)


@compile_key
class CastBackKey:
    """Compile-time key: hidden size, block, data format, scale storage, output dtype and the vector cores of the
    persistent grid (never the token count; the scales' rounding does not change their decoding)."""

    hidden: int
    rows: int
    cols: int
    fmt: str  # "e4m3" | "e2m1"
    sf: str  # "fp32" | "e4m3" | "ue8m0"
    storage: str  # "row" | "col_tma"
    out_dtype: str  # "bfloat16" | "float32"
    num_cores: int


def _align(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class Tiling:
    """``BM`` tokens (``nb`` block rows) by ``hk`` channels (``ng`` scale groups, ``nw`` stored scale columns), the
    stored scale tile's shape and the UB bytes the formula counts."""

    bm: int
    nb: int
    hk: int
    ng: int
    nw: int
    sf_shape: tuple
    ub_bytes: int


def _tile(hk: int, rows: int, cols: int, fmt: str, sf: str, storage: str, out_dtype: str) -> Tiling:
    per_channel = cols == 1
    bm = PLAN.tokens if rows == 1 else rows
    nb = bm // rows
    ng = hk // cols
    pack = 2 if sf == "ue8m0" and not per_channel else 1
    nw = -(-ng // pack)
    elem = _SF_BYTES[sf]
    # e4m3 tiles are widened 64 entries at a time: their rows are padded to 64 entries
    row_unit = LANES if sf == "e4m3" else DMA_ROW_BYTES // elem
    if per_channel:
        shape = (1, _align(hk, row_unit))
    elif storage == "col_tma":
        shape = (nw, _align(nb, row_unit))
    else:
        shape = (nb, _align(nw, row_unit))
    raw = shape[0] * shape[1]
    data = bm * hk // (2 if fmt == "e2m1" else 1)
    versioned = data + bm * hk * OUT_DTYPES[out_dtype] + raw * elem
    widened = 4 * raw if sf == "e4m3" else 0
    return Tiling(bm, nb, hk, ng, nw, shape, PLAN.stages * versioned + widened + SLACK)


def tiling(hidden: int, rows: int, cols: int, fmt: str, sf: str, storage: str, out_dtype: str) -> Tiling:
    """The widest hidden tile that divides ``H``, is a multiple of 128 channels and fits the UB budget. A UE8M0 word
    may straddle two tiles (128-channel groups, an odd count per tile): each tile reads every word it needs."""
    fits = [hk for hk in range(128, hidden + 1, 128)
            if hidden % hk == 0
            and _tile(hk, rows, cols, fmt, sf, storage, out_dtype).ub_bytes <= _build.UB_BUDGET_BYTES]
    if not fits:
        raise limits.LimitError(f"cast_back: no hidden tile fits the UB at H={hidden}")
    return _tile(fits[-1], rows, cols, fmt, sf, storage, out_dtype)


def check_key(where: str, hidden, rows, cols, fmt, sf, storage, out_dtype, num_cores) -> None:
    """:class:`limits.LimitError` unless the key is a supported cast back."""
    limits.QUANT_HIDDEN.require(where, int(hidden))
    limits.IntRange("num_cores", 1).require(where, int(num_cores))
    if out_dtype not in OUT_DTYPES:
        raise limits.LimitError(f"{where}: out_dtype must be one of {tuple(OUT_DTYPES)}; got {out_dtype}")
    try:  # the layout's own rules (blocks, per-channel row e4m3, ...)
        ScaleLayout((int(rows), int(cols)), fmt, sf, storage, sf == "ue8m0")
    except (TypeError, ValueError) as exc:
        raise limits.LimitError(f"{where}: {exc}") from None


def build_cast_back(hidden: int, rows: int, cols: int, fmt: str, sf: str, storage: str, out_dtype: str,
                    num_cores: int):
    """prim_func(data (T, H) e4m3 | e2m1, sf (the stored scales; col_tma its (cols, rows) buffer), out (T, H))."""
    check_key("cast_back", hidden, rows, cols, fmt, sf, storage, out_dtype, num_cores)
    H, rb, c = int(hidden), int(rows), int(cols)
    til = tiling(H, rb, c, fmt, sf, storage, out_dtype)
    BM, hk, nw, stages = til.bm, til.hk, til.nw, PLAN.stages
    n_tiles = H // hk
    per_channel = c == 1
    col = storage == "col_tma"
    e2m1 = fmt == "e2m1"
    ue8m0 = sf == "ue8m0"
    per_vec = max(1, LANES // c)  # groups per 64-lane vector (c < 64)
    vec_per_group = max(1, c // LANES)
    data_t = T.float4_e2m1fn if e2m1 else T.float8_e4m3fn
    out_t = T.bfloat16 if out_dtype == "bfloat16" else T.float32
    sf_t = {"fp32": T.float32, "e4m3": T.float8_e4m3fn, "ue8m0": T.int16}[sf]
    nk = H // c
    gm_cols = nk if per_channel else (-(-nk // 2) if ue8m0 else nk)  # per-channel: H
    num_tokens = T.dynamic("num_tokens")
    nm = T.ceildiv(num_tokens, rb)
    if per_channel:
        sf_shape = (T.ceildiv(nm, 2) if ue8m0 else nm, H)
    elif col:
        sf_shape = (gm_cols, nm)
    else:
        sf_shape = (nm, gm_cols)
    raw_rows, raw_cols = til.sf_shape

    def at(tile, bi, gi):
        """The stored scale tile's element of tile block row ``bi``, stored column ``gi``."""
        return tile[gi * raw_cols + bi] if col else tile[bi * raw_cols + gi]

    def brc_f32(tile, bi, gi):
        return S.vld(at(tile, bi, gi), dist="BRC_B32")

    @T.macro
    def word_scale(raw_ub, bi, gi, shift):
        """fp32 scales of lanes whose byte sits in the word of group ``gi``: the word broadcast to both 16-bit halves
        of each lane, shifted left by ``shift`` (23 for the even group's byte, 15 for the odd one's), masked."""
        w = T.reinterpret(S.vld(at(raw_ub, bi, gi // 2), dist="BRC_B16"), "uint32x64")
        return T.reinterpret(S.vand(S.vshl(w, shift), S.vdup(0x7F800000, T.uint32)), "float32x64")

    @T.macro
    def lane_scale(raw_ub, sf_ub, r, ch, bi_row, off, ge1, ge2, ge3, shift_32, shift_16):
        """The fp32 scale of each lane of the 64-channel vector ``ch`` of tile row ``r``."""
        bi = r // rb
        if per_channel:
            if ue8m0:  # 64 words of the block rows' word row: byte bi_row % 2
                w = T.reinterpret(S.vld(raw_ub[ch * LANES], dist="UNPK_B16"), "uint32x64")
                return T.reinterpret(S.vand(S.vshls(w, 23 - 8 * (bi_row % 2)), S.vdup(0x7F800000, T.uint32)),
                                     "float32x64")
            return S.vld(sf_ub[ch * LANES])
        if ue8m0:
            if c >= LANES:  # the tile's first group may be the odd byte of its word (off): 128-channel groups
                gi = ch // vec_per_group + off
                return word_scale(raw_ub, bi, gi, S.vdup(T.if_then_else(gi % 2 == 0, 23, 15), T.uint32))
            if c == 32:  # groups 2 ch, 2 ch + 1: one word
                return word_scale(raw_ub, bi, 2 * ch, shift_32)
            # c == 16: groups 4 ch .. 4 ch + 3: words 2 ch, 2 ch + 1
            return S.vsel(word_scale(raw_ub, bi, 4 * ch + 2, shift_16), word_scale(raw_ub, bi, 4 * ch, shift_16),
                          ge2)
        if c >= LANES:
            return brc_f32(sf_ub, bi, ch // vec_per_group)
        if c == 32:
            return S.vsel(brc_f32(sf_ub, bi, 2 * ch + 1), brc_f32(sf_ub, bi, 2 * ch), ge1)
        s01 = S.vsel(brc_f32(sf_ub, bi, 4 * ch + 1), brc_f32(sf_ub, bi, 4 * ch), ge1)
        s012 = S.vsel(brc_f32(sf_ub, bi, 4 * ch + 2), s01, ge2)
        return S.vsel(brc_f32(sf_ub, bi, 4 * ch + 3), s012, ge3)

    @T.macro
    def store_out(out_ub, r, ch, v):
        if out_dtype == "bfloat16":
            S.vsts(out_ub[r, ch * LANES], S.vcvt(v, T.bfloat16), dist="PK_B32")
        else:
            S.vsts(out_ub[r, ch * LANES], v)

    @T.macro
    def cast_back_vf(data_ub, raw_ub, sf_ub, out_ub, valid, bi_row, off):
        with T.SimdVF():
            lane = S.vci(0, T.int32)
            ge1 = S.vcmps(lane, c, op="ge")
            ge2 = S.vcmps(lane, 2 * c, op="ge")
            ge3 = S.vcmps(lane, 3 * c, op="ge")
            # UE8M0 shifts by lane: 32-channel groups (23 | 15 by halves), 16-channel groups (23, 15, 23, 15)
            shift_32 = S.vsel(S.vdup(15, T.uint32), S.vdup(23, T.uint32), S.vcmps(lane, 32, op="ge"))
            odd16 = S.vcmps(S.vand(lane, S.vdup(16, T.int32)), 16, op="eq")
            shift_16 = S.vsel(S.vdup(15, T.uint32), S.vdup(23, T.uint32), odd16)
            if sf == "e4m3":  # the stored e4m3 scales widened to fp32, 64 at a time
                for v in T.unroll(raw_rows * raw_cols // LANES, explicit=True):
                    S.vsts(sf_ub[v * LANES], S.vcvt(S.vld(raw_ub[v * LANES], dist="UNPK4_B8"), T.float32))
                S.mem_bar("VST_VLD")
            if e2m1:
                zero = S.vdup(0.0, T.bfloat16)
                for r in T.serial(valid):
                    for p in T.serial(hk // (2 * LANES)):
                        q = S.vcvt(S.vld(data_ub[r, 2 * p * LANES], dist="UNPK4_B8"), T.bfloat16)
                        lo, hi = S.vintlv(zero, q)  # bf16 bits in the high half: the exact fp32
                        store_out(out_ub, r, 2 * p, S.vmul(T.reinterpret(lo, "float32x64"), lane_scale(
                            raw_ub, sf_ub, r, 2 * p, bi_row, off, ge1, ge2, ge3, shift_32, shift_16)))
                        store_out(out_ub, r, 2 * p + 1, S.vmul(T.reinterpret(hi, "float32x64"), lane_scale(
                            raw_ub, sf_ub, r, 2 * p + 1, bi_row, off, ge1, ge2, ge3, shift_32, shift_16)))
            else:
                for r in T.serial(valid):
                    for ch in T.serial(hk // LANES):
                        v = S.vcvt(S.vld(data_ub[r, ch * LANES], dist="UNPK4_B8"), T.float32)
                        store_out(out_ub, r, ch, S.vmul(v, lane_scale(raw_ub, sf_ub, r, ch, bi_row, off, ge1, ge2, ge3,
                                                                      shift_32, shift_16)))

    @T.prim_func
    def cast_back_asc(
        data: T.Tensor[(num_tokens, H), data_t],
        sf_in: T.Tensor[sf_shape, sf_t],
        out: T.Tensor[(num_tokens, H), out_t],
    ):
        with T.Kernel(num_cores) as core_id:
            data_ub = T.alloc_shared((BM, hk), data_t)
            out_ub = T.alloc_shared((BM, hk), out_t)
            raw_ub = T.alloc_shared((raw_rows * raw_cols,), sf_t)
            # the widened e4m3 scales (fp32 scales are read as stored)
            sf_ub = T.alloc_shared((raw_rows * raw_cols,), T.float32) if sf == "e4m3" else raw_ub
            T.annotate_buffer_versions({data_ub: stages, out_ub: stages, raw_ub: stages})
            raw_2d = T.reshape(raw_ub, (raw_rows, raw_cols))
            for tt, ht in T.Persistent([T.ceildiv(num_tokens, BM), n_tiles], num_cores, core_id,
                                       group_size=n_tiles, num_stages=stages):
                row = tt * BM
                valid = T.min(BM, num_tokens - row)
                h0 = ht * hk
                i0 = row // rb  # the tile's first block row
                nbv = T.ceildiv(valid, rb)
                T.copy(data[row : row + valid, h0 : h0 + hk], data_ub[:valid, :], l2_cache_ctrl="NOTALLOC_KEEP")
                if per_channel:
                    if ue8m0:
                        T.copy(sf_in[i0 // 2 : i0 // 2 + 1, h0 : h0 + hk], raw_2d[:1, :hk])
                    else:
                        T.copy(sf_in[i0 : i0 + 1, h0 : h0 + hk], raw_2d[:1, :hk])
                elif col:
                    T.copy(sf_in[h0 // c // (2 if ue8m0 else 1) : h0 // c // (2 if ue8m0 else 1) + nw, i0 : i0 + nbv],
                           raw_2d[:nw, :nbv])
                else:
                    T.copy(sf_in[i0 : i0 + nbv, h0 // c // (2 if ue8m0 else 1) : h0 // c // (2 if ue8m0 else 1) + nw],
                           raw_2d[:nbv, :nw])
                cast_back_vf(data_ub, raw_ub, sf_ub, out_ub, valid, i0, (h0 // c) % 2 if ue8m0 and c > 1 else 0)
                T.copy(out_ub[:valid, :], out[row : row + valid, h0 : h0 + hk])

    return cast_back_asc


_OUT_NAMES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def cast_back_key(data, layout, out_dtype, num_cores: int) -> CastBackKey:
    """The key of a launch (``limits.LimitError`` outside the supported ranges)."""
    spec = ScaleLayout.parse(layout)
    key = CastBackKey(spec.hidden_of(data), spec.block[0], spec.block[1], spec.fmt, spec.sf, spec.storage,
                      _OUT_NAMES.get(str(out_dtype), str(out_dtype)), int(num_cores))
    check_key("cast_back", *(getattr(key, f.name) for f in dataclasses.fields(key)))
    return key


# the lowering cases: every block kind, data format, scale dtype, storage and output dtype
_CASES = {
    "e4m3_1x128_fp32_row_bf16": ("1x128/e4m3/fp32/row/exact", "bfloat16"),
    "e4m3_1x128_ue8m0_col_f32": ("1x128/e4m3/ue8m0/col_tma/round", "float32"),
    "e2m1_1x32_ue8m0_row_bf16": ("1x32/e2m1/ue8m0/row/round", "bfloat16"),
    "e2m1_1x16_e4m3_col_f32": ("1x16/e2m1/e4m3/col_tma/exact", "float32"),
    "e4m3_128x128_fp32_row_bf16": ("128x128/e4m3/fp32/row/round", "bfloat16"),
    "e2m1_32x32_ue8m0_col_bf16": ("32x32/e2m1/ue8m0/col_tma/round", "bfloat16"),
    "e4m3_128x1_ue8m0_row_bf16": ("128x1/e4m3/ue8m0/row/round", "bfloat16"),
    "e4m3_32x1_e4m3_row_f32": ("32x1/e4m3/e4m3/row/exact", "float32"),
}


def cast_back_cases(hidden_size: int, hc_mult: int) -> dict:
    del hc_mult
    out = {}
    for name, (spec, out_dtype) in _CASES.items():
        s = ScaleLayout.parse(spec)
        out[f"cast_back_{name}"] = CastBackKey(hidden_size, s.block[0], s.block[1], s.fmt, s.sf, s.storage, out_dtype,
                                               ASCEND_CASE_CORES)
    return out


CAST_BACK = Kernel("cast_back", CastBackKey, build_cast_back, cases=cast_back_cases,
                   derive=lambda data, sf, layout, out_dtype, out: cast_back_key(data, layout, out_dtype,
                                                                                 num_vector_cores()))


def cast_back(data, sf, layout, out_dtype, out) -> None:
    """data (T, H) e4m3 | (T, H/2) uint8 e2m1, sf (the layout's scales for backend "ascend") -> out (T, H),
    pre-allocated. ``col_tma`` scales are passed as their ``(cols, rows)`` row-major buffer. Current stream."""
    key = CAST_BACK.key(data, sf, layout, out_dtype, out)
    CAST_BACK.compiled(key)(data, sf.t() if key.storage == "col_tma" else sf, out)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, CAST_BACK)
