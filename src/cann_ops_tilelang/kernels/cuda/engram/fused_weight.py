"""CUDA kernel of ``engram_fused_weight`` (docs/ops/engram.md#fused_weight): ``wf = f32(wh) * f32(we)``,
bit-exact, over the flattened ``(m, H)`` weights."""

import dataclasses

import torch

from ....limits import ENGRAM_FUSED_WEIGHT_ALIGN, ENGRAM_HC_MULT, ENGRAM_HIDDEN, IntRange
from ..._kernel import Kernel, compile_key, kernel_module


_NUMEL = IntRange("element count", ENGRAM_FUSED_WEIGHT_ALIGN, multiple_of=ENGRAM_FUSED_WEIGHT_ALIGN)


@dataclasses.dataclass(frozen=True)
class FusedWeightPlan:
    """``vec`` bf16 elements per thread (one 16-byte load of each input); CTAs of the first of ``threads`` that
    divides the ``numel / vec`` thread count."""

    vec: int
    threads: tuple[int, ...]


# m*H is tiny (28672 for m=4, H=7168), so the kernel is launch-latency bound: 128-thread CTAs spread it over ~28 SMs
# of the H200, each thread doing one 16-byte load per input.
PLAN = FusedWeightPlan(vec=8, threads=(128, 64, 32))


def _threads(numel: int) -> int:
    groups = numel // PLAN.vec
    return next(threads for threads in PLAN.threads if groups % threads == 0)


@compile_key
class FusedWeightKey:
    """Compile-time key: ``numel = m * H`` of the flattened ``(m, H)`` weights."""

    numel: int


def _cases(hidden_size: int, hc_mult: int) -> FusedWeightKey:
    """Over the ``(hc_mult, hidden_size)`` weights (in the Engram ranges)."""
    return FusedWeightKey(ENGRAM_HC_MULT.require("engram_fused_weight", hc_mult)
                          * ENGRAM_HIDDEN.require("engram_fused_weight", hidden_size))


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
    threads, vec = _threads(numel), PLAN.vec
    num_blocks = numel // (threads * vec)

    @T.prim_func
    def engram_fused_weight_cuda(
        weight_hidden: T.Tensor((numel,), T.bfloat16),
        weight_embed: T.Tensor((numel,), T.bfloat16),
        weight_fused: T.Tensor((numel,), T.float32),
    ):
        with T.Kernel(num_blocks, threads=threads) as bid:
            tid = T.get_thread_binding()
            a = T.alloc_local((vec,), T.float32)
            b = T.alloc_local((vec,), T.float32)
            base = (bid * threads + tid) * vec
            for k in T.vectorized(vec):
                a[k] = weight_hidden[base + k]
            for k in T.vectorized(vec):
                b[k] = weight_embed[base + k]
            for k in T.vectorized(vec):
                weight_fused[base + k] = a[k] * b[k]

    return engram_fused_weight_cuda


KERNEL = Kernel("engram_fused_weight", FusedWeightKey, build_engram_fused_weight, cases=_cases,
                derive=lambda weight_hidden: FusedWeightKey(int(weight_hidden.numel())))


def engram_fused_weight(weight_hidden: torch.Tensor, weight_embed: torch.Tensor, out: torch.Tensor) -> None:
    """Launches ``out = f32(weight_hidden) * f32(weight_embed)`` on the current stream.

    Args:
        weight_hidden: ``(m, H)`` bf16, contiguous.
        weight_embed: ``(m, H)`` bf16, contiguous.
        out: ``(m, H)`` f32, contiguous, written.
    """
    KERNEL.compiled(KERNEL.key(weight_hidden))(weight_hidden.view(-1), weight_embed.view(-1), out.view(-1))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
