"""Ascend kernel of ``engram_grad_w_reduce`` (docs/ops/engram.md#grad_w_reduce).

``gw = sum_{p=0..P-1} grad_w_partial[p]`` (fp32, p ascending), then in place
``grad_weight_hidden += gw * f32(we)`` and ``grad_weight_embed += gw * f32(wh)``.

The (m, H) planes are treated as flat vectors of ``N = m*H`` elements split into column blocks; a
persistent loop hands blocks to the vector cores, and inside a block the P partial rows stream through
UB in one strided DMA (double-buffered across blocks) and are summed in registers, row 0 first.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ....limits import ENGRAM_HC_MULT, ENGRAM_HIDDEN, IntRange
from ....policy import ASCEND_CASE_CORES, GRAD_W_WORKERS
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from .._build import UB_BUDGET_BYTES


_LANES = 64


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """``stages`` UB versions of the block tiles; block widths (fp32 elements) from ``widths``: the largest that
    fits the UB less ``ub_slack`` (left to the pool's padding) and still gives every core a block."""

    stages: int
    widths: tuple[int, ...]
    ub_slack: int


# Two stages; 8 KiB below the budget (240 KiB) (docs/perf/ascend950/engram.md, 2026-11-30 — grad_w_reduce: block
# widths).
PLAN = ReducePlan(stages=2, widths=(2048, 1024, 512, 256, 128, 64), ub_slack=8 * 1024)
_UB_LIMIT = UB_BUDGET_BYTES - PLAN.ub_slack


def reduce_ub_bytes(num_partials: int, width: int) -> int:
    """UB of one block: per stage the P partial rows (4PW), wh and we (4W), the two gradient tiles (8W); plus
    the accumulator (4W)."""
    return PLAN.stages * (4 * num_partials + 12) * width + 4 * width


def max_partials() -> int:
    """The most partial rows whose narrowest block (``W = 64``) fits the UB (476)."""
    w = PLAN.widths[-1]
    return ((_UB_LIMIT - 4 * w) // (PLAN.stages * w) - 12) // 4


def _block_width(num_partials: int, numel: int, num_cores: int) -> int:
    fitting = [w for w in PLAN.widths if numel % w == 0 and reduce_ub_bytes(num_partials, w) <= _UB_LIMIT]
    for w in fitting:
        if numel // w >= num_cores:
            return w
    return fitting[-1]


@compile_key
class ReduceKey:
    """Compile-time key: ``P`` partial rows, ``numel = m * H`` and the vector cores (never T)."""

    num_partials: int
    numel: int
    num_cores: int


def _key(grad_w_partial) -> ReduceKey:
    p, m, hidden = grad_w_partial.shape
    return ReduceKey(int(p), int(m) * int(hidden), int(num_vector_cores()))


def _cases(hidden_size: int, hc_mult: int) -> ReduceKey:
    """At ``hidden_size`` with the Ascend 950's cores and partial rows (``GRAD_W_WORKERS``; no NPU needed)."""
    ENGRAM_HC_MULT.require("engram_grad_w_reduce", hc_mult)
    ENGRAM_HIDDEN.require("engram_grad_w_reduce", hidden_size)
    return ReduceKey(GRAD_W_WORKERS["ascend"], hc_mult * hidden_size, ASCEND_CASE_CORES)


def build_engram_grad_w_reduce(num_partials: int, numel: int, num_cores: int):
    """prim_func over flat views: partial (P, N) f32, wh (N,) bf16, we (N,) bf16, gwh (N,) f32 in/out,
    gwe (N,) f32 in/out. ``1 <= P <= max_partials()`` and ``N`` a positive multiple of 64, else
    ``limits.LimitError``."""
    stages = PLAN.stages
    P = IntRange("num_partials", 1, max_partials()).require("engram_grad_w_reduce", num_partials)
    N = IntRange("numel = m * H", _LANES, multiple_of=_LANES).require("engram_grad_w_reduce", numel)
    W = _block_width(P, N, num_cores)
    n_blocks = N // W
    n_chunks = W // _LANES

    @T.prim_func
    def engram_grad_w_reduce_asc(
        grad_w_partial: T.Tensor[(P, N), T.float32],
        weight_hidden: T.Tensor[(N,), T.bfloat16],
        weight_embed: T.Tensor[(N,), T.bfloat16],
        grad_weight_hidden: T.Tensor[(N,), T.float32],
        grad_weight_embed: T.Tensor[(N,), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            part_ub = T.alloc_shared((P, W), T.float32)
            acc_ub = T.alloc_shared((W,), T.float32)
            wh_ub = T.alloc_shared((W,), T.bfloat16)
            we_ub = T.alloc_shared((W,), T.bfloat16)
            gwh_ub = T.alloc_shared((W,), T.float32)
            gwe_ub = T.alloc_shared((W,), T.float32)
            T.annotate_buffer_versions({part_ub: stages, wh_ub: stages, we_ub: stages, gwh_ub: stages, gwe_ub: stages})
            for (blk,) in T.Persistent([n_blocks], num_cores, core_id, group_size=1, num_stages=stages):
                base = blk * W
                # one strided DMA brings the P partial rows of this column block
                T.copy(grad_w_partial[:, base : base + W], part_ub)
                with T.SimdVF():
                    s = S.alloc_local((1,), T.float32)
                    for c in T.serial(n_chunks):
                        d = c * _LANES
                        s[0] = S.vld(part_ub[0, d])
                        for p in T.serial(1, P):  # fixed order: p ascending
                            s[0] = S.vadd(s[0], S.vld(part_ub[p, d]))
                        S.vsts(acc_ub[d], s[0])
                T.copy(weight_hidden[base : base + W], wh_ub)
                T.copy(weight_embed[base : base + W], we_ub)
                T.copy(grad_weight_hidden[base : base + W], gwh_ub)
                T.copy(grad_weight_embed[base : base + W], gwe_ub)
                with T.SimdVF():
                    r = S.alloc_local((2,), T.float32)
                    for c in T.serial(n_chunks):
                        d = c * _LANES
                        gw = S.vld(acc_ub[d])
                        wh = S.vcvt(S.vld(wh_ub[d], dist="UNPK_B16"), T.float32, part=0)
                        we = S.vcvt(S.vld(we_ub[d], dist="UNPK_B16"), T.float32, part=0)
                        r[0] = S.vld(gwh_ub[d])
                        r[1] = S.vld(gwe_ub[d])
                        S.vmula(r[0], gw, we)
                        S.vmula(r[1], gw, wh)
                        S.vsts(gwh_ub[d], r[0])
                        S.vsts(gwe_ub[d], r[1])
                T.copy(gwh_ub, grad_weight_hidden[base : base + W])
                T.copy(gwe_ub, grad_weight_embed[base : base + W])

    return engram_grad_w_reduce_asc


KERNEL = Kernel("engram_grad_w_reduce", ReduceKey, build_engram_grad_w_reduce, derive=_key, cases=_cases)


def engram_grad_w_reduce(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed) -> None:
    """partial (P,m,H) f32, wh/we (m,H) bf16; gwh/gwe (m,H) f32 updated in place (+=). Current stream."""
    kernel = KERNEL.compiled(KERNEL.key(grad_w_partial))
    kernel(
        grad_w_partial.view(grad_w_partial.shape[0], -1), weight_hidden.view(-1), weight_embed.view(-1),
        grad_weight_hidden.view(-1), grad_weight_embed.view(-1),
    )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
