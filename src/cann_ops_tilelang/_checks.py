"""Metadata-only argument checks shared by every op's validation function.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong rank, shape,
layout, device or value) with a message naming the op, the argument, what was expected and what
was received. Nothing here reads tensor data or touches a device, so the checks run unchanged on
fake and meta tensors.
"""

import math
from collections.abc import Sequence

import torch

__all__ = ["OpError", "check_float", "check_same_device", "check_tensor", "misalignment"]


class OpError:
    """Builds error messages for one op: ``OpError("engram_gate_fwd").value("kv", "...")``."""

    def __init__(self, op: str):
        self.op = op

    def _msg(self, arg: str, text: str) -> str:
        return f"cann_ops_tilelang::{self.op}: argument '{arg}': {text}"

    def type(self, arg: str, text: str) -> TypeError:
        return TypeError(self._msg(arg, text))

    def value(self, arg: str, text: str) -> ValueError:
        return ValueError(self._msg(arg, text))


def misalignment(tensor: torch.Tensor, width: int) -> int:
    """Bytes by which the data of ``tensor`` starts past a multiple of ``width`` (0 when aligned or empty)."""
    return tensor.data_ptr() % width if tensor.numel() > 0 else 0


def _fmt_shape(shape: Sequence[object]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_tensor(
    err: OpError,
    arg: str,
    value: object,
    *,
    dtype: torch.dtype,
    shape: Sequence[object] | None = None,
    ndim: int | None = None,
) -> torch.Tensor:
    """Checks one tensor argument: a Tensor, of ``dtype``, of rank ``ndim`` or ``len(shape)``,
    matching ``shape`` (entries that are ``None`` are free) and contiguous.

    Returns:
        The tensor, for chaining.
    """
    if not isinstance(value, torch.Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {type(value).__name__}")
    if value.dtype != dtype:
        raise err.type(arg, f"expected dtype {dtype}, got {value.dtype}")
    rank = len(shape) if shape is not None else ndim
    if rank is not None and value.dim() != rank:
        want = _fmt_shape(shape) if shape is not None else f"{rank}-D"
        raise err.value(arg, f"expected a {rank}-D tensor {want}, got shape {_fmt_shape(tuple(value.shape))}")
    if shape is not None:
        for want, got in zip(shape, value.shape):
            if want is not None and want != got:
                raise err.value(
                    arg, f"expected shape {_fmt_shape(shape)}, got {_fmt_shape(tuple(value.shape))}"
                )
    if not value.is_contiguous():
        raise err.value(arg, f"expected a contiguous tensor, got strides {tuple(value.stride())}")
    return value


def check_same_device(err: OpError, named: Sequence[tuple[str, torch.Tensor | None]]) -> None:
    """All given tensors (``None`` entries skipped) live on one device."""
    first: tuple[str, torch.Tensor] | None = None
    for arg, tensor in named:
        if tensor is None:
            continue
        if first is None:
            first = (arg, tensor)
        elif tensor.device != first[1].device:
            raise err.value(
                arg, f"expected a tensor on {first[1].device} (the device of '{first[0]}'), got {tensor.device}"
            )


def check_float(err: OpError, arg: str, value: object, *, minimum: float, inclusive: bool = True) -> float:
    """A finite Python number ``>= minimum`` (or ``> minimum`` when not ``inclusive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise err.type(arg, f"expected a float, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise err.value(arg, f"expected a finite number, got {number}")
    if number < minimum or (not inclusive and number == minimum):
        relation = ">=" if inclusive else ">"
        raise err.value(arg, f"expected a number {relation} {minimum}, got {number}")
    return number
