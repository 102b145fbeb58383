"""Metadata-only argument checks shared by every op's validation function.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong rank, shape,
layout, device or value) with a message naming the op, the argument, what was expected and what
was received. Nothing here reads tensor data or touches a device, so the checks run unchanged on
fake and meta tensors.
"""

import math
import numbers
import operator
import struct
import sys
from collections.abc import Sequence

import torch

__all__ = ["OpError", "check_bool", "check_float", "check_int", "check_same_device", "check_tensor", "describe",
           "format_shape", "misalignment", "overlap", "type_name"]

# the smallest positive normal fp32: kernels may flush smaller values to zero
_FP32_TINY = 1.1754943508222875e-38


class OpError:
    """Builds error messages for one op: ``OpError("engram_gate_forward").value("kv", "...")``."""

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


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors with data share bytes of one storage (views of one buffer that do not intersect,
    such as two halves of a flat gradient bucket, do not). Works on meta and fake tensors too: it compares
    storages and storage offsets, never addresses."""
    # one storage first (the common answer, and the cheapest check): then the devices agree too
    if not torch._C._is_alias_of(a, b) or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        start = t.storage_offset() * t.element_size()
        return start, start + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def type_name(value: object) -> str:
    """The name of ``value``'s type as a message shows it: builtins bare (``str``), anything else qualified by its
    package (``numpy.bool``, ``numpy.float32``, ``torch.Tensor``), so a numpy bool never reads as a bool."""
    if value is None:
        return "None"
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    # the shortest public path that reaches the type (torch.Tensor, not torch._tensor.Tensor; torch.nn.Parameter),
    # else its full path
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = ".".join(parts[:end])
        if getattr(sys.modules.get(module), cls.__name__, None) is cls:
            return f"{module}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def describe(value: object) -> str:
    """What a message says it got: the type name, and the value itself for a scalar or a string
    (``numpy.bool True``, ``str 'False'``, ``float 0.5``; an int of more than 30 digits by its length)."""
    name = type_name(value)
    if value is None or isinstance(value, torch.Tensor):
        return name
    if isinstance(value, int) and not isinstance(value, bool):
        digits = len(str(abs(int(value))))
        if digits > 30:  # 10**400 would flood the message, and a truncated number would read as another one
            return f"{name} of {digits} digits ({'-' if value < 0 else ''}{str(abs(int(value)))[:6]}...)"
    if type(value) in (bool, int, float, complex, str, bytes):
        text = repr(value)
    elif isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        text = str(value)  # numpy and other scalars: str() is the bare value (repr would be np.True_)
    else:
        return name
    return f"{name} {text if len(text) <= 40 else text[:37] + '...'}"


def format_shape(shape: Sequence[object]) -> str:
    """A shape as messages write it: ``(3, 4, 512)``, ``(3,)``; a free dim (``None``) as ``*``, a named free dim
    (a ``str``) by its name: ``(*, 4, 512)``, ``(T, 4, 512)``."""
    parts = ["*" if s is None else str(s) for s in shape]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


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
    matching ``shape`` (entries that are ``None`` are free and print as ``*``; a ``str`` entry is a free dim
    printed by that name) and contiguous.

    Returns:
        The tensor, for chaining.
    """
    if not isinstance(value, torch.Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {describe(value)}")
    if value.dtype != dtype:
        raise err.type(arg, f"expected dtype {dtype}, got {value.dtype}")
    rank = len(shape) if shape is not None else ndim
    if rank is not None and value.dim() != rank:
        want = f" of shape {format_shape(shape)}" if shape is not None else ""
        raise err.value(arg, f"expected a {rank}-D tensor{want}, got shape {format_shape(tuple(value.shape))}")
    if shape is not None:
        for want, size in zip(shape, value.shape):
            if want is not None and want != size and not isinstance(want, str):  # ints and SymInts must match
                raise err.value(arg, f"expected shape {format_shape(shape)}, got {format_shape(tuple(value.shape))}")
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


def _as_fp32(value: float) -> float:
    """``value`` rounded to fp32 (``inf`` where it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_float(err: OpError, arg: str, value: object, *, minimum: float, inclusive: bool = True) -> float:
    """A Python number (not a bool) ``>= minimum`` (``> minimum`` when not ``inclusive``) that survives the
    conversion to fp32, where the kernels use it: finite there (``1e300`` is refused), and zero or at least
    fp32's smallest normal number in magnitude (``1e-50`` would become zero, or a subnormal that kernels may
    flush to zero: an ``eps`` or ``clamp_value`` silently lost)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise err.type(arg, f"expected a float, got {describe(value)}")
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value  # a traced value: checked when the graph runs with a real one
    number = float(value)
    single = _as_fp32(number)
    if not math.isfinite(number) or not math.isfinite(single):
        raise err.value(arg, f"expected a number that is finite in fp32 (|x| < 3.4e38), got {number}")
    relation = ">=" if inclusive else ">"
    if number < minimum or (not inclusive and number == minimum):
        raise err.value(arg, f"expected a number {relation} {minimum}, got {number}")
    if number != 0.0 and abs(single) < _FP32_TINY:
        raise err.value(arg, f"expected zero or a number that stays so in fp32 (at least {_FP32_TINY:.4g} in "
                             f"magnitude, fp32's smallest normal number), got {number}")
    return number


def check_int(err: OpError, arg: str, value: object) -> int:
    """An integer (not a bool; numpy integers become ints; a traced SymInt passes); ranges are checked with
    ``limits.IntRange.check``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise err.type(arg, f"expected an int, got {describe(value)}")
    return value if isinstance(value, (int, torch.SymInt)) else operator.index(value)


def check_bool(err: OpError, arg: str, value: object) -> bool:
    """A bool (not a string, an int or a numpy bool: the schema takes Python's bool only)."""
    if not isinstance(value, bool):
        raise err.type(arg, f"expected a bool, got {describe(value)}")
    return value
