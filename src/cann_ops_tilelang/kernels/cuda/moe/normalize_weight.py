"""CUDA kernel of ``normalize_weight`` (docs/ops/moe.md#normalize_weight).

One thread per token: the row's ``k`` weights in registers, their pairwise sum in the contract's order
(``pairwise_steps``), ``denominator = fl(1e-20 + sum)`` and ``normalized = fl(w / denominator)`` with IEEE
additions and divisions (``__fadd_rn``, ``__fdiv_rn``: bitwise the reference's). ``T`` is dynamic.
"""

import dataclasses

import torch

from ....limits import MOE_TOPK
from ....moe._common import DENOMINATOR_EPS, NORMALIZE_CASES, pairwise_steps
from ..._kernel import Kernel, compile_key, kernel_module


@compile_key
class NormalizeKey:
    k: int


@dataclasses.dataclass(frozen=True)
class NormalizePlan:
    """CTAs of ``threads`` threads, one token per thread."""

    threads: int


# 128 tokens per CTA (not measured yet: the first GPU run of the benchmark sets it, docs/perf/<chip>/moe.md)
NORMALIZE_WEIGHT_PLAN = NormalizePlan(threads=128)


def build_normalize_weight(k: int):
    """Builds the normalization of ``k`` weights per row.

    Returns:
        ``T.prim_func(topk_weights (T, k) fp32, denominator (T,) fp32, normalized (T, k) fp32)``; ``T`` dynamic.
    """
    from tilelang import language as T

    K = MOE_TOPK.require("normalize_weight", k)
    threads = NORMALIZE_WEIGHT_PLAN.threads
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def normalize_weight_cuda(topk_weights: T.Tensor((num_tokens, K), f32), denominator: T.Tensor((num_tokens,), f32),
                              normalized: T.Tensor((num_tokens, K), f32)):
        with T.Kernel(T.ceildiv(num_tokens, threads), threads=threads) as bid:
            row = bid * threads + T.get_thread_binding()
            w = T.alloc_local((K,), f32)
            acc = T.alloc_local((K,), f32)
            den = T.alloc_var(f32)
            if row < num_tokens:
                for i in T.unroll(K):
                    w[i] = topk_weights[row, i]
                    acc[i] = w[i]
                for dst, src in pairwise_steps(K):
                    acc[dst] = T.ieee_add(acc[dst], acc[src])
                den = T.ieee_add(T.float32(DENOMINATOR_EPS), acc[0])
                denominator[row] = den
                for i in T.unroll(K):
                    normalized[row, i] = T.ieee_fdiv(w[i], den)

    return normalize_weight_cuda


NORMALIZE_WEIGHT = Kernel("normalize_weight", NormalizeKey, build_normalize_weight,
                          cases=lambda hidden_size, hc_mult: {f"normalize_weight_k{k}": NormalizeKey(k)
                                                              for k in NORMALIZE_CASES},
                          derive=lambda topk_weights: NormalizeKey(MOE_TOPK.require("normalize_weight",
                                                                                    topk_weights.shape[1])))


def normalize_weight(topk_weights: torch.Tensor, denominator: torch.Tensor, normalized: torch.Tensor) -> None:
    """Launches the normalization on the current stream (arguments validated upstream, ``T > 0``).

    Args:
        topk_weights: ``(T, k)`` fp32, contiguous.
        denominator: ``(T,)`` fp32, written.
        normalized: ``(T, k)`` fp32, written.
    """
    NORMALIZE_WEIGHT.compiled(NORMALIZE_WEIGHT.key(topk_weights))(topk_weights, denominator, normalized)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, NORMALIZE_WEIGHT)
