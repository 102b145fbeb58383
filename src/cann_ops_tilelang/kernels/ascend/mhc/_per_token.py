"""Helpers of the per-token mHC kernels (reduce + RMSNorm, split mixes, Sinkhorn, head mix), m = 4.

Numerics shared with the fused paths (``mhc_pre_big_fuse`` must use the same sequences to be bitwise
equal): every op is fp32; ``sigma(z) = 1/(1 + exp(0 - z))`` as ``vdiv(1, vadds(vexpdif(0, z), 1))``
(correctly rounded division); the affine map is ``z = x*scale + base`` with two roundings (``vmul`` then
``vadd``, no fused multiply-add). The kernels move whole token blocks with one contiguous DMA each way and
compute on 64-lane fp32 vectors. Ragged token tails: the DMA of the last block is clamped to the valid
rows by TileLang (lanes of absent tokens hold stale UB data, are computed but never stored) and
parameter-gradient accumulations mask them with a per-lane token predicate.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

__all__ = ["TOK", "TokenPlan", "sigmoid", "token_block_range", "u32"]

TOK = 64  # tokens per block of the per-token kernels: one lane per token in the SoA layouts


@dataclasses.dataclass(frozen=True)
class TokenPlan:
    """Pipeline of a per-token kernel: ``tokens`` per block, ``stages`` UB versions of the block tiles."""

    tokens: int = TOK
    stages: int = 2


def u32(v):
    """Reinterpret an int32 index vector as the uint32 offsets that gather/scatter take."""
    return T.reinterpret(v, "uint32x64")


def sigmoid(z, zero, one):
    """sigma(z) = 1/(1 + exp(0 - z)) (the formulation of every Ascend mHC kernel; the CUDA head-mix
    forward alone uses the MUFU exp and reciprocal)."""
    return S.vdiv(one, S.vadds(S.vexpdif(zero, z), 1.0))


def token_block_range(p, num_parts, num_tokens, block):
    """Token blocks [lo, hi) of partial row p: the ceil(T/block) blocks split into num_parts contiguous,
    balanced ranges (fixed for a given T and P, so the partials are deterministic)."""
    n_blk = T.ceildiv(num_tokens, block)
    return (p * n_blk) // num_parts, ((p + 1) * n_blk) // num_parts
