"""Autograd functions and modules over the ops: the Engram gate, the mHC training chain, RMSNorm / LayerNorm / SwiGLU
and the FP8 linear layer."""

from .engram import Engram, ngram_token_ids
from .engram_gate import EngramGate, engram_gate
from .mhc import (MHCHead, MHCSublayer, expand_from_embedding, mhc_head, mhc_multilayer_recompute, mhc_post, mhc_pre,
                  mhc_recompute_chunk)
from .norm import LayerNorm, RMSNorm, SwiGLU, add_rms_norm, layer_norm, rms_norm, swiglu

# fp8_linear's names load on first use: its module imports Dynamo (torch.compile's constant), which imports
# torch.distributed.tensor, and importing the package must not (tests/test_dtensor.py)
_FP8_LINEAR = ("FP8Linear", "fp8_linear", "fp8_linear_gemm")


def __getattr__(name: str):
    if name in _FP8_LINEAR:
        import importlib

        # the import binds the submodule to the name fp8_linear: the function replaces it
        module = importlib.import_module(f"{__name__}.fp8_linear")

        globals().update({n: getattr(module, n) for n in _FP8_LINEAR})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Engram", "EngramGate", "FP8Linear", "fp8_linear", "fp8_linear_gemm", "ngram_token_ids",
           "MHCHead", "MHCSublayer", "engram_gate", "expand_from_embedding", "mhc_head",
           "mhc_multilayer_recompute", "mhc_post", "mhc_pre", "mhc_recompute_chunk",
           "LayerNorm", "RMSNorm", "SwiGLU", "add_rms_norm", "layer_norm", "rms_norm", "swiglu"]
