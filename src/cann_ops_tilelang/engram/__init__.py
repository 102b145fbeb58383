"""The Engram family (docs/ops/engram.md): the gate, the n-gram hash and the Sinkhorn optimizer's ops, one
module per op (pair)."""

from .. import _deprecated
from .fused_weight import engram_fused_weight
from .gate import engram_gate_backward, engram_gate_forward, engram_gate_forward_inplace
from .grad_w_reduce import engram_grad_w_reduce
from .hash import engram_hash
from .sinkhorn import (engram_sinkhorn_finalize, engram_sinkhorn_finalize_apply, engram_sinkhorn_momentum_update,
                       engram_sinkhorn_step, engram_sinkhorn_step_reduce)

__all__ = [
    "engram_fused_weight",
    "engram_gate_backward",
    "engram_gate_forward",
    "engram_gate_forward_inplace",
    "engram_grad_w_reduce",
    "engram_hash",
    "engram_sinkhorn_finalize",
    "engram_sinkhorn_finalize_apply",
    "engram_sinkhorn_momentum_update",
    "engram_sinkhorn_step",
    "engram_sinkhorn_step_reduce",
]

__getattr__ = _deprecated.module_getattr(__name__, globals())  # the names renamed in 0.2, for one release
