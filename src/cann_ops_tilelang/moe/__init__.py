"""The MoE routing family (docs/ops/moe.md): the top-k gates and the routing weights' normalization, one module
per op (pair).
"""

from .normalize_weight import normalize_weight
from .topk_gate import topk_gate

__all__ = ["normalize_weight", "topk_gate"]
