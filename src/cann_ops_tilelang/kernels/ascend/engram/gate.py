"""Ascend 950 kernels of the op module ``gate`` (docs/ops/engram.md#gate), m = 4: ``engram_gate_forward``
(also launched by ``engram_gate_forward_inplace``) and ``engram_gate_backward``.

Forward, per token t and stream h (sums over d in fp32 from bf16 inputs)::

    Sx = sum x^2   Sk = sum k^2   raw = sum x*wf*k            (k = kv[t, h], v = kv[t, m])
    rstd_x = 1/sqrt(Sx*(1/H) + eps)   rstd_k = 1/sqrt(Sk*(1/H) + eps)
    z = raw*rstd_x*rstd_k*H^-1/2      q = (z >= 0 ? +1 : -1) * sqrt(max(|z|, clamp))
    g = 1/(1 + exp(-q))               out[t, h] = bf16(x + g*v)

A persistent loop over tasks (token, stream pair); the grid size is even, so vector core c always serves
stream pair c % 2 and keeps that pair's rows of ``wf`` resident in UB. Pass 1 reduces the three sums over
the two x rows and two k rows, pass 2 streams v and writes the output from the cached x. Masked tokens copy
x to out (skipped when in place) and write zero statistics. Saving the statistics and in-place operation
are compile-time flags that only add or remove stores: the arithmetic of the output is the same
instruction sequence in every variant, so outputs are bitwise identical. Without the residual
(``residual=False``) the output is ``bf16(g*v)`` and masked tokens get zeros.

The backward is described at :func:`build_engram_gate_backward`.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ....limits import ENGRAM_HC_MULT, ENGRAM_HIDDEN, IntRange, LimitError
from ....policy import ASCEND_CASE_CORES, GRAD_W_WORKERS
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from .._build import UB_BUDGET_BYTES


_LANES = 64  # fp32 lanes per vector register
_BF16_LANES = 128


@dataclasses.dataclass(frozen=True)
class GatePlan:
    """``accumulators`` independent accumulators per sum (they break the ``vmula`` dependency chain; needs
    H % 128 == 0); ``streams_per_task`` streams of one forward task (a pair: the grid is whole pairs);
    ``max_stages`` pipeline stages where the UB estimate allows, else ``min_stages``; ``ub_slack`` of the estimate
    for the stats tiles and the 32-byte alignment padding of the merged UB pool."""

    accumulators: int
    streams_per_task: int
    max_stages: int
    min_stages: int
    ub_slack: int


PLAN = GatePlan(accumulators=2, streams_per_task=2, max_stages=3, min_stages=2, ub_slack=4 * 1024)
_PAIR = PLAN.streams_per_task
_FWD_CORES = IntRange("num_cores", _PAIR, multiple_of=_PAIR)  # the forward's grid: whole stream pairs


def _require_sizes(where: str, hidden_size: int, hc_mult: int) -> tuple[int, int]:
    """``(H, m)`` when both are in the Engram ranges, else ``limits.LimitError``."""
    return ENGRAM_HIDDEN.require(where, hidden_size), ENGRAM_HC_MULT.require(where, hc_mult)


def _require_ub(where: str, hidden_size: int, ub_bytes: int) -> None:
    """``limits.LimitError`` where the UB estimate of a kernel at ``H`` exceeds the budget (never inside
    ``limits.ENGRAM_HIDDEN``: 224 KiB at H = 8192)."""
    if ub_bytes > UB_BUDGET_BYTES:
        raise LimitError(f"{where}: hidden size {hidden_size} needs {ub_bytes} B of UB, more than the "
                         f"{UB_BUDGET_BYTES} B budget ({ENGRAM_HIDDEN.what} must be {ENGRAM_HIDDEN.describe()})")


# UB estimates (the lowered kernels' real figures are checked in the tests): resident 8H bytes plus 10H per
# pipeline stage in both kernels, so 3 stages up to H = 6400 and 2 beyond (224 KiB at H = 8192;
# docs/perf/ascend950/engram.md, 2026-11-30 — gate forward / gate backward: UB tiles and stages).
def fwd_ub_bytes(hidden_size: int, stages: int) -> int:
    """UB estimate of the forward kernel: the pair's wf rows (8H) + per stage x, k/out and v (10H)."""
    return 8 * hidden_size + stages * 10 * hidden_size + PLAN.ub_slack


def fwd_stages(hidden_size: int) -> int:
    return PLAN.max_stages if fwd_ub_bytes(hidden_size, PLAN.max_stages) <= UB_BUDGET_BYTES else PLAN.min_stages


def bwd_ub_bytes(hidden_size: int, stages: int) -> int:
    """UB estimate of the backward kernel: wf and grad_wf rows (8H) + per stage go, x, k, v and the m go
    slices (10H)."""
    return 8 * hidden_size + stages * 10 * hidden_size + PLAN.ub_slack


def bwd_stages(hidden_size: int) -> int:
    return PLAN.max_stages if bwd_ub_bytes(hidden_size, PLAN.max_stages) <= UB_BUDGET_BYTES else PLAN.min_stages


def bwd_workers_per_stream(num_partials: int, hc_mult: int, num_cores: int) -> int:
    return max(1, min(num_partials, num_cores // hc_mult))


@compile_key
class FwdKey:
    """Compile-time key of the forward (never T): ``inplace`` only matters with a mask; ``num_cores`` is the
    launch's vector cores in whole stream pairs."""

    hidden_size: int
    hc_mult: int
    save_stats: bool
    has_mask: bool
    inplace: bool
    num_cores: int
    residual: bool = True


def _fwd_key(hidden_states, image_token_mask, out, dot, residual: bool = True) -> FwdKey:
    """Statistics saved where ``dot`` is given; in place where ``out`` is ``hidden_states``."""
    _, m, hidden = hidden_states.shape
    has_mask = image_token_mask is not None
    inplace = out.data_ptr() == hidden_states.data_ptr()
    num_cores = max(2, int(num_vector_cores()) // _PAIR * _PAIR)
    return FwdKey(int(hidden), int(m), dot is not None, has_mask, inplace and has_mask, num_cores, bool(residual))


def _fwd_cases(hidden_size: int, hc_mult: int) -> dict:
    """``engram_gate_forward_{save,nosave}_{mask,nomask}``, ``engram_gate_forward_nosave_mask_inplace`` (in place only
    changes the masked path, and never saves: docs/ops/engram.md#gate); without the residual
    ``engram_gate_forward_noresidual_{save,nosave}_{mask,nomask}`` (no in-place one); the Ascend 950's cores."""
    cases = {}
    for residual, infix in ((True, ""), (False, "noresidual_")):
        for save in (True, False):
            for mask in (False, True):
                name = f"engram_gate_forward_{infix}{'save' if save else 'nosave'}_{'mask' if mask else 'nomask'}"
                cases[name] = FwdKey(hidden_size, hc_mult, save, mask, False, ASCEND_CASE_CORES, residual)
    cases["engram_gate_forward_nosave_mask_inplace"] = FwdKey(hidden_size, hc_mult, False, True, True, ASCEND_CASE_CORES)
    return cases


def build_engram_gate_forward(hidden_size: int, hc_mult: int, save_stats: bool, has_mask: bool, inplace: bool, num_cores: int,
                          residual: bool = True):
    """prim_func(x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, mask (T,) bool, out (T,m,H) bf16,
    dot/gate_score/rstd_x/rstd_k (T,m) f32, eps f32, clamp_value f32); T is a dynamic dim.

    Unused tensors (mask without ``has_mask``, stats without ``save_stats``) may be passed as None.
    ``residual=False`` writes ``bf16(g*v)`` (masked tokens: zeros) and has no in-place variant; it only
    changes pass 2 and the masked store, so ``residual=True`` builds the kernel as before the flag.
    ``H``, ``m`` outside ``limits.ENGRAM_HIDDEN`` / ``ENGRAM_HC_MULT``, an odd ``num_cores`` or in place
    without the residual: ``limits.LimitError``.
    """
    accs, pair = PLAN.accumulators, PLAN.streams_per_task
    H, m = _require_sizes("engram_gate_forward", hidden_size, hc_mult)
    num_cores = _FWD_CORES.require("engram_gate_forward", num_cores)
    if inplace and not residual:
        raise LimitError("engram_gate_forward: no in-place kernel without the residual (hidden_states would be lost)")
    groups = m // pair
    stages = fwd_stages(H)
    _require_ub("engram_gate_forward", H, fwd_ub_bytes(H, stages))
    n_chunks = H // _LANES
    inv_h = 1.0 / H
    scale = H**-0.5  # host double rounded to an fp32 immediate
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def engram_gate_forward_asc(
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
            wf_ub = T.alloc_shared((pair, H), T.float32)
            x_ub = T.alloc_shared((pair, H), T.bfloat16)
            ko_ub = T.alloc_shared((pair, H), T.bfloat16)  # k rows, then the output rows
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

            h0 = (core_id % groups) * pair
            T.copy(weight_fused[h0 : h0 + pair, :], wf_ub)

            for t, grp in T.Persistent([num_tokens, groups], num_cores, core_id, group_size=groups, num_stages=stages):
                hb = grp * pair  # == h0: the grid is a multiple of the group count
                if has_mask and image_token_mask[t]:
                    if not residual:
                        # no residual: a masked token's gated value is 0
                        with T.SimdVF():
                            zb = S.vdup(0.0, T.bfloat16)
                            for j in T.unroll(pair, explicit=True):
                                for c in T.serial(H // _BF16_LANES):
                                    S.vsts(ko_ub[j, c * _BF16_LANES], zb, dist="NORM_B16")
                        T.copy(ko_ub, out[t, hb : hb + pair, :])
                    elif not inplace:
                        T.copy(hidden_states[t, hb : hb + pair, :], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                        T.copy(x_ub, out[t, hb : hb + pair, :])
                    if save_stats:
                        with T.SimdVF():
                            zero = S.vdup(0.0, T.float32)
                            for j in T.unroll(pair, explicit=True):
                                S.vsts(dot_ub[j], zero, dist="ONEPT_B32")
                                S.vsts(g_ub[j], zero, dist="ONEPT_B32")
                                S.vsts(rx_ub[j], zero, dist="ONEPT_B32")
                                S.vsts(rk_ub[j], zero, dist="ONEPT_B32")
                else:
                    T.copy(hidden_states[t, hb : hb + pair, :], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    T.copy(kv[t, hb : hb + pair, :], ko_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    # pass 1: the three sums of both streams, then the gate (lane 0 of each vector)
                    with T.SimdVF():
                        one = S.vdup(1.0, T.float32)
                        zero = S.vdup(0.0, T.float32)
                        acc = S.alloc_local((3 * accs,), T.float32)  # [Sx | Sk | raw] x accs
                        for j in T.unroll(pair, explicit=True):
                            for a in T.unroll(3 * accs, explicit=True):
                                acc[a] = zero
                            for c in T.serial(n_chunks // accs):
                                for a in T.unroll(accs, explicit=True):
                                    d = (c * accs + a) * _LANES
                                    xf = S.vcvt(S.vld(x_ub[j, d], dist="UNPK_B16"), T.float32, part=0)
                                    kf = S.vcvt(S.vld(ko_ub[j, d], dist="UNPK_B16"), T.float32, part=0)
                                    wf = S.vld(wf_ub[j, d])
                                    S.vmula(acc[a], xf, xf)
                                    S.vmula(acc[accs + a], kf, kf)
                                    S.vmula(acc[2 * accs + a], S.vmul(xf, wf), kf)
                            sx = S.vcadd(S.vadd(acc[0], acc[1]))
                            sk = S.vcadd(S.vadd(acc[accs], acc[accs + 1]))
                            raw = S.vcadd(S.vadd(acc[2 * accs], acc[2 * accs + 1]))
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
                    # pass 2: out = bf16(x + g*v) (no residual: bf16(g*v)) into the (consumed) k tile
                    with T.SimdVF():
                        gv = S.alloc_local((pair,), T.float32)
                        o = S.alloc_local((pair,), T.float32)
                        for j in T.unroll(pair, explicit=True):
                            gv[j] = S.vld(g_ub[j], dist="BRC_B32")
                        for c in T.serial(n_chunks):
                            d = c * _LANES
                            vf = S.vcvt(S.vld(v_ub[d], dist="UNPK_B16"), T.float32, part=0)
                            for j in T.unroll(pair, explicit=True):
                                if residual:
                                    o[j] = S.vcvt(S.vld(x_ub[j, d], dist="UNPK_B16"), T.float32, part=0)
                                    S.vmula(o[j], vf, gv[j])
                                else:
                                    o[j] = S.vmul(vf, gv[j])
                                S.vsts(ko_ub[j, d], S.vcvt(o[j], T.bfloat16), dist="PK_B32")
                    T.copy(ko_ub, out[t, hb : hb + pair, :])
                if save_stats:
                    # one scheduler task (all on the MTE3 pipe) for the four 8-byte statistic stores,
                    # shared by the masked (zeros) and unmasked branches
                    with T.Task():
                        T.copy(dot_ub[:pair], dot[t, hb : hb + pair])
                        T.copy(g_ub[:pair], gate_score[t, hb : hb + pair])
                        T.copy(rx_ub[:pair], rstd_x[t, hb : hb + pair])
                        T.copy(rk_ub[:pair], rstd_k[t, hb : hb + pair])

    return engram_gate_forward_asc


FORWARD = Kernel("engram_gate_forward", FwdKey, build_engram_gate_forward, derive=_fwd_key, cases=_fwd_cases)


def engram_gate_forward(hidden_states, kv, weight_fused, image_token_mask, eps, clamp_value, out, dot, gate_score, rstd_x, rstd_k,
                    residual=True) -> None:
    """x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, mask (T,) bool | None, eps/clamp float,
    out (T,m,H) bf16 (may be ``hidden_states`` itself), dot/gate_score/rstd_x/rstd_k (T,m) f32 or all
    None, residual bool (False: out = g*v, never in place). Launches on the current stream; never
    synchronizes."""
    kernel = FORWARD.compiled(FORWARD.key(hidden_states, image_token_mask, out, dot, residual))
    kernel(hidden_states, kv, weight_fused, image_token_mask, out, dot, gate_score, rstd_x, rstd_k, float(eps), float(clamp_value))


@compile_key
class BwdKey:
    """Compile-time key of the backward (never T): ``P = num_partials`` rows of the weight-gradient partials."""

    hidden_size: int
    hc_mult: int
    has_mask: bool
    num_partials: int
    num_cores: int
    residual: bool = True


def _bwd_key(hidden_states, image_token_mask, grad_w_partial, residual: bool = True) -> BwdKey:
    _, m, hidden = hidden_states.shape
    return BwdKey(int(hidden), int(m), image_token_mask is not None, int(grad_w_partial.shape[0]),
                  int(num_vector_cores()), bool(residual))


def _bwd_cases(hidden_size: int, hc_mult: int) -> dict:
    """``engram_gate_backward_{mask,nomask}`` and ``engram_gate_backward_noresidual_{mask,nomask}`` with the Ascend 950's cores
    and partial rows (``GRAD_W_WORKERS``)."""
    return {f"engram_gate_backward_{infix}{'mask' if mask else 'nomask'}": BwdKey(
        hidden_size, hc_mult, mask, GRAD_W_WORKERS["ascend"], ASCEND_CASE_CORES, residual)
        for residual, infix in ((True, ""), (False, "noresidual_")) for mask in (False, True)}


def build_engram_gate_backward(hidden_size: int, hc_mult: int, has_mask: bool, num_partials: int, num_cores: int,
                          residual: bool = True):
    """prim_func(go (T,m,H) bf16, x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, dot/gate_score/
    rstd_x/rstd_k (T,m) f32, mask (T,) bool, grad_x (T,m,H) bf16, grad_kv (T,m+1,H) bf16,
    grad_w_partial (P,m,H) f32, clamp_value f32); T is a dynamic dim. mask may be None without has_mask.
    ``H``, ``m`` outside ``limits.ENGRAM_HIDDEN`` / ``ENGRAM_HC_MULT`` or ``P < 1``: ``limits.LimitError``.

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
    ``residual=False`` (the forward wrote ``g*v`` alone): ``grad_x = bf16(beta*(k*wf - x*ax))``, masked
    tokens 0; ``residual=True`` builds the kernel as before the flag.
    """
    accs = PLAN.accumulators
    H, m = _require_sizes("engram_gate_backward", hidden_size, hc_mult)
    P = IntRange("num_partials", 1).require("engram_gate_backward", num_partials)
    G = bwd_workers_per_stream(P, m, num_cores)
    grid = m * G
    rows_max = (P + G - 1) // G
    stages = bwd_stages(H)
    _require_ub("engram_gate_backward", H, bwd_ub_bytes(H, stages))
    W = H // m  # value-gradient slice per stream worker
    n_chunks = H // _LANES
    w_chunks = W // _LANES
    inv_h = 1.0 / H
    scale = H**-0.5
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def engram_gate_backward_asc(
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
            # The row loop has the compile-time trip count ceil(P/G) (docs/perf/ascend950/engram.md,
            # 2026-11-30 — gate backward: UB tiles and stages); workers owning fewer rows run an empty last
            # sub-range and skip its store.
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
                            if not residual:
                                for c in T.serial(H // _BF16_LANES):
                                    S.vsts(go_ub[c * _BF16_LANES], zb, dist="NORM_B16")
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
                            acc = S.alloc_local((accs,), T.float32)
                            for a in T.unroll(accs, explicit=True):
                                acc[a] = zero
                            for c in T.serial(n_chunks // accs):
                                for a in T.unroll(accs, explicit=True):
                                    d = (c * accs + a) * _LANES
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
                                if residual:
                                    r[0] = gof
                                    S.vmula(r[0], beta, S.vsub(S.vmul(kf, wf), S.vmul(xf, ax)))
                                else:
                                    r[0] = S.vmul(beta, S.vsub(S.vmul(kf, wf), S.vmul(xf, ax)))
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

    return engram_gate_backward_asc


BACKWARD = Kernel("engram_gate_backward", BwdKey, build_engram_gate_backward, derive=_bwd_key, cases=_bwd_cases)


def engram_gate_backward(
    grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, image_token_mask, clamp_value,
    grad_hidden_states, grad_kv, grad_w_partial, residual=True,
) -> None:
    """go/x (T,m,H) bf16, kv (T,m+1,H) bf16, wf (m,H) f32, stats (T,m) f32, mask (T,) bool | None,
    clamp float -> grad_hidden_states (T,m,H) bf16, grad_kv (T,m+1,H) bf16, grad_w_partial (P,m,H) f32
    (any P >= 1; every row written); residual: the forward added x (False: grad_x without go). Current
    stream, no sync."""
    kernel = BACKWARD.compiled(BACKWARD.key(hidden_states, image_token_mask, grad_w_partial, residual))
    kernel(
        grad_out, hidden_states, kv, weight_fused, dot, gate_score, rstd_x, rstd_k, image_token_mask,
        grad_hidden_states, grad_kv, grad_w_partial, float(clamp_value),
    )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
