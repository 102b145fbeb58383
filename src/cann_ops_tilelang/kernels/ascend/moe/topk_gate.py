"""Ascend 950 kernel of ``topk_gate`` (docs/ops/moe.md#topk_gate): the stable top-k of each score row.

A persistent loop over tiles of ``rows`` tokens: the tile's scores go to the UB in one copy, then a SimtVF region
runs one thread per token: ``k`` ascending scans of its row, each keeping the first strictly greater score (so equal
scores go to the smaller id), recording its id and overwriting that score with -inf in the UB; the ids of the tile
go back in one copy. Exact: only comparisons. ``T`` is dynamic.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
import torch
from tilelang.ascend import language as T

from ....limits import IntRange
from ....moe._common import TOPK_CASES as CASES
from ....moe._common import require_topk
from ....policy import ASCEND_CASE_CORES
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._tiles import RowTilePlan


@compile_key
class TopkKey:
    experts: int
    k: int
    int32: bool
    num_cores: int


# 128 threads for E <= 128, 32 tokens of 512 scores: 64 KiB of scores per stage, two stages in the SIMT budget (not
# measured yet: the first NPU run of the benchmark sets it, docs/perf/ascend950/moe.md)
TOPK_GATE_PLAN = RowTilePlan(max_rows=128, tile_bytes=64 * 1024, stages=2)


def build_topk_gate(experts: int, k: int, int32: bool, num_cores: int):
    """prim_func ``(scores (T, E) fp32, topk_idx (T, k) int64 | int32)``; ``E``, ``k`` in ``limits.MOE_*`` with
    ``k <= E``, ``num_cores >= 1``, else ``limits.LimitError``."""
    E, K = require_topk("topk_gate", experts, k)
    cores = IntRange("num_cores", 1).require("topk_gate", num_cores)
    rows, stages = TOPK_GATE_PLAN.rows(E), TOPK_GATE_PLAN.stages
    f32, i32 = T.float32, T.int32
    id_type = T.int32 if int32 else T.int64
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def topk_gate_asc(scores: T.Tensor[(num_tokens, E), f32], topk_idx: T.Tensor[(num_tokens, K), id_type]):
        with T.Kernel(cores) as core_id:
            s_ub = T.alloc_shared((rows, E), f32)
            idx_ub = T.alloc_shared((rows, K), id_type)
            T.annotate_buffer_versions({s_ub: stages, idx_ub: stages})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, rows)], cores, core_id, group_size=1,
                                       num_stages=stages):
                row = blk * rows
                valid = T.min(rows, num_tokens - row)
                T.copy(scores[row : row + valid, :], s_ub[:valid, :])
                with T.SimtVF(threads=rows):
                    t = T.get_thread_binding()  # rows past `valid` scan stale scores, never stored
                    best = T.alloc_var(f32)
                    pick = T.alloc_var(i32)
                    for r in T.serial(K):
                        best = s_ub[t, 0]
                        pick = 0
                        for e in T.serial(1, E):
                            if s_ub[t, e] > best:
                                best = s_ub[t, e]
                                pick = e
                        idx_ub[t, r] = T.cast(pick, id_type)
                        s_ub[t, pick] = -T.infinity(f32)
                T.copy(idx_ub[:valid, :], topk_idx[row : row + valid, :])

    return topk_gate_asc


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Independent of the hidden size on the Ascend 950's cores (the CUDA module's names): the edges of E and k, the
    peer's (72, 6) and DeepSeek-V3's (256, 8) with both id dtypes."""
    return {f"topk_gate_e{e}_k{k}{'_int32' if int32 else ''}": TopkKey(e, k, int32, ASCEND_CASE_CORES)
            for e, k, int32 in CASES}


TOPK_GATE = Kernel("topk_gate", TopkKey, build_topk_gate, cases=_cases,
                   derive=lambda scores, k, topk_idx: TopkKey(*require_topk("topk_gate", scores.shape[1], k),
                                                              topk_idx.dtype == torch.int32, num_vector_cores()))


def topk_gate(scores, k, int32, topk_idx) -> None:
    """scores ``(T, E)`` fp32 -> topk_idx ``(T, k)`` int64 | int32 (written). Current stream, no sync."""
    TOPK_GATE.compiled(TOPK_GATE.key(scores, k, topk_idx))(scores, topk_idx)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, TOPK_GATE)
