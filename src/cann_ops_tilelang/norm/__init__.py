"""The norm family (docs/ops/norm.md): RMSNorm, LayerNorm (each with an optional fused residual add) and the MLP's
SwiGLU activation, forward and backward, each with an optional fused per-token cast of its output to a layout of
the quant family; one module per op pair.
"""

from .layer_norm import layer_norm_backward, layer_norm_forward
from .rms_norm import rms_norm_backward, rms_norm_forward
from .swiglu import swiglu_backward, swiglu_forward

__all__ = ["layer_norm_backward", "layer_norm_forward", "rms_norm_backward", "rms_norm_forward", "swiglu_backward",
           "swiglu_forward"]
