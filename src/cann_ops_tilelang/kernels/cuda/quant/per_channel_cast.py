"""CUDA kernel of ``per_channel_cast`` (docs/ops/quant.md#per_channel_cast).

A flat grid of ``ceil(T / r) * (H / W)`` CTAs, the strip index fastest (neighbouring CTAs read the same rows): a
CTA owns one token block of ``r`` rows by a strip of ``W = lanes * V`` channels (``V`` elements per 16-byte vector:
8 bf16, 4 fp32, 16 e4m3). Its threads are ``rows`` row groups of ``lanes`` column lanes; thread ``(g, c)`` loads
rows ``g, g + rows, ...`` of the block at columns ``c*V .. c*V+V-1`` of the strip, all loads issued before any
arithmetic (each warp access is whole 16-byte vectors of consecutive addresses), and keeps them in registers. Each
thread's column maxima go to shared memory (``[g][k][c]``: conflict-free), one thread per channel reduces them over
the row groups, derives the scale and inverse as the reference does (tests/quant/quant_ref.py: the clamp, IEEE
divisions ``a / max`` and ``max / a`` or ``1 / s``), stores the scale and shares the inverse; then every thread
writes ``Q(fl(v * inv))`` of its registers (e4m3 by the hardware's RNE saturating conversion). Rows past ``T`` (the
ragged last block) load zeros, which never raise a maximum, and are not written.

Re-quantization: ``x`` is e4m3 data with per-token scales ``sx`` (groups of 32 or 128: a vector stays in a group);
a thread reads ``sx`` of each of its rows once, and ``v = fl(f32(x) * sx)`` both for the amax and for the data.
Scales out: fp32 / e4m3 ``(ceil(T / r), H)``; UE8M0 bytes written one by one into the int32 words ``(ceil(T / r /
4), H)`` (byte ``b`` of word ``[i, c]`` is token block ``4i + b``), the last block zeroing the bytes after it.
"""

import dataclasses

import torch

from ....limits import QUANT_HIDDEN, LimitError
from ....quant import AMAX_CLAMP, BLOCKS, FORMATS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import f32_bits

VEC_BYTES = 16
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn"}
_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
TOKEN_BLOCKS = tuple(rows for rows, _ in BLOCKS["per_channel"])
INPUT_GROUPS = (32, 128)
UE8M0_PACK = 4  # exponent bytes per int32 word on CUDA


@dataclasses.dataclass(frozen=True)
class ChannelPlan:
    """CTAs of ``threads`` threads, ``lanes`` 16-byte column lanes per row (a strip of ``lanes * V`` channels)."""

    threads: int
    lanes: int


# 256 threads, 16 lanes: each warp reads two 256-byte row segments, a 128-token bf16 block is 32 KiB per CTA (8
# rows a thread), 8 KiB for 32 tokens; 8 lanes where 16 vectors do not divide H (e4m3 input at H % 256 != 0).
# Not yet measured on a GPU (docs/perf/h200/quant.md will hold the measurement).
CHANNEL_PLAN = ChannelPlan(threads=256, lanes=16)


@compile_key
class ChannelKey:
    """Compile-time key: the row, the token block, x's dtype, the output scales and, for re-quantization, the
    input group and scale storage (``x_group`` 0: plain input); never the token count nor a stride."""

    hidden: int
    block: int  # r, tokens per scale
    in_dtype: str  # "bfloat16" | "float32" | "float8_e4m3fn"
    sf: str  # "fp32" | "e4m3" | "ue8m0"
    round_sf: bool
    x_group: int  # 0 | 32 | 128
    x_sf: str  # "" | "fp32" | "e4m3" | "ue8m0"
    x_storage: str  # "" | "row" | "col_tma"


def lanes_of(hidden: int, in_dtype: str) -> int:
    """Column lanes of a strip: the plan's, halved until ``lanes * V`` divides ``H``."""
    V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]
    lanes = CHANNEL_PLAN.lanes
    while hidden % (lanes * V):
        lanes //= 2
    return lanes


def channel_key(op: str, hidden: int, in_dtype: str, layout: ScaleLayout, x_layout: ScaleLayout | None) -> ChannelKey:
    """The :class:`ChannelKey` of a launch (``LimitError`` outside the supported ranges)."""
    if layout.kind != "per_channel" or layout.fmt != "e4m3":
        raise LimitError(f"{op}: the layout must be per-channel e4m3, got {layout.spec}")
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"{op}: the input dtype must be bfloat16, float32 or float8_e4m3fn, got {in_dtype}")
    if (in_dtype == "float8_e4m3fn") != (x_layout is not None):
        raise LimitError(f"{op}: float8_e4m3fn input comes with its per-token scales, and only it")
    if x_layout is not None and (x_layout.kind != "per_token" or x_layout.fmt != "e4m3"
                                 or x_layout.block[1] not in INPUT_GROUPS):
        raise LimitError(f"{op}: the input layout must be per-token e4m3 of group 32 or 128, got {x_layout.spec}")
    return ChannelKey(hidden=QUANT_HIDDEN.require(op, int(hidden)), block=layout.block[0], in_dtype=in_dtype,
                      sf=layout.sf, round_sf=layout.round_sf, x_group=x_layout.block[1] if x_layout else 0,
                      x_sf=x_layout.sf if x_layout else "", x_storage=x_layout.storage if x_layout else "")


def build_per_channel_cast(hidden: int, block: int, in_dtype: str, sf: str, round_sf: bool, x_group: int, x_sf: str,
                           x_storage: str):
    """Builds the per-channel cast of one key (see the module docstring).

    Returns:
        ``T.prim_func(x, data, sf_out[, x_sf])``: ``x (T, H)`` with a dynamic row stride; ``data (T, H)`` e4m3;
        ``sf_out`` ``(nm, H)`` fp32 / e4m3 or the UE8M0 words' bytes ``(nw, 4 H)`` (``nm``, ``nw`` dynamic); for
        re-quantization ``x_sf`` as the launcher passes it: ``(T, nk)`` fp32 / e4m3 or the words' bytes ``(T, 4 w)``
        (row), their transposes with a dynamic row stride (col_tma).
    """
    from tilelang import language as T

    layout = ScaleLayout((block, 1), "e4m3", sf, "row", round_sf)  # the layout's own checks
    H = QUANT_HIDDEN.require("per_channel_cast", hidden)
    if block not in TOKEN_BLOCKS:
        raise LimitError(f"per_channel_cast: the token block must be one of {TOKEN_BLOCKS}, got {block}")
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"per_channel_cast: the input dtype must be bfloat16, float32 or float8_e4m3fn, got "
                         f"{in_dtype}")
    requant = in_dtype == "float8_e4m3fn"
    if requant:
        xl = ScaleLayout((1, x_group), "e4m3", x_sf, x_storage, x_sf == "ue8m0")
        if x_group not in INPUT_GROUPS:
            raise LimitError(f"per_channel_cast: the input group must be one of {INPUT_GROUPS}, got {x_group}")
        del xl
    elif x_group or x_sf or x_storage:
        raise LimitError(f"per_channel_cast: {in_dtype} input takes no input scales, got group {x_group}")
    V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]
    threads = CHANNEL_PLAN.threads
    lanes = lanes_of(H, in_dtype)
    rows = threads // lanes  # row groups
    W = lanes * V  # channels of a strip
    if block % rows:
        raise LimitError(f"per_channel_cast: {rows} row groups do not divide the token block {block}")
    rpt = block // rows  # rows a thread keeps in registers
    n_strips = H // W
    f32, u32, u8 = T.float32, T.uint32, T.uint8
    fmax = FORMATS["e4m3"].max
    clamp_bits = f32_bits(AMAX_CLAMP["e4m3", sf == "e4m3"])
    sf_dtype = {"fp32": f32, "e4m3": T.float8_e4m3fn, "ue8m0": u8}[sf]
    del layout

    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")
    sf_rows = T.dynamic("sf_rows")  # ceil(T / r), or ceil(T / r / 4) words
    sf_param = T.Tensor((sf_rows, 4 * H if sf == "ue8m0" else H), sf_dtype)
    if requant:
        nk_in = H // x_group
        words_in = -(-nk_in // UE8M0_PACK)
        xs_dtype = {"fp32": f32, "e4m3": T.float8_e4m3fn, "ue8m0": u8}[x_sf]
        xs_cols = UE8M0_PACK * words_in if x_sf == "ue8m0" else nk_in
        if x_storage == "row":
            xs_param = T.Tensor((num_tokens, xs_cols), xs_dtype)
        else:
            xs_stride = T.dynamic("xs_stride")
            xs_rows = words_in if x_sf == "ue8m0" else nk_in
            xs_param = T.StridedTensor((xs_rows, (UE8M0_PACK if x_sf == "ue8m0" else 1) * num_tokens),
                                       (xs_stride, 1), xs_dtype)

    @T.macro
    def input_scale(x_scales, row, group):
        """``sx`` of (token ``row``, input group ``group``) as fp32."""
        if x_sf == "ue8m0":
            if x_storage == "row":
                byte = x_scales[row, group]
            else:
                byte = x_scales[group // UE8M0_PACK, row * UE8M0_PACK + group % UE8M0_PACK]
            return T.reinterpret(T.shift_left(T.cast(byte, u32), T.uint32(23)), f32)
        if x_storage == "row":
            return T.cast(x_scales[row, group], f32)
        return T.cast(x_scales[group, row], f32)

    @T.macro
    def body(x, data, sf_out, x_scales):
        with T.Kernel(T.ceildiv(num_tokens, block) * n_strips, threads=threads) as bid:
            tid = T.get_thread_binding()
            xr = T.alloc_local((rpt, V), in_dtype)
            sx = T.alloc_local((rpt,), f32)
            amax = T.alloc_local((V,), f32)
            scale = T.alloc_local((4,), f32)  # a, a / max, s, inv
            # the column maxima of the row groups, then (row ``rows``) the strip's inverse scales: one buffer, so
            # that the inverses never share memory with maxima still being read
            red = T.alloc_shared(((rows + 1) * W,), f32)
            blk = bid // n_strips
            col0 = (bid % n_strips) * W + (tid % lanes) * V
            for i in T.unroll(rpt):
                if blk * block + i * rows + tid // lanes < num_tokens:
                    for k in T.vectorized(V):
                        xr[i, k] = x[blk * block + i * rows + tid // lanes, col0 + k]
                else:
                    for k in T.vectorized(V):
                        xr[i, k] = T.cast(0, in_dtype)
            if requant:
                for i in T.unroll(rpt):
                    if blk * block + i * rows + tid // lanes < num_tokens:
                        sx[i] = input_scale(x_scales, blk * block + i * rows + tid // lanes, col0 // x_group)
                    else:
                        sx[i] = T.float32(0)
            for k in T.unroll(V):
                amax[k] = T.float32(0)
            for i in T.unroll(rpt):
                for k in T.unroll(V):
                    if requant:
                        amax[k] = T.max(amax[k], T.abs(T.ieee_mul(T.cast(xr[i, k], f32), sx[i])))
                    else:
                        amax[k] = T.max(amax[k], T.abs(T.cast(xr[i, k], f32)))
            for k in T.unroll(V):
                red[(tid // lanes) * W + k * lanes + tid % lanes] = amax[k]
            T.sync_threads()
            if tid < W:
                # channel (tid % lanes) * V + tid // lanes of the strip: red[g * W + tid] over the row groups g
                scale[0] = red[tid]
                for g in T.unroll(1, rows):
                    scale[0] = T.max(scale[0], red[g * W + tid])
                scale[0] = T.max(scale[0], T.reinterpret(T.uint32(clamp_bits), f32))  # a
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
                red[rows * W + tid] = scale[3]
                if sf == "ue8m0":
                    sf_out[blk // UE8M0_PACK, ((bid % n_strips) * W + (tid % lanes) * V + tid // lanes) * UE8M0_PACK
                           + blk % UE8M0_PACK] = T.cast((T.reinterpret(scale[2], u32) >> T.uint32(23))
                                                        & T.uint32(0xFF), u8)
                    if blk == T.ceildiv(num_tokens, block) - 1:  # the bytes after the last block are 0
                        for b in T.unroll(1, UE8M0_PACK):
                            if b > blk % UE8M0_PACK:
                                sf_out[blk // UE8M0_PACK, ((bid % n_strips) * W + (tid % lanes) * V + tid // lanes)
                                       * UE8M0_PACK + b] = T.uint8(0)
                elif sf == "e4m3":
                    sf_out[blk, (bid % n_strips) * W + (tid % lanes) * V + tid // lanes] = \
                        T.cast(scale[2], T.float8_e4m3fn)
                else:
                    sf_out[blk, (bid % n_strips) * W + (tid % lanes) * V + tid // lanes] = scale[2]
            T.sync_threads()
            for k in T.unroll(V):
                amax[k] = red[rows * W + k * lanes + tid % lanes]  # now the inverse scales of this thread's columns
            for i in T.unroll(rpt):
                if blk * block + i * rows + tid // lanes < num_tokens:
                    for k in T.vectorized(V):
                        if requant:
                            data[blk * block + i * rows + tid // lanes, col0 + k] = T.cast(
                                T.ieee_mul(T.ieee_mul(T.cast(xr[i, k], f32), sx[i]), amax[k]), T.float8_e4m3fn)
                        else:
                            data[blk * block + i * rows + tid // lanes, col0 + k] = T.cast(
                                T.ieee_mul(T.cast(xr[i, k], f32), amax[k]), T.float8_e4m3fn)

    if requant:
        @T.prim_func
        def per_channel_cast_requant_cuda(
            x: T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype),
            data: T.Tensor((num_tokens, H), T.float8_e4m3fn),
            sf_out: sf_param,
            x_sf_in: xs_param,
        ):
            T.assume(x_stride % V == 0)  # rows start on vectors (the op checks it): the loads are 16 bytes wide
            body(x, data, sf_out, x_sf_in)

        return per_channel_cast_requant_cuda

    @T.prim_func
    def per_channel_cast_cuda(
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype),
        data: T.Tensor((num_tokens, H), T.float8_e4m3fn),
        sf_out: sf_param,
    ):
        T.assume(x_stride % V == 0)  # rows start on vectors (the op checks it): the loads are 16 bytes wide
        body(x, data, sf_out, None)

    return per_channel_cast_cuda


def _derive(x, layout, x_sf, x_layout, data, sf):
    return channel_key("per_channel_cast", x.shape[1], _IN_DTYPES.get(x.dtype, str(x.dtype)),
                       ScaleLayout.parse(layout), None if x_layout is None else ScaleLayout.parse(x_layout))


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """The variants the CPU tier lowers at ``H``: bf16 to UE8M0 128x1 (the default), fp32 and bf16 to fp32 and
    e4m3 32x1 scales, and re-quantization of SM100 activations (1x128 UE8M0 col_tma) and of 1x32 fp32 rows."""
    del hc_mult
    specs = {
        "bf16_ue8m0_b128": ("bfloat16", "128x1/e4m3/ue8m0/row/round", None),
        "f32_fp32_b32": ("float32", "32x1/e4m3/fp32/row/exact", None),
        "bf16_e4m3_b32": ("bfloat16", "32x1/e4m3/e4m3/row/exact", None),
        "requant_ue8m0_col_b128": ("float8_e4m3fn", "128x1/e4m3/fp32/row/round", "1x128/e4m3/ue8m0/col_tma/round"),
        "requant_fp32_row_b32": ("float8_e4m3fn", "32x1/e4m3/ue8m0/row/round", "1x32/e4m3/fp32/row/exact"),
    }
    return {f"per_channel_cast_{name}": channel_key("per_channel_cast", hidden_size, dtype, ScaleLayout.parse(spec),
                                                    None if xs is None else ScaleLayout.parse(xs))
            for name, (dtype, spec, xs) in specs.items()}


PER_CHANNEL_CAST = Kernel("per_channel_cast", ChannelKey, build_per_channel_cast, derive=_derive, cases=_cases)


def input_scale_view(x_sf: torch.Tensor, x_layout: str) -> torch.Tensor:
    """``x_sf`` as the kernel's parameter declares it: col_tma through its transposed buffer, UE8M0 words as bytes."""
    xl = ScaleLayout.parse(x_layout)
    view = x_sf.t() if xl.storage == "col_tma" else x_sf
    return view.view(torch.uint8) if xl.sf == "ue8m0" else view


def per_channel_cast(x: torch.Tensor, layout: str, x_sf, x_layout, data: torch.Tensor, sf: torch.Tensor) -> None:
    """Launches the cast of ``x`` to ``layout`` on the current stream (arguments validated and outputs allocated
    upstream, ``T > 0``): writes ``data`` and ``sf`` (UE8M0 words as their bytes)."""
    key = PER_CHANNEL_CAST.key(x, layout, x_sf, x_layout, data, sf)
    sf_param = sf.view(torch.uint8) if key.sf == "ue8m0" else sf
    if x_sf is None:
        PER_CHANNEL_CAST.compiled(key)(x, data, sf_param)
    else:
        PER_CHANNEL_CAST.compiled(key)(x, data, sf_param, input_scale_view(x_sf, x_layout))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_CHANNEL_CAST)
