"""Ascend 950 kernel of ``per_token_cast`` (docs/ops/quant.md#per_token_cast): each group of ``g`` consecutive
channels of a row of ``x (T, H)`` (bf16 / fp32) gets one scale, and its values are cast to e4m3 or e2m1.

Scheme: a persistent loop over (token tile, hidden tile) tasks, ``BM`` tokens by ``hk`` channels, multi-buffered
(the loads of the next task and the stores of the previous one overlap this one's vector work). Ragged token
tails: the DMAs of the last tile are clamped to its valid rows (rows past them hold stale UB data, are computed
and never stored); a ragged last hidden tile (only where no hidden tile that fits the UB divides ``H``) likewise.
Three vector functions per task, all arithmetic fp32 (bf16 widened exactly):

1. **amax**: ``|x|`` 64 lanes at a time, ``vmax`` over the group's vectors (``g >= 64``) or lane masks of the
   vector (``g < 64``), ``vcmax`` to one value, stored (``ONEPT``) at the group's place in the scale tile:
   ``[token, group]`` (row storage, rows padded to ``KS`` entries) or ``[group, token]`` (``col_tma``: one
   64-lane vector per group, lane = token: the column-major scales come out transposed without a shuffle).
2. **scales**, elementwise over the scale tile, 64 at a time: ``a = max(amax, clamp)``; fp32 exact ``s = a / max``,
   ``inv = max / a`` (correctly rounded ``vdiv``); ``round_sf``: ``e = ((bits(a * fl(1 / max)) - 1) >> 23) + 1``
   (the exponent of ``2^ceil(log2(a / max))``), ``s = e << 23``, ``inv = (254 - e) << 23``; e4m3 scales
   ``s8 = e4m3(min(a / max, 448))``, ``inv = 1 / f32(s8)``. UE8M0 bytes are packed two per int16 word in
   registers (``word = e_even | e_odd << 8``: byte 0 is the even scale, little endian), the odd byte past the
   last scale zeroed.
3. **data**: ``fl(x * inv)`` with ``inv`` broadcast per group, then e4m3 by ``vcvt`` (round to nearest even,
   saturating), or e2m1: the two fp32 halves of 128 values deinterleaved, the high half made a bf16 with the low
   half as a sticky bit (``hi | min(lo, 1)``: exact for a one-bit-mantissa target, no double rounding) and
   ``vcvt`` bf16 -> e2m1 packs value ``2j`` in the low nibble of byte ``j``.

Scale tensors: ``row`` ``(T, nk)`` (fp32 / e4m3) or ``(T, ceil(nk / 2))`` int16 (UE8M0); ``col_tma`` is the
transposed view of a ``(cols, T)`` row-major buffer on Ascend (no padding), which the launcher passes as that
buffer (``sf.t()``).
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
# UB kept free of the tile formula's count (alignment of the buffer versions in the merged UB pool), as the
# mHC streaming kernels do
SLACK = 8 * 1024
GROUPS = tuple(cols for _, cols in BLOCKS["per_token"])  # the per-token groups g
IN_DTYPES = {"bfloat16": 2, "float32": 4}  # input dtype -> bytes
SF_TYPES = {"fp32": T.float32, "e4m3": T.float8_e4m3fn, "ue8m0": T.int16}  # a stored scale (UE8M0: int16 words)


@dataclasses.dataclass(frozen=True)
class TokenTilePlan:
    """Tiles of the cast: ``tokens`` rows per tile and ``stages`` UB versions of the x / data / scale tiles.
    The hidden tile is the widest that fits the UB (:func:`tiling`)."""

    tokens: int
    stages: int


# Row scales: 32 tokens per tile (the peer's choice, TileKernels' Ascend per_token_cast), which leaves the
# hidden tile wide. col_tma: 64 tokens, one 64-lane vector per group of the transposed scale tile. Two stages
# (load / compute / store overlap). Not measured yet: no Ascend 950 here (docs/perf/ascend950/quant.md to come).
ROW_PLAN = TokenTilePlan(tokens=32, stages=2)
COL_PLAN = TokenTilePlan(tokens=LANES, stages=2)


@compile_key
class PerTokenCastKey:
    """Compile-time key of the cast: the hidden size, the group, x's dtype, the layout's fields (data format,
    scale kind, storage, rounding) and the vector cores of the persistent grid (never the token count)."""

    hidden: int
    group: int
    in_dtype: str  # "bfloat16" | "float32"
    fmt: str  # "e4m3" | "e2m1"
    sf: str  # "fp32" | "e4m3" | "ue8m0"
    storage: str  # "row" | "col_tma"
    round_sf: bool
    num_cores: int
    variant: str = "cast"  # VARIANTS
    x_group: int = 0  # re-quantization (in_dtype "e4m3" | "e2m1"): the input's group, scales and storage
    x_sf: str = ""
    x_storage: str = ""


# the kernels of one builder: the cast, its scales alone, its data alone from given scales, re-quantization
VARIANTS = ("cast", "sf_only", "with_sf", "requant")
QUANT_IN = {"e4m3": 1, "e2m1": 0.5}  # re-quantized data formats -> bytes per value


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def plan_of(storage: str, x_storage: str = "") -> TokenTilePlan:
    """Column-major scales (written or, re-quantizing, read) take 64 tokens: one 64-lane vector per group."""
    return COL_PLAN if "col_tma" in (storage, x_storage) else ROW_PLAN


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The tiles of one key: ``hk`` channels per hidden tile (``n_tiles`` tiles, the last ``last`` channels wide),
    ``nk`` groups per tile, the scale tile's shape (``sf_rows`` x ``sf_cols`` entries, flat in 64-lane vectors) and
    the UB bytes the formula counts."""

    tokens: int
    stages: int
    hk: int
    n_tiles: int
    last: int
    nk: int
    sf_rows: int
    sf_cols: int
    ub_bytes: int

    @property
    def ragged(self) -> bool:
        return self.last != self.hk


def _scale_tile(storage: str, tokens: int, nk: int) -> tuple[int, int]:
    """(rows, cols) of the amax / scale tile: ``[token, group]`` with rows padded to a power of two of at least 32
    entries (32-byte DMA rows of any scale dtype; the UE8M0 pad byte found with a mask), or ``[group, token]``."""
    if storage == "col_tma":
        return nk + nk % 2, tokens
    return tokens, max(32, _pow2_at_least(nk))


def tile_ub_bytes(hk: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str, variant: str = "cast",
                  x_group: int = 0, x_sf: str = "", x_storage: str = "") -> int:
    """UB bytes of a hidden tile of ``hk`` channels: the multi-buffered x, data and stored-scale tiles and the
    amax and inverse-scale tiles (fp32), plus :data:`SLACK`; re-quantizing also the input's stored-scale tile
    (multi-buffered), its fp32 scales and the fp32 values."""
    plan = plan_of(storage, x_storage)
    bm = plan.tokens
    rows, cols = _scale_tile(storage, bm, hk // group)
    n = rows * cols
    data = 0 if variant == "sf_only" else bm * hk // (2 if fmt == "e2m1" else 1)
    stored = {"fp32": 4 * n, "e4m3": n, "ue8m0": n}[sf]  # UE8M0: int16 words of two scales
    in_bytes = QUANT_IN[in_dtype] if variant == "requant" else IN_DTYPES[in_dtype]
    versioned = int(bm * hk * in_bytes) + data + stored
    extra = 0
    if variant == "requant":
        xr, xc = _scale_tile(x_storage, bm, hk // x_group)
        versioned += {"fp32": 4, "e4m3": 1, "ue8m0": 1}[x_sf] * xr * xc
        extra = 4 * xr * xc + 4 * bm * hk
    return plan.stages * versioned + 2 * 4 * n + extra + SLACK


def tiling(hidden_size: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str, variant: str = "cast",
           x_group: int = 0, x_sf: str = "", x_storage: str = "") -> Tiling:
    """The hidden tile: the whole row where it fits the UB budget, else the widest divisor of ``H`` that fits and
    is a multiple of 128 channels (of 256 for UE8M0 words of 128-groups, so that no word straddles two tiles),
    unless that is under half the widest multiple that fits: then that one, with a ragged last tile."""
    plan = plan_of(storage, x_storage)
    unit = max(2 * g if (kind == "ue8m0" and 2 * g > 128) else 128 for g, kind in ((group, sf), (x_group, x_sf)))
    budget = _build.UB_BUDGET_BYTES
    extra = (variant, x_group, x_sf, x_storage)

    def fits(hk):
        return tile_ub_bytes(hk, group, in_dtype, fmt, sf, storage, *extra) <= budget

    def make(hk):
        n_tiles = -(-hidden_size // hk)
        rows, cols = _scale_tile(storage, plan.tokens, hk // group)
        return Tiling(plan.tokens, plan.stages, hk, n_tiles, hidden_size - (n_tiles - 1) * hk, hk // group, rows,
                      cols, tile_ub_bytes(hk, group, in_dtype, fmt, sf, storage, *extra))

    if fits(hidden_size):
        return make(hidden_size)
    widest = max((hk for hk in range(unit, hidden_size, unit) if fits(hk)), default=None)
    if widest is None:
        raise limits.LimitError(f"per_token_cast: no hidden tile of {unit} channels fits the UB at H={hidden_size}")
    divisors = [hk for hk in range(unit, widest + 1, unit) if hidden_size % hk == 0]
    return make(divisors[-1] if divisors and 2 * divisors[-1] >= widest else widest)


def check_key(where: str, hidden, group, in_dtype, fmt, sf, storage, round_sf, num_cores, variant="cast", x_group=0,
              x_sf="", x_storage="") -> None:
    """:class:`limits.LimitError` unless the key is a supported per-token cast."""
    limits.QUANT_HIDDEN.require(where, int(hidden))
    limits.IntRange("num_cores", 1).require(where, int(num_cores))
    if group not in GROUPS or hidden % group:
        raise limits.LimitError(f"{where}: group must be one of {GROUPS} and divide H={hidden}; got {group}")
    if variant not in VARIANTS:
        raise limits.LimitError(f"{where}: variant must be one of {VARIANTS}; got {variant!r}")
    inputs = QUANT_IN if variant == "requant" else IN_DTYPES
    if in_dtype not in inputs:
        raise limits.LimitError(f"{where}: x must be one of {tuple(inputs)}; got {in_dtype}")
    try:  # the layout's own rules (ue8m0 needs round_sf, e4m3 scales refuse it, ...)
        ScaleLayout((1, group), fmt, sf, storage, bool(round_sf))
        if variant == "requant":
            ScaleLayout((1, x_group), in_dtype, x_sf, x_storage, x_sf == "ue8m0")
    except (TypeError, ValueError) as exc:
        raise limits.LimitError(f"{where}: {exc}") from None



def _stored_tile(storage: str, sf: str, bm: int, hk: int, group: int) -> tuple:
    """``(rows, cols)`` of the fp32 entry tile of a scale tensor's tile (:func:`_scale_tile`) and the shape of its
    stored tile (UE8M0: int16 words of two entries, along the entry rows' pairs (col) or along a row)."""
    rows, cols = _scale_tile(storage, bm, hk // group)
    if sf != "ue8m0":
        return rows, cols, (rows, cols)
    return rows, cols, ((rows // 2, cols) if storage == "col_tma" else (rows, cols // 2))


def build_per_token_cast(hidden: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str,
                         round_sf: bool, num_cores: int, variant: str = "cast", x_group: int = 0, x_sf: str = "",
                         x_storage: str = ""):
    """prim_func(x (T,H) bf16|fp32 with row stride x_stride, data (T,H) e4m3 | (T,H/2) uint8, sf): ``sf`` is
    ``(T, nk)`` fp32 / e4m3 or ``(T, ceil(nk/2))`` int16 (row), or the ``(cols, T)`` buffer of ``col_tma``.
    Variants: ``(x, sf)`` (sf_only), ``(x, sf, data)`` (with_sf: ``sf`` read), ``(x, x_sf, data, sf)`` (requant:
    ``x`` e4m3 ``(T, H)`` or e2m1 bytes ``(T, H/2)``, row stride x_stride; ``x_sf`` its scales in the same forms)."""
    check_key("per_token_cast", hidden, group, in_dtype, fmt, sf, storage, round_sf, num_cores, variant, x_group,
              x_sf, x_storage)
    layout = ScaleLayout((1, group), fmt, sf, storage, bool(round_sf))
    H, g = int(hidden), int(group)
    requant = variant == "requant"
    writes_data, writes_sf = variant != "sf_only", variant != "with_sf"
    til = tiling(H, g, in_dtype, fmt, sf, storage, variant, x_group, x_sf, x_storage)
    BM, stages, hk, n_tiles = til.tokens, til.stages, til.hk, til.n_tiles
    sf_rows, sf_cols, st_shape = _stored_tile(storage, sf, BM, hk, g)
    n_vec = sf_rows * sf_cols // LANES  # 64-entry vectors of the amax / inverse tiles
    col = storage == "col_tma"
    ue8m0 = sf == "ue8m0"
    e2m1 = fmt == "e2m1"
    scale_of = scale_macro(layout)
    n_chunks = hk // LANES  # 64-channel vectors of a tile row
    per_vec = max(1, LANES // g)  # groups per vector (g < 64)
    vec_dtype = "float32" if requant else in_dtype  # what the cast reads: re-quantizing, the fp32 values
    data_t = T.uint8 if e2m1 else T.float8_e4m3fn
    data_cols, hk_data = (H // 2, hk // 2) if e2m1 else (H, hk)
    sf_t = SF_TYPES[sf]
    st_cols = st_shape[1]
    # the UE8M0 odd byte past the last scale (the last tile's group count odd): zeroed
    last_nk = til.last // g
    odd_pad = ue8m0 and last_nk % 2 == 1
    row_words = sf_cols // 2  # words per token row of the row tile (a power of two)
    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")
    sf_gm_cols = -(-H // g // 2) if ue8m0 else H // g
    sf_shape = (sf_gm_cols, num_tokens) if col else (num_tokens, sf_gm_cols)
    if requant:  # the input: its data bytes and its scales' tiles
        x_t, x_cols, hk_x = (T.uint8, H // 2, hk // 2) if in_dtype == "e2m1" else (T.float8_e4m3fn, H, hk)
        xg, xcol = int(x_group), x_storage == "col_tma"
        x_rows_, x_cols_, xst_shape = _stored_tile(x_storage, x_sf, BM, hk, xg)
        xs_t, x_vec = SF_TYPES[x_sf], x_rows_ * x_cols_ // LANES
        x_gm_cols = -(-H // xg // 2) if x_sf == "ue8m0" else H // xg
        x_sf_shape = (x_gm_cols, num_tokens) if xcol else (num_tokens, x_gm_cols)
    else:
        x_t, x_cols, hk_x = (T.bfloat16 if in_dtype == "bfloat16" else T.float32), H, hk
        xg, xcol, x_rows_, x_cols_, xst_shape, xs_t, x_vec = LANES, False, 1, LANES, (1, LANES), T.float32, 1
        x_sf_shape = (1, 1)
    # buffers a variant does not use are kept as small placeholders (one parameter list for every variant)
    out_shape = (BM, hk_data) if writes_data else (1, 256)
    v_shape = (BM, hk) if requant else (1, LANES)

    def pos(r, gi):
        """Flat entry of (token r, group gi of the tile) in the amax / inverse tiles."""
        return gi * sf_cols + r if col else r * sf_cols + gi

    def pos_x(r, gi):
        """The same in the input's fp32 scale tile (re-quantizing)."""
        return gi * x_cols_ + r if xcol else r * x_cols_ + gi

    def loadf32(x_ub, r, c):
        """64 channels ``c..c+63`` of row ``r`` as fp32 (bf16 widened exactly)."""
        if vec_dtype == "bfloat16":
            return S.vcvt(S.vld(x_ub[r, c], dist="UNPK_B16"), T.float32, part=0)
        return S.vld(x_ub[r, c])

    def group_vec(tile_ub, at, gg, r, c, ge1, ge2, ge3):
        """The value of the group (of ``gg`` channels) of each lane of the 64-channel vector ``c`` of row ``r``,
        from a tile of one fp32 value per group (``at(r, group)`` its flat entry); ``ge<k>``: lane >= k gg."""
        if gg >= LANES:
            return S.vld(tile_ub[at(r, c // (gg // LANES))], dist="BRC_B32")
        first = S.vsel(S.vld(tile_ub[at(r, (LANES // gg) * c + 1)], dist="BRC_B32"),
                       S.vld(tile_ub[at(r, (LANES // gg) * c)], dist="BRC_B32"), ge1)
        if gg == 32:
            return first
        second = S.vsel(S.vld(tile_ub[at(r, 4 * c + 2)], dist="BRC_B32"), first, ge2)
        return S.vsel(S.vld(tile_ub[at(r, 4 * c + 3)], dist="BRC_B32"), second, ge3)

    @T.macro
    def decode_tile(st_ub, kind, tile_col, tile_cols, vectors, out_ub, inverse):
        """The fp32 scales of a stored scale tile (``inverse``: their inverses ``fl(1 / s)``), entry by entry into
        ``out_ub``: fp32 as is, e4m3 widened, a UE8M0 byte ``e`` as the bits ``e << 23``."""
        one = S.vdup(1.0, T.float32)
        byte = S.vdup(255, T.uint32)
        if kind == "ue8m0":
            for p in T.unroll(vectors // 2, explicit=True):
                w = T.reinterpret(S.vld(st_ub[p * LANES // tile_cols, p * LANES % tile_cols], dist="UNPK_B16"),
                                  "uint32x64")
                low = S.vand(w, byte)
                high = S.vand(S.vshrs(w, 8), byte)
                if tile_col:  # word row p: entry rows 2p (low bytes) and 2p + 1
                    s0 = T.reinterpret(S.vshls(low, 23), "float32x64")
                    s1 = T.reinterpret(S.vshls(high, 23), "float32x64")
                else:  # words j of a token row: entries 2j (low bytes), 2j + 1
                    e0, e1 = S.vintlv(low, high)
                    s0 = T.reinterpret(S.vshls(e0, 23), "float32x64")
                    s1 = T.reinterpret(S.vshls(e1, 23), "float32x64")
                if inverse:
                    S.vsts(out_ub[2 * p * LANES], S.vdiv(one, s0))
                    S.vsts(out_ub[(2 * p + 1) * LANES], S.vdiv(one, s1))
                else:
                    S.vsts(out_ub[2 * p * LANES], s0)
                    S.vsts(out_ub[(2 * p + 1) * LANES], s1)
        else:
            for v in T.unroll(vectors, explicit=True):
                if kind == "e4m3":
                    s = S.vcvt(S.vld(st_ub[v * LANES // tile_cols, v * LANES % tile_cols], dist="UNPK4_B8"),
                               T.float32)
                else:
                    s = S.vld(st_ub[v * LANES // tile_cols, v * LANES % tile_cols])
                if inverse:
                    S.vsts(out_ub[v * LANES], S.vdiv(one, s))
                else:
                    S.vsts(out_ub[v * LANES], s)

    @T.macro
    def cast_vf(x_ub, amax_ub, inv_ub, st_ub, out_ub, valid, is_last):
        with T.SimdVF():
            # lanes [q*g, (q+1)*g) of a 64-lane vector: group q of the vector (g < 64)
            every = S.pset(32, "PAT_ALL")
            lane = S.vci(0, T.int32)
            ge1 = S.vcmps(lane, g, op="ge")
            ge2 = S.vcmps(lane, 2 * g, op="ge")
            ge3 = S.vcmps(lane, 3 * g, op="ge")
            mk0 = S.pnot(ge1, every)
            mk1 = S.pand(ge1, S.pnot(ge2, every), every)
            mk2 = S.pand(ge2, S.pnot(ge3, every), every)
            mk3 = ge3
            if variant == "with_sf":
                # the given scales' inverses fl(1 / s)
                decode_tile(st_ub, sf, col, st_cols, n_vec, inv_ub, True)
            else:
                # 1. the amax of each group, stored at its entry of the amax tile
                for r in T.serial(valid):
                    if g >= LANES:
                        for gi in T.serial(hk // g):
                            m = S.vabs(loadf32(x_ub, r, gi * g))
                            if g == 2 * LANES:
                                m = S.vmax(m, S.vabs(loadf32(x_ub, r, gi * g + LANES)))
                            S.vsts(amax_ub[pos(r, gi)], S.vcmax(m), dist="ONEPT_B32")
                    else:
                        for c in T.serial(n_chunks):
                            a = S.vabs(loadf32(x_ub, r, c * LANES))
                            S.vsts(amax_ub[pos(r, c * per_vec)], S.vcmax(a, mk0), dist="ONEPT_B32")
                            S.vsts(amax_ub[pos(r, c * per_vec + 1)], S.vcmax(a, mk1), dist="ONEPT_B32")
                            if g == 16:
                                S.vsts(amax_ub[pos(r, c * per_vec + 2)], S.vcmax(a, mk2), dist="ONEPT_B32")
                                S.vsts(amax_ub[pos(r, c * per_vec + 3)], S.vcmax(a, mk3), dist="ONEPT_B32")
                S.mem_bar("VST_VLD")
                # 2. scales and inverses, 64 entries at a time; UE8M0 bytes packed two per word
                if ue8m0:
                    zero = S.vdup(0, T.uint32)
                    for p in T.unroll(n_vec // 2, explicit=True):
                        e0, inv0 = scale_of(S.vld(amax_ub[2 * p * LANES]))
                        e1, inv1 = scale_of(S.vld(amax_ub[(2 * p + 1) * LANES]))
                        S.vsts(inv_ub[2 * p * LANES], inv0)
                        S.vsts(inv_ub[(2 * p + 1) * LANES], inv1)
                        if col:
                            # entry rows 2p, 2p+1 ([group, token]) make word row p
                            if odd_pad:
                                drop = T.if_then_else(is_last, T.uint32(0), T.uint32(0xFFFFFFFF))
                                keep = S.vdup(T.if_then_else(2 * p + 1 == last_nk, drop, T.uint32(0xFFFFFFFF)),
                                              T.uint32)
                                word = S.vor(e0, S.vshls(S.vand(e1, keep), 8))
                            else:
                                word = S.vor(e0, S.vshls(e1, 8))
                        else:
                            # entries 2j, 2j+1 of a token row (rows of an even entry count) make its word j
                            even, odd = S.vdintlv(e0, e1)
                            if odd_pad:
                                word_of_row = S.vand(S.vadds(lane, p * LANES), S.vdup(row_words - 1, T.int32))
                                hit = T.if_then_else(is_last, last_nk // 2, row_words)  # row_words: no word
                                odd = S.vsel(zero, odd, S.vcmps(word_of_row, hit, op="eq"))
                            word = S.vor(even, S.vshls(odd, 8))
                        S.vsts(st_ub[p * LANES // st_cols, p * LANES % st_cols], T.reinterpret(word, "uint16x128"),
                               dist="PK_B32")
                else:
                    for v in T.unroll(n_vec, explicit=True):
                        s, inv = scale_of(S.vld(amax_ub[v * LANES]))
                        S.vsts(inv_ub[v * LANES], inv)
                        if sf == "e4m3":
                            S.vsts(st_ub[v * LANES // st_cols, v * LANES % st_cols], s, dist="PK4_B32")
                        else:
                            S.vsts(st_ub[v * LANES // st_cols, v * LANES % st_cols], s)
            # 3. the data: fl(x * inv), narrowed
            if writes_data:
                S.mem_bar("VST_VLD")
                for r in T.serial(valid):
                    if e2m1:
                        for p in T.serial(n_chunks // 2):
                            q0 = S.vmul(loadf32(x_ub, r, 2 * p * LANES),
                                        group_vec(inv_ub, pos, g, r, 2 * p, ge1, ge2, ge3))
                            q1 = S.vmul(loadf32(x_ub, r, (2 * p + 1) * LANES),
                                        group_vec(inv_ub, pos, g, r, 2 * p + 1, ge1, ge2, ge3))
                            low, high = S.vdintlv(T.reinterpret(q0, "uint16x128"), T.reinterpret(q1, "uint16x128"))
                            sticky = T.reinterpret(S.vor(high, S.vmins(low, 1)), "bfloat16x128")
                            fp4 = S.vcvt(sticky, T.float4_e2m1fn, part=0)
                            S.vsts(out_ub[r, p * LANES], T.reinterpret(fp4, "uint8x256"), dist="PK4_B32")
                    else:
                        for c in T.serial(n_chunks):
                            q = S.vmul(loadf32(x_ub, r, c * LANES), group_vec(inv_ub, pos, g, r, c, ge1, ge2, ge3))
                            S.vsts(out_ub[r, c * LANES], S.vcvt(q, T.float8_e4m3fn, part=0), dist="PK4_B32")

    @T.macro
    def dequant_vf(x_ub, x4_ub, xs_ub, sx_ub, v_ub, valid):
        """Re-quantizing (Ascend's order): the values ``v = fl(f32(data) * sx)`` of the tile, fp32, into ``v_ub``."""
        with T.SimdVF():
            lane = S.vci(0, T.int32)
            xge1 = S.vcmps(lane, xg, op="ge")
            xge2 = S.vcmps(lane, 2 * xg, op="ge")
            xge3 = S.vcmps(lane, 3 * xg, op="ge")
            decode_tile(xs_ub, x_sf, xcol, xst_shape[1], x_vec, sx_ub, False)
            S.mem_bar("VST_VLD")
            for r in T.serial(valid):
                if in_dtype == "e2m1":  # 128 values (64 bytes) at a time, widened through bf16 (exact)
                    for p in T.serial(n_chunks // 2):
                        wide = S.vcvt(S.vld(x4_ub[r, 2 * p * LANES], dist="UNPK4_B8"), T.bfloat16)
                        d0, d1 = S.vintlv(S.vcvt(wide, T.float32, part=0), S.vcvt(wide, T.float32, part=1))
                        S.vsts(v_ub[r, 2 * p * LANES], S.vmul(d0, group_vec(sx_ub, pos_x, xg, r, 2 * p, xge1, xge2,
                                                                              xge3)))
                        S.vsts(v_ub[r, (2 * p + 1) * LANES], S.vmul(d1, group_vec(sx_ub, pos_x, xg, r, 2 * p + 1, xge1,
                                                                                    xge2, xge3)))
                else:
                    for c in T.serial(n_chunks):
                        d = S.vcvt(S.vld(x_ub[r, c * LANES], dist="UNPK4_B8"), T.float32)
                        S.vsts(v_ub[r, c * LANES], S.vmul(d, group_vec(sx_ub, pos_x, xg, r, c, xge1, xge2, xge3)))

    @T.macro
    def copy_scales(gm, ub, kind, tile_col, gg, row, valid, h0, ext, load):
        """A tile's scales between the scale tensor ``gm`` and its stored tile ``ub`` (``load``: into the tile)."""
        groups = ext // gg
        if kind == "ue8m0":
            w0 = h0 // (2 * gg)
            wext = (groups + 1) // 2
            if tile_col:
                if load:
                    T.copy(gm[w0 : w0 + wext, row : row + valid], ub[:wext, :valid])
                else:
                    T.copy(ub[:wext, :valid], gm[w0 : w0 + wext, row : row + valid])
            elif load:
                T.copy(gm[row : row + valid, w0 : w0 + wext], ub[:valid, :wext])
            else:
                T.copy(ub[:valid, :wext], gm[row : row + valid, w0 : w0 + wext])
        elif tile_col:
            if load:
                T.copy(gm[h0 // gg : h0 // gg + groups, row : row + valid], ub[:groups, :valid])
            else:
                T.copy(ub[:groups, :valid], gm[h0 // gg : h0 // gg + groups, row : row + valid])
        elif load:
            T.copy(gm[row : row + valid, h0 // gg : h0 // gg + groups], ub[:valid, :groups])
        else:
            T.copy(ub[:valid, :groups], gm[row : row + valid, h0 // gg : h0 // gg + groups])

    @T.macro
    def body(x, x_sf_gm, data, sf_gm):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((BM, hk_x), x_t)
            out_ub = T.alloc_shared(out_shape, data_t)
            amax_ub = T.alloc_shared((sf_rows * sf_cols,), T.float32)
            inv_ub = T.alloc_shared((sf_rows * sf_cols,), T.float32)
            st_ub = T.alloc_shared(st_shape, sf_t)
            xs_ub = T.alloc_shared(xst_shape, xs_t)
            sx_ub = T.alloc_shared((x_rows_ * x_cols_,), T.float32)
            v_ub = T.alloc_shared(v_shape, T.float32)
            versions = {x_ub: stages, st_ub: stages}  # the placeholders of a variant are not multi-buffered
            if writes_data:
                versions[out_ub] = stages
            if requant:
                versions[xs_ub] = stages
            T.annotate_buffer_versions(versions)
            for tt, ht in T.Persistent([T.ceildiv(num_tokens, BM), n_tiles], num_cores, core_id,
                                       group_size=n_tiles, num_stages=stages):
                row = tt * BM
                valid = T.min(BM, num_tokens - row)
                h0 = ht * hk
                is_last = ht == n_tiles - 1
                ext = T.if_then_else(is_last, til.last, hk) if til.ragged else hk
                groups = ext // g
                if requant and in_dtype == "e2m1":
                    T.copy(x[row : row + valid, h0 // 2 : h0 // 2 + ext // 2], x_ub[:valid, : ext // 2],
                           l2_cache_ctrl="NOTALLOC_KEEP")
                else:
                    T.copy(x[row : row + valid, h0 : h0 + ext], x_ub[:valid, :ext], l2_cache_ctrl="NOTALLOC_KEEP")
                if requant:
                    copy_scales(x_sf_gm, xs_ub, x_sf, xcol, xg, row, valid, h0, ext, True)
                    if in_dtype == "e2m1":  # the bytes seen as FP4 values for the widening load
                        dequant_vf(x_ub, T.Tensor((BM, hk), T.float4_e2m1fn, x_ub.data), xs_ub, sx_ub, v_ub, valid)
                    else:
                        dequant_vf(x_ub, x_ub, xs_ub, sx_ub, v_ub, valid)
                    cast_vf(v_ub, amax_ub, inv_ub, st_ub, out_ub, valid, is_last)
                else:
                    if variant == "with_sf":
                        copy_scales(sf_gm, st_ub, sf, col, g, row, valid, h0, ext, True)
                    cast_vf(x_ub, amax_ub, inv_ub, st_ub, out_ub, valid, is_last)
                if writes_data:
                    if e2m1:
                        T.copy(out_ub[:valid, : ext // 2], data[row : row + valid, h0 // 2 : h0 // 2 + ext // 2])
                    else:
                        T.copy(out_ub[:valid, :ext], data[row : row + valid, h0 : h0 + ext])
                if writes_sf:
                    copy_scales(sf_gm, st_ub, sf, col, g, row, valid, h0, ext, False)

    x_param = T.StridedTensor[(num_tokens, x_cols), (x_stride, 1), x_t]
    data_param = T.Tensor[(num_tokens, data_cols), data_t]
    sf_param = T.Tensor[sf_shape, sf_t]
    if variant == "sf_only":
        @T.prim_func
        def per_token_cast_sf_asc(x: x_param, sf_out: sf_param):
            body(x, None, None, sf_out)
        return per_token_cast_sf_asc
    if variant == "with_sf":
        @T.prim_func
        def per_token_cast_with_sf_asc(x: x_param, sf: sf_param, data: data_param):
            body(x, None, data, sf)
        return per_token_cast_with_sf_asc
    if requant:
        x_sf_param = T.Tensor[x_sf_shape, xs_t]

        @T.prim_func
        def per_token_cast_requant_asc(x: x_param, x_sf: x_sf_param, data: data_param, sf_out: sf_param):
            body(x, x_sf, data, sf_out)
        return per_token_cast_requant_asc

    @T.prim_func
    def per_token_cast_asc(x: x_param, data: data_param, sf_out: sf_param):
        body(x, None, data, sf_out)
    return per_token_cast_asc


_IN_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def per_token_cast_key(x, layout, num_cores: int, variant: str = "cast", x_layout=None) -> PerTokenCastKey:
    """The key of a launch (``limits.LimitError`` outside the supported ranges); re-quantizing, ``x_layout`` is
    the input's layout and the key's ``in_dtype`` its data format."""
    spec = ScaleLayout.parse(layout)
    if spec.kind != "per_token":
        raise limits.LimitError(f"per_token_cast: layout {spec.spec} is not per-token")
    if x_layout is None:
        in_dtype, hidden, extra = _IN_DTYPE_NAMES.get(str(x.dtype), str(x.dtype)), int(x.shape[-1]), ()
    else:
        source = ScaleLayout.parse(x_layout)
        if source.kind != "per_token":
            raise limits.LimitError(f"per_token_cast: x_layout {source.spec} is not per-token")
        in_dtype, hidden = source.fmt, source.hidden_of(x)
        extra = (source.block[1], source.sf, source.storage)
    key = PerTokenCastKey(hidden, spec.block[1], in_dtype, spec.fmt, spec.sf, spec.storage, spec.round_sf,
                          int(num_cores), variant, *extra)
    check_key("per_token_cast", *(getattr(key, f.name) for f in dataclasses.fields(key)))
    return key


# the lowering cases: the layouts DeepGEMM (SM90 fp32, SM100 UE8M0 col_tma) and the FP4 paths (MXFP4 1x32 UE8M0,
# 1x16) load, each scale kind, storage, rounding and group path, both input dtypes
_CASES = {
    "e4m3_fp32_row_g128_bf16": (128, "bfloat16", "e4m3", "fp32", "row", False),
    "e4m3_fp32_row_g128_f32": (128, "float32", "e4m3", "fp32", "row", False),
    "e4m3_fp32_round_col_g128_bf16": (128, "bfloat16", "e4m3", "fp32", "col_tma", True),
    "e4m3_ue8m0_col_g128_bf16": (128, "bfloat16", "e4m3", "ue8m0", "col_tma", True),
    "e4m3_ue8m0_row_g128_bf16": (128, "bfloat16", "e4m3", "ue8m0", "row", True),
    "e4m3_e4m3_row_g64_bf16": (64, "bfloat16", "e4m3", "e4m3", "row", False),
    "e2m1_ue8m0_row_g32_bf16": (32, "bfloat16", "e2m1", "ue8m0", "row", True),
    "e2m1_fp32_col_g16_bf16": (16, "bfloat16", "e2m1", "fp32", "col_tma", False),
}
# one case per variant (the CPU tier's time): the scales alone and the data from given scales of SM100's UE8M0
# col_tma layout (the words' bytes read back), MXFP4 (e2m1, UE8M0 1x32 row) re-quantized to SM100's layout
_VARIANT_CASES = {
    "per_token_cast_sf_e4m3_ue8m0_col_bf16": ((128, "bfloat16", "e4m3", "ue8m0", "col_tma", True), ("sf_only",)),
    "per_token_cast_with_sf_e4m3_ue8m0_col_f32": ((128, "float32", "e4m3", "ue8m0", "col_tma", True), ("with_sf",)),
    "per_token_cast_requant_e2m1_ue8m0_g32_to_e4m3_ue8m0_col": ((128, "e2m1", "e4m3", "ue8m0", "col_tma", True),
                                                                ("requant", 32, "ue8m0", "row")),
}


def per_token_cast_cases(hidden_size: int, hc_mult: int) -> dict:
    """The lowering cases at ``hidden_size`` (hc_mult unused): every data format, scale kind, storage and input
    dtype, on the Ascend 950's vector cores, and re-quantization."""
    del hc_mult
    cases = {f"per_token_cast_{name}": PerTokenCastKey(hidden_size, group, in_dtype, fmt, sf, storage, round_sf,
                                                       ASCEND_CASE_CORES)
             for name, (group, in_dtype, fmt, sf, storage, round_sf) in _CASES.items()}
    return {**cases, **_variant_cases(hidden_size, "per_token_cast_requant")}


def _variant_cases(hidden_size: int, prefix: str) -> dict:
    return {name: PerTokenCastKey(hidden_size, *fields, ASCEND_CASE_CORES, *variant)
            for name, (fields, variant) in _VARIANT_CASES.items() if name.startswith(prefix + "_")}


PER_TOKEN_CAST = Kernel("per_token_cast", PerTokenCastKey, build_per_token_cast, cases=per_token_cast_cases,
                        derive=lambda x, layout, x_layout=None: per_token_cast_key(
                            x, layout, num_vector_cores(), "cast" if x_layout is None else "requant", x_layout))
PER_TOKEN_CAST_SF = Kernel("per_token_cast_sf", PerTokenCastKey, build_per_token_cast,
                           cases=lambda hidden_size, hc_mult: _variant_cases(hidden_size, "per_token_cast_sf"),
                           derive=lambda x, layout: per_token_cast_key(x, layout, num_vector_cores(), "sf_only"))
PER_TOKEN_CAST_WITH_SF = Kernel("per_token_cast_with_sf", PerTokenCastKey, build_per_token_cast,
                                cases=lambda hidden_size, hc_mult: _variant_cases(hidden_size,
                                                                                  "per_token_cast_with_sf"),
                                derive=lambda x, layout: per_token_cast_key(x, layout, num_vector_cores(),
                                                                            "with_sf"))


def _sf_arg(sf, storage: str):
    """``col_tma`` scales as their ``(cols, T)`` row-major buffer (no padding on Ascend)."""
    return sf.t() if storage == "col_tma" else sf


def per_token_cast(x, layout, x_sf, x_layout, data, sf) -> None:
    """x (T,H) bf16|fp32, layout (spec str) -> data, sf (pre-allocated in the layout for backend "ascend",
    overwritten); with x_sf / x_layout, x is re-quantized. ``col_tma`` scales are passed as their ``(cols, T)``
    row-major buffer. Current stream, no sync."""
    key = PER_TOKEN_CAST.key(x, layout, x_layout)
    if x_sf is None:
        PER_TOKEN_CAST.compiled(key)(x, data, _sf_arg(sf, key.storage))
    else:
        PER_TOKEN_CAST.compiled(key)(x, _sf_arg(x_sf, key.x_storage), data, _sf_arg(sf, key.storage))


def per_token_cast_sf(x, layout, sf) -> None:
    """The scales alone: writes ``sf`` (the layout for backend "ascend")."""
    key = PER_TOKEN_CAST_SF.key(x, layout)
    PER_TOKEN_CAST_SF.compiled(key)(x, _sf_arg(sf, key.storage))


def per_token_cast_with_sf(x, sf, layout, data) -> None:
    """The data alone from the given scales ``sf`` (read): writes ``data``."""
    key = PER_TOKEN_CAST_WITH_SF.key(x, layout)
    PER_TOKEN_CAST_WITH_SF.compiled(key)(x, _sf_arg(sf, key.storage), data)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_TOKEN_CAST, PER_TOKEN_CAST_SF, PER_TOKEN_CAST_WITH_SF)
