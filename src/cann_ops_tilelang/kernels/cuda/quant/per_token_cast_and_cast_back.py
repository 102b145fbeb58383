"""CUDA kernel of ``per_token_cast_and_cast_back`` (docs/ops/quant.md#per_token_cast_and_cast_back): ``x`` is
overwritten in place with ``x.dtype(fl(f32(Q(fl(x * inv))) * s))``.

The per-token cast's scheme without its stores of data and scales: a flat grid over the ``T * H / V`` 16-byte
vectors of ``x`` (``V`` = 8 bf16 or 4 fp32 elements), ``vectors`` per thread strided by the CTA size (coalesced),
all loads issued before any compute. A group of ``g`` channels is ``g / V`` consecutive lanes of one warp; an
xor-butterfly gives every lane the group's amax, every lane derives the scale ``s`` and inverse ``inv`` as the
reference does (the clamp, the IEEE divisions ``a / max`` and ``max / a`` or ``1 / s``, the power-of-two round-up on
the bits, e4m3 scales narrowed by the hardware), narrows ``fl(x * inv)`` (e4m3 by the hardware's round-to-nearest-even
saturating conversion, e2m1 by the grid's midpoints), widens it back exactly, multiplies by ``s`` (one IEEE product)
and rounds once to ``x``'s dtype, storing its own vector where it read it (no lane reads another's vector: the
shuffles exchange registers, so the in-place write is safe). ``T`` and ``x``'s row stride (a multiple of 16 bytes)
are dynamic; ``T * stride < 2**31``.
"""

import dataclasses

import torch

from ....limits import QUANT_HIDDEN, IntRange, LimitError
from ....quant import AMAX_CLAMP, FORMATS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import e2m1_decode, e2m1_encode, f32_bits

VEC_BYTES = 16  # bytes of one vector access of x
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
_GROUPS = IntRange("a per-token group size", 16, 128)


@dataclasses.dataclass(frozen=True)
class FakeQuantPlan:
    """A flat grid over the vectors of ``x``: CTAs of ``threads`` threads, ``vectors`` vectors per thread."""

    threads: int
    vectors: int


# 256 threads x 2 vectors (8 KiB of bf16 in flight per CTA), as the per-token cast; not yet measured on a GPU
# (docs/perf/h200/quant.md will hold the measurement).
FAKE_QUANT_PLAN = FakeQuantPlan(threads=256, vectors=2)


@compile_key
class FakeQuantKey:
    """Compile-time key: the row, the group, x's dtype, the data format and how the scale is made (fp32 exact,
    rounded to a power of two, or e4m3); never the token count nor the row stride. The storage does not matter and
    UE8M0 is fp32 rounded: both are left out, so equal arithmetic shares one kernel."""

    hidden: int
    group: int
    in_dtype: str  # "bfloat16" | "float32"
    fmt: str  # "e4m3" | "e2m1"
    scale: str  # "exact" | "round" | "e4m3"


def fake_quant_key(hidden: int, in_dtype: str, layout: ScaleLayout) -> FakeQuantKey:
    """The key of a launch: ``H`` in ``limits.QUANT_HIDDEN``, a per-token layout (``LimitError``)."""
    if layout.kind != "per_token":
        raise LimitError(f"per_token_cast_and_cast_back: the layout must be per-token, got {layout.spec}")
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"per_token_cast_and_cast_back: the input dtype must be bfloat16 or float32, got {in_dtype}")
    scale = "e4m3" if layout.sf == "e4m3" else "round" if layout.round_sf else "exact"
    return FakeQuantKey(hidden=QUANT_HIDDEN.require("per_token_cast_and_cast_back", int(hidden)),
                        group=_GROUPS.require("per_token_cast_and_cast_back", layout.block[1]), in_dtype=in_dtype,
                        fmt=layout.fmt, scale=scale)


def build_per_token_cast_and_cast_back(hidden: int, group: int, in_dtype: str, fmt: str, scale: str):
    """Builds the in-place fake quantization of one key (see the module docstring).

    Returns:
        ``T.prim_func(x)``: ``x (T, H)`` of ``in_dtype`` with a dynamic row stride, read and written. ``T`` is
        dynamic.
    """
    from tilelang import language as T

    if scale not in ("exact", "round", "e4m3"):
        raise LimitError(f"per_token_cast_and_cast_back: scale must be 'exact', 'round' or 'e4m3', got {scale!r}")
    ScaleLayout((1, group), fmt, "e4m3" if scale == "e4m3" else "fp32", "row", scale == "round")  # its checks
    H = QUANT_HIDDEN.require("per_token_cast_and_cast_back", hidden)
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"per_token_cast_and_cast_back: the input dtype must be bfloat16 or float32, got {in_dtype}")
    V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]  # elements per vector
    lanes = group // V  # lanes of a group (2..32, a power of two)
    levels = lanes.bit_length() - 1
    nvec = H // V
    threads, nvt = FAKE_QUANT_PLAN.threads, FAKE_QUANT_PLAN.vectors
    f32, u32 = T.float32, T.uint32
    fmax = FORMATS[fmt].max
    clamp_bits = f32_bits(AMAX_CLAMP[fmt, scale == "e4m3"])
    e2m1 = fmt == "e2m1"

    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")

    @T.prim_func
    def per_token_cast_and_cast_back_cuda(
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype),
    ):
        T.assume(x_stride % V == 0)  # rows start on vectors (the op checks it): the accesses are 16 bytes wide
        with T.Kernel(T.ceildiv(num_tokens * nvec, threads * nvt), threads=threads) as bid:
            tid = T.get_thread_binding()
            xr = T.alloc_local((nvt, V), in_dtype)
            y = T.alloc_local((V,), in_dtype)
            amax = T.alloc_local((nvt,), f32)
            sc = T.alloc_local((4,), f32)  # a, a / max, s, inv
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
                    sc[0] = T.max(amax[j], T.reinterpret(T.uint32(clamp_bits), f32))  # a
                    sc[1] = T.ieee_fdiv(sc[0], T.float32(fmax))  # a / max
                    if scale == "round":
                        sc[2] = T.reinterpret((T.reinterpret(sc[1], u32) + T.uint32(0x7FFFFF))
                                              & T.uint32(0x7F800000), f32)  # 2^ceil(log2(a / max))
                        sc[3] = T.ieee_fdiv(T.float32(1.0), sc[2])
                    elif scale == "e4m3":
                        sc[2] = T.cast(T.cast(T.min(sc[1], T.float32(448.0)), T.float8_e4m3fn), f32)
                        sc[3] = T.ieee_fdiv(T.float32(1.0), sc[2])
                    else:
                        sc[2] = sc[1]
                        sc[3] = T.ieee_fdiv(T.float32(fmax), sc[0])
                    for k in T.unroll(V):
                        if e2m1:
                            y[k] = T.cast(T.ieee_mul(e2m1_decode(T, T.cast(e2m1_encode(
                                T, T.ieee_mul(T.cast(xr[j, k], f32), sc[3])), u32)), sc[2]), in_dtype)
                        else:
                            y[k] = T.cast(T.ieee_mul(T.cast(T.cast(T.ieee_mul(T.cast(xr[j, k], f32), sc[3]),
                                                                   T.float8_e4m3fn), f32), sc[2]), in_dtype)
                    for k in T.vectorized(V):
                        x[((bid * nvt + j) * threads + tid) // nvec,
                          (((bid * nvt + j) * threads + tid) % nvec) * V + k] = y[k]

    return per_token_cast_and_cast_back_cuda


def _derive(x, layout):
    return fake_quant_key(x.shape[1], _IN_DTYPES.get(x.dtype, str(x.dtype)), ScaleLayout.parse(layout))


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """The variants the CPU tier lowers at ``H``: e4m3 with exact fp32 scales from bf16 and fp32, with power-of-two
    scales (UE8M0) at 1x128, e2m1 with power-of-two 1x32 (MXFP4) and e4m3 1x16 scales."""
    del hc_mult
    specs = {"e4m3_exact_g128_bf16": ("1x128/e4m3/fp32/row/exact", "bfloat16"),
             "e4m3_exact_g128_f32": ("1x128/e4m3/fp32/row/exact", "float32"),
             "e4m3_round_g128_bf16": ("1x128/e4m3/ue8m0/row/round", "bfloat16"),
             "e2m1_round_g32_bf16": ("1x32/e2m1/ue8m0/row/round", "bfloat16"),
             "e2m1_e4m3_g16_f32": ("1x16/e2m1/e4m3/row/exact", "float32")}
    return {f"per_token_cast_and_cast_back_{name}": fake_quant_key(hidden_size, dtype, ScaleLayout.parse(spec))
            for name, (spec, dtype) in specs.items()}


FAKE_QUANT = Kernel("per_token_cast_and_cast_back", FakeQuantKey, build_per_token_cast_and_cast_back, derive=_derive,
                    cases=_cases)


def per_token_cast_and_cast_back(x: torch.Tensor, layout: str) -> None:
    """Launches the in-place fake quantization of ``x`` on the current stream (validated upstream, ``T > 0``)."""
    FAKE_QUANT.compiled(FAKE_QUANT.key(x, layout))(x)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FAKE_QUANT)
