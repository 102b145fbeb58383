"""The routing weights normalized to sum to one per token (docs/ops/moe.md#normalize_weight)."""

from torch import Tensor

from .. import limits
from .._checks import OpError
from .._library import declare
from ._common import check_rows

__all__ = ["normalize_weight"]


@declare("normalize_weight", tokens="topk_weights", outputs=("denominator", "normalized"))
def normalize_weight(topk_weights: Tensor) -> tuple[Tensor, Tensor]:
    """``denominator = fl(1e-20 + S)``, ``S`` the pairwise sum of each row's weights, and ``normalized =
    fl(w / denominator)`` (docs/ops/moe.md#normalize_weight has the summation order).

    Args:
        topk_weights: ``(T, k)`` fp32, contiguous, ``k`` in ``limits.MOE_TOPK``, any ``T >= 0``.

    Returns:
        ``(denominator, normalized)``: ``(T,)`` and ``(T, k)`` fp32, contiguous.
    """
    err = OpError("normalize_weight")
    tokens, k = check_rows(err, "topk_weights", topk_weights, limits.MOE_TOPK)
    return topk_weights.new_empty((tokens,)), topk_weights.new_empty((tokens, k))


# DTensor sharding (docs/distributed.md): token-wise, so the token dim of the weights and of both results is sharded.
normalize_weight.sharding({"topk_weights": "S0", "returns": ("S0", "S0")})
