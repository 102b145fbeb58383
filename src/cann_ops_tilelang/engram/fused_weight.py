"""``engram_fused_weight``: the fused RMSNorm weight of the Engram gate (docs/ops/engram.md#fused_weight)."""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_same_device, check_tensor
from .._library import declare
from ._common import BF16, F32

__all__ = ["engram_fused_weight"]


@declare("engram_fused_weight", vector_args={"weight_hidden": 16, "weight_embed": 16}, outputs=("out",))
def engram_fused_weight(weight_hidden: Tensor, weight_embed: Tensor) -> Tensor:
    """Fused RMSNorm weight ``wf = f32(weight_hidden) * f32(weight_embed)`` (bit-exact).

    Args:
        weight_hidden: ``(m, H)`` bf16, contiguous; RMSNorm weight of the hidden streams.
        weight_embed: ``(m, H)`` bf16, contiguous, same shape; RMSNorm weight of the keys.
            Any 2-D shape works whose element count is a multiple of 256.

    Returns:
        ``(m, H)`` fp32, a new tensor. The inputs are never modified.
    """
    err = OpError("engram_fused_weight")
    wh = check_tensor(err, "weight_hidden", weight_hidden, dtype=BF16, ndim=2)
    we = check_tensor(err, "weight_embed", weight_embed, dtype=BF16, ndim=2)
    if wh.shape != we.shape:
        raise err.value("weight_embed", f"expected the shape of weight_hidden {tuple(wh.shape)}, got {tuple(we.shape)}")
    if wh.numel() % limits.ENGRAM_FUSED_WEIGHT_ALIGN != 0:
        raise err.value("weight_hidden", f"expected an element count divisible by {limits.ENGRAM_FUSED_WEIGHT_ALIGN}, "
                                         f"got {wh.numel()}")
    check_same_device(err, [("weight_hidden", wh), ("weight_embed", we)])
    return weight_hidden.new_empty(weight_hidden.shape, dtype=F32)


# its own binding: empty weights (no tokens argument to skip on) launch nothing
@engram_fused_weight.launch
def _(kernels, out, weight_hidden, weight_embed):
    if out.numel():
        kernels.engram_fused_weight(weight_hidden=weight_hidden, weight_embed=weight_embed, out=out)


# DTensor sharding (docs/distributed.md): element-wise and any 2-D shape of 256k elements is accepted, so
# either dim may be sharded alike in both inputs (FSDP2 shards dim 0).
engram_fused_weight.sharding({"weight_hidden": "S0", "weight_embed": "S0", "returns": "S0"},
                             {"weight_hidden": "S1", "weight_embed": "S1", "returns": "S1"})
