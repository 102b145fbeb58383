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

Variants, one builder: ``per_token_cast_sf`` skips the data stores; ``per_token_cast_with_sf`` skips the amax and
reads each group's scale (every lane of the group the same word, cached), ``inv = fl(1 / s)``. Re-quantization
(``per_token_cast`` with ``x_sf``): 16 values a lane (a 16-byte e4m3 load or 8 bytes of e2m1 pairs, decoded on
the bits), the lane's input scale read once (input groups are whole lanes), the amax over ``fl(f32(data) * sx)``
and the data ``Q(fl(f32(data) * fl(sx * inv)))``, CUDA's order of the contract.
"""

import dataclasses

import torch

from ....limits import QUANT_HIDDEN, IntRange, LimitError
from ....quant import ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import e2m1_encode, group_scale, sf_index, sf_param, sf_view, stored_scale

# bytes of one vector access of x
VEC_BYTES = 16
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
_GROUPS = IntRange("a per-token group size", 16, 128)
# the kernels of one builder: the cast, its scales alone, its data alone from given scales
VARIANTS = ("cast", "sf_only", "with_sf")
# values a lane of the re-quantization takes (16 e4m3 bytes, 8 bytes of e2m1): a group is whole lanes
REQUANT_VALUES = 16


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
    variant: str = "cast"  # "cast" | "sf_only" | "with_sf" (VARIANTS)


@compile_key
class RequantKey:
    """Compile-time key of the re-quantization: the output layout's fields and the input's data format and scales
    (group, kind, storage; its rounding does not change how a scale is read)."""

    hidden: int
    group: int
    fmt: str
    sf: str
    storage: str
    round_sf: bool
    x_fmt: str  # "e4m3" | "e2m1"
    x_group: int
    x_sf: str
    x_storage: str


def cast_key(op: str, hidden: int, in_dtype: str, layout: ScaleLayout, variant: str = "cast") -> CastKey:
    """The :class:`CastKey` of a launch: ``H`` in ``limits.QUANT_HIDDEN``, a per-token layout (``LimitError``)."""
    if layout.kind != "per_token":
        raise LimitError(f"{op}: the layout must be per-token, got {layout.spec}")
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    group = _GROUPS.require(op, layout.block[1])
    return CastKey(hidden=QUANT_HIDDEN.require(op, int(hidden)), group=group, in_dtype=in_dtype, fmt=layout.fmt,
                   sf=layout.sf, storage=layout.storage, round_sf=layout.round_sf, variant=variant)


def requant_key(op: str, hidden: int, layout: ScaleLayout, x_layout: ScaleLayout) -> RequantKey:
    """The :class:`RequantKey` of a launch (``LimitError`` outside the ranges or for a non-per-token layout)."""
    base = cast_key(op, hidden, "float32", layout)
    if x_layout.kind != "per_token":
        raise LimitError(f"{op}: the input layout must be per-token, got {x_layout.spec}")
    return RequantKey(hidden=base.hidden, group=base.group, fmt=base.fmt, sf=base.sf, storage=base.storage,
                      round_sf=base.round_sf, x_fmt=x_layout.fmt, x_group=_GROUPS.require(op, x_layout.block[1]),
                      x_sf=x_layout.sf, x_storage=x_layout.storage)


def build_per_token_cast(hidden: int, group: int, in_dtype: str, fmt: str, sf: str, storage: str, round_sf: bool,
                         variant: str = "cast"):
    """Builds the per-token cast of one layout (the key's fields; see the module docstring); ``variant``
    ``"cast"`` (data and scales), ``"sf_only"`` (scales alone) or ``"with_sf"`` (data alone from given scales).

    Returns:
        ``T.prim_func``: ``(x, data, sf_out)``, ``(x, sf_out)`` (sf only) or ``(x, sf, data)`` (with sf). ``x (T, H)``
        of ``in_dtype`` with a dynamic row stride; ``data`` ``(T, H)`` float8_e4m3fn or ``(T, H / 2)`` uint8; the
        scales as the launcher passes them: ``(T, nk)`` fp32 / e4m3 (row) or their transpose ``(nk, T)`` with a
        dynamic row stride (col_tma); UE8M0 as bytes, ``(T, 4 W)`` (row) or ``(W, 4 T)`` strided (col_tma),
        ``W = ceil(nk / 4)`` words per token. ``T`` is dynamic.
    """
    if variant not in VARIANTS:
        raise LimitError(f"per_token_cast: variant must be one of {VARIANTS}, got {variant!r}")
    return _build(hidden, group, fmt, sf, storage, round_sf, variant, in_dtype)


def build_per_token_cast_requant(hidden: int, group: int, fmt: str, sf: str, storage: str, round_sf: bool,
                                 x_fmt: str, x_group: int, x_sf: str, x_storage: str):
    """Builds the re-quantization of per-token quantized data (``x_fmt`` data, scales ``x_sf`` of groups
    ``x_group`` in ``x_storage``) to a per-token layout: ``T.prim_func(x, x_sf, data, sf_out)``, ``x`` ``(T, H)``
    float8_e4m3fn or ``(T, H / 2)`` uint8 (e2m1) with a dynamic row stride, ``x_sf`` in the forms of the scales
    above; the product ``f32(x) * fl(sx * inv)`` (CUDA's order, docs/ops/quant.md#per_token_cast)."""
    ScaleLayout((1, x_group), x_fmt, x_sf, x_storage, x_sf == "ue8m0")  # the input layout's own checks
    return _build(hidden, group, fmt, sf, storage, round_sf, "requant", x_fmt, (x_group, x_sf, x_storage))


def _build(hidden, group, fmt, sf, storage, round_sf, variant, in_dtype, x_scales=None):
    from tilelang import language as T

    layout = ScaleLayout((1, group), fmt, sf, storage, round_sf)  # the layout's own checks
    H = QUANT_HIDDEN.require("per_token_cast", hidden)
    if H % group:
        raise LimitError(f"per_token_cast: H = {H} is not a multiple of the group {group}")
    requant = variant == "requant"
    if requant:
        x_group, x_sf, x_storage = x_scales
        # 16 values a lane (16 e4m3 bytes, or 8 bytes of e2m1 pairs), so that every input group is whole lanes
        V, x_dtype = REQUANT_VALUES, (T.uint8 if in_dtype == "e2m1" else T.float8_e4m3fn)
        x_cols, VB = (H // 2, V // 2) if in_dtype == "e2m1" else (H, V)
    else:
        if in_dtype not in _ELEMENT_BYTES:
            raise LimitError(f"per_token_cast: the input dtype must be bfloat16 or float32, got {in_dtype}")
        V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]  # elements per vector
        x_dtype, x_cols, VB = in_dtype, H, V
    lanes = group // V  # lanes of a group (1..32, a power of two)
    levels = lanes.bit_length() - 1
    nvec, nk = H // V, H // group
    words = -(-nk // 4)  # UE8M0 words per token
    threads, nvt = CAST_PLAN.threads, CAST_PLAN.vectors
    f32, u32, u8 = T.float32, T.uint32, T.uint8
    scale_of = group_scale(T, fmt, sf, round_sf)
    e2m1 = fmt == "e2m1"
    data_dtype = u8 if e2m1 else T.float8_e4m3fn
    data_cols = H // 2 if e2m1 else H
    writes_data, writes_sf = variant != "sf_only", variant != "with_sf"
    x_align = VEC_BYTES // (1 if requant else _ELEMENT_BYTES[in_dtype])  # x's row stride: elements of 16 bytes

    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")
    sf_arg = sf_param(T, storage, sf, nk, num_tokens, "sf_stride")
    x_sf_arg = sf_param(T, x_storage, x_sf, H // x_group, num_tokens, "x_sf_stride") if requant else None
    del layout

    pad = (4 - nk % 4) % 4  # zero bytes after the last UE8M0 scale of a token

    @T.macro
    def store_scale(sf_out, token, g, value):
        sf_out[sf_index(storage, sf, token, g)] = value
        if sf == "ue8m0" and pad:
            if g == nk - 1:
                for b in T.unroll(pad):
                    if storage == "row":
                        sf_out[token, nk + b] = T.uint8(0)
                    else:
                        sf_out[words - 1, token * 4 + 4 - pad + b] = T.uint8(0)

    def decode(value, kind):
        """The fp32 scale of a stored one: fp32 as is, e4m3 widened, a UE8M0 byte ``e`` as the bits ``e << 23``."""
        if kind == "ue8m0":
            return T.reinterpret(T.cast(value, u32) << T.uint32(23), f32)
        return T.cast(value, f32) if kind == "e4m3" else value

    @T.macro
    def body(x, sf_in, data, sf_out):
        T.assume(x_stride % x_align == 0)  # rows start on 16 bytes (the op checks it): the loads are vectors
        with T.Kernel(T.ceildiv(num_tokens * nvec, threads * nvt), threads=threads) as bid:
            tid = T.get_thread_binding()
            xr = T.alloc_local((nvt, VB), x_dtype)
            v = T.alloc_local((nvt, V), f32)  # the values (re-quantizing: fl(f32(data) * sx))
            sx = T.alloc_local((nvt,), f32)  # re-quantizing: the lane's input scale (a lane is in one input group)
            y = T.alloc_local((V,), f32)
            amax = T.alloc_local((nvt,), f32)
            scale = T.alloc_local((4,), f32)  # a, a / max, s, inv
            factor = T.alloc_local((1,), f32)  # re-quantizing: fl(sx * inv)
            total = num_tokens * nvec
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for k in T.vectorized(VB):
                        xr[j, k] = x[((bid * nvt + j) * threads + tid) // nvec,
                                     (((bid * nvt + j) * threads + tid) % nvec) * VB + k]
                    if requant:
                        sx[j] = decode(sf_in[sf_index(x_storage, x_sf, ((bid * nvt + j) * threads + tid) // nvec,
                                                      ((((bid * nvt + j) * threads + tid) % nvec) * V) // x_group)],
                                       x_sf)
                else:
                    for k in T.vectorized(VB):
                        xr[j, k] = T.cast(0, x_dtype)
                    if requant:
                        sx[j] = T.float32(0)
            for j in T.unroll(nvt):
                for k in T.unroll(V):
                    if not requant:
                        v[j, k] = T.cast(xr[j, k], f32)
                    elif in_dtype == "e2m1":
                        v[j, k] = e2m1_value(T, (T.cast(xr[j, k // 2], u32) >> T.cast(4 * (k % 2), u32))
                                             & T.uint32(15))
                    else:
                        v[j, k] = T.cast(xr[j, k], f32)
            if writes_sf:
                for j in T.unroll(nvt):
                    amax[j] = T.float32(0)
                    for k in T.unroll(V):
                        if requant:
                            amax[j] = T.max(amax[j], T.abs(T.ieee_mul(v[j, k], sx[j])))
                        else:
                            amax[j] = T.max(amax[j], T.abs(v[j, k]))
                    for b in T.unroll(levels):
                        amax[j] = T.max(amax[j], T.shfl_xor(amax[j], 1 << b))
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    if variant == "with_sf":
                        scale[2] = decode(sf_in[sf_index(storage, sf, ((bid * nvt + j) * threads + tid) // nvec,
                                                          (((bid * nvt + j) * threads + tid) % nvec) // lanes)], sf)
                        scale[3] = T.ieee_fdiv(T.float32(1.0), scale[2])
                    else:
                        scale_of(scale, amax[j])
                    if writes_data:
                        if requant:  # CUDA's order: one factor fl(sx * inv) per lane, then f32(data) * factor
                            factor[0] = T.ieee_mul(sx[j], scale[3])
                            for k in T.unroll(V):
                                y[k] = T.ieee_mul(v[j, k], factor[0])
                        else:
                            for k in T.unroll(V):
                                y[k] = T.ieee_mul(v[j, k], scale[3])
                        if e2m1:
                            for k in T.vectorized(V // 2):
                                data[((bid * nvt + j) * threads + tid) // nvec,
                                     (((bid * nvt + j) * threads + tid) % nvec) * (V // 2) + k] = (
                                    e2m1_encode(T, y[2 * k]) | (e2m1_encode(T, y[2 * k + 1]) << T.uint8(4)))
                        else:
                            for k in T.vectorized(V):
                                data[((bid * nvt + j) * threads + tid) // nvec,
                                     (((bid * nvt + j) * threads + tid) % nvec) * V + k] = T.cast(y[k],
                                                                                                  T.float8_e4m3fn)
                    if writes_sf:
                        if ((bid * nvt + j) * threads + tid) % lanes == 0:
                            store_scale(sf_out, ((bid * nvt + j) * threads + tid) // nvec,
                                        (((bid * nvt + j) * threads + tid) % nvec) // lanes,
                                        stored_scale(T, scale[2], sf))

    x_param = T.StridedTensor((num_tokens, x_cols), (x_stride, 1), x_dtype)
    data_param = T.Tensor((num_tokens, data_cols), data_dtype)
    if variant == "sf_only":
        @T.prim_func
        def per_token_cast_sf_cuda(x: x_param, sf_out: sf_arg):
            body(x, None, None, sf_out)
        return per_token_cast_sf_cuda
    if variant == "with_sf":
        @T.prim_func
        def per_token_cast_with_sf_cuda(x: x_param, sf: sf_arg, data: data_param):
            body(x, sf, data, None)
        return per_token_cast_with_sf_cuda
    if requant:
        @T.prim_func
        def per_token_cast_requant_cuda(x: x_param, x_sf: x_sf_arg, data: data_param, sf_out: sf_arg):
            body(x, x_sf, data, sf_out)
        return per_token_cast_requant_cuda

    @T.prim_func
    def per_token_cast_cuda(x: x_param, data: data_param, sf_out: sf_arg):
        body(x, None, data, sf_out)
    return per_token_cast_cuda


def e2m1_value(T, code):
    """The fp32 value of an e2m1 code (uint32 0..15): magnitude bits ``(e + 126) << 23 | m << 22`` for exponent
    ``e > 0``, 0.5 for code 1, 0 for code 0; the sign is bit 3."""
    c = code
    e, m = (c >> T.uint32(1)) & T.uint32(3), c & T.uint32(1)
    mag = T.if_then_else(e > T.uint32(0), ((e + T.uint32(126)) << T.uint32(23)) | (m << T.uint32(22)),
                         m * T.uint32(126 << 23))
    return T.reinterpret(mag | ((c >> T.uint32(3)) << T.uint32(31)), T.float32)


def _in_dtype(x) -> str:
    return _IN_DTYPES.get(x.dtype, str(x.dtype))


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


# one lowering case per variant (the CPU tier's time): the scales alone and the data from given scales of SM100's
# UE8M0 col_tma layout (the words' bytes read back), and MXFP4 (e2m1, UE8M0 1x32 row) re-quantized to SM100's layout
_SF_CASE = ("e4m3_ue8m0_col_bf16", "1x128/e4m3/ue8m0/col_tma/round", "bfloat16")
_WITH_SF_CASE = ("e4m3_ue8m0_col_f32", "1x128/e4m3/ue8m0/col_tma/round", "float32")
_REQUANT_CASE = ("e2m1_ue8m0_g32_to_e4m3_ue8m0_col", "1x32/e2m1/ue8m0/row/round", "1x128/e4m3/ue8m0/col_tma/round")


def _sf_cases(hidden_size: int, hc_mult: int) -> dict:
    name, spec, dtype = _SF_CASE
    return {f"per_token_cast_sf_{name}": cast_key("per_token_cast_sf", hidden_size, dtype, ScaleLayout.parse(spec),
                                                  "sf_only")}


def _with_sf_cases(hidden_size: int, hc_mult: int) -> dict:
    name, spec, dtype = _WITH_SF_CASE
    return {f"per_token_cast_with_sf_{name}": cast_key("per_token_cast_with_sf", hidden_size, dtype,
                                                       ScaleLayout.parse(spec), "with_sf")}


def _requant_cases(hidden_size: int, hc_mult: int) -> dict:
    name, source, out = _REQUANT_CASE
    return {f"per_token_cast_requant_{name}": requant_key("per_token_cast", hidden_size, ScaleLayout.parse(out),
                                                          ScaleLayout.parse(source))}


PER_TOKEN_CAST = Kernel("per_token_cast", CastKey, build_per_token_cast, cases=_cases,
                        derive=lambda x, layout: cast_key("per_token_cast", x.shape[1], _in_dtype(x),
                                                          ScaleLayout.parse(layout)))
PER_TOKEN_CAST_REQUANT = Kernel("per_token_cast_requant", RequantKey, build_per_token_cast_requant,
                                cases=_requant_cases,
                                derive=lambda x, layout, x_layout: requant_key(
                                    "per_token_cast", ScaleLayout.parse(x_layout).hidden_of(x),
                                    ScaleLayout.parse(layout), ScaleLayout.parse(x_layout)))
PER_TOKEN_CAST_SF = Kernel("per_token_cast_sf", CastKey, build_per_token_cast, cases=_sf_cases,
                           derive=lambda x, layout: cast_key("per_token_cast_sf", x.shape[1], _in_dtype(x),
                                                             ScaleLayout.parse(layout), "sf_only"))
PER_TOKEN_CAST_WITH_SF = Kernel("per_token_cast_with_sf", CastKey, build_per_token_cast, cases=_with_sf_cases,
                                derive=lambda x, layout: cast_key("per_token_cast_with_sf", x.shape[1],
                                                                  _in_dtype(x), ScaleLayout.parse(layout),
                                                                  "with_sf"))


def per_token_cast(x: torch.Tensor, layout: str, x_sf: torch.Tensor | None, x_layout: str | None,
                   data: torch.Tensor, sf: torch.Tensor) -> None:
    """Launches the cast of ``x`` to ``layout`` on the current stream (arguments validated and outputs allocated
    upstream, ``T > 0``): writes ``data`` and ``sf``. With ``x_sf`` / ``x_layout``, ``x`` is re-quantized."""
    if x_sf is None:
        key = PER_TOKEN_CAST.key(x, layout)
        PER_TOKEN_CAST.compiled(key)(x, data, sf_view(sf, key.storage, key.sf))
        return
    key = PER_TOKEN_CAST_REQUANT.key(x, layout, x_layout)
    PER_TOKEN_CAST_REQUANT.compiled(key)(x, sf_view(x_sf, key.x_storage, key.x_sf), data,
                                         sf_view(sf, key.storage, key.sf))


def per_token_cast_sf(x: torch.Tensor, layout: str, sf: torch.Tensor) -> None:
    """Launches the scales alone: writes ``sf``."""
    key = PER_TOKEN_CAST_SF.key(x, layout)
    PER_TOKEN_CAST_SF.compiled(key)(x, sf_view(sf, key.storage, key.sf))


def per_token_cast_with_sf(x: torch.Tensor, sf: torch.Tensor, layout: str, data: torch.Tensor) -> None:
    """Launches the data alone from the given scales ``sf`` (read): writes ``data``."""
    key = PER_TOKEN_CAST_WITH_SF.key(x, layout)
    PER_TOKEN_CAST_WITH_SF.compiled(key)(x, sf_view(sf, key.storage, key.sf), data)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, PER_TOKEN_CAST, PER_TOKEN_CAST_REQUANT, PER_TOKEN_CAST_SF,
                                                 PER_TOKEN_CAST_WITH_SF)
