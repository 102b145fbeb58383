"""Checks shared by the MoE routing ops' validation (supported sizes: ``limits.MOE_*``; docs/ops/moe.md#conventions).

Per-token tensors are contiguous ``(T, W)`` rows: scores ``(T, E)`` and routing weights ``(T, k)`` in fp32, expert
ids ``(T, k)`` in int64 (int32 on request, torch_npu's convention).
"""

import functools

import torch

from .. import limits
from .._checks import OpError, check_bool, check_int, check_tensor

__all__ = ["DENOMINATOR_EPS", "F32", "GATE_BACKWARD_CASES", "GATE_CASES", "ID_DTYPES", "NORMALIZE_CASES",
           "REPLICA_STRIDE", "SOFTPLUS_LINEAR", "SOFTPLUS_SERIES", "TOPK_CASES", "check_k", "check_rows",
           "gate_backward_arguments", "gate_forward_arguments", "gate_key", "id_dtype", "pairwise_steps", "placeholder",
           "require_topk"]

F32 = torch.float32
# the expert ids' dtypes: int64 by default, int32 when asked (``int32=True``)
ID_DTYPES = {False: torch.int64, True: torch.int32}
# the edges of the ranges, read from limits (the cases below lower at both)
_E, _K = limits.MOE_EXPERTS.high, limits.MOE_TOPK.high
# the variants both backends' kernels are lowered at in the CPU tier, whatever the hidden size: (E, k, int32) of
# topk_gate (the edges of E and k, the peer's (72, 6), DeepSeek-V3's (256, 8) with both id dtypes) and k of
# normalize_weight
TOPK_CASES = ((1, 1, False), (72, 6, False), (256, 8, False), (256, 8, True), (_E, _K, False))
NORMALIZE_CASES = (1, 6, _K)
# the variants of moe_topk_gate_forward both backends lower in the CPU tier, by case name: (E, k, shared experts, then
# whether a mask, a bias, an image bias, fixed routing and a replica map are given): the edges of E and k bare, the
# peer's (72, 6) with every option and two shared experts, DeepSeek's (256, 8) with a bias and a mask
GATE_CASES = {"e1_k1": (1, 1, 0, False, False, False, False, False),
              "e72_k6_s2_all": (72, 6, 2, True, True, True, True, True),
              "e256_k8_bias_mask": (256, 8, 0, True, True, False, False, False),
              f"e{_E}_k{_K}": (_E, _K, 0, False, False, False, False, False)}
# added to the sum of a row's routing weights before dividing by it (a row of zeros gives zeros, not NaN), as the
# peer's kernels do (docs/ops/moe.md#normalize_weight)
DENOMINATOR_EPS = 1e-20
# moe_topk_gate_forward (docs/ops/moe.md#moe_topk_gate): the multiplier of the token's row in the replica choice
# (the peer's), and the logit above which softplus(x) is taken as x (fp32's log1p(exp(x)) rounds to x there)
REPLICA_STRIDE = 23333
SOFTPLUS_LINEAR = 20.0
# moe_topk_gate_backward: u'(x) = (1 - exp(-v)) / (2u), v = u^2, is taken from its series u/2 (1 - v/2 + v^2/6 - v^3/24
# + v^4/120 - v^5/720) below v = 0.1 (where 1 - exp(-v) would cancel), and the variants both backends lower, by case
# name: (E, k, with grad_scores_sum and mask)
SOFTPLUS_SERIES = 0.1
GATE_BACKWARD_CASES = {"e1_k1": (1, 1, False), "e72_k6_aux": (72, 6, True), "e256_k8": (256, 8, False),
                       f"e{_E}_k{_K}_aux": (_E, _K, True)}


def pairwise_steps(k: int) -> list[tuple[int, int]]:
    """The additions ``acc[dst] += acc[src]`` that sum ``k <= 32`` values into ``acc[0]``, the kernels' order on both
    backends: a pairwise tree over 32 lanes (lane ``j`` takes lane ``j + 16``, then ``j + 8``, ``+ 4``, ``+ 2``,
    ``+ 1``), the lanes past ``k`` absent (docs/ops/moe.md#normalize_weight)."""
    steps = []
    for span in (16, 8, 4, 2, 1):
        steps += [(j, j + span) for j in range(span) if j + span < k]
    return steps


def check_rows(err: OpError, arg: str, value, width: limits.IntRange) -> tuple[int, int]:
    """``value`` a contiguous fp32 ``(T, W)`` tensor with ``W`` in ``width``. Returns ``(T, W)``."""
    tokens, cols = check_tensor(err, arg, value, dtype=F32, ndim=2).shape
    width.check(err, arg, cols)
    return tokens, cols


def check_k(err: OpError, arg: str, k, experts: int) -> int:
    """``k`` an int in ``limits.MOE_TOPK`` and at most the ``experts`` it picks from."""
    limits.MOE_TOPK.check(err, arg, check_int(err, arg, k))
    if k > experts:
        raise err.value(arg, f"expected at most E = {experts} (the experts to pick from), got {k}")
    return k


def id_dtype(err: OpError, arg: str, int32) -> torch.dtype:
    """The dtype of the expert ids: int64, or int32 when ``int32`` is True."""
    return ID_DTYPES[check_bool(err, arg, int32)]


def require_topk(where: str, experts: int, k: int) -> tuple[int, int]:
    """For kernel builders and keys: ``(E, k)`` in ``limits.MOE_EXPERTS`` / ``MOE_TOPK`` with ``k <= E``, else
    ``limits.LimitError`` naming ``where``."""
    E = limits.MOE_EXPERTS.require(where, experts)
    K = limits.MOE_TOPK.require(where, k)
    if K > E:
        raise limits.LimitError(f"{where}: k must be at most E = {E}, got {K}")
    return E, K


def gate_key(where: str, key_type, logits, k, num_shared_experts, mask, bias, image_bias, fixed_topk_idx,
             to_physical_map, *extra):
    """For the kernels of ``moe_topk_gate_forward``: the key ``key_type(E, k, shared, has_mask, has_bias, has_image,
    has_fixed, has_map, *extra)`` of a launch, ``limits.LimitError`` naming ``where`` outside the limits."""
    experts, k = require_topk(where, logits.shape[1], k)
    require_topk(where, experts + num_shared_experts, k + num_shared_experts)
    return key_type(experts, k, num_shared_experts, mask is not None, bias is not None, image_bias is not None,
                    fixed_topk_idx is not None, to_physical_map is not None, *extra)


@functools.cache
def placeholder(device: torch.device, dtype: torch.dtype, width: int = 0) -> torch.Tensor:
    """For the kernels of ``moe_topk_gate_forward``: a ``(1,)`` (``width`` 0) or ``(1, width)`` zero tensor standing
    for an absent optional tensor (the kernel's key says it is absent: it is never read)."""
    return torch.zeros((1, width) if width else (1,), dtype=dtype, device=device)


def gate_forward_arguments(logits, k, routed_scaling_factor, ep_rank, mask, bias, image_bias, image_token_mask,
                           fix_routing_mask, fixed_topk_idx, to_physical_map, logical_count, topk_idx, topk_weights,
                           unmapped_topk_idx, scores) -> tuple:
    """For the launchers of ``moe_topk_gate_forward`` (both backends' kernels take the same parameters): the kernel's
    arguments in order, the absent optional tensors as placeholders, the scalars as Python numbers."""
    dev, f32 = logits.device, torch.float32

    def given(t, dtype, width=0):
        return t if t is not None else placeholder(dev, dtype, width)

    return (logits, given(mask, torch.bool), given(bias, f32), given(image_bias, f32),
            given(image_token_mask, torch.bool), given(fix_routing_mask, torch.bool),
            given(fixed_topk_idx, torch.int64, k), given(to_physical_map, torch.int32, 1),
            given(logical_count, torch.int32), float(routed_scaling_factor), int(ep_rank),
            topk_idx, topk_weights, unmapped_topk_idx, scores)


def gate_backward_arguments(grad_topk_weights, scores, unmapped_topk_idx, topk_weights, routed_scaling_factor, mask,
                            grad_scores_sum, grad_logits) -> tuple:
    """For the launchers of ``moe_topk_gate_backward``: the kernel's arguments in order; without ``grad_scores_sum``
    it and the mask go as placeholders (never read), a missing mask with it as all-true."""
    dev = scores.device
    if grad_scores_sum is None:
        mask, grad_scores_sum = placeholder(dev, torch.bool), placeholder(dev, torch.float32, scores.shape[1])
    elif mask is None:
        mask = torch.ones(scores.shape[0], dtype=torch.bool, device=dev)
    return (grad_topk_weights, scores, unmapped_topk_idx, topk_weights, float(routed_scaling_factor), mask,
            grad_scores_sum, grad_logits)
