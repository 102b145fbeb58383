"""Ascend 950 kernels of ``per_block_cast``, ``per_block_cast_sf`` and ``per_block_cast_with_sf``
(docs/ops/quant.md#per_block_cast): one scale per ``r x c`` block of ``x (T, H)`` (bf16 / fp32), ``r = c`` 128 or 32.

Scheme: a persistent loop over (block row, hidden tile) tasks, a task the ``r`` rows of one block row by ``hk``
channels (``g = hk / c`` blocks), multi-buffered (the loads of the next task and the stores of the previous one
overlap this one's vector work). A ragged last block row: its DMAs are clamped to the valid rows and only those
enter the amax and the stores. Three vector steps per task, all arithmetic fp32 (bf16 widened exactly):

1. **amax** of each block: ``|x|`` 64 lanes at a time, ``vmax`` over the block's rows and vectors (``c = 128``),
   or over its rows and then ``vcmax`` under a lane mask (``c = 32``, two blocks a vector), stored (``ONEPT``) at
   the block's entry of the amax tile; ``with_sf`` instead loads the given scales (GM -> UB) and widens them.
2. **scales**, 64 entries at a time, as in per_token_cast's Ascend kernel: ``a = max(amax, clamp)``; exact
   ``s = a / max``, ``inv = max / a`` (correctly rounded ``vdiv``); ``round_sf`` the exponent of ``a * fl(1 / max)``
   rounded up; e4m3 scales ``s8 = e4m3(min(a / max, 448))``, ``inv = 1 / f32(s8)``; ``with_sf`` ``inv = 1 / s``.
3. **data**: ``fl(x * inv)`` with ``inv`` broadcast per block, then e4m3 by ``vcvt`` (RNE, saturating), or e2m1
   through a bf16 with a sticky bit (exact for a one-bit mantissa) and ``vcvt`` bf16 -> e2m1.

Scales leave UB by DMA from a tile whose entries sit where the GM region wants them: row storage contiguous along
H; ``col_tma`` (on Ascend the transposed view of an unpadded ``(cols, nm)`` buffer) one 32-byte UB row per GM row.
UE8M0 words (two exponent bytes per int16) are written as bytes (the launcher passes the byte view): byte ``b`` of
word ``j`` is block ``2j + b``, the byte past an odd last block 0.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
import torch
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES
from ....quant import BLOCKS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores
from ._common import f32, scale_macro

LANES = 64  # fp32 lanes of one 256-byte vector register
SLACK = 8 * 1024  # UB kept free of the formula's count (alignment of the buffer versions), as per_token_cast
ROW_BYTES = 32  # a UB row of a col_tma scale tile: one DMA burst's alignment
IN_DTYPES = {"bfloat16": 2, "float32": 4}
SF_BYTES = {"fp32": 4, "e4m3": 1, "ue8m0": 1}  # a stored scale in UB (UE8M0: its byte)
BLOCK_SIZES = tuple(rows for rows, _ in BLOCKS["per_block"])
MODES = ("cast", "sf", "with_sf")
_OPS = {"cast": "per_block_cast", "sf": "per_block_cast_sf", "with_sf": "per_block_cast_with_sf"}


@dataclasses.dataclass(frozen=True)
class BlockTaskPlan:
    """``stages`` UB versions of the x / data / scale tiles; the hidden tile is the widest that fits the UB and
    divides ``H`` (:func:`tiling`), at most ``max_hidden`` channels (DMA rows of 256 to 2048 bytes)."""

    stages: int
    max_hidden: int


# Two stages (load / compute / store overlap); 1024 channels at most, so that a 32-row task is not a whole H row
# (more tasks than cores at small T). Not measured yet: no Ascend 950 here (docs/perf/ascend950/quant.md to come).
PLAN = BlockTaskPlan(stages=2, max_hidden=1024)


@compile_key
class PerBlockCastKey:
    """Compile-time key: H, the block, x's dtype, the layout's fields, the op (``mode``) and the vector cores of
    the persistent grid (never the token count)."""

    hidden: int
    block: int
    in_dtype: str
    fmt: str
    sf: str
    storage: str
    round_sf: bool
    mode: str
    num_cores: int


@dataclasses.dataclass(frozen=True)
class Tiling:
    """``hk`` channels a task (``n_tiles`` tiles), ``g`` blocks a tile, the scale tile's entries (``entries``, flat,
    in 64-lane vectors; ``st_shape`` its UB shape) and the UB bytes the formula counts."""

    hk: int
    n_tiles: int
    g: int
    entries: int
    st_shape: tuple
    ub_bytes: int


def entry(sf: str, storage: str, j):
    """The flat entry of block ``j`` of a task in the amax / inverse / stored-scale tiles: ``j`` (row storage), one
    32-byte row per GM row (col_tma: a block each; UE8M0 a word, its two bytes side by side)."""
    if storage == "row":
        return j
    if sf == "ue8m0":
        return (j // 2) * ROW_BYTES + j % 2
    return j * (ROW_BYTES // SF_BYTES[sf])


def _tile(block, hk, in_dtype, fmt, sf, storage) -> tuple:
    g = hk // block
    last = entry(sf, storage, g) + 1  # the pad byte's entry included
    entries = -(-last // LANES) * LANES
    if storage == "row":
        st_shape = (1, entries)
    else:
        cols = ROW_BYTES // SF_BYTES[sf]
        st_shape = (entries // cols, cols)
    data = block * hk // (2 if fmt == "e2m1" else 1)
    versioned = block * hk * IN_DTYPES[in_dtype] + data + entries * SF_BYTES[sf]
    return g, entries, st_shape, PLAN.stages * versioned + 2 * 4 * entries + SLACK


def tiling(hidden: int, block: int, in_dtype: str, fmt: str, sf: str, storage: str) -> Tiling:
    """The widest hidden tile that divides ``H`` and fits the UB: a multiple of 128 channels; for UE8M0 col_tma
    scales an even count of blocks (whole words), one block (its byte alone), or the whole row."""
    budget = _build.UB_BUDGET_BYTES
    fits = [hk for hk in range(128, min(hidden, PLAN.max_hidden) + 1, 128)
            if hidden % hk == 0 and _tile(block, hk, in_dtype, fmt, sf, storage)[3] <= budget]
    if sf == "ue8m0" and storage == "col_tma":  # a tile writes whole words, or one block's byte
        fits = [hk for hk in fits if (hk // block) % 2 == 0 or hk in (block, hidden)]
    if not fits:
        raise limits.LimitError(f"per_block_cast: no hidden tile fits the UB at H={hidden}, block {block}")
    hk = fits[-1]
    g, entries, st_shape, ub = _tile(block, hk, in_dtype, fmt, sf, storage)
    return Tiling(hk, hidden // hk, g, entries, st_shape, ub)


def check_key(where, hidden, block, in_dtype, fmt, sf, storage, round_sf, mode, num_cores) -> None:
    """:class:`limits.LimitError` unless the key is a supported per-block cast."""
    limits.QUANT_HIDDEN.require(where, int(hidden))
    limits.IntRange("num_cores", 1).require(where, int(num_cores))
    if block not in BLOCK_SIZES:
        raise limits.LimitError(f"{where}: block must be one of {BLOCK_SIZES}; got {block}")
    if in_dtype not in IN_DTYPES:
        raise limits.LimitError(f"{where}: x must be one of {tuple(IN_DTYPES)}; got {in_dtype}")
    if mode not in MODES:
        raise limits.LimitError(f"{where}: mode must be one of {MODES}; got {mode!r}")
    try:
        ScaleLayout((block, block), fmt, sf, storage, bool(round_sf))
    except (TypeError, ValueError) as exc:
        raise limits.LimitError(f"{where}: {exc}") from None



def build_per_block_cast(hidden: int, block: int, in_dtype: str, fmt: str, sf: str, storage: str, round_sf: bool,
                         mode: str, num_cores: int):
    """prim_func ``(x, data, sf)`` (cast), ``(x, sf)`` (sf) or ``(x, sf, data)`` (with_sf): ``x (T, H)`` with row
    stride ``x_stride``; ``sf`` ``(nm, nk)`` (row) or ``(nk, nm)`` (col_tma), UE8M0 as the bytes of its words,
    ``(nm, 2 W)`` or ``(W, 2 nm)``."""
    check_key(_OPS.get(mode, "per_block_cast"), hidden, block, in_dtype, fmt, sf, storage, round_sf, mode, num_cores)
    layout = ScaleLayout((block, block), fmt, sf, storage, bool(round_sf))
    H, r, c = int(hidden), int(block), int(block)
    til = tiling(H, c, in_dtype, fmt, sf, storage)
    hk, n_tiles, g, entries = til.hk, til.n_tiles, til.g, til.entries
    stages = PLAN.stages
    n_vec = entries // LANES
    col, ue8m0, e2m1 = storage == "col_tma", sf == "ue8m0", fmt == "e2m1"
    write_data, write_sf = mode != "sf", mode != "with_sf"
    nk = H // c
    words = -(-nk // 2)
    pad = ue8m0 and nk % 2 == 1  # the last block row's odd byte is zeroed
    scale_of = scale_macro(layout)
    n_chunks = hk // LANES
    in_t = T.bfloat16 if in_dtype == "bfloat16" else T.float32
    data_t = T.uint8 if e2m1 else T.float8_e4m3fn
    data_cols, hk_data = (H // 2, hk // 2) if e2m1 else (H, hk)
    st_t = {"fp32": T.float32, "e4m3": T.float8_e4m3fn, "ue8m0": T.uint8}[sf]
    st_cols = til.st_shape[1]
    num_tokens = T.dynamic("num_tokens")
    sf_rows = T.dynamic("sf_rows")
    x_stride = T.dynamic("x_stride")
    if ue8m0:
        sf_shape = (words, 2 * sf_rows) if col else (sf_rows, 2 * words)
    else:
        sf_shape = (nk, sf_rows) if col else (sf_rows, nk)

    def at(buf, flat):
        """A 2-D UB tile at its row-major entry ``flat``."""
        return buf[flat // st_cols, flat % st_cols]

    def loadf32(x_ub, rr, cc):
        if in_dtype == "bfloat16":
            return S.vcvt(S.vld(x_ub[rr, cc], dist="UNPK_B16"), T.float32, part=0)
        return S.vld(x_ub[rr, cc])

    def brc(inv_ub, j):
        return S.vld(inv_ub[entry(sf, storage, j)], dist="BRC_B32")

    @T.macro
    def given_inv(st_ub, v):
        """``1 / s`` of 64 entries of the given scales (fp32 as is, e4m3 widened, UE8M0 byte e as bits e << 23)."""
        one = S.vdup(1.0, T.float32)
        if sf == "fp32":
            return S.vdiv(one, S.vld(at(st_ub, v * LANES)))
        raw = S.vld(at(st_ub, v * LANES), dist="UNPK4_B8")
        if sf == "e4m3":
            return S.vdiv(one, S.vcvt(raw, T.float32, part=0))
        e = S.vand(T.reinterpret(raw, "uint32x64"), S.vdup(0xFF, T.uint32))
        return S.vdiv(one, T.reinterpret(S.vshls(e, 23), "float32x64"))

    @T.macro
    def inv_vec(inv_ub, q, hi):
        """The inverse scale of each lane of the 64-channel vector ``q`` of a row."""
        if c >= LANES:
            return brc(inv_ub, q // (c // LANES))
        return S.vsel(brc(inv_ub, 2 * q + 1), brc(inv_ub, 2 * q), hi)

    @T.macro
    def cast_vf(x_ub, amax_ub, inv_ub, st_ub, out_ub, valid, pad_at):
        with T.SimdVF():
            every = S.pset(32, "PAT_ALL")
            lane = S.vci(0, T.int32)
            hi = S.vcmps(lane, 32, op="ge")  # the second 32-column block of a 64-lane vector
            lo = S.pnot(hi, every)
            if write_sf:
                # 1. each block's amax over its valid rows (a register accumulator)
                acc = S.alloc_local((1,), T.float32)
                if c >= LANES:
                    for j in T.serial(g):
                        acc[0] = S.vmax(S.vabs(loadf32(x_ub, 0, j * c)), S.vabs(loadf32(x_ub, 0, j * c + LANES)))
                        for rr in T.serial(1, valid):
                            acc[0] = S.vmax(acc[0], S.vmax(S.vabs(loadf32(x_ub, rr, j * c)),
                                                           S.vabs(loadf32(x_ub, rr, j * c + LANES))))
                        S.vsts(amax_ub[entry(sf, storage, j)], S.vcmax(acc[0]), dist="ONEPT_B32")
                else:
                    for q in T.serial(n_chunks):
                        acc[0] = S.vabs(loadf32(x_ub, 0, q * LANES))
                        for rr in T.serial(1, valid):
                            acc[0] = S.vmax(acc[0], S.vabs(loadf32(x_ub, rr, q * LANES)))
                        S.vsts(amax_ub[entry(sf, storage, 2 * q)], S.vcmax(acc[0], lo), dist="ONEPT_B32")
                        S.vsts(amax_ub[entry(sf, storage, 2 * q + 1)], S.vcmax(acc[0], hi), dist="ONEPT_B32")
                S.mem_bar("VST_VLD")
                # 2. scales and inverses, 64 entries at a time (the pad byte's entry zeroed)
                for v in T.unroll(n_vec, explicit=True):
                    s, inv = scale_of(S.vld(amax_ub[v * LANES]))
                    if write_data:
                        S.vsts(inv_ub[v * LANES], inv)
                    if ue8m0:
                        if pad:
                            s = S.vsel(S.vdup(0, T.uint32), s, S.vcmps(S.vadds(lane, v * LANES), pad_at, op="eq"))
                        S.vsts(at(st_ub, v * LANES), T.reinterpret(s, "uint8x256"), dist="PK4_B32")
                    elif sf == "e4m3":
                        S.vsts(at(st_ub, v * LANES), s, dist="PK4_B32")
                    else:
                        S.vsts(at(st_ub, v * LANES), s)
            else:
                for v in T.unroll(n_vec, explicit=True):
                    S.vsts(inv_ub[v * LANES], given_inv(st_ub, v))
            if write_data:
                S.mem_bar("VST_VLD")
                # 3. the data: fl(x * inv), narrowed
                for rr in T.serial(valid):
                    if e2m1:
                        for p in T.serial(n_chunks // 2):
                            q0 = S.vmul(loadf32(x_ub, rr, 2 * p * LANES), inv_vec(inv_ub, 2 * p, hi))
                            q1 = S.vmul(loadf32(x_ub, rr, (2 * p + 1) * LANES), inv_vec(inv_ub, 2 * p + 1, hi))
                            low, high = S.vdintlv(T.reinterpret(q0, "uint16x128"), T.reinterpret(q1, "uint16x128"))
                            sticky = T.reinterpret(S.vor(high, S.vmins(low, 1)), "bfloat16x128")
                            fp4 = S.vcvt(sticky, T.float4_e2m1fn, part=0)
                            S.vsts(out_ub[rr, p * LANES], T.reinterpret(fp4, "uint8x256"), dist="PK4_B32")
                    else:
                        for q in T.serial(n_chunks):
                            y = S.vmul(loadf32(x_ub, rr, q * LANES), inv_vec(inv_ub, q, hi))
                            S.vsts(out_ub[rr, q * LANES], S.vcvt(y, T.float8_e4m3fn, part=0), dist="PK4_B32")

    @T.macro
    def sf_region(st_ub, sf_gm, m, ht, is_last, load):
        """The task's scales between UB and GM (``load``: GM -> UB, the given scales); regions are written out in
        each branch (a region cannot be bound to a name in a macro)."""
        k0 = ht * g
        if not ue8m0 and not col:
            if load:
                T.copy(sf_gm[m : m + 1, k0 : k0 + g], st_ub[0:1, 0:g])
            else:
                T.copy(st_ub[0:1, 0:g], sf_gm[m : m + 1, k0 : k0 + g])
        elif not ue8m0:
            if load:
                T.copy(sf_gm[k0 : k0 + g, m : m + 1], st_ub[0:g, 0:1])
            else:
                T.copy(st_ub[0:g, 0:1], sf_gm[k0 : k0 + g, m : m + 1])
        elif not col:
            ext = g + T.if_then_else(is_last, 1, 0) if pad else g
            if load:
                T.copy(sf_gm[m : m + 1, k0 : k0 + ext], st_ub[0:1, 0:ext])
            else:
                T.copy(st_ub[0:1, 0:ext], sf_gm[m : m + 1, k0 : k0 + ext])
        elif g == 1 and n_tiles > 1:  # one block a tile: its byte (and the pad byte after an odd last one)
            ext = 1 + T.if_then_else(is_last, 1, 0) if pad else 1
            if load:
                T.copy(sf_gm[k0 // 2 : k0 // 2 + 1, 2 * m + k0 % 2 : 2 * m + k0 % 2 + ext], st_ub[0:1, 0:ext])
            else:
                T.copy(st_ub[0:1, 0:ext], sf_gm[k0 // 2 : k0 // 2 + 1, 2 * m + k0 % 2 : 2 * m + k0 % 2 + ext])
        else:  # whole words: k0 even, the pad byte in the tile when g is odd (the whole row)
            if load:
                T.copy(sf_gm[k0 // 2 : k0 // 2 + (g + 1) // 2, 2 * m : 2 * m + 2], st_ub[0 : (g + 1) // 2, 0:2])
            else:
                T.copy(st_ub[0 : (g + 1) // 2, 0:2], sf_gm[k0 // 2 : k0 // 2 + (g + 1) // 2, 2 * m : 2 * m + 2])

    @T.macro
    def body(x, data, sf_gm):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((r, hk), in_t)
            out_ub = T.alloc_shared((r, hk_data), data_t)
            amax_ub = T.alloc_shared((entries,), T.float32)
            inv_ub = T.alloc_shared((entries,), T.float32)
            st_ub = T.alloc_shared(til.st_shape, st_t)
            T.annotate_buffer_versions({x_ub: stages, out_ub: stages, st_ub: stages})
            for m, ht in T.Persistent([T.ceildiv(num_tokens, r), n_tiles], num_cores, core_id,
                                      group_size=n_tiles, num_stages=stages):
                row = m * r
                valid = T.min(r, num_tokens - row)
                h0 = ht * hk
                is_last = ht == n_tiles - 1
                pad_at = T.if_then_else(is_last, entry(sf, storage, g), -1)
                T.copy(x[row : row + valid, h0 : h0 + hk], x_ub[:valid, :], l2_cache_ctrl="NOTALLOC_KEEP")
                if not write_sf:
                    sf_region(st_ub, sf_gm, m, ht, is_last, True)
                cast_vf(x_ub, amax_ub, inv_ub, st_ub, out_ub, valid, pad_at)
                if write_data:
                    d0 = h0 // 2 if e2m1 else h0
                    T.copy(out_ub[:valid, :], data[row : row + valid, d0 : d0 + hk_data])
                if write_sf:
                    sf_region(st_ub, sf_gm, m, ht, is_last, False)

    x_param = T.StridedTensor[(num_tokens, H), (x_stride, 1), in_t]
    data_param = T.Tensor[(num_tokens, data_cols), data_t]
    sf_param = T.Tensor[sf_shape, st_t]
    if mode == "cast":
        @T.prim_func
        def per_block_cast_asc(x: x_param, data: data_param, sf_out: sf_param):
            body(x, data, sf_out)

        return per_block_cast_asc
    if mode == "sf":
        @T.prim_func
        def per_block_cast_sf_asc(x: x_param, sf_out: sf_param):
            body(x, None, sf_out)

        return per_block_cast_sf_asc

    @T.prim_func
    def per_block_cast_with_sf_asc(x: x_param, sf_in: sf_param, data: data_param):
        body(x, data, sf_in)

    return per_block_cast_with_sf_asc


_IN_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def per_block_key(mode: str, x, layout, num_cores: int) -> PerBlockCastKey:
    """The key of a launch (``limits.LimitError`` outside the supported ranges)."""
    spec = ScaleLayout.parse(layout)
    op = _OPS.get(mode, "per_block_cast")
    if spec.kind != "per_block":
        raise limits.LimitError(f"{op}: layout {spec.spec} is not per-block")
    key = PerBlockCastKey(int(x.shape[-1]), spec.block[0], _IN_DTYPE_NAMES.get(str(x.dtype), str(x.dtype)), spec.fmt,
                          spec.sf, spec.storage, spec.round_sf, mode, int(num_cores))
    check_key(op, *(getattr(key, f.name) for f in dataclasses.fields(key)))
    return key


# the lowering cases, per op: each block, format, scale kind, storage, rounding and input dtype
_CASES = {
    "cast": {"b128_e4m3_fp32_row_bf16": (128, "bfloat16", "e4m3", "fp32", "row", False),
             "b128_e4m3_ue8m0_col_f32": (128, "float32", "e4m3", "ue8m0", "col_tma", True),
             "b32_e2m1_ue8m0_row_bf16": (32, "bfloat16", "e2m1", "ue8m0", "row", True),
             "b32_e4m3_e4m3_col_bf16": (32, "bfloat16", "e4m3", "e4m3", "col_tma", False),
             "b128_e2m1_fp32_round_col_bf16": (128, "bfloat16", "e2m1", "fp32", "col_tma", True)},
    "sf": {"b32_e4m3_ue8m0_col_bf16": (32, "bfloat16", "e4m3", "ue8m0", "col_tma", True)},
    "with_sf": {"b128_e4m3_e4m3_row_bf16": (128, "bfloat16", "e4m3", "e4m3", "row", False),
                "b32_e2m1_ue8m0_col_f32": (32, "float32", "e2m1", "ue8m0", "col_tma", True)},
}


def _cases(mode):
    def cases(hidden_size: int, hc_mult: int) -> dict:
        del hc_mult
        return {f"{_OPS[mode]}_{name}": PerBlockCastKey(hidden_size, *fields, mode, ASCEND_CASE_CORES)
                for name, fields in _CASES[mode].items()}
    return cases


def _derive(mode):
    return lambda x, layout, *_: per_block_key(mode, x, layout, num_vector_cores())


PER_BLOCK_CAST, PER_BLOCK_CAST_SF, PER_BLOCK_CAST_WITH_SF = (
    Kernel(_OPS[mode], PerBlockCastKey, build_per_block_cast, derive=_derive(mode), cases=_cases(mode))
    for mode in MODES)


def _sf_view(key, sf):
    """col_tma through its ``(cols, nm)`` buffer (``sf.t()``), UE8M0 words as their bytes."""
    view = sf.t() if key.storage == "col_tma" else sf
    return view.view(torch.uint8) if key.sf == "ue8m0" else view


def per_block_cast(x, layout, data, sf) -> None:
    """x (T,H) bf16|fp32 -> data, sf (pre-allocated for backend "ascend"). Current stream, no sync."""
    key = PER_BLOCK_CAST.key(x, layout, data, sf)
    PER_BLOCK_CAST.compiled(key)(x, data, _sf_view(key, sf))


def per_block_cast_sf(x, layout, sf) -> None:
    """x -> sf (the scales alone)."""
    key = PER_BLOCK_CAST_SF.key(x, layout, sf)
    PER_BLOCK_CAST_SF.compiled(key)(x, _sf_view(key, sf))


def per_block_cast_with_sf(x, sf, layout, data) -> None:
    """x and its given scales sf -> data."""
    key = PER_BLOCK_CAST_WITH_SF.key(x, layout, sf, data)
    PER_BLOCK_CAST_WITH_SF.compiled(key)(x, _sf_view(key, sf), data)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_BLOCK_CAST, PER_BLOCK_CAST_SF, PER_BLOCK_CAST_WITH_SF)
