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
