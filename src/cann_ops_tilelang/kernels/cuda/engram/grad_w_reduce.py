"""CUDA kernel of ``engram_grad_w_reduce`` (OPS.md B.1.4).

Each CTA owns 128 columns of one stream. The ``P`` partial rows of its columns arrive in shared memory by
TMA, in chunks of at most 128 rows, at least two where P > 1 (one TMA load per chunk; up to three buffers
in flight, chunk ``c`` in buffer ``c % 3`` with its mbarrier at phase ``c // 3``); one thread per column
sums each chunk as soon as it lands, sequentially in ascending ``p`` (fixed order, deterministic), and
finally updates the two fp32 gradient buffers in place:
``gwh += gw * f32(we)``, ``gwe += gw * f32(wh)``.
"""

import functools

import torch

from .._build import jit_compile

__all__ = ["build_engram_grad_w_reduce", "engram_grad_w_reduce", "engram_grad_w_reduce_key", "get_engram_grad_w_reduce_kernel"]

# NOTE tuned for H200 (P = 132 and 66, m = 4, cupti, cold L2, 3 interleaved rounds): 128 columns per CTA
# and two TMA chunks of 66 rows: 6.93 / 4.85 us at H = 7168 / 4096 (peer 6.96 / 5.21 us). One chunk: 7.13 / 5.07
# us; 64 columns: 7.11 / 4.94 (two chunks), 7.24 / 5.12 us (one). The earlier all-threads load of 64
# columns x 132 rows into shared memory (16-byte loads, 256 threads): 7.40 / 5.47 us; with cp.async in
# 2 / 4 / 8 row batches, each summed while the later ones load, it was slower still (H = 7168, an earlier
# run: 7.67 / 7.98 / 8.32 us against 7.43 us). At P = 66 (the backward's rows at H = 7168 since one worker
# per 2-CTA cluster; 7 rotated rounds): at least two chunks (2 x 33 rows) 4.71 us against one of 66 rows
# 4.83, three 4.71, four (3 buffers) 4.96 (peer 4.53; at P = 132 all 6.90-6.95 against the peer's 6.91).
# NOTE (2026-12-02, P = 66 / 132, 7-9 rotated rounds): at P = 66 this kernel stays at 4.57-4.76 us whatever
# its shape (128 / 224 / 256 columns over the flattened (P, m * H) view, 2 or 3 chunks; 4 to 8 chunks all in
# flight: 4.75-5.28; peer 4.53-4.63 in those runs), and plain per-thread loads of all rows into registers
# take 4.76-4.91. Per-thread cp.async of 4 adjacent columns, all rows in flight in 4 groups of 17 rows and
# no barrier, took 4.34 us (256 columns per CTA; 4.32-4.45 with 128-512) with the weights and buffers in
# 16 / 8-byte vectors, which main_grad views at any 4-byte offset do not allow; one element at a time in
# that layout (a warp access strided over 512 bytes) 4.85. At P = 132 cp.async took 5.10-5.30 against TMA's
# 4.85-4.93. Not yet measured: cp.async for P <= 66 with the sums passed through shared memory to a
# coalesced update layout.
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


def engram_grad_w_reduce_key(grad_w_partial: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m, P)``."""
    num_partials, hc_mult, hidden_size = grad_w_partial.shape
    return (int(hidden_size), int(hc_mult), int(num_partials))


def build_engram_grad_w_reduce(hidden_size: int, hc_mult: int, num_partials: int):
    """Builds the reduction prim_func.

    Args:
        hidden_size: ``H`` (multiple of 128).
        hc_mult: ``m``.
        num_partials: ``P >= 1`` (any value; see :func:`chunk_plan`).

    Returns:
        ``T.prim_func(grad_w_partial (P, m, H) f32, wh (m, H) bf16, we (m, H) bf16, gwh (m, H) f32,
        gwe (m, H) f32)``.
    """
    from tilelang import language as T

    H, m, P = hidden_size, hc_mult, num_partials
    if H % _COLS != 0 or P < 1:
        raise ValueError(f"engram_grad_w_reduce: needs H % {_COLS} == 0 and P >= 1, got H={H}, P={P}")
    f32, bf16 = T.float32, T.bfloat16
    chunks, rows, nbuf = chunk_plan(P)

    @T.macro
    def load(grad_w_partial, buf, bar, c, b, h, bx):
        # chunk c (rows from min(c * rows, P - rows)) into buffer b, completing its mbarrier's phase
        T.tma_copy(
            grad_w_partial[T.min(c * rows, P - rows) : T.min(c * rows, P - rows) + rows, h, bx * _COLS : bx * _COLS + _COLS],
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
            acc[0] = 0.0
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
    """
    kernel = get_engram_grad_w_reduce_kernel(*engram_grad_w_reduce_key(grad_w_partial))
    kernel(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed)
