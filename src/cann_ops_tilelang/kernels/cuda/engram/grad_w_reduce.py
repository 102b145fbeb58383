"""CUDA kernel of ``engram_grad_w_reduce`` (OPS.md B.1.4).

Each CTA owns 64 columns of one stream. It stages the ``P`` partial rows of its columns in shared
memory (up to 256 rows per round, all loads of a round in flight at once), then one thread per column
sums them sequentially in ascending ``p`` (fixed order, deterministic), and finally updates the two
fp32 gradient buffers in place: ``gwh += gw * f32(we)``, ``gwe += gw * f32(wh)``.
"""

import functools

import torch

from .._build import jit_compile

__all__ = ["build_engram_grad_w_reduce", "engram_grad_w_reduce", "engram_grad_w_reduce_key", "get_engram_grad_w_reduce_kernel"]

# NOTE tuned for H200: 64 columns x up to 256 rows (<= 64 KB of shared memory per CTA); at m = 4,
# H = 7168, P = 132 this gives 448 CTAs of 33 KB (3-4 per SM) and puts the whole 15 MB of partials in
# flight in a single round.
# cp.async in 2 / 4 / 8 row batches, each summed while the later ones load, was slower (H = 7168:
# 7.67 / 7.98 / 8.32 us against 7.43 us).
_COLS = 64
_MAX_ROWS = 256
_THREADS = 256


def engram_grad_w_reduce_key(grad_w_partial: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m, P)``."""
    num_partials, hc_mult, hidden_size = grad_w_partial.shape
    return (int(hidden_size), int(hc_mult), int(num_partials))


def build_engram_grad_w_reduce(hidden_size: int, hc_mult: int, num_partials: int):
    """Builds the reduction prim_func.

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.
        num_partials: ``P >= 1`` (any value; no padding assumed).

    Returns:
        ``T.prim_func(grad_w_partial (P, m, H) f32, wh (m, H) bf16, we (m, H) bf16, gwh (m, H) f32,
        gwe (m, H) f32)``.
    """
    from tilelang import language as T

    H, m, P = hidden_size, hc_mult, num_partials
    f32, bf16 = T.float32, T.bfloat16
    quads = _COLS // 4  # float4 loads per row
    _ROWS = min(P, _MAX_ROWS)  # rows staged per round
    rounds = -(-P // _ROWS)
    loads_per_thread = -(-(_ROWS * quads) // _THREADS)

    @T.prim_func
    def engram_grad_w_reduce_cuda(
        grad_w_partial: T.Tensor((P, m, H), f32),
        weight_hidden: T.Tensor((m, H), bf16),
        weight_embed: T.Tensor((m, H), bf16),
        grad_weight_hidden: T.Tensor((m, H), f32),
        grad_weight_embed: T.Tensor((m, H), f32),
    ):
        with T.Kernel(H // _COLS, m, threads=_THREADS) as (bx, h):
            tid = T.get_thread_binding()
            buf = T.alloc_shared((_ROWS, _COLS), f32)
            acc = T.alloc_local((1,), f32)
            old = T.alloc_local((4,), f32)  # gwh, gwe, f32(we), f32(wh): loaded early, off the critical path
            acc[0] = 0.0
            if tid < _COLS:
                old[0] = grad_weight_hidden[h, bx * _COLS + tid]
                old[1] = grad_weight_embed[h, bx * _COLS + tid]
                old[2] = T.cast(weight_embed[h, bx * _COLS + tid], f32)
                old[3] = T.cast(weight_hidden[h, bx * _COLS + tid], f32)
            for r in T.serial(rounds):
                for j in T.unroll(loads_per_thread):
                    if r * _ROWS + (j * _THREADS + tid) // quads < P:
                        for k in T.vectorized(4):
                            buf[(j * _THREADS + tid) // quads, ((j * _THREADS + tid) % quads) * 4 + k] = grad_w_partial[
                                r * _ROWS + (j * _THREADS + tid) // quads, h, bx * _COLS + ((j * _THREADS + tid) % quads) * 4 + k
                            ]
                T.sync_threads()
                if tid < _COLS:
                    # Fully unrolled so the shared-memory loads run ahead of the dependent adds.
                    if rounds == 1:
                        for i in T.unroll(P):
                            acc[0] += buf[i, tid]
                    else:
                        for i in T.unroll(_ROWS):
                            if r * _ROWS + i < P:
                                acc[0] += buf[i, tid]
                if rounds > 1:
                    T.sync_threads()
            if tid < _COLS:
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
