"""CUDA kernel of ``engram_grad_w_reduce`` (OPS.md B.1.4).

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

import functools

import torch

from ...._checks import misalignment
from .._build import jit_compile

__all__ = [
    "VECTOR_MAX_PARTIALS",
    "VECTOR_UPDATE_WIDTHS",
    "build_engram_grad_w_reduce",
    "engram_grad_w_reduce",
    "engram_grad_w_reduce_key",
    "get_engram_grad_w_reduce_kernel",
]

# NOTE tuned for H200 (P = 132 and 66, m = 4, cupti, cold L2, 3 interleaved rounds): 128 columns per CTA
# and two TMA chunks of 66 rows: 6.93 / 4.85 us at H = 7168 / 4096 (peer 6.96 / 5.21 us). One chunk: 7.13 /
# 5.07 us; 64 columns: 7.11 / 4.94 (two chunks), 7.24 / 5.12 us (one). The earlier all-threads load of 64
# columns x 132 rows into shared memory (16-byte loads, 256 threads): 7.40 / 5.47 us; with cp.async in
# 2 / 4 / 8 row batches, each summed while the later ones load, it was slower still (H = 7168, an earlier
# run: 7.67 / 7.98 / 8.32 us against 7.43 us). At P = 66 (the backward's rows at H = 7168 since one worker
# per 2-CTA cluster; 7 rotated rounds): at least two chunks (2 x 33 rows) 4.71 us against one of 66 rows
# 4.83, three 4.71, four (3 buffers) 4.96 (peer 4.53; at P = 132 all 6.90-6.95 against the peer's 6.91).
# NOTE (2026-12-02, P = 66 / 132, 7-9 rotated rounds): at P = 66 the TMA schedule stays at 4.57-4.76 us
# whatever its shape (128 / 224 / 256 columns over the flattened (P, m * H) view, 2 or 3 chunks; 4 to 8
# chunks all in flight: 4.75-5.28; peer 4.53-4.63 in those runs), and plain per-thread loads of all rows
# into registers take 4.76-4.91. The vector schedule: 4.34 us with 256 columns per CTA (4.32-4.45 with
# 128-512); in 2 groups of 33 rows 4.63, in 8 of 9 rows 4.37. The copies spread over all threads with a
# barrier per group (one thread per column in the sum): 4.61-4.79. At P = 132 cp.async took 5.10-5.30
# against TMA's 4.85-4.93, so TMA keeps P > 66 (only P = 66 and 132 were measured: where between them
# cp.async stops winning is not known).
# NOTE (2026-12-02, next session, P = 66, 9 rotated rounds; vector schedule 4.35, TMA 4.70, peer 4.54 us
# in that run): cp.async with the weights and buffers accessed one element at a time, which would take
# main_grad views at any offset, stays behind TMA or barely ahead: 4 adjacent columns a thread 4.83 us; the
# sums passed through shared memory (one barrier) to a coalesced layout, thread t owning columns t + 64 j,
# 4.86-4.92 (4.63 with the buffers read by volatile ld.global, which ptxas issues earlier). So unaligned
# calls take TMA. In the benchmark harness (3 rotated rounds): the vector schedule 4.27 us against the
# peer's 4.44 (P = 66, H = 7168).
VECTOR_MAX_PARTIALS = 66  # most partial rows the vector schedule takes
_VECTOR_COLS = 256  # columns per CTA, 4 per thread
_VECTOR_GROUPS = 4  # commit groups, all issued at once
# the vector schedule's accesses besides the 16-byte cp.async of grad_w_partial (which the op declares):
# {argument: bytes}; the launcher takes the TMA schedule unless every one starts on such a boundary
VECTOR_UPDATE_WIDTHS = {"weight_hidden": 8, "weight_embed": 8, "grad_weight_hidden": 16, "grad_weight_embed": 16}
_COLS = 128
_CHUNK_ROWS = 128  # rows per TMA box (a box dimension is at most 256)
_MAX_BUFFERS = 3  # chunks in flight (3 x 128 rows x 128 columns x 4 bytes = 192 KiB of shared memory)
_MIN_CHUNKS = 2  # at least this many chunks (the sum of one overlaps the load of the next)


def chunk_plan(num_partials: int) -> tuple[int, int, int]:
    """``(chunks, rows, buffers)``: the ``P`` rows in ``chunks`` boxes of ``rows`` rows (the last box starts
    at ``P - rows`` and skips the rows the one before it summed), ``buffers`` of them in flight."""
    chunks = max(-(-num_partials // _CHUNK_ROWS), min(_MIN_CHUNKS, num_partials))
    rows = -(-num_partials // chunks)
    return chunks, rows, min(chunks, _MAX_BUFFERS)


def engram_grad_w_reduce_key(
    grad_w_partial: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    grad_weight_hidden: torch.Tensor,
    grad_weight_embed: torch.Tensor,
) -> tuple:
    """Compile-time key ``(H, m, P, vector)`` of a call: ``vector`` (the vector schedule) where
    ``P <= VECTOR_MAX_PARTIALS`` and each tensor of :data:`VECTOR_UPDATE_WIDTHS` starts on a multiple of its
    width."""
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
    return (hidden_size, hc_mult, num_partials, vector)


def build_engram_grad_w_reduce(hidden_size: int, hc_mult: int, num_partials: int, vector: bool = False):
    """Builds the reduction prim_func.

    Args:
        hidden_size: ``H`` (multiple of 256).
        hc_mult: ``m``.
        num_partials: ``P >= 1`` (any value for TMA, see :func:`chunk_plan`; at most 66 for vectors).
        vector: the vector schedule (module docstring), whose kernel needs the weights and buffers aligned
            as :data:`VECTOR_UPDATE_WIDTHS` says; else the TMA schedule (any 4-byte aligned buffers).

    Returns:
        ``T.prim_func(grad_w_partial (P, m, H) f32, wh (m, H) bf16, we (m, H) bf16, gwh (m, H) f32,
        gwe (m, H) f32)``.
    """
    from tilelang import language as T

    H, m, P = hidden_size, hc_mult, num_partials
    if H % _VECTOR_COLS != 0 or P < 1 or (vector and P > VECTOR_MAX_PARTIALS):
        raise ValueError(
            f"engram_grad_w_reduce: needs H % {_VECTOR_COLS} == 0 and 1 <= P (<= {VECTOR_MAX_PARTIALS} for the "
            f"vector schedule), got H={H}, P={P}, vector={vector}"
        )
    if vector:
        return _build_vector(H, m, P)
    f32, bf16 = T.float32, T.bfloat16
    chunks, rows, nbuf = chunk_plan(P)

    @T.macro
    def load(grad_w_partial, buf, bar, c, b, h, bx):
        # chunk c (rows from min(c * rows, P - rows)) into buffer b, completing its mbarrier's phase
        first = T.min(c * rows, P - rows)
        T.tma_copy(
            grad_w_partial[first : first + rows, h, bx * _COLS : bx * _COLS + _COLS],
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
        with T.Kernel(H // _COLS, m, threads=_COLS) as (bx, h):
            tid = T.get_thread_binding()
            buf = T.alloc_shared((nbuf, rows, _COLS), f32)
            bar = T.alloc_barrier([_COLS] * nbuf)  # chunk c lands in buffer c % nbuf, phase c // nbuf
            acc = T.alloc_local((1,), f32)
            old = T.alloc_local((4,), f32)  # gwh, gwe, f32(we), f32(wh): loaded while the partials land
            for c in T.unroll(nbuf):
                load(grad_w_partial, buf, bar, c, c, h, bx)
            acc[0] = -0.0  # the identity of fp32 addition, -0.0 sums included
            old[0] = grad_weight_hidden[h, bx * _COLS + tid]
            old[1] = grad_weight_embed[h, bx * _COLS + tid]
            old[2] = T.cast(weight_embed[h, bx * _COLS + tid], f32)
            old[3] = T.cast(weight_hidden[h, bx * _COLS + tid], f32)
            for c in T.serial(chunks):
                T.mbarrier_wait_parity(bar[c % nbuf], (c // nbuf) % 2)
                # the last chunk starts at P - rows: its first rows were summed with the chunk before
                for i in T.unroll(rows):
                    if T.min(c * rows, P - rows) + i >= c * rows:
                        acc[0] += buf[c % nbuf, i, tid]
                if c + nbuf < chunks:
                    T.sync_threads()  # every thread is done with this buffer
                    load(grad_w_partial, buf, bar, c + nbuf, c % nbuf, h, bx)
            grad_weight_hidden[h, bx * _COLS + tid] = old[0] + acc[0] * old[2]
            grad_weight_embed[h, bx * _COLS + tid] = old[1] + acc[0] * old[3]

    return engram_grad_w_reduce_cuda


def _build_vector(H: int, m: int, P: int):
    """The vector schedule (module docstring): ``ceil(P / 4)`` rows per commit group, all in flight."""
    from tilelang import language as T

    f32, bf16 = T.float32, T.bfloat16
    cols, vec = _VECTOR_COLS, 4
    threads = cols // vec
    rows = -(-P // _VECTOR_GROUPS)
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


@functools.lru_cache(maxsize=None)
def get_engram_grad_w_reduce_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`engram_grad_w_reduce_key`), built once per key."""
    return jit_compile("engram_grad_w_reduce", key, build_engram_grad_w_reduce(*key))


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
    key = engram_grad_w_reduce_key(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
    kernel = get_engram_grad_w_reduce_kernel(*key)
    kernel(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
