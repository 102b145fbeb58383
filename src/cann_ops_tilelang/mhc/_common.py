"""Checks shared by the mHC ops' validation (supported sizes: ``limits.MHC_*``).

Shapes use ``T`` tokens, ``m = 4`` streams, hidden size ``H``, ``K = m*H``, ``M3 = m*(m+2) = 24`` mixes.
"""

import torch

from .. import limits
from .._checks import OpError, check_same_device, check_tensor

HC_MULT = limits.MHC_HC_MULT.low
MIX = limits.MHC_MIX
COMB = HC_MULT * HC_MULT
BF16, F32 = torch.bfloat16, torch.float32


def check_hidden(err: OpError, arg: str, hidden: int) -> None:
    limits.MHC_HIDDEN.check(err, arg, hidden)


def check_width(err: OpError, arg: str, k: int) -> int:
    """Checks a flattened residual width ``K = m*H`` and returns ``H``."""
    if k % HC_MULT != 0:
        raise err.value(arg, f"expected a width K = {HC_MULT}*H, got {k}")
    check_hidden(err, arg, k // HC_MULT)
    return k // HC_MULT


def check_hc(err: OpError, arg: str, m: int) -> None:
    if m not in limits.MHC_HC_MULT:
        raise err.value(arg, f"expected hc_mult {HC_MULT} (the only one with kernels), got {m}")


def check_fn(err: OpError, arg: str, fn) -> int:
    """``fn``: ``(M3, K)`` fp32; returns ``K``."""
    f = check_tensor(err, arg, fn, dtype=F32, ndim=2)
    rows, k = f.shape
    if rows != MIX:
        raise err.value(arg, f"expected {MIX} rows (m*(m+2) mixes), got {rows}")
    check_width(err, arg, k)
    return k


def check_mixes(err: OpError, arg: str, value) -> int:
    """``(T, M3)`` fp32 mixes; returns ``T``."""
    t = check_tensor(err, arg, value, dtype=F32, ndim=2)
    if t.shape[1] != MIX:
        raise err.value(arg, f"expected {MIX} mixes (hc_mult {HC_MULT}) in the last dim, got {t.shape[1]}")
    return t.shape[0]


def check_residual(err: OpError, arg: str, value) -> tuple[int, int]:
    """``(T, m, H)`` bf16; returns ``(T, H)``."""
    r = check_tensor(err, arg, value, dtype=BF16, ndim=3)
    tokens, m, hidden = r.shape
    check_hc(err, arg, m)
    check_hidden(err, arg, hidden)
    return tokens, hidden


def check_square(err: OpError, arg: str, value) -> int:
    """``(T, m, m)`` fp32; returns ``T``."""
    t = check_tensor(err, arg, value, dtype=F32, ndim=3)
    if t.shape[1] != t.shape[2]:
        raise err.value(arg, f"expected (T, m, m) matrices, got shape {tuple(t.shape)}")
    check_hc(err, arg, t.shape[1])
    return t.shape[0]


def check_groups(err: OpError, arg: str, groups: int) -> None:
    if groups not in limits.MHC_RMS_GROUPS:
        raise err.value(arg, f"expected {limits.MHC_RMS_GROUPS.describe()} RMS group (G == 1, the only layout with "
                             f"kernels), got {groups}")


def same_device(err: OpError, **named) -> None:
    check_same_device(err, [(k, v) for k, v in named.items() if isinstance(v, torch.Tensor)])
