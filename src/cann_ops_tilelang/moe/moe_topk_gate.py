"""The scored top-k gate of a DeepSeek-style MoE layer and its backward (docs/ops/moe.md#moe_topk_gate): scores
``u = sqrt(softplus(logits))``, the top ``k`` experts by ``u + bias``, weights from the unbiased ``u``."""

from typing import Optional

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, check_float, check_int, check_same_device, check_tensor
from .._library import declare
from ._common import F32, check_k, check_rows

__all__ = ["moe_topk_gate_backward", "moe_topk_gate_forward"]

I32, I64 = torch.int32, torch.int64


def _check_options(err: OpError, tokens: int, experts: int, k: int, num_shared_experts, mask, bias, image_bias,
                   image_token_mask, fix_routing_mask, fixed_topk_idx, to_physical_map, logical_count) -> int:
    """The optional tensors of the forward (each alone, then the pairs that go together); returns the number of
    logical experts ``E + shared``."""
    shared = check_int(err, "num_shared_experts", num_shared_experts)
    if not 0 <= shared <= limits.MOE_TOPK.high - k:
        raise err.value("num_shared_experts", f"expected 0 to {limits.MOE_TOPK.high - k} (k + shared <= "
                                              f"{limits.MOE_TOPK.high}), got {shared}")
    if mask is not None:
        check_tensor(err, "mask", mask, dtype=torch.bool, shape=(tokens,))
    if bias is not None:
        check_tensor(err, "bias", bias, dtype=F32, shape=(experts,))
    if (image_bias is None) != (image_token_mask is None):
        given, missing = ("image_bias", "image_token_mask") if image_token_mask is None else \
            ("image_token_mask", "image_bias")
        raise err.value(missing, f"expected a tensor since '{given}' is given (both or neither), got None")
    if image_bias is not None:
        check_tensor(err, "image_bias", image_bias, dtype=F32, shape=(experts,))
        check_tensor(err, "image_token_mask", image_token_mask, dtype=torch.bool, shape=(tokens,))
    if (fix_routing_mask is None) != (fixed_topk_idx is None):
        given, missing = ("fix_routing_mask", "fixed_topk_idx") if fixed_topk_idx is None else \
            ("fixed_topk_idx", "fix_routing_mask")
        raise err.value(missing, f"expected a tensor since '{given}' is given (both or neither), got None")
    if fixed_topk_idx is not None:
        check_tensor(err, "fix_routing_mask", fix_routing_mask, dtype=torch.bool, shape=(tokens,))
        check_tensor(err, "fixed_topk_idx", fixed_topk_idx, dtype=I64, shape=(tokens, k))
    logical = experts + shared
    if (to_physical_map is None) != (logical_count is None):
        given, missing = ("to_physical_map", "logical_count") if logical_count is None else \
            ("logical_count", "to_physical_map")
        raise err.value(missing, f"expected a tensor since '{given}' is given (both or neither), got None")
    if to_physical_map is not None:
        replicas = check_tensor(err, "to_physical_map", to_physical_map, dtype=I32, shape=(logical, None)).shape[1]
        if replicas < 1:
            raise err.value("to_physical_map", f"expected at least one replica column, got shape "
                                               f"{tuple(to_physical_map.shape)}")
        check_tensor(err, "logical_count", logical_count, dtype=I32, shape=(logical,))
    return logical


@declare("moe_topk_gate_forward", tokens="logits",
         outputs=("topk_idx", "topk_weights", "unmapped_topk_idx", "scores"))
def moe_topk_gate_forward(
    logits: Tensor,
    k: int,
    num_shared_experts: int = 0,
    routed_scaling_factor: float = 1.0,
    ep_rank: int = 0,
    mask: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    image_bias: Optional[Tensor] = None,
    image_token_mask: Optional[Tensor] = None,
    fix_routing_mask: Optional[Tensor] = None,
    fixed_topk_idx: Optional[Tensor] = None,
    to_physical_map: Optional[Tensor] = None,
    logical_count: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The scored top-k gate (docs/ops/moe.md#moe_topk_gate has the math and the order of the sums).

    Per routed token: ``u = sqrt(softplus(logits))``; the ``k`` experts of the stable descending order of
    ``fl(u + b)`` (``b = image_bias`` for image tokens, else ``bias``, else 0), or the ``fixed_topk_idx`` of the
    row where ``fix_routing_mask`` is set; weights ``fl(fl(u_j / fl(1e-20 + S)) * routed_scaling_factor)``, ``S``
    the pairwise sum of the picked ``u_j``; the shared experts ``E .. E + shared - 1`` appended with weight 1;
    then each id ``i`` mapped to ``to_physical_map[i, (ep_rank + t * 23333) % logical_count[i]]``. Tokens whose
    ``mask`` is False get ids -1, weights 0 and scores 0.

    Args:
        logits: ``(T, E)`` fp32, contiguous, finite; ``E`` in ``limits.MOE_EXPERTS``, any ``T >= 0``.
        k: routed experts per token, in ``limits.MOE_TOPK`` and at most ``E``.
        num_shared_experts: shared experts appended to every routed token, ``k + shared <= 32``.
        routed_scaling_factor: the routed weights' factor (a finite fp32 number).
        ep_rank: this rank's index in the replica choice (an int ``>= 0``).
        mask: ``(T,)`` bool, the tokens routed (default all).
        bias, image_bias: ``(E,)`` fp32, added to ``u`` for the ranking only; ``image_bias`` for the tokens of
            ``image_token_mask`` ``(T,)`` bool (both or neither).
        fix_routing_mask, fixed_topk_idx: ``(T,)`` bool and ``(T, k)`` int64 (both or neither): the rows where the
            mask is set take these logical ids (in ``[0, E)``, or -1: no expert, weight 0) instead of ranking.
        to_physical_map, logical_count: ``(E + shared, R)`` and ``(E + shared,)`` int32 (both or neither): the
            replicas of each logical expert and how many of its ``R`` columns are used (``1 <= count <= R``).

    Returns:
        ``(topk_idx, topk_weights, unmapped_topk_idx, scores)``: ``(T, k + shared)`` int64 (physical ids when
        mapped), ``(T, k + shared)`` fp32, ``(T, k)`` int64 (the routed logical ids, for the backward and for
        fixed routing later) and ``u`` ``(T, E)`` fp32 (for the backward), all contiguous.
    """
    err = OpError("moe_topk_gate_forward")
    tokens, experts = check_rows(err, "logits", logits, limits.MOE_EXPERTS)
    check_k(err, "k", k, experts)
    _check_options(err, tokens, experts, k, num_shared_experts, mask, bias, image_bias, image_token_mask,
                   fix_routing_mask, fixed_topk_idx, to_physical_map, logical_count)
    check_float(err, "routed_scaling_factor", routed_scaling_factor, minimum=-float("inf"))
    if check_int(err, "ep_rank", ep_rank) < 0:
        raise err.value("ep_rank", f"expected an int >= 0, got {ep_rank}")
    check_same_device(err, [("logits", logits), ("mask", mask), ("bias", bias), ("image_bias", image_bias),
                            ("image_token_mask", image_token_mask), ("fix_routing_mask", fix_routing_mask),
                            ("fixed_topk_idx", fixed_topk_idx), ("to_physical_map", to_physical_map),
                            ("logical_count", logical_count)])
    width = k + num_shared_experts
    return (logits.new_empty((tokens, width), dtype=I64), logits.new_empty((tokens, width)),
            logits.new_empty((tokens, k), dtype=I64), logits.new_empty((tokens, experts)))


# DTensor sharding (docs/distributed.md): token-wise; the biases and the replica map are replicated. With a replica
# map, the replica of a token depends on its row in the local tensor (the peer's convention: each EP rank routes its
# own tokens), so a token-sharded call picks replicas by each shard's rows.
moe_topk_gate_forward.sharding({"logits": "S0", "mask": "S0", "image_token_mask": "S0", "fix_routing_mask": "S0",
                                "fixed_topk_idx": "S0", "returns": ("S0", "S0", "S0", "S0")})


@declare("moe_topk_gate_backward", tokens="scores", outputs=("grad_logits",))
def moe_topk_gate_backward(
    grad_topk_weights: Tensor,
    scores: Tensor,
    unmapped_topk_idx: Tensor,
    topk_weights: Tensor,
    routed_scaling_factor: float = 1.0,
    mask: Optional[Tensor] = None,
    grad_scores_sum: Optional[Tensor] = None,
) -> Tensor:
    """The gradient of the forward's routed weights (and of a sequence-level sum of ``u / sum(u)``) with respect to
    the logits (docs/ops/moe.md#moe_topk_gate has the math and the tolerance).

    ``grad_logits = u'(x) · (route + aux)``: ``route`` scatters ``(s · g_j - <g, w>) / D`` to the routed ids
    ``j >= 0`` (``D = 1e-20 + sum u_j``; repeated ids add up), ``aux = (h - <h, u> / U) / U`` with
    ``U = sum_e u_e`` and ``h`` the row of ``grad_scores_sum`` of the token's sequence (zero for tokens ``mask``
    leaves out), ``u'(x) = (1 - exp(-u^2)) / (2u)`` recovered from ``u`` (0 at ``u = 0``).

    Args:
        grad_topk_weights: ``(T, k)`` fp32, the gradient of the routed columns of ``topk_weights``.
        scores: ``(T, E)`` fp32, the forward's ``u``; ``E`` in ``limits.MOE_EXPERTS``, any ``T >= 0``.
        unmapped_topk_idx: ``(T, k)`` int64, the forward's routed logical ids (``-1``: none); ``k`` in
            ``limits.MOE_TOPK``, at most ``E``.
        topk_weights: ``(T, k)`` fp32, the forward's routed weights (its first ``k`` columns, contiguous).
        routed_scaling_factor: the forward's ``s``.
        mask: ``(T,)`` bool, the tokens routed (default all): the others get no aux term.
        grad_scores_sum: ``(S, E)`` fp32, the gradient of each sequence's sum of ``u / U`` over its tokens; the
            ``T`` tokens are ``S`` sequences of ``T / S`` consecutive tokens (``S`` divides ``T``).

    Returns:
        ``grad_logits`` ``(T, E)`` fp32, contiguous.
    """
    err = OpError("moe_topk_gate_backward")
    tokens, experts = check_rows(err, "scores", scores, limits.MOE_EXPERTS)
    idx = check_tensor(err, "unmapped_topk_idx", unmapped_topk_idx, dtype=I64, shape=(tokens, None))
    check_k(err, "unmapped_topk_idx", idx.shape[1], experts)
    k = idx.shape[1]
    check_tensor(err, "grad_topk_weights", grad_topk_weights, dtype=F32, shape=(tokens, k))
    check_tensor(err, "topk_weights", topk_weights, dtype=F32, shape=(tokens, k))
    check_float(err, "routed_scaling_factor", routed_scaling_factor, minimum=-float("inf"))
    if mask is not None:
        check_tensor(err, "mask", mask, dtype=torch.bool, shape=(tokens,))
    if grad_scores_sum is not None:
        seqs = check_tensor(err, "grad_scores_sum", grad_scores_sum, dtype=F32, shape=(None, experts)).shape[0]
        if (seqs < 1 and tokens > 0) or (seqs >= 1 and tokens % seqs):
            raise err.value("grad_scores_sum", f"expected a number of sequences S >= 1 that divides T = {tokens} "
                                               f"(T / S tokens each), got shape {tuple(grad_scores_sum.shape)}")
    check_same_device(err, [("grad_topk_weights", grad_topk_weights), ("scores", scores),
                            ("unmapped_topk_idx", unmapped_topk_idx), ("topk_weights", topk_weights), ("mask", mask),
                            ("grad_scores_sum", grad_scores_sum)])
    return scores.new_empty((tokens, experts))


# DTensor sharding: token-wise. The sequences' gradients are sharded with the tokens, which is right where every shard
# holds whole sequences (the T / S tokens of a sequence on one shard, its row of grad_scores_sum with them).
moe_topk_gate_backward.sharding({"grad_topk_weights": "S0", "scores": "S0", "unmapped_topk_idx": "S0",
                                 "topk_weights": "S0", "mask": "S0", "grad_scores_sum": "S0", "returns": "S0"})
