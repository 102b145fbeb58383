"""The element-wise narrowing cast without scales (docs/ops/quant.md#cast), round to nearest even or stochastic
rounding (docs/ops/quant.md#stochastic_rounding).

Op: ``cast(x, dtype, seed=None, offset=0) -> Tensor``: fp32 -> bf16 or e4m3, bf16 -> e4m3.
"""

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, check_int, describe
from .._library import declare
from ._common import BF16, F32

__all__ = ["CAST_TARGETS", "COUNTER_MUL", "FMIX", "cast", "counter_key", "fmix32", "sr_scalars"]

E4M3 = torch.float8_e4m3fn
# the narrowing casts of the contract: input dtype -> the dtypes it may be cast to
CAST_TARGETS = {F32: (BF16, E4M3), BF16: (E4M3,)}
# the kernels index x and the result with int32 element offsets, as the other casts do (limits.QUANT_ELEMENTS)
ELEMENTS = dataclasses.replace(limits.QUANT_ELEMENTS, what="elements of x")
# the counter offset (docs/ops/quant.md#stochastic_rounding) and the seed, an int64 taken mod 2**64
OFFSETS = limits.IntRange("a counter offset", 0, 2**63 - 1)
SEEDS = limits.IntRange("a seed that fits int64", -2**63, 2**63 - 1)

# stochastic rounding's hash constants (docs/ops/quant.md#stochastic_rounding)
_M32 = 0xFFFFFFFF
COUNTER_MUL = 0x9E3779B1
HIGH_SALT = 0x243F6A88
FMIX = (0x85EBCA6B, 0xC2B2AE35)


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finalizer on a Python int (the host half of the hash)."""
    h ^= h >> 16
    h = (h * FMIX[0]) & _M32
    h ^= h >> 13
    h = (h * FMIX[1]) & _M32
    return h ^ (h >> 16)


def counter_key(seed: int, high: int) -> int:
    """``key = fmix32(fmix32(fmix32(n_hi ^ 0x243F6A88) ^ seed_hi) ^ seed_lo)`` of the counters whose high word is
    ``high`` (mod 2**32), ``seed`` taken mod 2**64."""
    seed %= 2**64
    return fmix32(fmix32(fmix32((high & _M32) ^ HIGH_SALT) ^ (seed >> 32)) ^ (seed & _M32))


def sr_scalars(seed: int, start: int) -> tuple[int, int, int]:
    """The kernels' scalars of a launch whose element 0 has the counter ``start`` (mod 2**64), fewer than 2**32
    elements: ``(n_lo of element 0, key of its high word, key of the next high word)`` as int32 bit patterns.
    Element ``i`` has ``n_lo = start_lo + i mod 2**32`` and the second key where that wraps (``n_lo < start_lo``):
    the key depends on the high word alone, so it is hashed here once per launch instead of per element."""
    start %= 2**64
    hi = start >> 32

    def i32(v: int) -> int:
        return v - 2**32 if v >= 2**31 else v

    return i32(start & _M32), i32(counter_key(seed, hi)), i32(counter_key(seed, hi + 1))


def _check_scalar(err: OpError, arg: str, value, valid: limits.IntRange):
    """An int in ``valid``; a traced SymInt is checked when the graph runs (a runtime assert, no guard: a new
    offset reuses the graph)."""
    value = check_int(err, arg, value)
    if isinstance(value, torch.SymInt):
        torch._check(valid.low <= value, lambda: err.value(arg, f"expected {valid.what} {valid.describe()}").args[0])
        torch._check(value <= valid.high, lambda: err.value(arg, f"expected {valid.what} {valid.describe()}").args[0])
        return value
    return valid.check(err, arg, value)


@declare("cast", vector_args={"x": 16}, outputs=("out",))
def cast(x: Tensor, dtype: torch.dtype, seed: Optional[int] = None, offset: int = 0) -> Tensor:
    """Casts each element of ``x`` to the narrower ``dtype``, without a scale.

    Round to nearest even (e4m3 saturating at +-448, NaN stays NaN; bf16 as ``Tensor.to``, overflow to inf), or,
    with a ``seed``, stochastic rounding with the counter ``offset + i`` of the element of row-major index ``i``
    (docs/ops/quant.md#stochastic_rounding: the same bits eager, compiled and on both backends; a tensor cast in
    two calls, the second at ``offset + x[:k].numel()``, equals one call).

    Args:
        x: any shape, contiguous, bf16 or fp32, starting on 16 bytes; at most ``2**31 - 1`` elements (zero: nothing
            is launched).
        dtype: ``torch.bfloat16`` or ``torch.float8_e4m3fn`` for fp32 ``x``; ``torch.float8_e4m3fn`` for bf16.
        seed: None (round to nearest even) or an int64 (stochastic rounding).
        offset: the counter of element 0, ``0 <= offset < 2**63`` (ignored without a seed).

    Returns:
        ``x``'s shape, ``dtype``, contiguous (new).
    """
    err = OpError("cast")
    if not isinstance(x, Tensor):
        raise err.type("x", f"expected a torch.Tensor, got {describe(x)}")
    if x.dtype not in CAST_TARGETS:
        raise err.type("x", f"expected dtype torch.bfloat16 or torch.float32, got {x.dtype}")
    if not isinstance(dtype, torch.dtype):
        raise err.type("dtype", f"expected a torch.dtype, got {describe(dtype)}")
    targets = CAST_TARGETS[x.dtype]
    if dtype not in targets:
        raise err.value("dtype", f"expected {' or '.join(map(str, targets))} (a narrowing cast of {x.dtype}), got "
                                 f"{dtype}")
    if not x.is_contiguous():
        raise err.value("x", f"expected a contiguous tensor (the cast reads x flat, row-major), got strides "
                             f"{tuple(x.stride())} for shape {tuple(x.shape)}")
    ELEMENTS.check(err, "x", x.numel())
    if seed is not None:
        _check_scalar(err, "seed", seed, SEEDS)
    _check_scalar(err, "offset", offset, OFFSETS)
    return x.new_empty(x.shape, dtype=dtype)


# its own binding: x takes any shape (no token dim), so an empty x is skipped here: nothing is launched
@cast.launch
def _(kernels, out, x, dtype, seed, offset):
    if out.numel():
        kernels.cast(x=x, dtype=dtype, seed=seed, offset=offset, out=out)


# DTensor sharding (docs/distributed.md): element-wise, so dim 0 of x and of the result is sharded, no communication.
# Round to nearest gives the unsharded bits; with a seed each rank counts from `offset` over its own shard
# (docs/ops/quant.md#cast says how to get the unsharded bits).
cast.sharding({"x": "S0", "returns": "S0"})
