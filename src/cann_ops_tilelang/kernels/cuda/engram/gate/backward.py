"""CUDA kernel of ``engram_gate_backward`` (docs/ops/engram.md#gate).

``P`` persistent workers (``P = grad_w_partial.shape[0]``): worker ``w`` owns the token range
``[w*ceil(T/P), min((w+1)*ceil(T/P), T))`` and writes row ``w`` of the weight-gradient partials (zeros when
its range is empty): deterministic without atomics. Worker ``w`` is CTA ``w``, or, where :func:`bwd_plan`
splits the columns (``S > 1``, e.g. H = 7168), cluster ``w`` of ``S`` CTAs whose rank ``r`` owns the
columns ``[r*H/S, (r+1)*H/S)`` (``P = #SMs / S``, :func:`num_partials`). Each thread owns ``nc`` 8-element
column vectors of all ``m`` streams, its fp32 share of ``grad_wf`` in registers or in a shared-memory tile
only it touches. Per token: (1) ``go`` (kept) and ``v``: ``G_h = <go_h, v>`` and the value gradient
``sum_h go_h * g_h`` (ascending ``h``); (2) ``G_h`` reduced over the CTA or cluster (warp shuffles, every
warp's partial stored into every CTA's shared memory, one barrier, then one identical shuffle reduction per
warp: bitwise-equal sums everywhere); (3) ``x``, ``k``, ``wf``: ``grad_x``, ``grad_k`` and ``beta * x * k``.
Latency hiding (:class:`BwdPlan`): thread-private ``cp.async`` staging of x/k and prefetch of the next
go/v (only ``cp.async.wait_group``, no barrier); where a second x/k buffer fits, a token-pipelined variant
(:func:`build_engram_gate_backward`) for at most ``BWD_TUNING.pipelined_tokens_per_worker`` tokens per worker.
Measurements: the "gate
backward" entries of docs/perf/h200/engram.md.
"""

import torch

from .....limits import IntRange, LimitError
from .....policy import BWD_TUNING, BwdPlan, bwd_plan, num_partials
from ...._kernel import Kernel, public_names
from ._keys import BwdKey, backward_cases

_PRELUDE = r"""
__device__ __forceinline__ void ops_st_cluster_f32(float* ptr, int rank, float value) {
  unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(ptr));
  unsigned int remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(value) : "memory");
}
"""


def _key(hidden_states, grad_w_partial, image_token_mask, residual: bool = True) -> BwdKey:
    _, hc_mult, hidden_size = hidden_states.shape
    return BwdKey(int(hidden_size), int(hc_mult), int(grad_w_partial.shape[0]), image_token_mask is not None,
                  bool(residual))


def build_engram_gate_backward(hidden_size: int, hc_mult: int, num_partials: int, has_mask: bool, residual: bool = True,
                          pipelined: bool = False):
    """Builds the backward prim_func.

    Args:
        hidden_size: ``H`` in ``limits.ENGRAM_HIDDEN`` (see :func:`bwd_plan`).
        hc_mult: ``m`` in ``limits.ENGRAM_HC_MULT``.
        num_partials: ``P``, the number of workers / rows of ``grad_w_partial`` (the grid is ``S * P`` CTAs
            at the split ``S`` of :func:`bwd_plan`, one worker per cluster).
        has_mask: Take an ``image_token_mask`` ``(T,)`` bool.
        pipelined: The token-pipelined variant of the split schedule (only where ``bwd_plan(...).pipe``):
            iteration ``t`` runs phase 1 of token ``t+1`` and sends its dL/dg partials, stages its x/k and
            loads the go/v and the scalars of token ``t+2`` (after the cluster arrive), runs phase 2 of token
            ``t``, then waits for the cluster, so that the exchange and the loads overlap a phase 2. The
            worker's first go/v and x/k and its second go/v (into that token's free x/k buffer) are loaded
            before its first phase 1. Same arithmetic in the same order (bitwise-equal outputs).
        residual: The forward added ``x``: ``grad_x`` includes ``go``; False: not (masked tokens get 0, not ``go``).

    Returns:
        ``T.prim_func(go, x, kv, wf, dot, gate, rstd_x, rstd_k, [mask], clamp: f32, grad_x, grad_kv,
        grad_w_partial)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    plan, vec = bwd_plan(hidden_size, hc_mult), BWD_TUNING.vec  # limits.LimitError outside the Engram ranges
    H, m = int(hidden_size), int(hc_mult)
    P = IntRange("num_partials", 1).require("engram_gate_backward", num_partials)
    S, threads, nc = plan.split, plan.threads, plan.nc
    gw_regs, stage_xk, pre_gov, wf_smem = plan.gw_regs, plan.stage_xk, plan.pre_gov, plan.wf_smem
    if pipelined and not plan.pipe:
        raise LimitError(f"engram_gate_backward: no pipelined schedule at hidden_size {H}, hc_mult {m}, {P} partials")
    # the pipelined kernel implies S > 1, x/k staging, the go/v prefetch, wf in shared memory, tile in registers
    # (plan.pipe is set only where policy._pipe_fits says all hold)
    pipe = pipelined
    if threads % 32 != 0:
        # the weight-gradient flush exchanges values across full warps (H % 256 == 0 guarantees it)
        raise LimitError(f"engram_gate_backward: hidden_size {H} gives {threads} threads per CTA, not whole warps")
    wf_pipe = not wf_smem  # wf from global memory: software-pipelined one (vector, stream) step ahead
    gov0 = 4 * m if pipe else 0  # first go/v row (in the pipelined kernel, after the two x/k buffers)
    # The next token's gate / dot / rstd loaded one token ahead (off phase 1's critical path); not in
    # the unpipelined split schedule, where it measured slower (docs/perf/h200/engram.md, 2026-11-30 — gate
    # backward: column split over a 2-CTA cluster); the pipelined kernel loads token t+2's after the arrive.
    scalars_ahead = S == 1
    nwarps = threads // 32
    HC = H // S  # columns per CTA
    nvec = HC // vec
    scale = float(H**-0.5)
    hidden_f = float(H)
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def cp16(dst, row, col, src, t, h, c):
        # One thread's 16-byte cp.async of the 8 bf16 src[t, h, c:c+8] into dst[row, col:col+8].
        T.ptx_cp_async(T.access_ptr(dst[row, col], "w", vec), T.access_ptr(src[t, h, c], "r", vec), vec)

    @T.macro
    def prefetch(go, kv, dst, r0, t, t_stop, tid, c0):
        # Thread-private cp.async of the thread's own go (m rows) and v columns of token t (if t < t_stop)
        # into rows r0 .. r0 + m of dst; the group is committed either way, so that a fixed wait_group
        # count covers the groups after it.
        if t < t_stop:
            for i in T.unroll(nc):
                for h in T.unroll(m):
                    cp16(dst, r0 + h, (i * threads + tid) * vec, go, t, h, c0 + (i * threads + tid) * vec)
                cp16(dst, r0 + m, (i * threads + tid) * vec, kv, t, m, c0 + (i * threads + tid) * vec)
        T.ptx_commit_group()

    @T.macro
    def load_gov(go, kv, gor, vr, t, tid, c0):
        # Direct (register) loads of the thread's go rows and v columns of token t.
        for i in T.unroll(nc):
            for h in T.unroll(m):
                for k in T.vectorized(vec):
                    gor[i, h, k] = go[t, h, c0 + (i * threads + tid) * vec + k]
            for k in T.vectorized(vec):
                vr[i, k] = kv[t, m, c0 + (i * threads + tid) * vec + k]

    @T.macro
    def stage(x, kv, dst, r0, t, tid, c0):
        # Thread-private cp.async of the thread's own x and k columns (all m streams) of token t into
        # rows r0 .. r0 + 2m of dst (x, then k).
        for i in T.unroll(nc):
            for h in T.unroll(m):
                cp16(dst, r0 + h, (i * threads + tid) * vec, x, t, h, c0 + (i * threads + tid) * vec)
                cp16(dst, r0 + m + h, (i * threads + tid) * vec, kv, t, h, c0 + (i * threads + tid) * vec)
        T.ptx_commit_group()

    @T.macro
    def flush(grad_w, gwr, gw_s, wr, wo, row, tid, lane, wid, c0):
        # Row ``row`` of the partials, this CTA's columns.
        # Lane l holds the 8 columns [8l, 8l+8) of its warp's 256; stored as they are, each 16-byte
        # store would half-fill 32 sectors. Instead the warp stores the two contiguous 512-byte halves:
        # lane l writes columns 4l .. 4l+3 (+128 for the second half), from lane l / 2 (+16).
        for i in T.unroll(nc):
            for h in T.unroll(m):
                for k in T.unroll(vec):
                    if gw_regs:
                        wr[k] = gwr[i, h, k]
                    else:
                        wr[k] = gw_s[h, k, i * threads + tid]
                for half in T.unroll(2):
                    # both shuffles unconditionally (every lane takes part), then the lane's pick
                    for e in T.unroll(4):
                        wo[e] = T.shfl_sync(wr[e], half * 16 + lane // 2)
                        wo[4 + e] = T.shfl_sync(wr[4 + e], half * 16 + lane // 2)
                    for e in T.unroll(4):
                        wo[e] = T.if_then_else(lane % 2 == 0, wo[e], wo[4 + e])
                    for e in T.vectorized(4):
                        grad_w[row, h, c0 + (i * threads + wid * 32) * vec + half * 128 + lane * 4 + e] = wo[e]

    @T.macro
    def load_scalars(dot, gate, rstd_x, rstd_k, sc, gl, t, tid):
        # Token t's gate scores (every thread) and, in thread h < m, stream h's dot, rstd_x, rstd_k.
        if tid < m:
            sc[0] = dot[t, tid]
            sc[1] = rstd_x[t, tid]
            sc[2] = rstd_k[t, tid]
        for h in T.unroll(m):
            gl[h] = gate[t, h]

    @T.macro
    def take_scalars(gl, sc, gln, scn, tid):
        # The scalars loaded one token ahead (gln, scn) become the current token's (gl, sc).
        for h in T.unroll(m):
            gl[h] = gln[h]
        if tid < m:
            for q in T.unroll(3):
                sc[q] = scn[q]

    @T.macro
    def image_token(go, kv, gov_s, r0, grad_x, grad_kv, cp, t, t_pf, t_stop, tid, c0):
        # Image token t: grad_x = go (bit copy, from the prefetched go/v in rows r0 .. r0 + m of gov_s where
        # there is one; then token t_pf's go/v, if t_pf < t_stop, into the go/v rows), grad_kv = 0, no
        # weight-gradient contribution. Without the residual grad_x = 0 (the prefetched go/v is not read).
        for i in T.unroll(nc):
            for h in T.unroll(m):
                if not residual:
                    for k in T.vectorized(vec):
                        cp[k] = T.cast(0.0, bf16)
                elif pre_gov:
                    for k in T.vectorized(vec):
                        cp[k] = gov_s[r0 + h, (i * threads + tid) * vec + k]
                else:
                    for k in T.vectorized(vec):
                        cp[k] = go[t, h, c0 + (i * threads + tid) * vec + k]
                for k in T.vectorized(vec):
                    grad_x[t, h, c0 + (i * threads + tid) * vec + k] = cp[k]
        if pre_gov:
            prefetch(go, kv, gov_s, gov0, t_pf, t_stop, tid, c0)
        for i in T.unroll(nc):
            for h in T.unroll(m + 1):
                for k in T.vectorized(vec):
                    grad_kv[t, h, c0 + (i * threads + tid) * vec + k] = T.cast(0.0, bf16)

    @T.macro
    def phase1_vec(gor, vr, vf, gv, gl, acc, grad_kv, i, t, tid, c0):
        # Column vector i of phase 1 (go in gor, v in vr): the dL/dg partials and the value gradient.
        for k in T.unroll(vec):
            vf[k] = T.cast(vr[i, k], f32)
        for h in T.unroll(m):
            for k in T.unroll(vec):
                acc[h] += T.cast(gor[i, h, k], f32) * vf[k]
        for k in T.unroll(vec):
            gv[k] = T.cast(gor[i, 0, k], f32) * gl[0]
            for h in T.unroll(1, m):
                gv[k] += T.cast(gor[i, h, k], f32) * gl[h]
        for k in T.vectorized(vec):
            grad_kv[t, m, c0 + (i * threads + tid) * vec + k] = T.cast(gv[k], bf16)

    @T.macro
    def publish_scalars(scs, sc, parity, clamp, tid):
        # Thread h < m (holding stream h's dot, rstd_x, rstd_k in sc) publishes its per-stream scalars.
        if tid < m:
            sc[3] = scale * sc[1] * sc[2]
            scs[parity[0], 0, tid] = T.if_then_else(
                T.abs(sc[0]) * sc[3] >= clamp, T.sqrt(sc[3] / T.abs(sc[0])), T.cast(0.0, f32)
            )
            scs[parity[0], 1, tid] = T.if_then_else(T.abs(sc[0]) * sc[3] >= clamp, T.cast(1.0, f32), T.cast(0.0, f32))
            scs[parity[0], 2, tid] = sc[0] * sc[1] * sc[1] / hidden_f
            scs[parity[0], 3, tid] = sc[0] * sc[2] * sc[2] / hidden_f

    @T.macro
    def send_partials(red, acc, parity, lane, wid, rank):
        # Every CTA of the cluster gets every warp's partial (slot rank * nwarps + wid), so all of them
        # sum the same values in the same order: bitwise-equal dL/dg.
        if lane == 0:
            for h in T.unroll(m):
                for r in T.unroll(S):
                    T.call_extern(
                        "void", "ops_st_cluster_f32", T.address_of(red[parity[0], h, rank * nwarps + wid]), r, acc[h]
                    )

    @T.macro
    def betas(red, scs, gl, acc, beta, ax, ak, parity, lane):
        # After the barrier: the sum of all warps' partials (same order on every thread) and the token's
        # beta / alpha_x / alpha_k per stream; the reduction buffers flip.
        for h in T.unroll(m):
            acc[h] = T.warp_reduce_sum(
                T.if_then_else(lane < S * nwarps, red[parity[0], h, lane], T.cast(0.0, f32))
            )
        # Per-stream scalars (same arithmetic as computing them here).
        for h in T.unroll(m):
            beta[h] = T.if_then_else(
                scs[parity[0], 1, h] != 0.0,
                acc[h] * gl[h] * (1.0 - gl[h]) * 0.5 * scs[parity[0], 0, h],
                T.cast(0.0, f32),
            )
            ax[h] = scs[parity[0], 2, h]
            ak[h] = scs[parity[0], 3, h]
        parity[0] = 1 - parity[0]

    @T.macro
    def phase2_vec(grad_x, grad_kv, gwr, gw_s, gor, xr, kr, wr, cp, beta, ax, ak, i, h, t, tid, c0):
        # Column vector i of stream h in phase 2 (x, k, wf in xr, kr, wr): grad_x (+ go if residual), grad_k, grad_wf.
        if residual:
            for k in T.vectorized(vec):
                cp[k] = gor[i, h, k]
            for k in T.vectorized(vec):
                grad_x[t, h, c0 + (i * threads + tid) * vec + k] = T.cast(
                    T.cast(cp[k], f32) + beta[h] * (kr[k] * wr[k] - xr[k] * ax[h]), bf16
                )
        else:
            for k in T.vectorized(vec):
                grad_x[t, h, c0 + (i * threads + tid) * vec + k] = T.cast(
                    beta[h] * (kr[k] * wr[k] - xr[k] * ax[h]), bf16)
        for k in T.vectorized(vec):
            grad_kv[t, h, c0 + (i * threads + tid) * vec + k] = T.cast(beta[h] * (xr[k] * wr[k] - kr[k] * ak[h]), bf16)
        for k in T.unroll(vec):
            if gw_regs:
                gwr[i, h, k] += beta[h] * xr[k] * kr[k]
            else:
                gw_s[h, k, i * threads + tid] += beta[h] * xr[k] * kr[k]

    @T.macro
    def tokens(go, x, kv, wf, dot, gate, rstd_x, rstd_k, mask, clamp, grad_x, grad_kv,
               gwr, gw_s, xk_s, gov_s, wf_s, red, scs, gor, cp, vr, vf, gv, xr, kr, wr, wq, gl, acc, beta,
               ax, ak, sc, gln, scn, parity, t_lo, t_hi, tid, lane, wid, rank, c0):
        # The worker's tokens [t_lo, t_hi).
        for t in T.serial(t_lo, t_hi):
            if pre_gov:
                T.ptx_wait_group(0)
            if scalars_ahead:
                # this token's scalars were loaded during the previous one; load the next token's now
                take_scalars(gl, sc, gln, scn, tid)
                if t + 1 < t_hi:
                    for h in T.unroll(m):
                        gln[h] = gate[t + 1, h]
                    if tid < m:
                        scn[0] = dot[t + 1, tid]
                        scn[1] = rstd_x[t + 1, tid]
                        scn[2] = rstd_k[t + 1, tid]
            if has_mask and mask[t]:
                image_token(go, kv, gov_s, 0, grad_x, grad_kv, cp, t, t + 1, t_hi, tid, c0)
            else:
                if stage_xk:
                    stage(x, kv, xk_s, 0, t, tid, c0)
                # Per-stream scalars (here, unless loaded one token ahead): thread h < m loads those of
                # stream h (used only after phase 1) and publishes them before the reduction barrier;
                # everyone reads them after it (double-buffered).
                if not scalars_ahead:
                    load_scalars(dot, gate, rstd_x, rstd_k, sc, gl, t, tid)
                for h in T.unroll(m):
                    acc[h] = 0.0
                # Phase 1: go (kept in registers) and v -> partial dL/dg per stream, value gradient.
                for i in T.unroll(nc):
                    if pre_gov:
                        for h in T.unroll(m):
                            for k in T.vectorized(vec):
                                gor[i, h, k] = gov_s[h, (i * threads + tid) * vec + k]
                        for k in T.vectorized(vec):
                            vr[i, k] = gov_s[m, (i * threads + tid) * vec + k]
                    else:
                        load_gov(go, kv, gor, vr, t, tid, c0)
                    phase1_vec(gor, vr, vf, gv, gl, acc, grad_kv, i, t, tid, c0)
                # The staging buffer is consumed: fetch the next token while this one finishes.
                if pre_gov:
                    prefetch(go, kv, gov_s, 0, t + 1, t_hi, tid, c0)
                publish_scalars(scs, sc, parity, clamp, tid)
                if wf_pipe:
                    # phase 2's first wf vector, issued before the reduction (independent of it)
                    for k in T.vectorized(vec):
                        wq[0, k] = wf[0, c0 + tid * vec + k]
                for h in T.unroll(m):
                    acc[h] = T.warp_reduce_sum(acc[h])
                if S == 1:
                    if lane == 0:
                        for h in T.unroll(m):
                            red[parity[0], h, wid] = acc[h]
                    T.sync_threads()
                else:
                    send_partials(red, acc, parity, lane, wid, rank)
                    T.cluster_arrive()
                    T.cluster_wait()
                betas(red, scs, gl, acc, beta, ax, ak, parity, lane)
                # Phase 2: x, k, wf -> grad_x, grad_k and the weight-gradient tile.
                if stage_xk:
                    # this token's x/k; the next token's go/v prefetch (committed after it) may stay in flight
                    T.ptx_wait_group(1 if pre_gov else 0)
                for i in T.unroll(nc):
                    for h in T.unroll(m):
                        if stage_xk:
                            for k in T.vectorized(vec):
                                xr[k] = xk_s[h, (i * threads + tid) * vec + k]
                            for k in T.vectorized(vec):
                                kr[k] = xk_s[m + h, (i * threads + tid) * vec + k]
                        else:
                            for k in T.vectorized(vec):
                                xr[k] = x[t, h, c0 + (i * threads + tid) * vec + k]
                            for k in T.vectorized(vec):
                                kr[k] = kv[t, h, c0 + (i * threads + tid) * vec + k]
                        if wf_smem:
                            for k in T.vectorized(vec):
                                wr[k] = wf_s[h, (i * threads + tid) * vec + k]
                        elif wf_pipe:
                            if i * m + h + 1 < nc * m:
                                for k in T.vectorized(vec):
                                    wq[(i * m + h + 1) % 2, k] = wf[
                                        (h + 1) % m, c0 + ((i + (h + 1) // m) * threads + tid) * vec + k
                                    ]
                            for k in T.vectorized(vec):
                                wr[k] = wq[(i * m + h) % 2, k]
                        else:
                            for k in T.vectorized(vec):
                                wr[k] = wf[h, c0 + (i * threads + tid) * vec + k]
                        phase2_vec(grad_x, grad_kv, gwr, gw_s, gor, xr, kr, wr, cp, beta, ax, ak, i, h, t, tid, c0)

    @T.macro
    def pipe_phase1(go, x, kv, dot, gate, rstd_x, rstd_k, clamp, grad_kv, sb, red, scs, gon, vr, vf, gv, gl,
                    acc, sc, gln, scn, parity, r0, t, t_pf, t_stop, tid, lane, wid, rank, c0, with_xk=True,
                    loaded=False):
        # Phase 1 of token t (split schedule, its go/v in rows r0 .. r0 + m of sb): go into gon, the value
        # gradient, this CTA's dL/dg partials into every CTA of the cluster; the arrive; then token t's x/k
        # staging into its buffer (with_xk: unless staged before) and token t_pf's go/v prefetch into the
        # go/v rows (if t_pf < t_stop). The loads go after the arrive, whose release fence (MEMBAR.ALL.GPU)
        # waits for the thread's outstanding memory operations. loaded: token t's scalars are in gln / scn.
        if loaded:
            take_scalars(gl, sc, gln, scn, tid)
        else:
            load_scalars(dot, gate, rstd_x, rstd_k, sc, gl, t, tid)
        for h in T.unroll(m):
            acc[h] = 0.0
        for i in T.unroll(nc):
            for h in T.unroll(m):
                for k in T.vectorized(vec):
                    gon[i, h, k] = sb[r0 + h, (i * threads + tid) * vec + k]
            for k in T.vectorized(vec):
                vr[i, k] = sb[r0 + m, (i * threads + tid) * vec + k]
            phase1_vec(gon, vr, vf, gv, gl, acc, grad_kv, i, t, tid, c0)
        publish_scalars(scs, sc, parity, clamp, tid)
        for h in T.unroll(m):
            acc[h] = T.warp_reduce_sum(acc[h])
        send_partials(red, acc, parity, lane, wid, rank)
        T.cluster_arrive()
        if with_xk:
            stage(x, kv, sb, 2 * m * (t % 2), t, tid, c0)
        prefetch(go, kv, sb, gov0, t_pf, t_stop, tid, c0)

    @T.macro
    def pipe_phase2(grad_x, grad_kv, sb, wf_s, gwr, gor, xr, kr, wr, cp, beta, ax, ak, t, tid, c0):
        # Phase 2 of token t from its x/k buffer (t % 2): grad_x, grad_k, the weight-gradient registers.
        for i in T.unroll(nc):
            for h in T.unroll(m):
                for k in T.vectorized(vec):
                    xr[k] = sb[2 * m * (t % 2) + h, (i * threads + tid) * vec + k]
                for k in T.vectorized(vec):
                    kr[k] = sb[2 * m * (t % 2) + m + h, (i * threads + tid) * vec + k]
                for k in T.vectorized(vec):
                    wr[k] = wf_s[h, (i * threads + tid) * vec + k]
                phase2_vec(grad_x, grad_kv, gwr, None, gor, xr, kr, wr, cp, beta, ax, ak, i, h, t, tid, c0)

    @T.macro
    def pipe_take(red, scs, gl, acc, beta, ax, ak, parity, lane, gor, gon):
        # After the exchange of the token whose phase 1 ran last: its betas, and its go becomes the current.
        T.cluster_wait()
        betas(red, scs, gl, acc, beta, ax, ak, parity, lane)
        for i in T.unroll(nc):
            for h in T.unroll(m):
                for k in T.vectorized(vec):
                    gor[i, h, k] = gon[i, h, k]

    @T.macro
    def tokens_pipe(go, x, kv, dot, gate, rstd_x, rstd_k, mask, clamp, grad_x, grad_kv, gwr, sb, wf_s, red, scs,
                    gor, gon, cp, vr, vf, gv, xr, kr, wr, gl, acc, beta, ax, ak, sc, gln, scn, parity,
                    t_lo, t_hi, tid, lane, wid, rank, c0):
        # The worker's tokens [t_lo, t_hi), software-pipelined by one token: iteration t runs phase 1 of
        # token t+1 (sending its dL/dg partials, then staging its x/k and loading token t+2's go/v and
        # scalars), then phase 2 of token t (whose exchange completed in the previous iteration), then waits for token
        # t+1's exchange. The cluster barrier and the loads thus overlap phase 2 of the previous token. Per
        # token the same arithmetic in the same order as the unpipelined loop (bitwise-equal results).
        # On entry (loaded in the prologue by pipe_entry, the last two groups committed): token t_lo's go/v
        # in the go/v rows and its x/k in its buffer, and token t_lo+1's go/v (if it is this worker's) in
        # the x/k buffer of that token, which is free until its x/k is staged. So the go/v rows take token
        # t_lo+2's next, two tokens ahead.
        # Phase 1 of token t_lo, peeled: it waits for its go/v (and wf, committed before it) only.
        T.ptx_wait_group(2)
        if t_lo < t_hi:
            t_pf = T.min(t_lo + 2, t_hi)  # the first token whose go/v is not fetched yet
            if has_mask and mask[t_lo]:
                image_token(go, kv, sb, gov0, grad_x, grad_kv, cp, t_lo, t_pf, t_hi, tid, c0)
            else:
                pipe_phase1(go, x, kv, dot, gate, rstd_x, rstd_k, clamp, grad_kv, sb, red, scs, gon, vr, vf, gv,
                            gl, acc, sc, gln, scn, parity, gov0, t_lo, t_pf, t_hi, tid, lane, wid, rank, c0, False)
            # token t_lo+1's scalars, in flight during the exchange (after the arrive)
            if t_lo + 1 < t_hi:
                load_scalars(dot, gate, rstd_x, rstd_k, scn, gln, t_lo + 1, tid)
            if not (has_mask and mask[t_lo]):
                pipe_take(red, scs, gl, acc, beta, ax, ak, parity, lane, gor, gon)
        for t in T.serial(t_lo, t_hi):
            # token t's x/k and token t+1's go/v
            T.ptx_wait_group(0)
            if t + 1 < t_hi:
                # token t_lo+1's go/v in its x/k buffer, no prefetch with it (the go/v rows hold t_lo+2's)
                r0 = gov0 - T.cast(t == t_lo, T.int32) * (gov0 - 2 * m * ((t + 1) % 2))
                pf_stop = T.min(t_hi, T.if_then_else(t == t_lo, t_lo, t_hi))  # min: provably in bounds
                if has_mask and mask[t + 1]:
                    image_token(go, kv, sb, r0, grad_x, grad_kv, cp, t + 1, t + 2, pf_stop, tid, c0)
                else:
                    pipe_phase1(go, x, kv, dot, gate, rstd_x, rstd_k, clamp, grad_kv, sb, red, scs, gon, vr, vf,
                                gv, gl, acc, sc, gln, scn, parity, r0, t + 1, t + 2, pf_stop, tid, lane, wid, rank, c0,
                                True, True)
                # token t+2's scalars, in flight during phase 2 of token t (after the arrive)
                if t + 2 < t_hi:
                    load_scalars(dot, gate, rstd_x, rstd_k, scn, gln, t + 2, tid)
            if not (has_mask and mask[t]):
                pipe_phase2(grad_x, grad_kv, sb, wf_s, gwr, gor, xr, kr, wr, cp, beta, ax, ak, t, tid, c0)
            if t + 1 < t_hi:
                if not (has_mask and mask[t + 1]):
                    # token t's phase 2 is done: its go and scalars make room for token t+1's
                    pipe_take(red, scs, gl, acc, beta, ax, ak, parity, lane, gor, gon)

    @T.macro
    def pipe_entry(go, x, kv, sb, t_lo, t_hi, tid, c0):
        # What tokens_pipe expects on entry besides token t_lo's go/v: token t_lo's x/k staged into its
        # buffer and token t_lo+1's go/v (if below t_hi) into the other, always two groups.
        if t_lo < t_hi:
            stage(x, kv, sb, 2 * m * (t_lo % 2), t_lo, tid, c0)
        else:
            T.ptx_commit_group()
        prefetch(go, kv, sb, 2 * m * ((t_lo + 1) % 2), t_lo + 1, t_hi, tid, c0)

    @T.macro
    def body(go, x, kv, wf, dot, gate, rstd_x, rstd_k, mask, clamp, grad_x, grad_kv, grad_w):
        cluster = dict(cluster_dims=S, prelude=_PRELUDE) if S > 1 else {}
        with T.Kernel(P * S, threads=threads, **cluster) as p:
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            gwr = T.alloc_local((nc, m, vec), f32) if gw_regs else None
            gw_s = None if gw_regs else T.alloc_shared((m, vec, nvec), f32)
            if pipe:
                # rows [2m*b, 2m*b + 2m): x/k buffer b (token t in buffer t % 2); rows [gov0, gov0 + m]: go/v
                xk_s = T.alloc_shared((gov0 + m + 1, HC), bf16)
                gov_s = xk_s
            else:
                # this token's x and k (rows [0, m) and [m, 2m)), own columns only
                xk_s = T.alloc_shared((2 * m, HC), bf16) if stage_xk else None
                gov_s = T.alloc_shared((m + 1, HC), bf16) if pre_gov else None  # next token's go rows and v
            wf_s = T.alloc_shared((m, HC), f32) if wf_smem else None  # wf, own columns only (loaded once)
            red = T.alloc_shared((2, m, 32), f32)
            scs = T.alloc_shared((2, 4, m), f32)  # per-stream scalars, written by thread h < m
            gor = T.alloc_local((nc, m, vec), bf16)
            cp = T.alloc_local((vec,), bf16)
            vr = T.alloc_local((nc, vec), bf16)
            vf = T.alloc_local((vec,), f32)
            gv = T.alloc_local((vec,), f32)
            xr = T.alloc_local((vec,), f32)
            kr = T.alloc_local((vec,), f32)
            wr = T.alloc_local((vec,), f32)
            wq = T.alloc_local((2, vec), f32) if wf_pipe else None  # wf of the current / next (vector, stream) step
            gl = T.alloc_local((m,), f32)
            acc = T.alloc_local((m,), f32)
            beta = T.alloc_local((m,), f32)
            ax = T.alloc_local((m,), f32)
            ak = T.alloc_local((m,), f32)
            sc = T.alloc_local((4,), f32)
            # the next token's gate scores and its dot, rstd_x, rstd_k (threads h < m), loaded one token ahead
            gln = T.alloc_local((m,), f32) if scalars_ahead or pipe else None
            scn = T.alloc_local((3,), f32) if scalars_ahead or pipe else None
            parity = T.alloc_local((1,), T.int32)  # reduction buffer of this token
            gon = T.alloc_local((nc, m, vec), bf16) if pipe else None  # the next token's go (pipelined)

            parity[0] = 0
            if pipe:
                # zeroed for TileLang's read-before-write check, which cannot see that the pipeline's
                # first phase 2 always runs after its phase 1
                for h in T.unroll(m):
                    beta[h] = 0.0
                    ax[h] = 0.0
                    ak[h] = 0.0
                for i in T.unroll(nc):
                    for h in T.unroll(m):
                        for k in T.unroll(vec):
                            gor[i, h, k] = T.cast(0.0, bf16)
            for i in T.unroll(nc):
                for h in T.unroll(m):
                    for k in T.unroll(vec):
                        if gw_regs:
                            gwr[i, h, k] = 0.0
                        else:
                            gw_s[h, k, i * threads + tid] = 0.0
            # Worker w (row w of the partials) is cluster w of S CTAs (CTA w without the split) and owns the
            # token range [w*per, (w+1)*per); CTA rank r = p % S owns the columns [r*HC, (r+1)*HC).
            rank = p % S if S > 1 else 0
            c0 = rank * HC if S > 1 else 0
            w = p // S if S > 1 else p
            per = T.ceildiv(num_tokens, P)
            t_lo = T.min(per * w, num_tokens)
            t_hi = T.min(per * w + per, num_tokens)
            if S > 1:
                # the partner CTA is running (its shared memory may be written) once the wait returns
                T.cluster_arrive()
                if not pipe:
                    T.cluster_wait()
            if wf_smem:
                if t_lo < t_hi:
                    for i in T.unroll(nc):
                        for h in T.unroll(m):
                            for j in T.unroll(2):
                                T.ptx_cp_async(
                                    T.access_ptr(wf_s[h, (i * threads + tid) * vec + j * 4], "w", 4),
                                    T.access_ptr(wf[h, c0 + (i * threads + tid) * vec + j * 4], "r", 4),
                                    4,
                                )
                    T.ptx_commit_group()
            if pre_gov:
                prefetch(go, kv, gov_s, gov0, t_lo, t_hi, tid, c0)
            if pipe:
                # the first x/k and the second go/v travel with the first go/v; the wait of the start barrier
                # overlaps them
                pipe_entry(go, x, kv, xk_s, t_lo, t_hi, tid, c0)
                T.cluster_wait()
            if scalars_ahead:
                if t_lo < t_hi:
                    for h in T.unroll(m):
                        gln[h] = gate[t_lo, h]
                    if tid < m:
                        scn[0] = dot[t_lo, tid]
                        scn[1] = rstd_x[t_lo, tid]
                        scn[2] = rstd_k[t_lo, tid]
            if pipe:
                tokens_pipe(go, x, kv, dot, gate, rstd_x, rstd_k, mask, clamp, grad_x, grad_kv, gwr, xk_s, wf_s, red,
                            scs, gor, gon, cp, vr, vf, gv, xr, kr, wr, gl, acc, beta, ax, ak, sc, gln, scn, parity,
                            t_lo, t_hi, tid, lane, wid, rank, c0)
            else:
                tokens(go, x, kv, wf, dot, gate, rstd_x, rstd_k, mask, clamp, grad_x, grad_kv, gwr, gw_s, xk_s, gov_s,
                       wf_s, red, scs, gor, cp, vr, vf, gv, xr, kr, wr, wq, gl, acc, beta, ax, ak, sc, gln, scn, parity,
                       t_lo, t_hi, tid, lane, wid, rank, c0)
            # the worker's row of the partials (zeros for an empty range)
            flush(grad_w, gwr, gw_s, wr, xr, w, tid, lane, wid, c0)  # xr: free scratch here

    xs, kvs, ws, ms, ss, ps = (num_tokens, m, H), (num_tokens, m + 1, H), (m, H), (num_tokens,), (num_tokens, m), (P, m, H)

    if has_mask:

        @T.prim_func
        def engram_gate_backward_cuda(
            grad_out: T.Tensor(xs, bf16),
            hidden_states: T.Tensor(xs, bf16),
            kv: T.Tensor(kvs, bf16),
            weight_fused: T.Tensor(ws, f32),
            dot: T.Tensor(ss, f32),
            gate_score: T.Tensor(ss, f32),
            rstd_x: T.Tensor(ss, f32),
            rstd_k: T.Tensor(ss, f32),
            image_token_mask: T.Tensor(ms, T.bool),
            clamp: f32,
            grad_hidden_states: T.Tensor(xs, bf16),
            grad_kv: T.Tensor(kvs, bf16),
            grad_w_partial: T.Tensor(ps, f32),
        ):
            body(grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, image_token_mask, clamp,
                 grad_hidden_states, grad_kv, grad_w_partial)

    else:

        @T.prim_func
        def engram_gate_backward_cuda(
            grad_out: T.Tensor(xs, bf16),
            hidden_states: T.Tensor(xs, bf16),
            kv: T.Tensor(kvs, bf16),
            weight_fused: T.Tensor(ws, f32),
            dot: T.Tensor(ss, f32),
            gate_score: T.Tensor(ss, f32),
            rstd_x: T.Tensor(ss, f32),
            rstd_k: T.Tensor(ss, f32),
            clamp: f32,
            grad_hidden_states: T.Tensor(xs, bf16),
            grad_kv: T.Tensor(kvs, bf16),
            grad_w_partial: T.Tensor(ps, f32),
        ):
            body(grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, None, clamp,
                 grad_hidden_states, grad_kv, grad_w_partial)

    return engram_gate_backward_cuda


def _build_pipelined(hidden_size: int, hc_mult: int, num_partials: int, has_mask: bool, residual: bool = True):
    return build_engram_gate_backward(hidden_size, hc_mult, num_partials, has_mask, residual, pipelined=True)


PIPELINED = Kernel("engram_gate_backward_pipelined", BwdKey, _build_pipelined, cases=backward_cases(pipelined=True))
# One compile per key (never per token count) gives both variants: ``(kernel, pipelined kernel or None)``; the
# launcher takes the pipelined one for at most ``BWD_TUNING.pipelined_tokens_per_worker`` tokens per worker.
BACKWARD = Kernel("engram_gate_backward", BwdKey, build_engram_gate_backward, derive=_key,
                  cases=backward_cases(pipelined=False),
                  compile=lambda key: (BACKWARD.jit(key), PIPELINED.compiled(key)
                                       if bwd_plan(key.hidden_size, key.hc_mult).pipe else None))


def engram_gate_backward(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    image_token_mask: torch.Tensor | None,
    clamp_value: float,
    grad_hidden_states: torch.Tensor,
    grad_kv: torch.Tensor,
    grad_w_partial: torch.Tensor,
    residual: bool = True,
) -> None:
    """Launches the Engram gate backward on the current stream (inputs validated upstream).

    Args:
        grad_out: ``(T, m, H)`` bf16, ``T > 0``.
        hidden_states: ``x`` ``(T, m, H)`` bf16 (forward input).
        kv: ``(T, m+1, H)`` bf16.
        weight_fused: ``(m, H)`` f32.
        dot, gate_score, rstd_x, rstd_k: ``(T, m)`` f32 saved by the forward.
        image_token_mask: ``(T,)`` bool or None; masked tokens get ``grad_x = grad_out``, ``grad_kv = 0``.
        clamp_value: signed-sqrt clamp (runtime fp32 scalar).
        grad_hidden_states: ``(T, m, H)`` bf16, written.
        grad_kv: ``(T, m+1, H)`` bf16, written.
        grad_w_partial: ``(P, m, H)`` f32, every row written (row ``p`` = worker ``p``'s sum).
        residual: the forward added the residual (``grad_x`` includes ``grad_out``); False: it did not.
    """
    key = BACKWARD.key(hidden_states, grad_w_partial, image_token_mask, residual)
    kernel, pipelined = BACKWARD.compiled(key)
    per_worker = -(-hidden_states.shape[0] // key.num_partials)
    if pipelined is not None and per_worker <= BWD_TUNING.pipelined_tokens_per_worker:
        kernel = pipelined
    args = [grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k]
    if key.has_mask:
        args.append(image_token_mask)
    args += [float(clamp_value), grad_hidden_states, grad_kv, grad_w_partial]
    kernel(*args)


__all__ = public_names(__name__)
