"""Autograd functions and modules over the ops: the Engram gate, the mHC training chain and the FP8 linear layer."""

from .engram import Engram, ngram_token_ids
from .engram_gate import EngramGate, engram_gate
from .fp8_linear import FP8Linear, fp8_linear, fp8_linear_gemm
from .mhc import (MHCHead, MHCSublayer, expand_from_embedding, mhc_head, mhc_multilayer_recompute, mhc_post, mhc_pre,
                  mhc_recompute_chunk)

__all__ = ["Engram", "EngramGate", "FP8Linear", "fp8_linear", "fp8_linear_gemm", "ngram_token_ids",
           "MHCHead", "MHCSublayer", "engram_gate", "expand_from_embedding", "mhc_head",
           "mhc_multilayer_recompute", "mhc_post", "mhc_pre", "mhc_recompute_chunk"]
