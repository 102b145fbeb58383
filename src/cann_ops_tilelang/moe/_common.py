"""Checks shared by the MoE routing ops' validation (supported sizes: ``limits.MOE_*``; docs/ops/moe.md#conventions).

Per-token tensors are contiguous ``(T, W)`` rows: scores ``(T, E)`` and routing weights ``(T, k)`` in fp32, expert
ids ``(T, k)`` in int64 (int32 on request, torch_npu's convention).
"""

import torch

from .. import limits
from .._checks import OpError, check_bool, check_int, check_tensor

__all__ = ["DENOMINATOR_EPS", "F32", "ID_DTYPES", "NORMALIZE_CASES", "TOPK_CASES", "check_k", "check_rows", "id_dtype",
           "pairwise_steps", "require_topk"]

F32 = torch.float32
# the expert ids' dtypes: int64 by default, int32 when asked (``int32=True``)
ID_DTYPES = {False: torch.int64, True: torch.int32}
# the variants both backends' kernels are lowered at in the CPU tier, whatever the hidden size: (E, k, int32) of
# topk_gate (the edges of E and k, the peer's (72, 6), DeepSeek-V3's (256, 8) with both id dtypes) and k of normalize_weight
TOPK_CASES = ((1, 1, False), (72, 6, False), (256, 8, False), (256, 8, True), (512, 32, False))
NORMALIZE_CASES = (1, 6, 32)
# added to the sum of a row's routing weights before dividing by it (a row of zeros gives zeros, not NaN), as the
# peer's kernels do (docs/ops/moe.md#normalize_weight)
DENOMINATOR_EPS = 1e-20


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
