"""CUDA kernels of ``per_block_cast``, ``per_block_cast_sf`` and ``per_block_cast_with_sf``
(docs/ops/quant.md#per_block_cast).

A flat grid of CTA tiles, ``r`` rows by ``blocks`` scale blocks of ``c`` channels, the tile column fastest (adjacent
CTAs read adjacent bytes of the same rows). Each warp owns one block (32 x 32: one warp per block, 8 blocks per
CTA) or a part of one (128 x 128: the 8 warps of the CTA share the block): lane ``l`` of sub-warp ``s`` reads the
16-byte vector ``l % cv`` (``cv`` vectors per block row) of the rows ``s * rp + l // cv + p * step`` (``rp = 32 /
cv`` rows per warp access, ``step`` rows per CTA access), all its ``P`` vectors issued before any is used, so
every warp access is whole 64- to 512-byte row segments and each thread has 64 to 256 bytes in flight. Rows past
``T`` (a ragged last tile row) read as 0, which never exceeds a valid ``|v|``, and are not stored.

The block's amax: each lane's max over its vectors, an xor-butterfly over the warp (every lane of a warp is in
one block), and for 128 x 128 a max over the 8 warps' values through shared memory. Every thread then derives the
same scale and inverse from it, operation by operation as the reference (tests/quant/quant_ref.py: the clamp,
the IEEE divisions ``a / max`` and ``max / a`` or ``1 / s``, the power-of-two rounding on the fp32 bits), or
(``with_sf``) reads the block's given scale and takes ``inv = 1 / s``; it writes ``Q(fl(x * inv))`` for its
vectors (e4m3 by the hardware's saturating round-to-nearest-even conversion, e2m1 by the grid's midpoints) and
the block's first thread writes the scale: fp32 / e4m3 values, or UE8M0 bytes into the int32 words (byte ``b``
of word ``j`` is block ``4j + b``; the bytes past the last block 0), row-major or into the transposed, TMA-padded
buffer of ``col_tma`` (its padding is not written). ``T`` and ``x``'s row stride are dynamic (32-bit offsets:
``T * stride < 2**31``, ``limits.QUANT_ELEMENTS``).
"""

import dataclasses

import torch

from ....limits import QUANT_HIDDEN, LimitError
from ....quant import AMAX_CLAMP, BLOCKS, FORMATS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import e2m1_encode, f32_bits

VEC_BYTES = 16  # bytes of one vector access of x
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
MODES = ("cast", "sf", "with_sf")  # per_block_cast, per_block_cast_sf, per_block_cast_with_sf
_OPS = {"cast": "per_block_cast", "sf": "per_block_cast_sf", "with_sf": "per_block_cast_with_sf"}
WARP = 32


@dataclasses.dataclass(frozen=True)
class BlockTilePlan:
    """A CTA tile: ``warps_per_block`` warps share one scale block, ``blocks`` blocks side by side along H."""

    warps_per_block: int
    blocks: int


# 8 warps a CTA for both blocks: 128 x 128 is one block of 32 KiB (bf16) a CTA, 8 bf16 vectors a thread, as the
# peer's tile; 32 x 32 is one block a warp (4 vectors a thread, no shared memory), 8 blocks a CTA (4 where H / 32
# is not a multiple of 8). Not yet measured on a GPU (docs/perf/h200/quant.md will hold the measurement).
PLANS = {128: BlockTilePlan(warps_per_block=8, blocks=1), 32: BlockTilePlan(warps_per_block=1, blocks=8)}


# CTAs an SM keeps resident (the registers each thread may use), by (block, x's dtype): a bf16 128 x 128 CTA would
# take 83 to 88 registers a thread, 2 CTAs an SM; 3 (80 registers, no spill) keep a third tile's loads in flight
# while the others reduce and store. fp32 tiles are 64 KiB (2 CTAs hold 128 KiB in flight); 32 x 32 CTAs take 56.
MIN_CTAS_PER_SM = {(128, "bfloat16"): 3}


def plan_of(block: int, hidden: int) -> BlockTilePlan:
    plan = PLANS[block]
    blocks = plan.blocks
    while (hidden // block) % blocks:
        blocks //= 2
    return BlockTilePlan(plan.warps_per_block, blocks)


@compile_key
class BlockCastKey:
    """Compile-time key: the row, the block, x's dtype, the layout's fields and the op (``mode``); never the token
    count nor the row stride."""

    hidden: int
    block: int  # r = c: 128 or 32
    in_dtype: str  # "bfloat16" | "float32"
    fmt: str  # "e4m3" | "e2m1"
    sf: str  # "fp32" | "e4m3" | "ue8m0"
    storage: str  # "row" | "col_tma"
    round_sf: bool
    mode: str  # "cast" | "sf" | "with_sf"


def block_key(mode: str, hidden: int, in_dtype: str, layout: ScaleLayout) -> BlockCastKey:
    """The :class:`BlockCastKey` of a launch (``LimitError`` outside the supported ranges)."""
    op = _OPS.get(mode, "per_block_cast")
    if mode not in MODES:
        raise LimitError(f"{op}: mode must be one of {MODES}, got {mode!r}")
    if layout.kind != "per_block":
        raise LimitError(f"{op}: the layout must be per-block, got {layout.spec}")
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    return BlockCastKey(hidden=QUANT_HIDDEN.require(op, int(hidden)), block=layout.block[0], in_dtype=in_dtype,
                        fmt=layout.fmt, sf=layout.sf, storage=layout.storage, round_sf=layout.round_sf, mode=mode)


def build_per_block_cast(hidden: int, block: int, in_dtype: str, fmt: str, sf: str, storage: str, round_sf: bool,
                         mode: str):
    """Builds one per-block kernel (the key's fields; see the module docstring).

    Returns:
        ``T.prim_func``: ``(x, data, sf)`` (cast), ``(x, sf)`` (sf) or ``(x, sf, data)`` (with_sf); ``x (T, H)`` of
        ``in_dtype`` with a dynamic row stride, ``data`` ``(T, H)`` e4m3 or ``(T, H / 2)`` uint8, ``sf`` as the
        launcher passes it: ``(nm, nk)`` fp32 / e4m3 (row) or their transpose ``(nk, nm)`` with a dynamic row
        stride (col_tma); UE8M0 as bytes, ``(nm, 4 W)`` (row) or ``(W, 4 nm)`` strided (col_tma), ``W = ceil(nk /
        4)`` words a block row. ``T`` and ``nm = ceil(T / r)`` are dynamic.
    """
    from tilelang import language as T

    if block not in (b[0] for b in BLOCKS["per_block"]):
        raise LimitError(f"per_block_cast: the block must be 128 or 32, got {block}")
    ScaleLayout((block, block), fmt, sf, storage, round_sf)  # the layout's own checks
    if mode not in MODES:
        raise LimitError(f"per_block_cast: mode must be one of {MODES}, got {mode!r}")
    H = QUANT_HIDDEN.require(_OPS[mode], hidden)
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"{_OPS[mode]}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]  # elements per vector
    r = c = block
    plan = plan_of(block, H)
    wpb, bpc = plan.warps_per_block, plan.blocks
    threads = WARP * wpb * bpc
    cv = c // V  # vectors of a block row: 4..32
    rp = WARP // cv  # rows of one warp access
    step = rp * wpb  # rows of one CTA access
    passes = r // step  # vectors per thread
    nk = H // c
    n_tiles = nk // bpc  # CTA tiles along H
    words = -(-nk // 4)  # UE8M0 words per block row
    pad = words * 4 - nk  # zero bytes after the last UE8M0 scale of a block row
    f32, u32, u8 = T.float32, T.uint32, T.uint8
    fmax = FORMATS[fmt].max
    clamp_bits = f32_bits(AMAX_CLAMP[fmt, sf == "e4m3"])
    e2m1 = fmt == "e2m1"
    data_dtype = u8 if e2m1 else T.float8_e4m3fn
    data_cols = H // 2 if e2m1 else H
    sf_dtype = {"fp32": f32, "e4m3": T.float8_e4m3fn, "ue8m0": u8}[sf]
    write_data, write_sf = mode != "sf", mode != "with_sf"

    num_tokens = T.dynamic("num_tokens")
    sf_rows = T.dynamic("sf_rows")  # ceil(T / r), bound from the scales' shape
    x_stride = T.dynamic("x_stride")
    sf_stride = T.dynamic("sf_stride")
    if storage == "row":
        sf_param = T.Tensor((sf_rows, 4 * words if sf == "ue8m0" else nk), sf_dtype)
    else:
        sf_shape = (words, 4 * sf_rows) if sf == "ue8m0" else (nk, sf_rows)
        sf_param = T.StridedTensor(sf_shape, (sf_stride, 1), sf_dtype)
    x_param = T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype)
    data_param = T.Tensor((num_tokens, data_cols), data_dtype)

    @T.macro
    def sf_at(sf_buf, m, k):
        """The stored scale of block (m, k) as a buffer element (UE8M0: its byte)."""
        if sf == "ue8m0":
            if storage == "row":
                return sf_buf[m, k]
            return sf_buf[k // 4, m * 4 + k % 4]
        if storage == "row":
            return sf_buf[m, k]
        return sf_buf[k, m]

    @T.macro
    def store_scale(sf_buf, m, k, value):
        if sf == "ue8m0" and storage == "row":
            sf_buf[m, k] = value
            if pad:
                if k == nk - 1:
                    for b in T.unroll(pad):
                        sf_buf[m, nk + b] = T.uint8(0)
        elif sf == "ue8m0":
            sf_buf[k // 4, m * 4 + k % 4] = value
            if pad:
                if k == nk - 1:
                    for b in T.unroll(pad):
                        sf_buf[words - 1, m * 4 + 4 - pad + b] = T.uint8(0)
        elif storage == "row":
            sf_buf[m, k] = value
        else:
            sf_buf[k, m] = value

    @T.macro
    def body(x, data, sf_buf):
        T.assume(x_stride % V == 0)  # rows start on vectors (the op checks it): the loads are 16 bytes wide
        with T.Kernel(T.ceildiv(num_tokens, r) * n_tiles, threads=threads) as bid:
            if (block, in_dtype) in MIN_CTAS_PER_SM:
                T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM[block, in_dtype])
            tid = T.get_thread_binding()
            lane = tid % WARP
            warp = tid // WARP
            xr = T.alloc_local((passes, V), in_dtype)
            y = T.alloc_local((V,), f32)
            packed = T.alloc_local((V // 2,), u8)  # e2m1 pairs, stored as one vector
            amax = T.alloc_local((1,), f32)
            scale = T.alloc_local((4,), f32)  # a, a / max, s, inv
            m = bid // n_tiles  # the block row
            k = (bid % n_tiles) * bpc + warp // wpb  # the block column (scale index along H)
            row = m * r + (warp % wpb) * rp + lane // cv  # the thread's first row; then + p * step
            col = k * c + (lane % cv) * V
            for p in T.unroll(passes):
                if row + p * step < num_tokens:
                    for e in T.vectorized(V):
                        xr[p, e] = x[row + p * step, col + e]
                else:
                    for e in T.vectorized(V):
                        xr[p, e] = T.cast(0, in_dtype)
            if write_sf:
                amax[0] = T.abs(T.cast(xr[0, 0], f32))
                for p in T.unroll(passes):
                    for e in T.unroll(V):
                        amax[0] = T.max(amax[0], T.abs(T.cast(xr[p, e], f32)))
                for b in T.unroll(5):
                    amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << b))
                if wpb > 1:
                    red = T.alloc_shared((wpb * bpc,), f32)
                    if lane == 0:
                        red[warp] = amax[0]
                    T.sync_threads()
                    for w in T.unroll(wpb):
                        amax[0] = T.max(amax[0], red[(warp // wpb) * wpb + w])
                # every slot written once: TileLang's codegen may reuse a reinterpret of a slot across a store
                scale[0] = T.max(amax[0], T.reinterpret(T.uint32(clamp_bits), f32))  # a
                scale[1] = T.ieee_fdiv(scale[0], T.float32(fmax))  # a / max
                if round_sf:
                    scale[2] = T.reinterpret((T.reinterpret(scale[1], u32) + T.uint32(0x7FFFFF))
                                             & T.uint32(0x7F800000), f32)  # 2^ceil(log2(a / max))
                    scale[3] = T.ieee_fdiv(T.float32(1.0), scale[2])
                elif sf == "e4m3":
                    scale[2] = T.cast(T.cast(T.min(scale[1], T.float32(448.0)), T.float8_e4m3fn), f32)
                    scale[3] = T.ieee_fdiv(T.float32(1.0), scale[2])
                else:
                    scale[2] = scale[1]
                    scale[3] = T.ieee_fdiv(T.float32(fmax), scale[0])
                if tid % (WARP * wpb) == 0:
                    if sf == "ue8m0":
                        store_scale(sf_buf, m, k, T.cast((T.reinterpret(scale[2], u32) >> T.uint32(23))
                                                         & T.uint32(0xFF), u8))
                    elif sf == "e4m3":
                        store_scale(sf_buf, m, k, T.cast(scale[2], T.float8_e4m3fn))
                    else:
                        store_scale(sf_buf, m, k, scale[2])
            else:  # the given scale: fp32 as is, e4m3 widened, a UE8M0 byte e as the fp32 bits e << 23
                if sf == "ue8m0":
                    scale[2] = T.reinterpret(T.cast(sf_at(sf_buf, m, k), u32) << T.uint32(23), f32)
                elif sf == "e4m3":
                    scale[2] = T.cast(sf_at(sf_buf, m, k), f32)
                else:
                    scale[2] = sf_at(sf_buf, m, k)
                scale[3] = T.ieee_fdiv(T.float32(1.0), scale[2])
            if write_data:
                for p in T.unroll(passes):
                    if row + p * step < num_tokens:
                        for e in T.unroll(V):
                            y[e] = T.ieee_mul(T.cast(xr[p, e], f32), scale[3])
                        if e2m1:
                            for e in T.unroll(V // 2):
                                packed[e] = e2m1_encode(T, y[2 * e]) | (e2m1_encode(T, y[2 * e + 1]) << T.uint8(4))
                            for e in T.vectorized(V // 2):
                                data[row + p * step, col // 2 + e] = packed[e]
                        else:
                            for e in T.vectorized(V):
                                data[row + p * step, col + e] = T.cast(y[e], T.float8_e4m3fn)

    if mode == "cast":
        @T.prim_func
        def per_block_cast_cuda(x: x_param, data: data_param, sf_out: sf_param):
            body(x, data, sf_out)

        return per_block_cast_cuda
    if mode == "sf":
        @T.prim_func
        def per_block_cast_sf_cuda(x: x_param, sf_out: sf_param):
            body(x, None, sf_out)

        return per_block_cast_sf_cuda

    @T.prim_func
    def per_block_cast_with_sf_cuda(x: x_param, sf_in: sf_param, data: data_param):
        body(x, data, sf_in)

    return per_block_cast_with_sf_cuda


def _key(mode):
    def derive(x, layout, *_):
        return block_key(mode, x.shape[1], _IN_DTYPES.get(x.dtype, str(x.dtype)), ScaleLayout.parse(layout))
    return derive


# the variants the CPU tier lowers at H, per op: each block, format, scale kind, storage and input dtype once
_CASES = {
    "cast": {"b128_e4m3_fp32_row_bf16": ("128x128/e4m3/fp32/row/exact", "bfloat16"),
             "b128_e4m3_ue8m0_col_f32": ("128x128/e4m3/ue8m0/col_tma/round", "float32"),
             "b32_e2m1_ue8m0_row_bf16": ("32x32/e2m1/ue8m0/row/round", "bfloat16"),
             "b32_e4m3_e4m3_col_bf16": ("32x32/e4m3/e4m3/col_tma/exact", "bfloat16"),
             "b128_e2m1_fp32_round_row_f32": ("128x128/e2m1/fp32/row/round", "float32")},
    "sf": {"b128_e4m3_ue8m0_row_bf16": ("128x128/e4m3/ue8m0/row/round", "bfloat16")},
    "with_sf": {"b128_e4m3_fp32_row_bf16": ("128x128/e4m3/fp32/row/exact", "bfloat16"),
                "b32_e2m1_ue8m0_col_f32": ("32x32/e2m1/ue8m0/col_tma/round", "float32")},
}


def _cases(mode):
    def cases(hidden_size: int, hc_mult: int) -> dict:
        del hc_mult
        return {f"{_OPS[mode]}_{name}": block_key(mode, hidden_size, dtype, ScaleLayout.parse(spec))
                for name, (spec, dtype) in _CASES[mode].items()}
    return cases


PER_BLOCK_CAST, PER_BLOCK_CAST_SF, PER_BLOCK_CAST_WITH_SF = (
    Kernel(_OPS[mode], BlockCastKey, build_per_block_cast, derive=_key(mode), cases=_cases(mode)) for mode in MODES)


def _sf_view(key: BlockCastKey, sf: torch.Tensor) -> torch.Tensor:
    """The scales as the kernel takes them: col_tma through the transposed (padded) buffer, UE8M0 words as bytes."""
    view = sf.t() if key.storage == "col_tma" else sf
    return view.view(torch.uint8) if key.sf == "ue8m0" else view


def per_block_cast(x: torch.Tensor, layout: str, data: torch.Tensor, sf: torch.Tensor) -> None:
    """Launches the per-block cast of ``x`` on the current stream (arguments validated and outputs allocated
    upstream, ``T > 0``): writes ``data`` and ``sf``."""
    key = PER_BLOCK_CAST.key(x, layout, data, sf)
    PER_BLOCK_CAST.compiled(key)(x, data, _sf_view(key, sf))


def per_block_cast_sf(x: torch.Tensor, layout: str, sf: torch.Tensor) -> None:
    """Launches the scales-only cast of ``x`` (``T > 0``): writes ``sf``."""
    key = PER_BLOCK_CAST_SF.key(x, layout, sf)
    PER_BLOCK_CAST_SF.compiled(key)(x, _sf_view(key, sf))


def per_block_cast_with_sf(x: torch.Tensor, sf: torch.Tensor, layout: str, data: torch.Tensor) -> None:
    """Launches the cast of ``x`` with the given scales ``sf`` (``T > 0``): writes ``data``."""
    key = PER_BLOCK_CAST_WITH_SF.key(x, layout, sf, data)
    PER_BLOCK_CAST_WITH_SF.compiled(key)(x, _sf_view(key, sf), data)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_BLOCK_CAST, PER_BLOCK_CAST_SF, PER_BLOCK_CAST_WITH_SF)
