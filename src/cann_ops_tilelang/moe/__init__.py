"""The MoE routing family (docs/ops/moe.md): the top-k gates (the plain one and the scored one) and the routing
weights' normalization, one module per op (pair).
"""

from .moe_topk_gate import moe_topk_gate_backward, moe_topk_gate_forward
from .normalize_weight import normalize_weight
from .topk_gate import topk_gate

__all__ = ["moe_topk_gate_backward", "moe_topk_gate_forward", "normalize_weight", "topk_gate"]
