"""CUDA kernel of ``engram_gate_forward`` and ``engram_gate_forward_inplace`` (docs/ops/engram.md#gate).

Schedule: one CTA per token; the CTA holds ``m`` groups of ``32 * wps`` threads, group ``h`` serving
stream ``h``. Each thread owns ``nv`` 8-element column vectors per summation group it serves (see
:func:`fwd_layout`). Pass 1 loads the thread's ``x`` vectors into registers (kept for pass 2) and its
``k`` vectors, and accumulates ``Sx``, ``Sk`` and ``raw`` per summation group; a warp shuffle reduction
per group plus a step that adds the groups in ascending order gives the per-stream sums (through shared
memory and a barrier where several warps serve a stream, in registers where one warp does; every thread
of the stream adds the same values in the same order, so they are bitwise equal).
Pass 2 streams ``v`` and writes ``out = bf16(x + g * v)`` from the registers, so ``x`` and ``kv`` are
read from HBM exactly once (``residual=False``: ``v`` is loaded into those registers before pass 1, which
streams ``x``, and pass 2 writes ``out = bf16(g * v)``, masked tokens 0). The kernel always
writes the statistics ``dot, gate_score, rstd_x, rstd_k``;
without ``save_for_backward`` the launcher points them at a scratch buffer (64 bytes per token, see
:func:`engram_gate_forward`). The token count is a dynamic dimension."""

import dataclasses

import torch

from .....limits import ENGRAM_HC_MULT, ENGRAM_HIDDEN, LimitError
from ...._kernel import Kernel, public_names
from ._keys import FwdKey, forward_cases

@dataclasses.dataclass(frozen=True)
class FwdPlan:
    """Tuning of the forward's thread layout (:func:`fwd_layout`): ``vec`` bf16 elements per 16-byte access; at
    most ``max_groups`` summation groups per stream and ``max_vectors`` column vectors per group lane; one warp
    per stream where a row takes at most ``warp_local_vectors`` vectors per thread unguarded, with
    ``warp_local_sm_threads / (32 m)`` (at most ``warp_local_blocks``) CTAs per SM; else ``min_blocks`` CTAs per
    SM (fewer where they would exceed ``sm_threads``)."""

    vec: int
    max_groups: int
    max_vectors: int
    warp_local_vectors: int
    warp_local_sm_threads: int
    warp_local_blocks: int
    min_blocks: int
    sm_threads: int


# Chosen on the H200 (see fwd_layout): docs/perf/h200/engram.md, 2026-11-30 and 2026-12-01.
FWD_PLAN = FwdPlan(vec=8, max_groups=4, max_vectors=8, warp_local_vectors=16, warp_local_sm_threads=512,
                   warp_local_blocks=4, min_blocks=2, sm_threads=1024)


@dataclasses.dataclass(frozen=True)
class FwdLayout:
    """The forward's thread layout at ``(H, m)``: ``warps_per_stream`` warps serve a stream's
    ``groups_per_stream`` summation groups of 32 lanes, each lane owning ``vectors`` column vectors per group;
    ``guarded``: the last vector slot can fall outside ``H``; ``min_blocks``: resident CTAs per SM the register
    budget is sized for."""

    warps_per_stream: int
    groups_per_stream: int
    vectors: int
    guarded: bool
    min_blocks: int


def fwd_layout(hidden_size: int, hc_mult: int, residual: bool = True, plan: FwdPlan = FWD_PLAN) -> FwdLayout:
    """Thread layout (:class:`FwdLayout`: ``wps, gps, nv, guarded, min_blocks`` below) of the forward kernel
    (``residual``: the mode).

    A stream's three sums are formed in ``gps`` summation groups of 32 lanes (group ``w``, lane ``l``
    owns the column vectors ``i * 32 * gps + 32 * w + l``, ``i < nv``), each reduced by a warp butterfly,
    then added in ascending ``w``. ``wps`` warps serve one stream, each warp taking ``gps / wps``
    consecutive groups, so the sums (and every output bit) do not depend on ``wps``. ``guarded`` says
    whether the last vector slot can fall outside ``H``; ``min_blocks`` is the number of resident CTAs
    per SM the register budget is sized for.

    Chosen on the H200: up to 8 vectors per group lane and up to 4 one-warp groups per stream (512 threads at
    m = 4, two CTAs per SM) for H > 4096 and guarded rows; at ``H <= 4096`` without a guarded slot one warp
    serves all groups of a stream (up to 16 vectors per thread, 128 registers, four 128-thread CTAs per SM):
    its lanes hold the group sums after the butterflies, so there is no shared-memory step and no barrier
    (docs/perf/h200/engram.md, 2026-11-30 — gate forward: thread layout and CTAs per SM; 2026-12-01 — gate
    forward: one warp per stream at H <= 4096). Without the residual the several-warp layout takes half
    as many warps per stream at 128 registers: at 64 ptxas spilled that kernel in every schedule tried
    (docs/perf/h100/engram.md, 2026-12-05 (later) — gate forward without the residual: thread layout).
    """
    n32 = hidden_size // (32 * plan.vec)
    max_gps = max(1, min(plan.max_groups, 32 // hc_mult))
    groups = [g for g in (4, 2, 1) if g <= plan.max_groups]
    gps = next((g for g in groups if g <= max_gps and n32 % g == 0 and n32 // g <= plan.max_vectors), max_gps)
    nv = -(-n32 // gps)
    guarded = nv * gps != n32
    if n32 <= plan.warp_local_vectors and not guarded:  # <= 128 registers per thread
        return FwdLayout(1, gps, nv, False, max(1, min(plan.warp_local_blocks,
                                                       plan.warp_local_sm_threads // (32 * hc_mult))))
    wps = gps if residual else max(1, gps // 2)
    return FwdLayout(wps, gps, nv, guarded, max(1, min(plan.min_blocks, plan.sm_threads // (hc_mult * 32 * gps))))


def _key(hidden_states: torch.Tensor, out: torch.Tensor, image_token_mask: torch.Tensor | None,
         residual: bool = True) -> FwdKey:
    _, hc_mult, hidden_size = hidden_states.shape
    inplace = out.data_ptr() == hidden_states.data_ptr()
    return FwdKey(int(hidden_size), int(hc_mult), image_token_mask is not None, bool(inplace), bool(residual))


def build_engram_gate_forward(hidden_size: int, hc_mult: int, has_mask: bool, inplace: bool, residual: bool = True):
    """Builds the forward prim_func.

    Args:
        hidden_size: ``H`` in ``limits.ENGRAM_HIDDEN`` (else ``limits.LimitError``).
        hc_mult: ``m`` in ``limits.ENGRAM_HC_MULT`` (else ``limits.LimitError``).
        has_mask: Take an ``image_token_mask`` ``(T,)`` bool.
        inplace: Write the output into ``hidden_states`` (no ``out`` parameter).
        residual: Write ``x + g * v`` (else ``g * v`` alone, masked tokens 0; not with ``inplace``). The
            choice only moves the add in pass 2 and the masked store, so ``residual=True`` builds the
            same kernel as before the flag existed.

    Returns:
        ``T.prim_func(x, kv, wf, [mask], eps: f32, clamp: f32, [out], dot, gate, rstd_x, rstd_k)`` with
        ``x (T, m, H) bf16``, ``kv (T, m+1, H) bf16``, ``wf (m, H) f32``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H = ENGRAM_HIDDEN.require("engram_gate_forward", hidden_size)
    m = ENGRAM_HC_MULT.require("engram_gate_forward", hc_mult)
    if inplace and not residual:
        raise LimitError("engram_gate_forward: no in-place kernel without the residual (hidden_states would be lost)")
    layout, vec = fwd_layout(H, m, residual), FWD_PLAN.vec
    wps, gps, nv, guarded, min_blocks = (layout.warps_per_stream, layout.groups_per_stream, layout.vectors,
                                         layout.guarded, layout.min_blocks)
    q = gps // wps  # summation groups per warp
    warp_local = wps == 1  # one warp per stream: no shared-memory step, no barrier
    tps = 32 * wps  # threads per stream
    gw = 32 * gps  # column vectors per step i (all groups of a stream)
    threads = m * tps
    nvec = H // vec
    scale = float(H**-0.5)  # host double, used as an fp32 immediate
    inv_hidden = float(H)
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def body(x, kv, wf, mask, eps, clamp, out, dot, gate, rstd_x, rstd_k):
        with T.Kernel(num_tokens, threads=threads) as t:
            # Two CTAs (tokens) per SM with several warps per stream overlap one token's reduction and
            # barrier with the other's loads (64 registers per thread; the one-warp-per-stream layout: four
            # CTAs at 128): docs/perf/h200/engram.md, 2026-11-30 — gate forward: thread layout and CTAs per SM.
            T.annotate_min_blocks_per_sm(min_blocks)
            tid = T.get_thread_binding()
            h = tid // tps
            lt = tid % tps
            lane = tid % 32
            g0 = (lt // 32) * q  # this warp's first summation group
            xr = T.alloc_local((nv, q, vec), bf16)  # x (v without the residual), kept for pass 2
            xs = T.alloc_local((vec,), bf16)  # x streamed, without the residual
            kf = T.alloc_local((vec,), f32)
            wr = T.alloc_local((vec,), f32)
            vr = T.alloc_local((vec,), f32)
            part = T.alloc_local((q, 3), f32)
            st = T.alloc_local((4,), f32)  # raw, rstd_x, rstd_k, gate
            red = None if warp_local else T.alloc_shared((3, m * gps), f32)
            live = T.alloc_var(T.bool)

            live = True
            if has_mask:
                live = not mask[t]
            for u in T.unroll(q):
                for j in T.unroll(3):
                    part[u, j] = 0.0
            # Pass 1: x into registers (kept), k streamed, three fp32 sums per summation group. Without the
            # residual v goes into those registers first (its loads travel with pass 1's) and x is streamed.
            # Slot (i, u) holds column vector i * gw + (g0 + u) * 32 + lane.
            if residual:
                for i in T.unroll(nv):
                    for u in T.unroll(q):
                        if (not guarded) or (i * gw + (g0 + u) * 32 + lane < nvec):
                            for k in T.vectorized(vec):
                                xr[i, u, k] = x[t, h, (i * gw + (g0 + u) * 32 + lane) * vec + k]
            elif live:
                for i in T.unroll(nv):
                    for u in T.unroll(q):
                        if (not guarded) or (i * gw + (g0 + u) * 32 + lane < nvec):
                            for k in T.vectorized(vec):
                                xr[i, u, k] = kv[t, m, (i * gw + (g0 + u) * 32 + lane) * vec + k]
            if live:
                for i in T.unroll(nv):
                    for u in T.unroll(q):
                        if (not guarded) or (i * gw + (g0 + u) * 32 + lane < nvec):
                            if not residual:
                                for k in T.vectorized(vec):
                                    xs[k] = x[t, h, (i * gw + (g0 + u) * 32 + lane) * vec + k]
                            for k in T.vectorized(vec):
                                kf[k] = kv[t, h, (i * gw + (g0 + u) * 32 + lane) * vec + k]
                            for k in T.vectorized(vec):
                                wr[k] = wf[h, (i * gw + (g0 + u) * 32 + lane) * vec + k]
                            if residual:
                                for k in T.unroll(vec):
                                    part[u, 0] += T.cast(xr[i, u, k], f32) * T.cast(xr[i, u, k], f32)
                                    part[u, 1] += kf[k] * kf[k]
                                    part[u, 2] += T.cast(xr[i, u, k], f32) * wr[k] * kf[k]
                            else:
                                for k in T.unroll(vec):
                                    part[u, 0] += T.cast(xs[k], f32) * T.cast(xs[k], f32)
                                    part[u, 1] += kf[k] * kf[k]
                                    part[u, 2] += T.cast(xs[k], f32) * wr[k] * kf[k]
            for u in T.unroll(q):
                for j in T.unroll(3):
                    part[u, j] = T.warp_reduce_sum(part[u, j])
            if warp_local:
                # one warp per stream: every lane holds the group sums; add them in ascending order
                for j in T.unroll(3):
                    for u in T.unroll(1, q):
                        part[0, j] += part[u, j]
            else:
                if lane == 0:
                    for u in T.unroll(q):
                        for j in T.unroll(3):
                            red[j, h * gps + g0 + u] = part[u, j]
                T.sync_threads()
                for j in T.unroll(3):
                    part[0, j] = red[j, h * gps]
                    for w in T.unroll(1, gps):
                        part[0, j] += red[j, h * gps + w]
            st[0] = part[0, 2]
            st[1] = T.rsqrt(part[0, 0] / inv_hidden + eps)
            st[2] = T.rsqrt(part[0, 1] / inv_hidden + eps)
            st[3] = st[0] * st[1] * st[2] * scale
            st[3] = T.sigmoid(T.copysign(T.sqrt(T.max(T.abs(st[3]), clamp)), st[3]))
            if lt == 0:
                if live:
                    dot[t, h] = st[0]
                    rstd_x[t, h] = st[1]
                    rstd_k[t, h] = st[2]
                    gate[t, h] = st[3]
                else:
                    dot[t, h] = 0.0
                    rstd_x[t, h] = 0.0
                    rstd_k[t, h] = 0.0
                    gate[t, h] = 0.0
            # Pass 2: stream v, write bf16(x + g * v) from the registers (without the residual v is already in
            # xr: write bf16(g * v)).
            if live:
                for i in T.unroll(nv):
                    for u in T.unroll(q):
                        if (not guarded) or (i * gw + (g0 + u) * 32 + lane < nvec):
                            if residual:
                                for k in T.vectorized(vec):
                                    vr[k] = kv[t, m, (i * gw + (g0 + u) * 32 + lane) * vec + k]
                                for k in T.vectorized(vec):
                                    out[t, h, (i * gw + (g0 + u) * 32 + lane) * vec + k] = T.cast(
                                        T.cast(xr[i, u, k], f32) + st[3] * vr[k], bf16)
                            else:  # v is in xr (bf16, exact in fp32)
                                for k in T.vectorized(vec):
                                    out[t, h, (i * gw + (g0 + u) * 32 + lane) * vec + k] = T.cast(
                                        st[3] * T.cast(xr[i, u, k], f32), bf16)
            else:
                if not residual:
                    # a masked token's gated value is 0
                    for i in T.unroll(nv):
                        for u in T.unroll(q):
                            if (not guarded) or (i * gw + (g0 + u) * 32 + lane < nvec):
                                for k in T.vectorized(vec):
                                    out[t, h, (i * gw + (g0 + u) * 32 + lane) * vec + k] = T.cast(0.0, bf16)
                elif not inplace:
                    for i in T.unroll(nv):
                        for u in T.unroll(q):
                            if (not guarded) or (i * gw + (g0 + u) * 32 + lane < nvec):
                                for k in T.vectorized(vec):
                                    out[t, h, (i * gw + (g0 + u) * 32 + lane) * vec + k] = xr[i, u, k]

    # Each parameter needs its own annotation object (a shared one would alias the buffers).
    xs, kvs, ws, ms, ss = (num_tokens, m, H), (num_tokens, m + 1, H), (m, H), (num_tokens,), (num_tokens, m)

    # One signature per variant; the body (and so the arithmetic) is shared.
    if has_mask and not inplace:

        @T.prim_func
        def engram_gate_forward_cuda(x: T.Tensor(xs, bf16), kv: T.Tensor(kvs, bf16), wf: T.Tensor(ws, f32), mask: T.Tensor(ms, T.bool), eps: f32, clamp: f32, out: T.Tensor(xs, bf16), dot: T.Tensor(ss, f32), gate: T.Tensor(ss, f32), rstd_x: T.Tensor(ss, f32), rstd_k: T.Tensor(ss, f32)):
            body(x, kv, wf, mask, eps, clamp, out, dot, gate, rstd_x, rstd_k)

    elif has_mask:

        @T.prim_func
        def engram_gate_forward_cuda(x: T.Tensor(xs, bf16), kv: T.Tensor(kvs, bf16), wf: T.Tensor(ws, f32), mask: T.Tensor(ms, T.bool), eps: f32, clamp: f32, dot: T.Tensor(ss, f32), gate: T.Tensor(ss, f32), rstd_x: T.Tensor(ss, f32), rstd_k: T.Tensor(ss, f32)):
            body(x, kv, wf, mask, eps, clamp, x, dot, gate, rstd_x, rstd_k)

    elif not inplace:

        @T.prim_func
        def engram_gate_forward_cuda(x: T.Tensor(xs, bf16), kv: T.Tensor(kvs, bf16), wf: T.Tensor(ws, f32), eps: f32, clamp: f32, out: T.Tensor(xs, bf16), dot: T.Tensor(ss, f32), gate: T.Tensor(ss, f32), rstd_x: T.Tensor(ss, f32), rstd_k: T.Tensor(ss, f32)):
            body(x, kv, wf, None, eps, clamp, out, dot, gate, rstd_x, rstd_k)

    else:

        @T.prim_func
        def engram_gate_forward_cuda(x: T.Tensor(xs, bf16), kv: T.Tensor(kvs, bf16), wf: T.Tensor(ws, f32), eps: f32, clamp: f32, dot: T.Tensor(ss, f32), gate: T.Tensor(ss, f32), rstd_x: T.Tensor(ss, f32), rstd_k: T.Tensor(ss, f32)):
            body(x, kv, wf, None, eps, clamp, x, dot, gate, rstd_x, rstd_k)

    return engram_gate_forward_cuda


FORWARD = Kernel("engram_gate_forward", FwdKey, build_engram_gate_forward, derive=_key, cases=forward_cases)


def engram_gate_forward(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    weight_fused: torch.Tensor,
    image_token_mask: torch.Tensor | None,
    eps: float,
    clamp_value: float,
    out: torch.Tensor,
    dot: torch.Tensor | None,
    gate_score: torch.Tensor | None,
    rstd_x: torch.Tensor | None,
    rstd_k: torch.Tensor | None,
    residual: bool = True,
) -> None:
    """Launches the Engram gate forward on the current stream (inputs validated upstream).

    Args:
        hidden_states: ``x`` ``(T, m, H)`` bf16, ``T > 0``.
        kv: ``(T, m+1, H)`` bf16 (rows ``0..m-1`` keys, row ``m`` value).
        weight_fused: ``(m, H)`` f32.
        image_token_mask: ``(T,)`` bool or None; masked tokens copy ``x`` and get zero statistics.
        eps: RMSNorm epsilon (runtime fp32 scalar).
        clamp_value: signed-sqrt clamp (runtime fp32 scalar); ``z = +0`` gives ``+sqrt(clamp)``.
        out: ``(T, m, H)`` bf16; may be ``hidden_states`` itself (in place).
        dot, gate_score, rstd_x, rstd_k: ``(T, m)`` f32 each, or all None (statistics not saved: the kernel
            writes them into a scratch buffer of ``4 T m`` floats instead).
        residual: ``out = bf16(x + g * v)``; False: ``bf16(g * v)`` (never in place).

    Without ``save_for_backward`` the same kernel runs with its statistics pointed at scratch memory (64
    bytes per token, rows padded to 16 tokens so that each of the four starts 64-byte aligned): the kernel
    without the statistics stores was slower (docs/perf/h200/engram.md, 2026-12-01 — gate forward: statistics
    always written), and the output is bitwise the same either way.
    """
    key = FORWARD.key(hidden_states, out, image_token_mask, residual)
    kernel = FORWARD.compiled(key)
    if dot is None:
        num_tokens, hc_mult = hidden_states.shape[0], hidden_states.shape[1]
        rows = -(-num_tokens // 16) * 16
        scratch = torch.empty((4, rows, hc_mult), dtype=torch.float32, device=hidden_states.device)
        dot, gate_score, rstd_x, rstd_k = scratch[:, :num_tokens].unbind(0)
    args = [hidden_states, kv, weight_fused]
    if key.has_mask:
        args.append(image_token_mask)
    args += [float(eps), float(clamp_value)]
    if not key.inplace:
        args.append(out)
    args += [dot, gate_score, rstd_x, rstd_k]
    kernel(*args)


__all__ = public_names(__name__)
