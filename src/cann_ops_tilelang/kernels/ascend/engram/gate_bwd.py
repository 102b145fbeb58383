"""Ascend kernel of ``engram_gate_bwd`` (OPS.md B.1.3), m = 4.

Per token t and stream h (s = H^-1/2, all fp32)::

    G  = sum go*v     c = s*rstd_x*rstd_k     active = |raw|*c >= clamp
    beta = active ? G*g*(1-g)*0.5*sqrt(c/|raw|) : 0
    ax = raw*rstd_x^2*(1/H)   ak = raw*rstd_k^2*(1/H)
    grad_x  = bf16(go + beta*(k*wf - x*ax))       grad_k = bf16(beta*(x*wf - k*ak))
    grad_v  = bf16(sum_{h=0..m-1} go_h*g_h)        grad_wf[h] += (beta*x)*k

Partition (deterministic, no atomics): the grid has ``m*G`` blocks, ``G = min(P, num_cores // m)``
workers per stream; block b serves stream ``b % m`` as worker ``q = b // m``. Worker q owns the
contiguous token range ``[q*ceil(T/G), ...)`` and the partial rows ``p = q, q+G, q+2G, ...`` (k_q rows);
it splits its range into k_q consecutive sub-ranges of (nearly) equal size, accumulates grad_wf of
sub-range i in a UB row and writes it to ``grad_w_partial[q + i*G, h]``. Every one of the P rows is
written exactly once (zeros when its sub-range is empty), the load is balanced whatever P is, and the
four stream workers of a q share their token set, so worker (q, h) also produces the value gradient
for the column slice ``[h*H/m, (h+1)*H/m)`` of its tokens from the go slices of all m streams.
Masked tokens: grad_x = go (copied), grad_kv rows and slice = 0, no grad_wf contribution.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import functools

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .. import num_vector_cores
from .._build import UB_BUDGET_BYTES

__all__ = ["build_engram_gate_bwd", "engram_gate_bwd", "engram_gate_bwd_key", "get_engram_gate_bwd_kernel"]

_LANES = 64
_BF16_LANES = 128
_ACCS = 2
_SLACK = 4 * 1024


def bwd_ub_bytes(hidden_size: int, stages: int) -> int:
    """UB estimate of the backward kernel.

    NOTE: resident: wf row (4H) + grad_wf accumulator row (4H) = 8H bytes. Per stage: go, x, k, v rows
    (4 x 2H, reused in place for grad_x, grad_k, grad_v) + the m go slices of H/m columns (2H) = 10H.
    8H + 2*10H = 28H -> 224 KiB at H = 8192; 3 stages fit up to H = 6400.
    """
    return 8 * hidden_size + stages * 10 * hidden_size + _SLACK


def bwd_stages(hidden_size: int) -> int:
    return 3 if bwd_ub_bytes(hidden_size, 3) <= UB_BUDGET_BYTES else 2


def bwd_workers_per_stream(num_partials: int, hc_mult: int, num_cores: int) -> int:
    return max(1, min(num_partials, num_cores // hc_mult))


def engram_gate_bwd_key(hidden_states, image_token_mask, grad_w_partial, num_cores: int) -> tuple:
    """(H, m, has_mask, P, num_cores); never T."""
    _, m, hidden = hidden_states.shape
    return (int(hidden), int(m), image_token_mask is not None, int(grad_w_partial.shape[0]), int(num_cores))


def build_engram_gate_bwd(hidden_size: int, hc_mult: int, has_mask: bool, num_partials: int, num_cores: int):
    """prim_func(go (T,m,H) bf16, x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, dot/gate_score/
    rstd_x/rstd_k (T,m) f32, mask (T,) bool, grad_x (T,m,H) bf16, grad_kv (T,m+1,H) bf16,
    grad_w_partial (P,m,H) f32, clamp_value f32); T is a dynamic dim. mask may be None without has_mask.
    """
    H, m, P = hidden_size, hc_mult, num_partials
    assert m == 4, "the Ascend Engram gate supports hc_mult == 4 only"
    assert H % (m * _LANES) == 0 and H % (_LANES * _ACCS) == 0
    assert P >= 1
    G = bwd_workers_per_stream(P, m, num_cores)
    grid = m * G
    rows_max = (P + G - 1) // G
    stages = bwd_stages(H)
    assert bwd_ub_bytes(H, stages) <= UB_BUDGET_BYTES, f"H={H} does not fit the UB"
    W = H // m  # value-gradient slice per stream worker
    n_chunks = H // _LANES
    w_chunks = W // _LANES
    inv_h = 1.0 / H
    scale = H**-0.5
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def engram_gate_bwd_asc(
        grad_out: T.Tensor[(num_tokens, m, H), T.bfloat16],
        hidden_states: T.Tensor[(num_tokens, m, H), T.bfloat16],
        kv: T.Tensor[(num_tokens, m + 1, H), T.bfloat16],
        weight_fused: T.Tensor[(m, H), T.float32],
        dot: T.Tensor[(num_tokens, m), T.float32],
        gate_score: T.Tensor[(num_tokens, m), T.float32],
        rstd_x: T.Tensor[(num_tokens, m), T.float32],
        rstd_k: T.Tensor[(num_tokens, m), T.float32],
        image_token_mask: T.Tensor[(num_tokens,), T.bool],
        grad_x: T.Tensor[(num_tokens, m, H), T.bfloat16],
        grad_kv: T.Tensor[(num_tokens, m + 1, H), T.bfloat16],
        grad_w_partial: T.Tensor[(P, m, H), T.float32],
        clamp_value: T.float32,
    ):
        with T.Kernel(grid) as block_id:
            h = block_id % m
            q = block_id // m
            wf_ub = T.alloc_shared((H,), T.float32)
            gw_ub = T.alloc_shared((H,), T.float32)
            go_ub = T.alloc_shared((H,), T.bfloat16)  # go row, then grad_x
            x_ub = T.alloc_shared((H,), T.bfloat16)  # x row, then grad_k
            k_ub = T.alloc_shared((H,), T.bfloat16)
            v_ub = T.alloc_shared((H,), T.bfloat16)  # v row, then grad_v in this worker's slice
            cols_ub = T.alloc_shared((m, W), T.bfloat16)  # go[t, 0..m-1, slice]
            st_ub = T.alloc_shared((4, 8), T.float32)  # dot, g, rstd_x, rstd_k rows of the token
            T.annotate_buffer_versions(
                {go_ub: stages, x_ub: stages, k_ub: stages, v_ub: stages, cols_ub: stages, st_ub: stages}
            )
            T.copy(weight_fused[h, :], wf_ub)

            per_worker = T.ceildiv(num_tokens, G)
            lo = T.min(q * per_worker, num_tokens)
            hi = T.min(lo + per_worker, num_tokens)
            n_rows = (P - q + G - 1) // G  # partial rows owned by worker q (runtime, >= 1)
            # NOTE: the row loop has the compile-time trip count ceil(P/G) (a runtime trip count makes
            # the auto-scheduler much slower); workers owning fewer rows run an empty last sub-range and
            # skip its store.
            for i in T.serial(rows_max):
                t0 = lo + (T.min(i, n_rows) * (hi - lo)) // n_rows
                t1 = lo + (T.min(i + 1, n_rows) * (hi - lo)) // n_rows
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for c in T.serial(n_chunks):
                        S.vsts(gw_ub[c * _LANES], zero)
                for t in T.Pipelined(t0, t1, num_stages=stages):
                    T.copy(grad_out[t, h, :], go_ub)
                    if has_mask and image_token_mask[t]:
                        with T.SimdVF():
                            zb = S.vdup(0.0, T.bfloat16)
                            for c in T.serial(H // _BF16_LANES):
                                S.vsts(x_ub[c * _BF16_LANES], zb, dist="NORM_B16")
                            for c in T.serial(W // _BF16_LANES):
                                S.vsts(v_ub[h * W + c * _BF16_LANES], zb, dist="NORM_B16")
                            if W % _BF16_LANES != 0:
                                # 64 trailing bf16 of the slice: packed store of a zero fp32 vector
                                S.vsts(v_ub[h * W + (W // _BF16_LANES) * _BF16_LANES], S.vcvt(S.vdup(0.0, T.float32), T.bfloat16), dist="PK_B32")
                    else:
                        T.copy(grad_out[t, :, h * W : h * W + W], cols_ub)
                        T.copy(hidden_states[t, h, :], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                        T.copy(kv[t, h, :], k_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                        T.copy(kv[t, m, :], v_ub)
                        with T.Task():
                            T.copy(dot[t, :], st_ub[0, 0:m])
                            T.copy(gate_score[t, :], st_ub[1, 0:m])
                            T.copy(rstd_x[t, :], st_ub[2, 0:m])
                            T.copy(rstd_k[t, :], st_ub[3, 0:m])
                        with T.SimdVF():
                            zero = S.vdup(0.0, T.float32)
                            one = S.vdup(1.0, T.float32)
                            # G = <go_h, v>
                            acc = S.alloc_local((_ACCS,), T.float32)
                            for a in T.unroll(_ACCS, explicit=True):
                                acc[a] = zero
                            for c in T.serial(n_chunks // _ACCS):
                                for a in T.unroll(_ACCS, explicit=True):
                                    d = (c * _ACCS + a) * _LANES
                                    gof = S.vcvt(S.vld(go_ub[d], dist="UNPK_B16"), T.float32, part=0)
                                    vf = S.vcvt(S.vld(v_ub[d], dist="UNPK_B16"), T.float32, part=0)
                                    S.vmula(acc[a], gof, vf)
                            dg = S.vdupv(S.vcadd(S.vadd(acc[0], acc[1])))
                            # per-(t, h) scalars, broadcast to all lanes
                            raw = S.vld(st_ub[0, h], dist="BRC_B32")
                            g = S.vld(st_ub[1, h], dist="BRC_B32")
                            rx = S.vld(st_ub[2, h], dist="BRC_B32")
                            rk = S.vld(st_ub[3, h], dist="BRC_B32")
                            c_ = S.vmuls(S.vmul(rx, rk), scale)
                            abs_raw = S.vabs(raw)
                            active = S.vcmps(S.vmul(abs_raw, c_), clamp_value, op="ge")
                            half_dsqrt = S.vmuls(S.vsqrt(S.vdiv(c_, abs_raw, mask=active)), 0.5)
                            # inactive lanes (all or none) are zeroed by the predicated multiply
                            beta = S.vmul(S.vmul(dg, S.vmul(g, S.vsub(one, g))), half_dsqrt, mask=active)
                            ax = S.vmuls(S.vmul(S.vmul(raw, rx), rx), inv_h)
                            ak = S.vmuls(S.vmul(S.vmul(raw, rk), rk), inv_h)
                            # grad_v slice, streams in ascending order
                            gs = S.alloc_local((m,), T.float32)
                            for j in T.unroll(m, explicit=True):
                                gs[j] = S.vld(st_ub[1, j], dist="BRC_B32")
                            gv = S.alloc_local((1,), T.float32)
                            for c in T.serial(w_chunks):
                                d = c * _LANES
                                gv[0] = S.vmul(S.vcvt(S.vld(cols_ub[0, d], dist="UNPK_B16"), T.float32, part=0), gs[0])
                                for j in T.unroll(1, m, explicit=True):
                                    S.vmula(gv[0], S.vcvt(S.vld(cols_ub[j, d], dist="UNPK_B16"), T.float32, part=0), gs[j])
                                S.vsts(v_ub[h * W + d], S.vcvt(gv[0], T.bfloat16), dist="PK_B32")
                            # grad_x, grad_k, grad_wf over the row
                            r = S.alloc_local((3,), T.float32)
                            for c in T.serial(n_chunks):
                                d = c * _LANES
                                gof = S.vcvt(S.vld(go_ub[d], dist="UNPK_B16"), T.float32, part=0)
                                xf = S.vcvt(S.vld(x_ub[d], dist="UNPK_B16"), T.float32, part=0)
                                kf = S.vcvt(S.vld(k_ub[d], dist="UNPK_B16"), T.float32, part=0)
                                wf = S.vld(wf_ub[d])
                                r[0] = gof
                                S.vmula(r[0], beta, S.vsub(S.vmul(kf, wf), S.vmul(xf, ax)))
                                r[1] = S.vmul(beta, S.vsub(S.vmul(xf, wf), S.vmul(kf, ak)))
                                r[2] = S.vld(gw_ub[d])
                                S.vmula(r[2], S.vmul(beta, xf), kf)
                                S.vsts(go_ub[d], S.vcvt(r[0], T.bfloat16), dist="PK_B32")
                                S.vsts(x_ub[d], S.vcvt(r[1], T.bfloat16), dist="PK_B32")
                                S.vsts(gw_ub[d], r[2])
                    with T.Task():
                        T.copy(go_ub, grad_x[t, h, :])
                        T.copy(x_ub, grad_kv[t, h, :])
                        T.copy(v_ub[h * W : h * W + W], grad_kv[t, m, h * W : h * W + W])
                if rows_max * G == P or q + i * G < P:
                    T.copy(gw_ub, grad_w_partial[q + i * G, h, :])

    return engram_gate_bwd_asc


@functools.lru_cache(maxsize=None)
def get_engram_gate_bwd_kernel(hidden_size, hc_mult, has_mask, num_partials, num_cores):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, has_mask, num_partials, num_cores)
    return jit_compile("engram_gate_bwd", key, build_engram_gate_bwd(*key))


def engram_gate_bwd(
    grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, image_token_mask, clamp_value,
    grad_hidden_states, grad_kv, grad_w_partial,
) -> None:
    """go/x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, stats (T,m) f32, mask (T,) bool | None,
    clamp float -> grad_hidden_states (T,m,H) bf16, grad_kv (T,m+1,H) bf16, grad_w_partial (P,m,H) f32
    (any P >= 1; every row written). Current stream, no sync."""
    key = engram_gate_bwd_key(hidden_states, image_token_mask, grad_w_partial, num_vector_cores())
    kernel = get_engram_gate_bwd_kernel(*key)
    kernel(
        grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, image_token_mask,
        grad_hidden_states, grad_kv, grad_w_partial, float(clamp_value),
    )
