"""What the CUDA kernels of the MoE gates share: one warp per token (``topk_gate``, ``moe_topk_gate_forward`` /
``_backward``), lane ``l`` holding the experts ``l, l + 32, ...`` of its row."""

import dataclasses

__all__ = ["WARP", "WarpPlan"]

WARP = 32


@dataclasses.dataclass(frozen=True)
class WarpPlan:
    """CTAs of ``warps`` warps, one token per warp."""

    warps: int
