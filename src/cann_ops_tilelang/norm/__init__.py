"""The norm family (docs/ops/norm.md): RMSNorm, LayerNorm (each with an optional fused residual add) and the MLP's
SwiGLU activation, forward and backward, each with an optional fused per-token cast of its output to a layout of
the quant family; one module per op pair.
"""

__all__: list[str] = []
from .swiglu import swiglu_backward, swiglu_forward  # noqa: E402

__all__ += ["swiglu_backward", "swiglu_forward"]
