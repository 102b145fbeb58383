"""Argument checks of the mHC modeling API (:mod:`.mhc`); the main_grad checks and the gathering of DTensor
leading dims it shares with the Engram gate are :mod:`._buffers`'.

Every check raises ``TypeError`` (a wrong kind or dtype) or ``ValueError`` (a wrong shape, device or value)
naming ``modeling.<function or module>`` and the argument as the caller passed it, before anything runs.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, check_bool, check_float, check_int, describe
from ..mhc._common import check_hc, check_hidden
from ._buffers import check_device

__all__ = ["check_hyper", "check_like_residual", "check_module", "check_params", "check_residual",
           "check_sublayer_output"]

M = limits.MHC_HC_MULT.low


def check_residual(op: str, residual: object, hidden_size: Optional[int] = None) -> tuple[tuple[int, ...], int, int]:
    """``residual (*, m, H)`` bf16 with ``m`` and ``H`` supported (``H`` the module's ``hidden_size`` where given);
    returns ``(*)``, ``m`` and ``H``."""
    err = OpError(op)
    if not isinstance(residual, Tensor):
        raise err.type("residual", f"expected a torch.Tensor, got {describe(residual)}")
    if residual.dim() < 2:
        raise err.value("residual", f"expected (*, m, H), got shape {tuple(residual.shape)}")
    if residual.dtype != torch.bfloat16:
        raise err.type("residual", f"expected bf16, got {residual.dtype}")
    m, hidden = residual.shape[-2:]
    if hidden_size is not None and hidden != hidden_size:
        raise err.value("residual", f"expected the module's hidden size {hidden_size} in the last dim, got "
                                    f"shape {tuple(residual.shape)}")
    if not torch.compiler.is_compiling():  # traced: the ops check the sizes (Dynamo cannot trace the ranges)
        check_hc(err, "residual", m)
        check_hidden(err, "residual", hidden)
    return tuple(residual.shape[:-2]), m, hidden


def check_like_residual(err: OpError, arg: str, value: object, dtype: torch.dtype, shapes: list[tuple[int, ...]],
                  residual: Tensor) -> None:
    """A tensor argument of the modeling API: its kind, ``dtype``, one of ``shapes`` and the residual's device
    (any strides: the callers make their views contiguous)."""
    if not isinstance(value, Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {describe(value)}")
    if value.dtype != dtype:
        raise err.type(arg, f"expected {dtype}, got {value.dtype}")
    if tuple(value.shape) not in shapes:
        raise err.value(arg, f"expected shape {' or '.join(map(str, shapes))} (from residual of shape "
                             f"{tuple(residual.shape)}), got {tuple(value.shape)}")
    if value.device != residual.device:
        raise err.value(arg, f"expected a tensor on {residual.device} (the residual's), got {value.device}")


def check_params(op: str, residual: Tensor, fn: Tensor, scale: Tensor, base: Tensor, norm_weight: Optional[Tensor],
                  rows: int, scales: int, bases: int, names: tuple[str, str, str] = ("fn", "scale", "base")) -> None:
    """The parameters' kinds, dtypes, shapes and device (the residual's); ``names``: the caller's names of ``fn``,
    ``scale``, ``base``. A width that disagrees with the residual's ``H`` is reported with the residual's shape:
    either may be the wrong one."""
    err = OpError(op)
    k = M * residual.shape[-1]
    width = f" (m*H = {M}*{residual.shape[-1]}, from residual of shape {tuple(residual.shape)})"
    for arg, value, shape in ((names[0], fn, (rows, k)), (names[1], scale, (scales,)), (names[2], base, (bases,)),
                              ("norm_weight", norm_weight, (k,))):
        if value is None and arg == "norm_weight":
            continue
        if not isinstance(value, Tensor):
            raise err.type(arg, f"expected a torch.Tensor, got {describe(value)}")
        if value.dtype != torch.float32:
            raise err.type(arg, f"expected torch.float32, got {value.dtype}")
        if tuple(value.shape) != shape:
            context = width if arg in (names[0], "norm_weight") and value.dim() == len(shape) else ""
            raise err.value(arg, f"expected shape {shape}{context}, got {tuple(value.shape)}")
        if value.device != residual.device:
            raise err.value(arg, f"expected a tensor on {residual.device} (the residual's), got {value.device}")


# the default of check_hyper's scalars that only mhc_pre has (None is a value a caller may pass, and is refused)
_ABSENT = object()


def check_hyper(op: str, residual: Tensor, eps: dict, n_splits: int, post_mult_value: object = _ABSENT,
                 sinkhorn_repeat: object = _ABSENT) -> dict:
    """The scalars of :func:`.mhc.mhc_pre` / :func:`.mhc.mhc_head` under their public names, before any kernel
    runs (eager only, as :func:`check_residual`'s ranges: traced, the ops check them). Returns them by name, numpy
    scalars as the Python numbers the ops get (traced: as given)."""
    values = {**eps, "n_splits": n_splits, "post_mult_value": post_mult_value, "sinkhorn_repeat": sinkhorn_repeat}
    if torch.compiler.is_compiling():
        return values
    err = OpError(op)
    for arg in eps:
        values[arg] = check_float(err, arg, values[arg], minimum=0.0)
    values["n_splits"] = limits.mhc_gemm_splits(M * residual.shape[-1]).check(
        err, "n_splits", check_int(err, "n_splits", n_splits))
    if post_mult_value is not _ABSENT:
        values["post_mult_value"] = check_float(err, "post_mult_value", post_mult_value, minimum=0.0,
                                                inclusive=False)
    if sinkhorn_repeat is not _ABSENT:
        values["sinkhorn_repeat"] = limits.MHC_SINKHORN_REPEAT.of(residual.device.type).check(
            err, "sinkhorn_repeat", check_int(err, "sinkhorn_repeat", sinkhorn_repeat))
    return values


def check_module(err: OpError, hidden_size: int, hc_mult: int, eps: float, n_splits: int, norm_weight: bool,
                  device) -> tuple[int, int, float, int, bool, Optional[torch.device]]:
    """The arguments the mHC modules share, checked at construction (as the ops would check them per call) and
    returned as Python numbers (numpy scalars are numbers as for the ops) and a ``torch.device``."""
    hidden_size = limits.MHC_HIDDEN.check(err, "hidden_size", check_int(err, "hidden_size", hidden_size))
    hc_mult = check_int(err, "hc_mult", hc_mult)
    if hc_mult not in limits.MHC_HC_MULT:
        raise err.value("hc_mult", f"expected {limits.MHC_HC_MULT.describe()}, got {hc_mult!r}")
    eps = check_float(err, "eps", eps, minimum=0.0)
    n_splits = limits.mhc_gemm_splits(hc_mult * hidden_size).check(err, "n_splits",
                                                                   check_int(err, "n_splits", n_splits))
    norm_weight = check_bool(err, "norm_weight", norm_weight)
    device = check_device(err, device)
    return hidden_size, hc_mult, eps, n_splits, norm_weight, device


def check_sublayer_output(err: OpError, output: object, layer_input: Tensor) -> Tensor:
    """What the wrapped sublayer returned: a tensor like its input (named as the sublayer's output, not as an
    argument of :func:`.mhc.mhc_post`, which the caller did not pass)."""
    if not isinstance(output, Tensor):
        raise err.type("sublayer", f"expected its output to be a torch.Tensor like its input "
                                   f"{tuple(layer_input.shape)} bf16, got {describe(output)}")
    if output.dtype != layer_input.dtype:
        raise err.type("sublayer", f"expected its output in {layer_input.dtype} (its input's dtype), got "
                                   f"{output.dtype}")
    if output.shape != layer_input.shape:
        raise err.value("sublayer", f"expected its output of its input's shape {tuple(layer_input.shape)}, got "
                                    f"{tuple(output.shape)}")
    if output.device != layer_input.device:
        raise err.value("sublayer", f"expected its output on {layer_input.device} (its input's device), got "
                                    f"{output.device}")
    return output
