"""Ascend kernel of ``engram_gate_fwd`` (OPS.md B.1.2), m = 4.

Per token t and stream h (sums over d in fp32 from bf16 inputs)::

    Sx = sum x^2   Sk = sum k^2   raw = sum x*wf*k            (k = kv[t, h], v = kv[t, m])
    rstd_x = 1/sqrt(Sx*(1/H) + eps)   rstd_k = 1/sqrt(Sk*(1/H) + eps)
    z = raw*rstd_x*rstd_k*H^-1/2      q = (z >= 0 ? +1 : -1) * sqrt(max(|z|, clamp))
    g = 1/(1 + exp(-q))               out[t, h] = bf16(x + g*v)

Scheduling: a persistent loop over tasks (token, stream pair); the grid size is even, so vector core c
always serves stream pair c % 2 and keeps that pair's rows of ``wf`` resident in UB. Pass 1 reduces the
three sums over the two x rows and two k rows, pass 2 streams v and writes the output from the cached x.
Masked tokens copy x to out (skipped when in place) and write zero statistics. Saving the statistics
and in-place operation are compile-time flags that only add or remove stores: the arithmetic of the
output is the same instruction sequence in every variant, so outputs are bitwise identical.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import functools

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .. import num_vector_cores
from .._build import UB_BUDGET_BYTES

__all__ = ["build_engram_gate_fwd", "engram_gate_fwd", "engram_gate_fwd_key", "get_engram_gate_fwd_kernel"]

_LANES = 64  # fp32 lanes per vector register
_ACCS = 2  # independent accumulators per sum (breaks the vmula dependency chain); needs H % 128 == 0
_PAIR = 2  # streams per task
_SLACK = 4 * 1024  # stats tiles + 32-byte alignment padding of the merged UB pool


def fwd_ub_bytes(hidden_size: int, stages: int) -> int:
    """UB estimate of the forward kernel (the lowered kernel's real figure is checked in tests).

    NOTE: resident wf rows of the pair: 2*H*4 = 8H bytes. Per pipeline stage: x (2 rows bf16, 4H),
    k rows reused as the output tile (4H), v (2H) = 10H. So 8H + stages*10H: H = 8192 -> 2 stages
    = 224 KiB; 3 stages fit up to H = 6400 (38H <= 248 KiB - slack).
    """
    return 8 * hidden_size + stages * 10 * hidden_size + _SLACK


def fwd_stages(hidden_size: int) -> int:
    return 3 if fwd_ub_bytes(hidden_size, 3) <= UB_BUDGET_BYTES else 2


def engram_gate_fwd_key(hidden_states, image_token_mask, save_stats: bool, inplace: bool, num_cores: int) -> tuple:
    """(H, m, save_stats, has_mask, inplace, num_cores); never T. ``inplace`` only matters with a mask."""
    _, m, hidden = hidden_states.shape
    has_mask = image_token_mask is not None
    num_cores = max(2, int(num_cores) // _PAIR * _PAIR)
    return (int(hidden), int(m), bool(save_stats), has_mask, bool(inplace) and has_mask, num_cores)


def build_engram_gate_fwd(hidden_size: int, hc_mult: int, save_stats: bool, has_mask: bool, inplace: bool, num_cores: int):
    """prim_func(x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, mask (T,) bool, out (T,m,H) bf16,
    dot/gate_score/rstd_x/rstd_k (T,m) f32, eps f32, clamp_value f32); T is a dynamic dim.

    Unused tensors (mask without ``has_mask``, stats without ``save_stats``) may be passed as None.
    """
    H, m = hidden_size, hc_mult
    assert m == 4, "the Ascend Engram gate supports hc_mult == 4 only"
    assert H % (_LANES * _ACCS) == 0
    assert num_cores % _PAIR == 0
    groups = m // _PAIR
    stages = fwd_stages(H)
    assert fwd_ub_bytes(H, stages) <= UB_BUDGET_BYTES, f"H={H} does not fit the UB"
    n_chunks = H // _LANES
    inv_h = 1.0 / H
    scale = H**-0.5  # host double rounded to an fp32 immediate
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def engram_gate_fwd_asc(
        hidden_states: T.Tensor[(num_tokens, m, H), T.bfloat16],
        kv: T.Tensor[(num_tokens, m + 1, H), T.bfloat16],
        weight_fused: T.Tensor[(m, H), T.float32],
        image_token_mask: T.Tensor[(num_tokens,), T.bool],
        out: T.Tensor[(num_tokens, m, H), T.bfloat16],
        dot: T.Tensor[(num_tokens, m), T.float32],
        gate_score: T.Tensor[(num_tokens, m), T.float32],
        rstd_x: T.Tensor[(num_tokens, m), T.float32],
        rstd_k: T.Tensor[(num_tokens, m), T.float32],
        eps: T.float32,
        clamp_value: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            wf_ub = T.alloc_shared((_PAIR, H), T.float32)
            x_ub = T.alloc_shared((_PAIR, H), T.bfloat16)
            ko_ub = T.alloc_shared((_PAIR, H), T.bfloat16)  # k rows, then the output rows
            v_ub = T.alloc_shared((H,), T.bfloat16)
            # one fp32 slot per stream of the pair, padded to a 32-byte DMA block
            dot_ub = T.alloc_shared((8,), T.float32)
            g_ub = T.alloc_shared((8,), T.float32)
            rx_ub = T.alloc_shared((8,), T.float32)
            rk_ub = T.alloc_shared((8,), T.float32)
            versions = {x_ub: stages, ko_ub: stages, v_ub: stages, g_ub: stages}
            if save_stats:
                versions.update({dot_ub: stages, rx_ub: stages, rk_ub: stages})
            T.annotate_buffer_versions(versions)

            h0 = (core_id % groups) * _PAIR
            T.copy(weight_fused[h0 : h0 + _PAIR, :], wf_ub)

            for t, grp in T.Persistent([num_tokens, groups], num_cores, core_id, group_size=groups, num_stages=stages):
                hb = grp * _PAIR  # == h0: the grid is a multiple of the group count
                if has_mask and image_token_mask[t]:
                    if not inplace:
                        T.copy(hidden_states[t, hb : hb + _PAIR, :], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                        T.copy(x_ub, out[t, hb : hb + _PAIR, :])
                    if save_stats:
                        with T.SimdVF():
                            zero = S.vdup(0.0, T.float32)
                            for j in T.unroll(_PAIR, explicit=True):
                                S.vsts(dot_ub[j], zero, dist="ONEPT_B32")
                                S.vsts(g_ub[j], zero, dist="ONEPT_B32")
                                S.vsts(rx_ub[j], zero, dist="ONEPT_B32")
                                S.vsts(rk_ub[j], zero, dist="ONEPT_B32")
                else:
                    T.copy(hidden_states[t, hb : hb + _PAIR, :], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    T.copy(kv[t, hb : hb + _PAIR, :], ko_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    # pass 1: the three sums of both streams, then the gate (lane 0 of each vector)
                    with T.SimdVF():
                        one = S.vdup(1.0, T.float32)
                        zero = S.vdup(0.0, T.float32)
                        acc = S.alloc_local((3 * _ACCS,), T.float32)  # [Sx | Sk | raw] x _ACCS
                        for j in T.unroll(_PAIR, explicit=True):
                            for a in T.unroll(3 * _ACCS, explicit=True):
                                acc[a] = zero
                            for c in T.serial(n_chunks // _ACCS):
                                for a in T.unroll(_ACCS, explicit=True):
                                    d = (c * _ACCS + a) * _LANES
                                    xf = S.vcvt(S.vld(x_ub[j, d], dist="UNPK_B16"), T.float32, part=0)
                                    kf = S.vcvt(S.vld(ko_ub[j, d], dist="UNPK_B16"), T.float32, part=0)
                                    wf = S.vld(wf_ub[j, d])
                                    S.vmula(acc[a], xf, xf)
                                    S.vmula(acc[_ACCS + a], kf, kf)
                                    S.vmula(acc[2 * _ACCS + a], S.vmul(xf, wf), kf)
                            sx = S.vcadd(S.vadd(acc[0], acc[1]))
                            sk = S.vcadd(S.vadd(acc[_ACCS], acc[_ACCS + 1]))
                            raw = S.vcadd(S.vadd(acc[2 * _ACCS], acc[2 * _ACCS + 1]))
                            rx = S.vdiv(one, S.vsqrt(S.vadds(S.vmuls(sx, inv_h), eps)))
                            rk = S.vdiv(one, S.vsqrt(S.vadds(S.vmuls(sk, inv_h), eps)))
                            z = S.vmuls(S.vmul(S.vmul(raw, rx), rk), scale)
                            root = S.vsqrt(S.vmaxs(S.vabs(z), clamp_value))
                            q = S.vsel(root, S.vneg(root), S.vcmps(z, 0.0, op="ge"))
                            g = S.vdiv(one, S.vadds(S.vexpdif(zero, q), 1.0))  # exp(0 - q)
                            S.vsts(g_ub[j], g, dist="ONEPT_B32")
                            if save_stats:
                                S.vsts(dot_ub[j], raw, dist="ONEPT_B32")
                                S.vsts(rx_ub[j], rx, dist="ONEPT_B32")
                                S.vsts(rk_ub[j], rk, dist="ONEPT_B32")
                    T.copy(kv[t, m, :], v_ub)
                    # pass 2: out = bf16(x + g*v) into the (consumed) k tile
                    with T.SimdVF():
                        gv = S.alloc_local((_PAIR,), T.float32)
                        o = S.alloc_local((_PAIR,), T.float32)
                        for j in T.unroll(_PAIR, explicit=True):
                            gv[j] = S.vld(g_ub[j], dist="BRC_B32")
                        for c in T.serial(n_chunks):
                            d = c * _LANES
                            vf = S.vcvt(S.vld(v_ub[d], dist="UNPK_B16"), T.float32, part=0)
                            for j in T.unroll(_PAIR, explicit=True):
                                o[j] = S.vcvt(S.vld(x_ub[j, d], dist="UNPK_B16"), T.float32, part=0)
                                S.vmula(o[j], vf, gv[j])
                                S.vsts(ko_ub[j, d], S.vcvt(o[j], T.bfloat16), dist="PK_B32")
                    T.copy(ko_ub, out[t, hb : hb + _PAIR, :])
                if save_stats:
                    # one scheduler task (all on the MTE3 pipe) for the four 8-byte statistic stores,
                    # shared by the masked (zeros) and unmasked branches
                    with T.Task():
                        T.copy(dot_ub[:_PAIR], dot[t, hb : hb + _PAIR])
                        T.copy(g_ub[:_PAIR], gate_score[t, hb : hb + _PAIR])
                        T.copy(rx_ub[:_PAIR], rstd_x[t, hb : hb + _PAIR])
                        T.copy(rk_ub[:_PAIR], rstd_k[t, hb : hb + _PAIR])

    return engram_gate_fwd_asc


@functools.lru_cache(maxsize=None)
def get_engram_gate_fwd_kernel(hidden_size, hc_mult, save_stats, has_mask, inplace, num_cores):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, save_stats, has_mask, inplace, num_cores)
    return jit_compile("engram_gate_fwd", key, build_engram_gate_fwd(*key))


def engram_gate_fwd(hidden_states, kv, weight_fused, image_token_mask, eps, clamp_value, out, dot, gate_score, rstd_x, rstd_k) -> None:
    """x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, mask (T,) bool | None, eps/clamp float,
    out (T,m,H) bf16 (may be ``hidden_states`` itself), dot/gate_score/rstd_x/rstd_k (T,m) f32 or all
    None. Launches on the current stream; never synchronizes."""
    save_stats = dot is not None
    inplace = out.data_ptr() == hidden_states.data_ptr()
    key = engram_gate_fwd_key(hidden_states, image_token_mask, save_stats, inplace, num_vector_cores())
    kernel = get_engram_gate_fwd_kernel(*key)
    kernel(hidden_states, kv, weight_fused, image_token_mask, out, dot, gate_score, rstd_x, rstd_k, float(eps), float(clamp_value))
