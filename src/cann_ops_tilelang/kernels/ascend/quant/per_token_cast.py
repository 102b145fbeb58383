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
import struct

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES
from ....quant import BLOCKS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores

LANES = 64  # fp32 lanes of one 256-byte vector register
# UB kept free of the tile formula's count (alignment of the buffer versions in the merged UB pool), as the
# mHC streaming kernels do
SLACK = 8 * 1024
GROUPS = tuple(cols for _, cols in BLOCKS["per_token"])  # the per-token groups g
IN_DTYPES = {"bfloat16": 2, "float32": 4}  # input dtype -> bytes


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


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def plan_of(storage: str) -> TokenTilePlan:
    return COL_PLAN if storage == "col_tma" else ROW_PLAN


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


def tile_ub_bytes(hk: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str) -> int:
    """UB bytes of a hidden tile of ``hk`` channels: the multi-buffered x, data and stored-scale tiles and the
    amax and inverse-scale tiles (fp32), plus :data:`SLACK`."""
    plan = plan_of(storage)
    bm = plan.tokens
    rows, cols = _scale_tile(storage, bm, hk // group)
    n = rows * cols
    data = bm * hk // (2 if fmt == "e2m1" else 1)
    stored = {"fp32": 4 * n, "e4m3": n, "ue8m0": n}[sf]  # UE8M0: int16 words of two scales
    versioned = bm * hk * IN_DTYPES[in_dtype] + data + stored
    return plan.stages * versioned + 2 * 4 * n + SLACK


def tiling(hidden_size: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str) -> Tiling:
    """The hidden tile: the whole row where it fits the UB budget, else the widest divisor of ``H`` that fits and
    is a multiple of 128 channels (of 256 for UE8M0 words of 128-groups, so that no word straddles two tiles),
    unless that is under half the widest multiple that fits: then that one, with a ragged last tile."""
    plan = plan_of(storage)
    unit = 2 * group if (sf == "ue8m0" and 2 * group > 128) else 128
    budget = _build.UB_BUDGET_BYTES

    def fits(hk):
        return tile_ub_bytes(hk, group, in_dtype, fmt, sf, storage) <= budget

    def make(hk):
        n_tiles = -(-hidden_size // hk)
        rows, cols = _scale_tile(storage, plan.tokens, hk // group)
        return Tiling(plan.tokens, plan.stages, hk, n_tiles, hidden_size - (n_tiles - 1) * hk, hk // group, rows,
                      cols, tile_ub_bytes(hk, group, in_dtype, fmt, sf, storage))

    if fits(hidden_size):
        return make(hidden_size)
    widest = max((hk for hk in range(unit, hidden_size, unit) if fits(hk)), default=None)
    if widest is None:
        raise limits.LimitError(f"per_token_cast: no hidden tile of {unit} channels fits the UB at H={hidden_size}")
    divisors = [hk for hk in range(unit, widest + 1, unit) if hidden_size % hk == 0]
    return make(divisors[-1] if divisors and 2 * divisors[-1] >= widest else widest)


def check_key(where: str, hidden, group, in_dtype, fmt, sf, storage, round_sf, num_cores) -> None:
    """:class:`limits.LimitError` unless the key is a supported per-token cast."""
    limits.QUANT_HIDDEN.require(where, int(hidden))
    limits.IntRange("num_cores", 1).require(where, int(num_cores))
    if group not in GROUPS or hidden % group:
        raise limits.LimitError(f"{where}: group must be one of {GROUPS} and divide H={hidden}; got {group}")
    if in_dtype not in IN_DTYPES:
        raise limits.LimitError(f"{where}: x must be one of {tuple(IN_DTYPES)}; got {in_dtype}")
    try:  # the layout's own rules (ue8m0 needs round_sf, e4m3 scales refuse it, ...)
        ScaleLayout((1, group), fmt, sf, storage, bool(round_sf))
    except (TypeError, ValueError) as exc:
        raise limits.LimitError(f"{where}: {exc}") from None


def _f32(value: float) -> float:
    """``value`` rounded to fp32 (a constant the kernel uses as fp32)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def build_per_token_cast(hidden: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str,
                         round_sf: bool, num_cores: int):
    """prim_func(x (T,H) bf16|fp32 with row stride x_stride, data (T,H) e4m3 | (T,H/2) uint8, sf): ``sf`` is
    ``(T, nk)`` fp32 / e4m3 or ``(T, ceil(nk/2))`` int16 (row), or the ``(cols, T)`` buffer of ``col_tma``."""
    check_key("per_token_cast", hidden, group, in_dtype, fmt, sf, storage, round_sf, num_cores)
    layout = ScaleLayout((1, group), fmt, sf, storage, bool(round_sf))
    H, g = int(hidden), int(group)
    til = tiling(H, g, in_dtype, fmt, sf, storage)
    BM, stages, hk, n_tiles = til.tokens, til.stages, til.hk, til.n_tiles
    sf_rows, sf_cols = til.sf_rows, til.sf_cols
    n_vec = sf_rows * sf_cols // LANES  # 64-entry vectors of the amax / inverse tiles
    col = storage == "col_tma"
    ue8m0 = sf == "ue8m0"
    e2m1 = fmt == "e2m1"
    fmax = float(layout.fmax)
    clamp = _f32(layout.amax_clamp)
    inv_fmax = _f32(1.0 / fmax)  # fl(1 / max): the round_sf recipe (docs/ops/quant.md#layout)
    n_chunks = hk // LANES  # 64-channel vectors of a tile row
    per_vec = max(1, LANES // g)  # groups per vector (g < 64)
    vec_per_group = max(1, g // LANES)  # vectors per group (g >= 64)
    in_t = T.bfloat16 if in_dtype == "bfloat16" else T.float32
    data_t = T.uint8 if e2m1 else T.float8_e4m3fn
    data_cols, hk_data = (H // 2, hk // 2) if e2m1 else (H, hk)
    sf_gm_cols = -(-H // g // 2) if ue8m0 else H // g
    sf_t = {"fp32": T.float32, "e4m3": T.float8_e4m3fn, "ue8m0": T.int16}[sf]
    if ue8m0:  # int16 words, two entries of the amax tile each
        st_shape = (sf_rows // 2, sf_cols) if col else (sf_rows, sf_cols // 2)
    else:
        st_shape = (sf_rows, sf_cols)
    st_cols = st_shape[1]
    # the UE8M0 odd byte past the last scale (the last tile's group count odd): zeroed
    last_nk = til.last // g
    odd_pad = ue8m0 and last_nk % 2 == 1
    row_words = sf_cols // 2  # words per token row of the row tile (a power of two)
    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")
    sf_shape = (sf_gm_cols, num_tokens) if col else (num_tokens, sf_gm_cols)

    def pos(r, gi):
        """Flat entry of (token r, group gi of the tile) in the amax / inverse tiles."""
        return gi * sf_cols + r if col else r * sf_cols + gi

    def st_at(st_ub, flat):
        """The stored scale tile at its row-major entry ``flat``."""
        return st_ub[flat // st_cols, flat % st_cols]

    def load_f32(x_ub, r, c):
        """64 channels ``c..c+63`` of row ``r`` as fp32 (bf16 widened exactly)."""
        if in_dtype == "bfloat16":
            return S.vcvt(S.vld(x_ub[r, c], dist="UNPK_B16"), T.float32, part=0)
        return S.vld(x_ub[r, c])

    def brc(inv_ub, r, gi):
        return S.vld(inv_ub[pos(r, gi)], dist="BRC_B32")

    @T.macro
    def scale_of(amax):
        """(s, inv) of 64 amax values; UE8M0: (exponent bytes as uint32, inv); e4m3 scales: (s8, inv)."""
        a = S.vmaxs(amax, clamp)
        if round_sf:
            bits = T.reinterpret(S.vmuls(a, inv_fmax), "uint32x64")
            e = S.vadds(S.vshrs(S.vsub(bits, S.vdup(1, T.uint32)), 23), 1)
            inv = T.reinterpret(S.vshls(S.vsub(S.vdup(254, T.uint32), e), 23), "float32x64")
            if ue8m0:
                return e, inv
            return T.reinterpret(S.vshls(e, 23), "float32x64"), inv
        fm = S.vdup(fmax, T.float32)
        if sf == "e4m3":
            s8 = S.vcvt(S.vmins(S.vdiv(a, fm), 448.0), T.float8_e4m3fn, part=0)
            return s8, S.vdiv(S.vdup(1.0, T.float32), S.vcvt(s8, T.float32, part=0))
        return S.vdiv(a, fm), S.vdiv(fm, a)

    @T.macro
    def inv_vec(inv_ub, r, c, ge1, ge2, ge3):
        """The inverse scale of each lane of the 64-channel vector ``c`` of row ``r``."""
        if g >= LANES:
            return brc(inv_ub, r, c // vec_per_group)
        if g == 32:
            return S.vsel(brc(inv_ub, r, 2 * c + 1), brc(inv_ub, r, 2 * c), ge1)
        inv01 = S.vsel(brc(inv_ub, r, 4 * c + 1), brc(inv_ub, r, 4 * c), ge1)
        inv012 = S.vsel(brc(inv_ub, r, 4 * c + 2), inv01, ge2)
        return S.vsel(brc(inv_ub, r, 4 * c + 3), inv012, ge3)

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
            # 1. the amax of each group, stored at its entry of the amax tile
            for r in T.serial(valid):
                if g >= LANES:
                    for gi in T.serial(hk // g):
                        m = S.vabs(load_f32(x_ub, r, gi * g))
                        if vec_per_group == 2:
                            m = S.vmax(m, S.vabs(load_f32(x_ub, r, gi * g + LANES)))
                        S.vsts(amax_ub[pos(r, gi)], S.vcmax(m), dist="ONEPT_B32")
                else:
                    for c in T.serial(n_chunks):
                        a = S.vabs(load_f32(x_ub, r, c * LANES))
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
                            keep = S.vdup(T.if_then_else(2 * p + 1 == last_nk, drop, T.uint32(0xFFFFFFFF)), T.uint32)
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
                    S.vsts(st_at(st_ub, p * LANES), T.reinterpret(word, "uint16x128"), dist="PK_B32")
            else:
                for v in T.unroll(n_vec, explicit=True):
                    s, inv = scale_of(S.vld(amax_ub[v * LANES]))
                    S.vsts(inv_ub[v * LANES], inv)
                    if sf == "e4m3":
                        S.vsts(st_at(st_ub, v * LANES), s, dist="PK4_B32")
                    else:
                        S.vsts(st_at(st_ub, v * LANES), s)
            S.mem_bar("VST_VLD")
            # 3. the data: fl(x * inv), narrowed
            for r in T.serial(valid):
                if e2m1:
                    for p in T.serial(n_chunks // 2):
                        q0 = S.vmul(load_f32(x_ub, r, 2 * p * LANES), inv_vec(inv_ub, r, 2 * p, ge1, ge2, ge3))
                        q1 = S.vmul(load_f32(x_ub, r, (2 * p + 1) * LANES),
                                    inv_vec(inv_ub, r, 2 * p + 1, ge1, ge2, ge3))
                        low, high = S.vdintlv(T.reinterpret(q0, "uint16x128"), T.reinterpret(q1, "uint16x128"))
                        sticky = T.reinterpret(S.vor(high, S.vmins(low, 1)), "bfloat16x128")
                        fp4 = S.vcvt(sticky, T.float4_e2m1fn, part=0)
                        S.vsts(out_ub[r, p * LANES], T.reinterpret(fp4, "uint8x256"), dist="PK4_B32")
                else:
                    for c in T.serial(n_chunks):
                        q = S.vmul(load_f32(x_ub, r, c * LANES), inv_vec(inv_ub, r, c, ge1, ge2, ge3))
                        S.vsts(out_ub[r, c * LANES], S.vcvt(q, T.float8_e4m3fn, part=0), dist="PK4_B32")

    @T.prim_func
    def per_token_cast_asc(
        x: T.StridedTensor[(num_tokens, H), (x_stride, 1), in_t],
        data: T.Tensor[(num_tokens, data_cols), data_t],
        sf_out: T.Tensor[sf_shape, sf_t],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((BM, hk), in_t)
            out_ub = T.alloc_shared((BM, hk_data), data_t)
            amax_ub = T.alloc_shared((sf_rows * sf_cols,), T.float32)
            inv_ub = T.alloc_shared((sf_rows * sf_cols,), T.float32)
            st_ub = T.alloc_shared(st_shape, sf_t)
            T.annotate_buffer_versions({x_ub: stages, out_ub: stages, st_ub: stages})
            for tt, ht in T.Persistent([T.ceildiv(num_tokens, BM), n_tiles], num_cores, core_id,
                                       group_size=n_tiles, num_stages=stages):
                row = tt * BM
                valid = T.min(BM, num_tokens - row)
                h0 = ht * hk
                is_last = ht == n_tiles - 1
                ext = T.if_then_else(is_last, til.last, hk) if til.ragged else hk
                groups = ext // g
                T.copy(x[row : row + valid, h0 : h0 + ext], x_ub[:valid, :ext], l2_cache_ctrl="NOTALLOC_KEEP")
                cast_vf(x_ub, amax_ub, inv_ub, st_ub, out_ub, valid, is_last)
                if e2m1:
                    T.copy(out_ub[:valid, : ext // 2], data[row : row + valid, h0 // 2 : h0 // 2 + ext // 2])
                else:
                    T.copy(out_ub[:valid, :ext], data[row : row + valid, h0 : h0 + ext])
                if ue8m0:
                    w0 = h0 // (2 * g)
                    wext = (groups + 1) // 2
                    if col:
                        T.copy(st_ub[:wext, :valid], sf_out[w0 : w0 + wext, row : row + valid])
                    else:
                        T.copy(st_ub[:valid, :wext], sf_out[row : row + valid, w0 : w0 + wext])
                else:
                    if col:
                        T.copy(st_ub[:groups, :valid], sf_out[h0 // g : h0 // g + groups, row : row + valid])
                    else:
                        T.copy(st_ub[:valid, :groups], sf_out[row : row + valid, h0 // g : h0 // g + groups])

    return per_token_cast_asc


_IN_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def per_token_cast_key(x, layout, num_cores: int) -> PerTokenCastKey:
    """The key of a launch (``limits.LimitError`` outside the supported ranges)."""
    spec = ScaleLayout.parse(layout)
    if spec.kind != "per_token":
        raise limits.LimitError(f"per_token_cast: layout {spec.spec} is not per-token")
    in_dtype = _IN_DTYPE_NAMES.get(str(x.dtype), str(x.dtype))
    key = PerTokenCastKey(int(x.shape[-1]), spec.block[1], in_dtype, spec.fmt, spec.sf, spec.storage, spec.round_sf,
                          int(num_cores))
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


def per_token_cast_cases(hidden_size: int, hc_mult: int) -> dict:
    """The lowering cases at ``hidden_size`` (hc_mult unused): every data format, scale kind, storage and input
    dtype, on the Ascend 950's vector cores."""
    del hc_mult
    return {f"per_token_cast_{name}": PerTokenCastKey(hidden_size, group, in_dtype, fmt, sf, storage, round_sf,
                                                      ASCEND_CASE_CORES)
            for name, (group, in_dtype, fmt, sf, storage, round_sf) in _CASES.items()}


PER_TOKEN_CAST = Kernel("per_token_cast", PerTokenCastKey, build_per_token_cast, cases=per_token_cast_cases,
                        derive=lambda x, layout, data, sf: per_token_cast_key(x, layout, num_vector_cores()))


def per_token_cast(x, layout, data, sf) -> None:
    """x (T,H) bf16|fp32, layout (spec str) -> data, sf (pre-allocated in the layout for backend "ascend",
    overwritten). ``col_tma`` scales are passed as their ``(cols, T)`` row-major buffer. Current stream, no sync."""
    key = PER_TOKEN_CAST.key(x, layout, data, sf)
    sf_arg = sf.t() if key.storage == "col_tma" else sf
    PER_TOKEN_CAST.compiled(key)(x, data, sf_arg)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_TOKEN_CAST)
