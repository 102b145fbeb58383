"""Autograd functions and modules over the ops: the Engram gate and the mHC training chain."""

from .engram import Engram, ngram_token_ids
from .engram_gate import EngramGate, engram_gate
from .mhc import (MHCHead, MHCSublayer, expand_from_embedding, mhc_head, mhc_multilayer_recompute, mhc_post, mhc_pre,
                  mhc_recompute_chunk)

__all__ = ["Engram", "EngramGate", "ngram_token_ids",
           "MHCHead", "MHCSublayer", "engram_gate", "expand_from_embedding", "mhc_head",
           "mhc_multilayer_recompute", "mhc_post", "mhc_pre", "mhc_recompute_chunk"]
