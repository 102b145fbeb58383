"""CUDA kernel of ``mhc_pre_big_fuse`` (docs/ops/mhc.md#pre_big_fuse): reduce + RMSNorm (``G = 1``, ``Rg = m*H``),
split mixes, Sinkhorn and pre apply mix in one launch, bitwise equal to the four unfused CUDA kernels. Every value
goes through the fp32 operations of the kernel it replaces, in the same order:

* ``mhc_reduce_partials_and_rmsnorm_fwd_cuda``: ``om = ((p_0 + p_1) + ...) + p_{S-1}`` and ``sq`` likewise
  (ascending ``s``), ``r = rsqrtf(sq / Rg + rms_eps)`` (IEEE division by the runtime scalar ``Rg``), ``om * r``;
* ``mhc_pre_split_mixes_fwd_cuda``: ``z = __fmul_rn(mix, scale) + base``, ``sigmoid(z) = 1 / (1 + expf(0 - z))``
  (IEEE), ``pre = sigmoid + pre_eps``, ``post = sigmoid * post_mult_value``, comb logits ``z``;
* ``mhc_sinkhorn_fwd_cuda``: its own macros (:func:`._sinkhorn.sinkhorn_macros`: one matrix element per lane,
  pairwise butterfly sums), the same step order and IEEE divisions;
* ``mhc_pre_apply_mix_forward_cuda``: ``acc = pre_0 * x_0``, then ``acc = acc + pre_i * x_i`` (i ascending, the
  same expression, which nvcc contracts the same way), one round-to-nearest-even cast to bf16 at the store.

Schedule: a 1-D grid of ``ceil(T / TB) * chunks`` CTAs over ``(token group, column chunk)`` pairs, chunks fastest
(``TB = plan.tokens``; the chunks of the pre-apply-mix forward's row layout: 4 x 128 threads of one 16-byte vector
per stream at H = 4096, 7 x 128 at 7168, 1 x 160 at 1280). A CTA has its streaming threads and one mix warp:

* mix warp: ``pre`` of the group's tokens (lane ``p``: token ``p // m``, pre mix ``p % m``; all ``2S`` partials
  in flight) into shared memory, one barrier, then the group's Sinkhorn passes with their ``post`` (two tokens of
  16 lanes at m = 4), shared out over the group's chunk CTAs (one each at H = 4096, 4 of 7 CTAs at 7168);
* streaming threads: a thread-private cp.async ring of ``plan.stages`` items (one 16-byte vector of each stream
  of one token), ``stages - 1`` issued before the barrier so that they cover the pre chain, then per item the
  apply-mix arithmetic and one 16-byte bf16 store, beside the Sinkhorn chain.

No CTA waits on another. ``residual`` is read (cp.async) and ``layer_input`` written in 16-byte vectors (``H`` in
``limits.MHC_HIDDEN``; guarded last vector slots where ``H / 8`` has no multiple-of-32 divisor), the rest by scalar
accesses. The launcher takes validated, contiguous tensors and ``T > 0``.
"""

import dataclasses

import torch

from ....limits import MHC_HC_MULT, MHC_HIDDEN, MHC_SINKHORN_REPEAT, LimitError, mhc_gemm_splits
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import VEC, RowLayout, min_blocks, row_chunk, row_layout
from ._sinkhorn import sinkhorn_layout, sinkhorn_macros


OP = "mhc_pre_big_fuse"


@dataclasses.dataclass(frozen=True)
class BigFusePlan:
    """Streaming threads of a CTA: the row layout (:func:`row_layout`) of up to ``stream_threads``, or of up to
    ``stream_fallback_threads`` where that gives fewer than ``stream_threads``; a CTA takes ``tokens`` tokens
    (``tokens * m <= 32``) of one column chunk; ``stages``: depth of the streaming threads' cp.async ring;
    ``split_batch``: split partials a lane loads before adding them (all of them up to this many splits, else
    batches of this many); ``regs``: register budget per thread behind the occupancy hint; ``sinkhorn_warps``: 0,
    the mix warp runs the Sinkhorn passes after its pre phase, else up to this many warps of their own run them
    from the start (the pre warp and the streaming threads then meet at a named barrier)."""

    stream_threads: int
    stream_fallback_threads: int
    tokens: int
    stages: int
    split_batch: int
    regs: int
    sinkhorn_warps: int = 0


# 8 tokens x 1 vector per streaming thread and CTA, a 4-deep ring (6 CTAs of 192 threads per SM at 64 registers),
# a Sinkhorn warp of its own from the start (its passes off the pre phase's critical path).
# Wide rows: 4 chunk CTAs of 224 threads per token group instead of 7 of 128 at H = 7168 (each chunk CTA redoes
# the group's split reduction), 8 split partials per load, a 3-deep ring, 48 registers. H200 figures and the
# variants not adopted: docs/perf/h200/mhc.md, 2026-12-02 entries.
PLAN = BigFusePlan(stream_threads=128, stream_fallback_threads=256, tokens=8, stages=4, split_batch=16, regs=64,
                   sinkhorn_warps=1)
WIDE_PLAN = dataclasses.replace(PLAN, stream_threads=192, stages=3, split_batch=8, regs=48)
WIDE_FROM = 6144  # hidden sizes from which WIDE_PLAN is used (measured at 4096 and 7168)


def plan_for(hidden_size: int) -> BigFusePlan:
    """The schedule at ``hidden_size``: :data:`PLAN`, or :data:`WIDE_PLAN` from ``WIDE_FROM`` columns."""
    return WIDE_PLAN if hidden_size >= WIDE_FROM else PLAN


def _sinkhorn_warps(hidden_size: int, hc_mult: int, plan: BigFusePlan) -> int:
    """Sinkhorn warps of a CTA besides its mix warp (0: the mix warp runs the passes after its pre phase): up to
    ``plan.sinkhorn_warps``, no more than the passes a CTA gets once the group's are shared out over its chunks."""
    if not plan.sinkhorn_warps:
        return 0
    layout = stream_layout(hidden_size, plan)
    chunks = layout.nv // row_chunk(layout.nv)
    passes = -(-plan.tokens // (32 // (hc_mult * hc_mult)))
    return max(1, min(plan.sinkhorn_warps, -(-passes // chunks)))


def _check(hidden_size: int, hc_mult: int, n_splits: int, repeat: int, plan: BigFusePlan) -> None:
    MHC_HIDDEN.require(OP, hidden_size)
    MHC_HC_MULT.require(OP, hc_mult)
    if hc_mult < 2 or hc_mult & (hc_mult - 1) or hc_mult * hc_mult > 32 or plan.tokens * hc_mult > 32:
        raise LimitError(f"{OP}: the CUDA kernel needs a power-of-two hc_mult in [2, 4] (and tokens * hc_mult <= 32),"
                         f" got {hc_mult}")
    mhc_gemm_splits(hc_mult * hidden_size).require(OP, n_splits)
    MHC_SINKHORN_REPEAT["cuda"].require(OP, repeat)


def stream_layout(hidden_size: int, plan: BigFusePlan | None = None) -> RowLayout:
    """Row layout of a CTA's streaming threads (see :class:`BigFusePlan`; ``plan_for(hidden_size)`` by default)."""
    plan = plan or plan_for(hidden_size)
    layout = row_layout(hidden_size, plan.stream_threads)
    return layout if layout.threads >= plan.stream_threads else row_layout(hidden_size, plan.stream_fallback_threads)


def grid_layout(hidden_size: int, plan: BigFusePlan | None = None, hc_mult: int = 4) -> tuple[int, int, int]:
    """``(threads, tokens, chunks)``: threads per CTA (the streaming threads, the pre warp and the Sinkhorn warps),
    tokens per CTA and column chunks per row; the grid is ``ceil(T / tokens) * chunks`` CTAs."""
    plan = plan or plan_for(hidden_size)
    layout = stream_layout(hidden_size, plan)
    return (layout.threads + 32 * (1 + _sinkhorn_warps(hidden_size, hc_mult, plan)), plan.tokens,
            layout.nv // row_chunk(layout.nv))


@compile_key
class BigFuseKey:
    """Compile-time key: ``S`` splits, ``H``, ``m`` and the Sinkhorn repeat count ``R`` (never the token count)."""

    n_splits: int
    hidden_size: int
    hc_mult: int
    repeat: int


def _key(gemm_out_mul: torch.Tensor, residual: torch.Tensor, sinkhorn_repeat: int, n_splits: int) -> BigFuseKey:
    """``LimitError`` unless ``S == n_splits``, ``M3 = m*(m+2)`` and every size is in its ``limits`` range."""
    splits, _, mult3 = (int(s) for s in gemm_out_mul.shape)
    _, hc_mult, hidden_size = (int(s) for s in residual.shape)
    if splits != int(n_splits):
        raise LimitError(f"{OP}: gemm_out_mul has {splits} splits but n_splits={n_splits}")
    if mult3 != hc_mult * (hc_mult + 2):
        raise LimitError(f"{OP}: gemm_out_mul has {mult3} mixes, expected m*(m+2) = {hc_mult * (hc_mult + 2)}")
    _check(hidden_size, hc_mult, splits, int(sinkhorn_repeat), plan_for(hidden_size))
    return BigFuseKey(splits, hidden_size, hc_mult, int(sinkhorn_repeat))


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """16 splits with ``R`` in {10, 20}, one split with ``R = 20`` and the most splits ``m*H/64`` with ``R = 1``."""
    most = mhc_gemm_splits(hc_mult * hidden_size).high
    return {f"{OP}_s{s}_r{r}": BigFuseKey(s, hidden_size, hc_mult, r)
            for s, r in ((16, 10), (16, 20), (1, 20), (most, 1))}


def build_mhc_pre_big_fuse(n_splits: int, hidden_size: int, hc_mult: int, repeat: int,
                           plan: BigFusePlan | None = None):
    """Builds the fused pre-stage forward prim_func (see the module docstring for the schedule and arithmetic).

    Args:
        n_splits: ``S`` in ``[1, m*H/64]``.
        hidden_size: ``H`` in ``limits.MHC_HIDDEN``.
        hc_mult: ``m`` (a power of two, ``m*m <= 32``).
        repeat: Sinkhorn ``R`` in ``limits.MHC_SINKHORN_REPEAT["cuda"]`` (compile-time).
        plan: the schedule's :class:`BigFusePlan` (``plan_for(hidden_size)`` by default).

    Returns:
        ``T.prim_func(gemm_out_mul (S, T, M3) f32, gemm_out_sqrsum (S, T) f32, mhc_scale (3,) f32, mhc_base (M3,)
        f32, residual (T, m, H) bf16, post_mix (T, m) f32, comb_mix (T, m*m) f32, layer_input (T, H) bf16,
        rms_group_size: f32, rms_eps: f32, pre_eps: f32, sinkhorn_eps: f32, post_mult_value: f32)``; ``T`` is
        dynamic.
    """
    plan = plan or plan_for(hidden_size)
    _check(hidden_size, hc_mult, n_splits, repeat, plan)
    from tilelang import language as T

    S, H, m, R = n_splits, hidden_size, hc_mult, repeat
    M3, M2 = m * (m + 2), m * m
    layout = stream_layout(H, plan)
    ts, nv, guarded = layout.threads, layout.nv, layout.guarded  # streaming threads
    nvc = row_chunk(nv)  # vectors per streaming thread and token in one CTA
    chunks = nv // nvc
    nvec = H // VEC
    SW = _sinkhorn_warps(H, m, plan)
    S0, SWm = (1, SW) if SW else (0, 1)  # the Sinkhorn warps' first warp after the pre warp, and their count
    threads, TB, D = ts + 32 * (1 + SW), plan.tokens, plan.stages
    NI = TB * nvc  # items (token, vector) per streaming thread, token-major
    k, N = sinkhorn_layout(m)  # k = 1: one comb element per lane, N = m*m lanes per token
    PT = 32 // N  # tokens per Sinkhorn pass of the mix warp
    passes = -(-TB // PT)
    SB = min(S, plan.split_batch)
    full, rem = divmod(S - SB, SB)  # further whole batches and the last partial one
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")
    softmax_eps, row_sum, col_sum, _ = sinkhorn_macros(T, m)

    @T.macro
    def split_sum(acc, q, gemm_out_mul, gemm_out_sqrsum, t, use_mul, col):
        # acc[0] = ((v_0 + v_1) + ...) + v_{S-1} with v_s = gemm_out_mul[s, t, col] where use_mul, else
        # gemm_out_sqrsum[s, t] (the reduce kernel's order: from v_0, s ascending); SB loads in flight.
        for j in T.unroll(SB):
            q[j] = T.if_then_else(use_mul, gemm_out_mul[j, t, col], gemm_out_sqrsum[j, t])
        acc[0] = q[0]
        for j in T.unroll(1, SB):
            acc[0] = acc[0] + q[j]
        if full > 0:
            for b in T.serial(full):
                for j in T.unroll(SB):
                    q[j] = T.if_then_else(use_mul, gemm_out_mul[SB + b * SB + j, t, col],
                                          gemm_out_sqrsum[SB + b * SB + j, t])
                for j in T.unroll(SB):
                    acc[0] = acc[0] + q[j]
        if rem > 0:
            for j in T.unroll(rem):
                q[j] = T.if_then_else(use_mul, gemm_out_mul[SB + full * SB + j, t, col],
                                      gemm_out_sqrsum[SB + full * SB + j, t])
            for j in T.unroll(rem):
                acc[0] = acc[0] + q[j]

    @T.macro
    def stage(residual, ring, g, cb, it, tid):
        # cp.async of item `it` (token it // nvc of the CTA, vector it % nvc of its chunk) into ring slot it % D;
        # one commit group per item, empty past the last token or the row.
        if (g * TB + it // nvc < num_tokens) and (
                (not guarded) or ((cb * nvc + it % nvc) * ts + tid < nvec)):
            for i in T.unroll(m):
                T.ptx_cp_async(
                    T.access_ptr(ring[it % D, i, tid * VEC], "w", VEC),
                    T.access_ptr(residual[g * TB + it // nvc, i, ((cb * nvc + it % nvc) * ts + tid) * VEC], "r",
                                 VEC),
                    VEC)
        T.ptx_commit_group()

    @T.prim_func
    def mhc_pre_big_fuse_cuda(
        gemm_out_mul: T.Tensor((S, num_tokens, M3), f32),
        gemm_out_sqrsum: T.Tensor((S, num_tokens), f32),
        mhc_scale: T.Tensor((3,), f32),
        mhc_base: T.Tensor((M3,), f32),
        residual: T.Tensor((num_tokens, m, H), bf16),
        post_mix: T.Tensor((num_tokens, m), f32),
        comb_mix: T.Tensor((num_tokens, M2), f32),
        layer_input: T.Tensor((num_tokens, H), bf16),
        rms_group_size: f32,
        rms_eps: f32,
        pre_eps: f32,
        sinkhorn_eps: f32,
        post_mult_value: f32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB) * chunks, threads=threads) as bid:
            T.annotate_min_blocks_per_sm(min_blocks(threads, plan.regs))
            tid = T.get_thread_binding()
            g = bid // chunks  # token group: tokens g*TB .. g*TB + TB - 1
            cb = bid % chunks  # column chunk
            lane = tid % 32
            mx_s = T.alloc_shared((TB, m), f32)
            ring = T.alloc_shared((D, m, ts * VEC), bf16)  # thread-private slots of the streaming threads
            q = T.alloc_local((SB,), f32)
            qc = T.alloc_local((SB,), f32)
            acc = T.alloc_local((1,), f32)
            accc = T.alloc_local((1,), f32)
            sc = T.alloc_local((2,), f32)  # sq, r
            se = T.alloc_local((1,), f32)  # sinkhorn_eps
            y = T.alloc_local((k,), f32)
            s = T.alloc_local((k,), f32)
            mx = T.alloc_local((m,), f32)
            xr = T.alloc_local((m, VEC), bf16)
            ob = T.alloc_local((VEC,), f32)
            if (tid >= ts) and (tid < ts + 32):
                # Pre warp: pre of the CTA's tokens, lane p: token p // m, pre mix p % m.
                if (lane < TB * m) and (g * TB + lane // m < num_tokens):
                    split_sum(acc, q, gemm_out_mul, gemm_out_sqrsum, g * TB + lane // m, True, lane % m)
                    split_sum(accc, qc, gemm_out_mul, gemm_out_sqrsum, g * TB + lane // m, False, 0)
                    sc[1] = T.rsqrt(accc[0] / rms_group_size + rms_eps)
                    mx_s[lane // m, lane % m] = T.sigmoid(
                        T.ieee_mul(acc[0] * sc[1], mhc_scale[0]) + mhc_base[lane % m]) + pre_eps
            elif tid < ts:
                # Streaming threads: the ring's prologue (always D - 1 groups, empty ones past the last item).
                for it in T.unroll(D - 1):
                    if it < NI:
                        stage(residual, ring, g, cb, it, tid)
                    else:
                        T.ptx_commit_group()
            if SW:
                # the pre warp and the streaming threads only: the Sinkhorn warps start at once
                if tid < ts + 32:
                    T.sync_threads(1, ts + 32)
            else:
                T.sync_threads()
            if tid >= ts + 32 * S0:
                # Sinkhorn passes of PT tokens each (lane e of token tk holds comb element e, row e // m, column
                # e % m), the CTA's passes shared out over its chunks' CTAs and their Sinkhorn warps.
                tk = lane // N
                e = lane % N
                w = (tid - ts) // 32 - S0  # Sinkhorn warp
                nw = SWm * chunks  # Sinkhorn warps over the chunks of a token group
                se[0] = sinkhorn_eps  # (the macros get a register: a parameter passed in would be renamed `eps`)
                for pq in T.serial(T.ceildiv(passes - (cb * SWm + w), nw)):
                    t = g * TB + (cb * SWm + w + pq * nw) * PT + tk
                    ok = ((cb * SWm + w + pq * nw) * PT + tk < TB) and (t < num_tokens)
                    y[0] = 0.0
                    acc[0] = 0.0
                    if ok:
                        # comb mix 2m + e; post mix m + e on lanes e < m, the squared sum on the others
                        split_sum(accc, qc, gemm_out_mul, gemm_out_sqrsum, t, True, 2 * m + e)
                        split_sum(acc, q, gemm_out_mul, gemm_out_sqrsum, t, e < m, m + e % m)
                    sc[0] = T.shfl_sync(acc[0], lane - e + m)
                    if ok:
                        sc[1] = T.rsqrt(sc[0] / rms_group_size + rms_eps)
                        y[0] = T.ieee_mul(accc[0] * sc[1], mhc_scale[2]) + mhc_base[2 * m + e]
                        if e < m:
                            post_mix[t, e] = T.sigmoid(
                                T.ieee_mul(acc[0] * sc[1], mhc_scale[1]) + mhc_base[m + e]) * post_mult_value
                    # mhc_sinkhorn_fwd_cuda: softmax + eps, a column step, then R - 1 (row step, column step) pairs
                    softmax_eps(y, s, y, se[0])
                    col_sum(y, s)
                    for c in T.unroll(k):
                        y[c] = T.ieee_fdiv(y[c], s[c] + se[0])
                    if R > 1:
                        for _r in T.serial(R - 1):
                            row_sum(y, s)
                            for c in T.unroll(k):
                                y[c] = T.ieee_fdiv(y[c], s[0] + se[0])
                            col_sum(y, s)
                            for c in T.unroll(k):
                                y[c] = T.ieee_fdiv(y[c], s[c] + se[0])
                    if ok:
                        comb_mix[t, e] = y[0]
            elif tid < ts:
                # Streaming threads: item it waits for its group (D - 1 younger ones may stay in flight), then
                # mhc_pre_apply_mix_forward_cuda's accumulation and bf16 store. __syncwarp: a compiler memory
                # barrier (TileLang's cp.async and wait asm carry no "memory" clobber) around the slot reads.
                for it in T.unroll(NI):
                    T.call_extern("void", "__syncwarp")
                    if it + D - 1 < NI:
                        stage(residual, ring, g, cb, it + D - 1, tid)
                    else:
                        T.ptx_commit_group()
                    T.ptx_wait_group(D - 1)
                    T.call_extern("void", "__syncwarp")
                    if (g * TB + it // nvc < num_tokens) and (
                            (not guarded) or ((cb * nvc + it % nvc) * ts + tid < nvec)):
                        for i in T.unroll(m):
                            for kk in T.vectorized(VEC):
                                xr[i, kk] = ring[it % D, i, tid * VEC + kk]
                        for i in T.unroll(m):
                            mx[i] = mx_s[it // nvc, i]
                        for kk in T.unroll(VEC):
                            ob[kk] = mx[0] * T.cast(xr[0, kk], f32)
                            for i in T.unroll(1, m):
                                ob[kk] += mx[i] * T.cast(xr[i, kk], f32)
                        for kk in T.vectorized(VEC):
                            layer_input[g * TB + it // nvc, ((cb * nvc + it % nvc) * ts + tid) * VEC + kk] = T.cast(
                                ob[kk], bf16)

    return mhc_pre_big_fuse_cuda


KERNEL = Kernel(OP, BigFuseKey, build_mhc_pre_big_fuse, derive=_key, cases=_cases)


def mhc_pre_big_fuse(
    gemm_out_mul: torch.Tensor,
    gemm_out_sqrsum: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    residual: torch.Tensor,
    post_mix: torch.Tensor,
    comb_mix: torch.Tensor,
    layer_input: torch.Tensor,
    rms_eps: float,
    pre_eps: float,
    sinkhorn_eps: float,
    post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int,
) -> None:
    """Launches the fused pre stage on the current stream (inputs validated upstream, contiguous, ``T > 0``).

    Writes ``post_mix``, ``comb_mix`` and ``layer_input`` bitwise equal to
    ``mhc_reduce_partials_and_rmsnorm_forward`` (``G = 1``, ``rms_group_size = m*H``) →
    ``mhc_pre_split_mixes_forward`` → ``mhc_sinkhorn_forward`` → ``mhc_pre_apply_mix_forward`` on the same inputs.

    Args:
        gemm_out_mul: ``(S, T, M3)`` f32 split partials of the pre-norm GEMM.
        gemm_out_sqrsum: ``(S, T)`` f32 split partial sums of squares.
        mhc_scale: ``(3,)`` f32.
        mhc_base: ``(M3,)`` f32.
        residual: ``(T, m, H)`` bf16 (16-byte aligned: read in 16-byte vectors).
        post_mix: ``(T, m)`` f32, written.
        comb_mix: ``(T, m*m)`` f32, written (after Sinkhorn).
        layer_input: ``(T, H)`` bf16, written (16-byte aligned: 16-byte vector stores).
        rms_eps, pre_eps, sinkhorn_eps, post_mult_value: runtime fp32 scalars.
        sinkhorn_repeat: ``R`` (compile-time).
        n_splits: ``S`` (must equal ``gemm_out_mul.shape[0]``).
    """
    kernel = KERNEL.compiled(KERNEL.key(gemm_out_mul, residual, sinkhorn_repeat, n_splits))
    num_tokens, hc_mult, hidden_size = residual.shape
    kernel(
        gemm_out_mul,
        gemm_out_sqrsum,
        mhc_scale,
        mhc_base,
        residual,
        post_mix,
        comb_mix.view(num_tokens, hc_mult * hc_mult),
        layer_input,
        float(hc_mult * hidden_size),
        float(rms_eps),
        float(pre_eps),
        float(sinkhorn_eps),
        float(post_mult_value),
    )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
