"""Helpers shared by several CUDA mHC kernel modules (private).

Row kernels (expand, normw merge, pre apply mix, post) work at thread level on 8-element bf16 column vectors
(one 16-byte access per row): :data:`VEC`, :func:`min_blocks`, :class:`RowLayout` / :func:`row_layout` and
:func:`row_chunk`; the streaming ones share the compile-time key :class:`RowKey` (:func:`row_key`). Per-token
kernels (reduce + RMSNorm, split mixes, Sinkhorn, head mix) take
:data:`TOKENS_PER_CTA` tokens per CTA and the widest fp32 vector of a row (:func:`vec_width`), their keys
:class:`MixKey` / :class:`PartialsKey`. The pre-norm
GEMM's forward and backward share :func:`check_gemm_weight` and :class:`GemmWeightKey`.
"""

import dataclasses

from ....chips import H200
from ....limits import MHC_GEMM_BLOCK, MHC_HC_MULT, MHC_HIDDEN, IntRange
from ..._kernel import compile_key

VEC = 8  # bf16 elements per 16-byte access

# 32 tokens per CTA: 256 CTAs at T = 8192, every H200 SM busy in one wave while each CTA stays a few warps
# (the per-token ops move a few dozen floats per token: latency-bound, not bandwidth-bound).
TOKENS_PER_CTA = 32

# The pre-norm GEMM's weight (M3, K) as its kernels need it: whole 64-column blocks, and M3 in 8-row pieces of
# at most one warp's 32 lanes (wider than the ops' ranges, limits.MHC_HIDDEN and limits.MHC_MIX).
GEMM_WIDTH = IntRange("K", MHC_GEMM_BLOCK, None, multiple_of=MHC_GEMM_BLOCK)
GEMM_ROWS = IntRange("M3", 8, 32, multiple_of=8)


def check_gemm_weight(op: str, rows: int, cols: int) -> None:
    """``LimitError`` unless the GEMM weight ``(rows, cols) = (M3, K)`` is in :data:`GEMM_ROWS` x :data:`GEMM_WIDTH`."""
    GEMM_WIDTH.require(op, cols)
    GEMM_ROWS.require(op, rows)


@compile_key
class GemmWeightKey:
    """Compile-time key of a GEMM kernel that depends on the weight's ``(M3, K) = (rows, cols)`` alone (the
    forward's ``fn`` preparation, the backward's partial reduction)."""

    cols: int
    rows: int


@compile_key
class RowKey:
    """Compile-time key of a row kernel (expand, pre apply mix, post, ...): ``H`` and ``m``, never the token count."""

    hidden_size: int
    hc_mult: int


def row_key(op: str, hidden_size, hc_mult) -> RowKey:
    """The :class:`RowKey` of ``op``'s launch, ``H`` and ``m`` checked against ``limits`` (``LimitError``)."""
    return RowKey(MHC_HIDDEN.require(op, int(hidden_size)), MHC_HC_MULT.require(op, int(hc_mult)))


@compile_key
class MixKey:
    """Compile-time key of a per-token kernel that depends on ``m`` alone (never ``H`` nor the token count)."""

    hc_mult: int


@compile_key
class PartialsKey:
    """Compile-time key of a per-token kernel writing ``num_partials`` per-worker partial rows."""

    hc_mult: int
    num_partials: int


def min_blocks(threads: int, regs: int) -> int:
    """Resident CTAs per SM for a register budget of ``regs`` per thread (the H200's registers per SM)."""
    return max(1, min(16, H200.arch.regs_per_sm // (regs * threads)))


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """A CTA's cover of one token row of ``H / 8`` vectors: ``threads`` threads of ``nv`` vectors each, the
    last slots ``guarded`` where ``threads * nv`` overruns the row."""

    threads: int
    nv: int
    guarded: bool


def row_layout(hidden_size: int, max_threads: int) -> RowLayout:
    """The layout covering one token row: ``threads`` the largest multiple of 32 up to ``max_threads`` that
    divides ``H / 8`` (no guard); where ``H / 8`` has none (``H % 256 != 0``), ``min(max_threads,
    align32(H / 8))`` threads and the last slots guarded. Up to 256 threads the model sizes give (threads, nv)
    = (160, 1) at H = 1280, (160, 2) at 2560, (256, 2) at 4096, (160, 4) at 5120, (224, 4) at 7168."""
    nvec = hidden_size // VEC
    best = 0
    for threads in range(32, max_threads + 1, 32):
        if nvec % threads == 0:
            best = threads
    if best:
        return RowLayout(best, nvec // best, False)
    threads = min(max_threads, -(-nvec // 32) * 32)
    nv = -(-nvec // threads)
    return RowLayout(threads, nv, nv * threads != nvec)


# (token, column chunk) CTAs of the forwards: the whole row in one CTA where that takes at most ROW_NVC vectors
# per thread, else one vector per thread and chunk (docs/perf/h200/mhc.md, 2026-12-01).
ROW_NVC = 2


def row_chunk(nv: int) -> int:
    """Vectors per thread of a ``(token, column chunk)`` CTA whose layout puts ``nv`` vectors per thread on
    the row: all of them (one chunk per token) where ``nv <= ROW_NVC``, else one (``nv`` chunks)."""
    return nv if nv <= ROW_NVC else 1


def vec_width(n: int) -> int:
    """Widest vector (4, 2 or 1 fp32) that evenly divides a row of ``n`` floats."""
    return 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)


def ceil32(n: int) -> int:
    return -(-n // 32) * 32
