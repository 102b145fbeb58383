"""CUDA kernel of ``topk_gate`` (docs/ops/moe.md#topk_gate): the stable top-k of each score row.

One warp per token. Lane ``l`` holds the experts ``l, l + 32, l + 64, ...`` of its row in registers (each load
instruction of the warp reads 32 consecutive scores; the lanes past ``E`` hold -inf). Each of the ``k`` rounds takes
the row's maximum (a warp max), then the smallest expert id holding it (a warp min over the lanes' smallest
matching ids), records it in lane ``j`` for rank ``j`` and sets that score to -inf; the lanes ``j < k`` then store
the row's ids together. Exact: only comparisons, so the ids are the reference's whatever the order of the
reductions. ``T`` is dynamic.
"""

import torch

from ....moe._common import TOPK_CASES as CASES
from ....moe._common import require_topk
from ..._kernel import Kernel, compile_key, kernel_module
from ._warps import WARP, WarpPlan


@compile_key
class TopkKey:
    experts: int
    k: int
    int32: bool


# 4 tokens per CTA: 128 threads, a row of up to 512 scores in 16 registers per lane (not measured yet: the first
# GPU run of the benchmark sets it, docs/perf/<chip>/moe.md)
TOPK_GATE_PLAN = WarpPlan(warps=4)


def build_topk_gate(experts: int, k: int, int32: bool):
    """Builds the top-k gate of ``E = experts`` scores per row.

    Returns:
        ``T.prim_func(scores (T, E) fp32, topk_idx (T, k) int64 | int32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    E, K = require_topk("topk_gate", experts, k)
    per_lane = -(-E // WARP)
    warps = TOPK_GATE_PLAN.warps
    f32, i32 = T.float32, T.int32
    id_type = T.int32 if int32 else T.int64
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def topk_gate_cuda(scores: T.Tensor((num_tokens, E), f32), topk_idx: T.Tensor((num_tokens, K), id_type)):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=warps * WARP) as bid:
            tid = T.get_thread_binding()
            lane = tid % WARP
            row = bid * warps + tid // WARP
            s = T.alloc_local((per_lane,), f32)
            top = T.alloc_var(f32)
            own = T.alloc_var(i32)
            pick = T.alloc_var(i32)
            mine = T.alloc_var(i32)
            mine = 0
            if row < num_tokens:  # the same for the 32 lanes of a warp: the shuffles see the whole warp
                for j in T.unroll(per_lane):
                    if (j + 1) * WARP <= E:
                        s[j] = scores[row, j * WARP + lane]
                    else:
                        s[j] = T.if_then_else(j * WARP + lane < E, scores[row, j * WARP + lane], -T.infinity(f32))
                for r in T.unroll(K):
                    top = s[0]
                    for j in T.unroll(1, per_lane):
                        top = T.max(top, s[j])
                    top = T.warp_reduce_max(top)
                    own = E  # no match in this lane
                    for jj in T.unroll(per_lane):  # descending: the last match kept is the lane's smallest id
                        if s[per_lane - 1 - jj] == top:
                            own = (per_lane - 1 - jj) * WARP + lane
                    pick = T.warp_reduce_min(own)
                    if lane == r:
                        mine = pick
                    for j in T.unroll(per_lane):
                        if j * WARP + lane == pick:
                            s[j] = -T.infinity(f32)
                if lane < K:
                    topk_idx[row, lane] = T.cast(mine, id_type)

    return topk_gate_cuda


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Independent of the hidden size: the edges of E and k, the peer's (72, 6) and DeepSeek-V3's (256, 8)
    with both id dtypes."""
    return {f"topk_gate_e{e}_k{k}{'_int32' if int32 else ''}": TopkKey(e, k, int32)
            for e, k, int32 in CASES}


TOPK_GATE = Kernel(
    "topk_gate", TopkKey, build_topk_gate, cases=_cases,
    derive=lambda scores, k, topk_idx: TopkKey(*require_topk("topk_gate", scores.shape[1], k),
                                               topk_idx.dtype == torch.int32))


def topk_gate(scores: torch.Tensor, k: int, int32: bool, topk_idx: torch.Tensor) -> None:
    """Launches the top-k gate on the current stream (arguments validated upstream, ``T > 0``).

    Args:
        scores: ``(T, E)`` fp32, contiguous.
        k: ids per row.
        int32: whether ``topk_idx`` is int32 (else int64).
        topk_idx: ``(T, k)``, written.
    """
    TOPK_GATE.compiled(TOPK_GATE.key(scores, k, topk_idx))(scores, topk_idx)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, TOPK_GATE)
