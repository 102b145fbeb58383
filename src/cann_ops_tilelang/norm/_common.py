"""Checks shared by the norm family's validation (supported sizes: ``limits.NORM_*``; docs/ops/norm.md#conventions).

Row tensors are ``(..., W)``: any leading dims (flattened into ``T`` rows), unit column stride, and rows that may be
strided as long as the leading dims flatten into one row stride (the pitch), a multiple of 16 bytes.
"""

import math

import torch

from .. import limits
from .._checks import OpError, check_same_device, check_tensor, describe
from ..quant._common import backend_of, check_layout

__all__ = ["BF16", "F32", "INPUT_DTYPES", "ROW_ALIGN_BYTES", "backend_of", "absent_cast", "cast_outputs",
           "check_cast_layout", "check_grad_buffer", "check_like", "check_param", "check_rows", "check_stat",
           "pitch_of", "present", "rows", "rows_of"]

BF16, F32 = torch.bfloat16, torch.float32
INPUT_DTYPES = (BF16, F32)
# the bytes of one vector access of a row (the CUDA kernels' 16-byte loads)
ROW_ALIGN_BYTES = 16


def pitch_of(x: torch.Tensor) -> int | None:
    """The row stride of ``x (..., W)`` seen as ``(T, W)`` rows, or None where its leading dims do not flatten into
    one stride (``W`` when there is at most one row, or none)."""
    width = x.shape[-1]
    if 0 in x.shape[:-1]:  # no rows: any strides
        return width
    pitch = None
    for size, stride in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1])):
        if size == 1:
            continue
        if pitch is None:
            pitch, expected = stride, stride * size
        elif stride != expected:
            return None
        else:
            expected = stride * size
    return width if pitch is None else pitch


def check_rows(err: OpError, arg: str, x, *, width_range: limits.IntRange = limits.NORM_HIDDEN, factor: int = 1,
               dtypes: tuple = INPUT_DTYPES) -> tuple[int, int]:
    """``x (..., factor * H)`` of one of ``dtypes``, at least 1-D, ``H`` in ``width_range``, unit column stride, the
    leading dims flattening into one row pitch ``>= factor * H`` that is a multiple of 16 bytes, ``T * pitch`` in
    ``limits.NORM_ELEMENTS``. Returns ``(T, H)``."""
    if not isinstance(x, torch.Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {describe(x)}")
    if x.dtype not in dtypes:
        raise err.type(arg, f"expected dtype {' or '.join(map(str, dtypes))}, got {x.dtype}")
    if x.dim() < 1:
        raise err.value(arg, f"expected a tensor of shape (..., {'%d H' % factor if factor > 1 else 'H'}), got a "
                             f"0-D tensor")
    width = x.shape[-1]
    if width % factor:
        raise err.value(arg, f"expected a last dim of {factor} H, got {width}")
    hidden = width // factor
    width_range.check(err, arg, hidden)
    tokens = math.prod(x.shape[:-1])
    pitch = pitch_of(x)
    if x.stride(-1) != 1 and tokens:
        raise err.value(arg, f"expected rows of unit column stride (strided rows are allowed), got strides "
                             f"{tuple(x.stride())}")
    vector = ROW_ALIGN_BYTES // x.element_size()
    if pitch is None or pitch < width or pitch % vector:
        raise err.value(arg, f"expected leading dims that flatten into one row stride of at least {width} and a "
                             f"multiple of {vector} elements ({ROW_ALIGN_BYTES} bytes), got shape {tuple(x.shape)} "
                             f"strides {tuple(x.stride())}")
    limits.NORM_ELEMENTS.check(err, arg, tokens * pitch)
    return tokens, hidden


def rows(x: torch.Tensor) -> torch.Tensor:
    """``x (..., W)`` as its ``(T, W)`` rows, a view (its leading dims flatten: :func:`check_rows`)."""
    tokens = math.prod(x.shape[:-1])
    return x.as_strided((tokens, x.shape[-1]), (pitch_of(x), 1))


def check_like(err: OpError, arg: str, t, x: torch.Tensor, arg_x: str = "x", *, dtype=None) -> torch.Tensor:
    """``t`` a tensor of ``x``'s shape, on its device, of ``dtype`` (default ``x``'s), with rows as
    :func:`check_rows` allows."""
    if not isinstance(t, torch.Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {describe(t)}")
    want = x.dtype if dtype is None else dtype
    if t.dtype != want:
        raise err.type(arg, f"expected dtype {want} (as {arg_x}), got {t.dtype}")
    if t.shape != x.shape:
        raise err.value(arg, f"expected shape {tuple(x.shape)} (as {arg_x}), got {tuple(t.shape)}")
    if t.device != x.device:
        raise err.value(arg, f"expected a tensor on {x.device} (as {arg_x}), got {t.device}")
    check_rows(err, arg, t, width_range=limits.IntRange("a width", 1, None), dtypes=(want,))
    return t


def check_param(err: OpError, arg: str, value, x: torch.Tensor, hidden: int) -> None:
    """``value`` None or a contiguous ``(H,)`` tensor of ``x``'s dtype on its device (a weight or bias)."""
    if value is None:
        return
    check_tensor(err, arg, value, dtype=x.dtype, shape=(hidden,))
    check_same_device(err, [("x", x), (arg, value)])


def check_stat(err: OpError, arg: str, value, x: torch.Tensor) -> None:
    """``value`` an fp32 statistic of shape ``x.shape[:-1]`` (one per row), contiguous, on ``x``'s device."""
    check_tensor(err, arg, value, dtype=F32, shape=tuple(x.shape[:-1]))
    check_same_device(err, [("x", x), (arg, value)])


def check_grad_buffer(err: OpError, arg: str, value, param, param_arg: str | None, hidden: int,
                      x: torch.Tensor) -> None:
    """``value`` None or a contiguous fp32 ``(H,)`` gradient buffer on ``x``'s device (accumulated in place), given
    only with its parameter ``param`` (named ``param_arg``; ``param_arg`` None: a buffer that needs none)."""
    if value is None:
        return
    if param_arg is not None and param is None:
        raise err.value(arg, f"expected None without a {param_arg} (there is no {param_arg} gradient), got "
                             f"{describe(value)}")
    check_tensor(err, arg, value, dtype=F32, shape=(hidden,))
    check_same_device(err, [("x", x), (arg, value)])


def check_cast_layout(err: OpError, arg: str, spec, hidden: int, x: torch.Tensor | None = None):
    """The per-token :class:`ScaleLayout` of a fused cast whose group divides ``hidden``. On the Ascend backend
    (``x``'s device) the cast is the quant family's ``per_token_cast`` after the norm, so ``hidden`` must also be in
    ``limits.QUANT_HIDDEN`` there: refused here, before anything is written."""
    layout = check_layout(err, arg, spec, ("per_token",))
    if hidden % layout.block[1]:
        raise err.value(arg, f"expected a group dividing H = {hidden}, got {spec!r} (groups of {layout.block[1]})")
    if x is not None and backend_of(x) == "ascend" and hidden not in limits.QUANT_HIDDEN:
        raise err.value(arg, f"expected H {limits.QUANT_HIDDEN.describe()} for a cast on the Ascend backend (the "
                             f"per_token_cast op's rows), got H = {hidden}")
    return layout


def absent_cast(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(data, sf)`` of an op asked for no cast: ``(0,)`` float8_e4m3fn and fp32 empties (conventions)."""
    return like.new_empty((0,), dtype=torch.float8_e4m3fn), like.new_empty((0,), dtype=F32)


def cast_outputs(spec, tokens: int, width: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(data, sf)`` of a fused per-token cast of ``(tokens, width)`` rows in ``spec`` (a :class:`ScaleLayout`):
    uninitialized, the scales in their layout for ``like``'s backend, both on ``like``'s device (``like.new_empty``:
    fakes can call it)."""
    return (spec.empty_data(tokens, width, like=like),
            spec.empty_sf(tokens, width, backend_of(like), like=like))


def rows_of(x: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`rows` of ``x``, None for None (an optional tensor)."""
    return None if x is None else rows(x)


def present(*tensors) -> list:
    """The tensors that are not None, in order: the arguments of a kernel variant whose absent optional tensors are
    no parameters."""
    return [t for t in tensors if t is not None]
