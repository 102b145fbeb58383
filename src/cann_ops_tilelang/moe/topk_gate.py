"""The stable top-k gate: the ids of each token's ``k`` highest scores (docs/ops/moe.md#topk_gate)."""

from torch import Tensor

from .. import limits
from .._checks import OpError
from .._library import declare
from ._common import check_k, check_rows, id_dtype

__all__ = ["topk_gate"]


@declare("topk_gate", tokens="scores", outputs=("topk_idx",))
def topk_gate(scores: Tensor, k: int, int32: bool = False) -> Tensor:
    """The ids of the ``k`` highest scores of each row, highest first; equal scores go to the smaller id.

    Args:
        scores: ``(T, E)`` fp32, contiguous, finite (the ids of a row holding NaN or an infinity are unspecified,
            not even in range); ``E`` in ``limits.MOE_EXPERTS``, any ``T >= 0``.
        k: the experts picked per token, in ``limits.MOE_TOPK`` and at most ``E``.
        int32: int32 ids instead of int64 (torch_npu's convention).

    Returns:
        ``topk_idx`` ``(T, k)`` int64 (int32 with ``int32=True``), contiguous: ``topk_idx[t, j]`` is the expert of
        rank ``j`` in the stable descending order of ``scores[t]`` (docs/ops/moe.md#topk_gate).
    """
    err = OpError("topk_gate")
    tokens, experts = check_rows(err, "scores", scores, limits.MOE_EXPERTS)
    check_k(err, "k", k, experts)
    return scores.new_empty((tokens, k), dtype=id_dtype(err, "int32", int32))


# DTensor sharding (docs/distributed.md): token-wise, so the token dim of scores and of the ids is sharded.
topk_gate.sharding({"scores": "S0", "returns": "S0"})
