"""CUDA kernels of ``mhc_pre_apply_mix_forward`` / ``_backward`` (docs/ops/mhc.md#pre_apply_mix).

Forward: ``out[t, d] = bf16(sum_i mix[t, i] * f32(x[t, i, d]))`` on a 1-D grid over ``(token, column chunk)``
pairs, chunks fastest, so that consecutive CTAs read consecutive chunks of the same rows; a thread loads its
token's mixes once. Backward: one CTA per token; ``grad_x`` accumulates in place (bf16 read-modify-write) and
``grad_mix`` is reduced over the row in a fixed order (warp shuffles, then one shared-memory step: no atomics).
Every thread access is a full 8-element vector (``H`` in ``limits.MHC_HIDDEN``; where ``H / 8`` has no
suitable multiple-of-32 divisor the last vector slots are guarded); the kernels are generic in ``m``.
"""

import dataclasses

import torch

from ..._kernel import Kernel, kernel_module
from ._common import VEC, RowKey, RowLayout, min_blocks, row_chunk, row_key, row_layout


@dataclasses.dataclass(frozen=True)
class ApplyMixPlan:
    """Thread bounds of the row layouts (:func:`row_layout`): the forward's ``(token, chunk)`` CTA takes up to
    ``forward_threads``, or up to ``forward_fallback_threads`` where that gives fewer than ``forward_threads``;
    the backward's one-token CTA up to ``backward_threads``."""

    forward_threads: int
    forward_fallback_threads: int
    backward_threads: int


# Forward: 128 threads x 1 vector per chunk (the 1-D grid, chunks of a token adjacent); where the row has no
# 128-thread layout (H = 1280, 2560) the post forward's 160-thread one. Backward: up to 512 threads (1-2 vectors
# each) at 2 CTAs per SM, which does not spill (docs/perf/h200/mhc.md, 2026-12-01 and 2026-11-30).
PLAN = ApplyMixPlan(forward_threads=128, forward_fallback_threads=256, backward_threads=512)


def forward_layout(hidden_size: int) -> RowLayout:
    """Layout of the forward's ``(token, chunk)`` CTA (see :class:`ApplyMixPlan`)."""
    layout = row_layout(hidden_size, PLAN.forward_threads)
    return layout if layout.threads >= PLAN.forward_threads else row_layout(hidden_size, PLAN.forward_fallback_threads)


def backward_layout(hidden_size: int) -> RowLayout:
    """Layout of the backward's one-token CTA (see :class:`ApplyMixPlan`)."""
    return row_layout(hidden_size, PLAN.backward_threads)


def build_mhc_pre_apply_mix_forward(hidden_size: int, hc_mult: int):
    """Builds ``out[t, d] = bf16(sum_{i=0..m-1} mix[t, i] * f32(x[t, i, d]))`` (i ascending, starting
    from the product ``mix_0 * x_0``).

    1-D grid over ``(token, column chunk)``, chunks fastest; a thread loads its token's ``m`` mixes once
    and ``m`` 16-byte vectors per column vector.

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(x (T, m, H) bf16, mix (T, m) f32, out (T, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    threads, nv, guarded = dataclasses.astuple(forward_layout(H))
    nvc = row_chunk(nv)
    chunks = nv // nvc
    nvec = H // VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_forward_cuda(
        x: T.Tensor((num_tokens, m, H), bf16), mix: T.Tensor((num_tokens, m), f32), out: T.Tensor((num_tokens, H), bf16)
    ):
        # One grid dimension (up to 2**31 - 1 CTAs; y is limited to 65535), the chunks of a token adjacent.
        with T.Kernel(num_tokens * chunks, threads=threads) as bid:
            t = bid // chunks
            cb = bid % chunks
            T.annotate_min_blocks_per_sm(min_blocks(threads, 64))
            tid = T.get_thread_binding()
            mx = T.alloc_local((m,), f32)
            xr = T.alloc_local((nvc, m, VEC), bf16)
            acc = T.alloc_local((VEC,), f32)
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for i in T.unroll(m):
                        for k in T.vectorized(VEC):
                            xr[j, i, k] = x[t, i, ((cb * nvc + j) * threads + tid) * VEC + k]
            for i in T.unroll(m):
                mx[i] = mix[t, i]
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for k in T.unroll(VEC):
                        acc[k] = mx[0] * T.cast(xr[j, 0, k], f32)
                        for i in T.unroll(1, m):
                            acc[k] += mx[i] * T.cast(xr[j, i, k], f32)
                    for k in T.vectorized(VEC):
                        out[t, ((cb * nvc + j) * threads + tid) * VEC + k] = T.cast(acc[k], bf16)

    return mhc_pre_apply_mix_forward_cuda


FORWARD = Kernel("mhc_pre_apply_mix_forward", RowKey, build_mhc_pre_apply_mix_forward, cases=RowKey,
                 derive=lambda x, mix, out: row_key("mhc_pre_apply_mix_forward", x.shape[2], x.shape[1]))


def mhc_pre_apply_mix_forward(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor) -> None:
    """Launches the pre-apply-mix forward on the current stream (inputs validated upstream).

    Args:
        x: ``(T, m, H)`` bf16 residual, ``T > 0``, ``H % 64 == 0``.
        mix: ``(T, m)`` f32.
        out: ``(T, H)`` bf16, written.
    """
    FORWARD.compiled(FORWARD.key(x, mix, out))(x, mix, out)


def build_mhc_pre_apply_mix_backward(hidden_size: int, hc_mult: int):
    """Builds the pre-apply-mix backward (one CTA per token).

    ``grad_x[t, i, d] = bf16(f32(grad_x[t, i, d]) + mix[t, i] * f32(grad_out[t, d]))`` (in place; the
    product is rounded before the add, as the contract writes it: nvcc would otherwise contract the two
    into one FMA, whose single rounding moves the bf16 result by an ulp of the prior content) and
    ``grad_mix[t, i] = sum_d f32(grad_out[t, d]) * f32(x[t, i, d])``: per-thread fp32 partials over the
    thread's columns (vector slots ascending), a butterfly warp reduction, then one thread sums the warp
    results in ascending warp order (deterministic).

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(grad_out (T, H) bf16, x (T, m, H) bf16, mix (T, m) f32, grad_x (T, m, H) bf16,
        grad_mix (T, m) f32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    threads, nv, guarded = dataclasses.astuple(backward_layout(H))
    nwarps = threads // 32
    nvec = H // VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_backward_cuda(
        grad_out: T.Tensor((num_tokens, H), bf16),
        x: T.Tensor((num_tokens, m, H), bf16),
        mix: T.Tensor((num_tokens, m), f32),
        grad_x: T.Tensor((num_tokens, m, H), bf16),
        grad_mix: T.Tensor((num_tokens, m), f32),
    ):
        with T.Kernel(num_tokens, threads=threads) as t:
            # two token CTAs per SM (one's reduction overlaps the other's loads), each with enough
            # registers for a whole vector's 9 loads in flight (no spill at H = 1024 .. 7168)
            T.annotate_min_blocks_per_sm(2)
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            mx = T.alloc_local((m,), f32)
            gr = T.alloc_local((VEC,), bf16)
            xr = T.alloc_local((m, VEC), bf16)
            xg = T.alloc_local((m, VEC), bf16)
            gf = T.alloc_local((VEC,), f32)
            part = T.alloc_local((m,), f32)
            red = T.alloc_shared((m, nwarps), f32)
            for i in T.unroll(m):
                mx[i] = mix[t, i]
                part[i] = 0.0
            for j in T.unroll(nv):
                if (not guarded) or (j * threads + tid < nvec):
                    for k in T.vectorized(VEC):
                        gr[k] = grad_out[t, (j * threads + tid) * VEC + k]
                    for i in T.unroll(m):
                        for k in T.vectorized(VEC):
                            xr[i, k] = x[t, i, (j * threads + tid) * VEC + k]
                        for k in T.vectorized(VEC):
                            xg[i, k] = grad_x[t, i, (j * threads + tid) * VEC + k]
                    for k in T.unroll(VEC):
                        gf[k] = T.cast(gr[k], f32)
                    for i in T.unroll(m):
                        for k in T.unroll(VEC):
                            part[i] += gf[k] * T.cast(xr[i, k], f32)
                        for k in T.vectorized(VEC):
                            grad_x[t, i, (j * threads + tid) * VEC + k] = T.cast(
                                T.cast(xg[i, k], f32) + T.ieee_mul(mx[i], gf[k]), bf16)
            for i in T.unroll(m):
                part[i] = T.warp_reduce_sum(part[i])
            if lane == 0:
                for i in T.unroll(m):
                    red[i, wid] = part[i]
            T.sync_threads()
            if tid < m:
                part[0] = red[tid, 0]
                for w in T.unroll(1, nwarps):
                    part[0] += red[tid, w]
                grad_mix[t, tid] = part[0]

    return mhc_pre_apply_mix_backward_cuda


BACKWARD = Kernel("mhc_pre_apply_mix_backward", RowKey, build_mhc_pre_apply_mix_backward, cases=RowKey,
                  derive=lambda grad_out, x: row_key("mhc_pre_apply_mix_backward", x.shape[2], x.shape[1]))


def mhc_pre_apply_mix_backward(
    grad_out: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, grad_x: torch.Tensor, grad_mix: torch.Tensor
) -> None:
    """Launches the pre-apply-mix backward on the current stream.

    Args:
        grad_out: ``(T, H)`` bf16, ``T > 0``.
        x: ``(T, m, H)`` bf16 residual.
        mix: ``(T, m)`` f32.
        grad_x: ``(T, m, H)`` bf16, accumulated in place (bf16 read-modify-write).
        grad_mix: ``(T, m)`` f32, written (the op's new output).
    """
    BACKWARD.compiled(BACKWARD.key(grad_out, x))(grad_out, x, mix, grad_x, grad_mix)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
