"""CUDA kernel of ``cast_back`` (docs/ops/quant.md#cast_back): ``out = out_dtype(fl(f32(data) * s))``.

Memory-bound: a flat grid over the 16-byte vectors of ``data`` (16 e4m3 values, or 32 e2m1 values two per byte),
``vectors`` per thread strided by the CTA size (every warp access coalesced), all loads issued before any compute.
``H`` a multiple of 128 keeps every vector in one row. Each vector's values are widened (e4m3 by the hardware, e2m1
on the bits), multiplied by their scale (one IEEE product) and rounded once to bf16 (round to nearest even) or kept
fp32; the results leave as 16-byte stores (2 or 4 per vector for e4m3, 4 or 8 for e2m1) of consecutive addresses.

Scales: a vector lies in one scale column block (two for e2m1 with 16-column groups), except per-channel layouts
(one scale per column): then the vector's 16 scales are read as 16-byte vectors of the scale row (fp32, e4m3, or
the int32 UE8M0 words, shifted by ``8 (i % 4)`` for token block ``i``). Other UE8M0 words are read as their bytes
(byte ``b`` of word ``j`` is scale ``4j + b``); ``"col_tma"`` through the transposed, TMA-padded buffer (dynamic row
stride).
Scale reads hit L1 / L2: one scale row serves ``c`` columns of ``r`` tokens. ``T`` is dynamic; ``T * H < 2**31``.
"""

import dataclasses

import torch

from ....limits import QUANT_HIDDEN, LimitError
from ....quant import ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import e2m1_decode, ue8m0_decode

VEC_BYTES = 16  # bytes of one vector of data (and of each store of out)
_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_OUT_BYTES = {"bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class CastBackPlan:
    """A flat grid over the 16-byte vectors of ``data``: CTAs of ``threads`` threads, ``vectors`` per thread."""

    threads: int
    vectors: int


# 256 threads x 2 vectors: 32 bytes of data loads in flight per thread (8 KiB per CTA) before the 64-128 bytes of
# stores; not yet measured on a GPU (docs/perf/h200/quant.md will hold the measurement).
CAST_BACK_PLAN = CastBackPlan(threads=256, vectors=2)


@compile_key
class CastBackKey:
    """Compile-time key: the logical hidden size, the block, the data format, the scale storage and the output
    dtype; never the token count (rounding of the scales does not matter: decoding is the same)."""

    hidden: int
    rows: int
    cols: int
    fmt: str  # "e4m3" | "e2m1"
    sf: str  # "fp32" | "e4m3" | "ue8m0"
    storage: str  # "row" | "col_tma"
    out_dtype: str  # "bfloat16" | "float32"


def cast_back_key(hidden: int, layout: ScaleLayout, out_dtype: str) -> CastBackKey:
    """The key of a launch: ``H`` in ``limits.QUANT_HIDDEN``, out_dtype bf16 / fp32 (``LimitError``)."""
    if out_dtype not in _OUT_BYTES:
        raise LimitError(f"cast_back: out_dtype must be bfloat16 or float32, got {out_dtype}")
    return CastBackKey(hidden=QUANT_HIDDEN.require("cast_back", int(hidden)), rows=layout.block[0],
                       cols=layout.block[1], fmt=layout.fmt, sf=layout.sf, storage=layout.storage,
                       out_dtype=out_dtype)


def build_cast_back(hidden: int, rows: int, cols: int, fmt: str, sf: str, storage: str, out_dtype: str):
    """Builds the cast back of one layout (the key's fields; see the module docstring).

    Returns:
        ``T.prim_func(data, sf, out)``: ``data`` ``(T, H)`` float8_e4m3fn or ``(T, H / 2)`` uint8; ``sf`` as the
        launcher passes it: row storage ``(rows, cols)`` of the scale tensor (UE8M0 words as ``4`` bytes each, except
        per-channel words, read whole),
        col_tma the transposed buffer ``(cols, rows)`` with a dynamic row stride (UE8M0: ``(words, 4 rows)``
        bytes); ``out`` ``(T, H)`` of ``out_dtype``. ``T`` is dynamic.
    """
    from tilelang import language as T

    # the layout's own checks (block, ue8m0 only rounded, per-channel row e4m3): round_sf as ue8m0 needs it
    layout = ScaleLayout((rows, cols), fmt, sf, storage, sf == "ue8m0")
    H = QUANT_HIDDEN.require("cast_back", hidden)
    if out_dtype not in _OUT_BYTES:
        raise LimitError(f"cast_back: out_dtype must be bfloat16 or float32, got {out_dtype}")
    e2m1 = fmt == "e2m1"
    per_channel = layout.kind == "per_channel"
    E = 2 * VEC_BYTES if e2m1 else VEC_BYTES  # values per data vector
    VO = VEC_BYTES // _OUT_BYTES[out_dtype]  # values per 16-byte store
    units = H // E  # data vectors per row
    nk = H // cols
    ns = E if per_channel else max(1, E // cols)  # distinct scales of a vector
    threads, nvt = CAST_BACK_PLAN.threads, CAST_BACK_PLAN.vectors
    f32, u32, u8 = T.float32, T.uint32, T.uint8
    data_dtype = u8 if e2m1 else T.float8_e4m3fn
    sf_dtype = {"fp32": f32, "e4m3": T.float8_e4m3fn, "ue8m0": u8}[sf]
    ue8m0 = sf == "ue8m0"

    num_tokens = T.dynamic("num_tokens")
    sf_stride = T.dynamic("sf_stride")
    words = -(-nk // 4)
    # the scale tensor's rows (col_tma: its transposed buffer's columns), as the binder checks them
    sf_rows = T.ceildiv(num_tokens, rows * 4) if per_channel and ue8m0 else T.ceildiv(num_tokens, rows)
    if per_channel:  # (ceil(nm / 4), H) int32 words (ue8m0: byte i % 4 is token block i), else (nm, H)
        sf_param = T.Tensor((sf_rows, H), T.int32 if ue8m0 else sf_dtype)
    elif storage == "row":
        sf_param = T.Tensor((sf_rows, 4 * words if ue8m0 else nk), sf_dtype)
    else:
        sf_param = T.StridedTensor((words, 4 * sf_rows) if ue8m0 else (nk, sf_rows), (sf_stride, 1), sf_dtype)
    del layout

    def scale_at(sf_in, i, g):
        """The fp32 scale of block row ``i``, block column ``g`` (per-token / per-block)."""
        if ue8m0:
            return ue8m0_decode(T, sf_in[i, g] if storage == "row" else sf_in[g // 4, i * 4 + g % 4])
        value = sf_in[i, g] if storage == "row" else sf_in[g, i]
        return T.cast(value, f32) if sf == "e4m3" else value

    @T.prim_func
    def cast_back_cuda(
        data: T.Tensor((num_tokens, H // 2 if e2m1 else H), data_dtype),
        sf_in: sf_param,
        out: T.Tensor((num_tokens, H), out_dtype),
    ):
        with T.Kernel(T.ceildiv(num_tokens * units, threads * nvt), threads=threads) as bid:
            tid = T.get_thread_binding()
            raw = T.alloc_local((nvt, VEC_BYTES), data_dtype)
            scale = T.alloc_local((ns,), f32)
            scale_raw = T.alloc_local((E,), T.int32 if per_channel and ue8m0 else sf_dtype)
            y = T.alloc_local((E,), out_dtype)
            total = num_tokens * units
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for k in T.vectorized(VEC_BYTES):
                        raw[j, k] = data[((bid * nvt + j) * threads + tid) // units,
                                         (((bid * nvt + j) * threads + tid) % units) * VEC_BYTES + k]
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    # the vector's token and first column; its block row
                    if per_channel:
                        if ue8m0:  # 16 words (64 bytes) of the word row: byte i % 4 of each is the scale
                            for q in T.unroll(E // 4):
                                for k in T.vectorized(4):
                                    scale_raw[q * 4 + k] = sf_in[
                                        ((bid * nvt + j) * threads + tid) // units // rows // 4,
                                        (((bid * nvt + j) * threads + tid) % units) * E + q * 4 + k]
                            for k in T.unroll(E):
                                scale[k] = ue8m0_decode(T, T.cast(
                                    (T.cast(scale_raw[k], u32) >> T.cast(
                                        8 * ((((bid * nvt + j) * threads + tid) // units // rows) % 4), u32))
                                    & T.uint32(0xFF), u8))
                        elif sf == "e4m3":
                            for k in T.vectorized(E):
                                scale_raw[k] = sf_in[((bid * nvt + j) * threads + tid) // units // rows,
                                                     (((bid * nvt + j) * threads + tid) % units) * E + k]
                            for k in T.unroll(E):
                                scale[k] = T.cast(scale_raw[k], f32)
                        else:
                            for q in T.unroll(E // 4):
                                for k in T.vectorized(4):
                                    scale[q * 4 + k] = sf_in[((bid * nvt + j) * threads + tid) // units // rows,
                                                             (((bid * nvt + j) * threads + tid) % units) * E
                                                             + q * 4 + k]
                    else:
                        for m in T.unroll(ns):
                            scale[m] = scale_at(sf_in, ((bid * nvt + j) * threads + tid) // units // rows,
                                                ((((bid * nvt + j) * threads + tid) % units) * E) // cols + m)
                    for k in T.unroll(E):
                        if e2m1:
                            y[k] = T.cast(T.ieee_mul(
                                e2m1_decode(T, (T.cast(raw[j, k // 2], u32) >> T.uint32(4 * (k % 2)))
                                            & T.uint32(0xF)),
                                scale[k if per_channel else k // (E // ns)]), out_dtype)
                        else:
                            y[k] = T.cast(T.ieee_mul(T.cast(raw[j, k], f32),
                                                     scale[k if per_channel else k // (E // ns)]), out_dtype)
                    for q in T.unroll(E // VO):
                        for k in T.vectorized(VO):
                            out[((bid * nvt + j) * threads + tid) // units,
                                (((bid * nvt + j) * threads + tid) % units) * E + q * VO + k] = y[q * VO + k]

    return cast_back_cuda


def _derive(data, sf, layout, out_dtype, out):
    return cast_back_key(ScaleLayout.parse(layout).hidden_of(data), ScaleLayout.parse(layout),
                         _OUT_DTYPES.get(out_dtype, str(out_dtype)))


# the variants the CPU tier lowers: DeepGEMM's SM90 (fp32 row) and SM100 (UE8M0 col_tma) activations, MXFP4 (1x32
# UE8M0) and NVFP4-like (1x16 e4m3 col_tma) data, per-block weights (fp32, UE8M0 col_tma) and per-channel scales
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


def _cases(hidden_size: int, hc_mult: int) -> dict:
    del hc_mult
    return {f"cast_back_{name}": cast_back_key(hidden_size, ScaleLayout.parse(spec), out)
            for name, (spec, out) in _CASES.items()}


CAST_BACK = Kernel("cast_back", CastBackKey, build_cast_back, derive=_derive, cases=_cases)
# the kernel's parameter of the op's argument sf (the builder's sf is the scale kind)
ARGUMENTS = {"sf_in": "sf"}


def sf_view(sf: torch.Tensor, key: CastBackKey) -> torch.Tensor:
    """The scale tensor as the kernel's ``sf`` parameter: col_tma through its transposed buffer, UE8M0 words as
    their bytes."""
    view = sf.t() if key.storage == "col_tma" else sf
    return view.view(torch.uint8) if key.sf == "ue8m0" and key.cols > 1 else view


def cast_back(data: torch.Tensor, sf: torch.Tensor, layout: str, out_dtype: torch.dtype, out: torch.Tensor) -> None:
    """Launches the cast back on the current stream (arguments validated, ``out`` allocated upstream, ``T > 0``)."""
    key = CAST_BACK.key(data, sf, layout, out_dtype, out)
    CAST_BACK.compiled(key)(data, sf_view(sf, key), out)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, CAST_BACK)
