"""Checks shared by the Engram ops' validation (supported sizes: ``limits.ENGRAM_*``)."""

import torch

from .. import limits
from .._checks import OpError, check_tensor

BF16, F32 = torch.bfloat16, torch.float32


def check_hc_hidden(err: OpError, arg: str, m: int, hidden: int) -> None:
    """``m`` streams and hidden size ``H`` of ``arg`` are in the supported ranges."""
    if m not in limits.ENGRAM_HC_MULT:
        raise err.value(arg, f"expected hc_mult {limits.ENGRAM_HC_MULT.describe()} (the only one with kernels), "
                             f"got {m}")
    limits.ENGRAM_HIDDEN.check(err, arg, hidden)


def check_mask(err: OpError, mask: object, tokens: int) -> torch.Tensor | None:
    """``image_token_mask``: None or a contiguous ``(T,)`` bool tensor."""
    if mask is None:
        return None
    return check_tensor(err, "image_token_mask", mask, dtype=torch.bool, shape=(tokens,))
