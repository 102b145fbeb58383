"""CUDA kernel of ``engram_grad_w_reduce`` (docs/ops/engram.md#grad_w_reduce).

Both schedules sum every column's ``P`` partial rows in one thread, sequentially in ascending ``p``
(fixed order, deterministic, from ``-0.0``, the identity of fp32 addition), and finally update the two
fp32 gradient buffers in place: ``gwh += gw * f32(we)``, ``gwe += gw * f32(wh)``. The launcher picks one
per call (:func:`engram_grad_w_reduce_key`); both give bitwise the same result.

* Vector schedule (``P <= 66``, the backward's rows at H = 7168 on the H200, and the weights and buffers
  aligned for vectors: :data:`VECTOR_UPDATE_WIDTHS`). Each CTA owns 256 columns of one stream, each of its
  64 threads 4 adjacent ones. Every thread copies its own 16 bytes of all ``P`` rows into shared memory by
  cp.async, in up to four commit groups of ``ceil(P / 4)`` rows issued at once, and sums each group as soon
  as ``cp.async.wait_group`` says it landed (a thread reads only what it copied: no barrier); the update
  reads and writes its 4 columns in one vector per tensor.
* TMA schedule (any other call: more rows, or main_grad views at any 4-byte offset, the bf16 weights at any
  2-byte one). Each CTA owns 128 columns of one stream, one thread per column, and reads the weights and
  buffers one element at a time (coalesced). The partial rows arrive in shared memory by TMA, in chunks of
  at most 128 rows, at least two where ``P > 1`` (one TMA load per chunk; up to three buffers in flight,
  chunk ``c`` in buffer ``c % 3`` with its mbarrier at phase ``c // 3``); each chunk is summed as soon as it
  lands.
"""


import dataclasses

import torch

from ...._checks import misalignment
from ....limits import ENGRAM_HC_MULT, ENGRAM_HIDDEN, IntRange
from ....policy import grad_w_partials
from ..._kernel import Kernel, compile_key, kernel_module


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """The two schedules. Vectors: up to ``vector_max_partials`` rows, CTAs of ``vector_cols`` columns (4 per
    thread), the rows in ``vector_groups`` commit groups all issued at once. TMA: CTAs of ``cols`` columns (one
    per thread), the rows in boxes of at most ``chunk_rows`` (a box dimension is at most 256), at least
    ``min_chunks`` boxes (the sum of one overlaps the load of the next), ``max_buffers`` of them in flight."""

    vector_max_partials: int
    vector_cols: int
    vector_groups: int
    cols: int
    chunk_rows: int
    min_chunks: int
    max_buffers: int


# Chosen on the H200: the vector schedule up to 66 rows, TMA beyond (cp.async lost at P = 132) and for
# unaligned buffers (element-wise cp.async stayed behind TMA); TMA in 128-column CTAs with at least two
# chunks, three in flight (3 x 128 rows x 128 columns x 4 bytes = 192 KiB of shared memory). The "grad_w_reduce"
# entries of docs/perf/h200/engram.md (2026-11-30, 2026-12-02).
PLAN = ReducePlan(vector_max_partials=66, vector_cols=256, vector_groups=4, cols=128, chunk_rows=128, min_chunks=2,
                  max_buffers=3)
VECTOR_MAX_PARTIALS = PLAN.vector_max_partials  # most partial rows the vector schedule takes
# the vector schedule's accesses besides the 16-byte cp.async of grad_w_partial (which the op declares):
# {argument: bytes}; the launcher takes the TMA schedule unless every one starts on such a boundary
VECTOR_UPDATE_WIDTHS = {"weight_hidden": 8, "weight_embed": 8, "grad_weight_hidden": 16, "grad_weight_embed": 16}

# kernel parameters named differently from the op argument they receive (the TMA schedule takes the
# partials through a descriptor)
ARGUMENTS = {"grad_w_partial_desc": "grad_w_partial"}
# lowering cases whose launcher checks the alignment of some op arguments itself, launching another kernel
# where one is not aligned: {case: {argument: bytes}} (these need not be declared in the op's vector_args)
LAUNCHER_CHECKED = {"engram_grad_w_reduce_vector": dict(VECTOR_UPDATE_WIDTHS)}


@dataclasses.dataclass(frozen=True)
class Chunks:
    """The TMA schedule's boxes at one ``P``: ``chunks`` boxes of ``rows`` rows (the last box starts at
    ``P - rows`` and skips the rows the one before it summed), ``buffers`` of them in flight."""

    chunks: int
    rows: int
    buffers: int


def chunk_plan(num_partials: int) -> Chunks:
    """The :class:`Chunks` of the ``P`` rows (:data:`PLAN`)."""
    chunks = max(-(-num_partials // PLAN.chunk_rows), min(PLAN.min_chunks, num_partials))
    rows = -(-num_partials // chunks)
    return Chunks(chunks, rows, min(chunks, PLAN.max_buffers))


@compile_key
class ReduceKey:
    """Compile-time key: ``H``, ``m``, ``P = num_partials`` and the schedule (``vector``: the vector one)."""

    hidden_size: int
    hc_mult: int
    num_partials: int
    vector: bool = False


def _key(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> ReduceKey:
    """The key of a call: ``vector`` where ``P <= VECTOR_MAX_PARTIALS`` and each tensor of
    :data:`VECTOR_UPDATE_WIDTHS` starts on a multiple of its width."""
    num_partials, hc_mult, hidden_size = (int(n) for n in grad_w_partial.shape)
    named = {
        "weight_hidden": weight_hidden,
        "weight_embed": weight_embed,
        "grad_weight_hidden": grad_weight_hidden,
        "grad_weight_embed": grad_weight_embed,
    }
    vector = num_partials <= VECTOR_MAX_PARTIALS and not any(
        misalignment(named[name], width) for name, width in VECTOR_UPDATE_WIDTHS.items()
    )
    return ReduceKey(hidden_size, hc_mult, num_partials, vector)


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Both schedules: ``engram_grad_w_reduce`` (TMA) at the backward's CUDA partial count ``P`` of
    ``policy.grad_w_partials`` and ``engram_grad_w_reduce_vector`` (aligned buffers) at
    ``min(P, VECTOR_MAX_PARTIALS)``."""
    num_partials = grad_w_partials("cuda", hidden_size, hc_mult)
    return {"engram_grad_w_reduce": ReduceKey(hidden_size, hc_mult, num_partials),
            "engram_grad_w_reduce_vector": ReduceKey(hidden_size, hc_mult, min(num_partials, VECTOR_MAX_PARTIALS),
                                                     vector=True)}


def build_engram_grad_w_reduce(hidden_size: int, hc_mult: int, num_partials: int, vector: bool = False):
    """Builds the reduction prim_func.

    Args:
        hidden_size: ``H`` in ``limits.ENGRAM_HIDDEN``.
        hc_mult: ``m`` in ``limits.ENGRAM_HC_MULT``.
        num_partials: ``P >= 1`` (any value for TMA, see :func:`chunk_plan`; at most 66 for vectors).
        vector: the vector schedule (module docstring), whose kernel needs the weights and buffers aligned
            as :data:`VECTOR_UPDATE_WIDTHS` says; else the TMA schedule (any 4-byte aligned buffers).

    Values outside these ranges raise ``limits.LimitError``.

    Returns:
        ``T.prim_func(grad_w_partial (P, m, H) f32, wh (m, H) bf16, we (m, H) bf16, gwh (m, H) f32,
        gwe (m, H) f32)``.
    """
    from tilelang import language as T

    where = "engram_grad_w_reduce" + (" (vector schedule)" if vector else "")
    H = ENGRAM_HIDDEN.require(where, hidden_size)
    m = ENGRAM_HC_MULT.require(where, hc_mult)
    P = IntRange("num_partials", 1, VECTOR_MAX_PARTIALS if vector else None).require(where, num_partials)
    if vector:
        return _build_vector(H, m, P)
    f32, bf16 = T.float32, T.bfloat16
    plan = chunk_plan(P)
    chunks, rows, nbuf, cols = plan.chunks, plan.rows, plan.buffers, PLAN.cols

    @T.macro
    def load(grad_w_partial, buf, bar, c, b, h, bx):
        # chunk c (rows from min(c * rows, P - rows)) into buffer b, completing its mbarrier's phase
        first = T.min(c * rows, P - rows)
        T.tma_copy(
            grad_w_partial[first : first + rows, h, bx * cols : bx * cols + cols],
            buf[b, :, :],
            barrier=bar[b],
        )
        T.barrier_arrive(bar[b])

    @T.prim_func
    def engram_grad_w_reduce_cuda(
        grad_w_partial: T.Tensor((P, m, H), f32),
        weight_hidden: T.Tensor((m, H), bf16),
        weight_embed: T.Tensor((m, H), bf16),
        grad_weight_hidden: T.Tensor((m, H), f32),
        grad_weight_embed: T.Tensor((m, H), f32),
    ):
        with T.Kernel(H // cols, m, threads=cols) as (bx, h):
            tid = T.get_thread_binding()
            buf = T.alloc_shared((nbuf, rows, cols), f32)
            bar = T.alloc_barrier([cols] * nbuf)  # chunk c lands in buffer c % nbuf, phase c // nbuf
            acc = T.alloc_local((1,), f32)
            old = T.alloc_local((4,), f32)  # gwh, gwe, f32(we), f32(wh): loaded while the partials land
            for c in T.unroll(nbuf):
                load(grad_w_partial, buf, bar, c, c, h, bx)
            acc[0] = -0.0  # the identity of fp32 addition, -0.0 sums included
            old[0] = grad_weight_hidden[h, bx * cols + tid]
            old[1] = grad_weight_embed[h, bx * cols + tid]
            old[2] = T.cast(weight_embed[h, bx * cols + tid], f32)
            old[3] = T.cast(weight_hidden[h, bx * cols + tid], f32)
            for c in T.serial(chunks):
                T.mbarrier_wait_parity(bar[c % nbuf], (c // nbuf) % 2)
                # the last chunk starts at P - rows: its first rows were summed with the chunk before
                for i in T.unroll(rows):
                    if T.min(c * rows, P - rows) + i >= c * rows:
                        acc[0] += buf[c % nbuf, i, tid]
                if c + nbuf < chunks:
                    T.sync_threads()  # every thread is done with this buffer
                    load(grad_w_partial, buf, bar, c + nbuf, c % nbuf, h, bx)
            grad_weight_hidden[h, bx * cols + tid] = old[0] + acc[0] * old[2]
            grad_weight_embed[h, bx * cols + tid] = old[1] + acc[0] * old[3]

    return engram_grad_w_reduce_cuda


def _build_vector(H: int, m: int, P: int):
    """The vector schedule (module docstring): ``ceil(P / 4)`` rows per commit group, all in flight."""
    from tilelang import language as T

    f32, bf16 = T.float32, T.bfloat16
    cols, vec = PLAN.vector_cols, 4
    threads = cols // vec
    rows = -(-P // PLAN.vector_groups)
    groups = -(-P // rows)

    @T.prim_func
    def engram_grad_w_reduce_cuda(
        grad_w_partial: T.Tensor((P, m, H), f32),
        weight_hidden: T.Tensor((m, H), bf16),
        weight_embed: T.Tensor((m, H), bf16),
        grad_weight_hidden: T.Tensor((m, H), f32),
        grad_weight_embed: T.Tensor((m, H), f32),
    ):
        with T.Kernel(H // cols, m, threads=threads) as (bx, h):
            tid = T.get_thread_binding()
            c0 = bx * cols + tid * vec  # this thread's first column
            buf = T.alloc_shared((groups * rows, cols), f32)  # group g in rows g * rows ..
            acc = T.alloc_local((vec,), f32)
            old = T.alloc_local((4, vec), f32)  # gwh, gwe, f32(we), f32(wh): loaded while the partials land
            for g in T.unroll(groups):
                for i in T.unroll(rows):
                    if g * rows + i < P:
                        T.ptx_cp_async(
                            T.access_ptr(buf[g * rows + i, tid * vec], "w", vec),
                            T.access_ptr(grad_w_partial[g * rows + i, h, c0], "r", vec),
                            vec,
                        )
                T.ptx_commit_group()
            for j in T.vectorized(vec):
                old[0, j] = grad_weight_hidden[h, c0 + j]
            for j in T.vectorized(vec):
                old[1, j] = grad_weight_embed[h, c0 + j]
            for j in T.vectorized(vec):
                old[2, j] = T.cast(weight_embed[h, c0 + j], f32)
            for j in T.vectorized(vec):
                old[3, j] = T.cast(weight_hidden[h, c0 + j], f32)
            for j in T.vectorized(vec):
                acc[j] = -0.0  # the identity of fp32 addition, -0.0 sums included
            for g in T.serial(groups):
                # one (empty) group committed per step keeps the count fixed: groups 0 .. g have landed
                T.ptx_wait_group(groups - 1)
                for i in T.unroll(rows):
                    if g * rows + i < P:
                        for j in T.vectorized(vec):
                            acc[j] += buf[g * rows + i, tid * vec + j]
                T.ptx_commit_group()
            for j in T.vectorized(vec):
                grad_weight_hidden[h, c0 + j] = old[0, j] + acc[j] * old[2, j]
            for j in T.vectorized(vec):
                grad_weight_embed[h, c0 + j] = old[1, j] + acc[j] * old[3, j]

    return engram_grad_w_reduce_cuda


KERNEL = Kernel("engram_grad_w_reduce", ReduceKey, build_engram_grad_w_reduce, derive=_key, cases=_cases)


def engram_grad_w_reduce(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> None:
    """Launches the partial reduction and the in-place weight-gradient update on the current stream.

    Args:
        grad_w_partial: ``(P, m, H)`` f32.
        weight_hidden: ``(m, H)`` bf16.
        weight_embed: ``(m, H)`` bf16.
        grad_weight_hidden: ``(m, H)`` f32, updated in place (``+= gw * f32(we)``).
        grad_weight_embed: ``(m, H)`` f32, updated in place (``+= gw * f32(wh)``).

    ``grad_w_partial`` starts on a 16-byte boundary (the op checks it), the others may start anywhere their
    dtype allows: the launcher takes the vector schedule only where they are aligned for it.
    """
    kernel = KERNEL.compiled(KERNEL.key(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden,
                                        grad_weight_embed))
    kernel(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
