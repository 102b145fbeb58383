"""CUDA kernels of ``expand_to_mhc_forward`` / ``_backward`` (docs/ops/mhc.md#expand).

Forward: ``out[t, i, :] = x[t, :]`` (a bit copy); backward: ``grad_x = bf16(sum_i f32(grad_out[t, i]))``
(``i`` ascending, overwrite). Both run a flat grid over the ``T * H / 8`` 8-element vectors of the
token-major tensors, ``vectors`` per thread strided by the CTA size so that every warp access is coalesced;
each thread issues all its loads before it stores. ``H`` in ``limits.MHC_HIDDEN``, any ``T > 0``,
``T * m * H < 2**31`` (32-bit element offsets).
"""

import dataclasses

import torch

from ..._kernel import Kernel, kernel_module
from ._common import VEC, RowKey, min_blocks, row_key


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """A flat grid over the vectors: CTAs of ``threads`` threads, ``vectors`` vectors per thread."""

    threads: int
    vectors: int


# Forward 128 x 2 (one wave at T = 512, H = 7168, where 256 x 1 / 512 x 1 take two); the backward (4 loads per
# vector) 256 x 2, the others level or slower (docs/perf/h200/mhc.md, 2026-11-30).
FORWARD_PLAN = FlatPlan(threads=128, vectors=2)
BACKWARD_PLAN = FlatPlan(threads=256, vectors=2)


def build_expand_to_mhc_forward(hidden_size: int, hc_mult: int):
    """Builds the expand forward: ``out[t, i, :] = x[t, :]`` (bit copy).

    Args:
        hidden_size: ``H`` (``limits.MHC_HIDDEN``).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(x (T, H) bf16, out (T, m, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    nvec = H // VEC
    threads, nvt = FORWARD_PLAN.threads, FORWARD_PLAN.vectors
    bf16 = T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def expand_to_mhc_forward_cuda(x: T.Tensor((num_tokens, H), bf16), out: T.Tensor((num_tokens, m, H), bf16)):
        with T.Kernel(T.ceildiv(num_tokens * nvec, threads * nvt), threads=threads) as bid:
            T.annotate_min_blocks_per_sm(min_blocks(threads, 64))
            tid = T.get_thread_binding()
            xr = T.alloc_local((nvt, VEC), bf16)
            total = num_tokens * nvec
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for k in T.vectorized(VEC):
                        xr[j, k] = x[((bid * nvt + j) * threads + tid) // nvec, (((bid * nvt + j) * threads + tid) % nvec) * VEC + k]
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for i in T.unroll(m):
                        for k in T.vectorized(VEC):
                            out[((bid * nvt + j) * threads + tid) // nvec, i, (((bid * nvt + j) * threads + tid) % nvec) * VEC + k] = xr[j, k]

    return expand_to_mhc_forward_cuda


FORWARD = Kernel("expand_to_mhc_forward", RowKey, build_expand_to_mhc_forward, cases=RowKey,
                 derive=lambda x, out: row_key("expand_to_mhc_forward", x.shape[-1], out.shape[1]))


def expand_to_mhc_forward(x: torch.Tensor, out: torch.Tensor) -> None:
    """Launches ``out[t, i, :] = x[t, :]`` on the current stream (inputs validated upstream).

    Args:
        x: ``(T, H)`` bf16, ``T > 0``, ``H % 64 == 0``.
        out: ``(T, m, H)`` bf16, written.
    """
    FORWARD.compiled(FORWARD.key(x, out))(x, out)


def build_expand_to_mhc_backward(hidden_size: int, hc_mult: int):
    """Builds the expand backward: ``grad_x = bf16(sum_i f32(grad_out[t, i]))`` (i ascending, overwrite).

    Args:
        hidden_size: ``H`` (``limits.MHC_HIDDEN``).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(grad_out (T, m, H) bf16, grad_x (T, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    nvec = H // VEC
    threads, nvt = BACKWARD_PLAN.threads, BACKWARD_PLAN.vectors
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def expand_to_mhc_backward_cuda(grad_out: T.Tensor((num_tokens, m, H), bf16), grad_x: T.Tensor((num_tokens, H), bf16)):
        with T.Kernel(T.ceildiv(num_tokens * nvec, threads * nvt), threads=threads) as bid:
            T.annotate_min_blocks_per_sm(min_blocks(threads, 64))
            tid = T.get_thread_binding()
            gr = T.alloc_local((nvt, m, VEC), bf16)
            acc = T.alloc_local((VEC,), f32)
            total = num_tokens * nvec
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for i in T.unroll(m):
                        for k in T.vectorized(VEC):
                            gr[j, i, k] = grad_out[((bid * nvt + j) * threads + tid) // nvec, i, (((bid * nvt + j) * threads + tid) % nvec) * VEC + k]
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for k in T.unroll(VEC):
                        acc[k] = T.cast(gr[j, 0, k], f32)
                        for i in T.unroll(1, m):
                            acc[k] += T.cast(gr[j, i, k], f32)
                    for k in T.vectorized(VEC):
                        grad_x[((bid * nvt + j) * threads + tid) // nvec, (((bid * nvt + j) * threads + tid) % nvec) * VEC + k] = T.cast(acc[k], bf16)

    return expand_to_mhc_backward_cuda


BACKWARD = Kernel("expand_to_mhc_backward", RowKey, build_expand_to_mhc_backward, cases=RowKey,
                  derive=lambda grad_out, grad_x: row_key("expand_to_mhc_backward", grad_out.shape[-1],
                                                          grad_out.shape[1]))


def expand_to_mhc_backward(grad_out: torch.Tensor, grad_x: torch.Tensor) -> None:
    """Launches ``grad_x = bf16(sum_i f32(grad_out[:, i]))`` on the current stream (overwrites ``grad_x``).

    Args:
        grad_out: ``(T, m, H)`` bf16, ``T > 0``, ``H % 64 == 0``.
        grad_x: ``(T, H)`` bf16, written.
    """
    BACKWARD.compiled(BACKWARD.key(grad_out, grad_x))(grad_out, grad_x)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
