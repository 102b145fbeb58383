"""Engram gate family (OPS.md §B.1): custom ops and their validation."""

from .ops import (
    engram_fused_weight,
    engram_gate_bwd,
    engram_gate_fwd,
    engram_gate_fwd_inplace,
    engram_grad_w_reduce,
)

__all__ = [
    "engram_fused_weight",
    "engram_gate_bwd",
    "engram_gate_fwd",
    "engram_gate_fwd_inplace",
    "engram_grad_w_reduce",
]
