"""Ascend kernel of ``engram_fused_weight`` (docs/ops/engram.md#fused_weight): ``wf = f32(wh) * f32(we)``,
bit-exact.

The (m, H) weights are treated as one flat vector of ``numel = m*H`` elements (``numel % 256 == 0``);
a persistent loop hands fixed-size blocks to the vector cores.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ....limits import ENGRAM_FUSED_WEIGHT_ALIGN, ENGRAM_HC_MULT, ENGRAM_HIDDEN, IntRange
from ....policy import ASCEND_CASE_CORES
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores


_LANES = 64  # fp32 lanes of one 256-byte vector register


@dataclasses.dataclass(frozen=True)
class FusedWeightPlan:
    """``stages`` UB versions of the block tiles (GM->UB->GM: load block i+1 and store block i-1 while computing
    block i); block sizes (elements) from ``blocks``: the largest that still gives every core a block."""

    stages: int
    blocks: tuple[int, ...]


# Triple buffering; blocks of 8 bytes per element and stage, the largest 96 KiB of UB over 3 stages
# (docs/perf/ascend950/engram.md, 2026-11-30 — fused_weight: block sizes).
PLAN = FusedWeightPlan(stages=3, blocks=(4096, 2048, 1024, 512, 256))
_NUMEL = IntRange("element count", ENGRAM_FUSED_WEIGHT_ALIGN, multiple_of=ENGRAM_FUSED_WEIGHT_ALIGN)


def _block_size(numel: int, num_cores: int) -> int:
    """Largest block that still gives every core at least one block (else the smallest, 256)."""
    for blk in PLAN.blocks:
        if numel % blk == 0 and numel // blk >= num_cores:
            return blk
    return PLAN.blocks[-1]


@compile_key
class FusedWeightKey:
    """Compile-time key: ``numel = m * H`` of the flattened weights and the vector cores."""

    numel: int
    num_cores: int


def _cases(hidden_size: int, hc_mult: int) -> FusedWeightKey:
    """Over the ``(hc_mult, hidden_size)`` weights on the Ascend 950's cores (no NPU needed)."""
    numel = ENGRAM_HC_MULT.require("engram_fused_weight", hc_mult) * ENGRAM_HIDDEN.require("engram_fused_weight",
                                                                                          hidden_size)
    return FusedWeightKey(numel, ASCEND_CASE_CORES)


def build_engram_fused_weight(numel: int, num_cores: int):
    """prim_func over flat views: wh (numel,) bf16, we (numel,) bf16 -> wf (numel,) f32. ``numel`` a positive
    multiple of ``limits.ENGRAM_FUSED_WEIGHT_ALIGN`` (else ``limits.LimitError``)."""
    stages = PLAN.stages
    numel = _NUMEL.require("engram_fused_weight", numel)
    blk = _block_size(numel, num_cores)
    num_blocks = numel // blk

    @T.prim_func
    def engram_fused_weight_asc(
        weight_hidden: T.Tensor[(numel,), T.bfloat16],
        weight_embed: T.Tensor[(numel,), T.bfloat16],
        weight_fused: T.Tensor[(numel,), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            wh_ub = T.alloc_shared((blk,), T.bfloat16)
            we_ub = T.alloc_shared((blk,), T.bfloat16)
            wf_ub = T.alloc_shared((blk,), T.float32)
            T.annotate_buffer_versions({wh_ub: stages, we_ub: stages, wf_ub: stages})
            for (block,) in T.Persistent([num_blocks], num_cores, core_id, group_size=1, num_stages=stages):
                base = block * blk
                T.copy(weight_hidden[base : base + blk], wh_ub)
                T.copy(weight_embed[base : base + blk], we_ub)
                with T.SimdVF():
                    for i in T.serial(blk // _LANES):
                        # UNPK_B16 spreads 64 bf16 into the even halves of 64 fp32 lanes; the widening
                        # is exact and so is the product of two 8-bit significands.
                        a = S.vcvt(S.vld(wh_ub[i * _LANES], dist="UNPK_B16"), T.float32, part=0)
                        b = S.vcvt(S.vld(we_ub[i * _LANES], dist="UNPK_B16"), T.float32, part=0)
                        S.vsts(wf_ub[i * _LANES], S.vmul(a, b))
                T.copy(wf_ub, weight_fused[base : base + blk])

    return engram_fused_weight_asc


KERNEL = Kernel("engram_fused_weight", FusedWeightKey, build_engram_fused_weight, cases=_cases,
                derive=lambda weight_hidden: FusedWeightKey(int(weight_hidden.numel()), int(num_vector_cores())))


def engram_fused_weight(weight_hidden, weight_embed, out) -> None:
    """wh (m, H) bf16, we (m, H) bf16 -> out (m, H) f32 (pre-allocated, contiguous). Current stream, no sync."""
    kernel = KERNEL.compiled(KERNEL.key(weight_hidden))
    kernel(weight_hidden.view(-1), weight_embed.view(-1), out.view(-1))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
