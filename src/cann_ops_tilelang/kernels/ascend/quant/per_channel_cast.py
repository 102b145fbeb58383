"""Ascend 950 kernel of ``per_channel_cast`` (docs/ops/quant.md#per_channel_cast): one scale per channel for every
``r`` tokens of ``x (T, H)`` (bf16 / fp32, or e4m3 data with per-token scales), the values cast to e4m3.

Scheme: a persistent loop over (token tile, hidden tile) tasks, multi-buffered (the next task's loads and the
previous one's stores overlap this one's vector work). A token tile is one block of ``r`` rows, or two for UE8M0
scales (an int16 word holds the scales of two consecutive blocks of a channel, so one task writes whole words);
a hidden tile ``hk`` channels, the widest divisor of ``H`` that fits the UB. Ragged token tails: the DMAs of the
last tile are clamped to its valid rows; rows past them are never read by the vector functions. All arithmetic is
fp32 (bf16 and e4m3 widened exactly), 64 channels per vector:

0. (re-quantization) the tile's input scales, loaded in their own storage (row ``[token, group]`` or col_tma
   ``[group, token]``), are decoded to fp32 at the same flat positions (e4m3 widened, a UE8M0 byte ``e`` made the
   fp32 bits ``e << 23``); ``sx`` of (row, vector) is then a broadcast load (groups of 32: two, selected by lane).
1. **amax** per channel: ``vmax`` of ``|v|`` down the valid rows of each block, ``v = x`` or ``fl(f32(x) * sx)``.
2. **scales**: ``a = max(amax, clamp)``; fp32 exact ``s = a / max``, ``inv = max / a`` (correctly rounded
   ``vdiv``); ``round_sf`` the exponent of ``2^ceil(log2(a * fl(1 / max)))`` (``s``, ``inv`` from it exactly);
   e4m3 ``s8 = e4m3(min(a / max, 448))``, ``inv = 1 / f32(s8)``. UE8M0 words ``e_first | e_second << 8`` (the
   second byte 0 past the last block).
3. **data**: ``Q(fl(v * inv))`` by ``vcvt`` (round to nearest even, saturating), ``inv`` of the row's block.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES
from ....quant import BLOCKS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores
from ._common import f32, scale_macro

LANES = 64  # fp32 lanes of one 256-byte vector register
SLACK = 8 * 1024  # UB kept free of the formula's count (alignment of the buffer versions), as per_token_cast does
TOKEN_BLOCKS = tuple(rows for rows, _ in BLOCKS["per_channel"])
INPUT_GROUPS = (32, 128)
IN_DTYPES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}  # input dtype -> bytes
UE8M0_PACK = 2  # exponent bytes per int16 word on Ascend
_SF_BYTES = {"fp32": 4, "e4m3": 1, "ue8m0": 2}  # bytes of a stored output scale (UE8M0: a word of two blocks)
_XS_BYTES = {"fp32": 4, "e4m3": 1, "ue8m0": 2}  # bytes of an input scale element (UE8M0: an int16 word)


@dataclasses.dataclass(frozen=True)
class ChannelTilePlan:
    """``stages`` UB versions of the x / data / scale tiles (the hidden tile is the widest that fits)."""

    stages: int


# Two stages (load / compute / store overlap), as per_token_cast. Not measured yet: no Ascend 950 here.
PLAN = ChannelTilePlan(stages=2)


@compile_key
class PerChannelCastKey:
    """Compile-time key: hidden size, token block, x's dtype, the output scales, the input scales of a
    re-quantization (``x_group`` 0: none) and the vector cores of the persistent grid (never the token count)."""

    hidden: int
    block: int
    in_dtype: str  # "bfloat16" | "float32" | "float8_e4m3fn"
    sf: str  # "fp32" | "e4m3" | "ue8m0"
    round_sf: bool
    x_group: int  # 0 | 32 | 128
    x_sf: str  # "" | "fp32" | "e4m3" | "ue8m0"
    x_storage: str  # "" | "row" | "col_tma"
    num_cores: int


@dataclasses.dataclass(frozen=True)
class Tiling:
    """``rows`` token rows per task (one or two blocks), ``hk`` channels per hidden tile, the input scale tile's
    shape (``xs_rows`` x ``xs_cols`` elements of the input scale dtype) and the UB bytes the formula counts."""

    rows: int
    halves: int
    hk: int
    n_tiles: int
    xs_rows: int
    xs_cols: int
    ub_bytes: int


def _align(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _input_tile(rows: int, hk: int, x_group: int, x_sf: str, x_storage: str) -> tuple[int, int]:
    """(rows, cols) of the raw input scale tile in its storage: the groups of a hidden tile (UE8M0: the words that
    hold them, one more where the tile starts on an odd group), ``[token, group]`` rows padded to 32 bytes, or
    ``[group, token]``; the flat entry count is a multiple of 64 bytes' worth for the decode."""
    if not x_group:
        return 0, 0
    groups = hk // x_group
    cols = groups // UE8M0_PACK + 1 if x_sf == "ue8m0" else groups
    if x_storage == "col_tma":
        return cols, rows
    return rows, max(_align(cols, 32 // _XS_BYTES[x_sf]), cols)


def tile_ub_bytes(rows: int, hk: int, in_dtype: str, sf: str, x_group: int, x_sf: str, x_storage: str) -> int:
    """UB bytes of a task of ``rows`` tokens by ``hk`` channels: the multi-buffered x, data, stored-scale and raw
    input-scale tiles, the amax and inverse tiles (fp32, per block) and the decoded input scales, plus SLACK."""
    halves = 2 if sf == "ue8m0" else 1
    xr, xc = _input_tile(rows, hk, x_group, x_sf, x_storage)
    raw = xr * xc * _XS_BYTES[x_sf] if x_group else 0
    decoded = _align(xr * xc * (UE8M0_PACK if x_sf == "ue8m0" else 1), LANES) * 4 if x_group else 0
    versioned = rows * hk * IN_DTYPES[in_dtype] + rows * hk + hk * _SF_BYTES[sf] + raw
    return PLAN.stages * versioned + 2 * halves * hk * 4 + decoded + SLACK


def tiling(hidden: int, block: int, in_dtype: str, sf: str, x_group: int, x_sf: str, x_storage: str) -> Tiling:
    """The widest hidden tile that divides ``H``, is a multiple of 64 channels (and of the input group) and fits."""
    halves = 2 if sf == "ue8m0" else 1
    rows = block * halves
    unit = max(LANES, x_group)
    fitting = [hk for hk in range(unit, hidden + 1, unit) if hidden % hk == 0
               and tile_ub_bytes(rows, hk, in_dtype, sf, x_group, x_sf, x_storage) <= _build.UB_BUDGET_BYTES]
    if not fitting:
        raise limits.LimitError(f"per_channel_cast: no hidden tile of {unit} channels fits the UB at H={hidden}")
    hk = fitting[-1]
    xr, xc = _input_tile(rows, hk, x_group, x_sf, x_storage)
    return Tiling(rows, halves, hk, hidden // hk, xr, xc,
                  tile_ub_bytes(rows, hk, in_dtype, sf, x_group, x_sf, x_storage))


def check_key(where: str, hidden, block, in_dtype, sf, round_sf, x_group, x_sf, x_storage, num_cores) -> None:
    """:class:`limits.LimitError` unless the key is a supported per-channel cast."""
    limits.QUANT_HIDDEN.require(where, int(hidden))
    limits.IntRange("num_cores", 1).require(where, int(num_cores))
    if block not in TOKEN_BLOCKS:
        raise limits.LimitError(f"{where}: block must be one of {TOKEN_BLOCKS}; got {block}")
    if in_dtype not in IN_DTYPES:
        raise limits.LimitError(f"{where}: x must be one of {tuple(IN_DTYPES)}; got {in_dtype}")
    requant = in_dtype == "float8_e4m3fn"
    if requant != bool(x_group) or (not requant and (x_sf or x_storage)):
        raise limits.LimitError(f"{where}: float8_e4m3fn input comes with its per-token scales, and only it; got "
                                f"{in_dtype} with group {x_group}")
    try:  # the layouts' own rules (ue8m0 needs round_sf, e4m3 scales refuse it, ...)
        ScaleLayout((block, 1), "e4m3", sf, "row", bool(round_sf))
        if requant:
            if x_group not in INPUT_GROUPS:
                raise ValueError(f"the input group must be one of {INPUT_GROUPS}, got {x_group}")
            ScaleLayout((1, x_group), "e4m3", x_sf, x_storage, x_sf == "ue8m0")
    except (TypeError, ValueError) as exc:
        raise limits.LimitError(f"{where}: {exc}") from None



def build_per_channel_cast(hidden: int, block: int, in_dtype: str, sf: str, round_sf: bool, x_group: int, x_sf: str,
                           x_storage: str, num_cores: int):
    """prim_func(x (T,H) with row stride x_stride, data (T,H) e4m3, sf_out[, x_sf]): ``sf_out`` ``(nm, H)`` fp32 /
    e4m3 or ``(ceil(nm/2), H)`` int16; ``x_sf`` the per-token scales ``(T, nk)`` / ``(T, ceil(nk/2))`` int16 (row)
    or the ``(cols, T)`` buffer of ``col_tma``."""
    check_key("per_channel_cast", hidden, block, in_dtype, sf, round_sf, x_group, x_sf, x_storage, num_cores)
    layout = ScaleLayout((block, 1), "e4m3", sf, "row", bool(round_sf))
    H, r = int(hidden), int(block)
    til = tiling(H, r, in_dtype, sf, x_group, x_sf, x_storage)
    BM, halves, hk, n_tiles = til.rows, til.halves, til.hk, til.n_tiles
    stages = PLAN.stages
    n_chunks = hk // LANES
    requant = bool(x_group)
    ue8m0 = sf == "ue8m0"
    scale_of = scale_macro(layout)
    in_t = {"bfloat16": T.bfloat16, "float32": T.float32, "float8_e4m3fn": T.float8_e4m3fn}[in_dtype]
    sf_t = {"fp32": T.float32, "e4m3": T.float8_e4m3fn, "ue8m0": T.int16}[sf]
    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")
    sf_rows = T.dynamic("sf_rows")
    g = int(x_group)
    if requant:
        xs_t = {"fp32": T.float32, "e4m3": T.float8_e4m3fn, "ue8m0": T.int16}[x_sf]
        nk_in = H // g
        xs_gm_cols = -(-nk_in // UE8M0_PACK) if x_sf == "ue8m0" else nk_in
        xs_shape = (xs_gm_cols, num_tokens) if x_storage == "col_tma" else (num_tokens, xs_gm_cols)
        xr, xc = til.xs_rows, til.xs_cols
        col_in = x_storage == "col_tma"
        per_entry = UE8M0_PACK if x_sf == "ue8m0" else 1  # decoded entries per raw element
        n_dec = _align(xr * xc * per_entry, LANES)
        tile_groups = hk // g
    else:  # placeholders: no input scales
        xs_t, xs_shape, xr, xc, col_in, per_entry, n_dec, tile_groups = T.float32, (1, 1), 1, 8, False, 1, LANES, 1

    def sx_pos(r, gi, odd):
        """Flat entry (decoded) of the scale of token ``r`` of the tile, group ``gi`` of the hidden tile; ``odd``:
        the tile starts on the second byte of a UE8M0 word."""
        if x_sf == "ue8m0":
            b = gi + odd
            if col_in:
                return (b // UE8M0_PACK) * (UE8M0_PACK * xc) + UE8M0_PACK * r + b % UE8M0_PACK
            return r * (UE8M0_PACK * xc) + b
        return gi * xc + r if col_in else r * xc + gi

    @T.macro
    def value(x_ub, sx_ub, r, c, ge32, odd):
        """``v`` of the 64 channels ``c * 64 ..`` of row ``r`` of the tile, fp32."""
        if in_dtype == "bfloat16":
            return S.vcvt(S.vld(x_ub[r, c * LANES], dist="UNPK_B16"), T.float32, part=0)
        if in_dtype == "float32":
            return S.vld(x_ub[r, c * LANES])
        raw = S.vcvt(S.vld(x_ub[r, c * LANES], dist="UNPK4_B8"), T.float32, part=0)
        if g == 32:
            sx = S.vsel(S.vld(sx_ub[sx_pos(r, 2 * c + 1, odd)], dist="BRC_B32"),
                        S.vld(sx_ub[sx_pos(r, 2 * c, odd)], dist="BRC_B32"), ge32)
        else:
            sx = S.vld(sx_ub[sx_pos(r, c // (g // LANES), odd)], dist="BRC_B32")
        return S.vmul(raw, sx)

    @T.macro
    def cast_vf(x_ub, xs_ub, sx_ub, amax_ub, inv_ub, st_ub, out_ub, valid, odd):
        with T.SimdVF():
            lane = S.vci(0, T.int32)
            ge32 = S.vcmps(lane, 32, op="ge")
            acc = S.alloc_local((1,), T.float32)
            # 0. the input scales decoded to fp32 at their flat positions
            if requant and x_sf != "fp32":
                for v in T.serial(n_dec // LANES):
                    if x_sf == "e4m3":
                        S.vsts(sx_ub[v * LANES], S.vcvt(S.vld(xs_ub[v * LANES], dist="UNPK4_B8"), T.float32, part=0))
                    else:
                        e = S.vcvt(S.vld(xs_ub[v * LANES], dist="UNPK4_B8"), T.uint32, part=0)
                        S.vsts(sx_ub[v * LANES], T.reinterpret(S.vshls(e, 23), "float32x64"))
                S.mem_bar("VST_VLD")
            # 1. the amax of each block's channels
            for h in T.unroll(halves, explicit=True):
                for c in T.serial(n_chunks):
                    acc[0] = S.vdup(0.0, T.float32)
                    for rr in T.serial(T.max(T.min(valid, (h + 1) * r) - h * r, 0)):
                        acc[0] = S.vmax(acc[0], S.vabs(value(x_ub, sx_ub, h * r + rr, c, ge32, odd)))
                    S.vsts(amax_ub[h * hk + c * LANES], acc[0])
            S.mem_bar("VST_VLD")
            # 2. scales and inverses; UE8M0 words of the two blocks
            for c in T.serial(n_chunks):
                if ue8m0:
                    e0, inv0 = scale_of(S.vld(amax_ub[c * LANES]))
                    e1, inv1 = scale_of(S.vld(amax_ub[hk + c * LANES]))
                    S.vsts(inv_ub[c * LANES], inv0)
                    S.vsts(inv_ub[hk + c * LANES], inv1)
                    keep = S.vdup(T.if_then_else(valid > r, T.uint32(0xFFFFFFFF), T.uint32(0)), T.uint32)
                    word = S.vor(e0, S.vshls(S.vand(e1, keep), 8))
                    S.vsts(st_ub[c * LANES], T.reinterpret(word, "uint16x128"), dist="PK_B32")
                else:
                    s, inv = scale_of(S.vld(amax_ub[c * LANES]))
                    S.vsts(inv_ub[c * LANES], inv)
                    if sf == "e4m3":
                        S.vsts(st_ub[c * LANES], s, dist="PK4_B32")
                    else:
                        S.vsts(st_ub[c * LANES], s)
            S.mem_bar("VST_VLD")
            # 3. the data: Q(fl(v * inv)), inv of the row's block
            for rr in T.serial(valid):
                for c in T.serial(n_chunks):
                    q = S.vmul(value(x_ub, sx_ub, rr, c, ge32, odd), S.vld(inv_ub[(rr // r) * hk + c * LANES]))
                    S.vsts(out_ub[rr, c * LANES], S.vcvt(q, T.float8_e4m3fn, part=0), dist="PK4_B32")

    @T.macro
    def body(x, data, sf_out, x_sf_in):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((BM, hk), in_t)
            out_ub = T.alloc_shared((BM, hk), T.float8_e4m3fn)
            st_ub = T.alloc_shared((hk,), sf_t)
            amax_ub = T.alloc_shared((halves * hk,), T.float32)
            inv_ub = T.alloc_shared((halves * hk,), T.float32)
            xs_ub = T.alloc_shared((xr, xc), xs_t)
            sx_ub = T.alloc_shared((n_dec,), T.float32)
            versions = {x_ub: stages, out_ub: stages, st_ub: stages}
            if requant:
                versions[xs_ub] = stages
            T.annotate_buffer_versions(versions)
            xs_flat = T.view(xs_ub, (xr * xc * per_entry,), T.uint8 if x_sf == "ue8m0" else xs_t)
            sx_src = T.view(xs_ub, (xr * xc,), T.float32) if x_sf == "fp32" else sx_ub
            for tt, ht in T.Persistent([T.ceildiv(num_tokens, BM), n_tiles], num_cores, core_id,
                                       group_size=n_tiles, num_stages=stages):
                row = tt * BM
                valid = T.min(BM, num_tokens - row)
                h0 = ht * hk
                T.copy(x[row : row + valid, h0 : h0 + hk], x_ub[:valid, :], l2_cache_ctrl="NOTALLOC_KEEP")
                odd = 0
                if requant:
                    gi0 = h0 // g
                    if x_sf == "ue8m0":
                        odd = gi0 % UE8M0_PACK
                        w0 = gi0 // UE8M0_PACK
                        wext = (odd + tile_groups + UE8M0_PACK - 1) // UE8M0_PACK
                        if col_in:
                            T.copy(x_sf_in[w0 : w0 + wext, row : row + valid], xs_ub[:wext, :valid])
                        else:
                            T.copy(x_sf_in[row : row + valid, w0 : w0 + wext], xs_ub[:valid, :wext])
                    elif col_in:
                        T.copy(x_sf_in[gi0 : gi0 + tile_groups, row : row + valid], xs_ub[:tile_groups, :valid])
                    else:
                        T.copy(x_sf_in[row : row + valid, gi0 : gi0 + tile_groups], xs_ub[:valid, :tile_groups])
                cast_vf(x_ub, xs_flat, sx_src, amax_ub, inv_ub, st_ub, out_ub, valid, odd)
                T.copy(out_ub[:valid, :], data[row : row + valid, h0 : h0 + hk])
                T.copy(st_ub[:], sf_out[tt, h0 : h0 + hk])

    if requant:
        @T.prim_func
        def per_channel_cast_requant_asc(
            x: T.StridedTensor[(num_tokens, H), (x_stride, 1), in_t],
            data: T.Tensor[(num_tokens, H), T.float8_e4m3fn],
            sf_out: T.Tensor[(sf_rows, H), sf_t],
            x_sf_in: T.Tensor[xs_shape, xs_t],
        ):
            body(x, data, sf_out, x_sf_in)

        return per_channel_cast_requant_asc

    @T.prim_func
    def per_channel_cast_asc(
        x: T.StridedTensor[(num_tokens, H), (x_stride, 1), in_t],
        data: T.Tensor[(num_tokens, H), T.float8_e4m3fn],
        sf_out: T.Tensor[(sf_rows, H), sf_t],
    ):
        body(x, data, sf_out, None)

    return per_channel_cast_asc


_IN_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32", "torch.float8_e4m3fn": "float8_e4m3fn"}


def per_channel_cast_key(x, layout, x_layout, num_cores: int) -> PerChannelCastKey:
    """The key of a launch (``limits.LimitError`` outside the supported ranges)."""
    spec = ScaleLayout.parse(layout)
    if spec.kind != "per_channel":
        raise limits.LimitError(f"per_channel_cast: layout {spec.spec} is not per-channel")
    xl = None if x_layout is None else ScaleLayout.parse(x_layout)
    if xl is not None and xl.kind != "per_token":
        raise limits.LimitError(f"per_channel_cast: x_layout {xl.spec} is not per-token")
    in_dtype = _IN_DTYPE_NAMES.get(str(x.dtype), str(x.dtype))
    key = PerChannelCastKey(int(x.shape[-1]), spec.block[0], in_dtype, spec.sf, spec.round_sf,
                            xl.block[1] if xl else 0, xl.sf if xl else "", xl.storage if xl else "", int(num_cores))
    check_key("per_channel_cast", *(getattr(key, f.name) for f in dataclasses.fields(key)))
    return key


# the lowering cases: each output scale kind and token block, both plain inputs, re-quantization of the SM100
# activations (1x128 UE8M0 col_tma) and of 1x32 e4m3 / fp32 row scales
_CASES = {
    "bf16_ue8m0_b128": (128, "bfloat16", "ue8m0", True, 0, "", ""),
    "bf16_ue8m0_b32": (32, "bfloat16", "ue8m0", True, 0, "", ""),
    "f32_fp32_b128": (128, "float32", "fp32", False, 0, "", ""),
    "bf16_e4m3_b32": (32, "bfloat16", "e4m3", False, 0, "", ""),
    "requant_ue8m0_col_b128": (128, "float8_e4m3fn", "fp32", True, 128, "ue8m0", "col_tma"),
    "requant_e4m3_row_b32": (32, "float8_e4m3fn", "ue8m0", True, 32, "e4m3", "row"),
    "requant_fp32_col_b32": (32, "float8_e4m3fn", "fp32", False, 32, "fp32", "col_tma"),
}


def per_channel_cast_cases(hidden_size: int, hc_mult: int) -> dict:
    """The lowering cases at ``hidden_size`` (hc_mult unused), on the Ascend 950's vector cores."""
    del hc_mult
    return {f"per_channel_cast_{name}": PerChannelCastKey(hidden_size, *fields, ASCEND_CASE_CORES)
            for name, fields in _CASES.items()}


PER_CHANNEL_CAST = Kernel("per_channel_cast", PerChannelCastKey, build_per_channel_cast, cases=per_channel_cast_cases,
                          derive=lambda x, layout, x_sf, x_layout, data, sf: per_channel_cast_key(
                              x, layout, x_layout, num_vector_cores()))


def per_channel_cast(x, layout, x_sf, x_layout, data, sf) -> None:
    """x (T,H) bf16|fp32|e4m3 (+ x_sf in x_layout), layout (spec str) -> data, sf (pre-allocated for backend
    "ascend", overwritten). ``col_tma`` input scales are passed as their ``(cols, T)`` row-major buffer."""
    key = PER_CHANNEL_CAST.key(x, layout, x_sf, x_layout, data, sf)
    if x_sf is None:
        PER_CHANNEL_CAST.compiled(key)(x, data, sf)
    else:
        PER_CHANNEL_CAST.compiled(key)(x, data, sf, x_sf.t() if key.x_storage == "col_tma" else x_sf)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_CHANNEL_CAST)
