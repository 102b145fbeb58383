"""Device-free PyTorch references of the MoE routing family (docs/ops/moe.md).

The ``<op>_ref`` of a declared op takes the op's arguments and returns its outputs: the test plugin registers it as
the op's CPU kernel. Exact where the contract is (the ids: a stable sort; the weights: fp32 in the contract's
pairwise order), written from the contract, not from the kernels.
"""

import torch

F32, F64 = torch.float32, torch.float64
# the lanes of the pairwise sum of a row's weights (docs/ops/moe.md#normalize_weight)
LANES = 32


def topk_gate_ref(scores, k, int32=False):
    """The first ``k`` ids of each row in the stable descending order of its scores (equal scores: the smaller id
    first)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return order.to(torch.int32 if int32 else torch.int64).contiguous()


def pairwise_sum(w):
    """The sum of each row of ``w (T, k <= 32)`` in fp32: the row padded with zeros to 32 lanes, then halved five
    times (lane ``j`` plus lane ``j + span``, span 16, 8, 4, 2, 1). A padded zero adds nothing: ``x + 0 == x``
    but for ``-0``, which the ``1e-20`` added next hides."""
    acc = w.new_zeros(w.shape[0], LANES)
    acc[:, : w.shape[1]] = w
    span = LANES // 2
    while span:
        acc = acc[:, :span] + acc[:, span : 2 * span]
        span //= 2
    return acc[:, 0]


def normalize_weight_ref(topk_weights):
    """``denominator = fl(1e-20 + pairwise_sum(w))``, ``normalized = fl(w / denominator)``."""
    w = topk_weights.to(F32)
    total = pairwise_sum(w)
    denominator = total.new_tensor(1e-20) + total
    return denominator, w / denominator[:, None]


def normalize_weight_f64(topk_weights):
    """The float64 oracle of :func:`normalize_weight_ref` (the sum in any order)."""
    w = topk_weights.to(F64)
    denominator = w.sum(dim=1) + 1e-20
    return denominator, w / denominator[:, None]


# --- moe_topk_gate (docs/ops/moe.md#moe_topk_gate) -----------------------------------------------------------------

# the multiplier of the token's row in the replica choice, and the logit above which softplus(x) is x
REPLICA_STRIDE = 23333
SOFTPLUS_LINEAR = 20.0


def sqrt_softplus(logits):
    """``u = sqrt(softplus(x))`` in fp32 as the kernels compute it: ``sqrt(x)`` above 20, ``sqrt(log1p(exp(x)))``
    else, each function rounded (torch's CPU ``exp``, ``log1p``; the device's differ by an ulp or so: the contract
    bounds ``u`` against :func:`sqrt_softplus_f64`, not bitwise)."""
    x = logits.to(F32)
    return torch.where(x > SOFTPLUS_LINEAR, x, torch.log1p(torch.exp(x))).sqrt()


def sqrt_softplus_f64(logits):
    """The float64 oracle of :func:`sqrt_softplus` (the overflow-free form of softplus)."""
    x = logits.to(F64)
    return (x.clamp(min=0) + torch.log1p(torch.exp(-x.abs()))).sqrt()


def moe_topk_gate_from_scores(scores, k, num_shared_experts=0, routed_scaling_factor=1.0, ep_rank=0, mask=None,
                              bias=None, image_bias=None, image_token_mask=None, fix_routing_mask=None,
                              fixed_topk_idx=None, to_physical_map=None, logical_count=None):
    """The gate after the scores: ``(topk_idx, topk_weights, unmapped_topk_idx)`` from ``u = scores`` (the device
    tests pass the kernel's own ``u``: the rest is bitwise)."""
    u = scores.to(F32)
    tokens, experts = u.shape
    b = torch.zeros(tokens, experts) if bias is None else bias.to(F32).expand(tokens, experts)
    if image_bias is not None:
        b = torch.where(image_token_mask[:, None], image_bias.to(F32)[None, :], b)
    ranked = u + b if (bias is not None or image_bias is not None) else u
    ids = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :k]
    if fix_routing_mask is not None:
        ids = torch.where(fix_routing_mask[:, None], fixed_topk_idx, ids)
    picked = torch.where(ids >= 0, u.gather(1, ids.clamp(min=0)), torch.zeros((), dtype=F32))
    denominator = torch.tensor(1e-20, dtype=F32) + pairwise_sum(picked)
    weights = picked / denominator[:, None] * torch.tensor(routed_scaling_factor, dtype=F32)
    shared = torch.arange(experts, experts + num_shared_experts, dtype=torch.int64).expand(tokens, -1)
    topk_idx = torch.cat([ids, shared], dim=1)
    topk_weights = torch.cat([weights, torch.ones(tokens, num_shared_experts)], dim=1)
    if to_physical_map is not None:
        rows = torch.arange(tokens, dtype=torch.int64)[:, None].expand_as(topk_idx)
        valid = topk_idx >= 0
        logical = topk_idx.clamp(min=0)
        replica = (ep_rank + rows * REPLICA_STRIDE) % logical_count.to(torch.int64)[logical]
        topk_idx = torch.where(valid, to_physical_map.to(torch.int64)[logical, replica], topk_idx)
    if mask is not None:
        off = ~mask[:, None]
        topk_idx = topk_idx.masked_fill(off, -1)
        topk_weights = topk_weights.masked_fill(off, 0.0)
        ids = ids.masked_fill(off, -1)
    return topk_idx.contiguous(), topk_weights.contiguous(), ids.contiguous()


def moe_topk_gate_forward_ref(logits, k, num_shared_experts=0, routed_scaling_factor=1.0, ep_rank=0, mask=None,
                              bias=None, image_bias=None, image_token_mask=None, fix_routing_mask=None,
                              fixed_topk_idx=None, to_physical_map=None, logical_count=None):
    """``(topk_idx, topk_weights, unmapped_topk_idx, scores)``: :func:`sqrt_softplus` (zero on the tokens ``mask``
    leaves out), then :func:`moe_topk_gate_from_scores`."""
    u = sqrt_softplus(logits)
    if mask is not None:
        u = u.masked_fill(~mask[:, None], 0.0)
    out = moe_topk_gate_from_scores(u, k, num_shared_experts, routed_scaling_factor, ep_rank, mask, bias, image_bias,
                                    image_token_mask, fix_routing_mask, fixed_topk_idx, to_physical_map,
                                    logical_count)
    return (*out, u.contiguous())


def moe_topk_gate_forward_f64(logits, k, routed_scaling_factor=1.0, bias=None):
    """The float64 oracle of the routed part: ``(u, the top-k ids by u + bias, their weights s u_j / (1e-20 + sum
    u_j))``, everything in float64 (ids may differ from the fp32 ones where two biased scores are within an ulp)."""
    u = sqrt_softplus_f64(logits)
    ranked = u if bias is None else u + bias.to(F64)
    ids = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :k]
    picked = u.gather(1, ids)
    return u, ids, picked / (picked.sum(dim=1, keepdim=True) + 1e-20) * routed_scaling_factor


def softplus_derivative(u):
    """``u'(x) = (1 - exp(-v)) / (2u)``, ``v = u^2``, from ``u`` in fp32 as the kernels take it: the series ``u/2 (1 -
    v/2 + v^2/6 - v^3/24 + v^4/120 - v^5/720)`` below ``v = 0.1`` (0 at ``u = 0``)."""
    v = u * u
    c = [torch.tensor(c, dtype=F32) for c in (1 / 2, 1 / 6, 1 / 24, 1 / 120, 1 / 720)]
    series = 0.5 * u * (1 - v * (c[0] - v * (c[1] - v * (c[2] - v * (c[3] - v * c[4])))))
    return torch.where(v < 0.1, series, (1 - torch.exp(-v)) / (2 * u))


def moe_topk_gate_backward_ref(grad_topk_weights, scores, unmapped_topk_idx, topk_weights, routed_scaling_factor=1.0,
                               mask=None, grad_scores_sum=None):
    """``grad_logits`` in fp32 in the kernels' order: ``D = fl(1e-20 + pairwise_sum(u_j))``, ``<g, w> =
    pairwise_sum(fl(g_j w_j))``, the route terms ``fl(fl(s g_j - <g, w>) / D)`` added to a zero row in pick order; the
    aux term from ``U`` and ``<h, u>`` (sums in any order: not bitwise), then times :func:`softplus_derivative`."""
    u = scores.to(F32)
    tokens, experts = u.shape
    valid = unmapped_topk_idx >= 0
    idx = unmapped_topk_idx.clamp(min=0)
    zero = torch.zeros((), dtype=F32)
    g = torch.where(valid, grad_topk_weights, zero)
    picked = torch.where(valid, u.gather(1, idx), zero)
    den = torch.tensor(1e-20, dtype=F32) + pairwise_sum(picked)
    dot = pairwise_sum(torch.where(valid, g * topk_weights, zero))
    route = torch.where(valid, (routed_scaling_factor * g - dot[:, None]) / den[:, None], zero)
    grad = torch.zeros(tokens, experts)
    for j in range(idx.shape[1]):  # pick order: repeated ids add up in it
        grad.scatter_add_(1, idx[:, j : j + 1], route[:, j : j + 1])
    if grad_scores_sum is not None and tokens:
        h = grad_scores_sum.to(F32).repeat_interleave(tokens // grad_scores_sum.shape[0], dim=0)
        usum = u.sum(dim=1, keepdim=True)
        hsum = (h * u).sum(dim=1, keepdim=True)
        routed = torch.ones(tokens, 1, dtype=torch.bool) if mask is None else mask[:, None]
        inv = torch.where(routed, 1 / usum, zero)
        grad = grad + (h - hsum * inv) * inv
    return (softplus_derivative(u) * grad).contiguous()


def moe_topk_gate_backward_f64(grad_topk_weights, scores, unmapped_topk_idx, topk_weights, routed_scaling_factor=1.0,
                               mask=None, grad_scores_sum=None):
    """The float64 oracle of :func:`moe_topk_gate_backward_ref` (the given fp32 ``u`` and weights taken as exact;
    ``u'`` as ``-expm1(-u^2) / (2u)``)."""
    u = scores.to(F64)
    tokens, experts = u.shape
    valid = unmapped_topk_idx >= 0
    idx = unmapped_topk_idx.clamp(min=0)
    g = grad_topk_weights.to(F64) * valid
    den = (u.gather(1, idx) * valid).sum(dim=1, keepdim=True) + 1e-20
    route = (routed_scaling_factor * g - (g * topk_weights.to(F64)).sum(dim=1, keepdim=True)) / den * valid
    grad = torch.zeros(tokens, experts, dtype=F64).scatter_add_(1, idx, route)
    if grad_scores_sum is not None and tokens:
        h = grad_scores_sum.to(F64).repeat_interleave(tokens // grad_scores_sum.shape[0], dim=0)
        usum = u.sum(dim=1, keepdim=True)
        routed = torch.ones(tokens, 1, dtype=torch.bool) if mask is None else mask[:, None]
        inv = torch.where(routed, 1 / usum, torch.zeros((), dtype=F64))
        grad = grad + (h - (h * u).sum(dim=1, keepdim=True) * inv) * inv
    return torch.where(u > 0, -torch.expm1(-u * u) / (2 * u), 0.0) * grad
