"""Checks shared by the quant ops' validation (supported sizes: ``limits.QUANT_*``; docs/ops/quant.md)."""

import torch

from .. import limits, policy
from .._checks import OpError, describe
from ._layout import ScaleLayout

BF16, F32 = torch.bfloat16, torch.float32
# the input dtypes of the casts, and the bytes of one vector access of a row (the CUDA kernels' 16-byte loads)
INPUT_DTYPES = (BF16, F32)
ROW_ALIGN_BYTES = 16


def check_layout(err: OpError, arg: str, spec, kinds: tuple[str, ...]) -> ScaleLayout:
    """The :class:`ScaleLayout` of a spec string (``"1x128/e4m3/ue8m0/col_tma/round"``) whose block is of one of
    ``kinds`` (``"per_token"``, ...): ``TypeError`` for a non-str, ``ValueError`` naming ``arg`` otherwise."""
    if not isinstance(spec, str):
        raise err.type(arg, f"expected a str, a ScaleLayout spec such as '1x128/e4m3/fp32/row/exact', got "
                            f"{describe(spec)}")
    try:
        layout = ScaleLayout.parse(spec)
    except (TypeError, ValueError) as exc:
        raise err.value(arg, f"expected a ScaleLayout spec '<rows>x<cols>/<fmt>/<sf>/<storage>/<round|exact>', got "
                             f"{spec!r} ({exc})") from None
    if layout.kind not in kinds:
        raise err.value(arg, f"expected a {' or '.join(k.replace('_', '-') for k in kinds)} layout, got {spec!r} (a "
                             f"{layout.kind.replace('_', '-')} block {layout.block})")
    return layout


def check_rows(err: OpError, arg: str, x) -> tuple[int, int]:
    """``x (T, H)`` bf16 or fp32 whose rows may be strided: unit column stride, row pitch ``x.stride(0) >= H`` a
    multiple of 16 bytes (each row starts on a vector; the op's ``vector_args`` checks the first one), ``H`` in
    ``limits.QUANT_HIDDEN`` and ``T * pitch`` in ``limits.QUANT_ELEMENTS``. Returns ``(T, H)``."""
    if not isinstance(x, torch.Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {describe(x)}")
    if x.dtype not in INPUT_DTYPES:
        raise err.type(arg, f"expected dtype torch.bfloat16 or torch.float32, got {x.dtype}")
    if x.dim() != 2:
        raise err.value(arg, f"expected a 2-D tensor of shape (T, H), got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    limits.QUANT_HIDDEN.check(err, arg, hidden)
    if x.stride(1) != 1:
        raise err.value(arg, f"expected rows of unit column stride (strided rows are allowed), got strides "
                             f"{tuple(x.stride())}")
    pitch = x.stride(0) if tokens > 1 else hidden
    vector = ROW_ALIGN_BYTES // x.element_size()
    if pitch < hidden or pitch % vector:
        raise err.value(arg, f"expected a row stride of at least H = {hidden} and a multiple of {vector} elements "
                             f"({ROW_ALIGN_BYTES} bytes), got strides {tuple(x.stride())}")
    limits.QUANT_ELEMENTS.check(err, arg, tokens * pitch)
    return tokens, hidden


def backend_of(x: torch.Tensor) -> str:
    """The backend whose bytes the outputs take on ``x``'s device (``policy.kernel_backend``: CUDA on meta and CPU)."""
    return policy.kernel_backend(x.device.type)
