"""CUDA kernels of ``mhc_post_forward`` (and its out= variant) / ``mhc_post_backward`` (docs/ops/mhc.md#post).

Forward: ``out[t, o, :] = bf16(post[t, o] * x[t] + sum_i comb[t, i, o] * residual[t, i])`` on a 1-D grid over
``(token, column chunk)`` pairs, chunks fastest; a thread loads its token's ``m + m*m`` scalars once (uniform
loads). Backward: one CTA per token; ``grad_x`` and ``grad_residual`` per vector, ``grad_post`` and ``grad_comb`` as
``m + m*m`` fp32 partials per thread reduced by warp shuffles and one shared-memory step in a fixed order
(deterministic, no atomics). Where the one-token layout is unguarded with >= 2 vectors per thread, each thread
stages its next vectors by cp.async into a thread-private shared-memory ring. Every thread access is a full
8-element vector (``H`` in ``limits.MHC_HIDDEN``); the forward is generic in ``m``, the backward is for
``m = 4``.
"""

import dataclasses

import torch

from ....chips import H200
from ....limits import IntRange
from ..._kernel import Kernel, kernel_module
from ._common import VEC, RowKey, RowLayout, min_blocks, row_chunk, row_key, row_layout


@dataclasses.dataclass(frozen=True)
class PostPlan:
    """Thread bounds of the row layouts (:func:`row_layout`): the forward's ``(token, chunk)`` CTA up to
    ``forward_threads``; the backward's one-token CTA ``backward_aligned_threads`` where ``H / 8`` is a
    multiple of it, else up to ``backward_threads``; ``backward_stages``: depth of the backward's cp.async ring."""

    forward_threads: int
    backward_threads: int
    backward_aligned_threads: int
    backward_stages: int


# Forward: whole rows per CTA where that takes at most 2 vectors per thread (H = 4096: 256 x 2, 4 CTAs per SM
# at 64 registers), else one vector per thread and chunk. Backward: 128 threads where H % 1024 == 0 (4 CTAs per
# SM at ~128 registers, T = 512 in one wave), a 3-stage ring (docs/perf/h200/mhc.md, 2026-11-30, 2026-12-01).
PLAN = PostPlan(forward_threads=256, backward_threads=256, backward_aligned_threads=128, backward_stages=3)
# the backward's partials (m + m*m per thread) are laid out and validated for m = 4
BACKWARD_HC_MULT = IntRange("hc_mult", 4, 4)


def forward_layout(hidden_size: int) -> RowLayout:
    """Layout of the forward's ``(token, chunk)`` CTA (see :class:`PostPlan`)."""
    return row_layout(hidden_size, PLAN.forward_threads)


def build_mhc_post_forward(hidden_size: int, hc_mult: int):
    """Builds ``out[t, o, d] = bf16(post[t, o] * f32(x[t, d]) + sum_{i=0..m-1} comb[t, i, o] * f32(res[t, i, d]))``,
    accumulated in exactly that order (post term first, then i ascending).

    1-D grid over ``(token, column chunk)``, chunks fastest; a thread loads its token's ``m + m*m``
    scalars once (uniform loads) and, per column vector, ``1 + m`` 16-byte loads and ``m`` 16-byte stores.

    Args:
        hidden_size: ``H`` (``limits.MHC_HIDDEN``).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(x (T, H) bf16, residual (T, m, H) bf16, post_layer_mix (T, m) f32,
        comb_res_mix (T, m, m) f32, out (T, m, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    layout = forward_layout(H)
    threads, nv, guarded = layout.threads, layout.nv, layout.guarded
    # the whole row per CTA where that takes at most 2 vectors per thread (see PLAN): 2 * (1 + m) 16-byte
    # loads in flight per thread with the 20 scalars in 64 registers (no spill), 4 CTAs of 256 threads per SM
    nvc = row_chunk(nv)
    chunks = nv // nvc
    nvec = H // VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post_forward_cuda(
        x: T.Tensor((num_tokens, H), bf16),
        residual: T.Tensor((num_tokens, m, H), bf16),
        post_layer_mix: T.Tensor((num_tokens, m), f32),
        comb_res_mix: T.Tensor((num_tokens, m, m), f32),
        out: T.Tensor((num_tokens, m, H), bf16),
    ):
        # One grid dimension (up to 2**31 - 1 CTAs; y is limited to 65535), the chunks of a token adjacent.
        with T.Kernel(num_tokens * chunks, threads=threads) as bid:
            t = bid // chunks
            cb = bid % chunks
            T.annotate_min_blocks_per_sm(min_blocks(threads, 64))
            tid = T.get_thread_binding()
            pr = T.alloc_local((m,), f32)
            cr = T.alloc_local((m, m), f32)
            xr = T.alloc_local((nvc, VEC), bf16)
            rr = T.alloc_local((nvc, m, VEC), bf16)
            xf = T.alloc_local((VEC,), f32)
            acc = T.alloc_local((VEC,), f32)
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for k in T.vectorized(VEC):
                        xr[j, k] = x[t, ((cb * nvc + j) * threads + tid) * VEC + k]
                    for i in T.unroll(m):
                        for k in T.vectorized(VEC):
                            rr[j, i, k] = residual[t, i, ((cb * nvc + j) * threads + tid) * VEC + k]
            for o in T.unroll(m):
                pr[o] = post_layer_mix[t, o]
            for i in T.unroll(m):
                for o in T.unroll(m):
                    cr[i, o] = comb_res_mix[t, i, o]
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for k in T.unroll(VEC):
                        xf[k] = T.cast(xr[j, k], f32)
                    for o in T.unroll(m):
                        for k in T.unroll(VEC):
                            acc[k] = pr[o] * xf[k]
                            for i in T.unroll(m):
                                acc[k] += cr[i, o] * T.cast(rr[j, i, k], f32)
                        for k in T.vectorized(VEC):
                            out[t, o, ((cb * nvc + j) * threads + tid) * VEC + k] = T.cast(acc[k], bf16)

    return mhc_post_forward_cuda


# also the kernel of the op's out= variant (mhc_post_forward_out)
FORWARD = Kernel("mhc_post_forward", RowKey, build_mhc_post_forward, cases=RowKey,
                 derive=lambda x, residual: row_key("mhc_post_forward", residual.shape[2], residual.shape[1]))


def mhc_post_forward(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor, out: torch.Tensor
) -> None:
    """Launches the mHC post forward on the current stream (flat 3-D shapes, inputs validated upstream).

    Args:
        x: ``(T, H)`` bf16 sublayer output, ``T > 0``, ``H % 64 == 0``.
        residual: ``(T, m, H)`` bf16.
        post_layer_mix: ``(T, m)`` f32 (a ``(T, m, 1)`` view is accepted).
        comb_res_mix: ``(T, m, m)`` f32, ``comb[t, i, o]`` from input stream ``i`` to output ``o``.
        out: ``(T, m, H)`` bf16, written (the op's new output).
    """
    kernel = FORWARD.compiled(FORWARD.key(x, residual))
    kernel(x, residual, post_layer_mix.reshape(residual.shape[0], residual.shape[1]), comb_res_mix, out)


def _backward_key(x: torch.Tensor, residual: torch.Tensor) -> RowKey:
    """``H`` and ``m`` of the backward's launch; only ``m = 4`` is supported."""
    key = row_key("mhc_post_backward", residual.shape[2], residual.shape[1])
    BACKWARD_HC_MULT.require("mhc_post_backward", key.hc_mult)
    return key


def backward_layout(hidden_size: int) -> RowLayout:
    """Layout of the backward's one-token CTA: ``PLAN.backward_aligned_threads`` (128) threads where ``H / 8``
    is a multiple of it (``H % 1024 == 0``), else :func:`row_layout` up to ``PLAN.backward_threads``."""
    aligned = PLAN.backward_aligned_threads
    if (hidden_size // VEC) % aligned == 0:
        return RowLayout(aligned, hidden_size // VEC // aligned, False)
    return row_layout(hidden_size, PLAN.backward_threads)


@dataclasses.dataclass(frozen=True)
class PostBackwardSchedule:
    """The backward's schedule at one ``H``: its :class:`RowLayout` (``threads``, ``nv``, ``guarded``) and
    ``stages``: depth of the thread-private cp.async ring (``stages - 1`` vectors staged ahead), at most
    ``nv + 1`` (0: plain loads, for guarded layouts and one vector per thread); ``slots``: ring slots allocated
    (``min(stages, nv)``: with ``stages = nv + 1`` the whole row is staged up front and slot ``nv`` is never
    used); ``blocks``: resident CTAs per SM annotated on the kernel, the register budget (128 per thread) or
    what the ring's shared memory leaves, whichever is smaller.
    """

    threads: int
    nv: int
    guarded: bool
    stages: int
    slots: int
    blocks: int


def backward_schedule(hidden_size: int, hc_mult: int = 4) -> PostBackwardSchedule:
    """The :class:`PostBackwardSchedule` at ``H`` (on the H200: its SM's shared memory bounds ``blocks``)."""
    layout = backward_layout(hidden_size)
    threads, nv, guarded = layout.threads, layout.nv, layout.guarded
    stages = min(PLAN.backward_stages, nv + 1) if not guarded and nv > 1 else 0
    slots = min(stages, nv)
    blocks = min_blocks(threads, 128)
    if slots:
        ring_bytes = slots * (2 * hc_mult + 1) * threads * VEC * 2  # bf16; the reduction buffer shares it
        blocks = min(blocks, H200.arch.smem_per_sm // (ring_bytes + H200.arch.smem_reserved_per_cta))
    return PostBackwardSchedule(threads, nv, guarded, stages, slots, blocks)


def build_mhc_post_backward(hidden_size: int, hc_mult: int):
    """Builds the mHC post backward (one CTA per token).

    ``grad_x[t, d] = bf16(sum_o f32(grad_out[t, o, d]) * post[t, o])``,
    ``grad_res[t, i, d] = bf16(sum_o comb[t, i, o] * f32(grad_out[t, o, d]))`` (o ascending),
    ``grad_post[t, o] = sum_d f32(grad_out[t, o, d]) * f32(x[t, d])`` and
    ``grad_comb[t, i, o] = sum_d f32(res[t, i, d]) * f32(grad_out[t, o, d])``: ``m + m*m`` per-thread fp32
    partials, a butterfly warp reduction and an ascending-warp-order sum (deterministic).

    Args:
        hidden_size: ``H`` (``limits.MHC_HIDDEN``).
        hc_mult: ``m`` (4).

    Returns:
        ``T.prim_func(x (T, H) bf16, residual (T, m, H) bf16, post_layer_mix (T, m) f32,
        comb_res_mix (T, m, m) f32, grad_out (T, m, H) bf16, grad_x (T, H) bf16, grad_residual (T, m, H) bf16,
        grad_post (T, m) f32, grad_comb (T, m, m) f32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    schedule = backward_schedule(H, m)
    threads, nv, guarded = schedule.threads, schedule.nv, schedule.guarded
    stages, slots, blocks = schedule.stages, schedule.slots, schedule.blocks
    nwarps = threads // 32
    nred = m + m * m  # grad_post (m) then grad_comb (m*m, row-major [i, o])
    nrows = 2 * m + 1  # one vector's rows in the ring: grad_out (m), x, residual (m)
    nvec = H // VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def stage_vector(grad_out, x, residual, ring, j, slot, t, tid):
        # cp.async of this thread's vector j (grad_out, x, residual rows) into ring slot ``slot``; one group.
        for o in T.unroll(m):
            T.ptx_cp_async(T.access_ptr(ring[slot, o, tid * VEC], "w", VEC),
                           T.access_ptr(grad_out[t, o, (j * threads + tid) * VEC], "r", VEC), VEC)
        T.ptx_cp_async(T.access_ptr(ring[slot, m, tid * VEC], "w", VEC),
                       T.access_ptr(x[t, (j * threads + tid) * VEC], "r", VEC), VEC)
        for i in T.unroll(m):
            T.ptx_cp_async(T.access_ptr(ring[slot, m + 1 + i, tid * VEC], "w", VEC),
                           T.access_ptr(residual[t, i, (j * threads + tid) * VEC], "r", VEC), VEC)
        T.ptx_commit_group()

    @T.prim_func
    def mhc_post_backward_cuda(
        x: T.Tensor((num_tokens, H), bf16),
        residual: T.Tensor((num_tokens, m, H), bf16),
        post_layer_mix: T.Tensor((num_tokens, m), f32),
        comb_res_mix: T.Tensor((num_tokens, m, m), f32),
        grad_out: T.Tensor((num_tokens, m, H), bf16),
        grad_x: T.Tensor((num_tokens, H), bf16),
        grad_residual: T.Tensor((num_tokens, m, H), bf16),
        grad_post: T.Tensor((num_tokens, m), f32),
        grad_comb: T.Tensor((num_tokens, m, m), f32),
    ):
        with T.Kernel(num_tokens, threads=threads) as t:
            # Vectors processed one at a time (9 x 16-byte loads each: staged ``stages - 1``
            # vectors ahead by cp.async where the layout is unguarded with >= 2 vectors per thread, else
            # loaded directly with the next vector's loads hoisted by nvcc under __restrict__), 20 fp32
            # partials + 20 scalars per thread: <= 128 registers, 4 token CTAs of 128 threads (2-3 of
            # 160-256) per SM overlap reductions with loads.
            T.annotate_min_blocks_per_sm(blocks)
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            pr = T.alloc_local((m,), f32)
            cr = T.alloc_local((m, m), f32)
            xr = T.alloc_local((VEC,), bf16)
            rr = T.alloc_local((m, VEC), bf16)
            gr = T.alloc_local((m, VEC), bf16)
            xf = T.alloc_local((VEC,), f32)
            rf = T.alloc_local((m, VEC), f32)
            gf = T.alloc_local((m, VEC), f32)
            acc = T.alloc_local((VEC,), f32)
            part = T.alloc_local((nred,), f32)
            red = T.alloc_shared((nred, nwarps), f32)
            # thread-private cp.async ring of the next vectors (each thread reads only its own 16-byte slots)
            ring = T.alloc_shared((slots, nrows, threads * VEC), bf16) if stages else None
            for o in T.unroll(m):
                pr[o] = post_layer_mix[t, o]
            for i in T.unroll(m):
                for o in T.unroll(m):
                    cr[i, o] = comb_res_mix[t, i, o]
            for r in T.unroll(nred):
                part[r] = 0.0
            if stages:
                for j in range(stages - 1):
                    stage_vector(grad_out, x, residual, ring, j, j % stages, t, tid)
            for j in T.unroll(nv):
                if (not guarded) or (j * threads + tid < nvec):
                    if stages:
                        # vector j + stages - 1 into the slot vector j - 1 left; wait for vector j's group.
                        # __syncwarp: a compiler memory barrier (TileLang's cp.async and wait asm carry no
                        # "memory" clobber), so that no slot read moves across the issue or the wait.
                        T.call_extern("void", "__syncwarp")
                        if j + stages - 1 < nv:
                            stage_vector(grad_out, x, residual, ring, j + stages - 1, (j + stages - 1) % stages, t, tid)
                        else:
                            T.ptx_commit_group()
                        T.ptx_wait_group(stages - 1)
                        T.call_extern("void", "__syncwarp")
                        for o in T.unroll(m):
                            for k in T.vectorized(VEC):
                                gr[o, k] = ring[j % stages, o, tid * VEC + k]
                        for k in T.vectorized(VEC):
                            xr[k] = ring[j % stages, m, tid * VEC + k]
                        for i in T.unroll(m):
                            for k in T.vectorized(VEC):
                                rr[i, k] = ring[j % stages, m + 1 + i, tid * VEC + k]
                    else:
                        for o in T.unroll(m):
                            for k in T.vectorized(VEC):
                                gr[o, k] = grad_out[t, o, (j * threads + tid) * VEC + k]
                        for k in T.vectorized(VEC):
                            xr[k] = x[t, (j * threads + tid) * VEC + k]
                        for i in T.unroll(m):
                            for k in T.vectorized(VEC):
                                rr[i, k] = residual[t, i, (j * threads + tid) * VEC + k]
                    for o in T.unroll(m):
                        for k in T.unroll(VEC):
                            gf[o, k] = T.cast(gr[o, k], f32)
                    for k in T.unroll(VEC):
                        xf[k] = T.cast(xr[k], f32)
                    for i in T.unroll(m):
                        for k in T.unroll(VEC):
                            rf[i, k] = T.cast(rr[i, k], f32)
                    # grad_x = sum_o grad_out[o] * post[o]
                    for k in T.unroll(VEC):
                        acc[k] = gf[0, k] * pr[0]
                        for o in T.unroll(1, m):
                            acc[k] += gf[o, k] * pr[o]
                    for k in T.vectorized(VEC):
                        grad_x[t, (j * threads + tid) * VEC + k] = T.cast(acc[k], bf16)
                    # grad_residual[i] = sum_o comb[i, o] * grad_out[o]
                    for i in T.unroll(m):
                        for k in T.unroll(VEC):
                            acc[k] = cr[i, 0] * gf[0, k]
                            for o in T.unroll(1, m):
                                acc[k] += cr[i, o] * gf[o, k]
                        for k in T.vectorized(VEC):
                            grad_residual[t, i, (j * threads + tid) * VEC + k] = T.cast(acc[k], bf16)
                    # partials of grad_post[o] and grad_comb[i, o]
                    for o in T.unroll(m):
                        for k in T.unroll(VEC):
                            part[o] += gf[o, k] * xf[k]
                    for i in T.unroll(m):
                        for o in T.unroll(m):
                            for k in T.unroll(VEC):
                                part[m + i * m + o] += rf[i, k] * gf[o, k]
            for r in T.unroll(nred):
                part[r] = T.warp_reduce_sum(part[r])
            if stages:
                # TileLang places ``red`` over the ring (their lifetimes do not overlap within a thread):
                # every warp must be done with its ring slots before any warp writes ``red``
                T.sync_threads()
            if lane == 0:
                for r in T.unroll(nred):
                    red[r, wid] = part[r]
            T.sync_threads()
            if tid < nred:
                part[0] = red[tid, 0]
                for w in T.unroll(1, nwarps):
                    part[0] += red[tid, w]
                if tid < m:
                    grad_post[t, tid] = part[0]
                else:
                    grad_comb[t, (tid - m) // m, (tid - m) % m] = part[0]

    return mhc_post_backward_cuda


BACKWARD = Kernel("mhc_post_backward", RowKey, build_mhc_post_backward, cases=RowKey, derive=_backward_key)


def mhc_post_backward(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    grad_out: torch.Tensor,
    grad_x: torch.Tensor,
    grad_residual: torch.Tensor,
    grad_post: torch.Tensor,
    grad_comb: torch.Tensor,
) -> None:
    """Launches the mHC post backward on the current stream (flat 3-D shapes, ``m = 4``).

    Args:
        x: ``(T, H)`` bf16, ``T > 0``.
        residual: ``(T, m, H)`` bf16.
        post_layer_mix: ``(T, m)`` f32 (``(T, m, 1)`` accepted).
        comb_res_mix: ``(T, m, m)`` f32.
        grad_out: ``(T, m, H)`` bf16.
        grad_x: ``(T, H)`` bf16, written.
        grad_residual: ``(T, m, H)`` bf16, written.
        grad_post: ``(T, m)`` f32 (``(T, m, 1)`` accepted), written.
        grad_comb: ``(T, m, m)`` f32, written.
    """
    kernel = BACKWARD.compiled(BACKWARD.key(x, residual))
    n, m = residual.shape[0], residual.shape[1]
    kernel(x, residual, post_layer_mix.reshape(n, m), comb_res_mix, grad_out, grad_x, grad_residual,
           grad_post.view(n, m), grad_comb)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
