"""Ascend 950 kernel of ``moe_topk_gate_forward`` (docs/ops/moe.md#moe_topk_gate): the scored top-k gate.

A persistent loop over tiles of ``rows`` tokens: the tile's logits (and its rows of the token masks and fixed ids)
go to the UB in one copy each, the biases once per core; then a SimtVF region runs one thread per token: ``u =
sqrt(softplus(x))`` of its row into the scores tile, ``fl(u + b)`` in place of the logits, ``k`` ascending scans
keeping the first strictly greater value (ties to the smaller id) or the fixed ids, the picked ``u`` summed in the
contract's pairwise order (``pairwise_steps``, the CUDA kernel's), the weights, the shared experts and the replica
map (read from global memory by the thread). The tile's outputs go back in one copy each. Optional tensors the key
says are absent are one-element placeholders never read. ``T`` is dynamic.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T

from ....limits import IntRange
from ....moe._common import (DENOMINATOR_EPS, GATE_BACKWARD_CASES, GATE_CASES, REPLICA_STRIDE, SOFTPLUS_LINEAR,
                             SOFTPLUS_SERIES, gate_backward_arguments, gate_forward_arguments, gate_key,
                             pairwise_steps, require_topk)
from ....policy import ASCEND_CASE_CORES
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._tiles import RowTilePlan


@compile_key
class GateKey:
    experts: int
    k: int
    shared: int
    has_mask: bool
    has_bias: bool
    has_image: bool
    has_fixed: bool
    has_map: bool
    num_cores: int


# 128 threads for E <= 64, 16 tokens of 512 logits: 2 x 32 KiB (logits, scores) per stage, two stages (not measured
# yet: the first NPU run of the benchmark sets it, docs/perf/ascend950/moe.md)
MOE_TOPK_GATE_FORWARD_PLAN = RowTilePlan(max_rows=128, tile_bytes=32 * 1024, stages=2)


def build_moe_topk_gate_forward(experts: int, k: int, shared: int, has_mask: bool, has_bias: bool, has_image: bool,
                                has_fixed: bool, has_map: bool, num_cores: int):
    """prim_func with the CUDA kernel's parameters (``build_moe_topk_gate_forward`` there); ``E``, ``k``, ``k +
    shared`` in ``limits.MOE_*``, ``num_cores >= 1``, else ``limits.LimitError``."""
    E, K = require_topk("moe_topk_gate_forward", experts, k)
    W = require_topk("moe_topk_gate_forward", experts + shared, k + shared)[1]
    cores = IntRange("num_cores", 1).require("moe_topk_gate_forward", num_cores)
    rows, stages = MOE_TOPK_GATE_FORWARD_PLAN.rows(E), MOE_TOPK_GATE_FORWARD_PLAN.stages
    f32, i32, i64 = T.float32, T.int32, T.int64
    num_tokens = T.dynamic("num_tokens")
    n_mask, n_bias = T.dynamic("n_mask"), T.dynamic("n_bias")
    n_ibias, n_imask = T.dynamic("n_ibias"), T.dynamic("n_imask")
    n_fmask, n_fixed, n_logical, n_replicas = (T.dynamic("n_fmask"), T.dynamic("n_fixed"), T.dynamic("n_logical"),
                                               T.dynamic("n_replicas"))
    n_count = T.dynamic("n_count")
    # the biases' UB copies: (E,) when given, a placeholder's one element else
    bias_len = E if has_bias else 1
    ibias_len = E if has_image else 1

    @T.prim_func
    def moe_topk_gate_forward_asc(
        logits: T.Tensor[(num_tokens, E), f32], mask: T.Tensor[(n_mask,), T.bool], bias: T.Tensor[(n_bias,), f32],
        image_bias: T.Tensor[(n_ibias,), f32], image_token_mask: T.Tensor[(n_imask,), T.bool],
        fix_routing_mask: T.Tensor[(n_fmask,), T.bool], fixed_topk_idx: T.Tensor[(n_fixed, K), i64],
        to_physical_map: T.Tensor[(n_logical, n_replicas), i32], logical_count: T.Tensor[(n_count,), i32],
        routed_scaling_factor: f32, ep_rank: i32,
        topk_idx: T.Tensor[(num_tokens, W), i64], topk_weights: T.Tensor[(num_tokens, W), f32],
        unmapped_topk_idx: T.Tensor[(num_tokens, K), i64], scores: T.Tensor[(num_tokens, E), f32],
    ):
        with T.Kernel(cores) as core_id:
            s_ub = T.alloc_shared((rows, E), f32)
            u_ub = T.alloc_shared((rows, E), f32)
            mask_ub = T.alloc_shared((rows,), T.bool)
            image_ub = T.alloc_shared((rows,), T.bool)
            fmask_ub = T.alloc_shared((rows,), T.bool)
            fixed_ub = T.alloc_shared((rows, K), i64)
            idx_ub = T.alloc_shared((rows, W), i64)
            w_ub = T.alloc_shared((rows, W), f32)
            unmapped_ub = T.alloc_shared((rows, K), i64)
            bias_ub = T.alloc_shared((bias_len,), f32)
            ibias_ub = T.alloc_shared((ibias_len,), f32)
            # the token masks' and fixed ids' tiles stay single (small; unused when absent)
            T.annotate_buffer_versions({s_ub: stages, u_ub: stages, idx_ub: stages, w_ub: stages, unmapped_ub: stages})
            if has_bias:
                T.copy(bias[0:E], bias_ub[0:E])
            if has_image:
                T.copy(image_bias[0:E], ibias_ub[0:E])
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, rows)], cores, core_id, group_size=1,
                                       num_stages=stages):
                row = blk * rows
                valid = T.min(rows, num_tokens - row)
                T.copy(logits[row : row + valid, :], s_ub[:valid, :])
                if has_mask:
                    T.copy(mask[row : row + valid], mask_ub[:valid])
                if has_image:
                    T.copy(image_token_mask[row : row + valid], image_ub[:valid])
                if has_fixed:
                    T.copy(fix_routing_mask[row : row + valid], fmask_ub[:valid])
                    T.copy(fixed_topk_idx[row : row + valid, :], fixed_ub[:valid, :])
                with T.SimtVF(threads=rows):
                    t = T.get_thread_binding()  # rows past `valid` work on stale data, never stored
                    x = T.alloc_var(f32)
                    best = T.alloc_var(f32)
                    pick = T.alloc_var(i32)
                    expert = T.alloc_var(i64)
                    routed = T.alloc_var(T.bool)
                    image = T.alloc_var(T.bool)
                    fixed = T.alloc_var(T.bool)
                    acc = T.alloc_local((K,), f32)
                    pu = T.alloc_local((K,), f32)
                    den = T.alloc_var(f32)
                    routed = True
                    if has_mask:
                        routed = mask_ub[t]
                    if not routed:
                        for e in T.serial(E):
                            u_ub[t, e] = T.float32(0)
                        for j in T.serial(W):
                            idx_ub[t, j] = T.int64(-1)
                            w_ub[t, j] = T.float32(0)
                        for j in T.serial(K):
                            unmapped_ub[t, j] = T.int64(-1)
                    else:
                        image = False
                        if has_image:
                            image = image_ub[t]
                        fixed = False
                        if has_fixed:
                            fixed = fmask_ub[t]
                        for e in T.serial(E):
                            x = s_ub[t, e]
                            u_ub[t, e] = T.sqrt(T.if_then_else(x > T.float32(SOFTPLUS_LINEAR), x, T.log1p(T.exp(x))))
                            if has_image and image:
                                s_ub[t, e] = u_ub[t, e] + ibias_ub[e]
                            elif has_bias:
                                s_ub[t, e] = u_ub[t, e] + bias_ub[e]
                            else:
                                s_ub[t, e] = u_ub[t, e]
                        for r in T.serial(K):
                            if fixed:
                                pick = T.cast(fixed_ub[t, r], i32)
                            else:
                                best = s_ub[t, 0]
                                pick = 0
                                for e in T.serial(1, E):
                                    if s_ub[t, e] > best:
                                        best = s_ub[t, e]
                                        pick = e
                                s_ub[t, pick] = -T.infinity(f32)
                            unmapped_ub[t, r] = T.cast(pick, i64)
                            pu[r] = T.float32(0)
                            if pick >= 0:
                                pu[r] = u_ub[t, pick]
                            acc[r] = pu[r]
                        for dst, src in pairwise_steps(K):
                            acc[dst] = acc[dst] + acc[src]
                        den = T.float32(DENOMINATOR_EPS) + acc[0]
                        for j in T.serial(W):
                            if j < K:
                                w_ub[t, j] = pu[j] / den * routed_scaling_factor
                                expert = unmapped_ub[t, j]
                            else:
                                w_ub[t, j] = T.float32(1)
                                expert = T.cast(E - K + j, i64)
                            if has_map:
                                if expert >= 0:
                                    expert = T.cast(to_physical_map[expert, (T.cast(ep_rank, i64)
                                                                             + T.cast(row + t, i64) * REPLICA_STRIDE)
                                                                    % T.cast(logical_count[expert], i64)], i64)
                            idx_ub[t, j] = expert
                T.copy(u_ub[:valid, :], scores[row : row + valid, :])
                T.copy(idx_ub[:valid, :], topk_idx[row : row + valid, :])
                T.copy(w_ub[:valid, :], topk_weights[row : row + valid, :])
                T.copy(unmapped_ub[:valid, :], unmapped_topk_idx[row : row + valid, :])

    return moe_topk_gate_forward_asc


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Independent of the hidden size: the CUDA module's cases (``GATE_CASES``)."""
    return {f"moe_topk_gate_forward_{name}": GateKey(*fields, ASCEND_CASE_CORES) for name, fields in GATE_CASES.items()}


MOE_TOPK_GATE_FORWARD = Kernel(
    "moe_topk_gate_forward", GateKey, build_moe_topk_gate_forward, cases=_cases,
    derive=lambda *args: gate_key("moe_topk_gate_forward", GateKey, *args, num_vector_cores()))


def moe_topk_gate_forward(logits, k, num_shared_experts, routed_scaling_factor, ep_rank, mask, bias, image_bias,
                          image_token_mask, fix_routing_mask, fixed_topk_idx, to_physical_map, logical_count,
                          topk_idx, topk_weights, unmapped_topk_idx, scores) -> None:
    """Launches the gate on the current stream (arguments validated upstream, ``T > 0``; ``gate_forward_arguments``
    passes the absent optional tensors as placeholders)."""
    key = MOE_TOPK_GATE_FORWARD.key(logits, k, num_shared_experts, mask, bias, image_bias, fixed_topk_idx,
                                    to_physical_map)
    MOE_TOPK_GATE_FORWARD.compiled(key)(*gate_forward_arguments(
        logits, k, routed_scaling_factor, ep_rank, mask, bias, image_bias, image_token_mask, fix_routing_mask,
        fixed_topk_idx, to_physical_map, logical_count, topk_idx, topk_weights, unmapped_topk_idx, scores))


@compile_key
class GateBackwardKey:
    experts: int
    k: int
    has_aux: bool
    num_cores: int


def build_moe_topk_gate_backward(experts: int, k: int, has_aux: bool, num_cores: int):
    """prim_func with the CUDA kernel's parameters (``build_moe_topk_gate_backward`` there): tiles of tokens in the
    UB (scores in, gradients out, the routed ids, weights and their gradients), one SIMT thread per token: the sums
    of the picked ``u`` and of ``g_j w_j`` in the pairwise order, the route terms added to the row in pick order, the
    aux term with ``grad_scores_sum`` read from global memory by the thread (the row sums in ascending ids)."""
    E, K = require_topk("moe_topk_gate_backward", experts, k)
    cores = IntRange("num_cores", 1).require("moe_topk_gate_backward", num_cores)
    rows, stages = MOE_TOPK_GATE_FORWARD_PLAN.rows(E), MOE_TOPK_GATE_FORWARD_PLAN.stages
    f32, i32, i64 = T.float32, T.int32, T.int64
    num_tokens, num_seqs, n_mask = T.dynamic("num_tokens"), T.dynamic("num_seqs"), T.dynamic("n_mask")
    mask_len = rows if has_aux else 1

    @T.prim_func
    def moe_topk_gate_backward_asc(
        grad_topk_weights: T.Tensor[(num_tokens, K), f32], scores: T.Tensor[(num_tokens, E), f32],
        unmapped_topk_idx: T.Tensor[(num_tokens, K), i64], topk_weights: T.Tensor[(num_tokens, K), f32],
        routed_scaling_factor: f32, mask: T.Tensor[(n_mask,), T.bool],
        grad_scores_sum: T.Tensor[(num_seqs, E), f32], grad_logits: T.Tensor[(num_tokens, E), f32],
    ):
        with T.Kernel(cores) as core_id:
            u_ub = T.alloc_shared((rows, E), f32)
            out_ub = T.alloc_shared((rows, E), f32)
            idx_ub = T.alloc_shared((rows, K), i64)
            w_ub = T.alloc_shared((rows, K), f32)
            g_ub = T.alloc_shared((rows, K), f32)
            mask_ub = T.alloc_shared((mask_len,), T.bool)
            T.annotate_buffer_versions({u_ub: stages, out_ub: stages, idx_ub: stages, w_ub: stages, g_ub: stages})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, rows)], cores, core_id, group_size=1,
                                       num_stages=stages):
                row = blk * rows
                valid = T.min(rows, num_tokens - row)
                T.copy(scores[row : row + valid, :], u_ub[:valid, :])
                T.copy(unmapped_topk_idx[row : row + valid, :], idx_ub[:valid, :])
                T.copy(topk_weights[row : row + valid, :], w_ub[:valid, :])
                T.copy(grad_topk_weights[row : row + valid, :], g_ub[:valid, :])
                if has_aux:
                    T.copy(mask[row : row + valid], mask_ub[:valid])
                with T.SimtVF(threads=rows):
                    t = T.get_thread_binding()  # rows past `valid` work on stale data, never stored
                    pu = T.alloc_local((K,), f32)
                    gw = T.alloc_local((K,), f32)
                    expert = T.alloc_var(i32)
                    den = T.alloc_var(f32)
                    route = T.alloc_var(f32)
                    usum = T.alloc_var(f32)
                    hsum = T.alloc_var(f32)
                    inv = T.alloc_var(f32)
                    seq = T.alloc_var(i32)
                    v = T.alloc_var(f32)
                    x = T.alloc_var(f32)
                    for e in T.serial(E):
                        out_ub[t, e] = T.float32(0)
                    for j in T.serial(K):
                        pu[j] = T.float32(0)
                        gw[j] = T.float32(0)
                        if idx_ub[t, j] >= 0:
                            pu[j] = u_ub[t, T.cast(idx_ub[t, j], i32)]
                            gw[j] = g_ub[t, j] * w_ub[t, j]
                    for dst, src in pairwise_steps(K):
                        pu[dst] = pu[dst] + pu[src]
                        gw[dst] = gw[dst] + gw[src]
                    den = T.float32(DENOMINATOR_EPS) + pu[0]
                    for j in T.serial(K):
                        expert = T.cast(idx_ub[t, j], i32)
                        if expert >= 0:
                            route = (routed_scaling_factor * g_ub[t, j] - gw[0]) / den
                            out_ub[t, expert] = out_ub[t, expert] + route
                    if has_aux:
                        seq = (row + t) // (num_tokens // num_seqs)
                        usum = T.float32(0)
                        hsum = T.float32(0)
                        for e in T.serial(E):
                            usum = usum + u_ub[t, e]
                            hsum = hsum + grad_scores_sum[seq, e] * u_ub[t, e]
                        inv = T.float32(0)
                        if mask_ub[t]:
                            inv = T.float32(1) / usum
                        for e in T.serial(E):
                            out_ub[t, e] = out_ub[t, e] + (grad_scores_sum[seq, e] - hsum * inv) * inv
                    for e in T.serial(E):
                        x = u_ub[t, e]
                        v = x * x
                        out_ub[t, e] = out_ub[t, e] * T.if_then_else(
                            v < T.float32(SOFTPLUS_SERIES),
                            T.float32(0.5) * x * (T.float32(1) - v * (T.float32(1 / 2) - v * (T.float32(1 / 6) - v * (
                                T.float32(1 / 24) - v * (T.float32(1 / 120) - v * T.float32(1 / 720)))))),
                            (T.float32(1) - T.exp(-v)) / (T.float32(2) * x))
                T.copy(out_ub[:valid, :], grad_logits[row : row + valid, :])

    return moe_topk_gate_backward_asc


MOE_TOPK_GATE_BACKWARD = Kernel(
    "moe_topk_gate_backward", GateBackwardKey, build_moe_topk_gate_backward,
    cases=lambda hidden_size, hc_mult: {f"moe_topk_gate_backward_{name}": GateBackwardKey(*fields, ASCEND_CASE_CORES)
                                        for name, fields in GATE_BACKWARD_CASES.items()},
    derive=lambda scores, unmapped_topk_idx, grad_scores_sum: GateBackwardKey(
        *require_topk("moe_topk_gate_backward", scores.shape[1], unmapped_topk_idx.shape[1]),
        grad_scores_sum is not None, num_vector_cores()))


def moe_topk_gate_backward(grad_topk_weights, scores, unmapped_topk_idx, topk_weights, routed_scaling_factor, mask,
                           grad_scores_sum, grad_logits) -> None:
    """Launches the backward on the current stream (arguments validated upstream, ``T > 0``); without
    ``grad_scores_sum`` the mask and it go as placeholders (never read), a missing mask with it as all-true."""
    key = MOE_TOPK_GATE_BACKWARD.key(scores, unmapped_topk_idx, grad_scores_sum)
    MOE_TOPK_GATE_BACKWARD.compiled(key)(*gate_backward_arguments(
        grad_topk_weights, scores, unmapped_topk_idx, topk_weights, routed_scaling_factor, mask, grad_scores_sum,
        grad_logits))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, MOE_TOPK_GATE_FORWARD, MOE_TOPK_GATE_BACKWARD)
