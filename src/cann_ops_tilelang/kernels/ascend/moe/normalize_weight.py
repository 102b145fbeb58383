"""Ascend 950 kernel of ``normalize_weight`` (docs/ops/moe.md#normalize_weight).

A persistent loop over tiles of ``rows`` tokens: the tile's weights go to the UB in one copy, then a SimtVF region
runs one thread per token, summing its row in the contract's pairwise order (``pairwise_steps``, the CUDA kernel's),
``denominator = fl(1e-20 + sum)`` and ``normalized = fl(w / denominator)``; both go back in one copy each. ``T`` is
dynamic.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T

from ....limits import MOE_TOPK, IntRange
from ....moe._common import DENOMINATOR_EPS, NORMALIZE_CASES, pairwise_steps
from ....policy import ASCEND_CASE_CORES
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores


@compile_key
class NormalizeKey:
    k: int
    num_cores: int


@dataclasses.dataclass(frozen=True)
class NormalizePlan:
    """Tiles of ``rows`` tokens (one SIMT thread each), ``stages`` tiles in flight."""

    rows: int
    stages: int


# 128 tokens per tile, two in flight: 2 x 128 x 33 x 8 bytes at k = 32 (not measured yet: the first NPU run of the
# benchmark sets it, docs/perf/ascend950/moe.md)
NORMALIZE_WEIGHT_PLAN = NormalizePlan(rows=128, stages=2)


def build_normalize_weight(k: int, num_cores: int):
    """prim_func ``(topk_weights (T, k) fp32, denominator (T,) fp32, normalized (T, k) fp32)``; ``k`` in
    ``limits.MOE_TOPK``, ``num_cores >= 1``, else ``limits.LimitError``."""
    K = MOE_TOPK.require("normalize_weight", k)
    cores = IntRange("num_cores", 1).require("normalize_weight", num_cores)
    rows, stages = NORMALIZE_WEIGHT_PLAN.rows, NORMALIZE_WEIGHT_PLAN.stages
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def normalize_weight_asc(topk_weights: T.Tensor[(num_tokens, K), f32], denominator: T.Tensor[(num_tokens,), f32],
                             normalized: T.Tensor[(num_tokens, K), f32]):
        with T.Kernel(cores) as core_id:
            w_ub = T.alloc_shared((rows, K), f32)
            den_ub = T.alloc_shared((rows,), f32)
            out_ub = T.alloc_shared((rows, K), f32)
            T.annotate_buffer_versions({w_ub: stages, den_ub: stages, out_ub: stages})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, rows)], cores, core_id, group_size=1,
                                       num_stages=stages):
                row = blk * rows
                valid = T.min(rows, num_tokens - row)
                T.copy(topk_weights[row : row + valid, :], w_ub[:valid, :])
                with T.SimtVF(threads=rows):
                    t = T.get_thread_binding()  # rows past `valid` work on stale weights, never stored
                    acc = T.alloc_local((K,), f32)
                    for i in T.unroll(K):
                        acc[i] = w_ub[t, i]
                    for dst, src in pairwise_steps(K):
                        acc[dst] = acc[dst] + acc[src]
                    den_ub[t] = T.float32(DENOMINATOR_EPS) + acc[0]
                    for i in T.unroll(K):
                        out_ub[t, i] = w_ub[t, i] / den_ub[t]
                T.copy(den_ub[:valid], denominator[row : row + valid])
                T.copy(out_ub[:valid, :], normalized[row : row + valid, :])

    return normalize_weight_asc


NORMALIZE_WEIGHT = Kernel("normalize_weight", NormalizeKey, build_normalize_weight,
                          cases=lambda hidden_size, hc_mult: {
                              f"normalize_weight_k{k}": NormalizeKey(k, ASCEND_CASE_CORES) for k in NORMALIZE_CASES},
                          derive=lambda topk_weights: NormalizeKey(MOE_TOPK.require("normalize_weight",
                                                                                    topk_weights.shape[1]),
                                                                   num_vector_cores()))


def normalize_weight(topk_weights, denominator, normalized) -> None:
    """topk_weights ``(T, k)`` fp32 -> denominator ``(T,)``, normalized ``(T, k)`` fp32 (written). Current stream."""
    NORMALIZE_WEIGHT.compiled(NORMALIZE_WEIGHT.key(topk_weights))(topk_weights, denominator, normalized)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, NORMALIZE_WEIGHT)
