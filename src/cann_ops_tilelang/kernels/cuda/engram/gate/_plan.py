"""The compile-time schedule of the CUDA gate backward (:func:`bwd_plan`) and the partial-row count it implies
(:func:`num_partials`). Imports neither torch nor TileLang (``config.grad_w_partials`` reads it for fakes)."""

import dataclasses
import functools

from .....chips import H200
from .....limits import ENGRAM_HC_MULT, ENGRAM_HIDDEN, LimitError

__all__ = ["BwdPlan", "bwd_plan", "num_partials"]

_VEC = 8
_SMEM_BYTES = H200.arch.smem_per_cta  # one CTA's shared memory on the H200 (227 KiB)
# Chosen on the H200: weight-gradient accumulators in registers up to 32 floats per thread at <= 512 threads
# (more spilled at H = 7168), else the columns split over a 2-CTA cluster where that puts them in registers
# (docs/perf/h200/engram.md, 2026-11-30 — gate backward: schedule plan (tile, staging, prefetch, wf) and
# 2026-11-30 — gate backward: column split over a 2-CTA cluster).
_GW_REGS_MAX = 32  # fp32 accumulators per thread (nc * m * 8) that registers take
_SPLIT = 2  # cluster size of the column split


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """The backward's compile-time schedule at ``(H, m)`` (see :func:`bwd_plan`).

    split: a cluster of ``split`` CTAs shares each token, CTA ``r`` owning the columns
        ``[r*H/split, (r+1)*H/split)`` (1: one CTA per worker at full width).
    threads, nc: threads per CTA; each thread owns ``nc`` 8-element column vectors of its CTA's columns.
    gw_regs: weight-gradient accumulators in registers, else a shared-memory tile.
    stage_xk: the token's ``x``/``k`` staged in shared memory by ``cp.async`` at the start of the token,
        travelling together with the ``go``/``v`` loads.
    pre_gov: the next token's ``go``/``v`` prefetched into shared memory while the current token finishes.
    wf_smem: ``wf`` loaded once into shared memory (else read from global memory, one step ahead).
    pipe: the key also compiles the token-pipelined variant (split schedule only).
    """

    threads: int
    nc: int
    gw_regs: bool
    stage_xk: bool
    pre_gov: bool
    wf_smem: bool
    pipe: bool = False
    split: int = 1


def _smem_parts(columns: int, hc_mult: int) -> tuple[int, int, int, int, int]:
    """Shared-memory bytes of one CTA owning ``columns`` columns: ``(fixed, tile, xk, gov, wf)`` = the reduction
    and scalar buffers, the fp32 weight-gradient tile, one x/k staging buffer, the go/v prefetch buffer, wf."""
    H, m = columns, hc_mult
    return 2 * m * 32 * 4 + 2 * 4 * m * 4, 4 * m * H, 4 * m * H, 2 * (m + 1) * H, 4 * m * H


def _column_plan(columns: int, hc_mult: int) -> BwdPlan:
    """The schedule of one CTA that owns ``columns`` columns of every stream (see :func:`bwd_plan`)."""
    H, m = columns, hc_mult
    fixed, tile, xk_bytes, gov_bytes, wf_bytes = _smem_parts(H, m)
    stage_xk = fixed + tile + xk_bytes <= _SMEM_BYTES
    nvec = H // _VEC
    n32 = nvec // 32
    cap = 1024 if stage_xk else 512
    nc = next((c for c in range(1, n32 + 1) if n32 % c == 0 and nvec // c <= cap), None)
    if nc is None:
        raise LimitError(f"engram_gate_bwd: unsupported hidden_size (columns per CTA {columns})")
    threads = nvec // nc
    gw_regs = threads <= 512 and nc * m * _VEC <= _GW_REGS_MAX
    smem = fixed + (0 if gw_regs else tile) + (xk_bytes if stage_xk else 0)
    wf_smem = stage_xk and smem + wf_bytes <= _SMEM_BYTES
    smem += wf_bytes if wf_smem else 0
    pre_gov = smem + gov_bytes <= _SMEM_BYTES
    return BwdPlan(threads=threads, nc=nc, gw_regs=gw_regs, stage_xk=stage_xk, pre_gov=pre_gov, wf_smem=wf_smem)


def _pipe_fits(columns: int, hc_mult: int, plan: BwdPlan) -> bool:
    """Whether the token-pipelined variant fits at ``columns`` per CTA: it needs the tile in registers, the
    x/k staging, wf in shared memory and the go/v prefetch, plus a second x/k buffer."""
    fixed, _, xk_bytes, gov_bytes, wf_bytes = _smem_parts(columns, hc_mult)
    need = fixed + 2 * xk_bytes + wf_bytes + gov_bytes
    return plan.gw_regs and plan.stage_xk and plan.pre_gov and plan.wf_smem and need <= _SMEM_BYTES


def bwd_plan(hidden_size: int, hc_mult: int = 4) -> BwdPlan:
    """The backward's compile-time schedule at ``(H, m)`` (``limits.LimitError`` outside the Engram ranges).

    Steps: the layout is chosen with the tile in shared memory (x/k staged where tile and staging fit
    the 227 KiB of an H200 CTA; then one column vector per thread up to 1024 threads, else at most 512
    threads so that the phase-2 loads of several vectors stay in the 128-register budget); the tile
    moves to registers where the thread's share is at most ``_GW_REGS_MAX`` floats at <= 512 threads
    (128 registers per thread); the shared memory left goes to wf, then to the go/v prefetch. Where the
    tile stays in shared memory at full width and ``H / 2`` is a multiple of 256, the same steps at
    ``H / 2`` columns per CTA are taken instead if they put the tile in registers (``split`` 2; one worker
    per cluster, ``P = #SMs / 2``), with the token-pipelined variant where :func:`_pipe_fits`. At m = 4 this
    stages x/k and prefetches go/v at H <= 4096 and, split over two CTAs, at H % 512 == 0 up to 8192; it
    stages only at the other H up to 7168 (H = 4352, 4864, ...), whose weight-gradient tile stays in shared
    memory.
    """
    H = ENGRAM_HIDDEN.require("engram_gate_bwd", hidden_size)
    m = ENGRAM_HC_MULT.require("engram_gate_bwd", hc_mult)
    plan = _column_plan(H, m)
    S = _SPLIT
    if not plan.gw_regs and H % (256 * S) == 0:
        # S CTAs of a cluster per token, H / S columns each: the narrower schedule keeps grad_wf in
        # registers and has room for the x/k staging, wf and the go/v prefetch.
        part = _column_plan(H // S, m)
        if part.gw_regs and S * (part.threads // 32) <= 32:
            return dataclasses.replace(part, split=S, pipe=_pipe_fits(H // S, m, part))
    return plan


@functools.lru_cache(maxsize=None)
def _split(hidden_size: int, hc_mult: int) -> int:
    return bwd_plan(hidden_size, hc_mult).split


def num_partials(hidden_size: int, hc_mult: int, workers: int) -> int:
    """``P``, the rows of ``grad_w_partial`` on a device with ``workers`` SMs: one worker per SM, or per
    cluster of ``split`` SMs where :func:`bwd_plan` splits the columns (``workers // split``, at least 1).
    ``H`` and ``m`` may be symbolic sizes of a traced graph; they are read as ints (a guard on them)."""
    return max(1, workers // _split(int(hidden_size), int(hc_mult)))
