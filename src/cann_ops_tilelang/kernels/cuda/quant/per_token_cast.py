"""CUDA kernel of ``per_token_cast`` (docs/ops/quant.md#per_token_cast).

A flat grid over the ``T * H / V`` 16-byte vectors of ``x`` (``V`` = 8 bf16 or 4 fp32 elements), ``vectors`` per
thread strided by the CTA size so that every warp access is coalesced; each thread issues all its loads before it
computes. A group of ``g`` channels is ``g / V`` consecutive lanes of one warp (``H`` a multiple of 128 keeps every
group in one row and every row whole vectors): each lane takes the ``|max|`` of its vector, an xor-butterfly over
the group's lanes gives every lane the group's amax, every lane derives the same scale and inverse from it and
writes its vector's data (``V`` e4m3 bytes, or ``V / 2`` bytes of e2m1 pairs), and the group's first lane writes
the scale. The arithmetic is the reference's, operation by operation (tests/quant/quant_ref.py: the clamp, the
IEEE divisions ``a / max`` and ``max / a`` or ``1 / s``, one IEEE product ``x * inv``, e4m3 by the hardware's
round-to-nearest-even saturating conversion, e2m1 by comparisons with the midpoints of its grid).

Scales: fp32 or e4m3 values, or UE8M0 exponent bytes written one by one into the int32 words (byte ``b`` of word
``j`` is the scale of group ``4j + b``, the bytes past the last group 0); ``"row"`` storage row-major,
``"col_tma"`` into the transposed, TMA-padded buffer (its padding is not written). ``T`` is dynamic, ``x``'s row
stride too (a multiple of 16 bytes); ``T * stride < 2**31`` (32-bit offsets, ``limits.QUANT_ELEMENTS``).
"""

import dataclasses
import struct

import torch

from ....limits import QUANT_HIDDEN, IntRange, LimitError
from ....quant import AMAX_CLAMP, FORMATS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module

# bytes of one vector access of x
VEC_BYTES = 16
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
# the e2m1 grid's midpoints, each with whether a tie there rounds up (to the even code above it)
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_GROUPS = IntRange("a per-token group size", 16, 128)


@dataclasses.dataclass(frozen=True)
class CastPlan:
    """A flat grid over the vectors of ``x``: CTAs of ``threads`` threads, ``vectors`` vectors per thread."""

    threads: int
    vectors: int


# 256 threads x 2 vectors (8 KiB of bf16 in flight per CTA), as the mHC row copies; not yet measured on a GPU
# (docs/perf/h200/quant.md will hold the measurement).
CAST_PLAN = CastPlan(threads=256, vectors=2)


@compile_key
class CastKey:
    """Compile-time key of the cast: the row, the group and the layout's fields; never the token count nor the
    row stride."""

    hidden: int
    group: int
    in_dtype: str  # "bfloat16" | "float32"
    fmt: str  # "e4m3" | "e2m1"
    sf: str  # "fp32" | "e4m3" | "ue8m0"
    storage: str  # "row" | "col_tma"
    round_sf: bool


def cast_key(op: str, hidden: int, in_dtype: str, layout: ScaleLayout) -> CastKey:
    """The :class:`CastKey` of a launch: ``H`` in ``limits.QUANT_HIDDEN``, a per-token layout (``LimitError``)."""
    if layout.kind != "per_token":
        raise LimitError(f"{op}: the layout must be per-token, got {layout.spec}")
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    group = _GROUPS.require(op, layout.block[1])
    return CastKey(hidden=QUANT_HIDDEN.require(op, int(hidden)), group=group, in_dtype=in_dtype, fmt=layout.fmt,
                   sf=layout.sf, storage=layout.storage, round_sf=layout.round_sf)


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def build_per_token_cast(hidden: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str, round_sf: bool):
    """Builds the per-token cast of one layout (the key's fields; see the module docstring).

    Returns:
        ``T.prim_func(x, data, sf)``: ``x (T, H)`` of ``in_dtype`` with a dynamic row stride; ``data`` ``(T, H)``
        float8_e4m3fn or ``(T, H / 2)`` uint8; ``sf`` as the launcher passes it: ``(T, nk)`` fp32 / e4m3 (row) or
        their transpose ``(nk, T)`` with a dynamic row stride (col_tma); UE8M0 as bytes, ``(T, 4 W)`` (row) or
        ``(W, 4 T)`` strided (col_tma), ``W = ceil(nk / 4)`` words per token. ``T`` is dynamic.
    """
    from tilelang import language as T

    layout = ScaleLayout((1, group), fmt, sf, storage, round_sf)  # the layout's own checks
    H = QUANT_HIDDEN.require("per_token_cast", hidden)
    if H % group:
        raise LimitError(f"per_token_cast: H = {H} is not a multiple of the group {group}")
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"per_token_cast: the input dtype must be bfloat16 or float32, got {in_dtype}")
    V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]  # elements per vector
    lanes = group // V  # lanes of a group (2..32, a power of two)
    levels = lanes.bit_length() - 1
    nvec, nk = H // V, H // group
    words = -(-nk // 4)  # UE8M0 words per token
    threads, nvt = CAST_PLAN.threads, CAST_PLAN.vectors
    f32, u32, u8 = T.float32, T.uint32, T.uint8
    fmax = FORMATS[fmt].max
    clamp_bits = _f32_bits(AMAX_CLAMP[fmt, sf == "e4m3"])
    e2m1 = fmt == "e2m1"
    data_dtype = u8 if e2m1 else T.float8_e4m3fn
    data_cols = H // 2 if e2m1 else H
    sf_dtype = {"fp32": f32, "e4m3": T.float8_e4m3fn, "ue8m0": u8}[sf]

    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")
    sf_stride = T.dynamic("sf_stride")
    if storage == "row":
        sf_param = T.Tensor((num_tokens, 4 * words if sf == "ue8m0" else nk), sf_dtype)
    else:
        sf_shape = (words, 4 * num_tokens) if sf == "ue8m0" else (nk, num_tokens)
        sf_param = T.StridedTensor(sf_shape, (sf_stride, 1), sf_dtype)
    del layout

    pad = (4 - nk % 4) % 4  # zero bytes after the last UE8M0 scale of a token

    @T.macro
    def store_scale(sf_out, token, g, value):
        if sf != "ue8m0":
            if storage == "row":
                sf_out[token, g] = value
            else:
                sf_out[g, token] = value
        elif storage == "row":
            sf_out[token, g] = value
            if pad:
                if g == nk - 1:
                    for b in T.unroll(pad):
                        sf_out[token, nk + b] = T.uint8(0)
        else:
            sf_out[g // 4, token * 4 + g % 4] = value
            if pad:
                if g == nk - 1:
                    for b in T.unroll(pad):
                        sf_out[words - 1, token * 4 + 4 - pad + b] = T.uint8(0)

    @T.prim_func
    def per_token_cast_cuda(
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype),
        data: T.Tensor((num_tokens, data_cols), data_dtype),
        sf_out: sf_param,
    ):
        T.assume(x_stride % V == 0)  # rows start on vectors (the op checks it): the loads are 16 bytes wide
        with T.Kernel(T.ceildiv(num_tokens * nvec, threads * nvt), threads=threads) as bid:
            tid = T.get_thread_binding()
            xr = T.alloc_local((nvt, V), in_dtype)
            y = T.alloc_local((V,), f32)
            amax = T.alloc_local((nvt,), f32)
            scale = T.alloc_local((4,), f32)  # a, a / max, s, inv
            total = num_tokens * nvec
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for k in T.vectorized(V):
                        xr[j, k] = x[((bid * nvt + j) * threads + tid) // nvec,
                                     (((bid * nvt + j) * threads + tid) % nvec) * V + k]
                else:
                    for k in T.vectorized(V):
                        xr[j, k] = T.cast(0, in_dtype)
            for j in T.unroll(nvt):
                amax[j] = T.abs(T.cast(xr[j, 0], f32))
                for k in T.unroll(1, V):
                    amax[j] = T.max(amax[j], T.abs(T.cast(xr[j, k], f32)))
                for b in T.unroll(levels):
                    amax[j] = T.max(amax[j], T.shfl_xor(amax[j], 1 << b))
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    # every slot written once: TileLang's codegen may reuse a reinterpret of a slot across a store
                    scale[0] = T.max(amax[j], T.reinterpret(T.uint32(clamp_bits), f32))  # a
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
                    for k in T.unroll(V):
                        y[k] = T.ieee_mul(T.cast(xr[j, k], f32), scale[3])
                    if e2m1:
                        for k in T.vectorized(V // 2):
                            data[((bid * nvt + j) * threads + tid) // nvec,
                                 (((bid * nvt + j) * threads + tid) % nvec) * (V // 2) + k] = (
                                e2m1_code(T, y[2 * k]) | (e2m1_code(T, y[2 * k + 1]) << T.uint8(4)))
                    else:
                        for k in T.vectorized(V):
                            data[((bid * nvt + j) * threads + tid) // nvec,
                                 (((bid * nvt + j) * threads + tid) % nvec) * V + k] = T.cast(y[k], T.float8_e4m3fn)
                    if ((bid * nvt + j) * threads + tid) % lanes == 0:
                        if sf == "ue8m0":
                            store_scale(sf_out, ((bid * nvt + j) * threads + tid) // nvec,
                                        (((bid * nvt + j) * threads + tid) % nvec) // lanes,
                                        T.cast((T.reinterpret(scale[2], u32) >> T.uint32(23)) & T.uint32(0xFF), u8))
                        elif sf == "e4m3":
                            store_scale(sf_out, ((bid * nvt + j) * threads + tid) // nvec,
                                        (((bid * nvt + j) * threads + tid) % nvec) // lanes,
                                        T.cast(scale[2], T.float8_e4m3fn))
                        else:
                            store_scale(sf_out, ((bid * nvt + j) * threads + tid) // nvec,
                                        (((bid * nvt + j) * threads + tid) % nvec) // lanes, scale[2])

    return per_token_cast_cuda


def e2m1_code(T, v):
    """The e2m1 code (uint8 0..15) of an fp32 value: round to nearest even on the grid by comparisons with its
    midpoints (a tie goes to the even code), saturating at 6 (inf too); NaN gives 7; the sign bit is ``v``'s."""
    mag = T.abs(v)
    code = T.uint8(0)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code = code + T.cast(mag >= T.float32(mid) if tie_up else mag > T.float32(mid), T.uint8)
    code = T.if_then_else(T.isnan(v), T.uint8(7), code)
    return code | T.cast((T.reinterpret(v, T.uint32) >> T.uint32(31)) << T.uint32(3), T.uint8)


def _derive(x, layout, data, sf):
    return cast_key("per_token_cast", x.shape[1], _IN_DTYPES.get(x.dtype, str(x.dtype)), ScaleLayout.parse(layout))


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """The variants the CPU tier lowers at ``H``: e4m3 with fp32 scales (SM90 DeepGEMM, row), e4m3 with UE8M0
    col_tma scales (SM100 DeepGEMM), e2m1 with UE8M0 1x32 (MXFP4) and with e4m3 1x16 col_tma scales (NVFP4-like),
    each from bf16 and one from fp32."""
    del hc_mult
    specs = {"e4m3_fp32_row": ("1x128/e4m3/fp32/row/exact", ("bfloat16", "float32")),
             "e4m3_ue8m0_col": ("1x128/e4m3/ue8m0/col_tma/round", ("bfloat16", "float32")),
             "e2m1_ue8m0_row_g32": ("1x32/e2m1/ue8m0/row/round", ("bfloat16",)),
             "e2m1_e4m3_col_g16": ("1x16/e2m1/e4m3/col_tma/exact", ("float32",)),
             "e4m3_fp32_round_g64": ("1x64/e4m3/fp32/row/round", ("bfloat16",))}
    cases = {}
    for name, (spec, dtypes) in specs.items():
        for dtype in dtypes:
            short = "bf16" if dtype == "bfloat16" else "f32"
            cases[f"per_token_cast_{name}_{short}"] = cast_key("per_token_cast", hidden_size, dtype,
                                                              ScaleLayout.parse(spec))
    return cases


PER_TOKEN_CAST = Kernel("per_token_cast", CastKey, build_per_token_cast, derive=_derive, cases=_cases)


def per_token_cast(x: torch.Tensor, layout: str, data: torch.Tensor, sf: torch.Tensor) -> None:
    """Launches the cast of ``x`` to ``layout`` on the current stream (arguments validated and outputs allocated
    upstream, ``T > 0``): writes ``data`` and ``sf`` (UE8M0 words as their bytes, col_tma through the transposed
    buffer)."""
    key = PER_TOKEN_CAST.key(x, layout, data, sf)
    sf_param = sf.t() if key.storage == "col_tma" else sf
    if key.sf == "ue8m0":
        sf_param = sf_param.view(torch.uint8)
    PER_TOKEN_CAST.compiled(key)(x, data, sf_param)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_TOKEN_CAST)
