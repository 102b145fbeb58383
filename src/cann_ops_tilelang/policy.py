"""Device policy: the counts the kernels launch with that fakes must know without a device.

An op whose output has one row per worker (a partial sum) allocates it in its prepare function, which is also
the fake: the row counts are fixed per backend (the chip the kernels are tuned for, never the device's own core
count) and declared here, once. The op layer (``config.grad_w_partials``, the ops' prepare functions), the
kernels' launchers and their lowering cases read them from this module, which imports only :mod:`.chips` and
:mod:`.limits` (never a backend's kernel module, nor torch or TileLang).

The CUDA gate backward's cluster split divides its worker count (:func:`grad_w_partials`), so its compile-time
schedule (:func:`bwd_plan`) lives here too; its kernel (``kernels/cuda/engram/gate/backward.py``) reads it.
"""

import dataclasses
import functools

from . import limits
from .chips import ASCEND_950, H200
from .limits import ENGRAM_HC_MULT, ENGRAM_HIDDEN, LimitError

# Workers behind the per-worker partial rows of ``engram_gate_backward``'s weight gradient, per backend: the H200's SMs
# (one worker per SM, or per cluster where the CUDA backward splits the columns, see :func:`grad_w_partials`) and
# the Ascend 950's vector cores over the 4 streams (16 partial rows x 4 streams).
GRAD_W_WORKERS = {"cuda": H200.sms, "ascend": ASCEND_950.vector_cores // 4}

# Column partial rows of one ``engram_sinkhorn_step``: on CUDA four step CTAs per H200 SM (each owns a contiguous
# row range and writes one row), on the Ascend 950 one per vector core.
SINKHORN_STEP_PARTIALS = {"cuda": 4 * H200.sms, "ascend": ASCEND_950.vector_cores}

# Worker CTAs (partial rows) of the CUDA ``mhc_pre_split_mixes_backward``: one per H200 SM. The Ascend kernels take
# one partial row per vector core (their launch's core count).
MHC_SPLIT_MIXES_PARTIALS = H200.sms

# Token partitions of the norm family's weight gradients (rms_norm_backward): per-partition partial rows over fixed
# token ranges, summed in ascending order, so the bytes depend on this count only (never on the device's cores):
# one partition per H200 SM on CUDA, one per Ascend 950 vector core.
NORM_GRAD_WEIGHT_PARTITIONS = {"cuda": H200.sms, "ascend": ASCEND_950.vector_cores}

# Vector cores the Ascend lowering cases are built for (no NPU on the CPU tier; launchers read the stream's count).
ASCEND_CASE_CORES = ASCEND_950.vector_cores


# The backend whose device policy a device without kernels follows (meta and fake tensors without a device of
# their own, the CPU references of the tests): outputs whose bytes depend on the backend (the quant family's
# UE8M0 words and TMA padding, docs/ops/quant.md#layout) are allocated as on CUDA there.
FAKE_BACKEND = "cuda"


def kernel_backend(device_type: str) -> str:
    """The kernel backend (``"cuda"`` or ``"ascend"``) of a device type: ``"cuda"`` for CUDA, ``"ascend"`` for
    ``"npu"`` / ``"privateuseone"`` (``limits.BACKENDS``), :data:`FAKE_BACKEND` for any device without kernels."""
    return limits.backend_of(device_type) or FAKE_BACKEND


def per_backend(table: dict, device_type: str):
    """``table``'s entry for the backend of ``device_type``; any device without kernels (CPU references, meta
    tensors) takes the CUDA entry (:data:`FAKE_BACKEND`)."""
    return table[kernel_backend(device_type)]


def grad_w_partials(device_type: str, hidden_size: int, hc_mult: int = 4) -> int:
    """Rows ``P`` of the weight-gradient partials written by ``engram_gate_backward`` on a device type at ``(H, m)``:
    ``GRAD_W_WORKERS["ascend"]`` on Ascend; on CUDA (and any device without kernels) the H200's 132 SMs divided by
    the backward's cluster split at ``(H, m)`` (66 at H = 7168: one worker per 2-CTA cluster, 132 at H = 4096)."""
    if limits.backend_of(device_type) == "ascend":
        return GRAD_W_WORKERS["ascend"]
    return num_partials(hidden_size, hc_mult, GRAD_W_WORKERS["cuda"])


# --- the CUDA gate backward's compile-time schedule, whose cluster split fixes P on CUDA -----------------------

@dataclasses.dataclass(frozen=True)
class BwdTuning:
    """Tuning of the CUDA gate backward: ``vec`` bf16 elements per 16-byte access; ``gw_regs_max`` fp32
    weight-gradient accumulators per thread (``nc * m * vec``) that registers take (at <= ``gw_regs_threads``
    threads per CTA); ``split`` CTAs per cluster of the column split; the launcher's token-pipelined kernel for
    at most ``pipelined_tokens_per_worker`` tokens per worker."""

    vec: int
    gw_regs_max: int
    gw_regs_threads: int
    split: int
    pipelined_tokens_per_worker: int


# Chosen on the H200: weight-gradient accumulators in registers up to 32 floats per thread at <= 512 threads
# (more spilled at H = 7168), else the columns split over a 2-CTA cluster where that puts them in registers
# (docs/perf/h200/engram.md, 2026-11-30 — gate backward: schedule plan (tile, staging, prefetch, wf) and
# 2026-11-30 — gate backward: column split over a 2-CTA cluster); the pipelined kernel up to 32 tokens per worker
# (T <= 2112 at P = 66), the unpipelined one beyond (2026-12-02 — gate backward: one worker per 2-CTA cluster).
BWD_TUNING = BwdTuning(vec=8, gw_regs_max=32, gw_regs_threads=512, split=2, pipelined_tokens_per_worker=32)
_SMEM_BYTES = H200.arch.smem_per_cta  # one CTA's shared memory on the H200 (227 KiB)


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


def column_plan(columns: int, hc_mult: int) -> BwdPlan:
    """The schedule of one CTA that owns ``columns`` columns of every stream (see :func:`bwd_plan`)."""
    H, m = columns, hc_mult
    fixed, tile, xk_bytes, gov_bytes, wf_bytes = _smem_parts(H, m)
    stage_xk = fixed + tile + xk_bytes <= _SMEM_BYTES
    nvec = H // BWD_TUNING.vec
    n32 = nvec // 32
    cap = 1024 if stage_xk else 512
    nc = next((c for c in range(1, n32 + 1) if n32 % c == 0 and nvec // c <= cap), None)
    if nc is None:
        raise LimitError(f"engram_gate_backward: unsupported hidden_size (columns per CTA {columns})")
    threads = nvec // nc
    gw_regs = threads <= BWD_TUNING.gw_regs_threads and nc * m * BWD_TUNING.vec <= BWD_TUNING.gw_regs_max
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
    moves to registers where the thread's share is at most ``BWD_TUNING.gw_regs_max`` floats at <= 512 threads
    (128 registers per thread); the shared memory left goes to wf, then to the go/v prefetch. Where the
    tile stays in shared memory at full width and ``H / 2`` is a multiple of 256, the same steps at
    ``H / 2`` columns per CTA are taken instead if they put the tile in registers (``split`` 2; one worker
    per cluster, ``P = #SMs / 2``), with the token-pipelined variant where :func:`_pipe_fits`. At m = 4 this
    stages x/k and prefetches go/v at H <= 4096 and, split over two CTAs, at H % 512 == 0 up to 8192; it
    stages only at the other H up to 7168 (H = 4352, 4864, ...), whose weight-gradient tile stays in shared
    memory.
    """
    H = ENGRAM_HIDDEN.require("engram_gate_backward", hidden_size)
    m = ENGRAM_HC_MULT.require("engram_gate_backward", hc_mult)
    plan = column_plan(H, m)
    S = BWD_TUNING.split
    if not plan.gw_regs and H % (256 * S) == 0:
        # S CTAs of a cluster per token, H / S columns each: the narrower schedule keeps grad_wf in
        # registers and has room for the x/k staging, wf and the go/v prefetch.
        part = column_plan(H // S, m)
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
