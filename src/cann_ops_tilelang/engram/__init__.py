"""The Engram gate family (docs/ops/engram.md): one module per op."""

from .fused_weight import engram_fused_weight
from .gate import engram_gate_bwd, engram_gate_fwd, engram_gate_fwd_inplace
from .grad_w_reduce import engram_grad_w_reduce

__all__ = [
    "engram_fused_weight",
    "engram_gate_bwd",
    "engram_gate_fwd",
    "engram_gate_fwd_inplace",
    "engram_grad_w_reduce",
]
