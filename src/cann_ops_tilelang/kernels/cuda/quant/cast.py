"""CUDA kernel of ``cast`` (docs/ops/quant.md#cast): element-wise narrowing, fp32 -> bf16 / e4m3, bf16 -> e4m3.

A flat grid over the ``N / V`` 16-byte vectors of ``x`` (``V`` = 4 fp32 or 8 bf16 elements), ``vectors`` per
thread strided by the CTA size (every warp access coalesced), all loads issued before any conversion; each vector
gives ``V`` outputs stored as one vector (8 or 4 bytes). The ragged tail (``N % V`` elements) is the one thread past
the last vector, element by element. ``N`` is dynamic, below ``2**31`` (int32 offsets).

Round to nearest even: the hardware conversions (``cvt.rn`` to bf16, overflow to inf; e4m3 ``__NV_SATFINITE``, the
contract's saturating ``Q``). Stochastic rounding (docs/ops/quant.md#stochastic_rounding), 32-bit integer
operations only: ``r = fmix32((n_lo * 0x9E3779B1) ^ key)`` with ``n_lo = offset_lo + i mod 2**32``; the key depends
on the counter's high word alone, which takes two values at most in one launch (``N < 2**32``), so the launcher
hashes both on the host (the same fmix32 chain) and the kernel picks one per element by the carry of ``n_lo``.
bf16: the 16 dropped bits of the fp32 pattern get ``~r >> 16`` added (a carry rounds up: exactly ``r < frac32``)
and are cut. e4m3: ``P = |v| / 2^G`` with the spacing ``2^G``, ``G = max(e, 121) - 130`` from the biased exponent
``e`` (exact power-of-two scaling), ``frac32 = u32((P - floor P) * 2^32)``, the result ``(floor P + [r < frac32]) *
2^G`` with ``v``'s sign, then the saturating conversion (exact: the value is on the e4m3 grid, or beyond 448).
"""

import dataclasses

import torch

from ....limits import QUANT_ELEMENTS, LimitError
from ....quant.cast import COUNTER_MUL, FMIX, sr_scalars
from ..._kernel import Kernel, compile_key, kernel_module

VEC_BYTES = 16  # bytes of one vector access of x
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3fn"}
_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
# the contract's narrowing casts (input -> outputs)
CONVERSIONS = {"float32": ("bfloat16", "float8_e4m3fn"), "bfloat16": ("float8_e4m3fn",)}
@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """A flat grid over the vectors of ``x``: CTAs of ``threads`` threads, ``vectors`` 16-byte vectors per thread."""

    threads: int
    vectors: int


# 256 threads x 4 vectors: 16 KiB of x in flight per CTA, 8 CTAs (128 KiB) per SM at full occupancy, above what
# the H100's HBM needs in flight; the tail of a launch is under one wave's worth. Not measured yet on a GPU
# (docs/perf/h100/quant.md will hold the measurement).
CAST_PLAN = FlatPlan(threads=256, vectors=4)


@compile_key
class CastKey:
    """Compile-time key of the cast: the input and output dtypes and the rounding (never the element count)."""

    in_dtype: str  # "float32" | "bfloat16"
    out_dtype: str  # "bfloat16" | "float8_e4m3fn"
    stochastic: bool


def cast_key(in_dtype: str, out_dtype: str, stochastic: bool) -> CastKey:
    """The key of a conversion of the contract (``LimitError`` otherwise)."""
    if out_dtype not in CONVERSIONS.get(in_dtype, ()):
        raise LimitError(f"cast: {in_dtype} -> {out_dtype} is not a narrowing cast of the contract "
                         f"({', '.join(f'{i} -> {o}' for i, outs in CONVERSIONS.items() for o in outs)})")
    return CastKey(in_dtype=in_dtype, out_dtype=out_dtype, stochastic=bool(stochastic))


def build_cast(in_dtype: str, out_dtype: str, stochastic: bool):
    """Builds the cast of one conversion (see the module docstring).

    Returns:
        ``T.prim_func(x, out)`` (round to nearest even) or ``T.prim_func(x, out, offset_lo, key0, key1)``
        (stochastic rounding, the scalars int32 bit patterns of uint32 words); ``x (N,)`` and ``out (N,)`` flat,
        ``N`` dynamic.
    """
    from tilelang import language as T

    key = cast_key(in_dtype, out_dtype, stochastic)
    V = VEC_BYTES // _BYTES[key.in_dtype]  # elements per vector
    threads, nvt = CAST_PLAN.threads, CAST_PLAN.vectors
    f32, u32, i32 = T.float32, T.uint32, T.int32
    to_bf16 = out_dtype == "bfloat16"
    numel = T.dynamic("numel")

    def u(c: int):
        return T.uint32(c)

    @T.macro
    def narrow(v, y, k, e, offset_lo, key0, key1, r, bits):
        """``y[k]``: ``v`` (fp32, element ``e`` of x) rounded on the target's grid, as fp32 (e4m3 and round to
        nearest: the store converts) or as the bf16 result (stochastic bf16); the counter is ``offset + e``."""
        if not stochastic:
            y[k] = v
        else:
            # r(n) = fmix32((n_lo * 0x9E3779B1) ^ key), the key of the high word after a carry out of n_lo or not
            r[1] = T.cast(offset_lo, u32) + T.cast(e, u32)
            r[0] = (r[1] * u(COUNTER_MUL)) ^ T.if_then_else(r[1] < T.cast(offset_lo, u32), T.cast(key1, u32),
                                                            T.cast(key0, u32))
            r[0] = r[0] ^ (r[0] >> u(16))
            r[0] = r[0] * u(FMIX[0])
            r[0] = r[0] ^ (r[0] >> u(13))
            r[0] = r[0] * u(FMIX[1])
            r[0] = r[0] ^ (r[0] >> u(16))
            bits[0] = T.reinterpret(v, u32)
            if to_bf16:
                # the 16 dropped bits plus ~r >> 16 carry into bit 16 exactly when r < frac32; NaN stays NaN
                bits[1] = bits[0] & u(0x7FFFFFFF)
                bits[2] = T.if_then_else(bits[1] > u(0x7F800000), u(0x7FFF),
                                         ((bits[1] + (~r[0] >> u(16))) >> u(16)) | ((bits[0] >> u(16)) & u(0x8000)))
                y[k] = T.reinterpret(T.cast(bits[2], T.uint16), T.bfloat16)
            else:
                # spacing 2^G, G = max(e, 121) - 130; P = |v| / 2^G (exact), frac32 = u32((P - floor P) * 2^32)
                bits[1] = T.max((bits[0] >> u(23)) & u(0xFF), u(121))
                bits[2] = T.reinterpret(T.abs(v), u32)
                bits[2] = T.reinterpret(T.ieee_mul(T.reinterpret(bits[2], f32),
                                                   T.reinterpret((u(257) - bits[1]) << u(23), f32)), u32)
                bits[3] = T.reinterpret(T.floor(T.reinterpret(bits[2], f32)), u32)
                bits[2] = T.cast(T.ieee_mul(T.ieee_sub(T.reinterpret(bits[2], f32), T.reinterpret(bits[3], f32)),
                                            T.float32(2.0**32)), u32)
                bits[3] = T.reinterpret(
                    T.ieee_mul(T.ieee_add(T.reinterpret(bits[3], f32),
                                          T.if_then_else(r[0] < bits[2], T.float32(1.0), T.float32(0.0))),
                               T.reinterpret((bits[1] - u(3)) << u(23), f32)), u32) | (bits[0] & u(0x80000000))
                y[k] = T.if_then_else(T.isnan(v), v, T.reinterpret(bits[3], f32))

    @T.macro
    def body(x, out, offset_lo, key0, key1):
        with T.Kernel(T.ceildiv(numel, threads * nvt * V), threads=threads) as bid:
            tid = T.get_thread_binding()
            xv = T.alloc_local((nvt, V), key.in_dtype)
            # what narrow() leaves: bf16 results (stochastic bf16), else fp32 values converted by the vector store
            # (the hardware's round to nearest even, e4m3 saturating: __nv_cvt_float2_to_fp8x2 with __NV_SATFINITE)
            direct = stochastic and to_bf16
            y = T.alloc_local((V,), T.bfloat16 if direct else f32)
            yo = T.alloc_local((V,), out_dtype)  # the tail's converted vector
            r = T.alloc_local((2,), u32)
            bits = T.alloc_local((4,), u32)
            full = numel // V
            # vector j of the thread: (bid * nvt + j) * threads + tid, compared in vectors (int32 up to 2**31 - 1)
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < full:
                    for k in T.vectorized(V):
                        xv[j, k] = x[((bid * nvt + j) * threads + tid) * V + k]
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < full:
                    for k in T.unroll(V):
                        narrow(T.cast(xv[j, k], f32), y, k, ((bid * nvt + j) * threads + tid) * V + k, offset_lo,
                               key0, key1, r, bits)
                    for k in T.vectorized(V):
                        out[((bid * nvt + j) * threads + tid) * V + k] = y[k] if direct else T.cast(y[k], out_dtype)
                elif (bid * nvt + j) * threads + tid == full:
                    # the ragged tail (N % V elements): a zero-padded vector through the same conversions, stored
                    # element by element
                    for k in T.serial(V):
                        xv[j, k] = T.if_then_else(full * V + k < numel, x[T.min(full * V + k, numel - 1)],
                                                  T.cast(0, key.in_dtype))
                    for k in T.unroll(V):
                        narrow(T.cast(xv[j, k], f32), y, k, full * V + k, offset_lo, key0, key1, r, bits)
                    for k in T.vectorized(V):
                        yo[k] = y[k] if direct else T.cast(y[k], out_dtype)
                    for k in T.serial(V):
                        if full * V + k < numel:
                            out[full * V + k] = yo[k]

    if stochastic:
        @T.prim_func
        def cast_sr_cuda(x: T.Tensor((numel,), key.in_dtype), out: T.Tensor((numel,), out_dtype), offset_lo: i32,
                         key0: i32, key1: i32):
            body(x, out, offset_lo, key0, key1)

        return cast_sr_cuda

    @T.prim_func
    def cast_cuda(x: T.Tensor((numel,), key.in_dtype), out: T.Tensor((numel,), out_dtype)):
        body(x, out, 0, 0, 0)

    return cast_cuda


def _derive(x, dtype, seed, offset, out):
    return cast_key(_DTYPES.get(x.dtype, str(x.dtype)), _DTYPES.get(dtype, str(dtype)), seed is not None)


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Every conversion, round to nearest and stochastic (the kernel is flat: the hidden size does not matter)."""
    del hidden_size, hc_mult
    short = {"float32": "f32", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}
    return {f"cast_{short[i]}_{short[o]}_{'sr' if sr else 'rne'}": cast_key(i, o, sr)
            for i, outs in CONVERSIONS.items() for o in outs for sr in (False, True)}


CAST = Kernel("cast", CastKey, build_cast, derive=_derive, cases=_cases)


def cast(x: torch.Tensor, dtype: torch.dtype, seed, offset: int, out: torch.Tensor) -> None:
    """Launches the cast of ``x`` into ``out`` (validated and allocated upstream, ``N > 0``) on the current
    stream; both are read flat."""
    key = CAST.key(x, dtype, seed, offset, out)
    QUANT_ELEMENTS.require("cast", x.numel())
    kernel = CAST.compiled(key)
    if key.stochastic:
        kernel(x.view(-1), out.view(-1), *sr_scalars(int(seed), int(offset)))
    else:
        kernel(x.view(-1), out.view(-1))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, CAST)
