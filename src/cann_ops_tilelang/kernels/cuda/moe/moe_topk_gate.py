"""CUDA kernel of ``moe_topk_gate_forward`` (docs/ops/moe.md#moe_topk_gate): the scored top-k gate.

One warp per token, lane ``l`` holding the experts ``l, l + 32, ...`` of its row (as ``topk_gate``). Each lane
computes ``u = sqrt(softplus(x))`` of its logits (``log1pf(expf(x))`` below 20, ``x`` above; an IEEE square root),
stores them (the ``scores`` output) and ranks on ``fl(u + b)``. Each of the ``k`` rounds picks the row's maximum and
the smallest id holding it (a warp max, then a warp min), or reads the fixed id of the round; the ``u`` of the pick
comes back by a warp max over the one lane holding it (exact). Lane ``j < k`` keeps the pick of round ``j``; the sum
of the picked ``u`` is the xor-shuffle butterfly (lane 0's order is the contract's pairwise tree, and every lane
ends with the same bits), the weights ``fl(fl(u / fl(1e-20 + S)) * scale)`` with IEEE operations; lanes ``k ..
k + shared - 1`` hold the shared experts; then the replica map. Optional tensors the key says are absent are passed
as one-element placeholders the kernel never reads. ``T`` is dynamic.
"""

from ....moe._common import (DENOMINATOR_EPS, GATE_BACKWARD_CASES, GATE_CASES, REPLICA_STRIDE, SOFTPLUS_LINEAR,
                             SOFTPLUS_SERIES, gate_backward_arguments, gate_forward_arguments, gate_key,
                             require_topk)
from ..._kernel import Kernel, compile_key, kernel_module
from ._warps import WARP, WarpPlan


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


# 4 tokens per CTA, as topk_gate (not measured yet: the first GPU run of the benchmark sets it, docs/perf/<chip>/moe.md)
MOE_TOPK_GATE_FORWARD_PLAN = WarpPlan(warps=4)


def build_moe_topk_gate_forward(experts: int, k: int, shared: int, has_mask: bool, has_bias: bool, has_image: bool,
                                has_fixed: bool, has_map: bool):
    """Builds the gate of ``E = experts`` logits per row, ``k`` routed and ``shared`` shared experts.

    Returns:
        ``T.prim_func(logits (T, E) f32, mask (*,) bool, bias (*,) f32, image_bias (*,) f32, image_token_mask (*,)
        bool, fix_routing_mask (*,) bool, fixed_topk_idx (*, k) i64, to_physical_map (*, *) i32, logical_count (*,)
        i32, routed_scaling_factor f32, ep_rank i32, topk_idx (T, k + shared) i64, topk_weights (T, k + shared) f32,
        unmapped_topk_idx (T, k) i64, scores (T, E) f32)``; the optional tensors have their own dynamic sizes (their
        placeholders have one element), ``T`` is dynamic.
    """
    from tilelang import language as T

    E, K = require_topk("moe_topk_gate_forward", experts, k)
    W = require_topk("moe_topk_gate_forward", experts + shared, k + shared)[1]
    per_lane = -(-E // WARP)
    warps = MOE_TOPK_GATE_FORWARD_PLAN.warps
    f32, i32, i64 = T.float32, T.int32, T.int64
    num_tokens = T.dynamic("num_tokens")
    n_mask, n_bias = T.dynamic("n_mask"), T.dynamic("n_bias")
    n_ibias, n_imask = T.dynamic("n_ibias"), T.dynamic("n_imask")
    n_fmask, n_fixed, n_logical, n_replicas = (T.dynamic("n_fmask"), T.dynamic("n_fixed"), T.dynamic("n_logical"),
                                               T.dynamic("n_replicas"))
    n_count = T.dynamic("n_count")

    @T.prim_func
    def moe_topk_gate_forward_cuda(
        logits: T.Tensor((num_tokens, E), f32), mask: T.Tensor((n_mask,), T.bool), bias: T.Tensor((n_bias,), f32),
        image_bias: T.Tensor((n_ibias,), f32), image_token_mask: T.Tensor((n_imask,), T.bool),
        fix_routing_mask: T.Tensor((n_fmask,), T.bool), fixed_topk_idx: T.Tensor((n_fixed, K), i64),
        to_physical_map: T.Tensor((n_logical, n_replicas), i32), logical_count: T.Tensor((n_count,), i32),
        routed_scaling_factor: f32, ep_rank: i32,
        topk_idx: T.Tensor((num_tokens, W), i64), topk_weights: T.Tensor((num_tokens, W), f32),
        unmapped_topk_idx: T.Tensor((num_tokens, K), i64), scores: T.Tensor((num_tokens, E), f32),
    ):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=warps * WARP) as bid:
            tid = T.get_thread_binding()
            lane = tid % WARP
            row = bid * warps + tid // WARP
            u = T.alloc_local((per_lane,), f32)
            s = T.alloc_local((per_lane,), f32)
            x = T.alloc_var(f32)
            routed = T.alloc_var(T.bool)
            image = T.alloc_var(T.bool)
            fixed = T.alloc_var(T.bool)
            top = T.alloc_var(f32)
            got = T.alloc_var(f32)
            own = T.alloc_var(i32)
            pick = T.alloc_var(i32)
            mine = T.alloc_var(i64)
            mine_u = T.alloc_var(f32)
            acc = T.alloc_var(f32)
            den = T.alloc_var(f32)
            weight = T.alloc_var(f32)
            expert = T.alloc_var(i64)
            mine = -1
            mine_u = 0.0
            if row < num_tokens:  # the same for the 32 lanes of a warp: the shuffles see the whole warp
                routed = True
                if has_mask:
                    routed = mask[row]
                if not routed:
                    for j in T.unroll(per_lane):
                        if j * WARP + lane < E:
                            scores[row, j * WARP + lane] = T.float32(0)
                    if lane < W:
                        topk_idx[row, lane] = T.int64(-1)
                        topk_weights[row, lane] = T.float32(0)
                    if lane < K:
                        unmapped_topk_idx[row, lane] = T.int64(-1)
                else:
                    image = False
                    if has_image:
                        image = image_token_mask[row]
                    fixed = False
                    if has_fixed:
                        fixed = fix_routing_mask[row]
                    for j in T.unroll(per_lane):
                        if j * WARP + lane < E:
                            x = logits[row, j * WARP + lane]
                            u[j] = T.ieee_fsqrt(T.if_then_else(x > T.float32(SOFTPLUS_LINEAR), x, T.log1p(T.exp(x))))
                            scores[row, j * WARP + lane] = u[j]
                            if has_image and image:
                                s[j] = T.ieee_add(u[j], image_bias[j * WARP + lane])
                            elif has_bias:
                                s[j] = T.ieee_add(u[j], bias[j * WARP + lane])
                            else:
                                s[j] = u[j]
                        else:
                            u[j] = -T.infinity(f32)
                            s[j] = -T.infinity(f32)
                    for r in T.unroll(K):
                        if fixed:
                            pick = T.cast(fixed_topk_idx[row, r], i32)
                        else:
                            top = s[0]
                            for j in T.unroll(1, per_lane):
                                top = T.max(top, s[j])
                            top = T.warp_reduce_max(top)
                            own = E  # no match in this lane
                            for jj in T.unroll(per_lane):  # descending: the last match kept is the lane's smallest id
                                if s[per_lane - 1 - jj] == top:
                                    own = (per_lane - 1 - jj) * WARP + lane
                            pick = T.warp_reduce_min(own)
                            for j in T.unroll(per_lane):
                                if j * WARP + lane == pick:
                                    s[j] = -T.infinity(f32)
                        got = -T.infinity(f32)
                        for j in T.unroll(per_lane):
                            if j * WARP + lane == pick:
                                got = u[j]
                        got = T.warp_reduce_max(got)  # one lane holds u[pick] (u >= 0); none for a fixed -1
                        if lane == r:
                            mine = T.cast(pick, i64)
                            mine_u = T.max(got, T.float32(0))
                    acc = mine_u
                    for span in (16, 8, 4, 2, 1):
                        acc = T.ieee_add(acc, T.shfl_xor(acc, span))
                    den = T.ieee_add(T.float32(DENOMINATOR_EPS), acc)
                    if lane < K:
                        weight = T.ieee_mul(T.ieee_fdiv(mine_u, den), routed_scaling_factor)
                        expert = mine
                        unmapped_topk_idx[row, lane] = mine
                    else:
                        weight = T.float32(1)
                        expert = T.cast(E - K + lane, i64)
                    if has_map:
                        if lane < W and expert >= 0:
                            replica = (T.cast(ep_rank, i64) + T.cast(row, i64) * REPLICA_STRIDE) % T.cast(
                                logical_count[expert], i64)
                            expert = T.cast(to_physical_map[expert, replica], i64)
                    if lane < W:
                        topk_idx[row, lane] = expert
                        topk_weights[row, lane] = weight

    return moe_topk_gate_forward_cuda


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Independent of the hidden size: the edges of E and k without options, the peer's (72, 6) with every option and
    two shared experts, DeepSeek's (256, 8) with a bias and a mask."""
    return {f"moe_topk_gate_forward_{name}": GateKey(*fields) for name, fields in GATE_CASES.items()}


MOE_TOPK_GATE_FORWARD = Kernel(
    "moe_topk_gate_forward", GateKey, build_moe_topk_gate_forward, cases=_cases,
    derive=lambda *args: gate_key("moe_topk_gate_forward", GateKey, *args))


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


def softplus_derivative(T, u):
    """``u'(x) = (1 - exp(-u^2)) / (2u)`` from ``u`` (TileLang expression; 0 at ``u = 0``): the series below
    ``u^2 = SOFTPLUS_SERIES`` (docs/ops/moe.md#moe_topk_gate)."""
    v = u * u
    series = T.float32(0.5) * u * (T.float32(1) - v * (T.float32(1 / 2) - v * (T.float32(1 / 6) - v * (
        T.float32(1 / 24) - v * (T.float32(1 / 120) - v * T.float32(1 / 720))))))
    return T.if_then_else(v < T.float32(SOFTPLUS_SERIES), series,
                          (T.float32(1) - T.exp(-v)) / (T.float32(2) * u))


def build_moe_topk_gate_backward(experts: int, k: int, has_aux: bool):
    """Builds the backward of the gate of ``E = experts`` scores, ``k`` routed experts.

    One warp per token, as the forward: lanes ``j < k`` hold the routed ids, weights and gradients, the sums of the
    picked ``u`` and of ``g_j w_j`` are xor butterflies, the route terms go to the lanes holding their experts one
    pick after the other (shuffled from lane ``j``: repeated ids add up in pick order, no atomics); with ``has_aux``
    the lanes' sums of ``u`` and ``h u`` (ascending ids per lane, then a butterfly) give the aux term.

    Returns:
        ``T.prim_func(grad_topk_weights (T, k) f32, scores (T, E) f32, unmapped_topk_idx (T, k) i64, topk_weights
        (T, k) f32, routed_scaling_factor f32, mask (*,) bool, grad_scores_sum (S, E) f32, grad_logits (T, E) f32)``;
        ``T`` and ``S`` dynamic (the placeholders ``(1,)`` and ``(1, E)`` without ``has_aux``).
    """
    from tilelang import language as T

    E, K = require_topk("moe_topk_gate_backward", experts, k)
    per_lane = -(-E // WARP)
    warps = MOE_TOPK_GATE_FORWARD_PLAN.warps
    f32, i32, i64 = T.float32, T.int32, T.int64
    num_tokens, num_seqs, n_mask = T.dynamic("num_tokens"), T.dynamic("num_seqs"), T.dynamic("n_mask")

    @T.prim_func
    def moe_topk_gate_backward_cuda(
        grad_topk_weights: T.Tensor((num_tokens, K), f32), scores: T.Tensor((num_tokens, E), f32),
        unmapped_topk_idx: T.Tensor((num_tokens, K), i64), topk_weights: T.Tensor((num_tokens, K), f32),
        routed_scaling_factor: f32, mask: T.Tensor((n_mask,), T.bool),
        grad_scores_sum: T.Tensor((num_seqs, E), f32), grad_logits: T.Tensor((num_tokens, E), f32),
    ):
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=warps * WARP) as bid:
            tid = T.get_thread_binding()
            lane = tid % WARP
            row = bid * warps + tid // WARP
            u = T.alloc_local((per_lane,), f32)
            h = T.alloc_local((per_lane,), f32)
            grad = T.alloc_local((per_lane,), f32)
            expert = T.alloc_var(i32)
            g = T.alloc_var(f32)
            pu = T.alloc_var(f32)
            gw = T.alloc_var(f32)
            den = T.alloc_var(f32)
            dot = T.alloc_var(f32)
            route = T.alloc_var(f32)
            rid = T.alloc_var(i32)
            rval = T.alloc_var(f32)
            usum = T.alloc_var(f32)
            hsum = T.alloc_var(f32)
            inv = T.alloc_var(f32)
            seq = T.alloc_var(i32)
            if row < num_tokens:  # the same for the 32 lanes of a warp: the shuffles see the whole warp
                for j in T.unroll(per_lane):
                    u[j] = T.float32(0)
                    h[j] = T.float32(0)
                    grad[j] = T.float32(0)
                    if j * WARP + lane < E:
                        u[j] = scores[row, j * WARP + lane]
                expert = -1
                g = T.float32(0)
                pu = T.float32(0)
                gw = T.float32(0)
                if lane < K:
                    expert = T.cast(unmapped_topk_idx[row, lane], i32)
                    if expert >= 0:
                        g = grad_topk_weights[row, lane]
                        pu = scores[row, expert]
                        gw = T.ieee_mul(g, topk_weights[row, lane])
                den = pu
                dot = gw
                for span in (16, 8, 4, 2, 1):
                    den = T.ieee_add(den, T.shfl_xor(den, span))
                    dot = T.ieee_add(dot, T.shfl_xor(dot, span))
                den = T.ieee_add(T.float32(DENOMINATOR_EPS), den)
                route = T.ieee_fdiv(T.ieee_add(T.ieee_mul(routed_scaling_factor, g), -dot), den)
                for r in T.unroll(K):
                    rid = T.shfl_sync(expert, r)
                    rval = T.shfl_sync(route, r)
                    for j in T.unroll(per_lane):
                        if j * WARP + lane == rid:
                            grad[j] = T.ieee_add(grad[j], rval)
                if has_aux:
                    seq = row // (num_tokens // num_seqs)
                    usum = T.float32(0)
                    hsum = T.float32(0)
                    for j in T.unroll(per_lane):
                        if j * WARP + lane < E:
                            h[j] = grad_scores_sum[seq, j * WARP + lane]
                        usum = T.ieee_add(usum, u[j])
                        hsum = T.ieee_add(hsum, T.ieee_mul(h[j], u[j]))
                    for span in (16, 8, 4, 2, 1):
                        usum = T.ieee_add(usum, T.shfl_xor(usum, span))
                        hsum = T.ieee_add(hsum, T.shfl_xor(hsum, span))
                    inv = T.float32(0)
                    if mask[row]:
                        inv = T.ieee_fdiv(T.float32(1), usum)
                    for j in T.unroll(per_lane):
                        grad[j] = T.ieee_add(grad[j], T.ieee_mul(T.ieee_add(h[j], -T.ieee_mul(hsum, inv)), inv))
                for j in T.unroll(per_lane):
                    if j * WARP + lane < E:
                        grad_logits[row, j * WARP + lane] = T.ieee_mul(softplus_derivative(T, u[j]), grad[j])

    return moe_topk_gate_backward_cuda


MOE_TOPK_GATE_BACKWARD = Kernel(
    "moe_topk_gate_backward", GateBackwardKey, build_moe_topk_gate_backward,
    cases=lambda hidden_size, hc_mult: {f"moe_topk_gate_backward_{name}": GateBackwardKey(*fields)
                                        for name, fields in GATE_BACKWARD_CASES.items()},
    derive=lambda scores, unmapped_topk_idx, grad_scores_sum: GateBackwardKey(
        *require_topk("moe_topk_gate_backward", scores.shape[1], unmapped_topk_idx.shape[1]),
        grad_scores_sum is not None))


def moe_topk_gate_backward(grad_topk_weights, scores, unmapped_topk_idx, topk_weights, routed_scaling_factor, mask,
                           grad_scores_sum, grad_logits) -> None:
    """Launches the backward on the current stream (arguments validated upstream, ``T > 0``); without
    ``grad_scores_sum`` the mask and it go as placeholders (never read), a missing mask with it as all-true."""
    key = MOE_TOPK_GATE_BACKWARD.key(scores, unmapped_topk_idx, grad_scores_sum)
    MOE_TOPK_GATE_BACKWARD.compiled(key)(*gate_backward_arguments(
        grad_topk_weights, scores, unmapped_topk_idx, topk_weights, routed_scaling_factor, mask, grad_scores_sum,
        grad_logits))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, MOE_TOPK_GATE_FORWARD, MOE_TOPK_GATE_BACKWARD)
