"""``engram_grad_w_reduce``: the fixed-order reduction of the Engram gate's weight-gradient partials into the
two fp32 gradient buffers (docs/ops/engram.md#grad_w_reduce)."""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_same_device, check_tensor
from .._library import declare
from ._common import BF16, F32, check_hc_hidden

__all__ = ["engram_grad_w_reduce"]


# the partials are loaded in 16-byte vectors (TMA or cp.async); the weights and the gradient buffers (e.g.
# Megatron main_grad views at any offset) element by element unless the CUDA launcher finds them aligned
@declare("engram_grad_w_reduce", mutates_args=("grad_weight_hidden", "grad_weight_embed"),
         vector_args={"grad_w_partial": 16}, tokens="grad_w_partial")
def engram_grad_w_reduce(
    grad_w_partial: Tensor,
    weight_hidden: Tensor,
    weight_embed: Tensor,
    grad_weight_hidden: Tensor,
    grad_weight_embed: Tensor,
) -> None:
    """Reduces the weight-gradient partials and accumulates into the two fp32 buffers in place.

    ``gw = sum_p grad_w_partial[p]`` (p ascending, from -0.0), then ``grad_weight_hidden += gw * f32(weight_embed)``
    and ``grad_weight_embed += gw * f32(weight_hidden)``.

    Args:
        grad_w_partial: ``(P, m, H)`` fp32 from ``engram_gate_backward`` (``P = 0``: nothing is added; at most 476
            rows on Ascend, ``limits.ENGRAM_GRAD_W_PARTIALS``).
        weight_hidden, weight_embed: ``(m, H)`` bf16.
        grad_weight_hidden, grad_weight_embed: ``(m, H)`` fp32, contiguous, updated in place (Megatron
            ``main_grad`` buffers, or zeros); they must not share memory with each other or the inputs.
    """
    err = OpError("engram_grad_w_reduce")
    partial = check_tensor(err, "grad_w_partial", grad_w_partial, dtype=F32, ndim=3)
    rows, m, hidden = partial.shape
    limits.ENGRAM_GRAD_W_PARTIALS.of(partial.device.type).check(err, "grad_w_partial", rows)
    check_hc_hidden(err, "grad_w_partial", m, hidden)
    named = [("grad_w_partial", partial)]
    for arg, value, dtype in (("weight_hidden", weight_hidden, BF16), ("weight_embed", weight_embed, BF16),
                              ("grad_weight_hidden", grad_weight_hidden, F32),
                              ("grad_weight_embed", grad_weight_embed, F32)):
        named.append((arg, check_tensor(err, arg, value, dtype=dtype, shape=(m, hidden))))
    check_same_device(err, named)


# DTensor sharding (docs/distributed.md): linear in grad_w_partial, so Partial partials (sums over each rank's
# tokens) accumulate into Partial buffers with no communication. The op takes only whole (m, H) weights
# (m = 4, H in range), so no weight dim is sharded; Replicate buffers take the fallback (partials all-reduced).
engram_grad_w_reduce.sharding({"grad_w_partial": "P", "grad_weight_hidden": "P", "grad_weight_embed": "P"})
