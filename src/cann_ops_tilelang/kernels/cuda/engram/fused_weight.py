"""CUDA kernel of ``engram_fused_weight`` (docs/ops/engram.md#fused_weight): ``wf = f32(wh) * f32(we)``,
bit-exact, over the flattened ``(m, H)`` weights."""

import functools

import torch

from ....limits import ENGRAM_FUSED_WEIGHT_ALIGN, ENGRAM_HC_MULT, ENGRAM_HIDDEN, IntRange
from .._build import jit_compile

__all__ = [
    "build_engram_fused_weight",
    "engram_fused_weight",
    "engram_fused_weight_key",
    "get_engram_fused_weight_kernel",
    "lowering_cases",
]

_VEC = 8  # bf16 elements per thread: one 16-byte load of each input
_NUMEL = IntRange("element count", ENGRAM_FUSED_WEIGHT_ALIGN, multiple_of=ENGRAM_FUSED_WEIGHT_ALIGN)


def _threads(numel: int) -> int:
    # m*H is tiny (28672 for m=4, H=7168), so the kernel is launch-latency bound: 128-thread CTAs spread
    # it over ~28 SMs of the H200, each thread doing one 16-byte load per input.
    groups = numel // _VEC
    return next(threads for threads in (128, 64, 32) if groups % threads == 0)


def engram_fused_weight_key(weight_hidden: torch.Tensor) -> tuple:
    """Compile-time key: ``(numel,)`` of the flattened ``(m, H)`` weights."""
    return (int(weight_hidden.numel()),)


def build_engram_fused_weight(numel: int):
    """Builds the prim_func over the flattened weights.

    Args:
        numel: ``m * H``, a positive multiple of ``limits.ENGRAM_FUSED_WEIGHT_ALIGN`` (256); else
            ``limits.LimitError``.

    Returns:
        ``T.prim_func(wh: (numel,) bf16, we: (numel,) bf16, wf: (numel,) f32)``.
    """
    from tilelang import language as T

    numel = _NUMEL.require("engram_fused_weight", numel)
    threads = _threads(numel)
    num_blocks = numel // (threads * _VEC)

    @T.prim_func
    def engram_fused_weight_cuda(
        weight_hidden: T.Tensor((numel,), T.bfloat16),
        weight_embed: T.Tensor((numel,), T.bfloat16),
        weight_fused: T.Tensor((numel,), T.float32),
    ):
        with T.Kernel(num_blocks, threads=threads) as bid:
            tid = T.get_thread_binding()
            a = T.alloc_local((_VEC,), T.float32)
            b = T.alloc_local((_VEC,), T.float32)
            base = (bid * threads + tid) * _VEC
            for k in T.vectorized(_VEC):
                a[k] = weight_hidden[base + k]
            for k in T.vectorized(_VEC):
                b[k] = weight_embed[base + k]
            for k in T.vectorized(_VEC):
                weight_fused[base + k] = a[k] * b[k]

    return engram_fused_weight_cuda


@functools.lru_cache(maxsize=None)
def get_engram_fused_weight_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`engram_fused_weight_key`), built once per key."""
    return jit_compile("engram_fused_weight", key, build_engram_fused_weight(*key))


def engram_fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor, out: torch.Tensor) -> None:
    """Launches ``out = f32(weight_hidden) * f32(weight_embed)`` on the current stream.

    Args:
        weight_hidden: ``(m, H)`` bf16, contiguous.
        weight_embed: ``(m, H)`` bf16, contiguous.
        out: ``(m, H)`` f32, contiguous, written.
    """
    kernel = get_engram_fused_weight_kernel(*engram_fused_weight_key(weight_hidden))
    kernel(weight_hidden.view(-1), weight_embed.view(-1), out.view(-1))


def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """``{"engram_fused_weight": prim_func}`` over the ``(hc_mult, hidden_size)`` weights (CPU build tests)."""
    ENGRAM_HC_MULT.require("engram_fused_weight", hc_mult)
    ENGRAM_HIDDEN.require("engram_fused_weight", hidden_size)
    return {"engram_fused_weight": build_engram_fused_weight(hc_mult * hidden_size)}
