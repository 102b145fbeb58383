"""The per-token-group cast to FP8 / FP4 with scales and its variants (docs/ops/quant.md#per_token_cast).

Ops: ``per_token_cast(x, layout, x_sf=None, x_layout=None) -> (data, sf)`` (with ``x_sf`` / ``x_layout``: ``x``
is per-token quantized data, re-quantized), ``per_token_cast_sf(x, layout) -> sf`` (the scales alone) and
``per_token_cast_with_sf(x, sf, layout) -> data`` (the data alone, from given scales), the layouts as spec
strings; the Python function ``quantize`` (quant/_quantize.py) takes a :class:`ScaleLayout` or its spec and returns
a :class:`QuantTensor`.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, check_same_device, describe
from .._library import declare
from ._common import ROW_ALIGN_BYTES, backend_of, check_layout, check_rows
from ._layout import QuantTensor, ScaleLayout

__all__ = ["per_token_cast", "per_token_cast_sf", "per_token_cast_with_sf", "quantize"]


def _check_scales(err: OpError, arg: str, sf, layout: ScaleLayout, x: Tensor, tokens: int, hidden: int) -> None:
    """``sf`` a tensor on ``x``'s device with ``layout``'s dtype, shape and strides at ``(T, H)`` for ``x``'s
    backend (metadata only: the values, e.g. powers of two under ``round_sf``, are not checked)."""
    if not isinstance(sf, torch.Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {describe(sf)}")
    check_same_device(err, [("x", x), (arg, sf)])
    backend = backend_of(x)
    try:
        layout.check_sf(sf, tokens, hidden, backend, name=arg)
    except TypeError as exc:
        raise err.type(arg, f"expected the scales of layout {layout.spec} for x ({tokens}, {hidden}) on {backend}: "
                            f"{exc}") from None
    except ValueError as exc:
        raise err.value(arg, f"expected the scales of layout {layout.spec} for x ({tokens}, {hidden}) on {backend}: "
                             f"{exc}") from None


def _check_quantized(err: OpError, x, x_sf, x_layout) -> tuple[int, int]:
    """Re-quantization input: ``x`` per-token quantized data of ``x_layout`` (float8_e4m3fn ``(T, H)``, or uint8
    ``(T, H / 2)`` for e2m1) whose rows may be strided (unit column stride, row stride a multiple of 16 bytes),
    ``x_sf`` its scales in ``x_layout``. Returns ``(T, H)``, ``H`` logical."""
    if x_sf is None or x_layout is None:
        missing, given = ("x_sf", "x_layout") if x_sf is None else ("x_layout", "x_sf")
        raise err.value(missing, f"expected both x_sf and x_layout (re-quantization) or neither, got {given} "
                                 f"without {missing}")
    spec = check_layout(err, "x_layout", x_layout, ("per_token",))
    if not isinstance(x, torch.Tensor):
        raise err.type("x", f"expected a torch.Tensor, got {describe(x)}")
    if x.dtype != spec.data_dtype:
        raise err.type("x", f"expected dtype {spec.data_dtype} (the data of x_layout {spec.spec}), got {x.dtype}")
    if x.dim() != 2:
        raise err.value("x", f"expected a 2-D tensor of shape (T, H{' / 2' if spec.fmt == 'e2m1' else ''}), got "
                             f"shape {tuple(x.shape)}")
    tokens, hidden = x.shape[0], spec.hidden_of(x)
    limits.QUANT_HIDDEN.check(err, "x", hidden)
    if x.stride(1) != 1:
        raise err.value("x", f"expected rows of unit column stride (strided rows are allowed), got strides "
                             f"{tuple(x.stride())}")
    pitch = x.stride(0) if tokens > 1 else x.shape[1]
    if pitch < x.shape[1] or pitch % ROW_ALIGN_BYTES:
        raise err.value("x", f"expected a row stride of at least {x.shape[1]} and a multiple of {ROW_ALIGN_BYTES} "
                             f"elements ({ROW_ALIGN_BYTES} bytes), got strides {tuple(x.stride())}")
    limits.QUANT_ELEMENTS.check(err, "x", tokens * pitch)
    _check_scales(err, "x_sf", x_sf, spec, x, tokens, hidden)
    return tokens, hidden


@declare("per_token_cast", vector_args={"x": 16}, tokens="x", outputs=("data", "sf"))
def per_token_cast(x: Tensor, layout: str, x_sf: Optional[Tensor] = None,
                   x_layout: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """Casts each group of ``g`` consecutive channels of each row of ``x`` to e4m3 / e2m1 with one scale per group.

    Per group: ``a = max(max |v|, clamp)``, the scale ``s`` and its inverse ``inv`` from ``a`` as the layout says
    (fp32 ``a / max``, rounded up to a power of two, or e4m3), the data ``Q(fl(v * inv))`` (round to nearest even,
    saturating); docs/ops/quant.md#layout has the math, the clamps and the stored bytes. ``v = x``, or when
    re-quantizing ``v = fl(f32(x) * sx)``: the data is then ``Q(fl(f32(x) * fl(sx * inv)))`` on CUDA and
    ``Q(fl(v * inv))`` on Ascend (docs/ops/quant.md#per_token_cast).

    Args:
        x: ``(T, H)`` bf16 or fp32; rows may be strided (unit column stride, row stride a multiple of 16 bytes);
            ``H`` a multiple of 128 up to 32768 (``limits.QUANT_HIDDEN``); any ``T >= 0``. Re-quantizing: the
            data of ``x_layout``, ``(T, H)`` float8_e4m3fn or ``(T, H / 2)`` uint8 (e2m1), rows as above.
        layout: a per-token ScaleLayout spec, ``"1x<g>/<e4m3|e2m1>/<fp32|e4m3|ue8m0>/<row|col_tma>/<round|exact>"``,
            ``g`` in {16, 32, 64, 128}.
        x_sf: None, or the scales of ``x`` in ``x_layout`` (its shape, strides and dtype for ``x``'s backend).
        x_layout: None, or ``x``'s per-token layout spec (given with ``x_sf``: both or neither).

    Returns:
        ``(data, sf)``: ``data`` ``(T, H)`` float8_e4m3fn, or ``(T, H / 2)`` uint8 (two e2m1 per byte, low nibble
        first); ``sf`` with ``layout.sf_shape / sf_dtype / sf_strides(T, H, backend)``, the backend that of
        ``x``'s device (CUDA on meta and CPU tensors: UE8M0 packed 4 per int32, col_tma padded to 16 bytes).
    """
    err = OpError("per_token_cast")
    if x_sf is None and x_layout is None:
        tokens, hidden = check_rows(err, "x", x)
    else:
        tokens, hidden = _check_quantized(err, x, x_sf, x_layout)
    spec = check_layout(err, "layout", layout, ("per_token",))
    return spec.empty_data(tokens, hidden, like=x), spec.empty_sf(tokens, hidden, backend_of(x), like=x)


# DTensor sharding (docs/distributed.md): token-wise, so the token dim of x, x_sf, data and sf is sharded. A col_tma
# sf shard is the column-major scales of its rank's tokens (its own TMA padding), which is what that rank's GEMM
# reads (and what a rank's own cast gives as x_sf); its full_tensor() is the same values, row-major.
per_token_cast.sharding({"x": "S0", "x_sf": "S0", "returns": ("S0", "S0")})


@declare("per_token_cast_sf", vector_args={"x": 16}, tokens="x", outputs=("sf",))
def per_token_cast_sf(x: Tensor, layout: str) -> Tensor:
    """The scales of :func:`per_token_cast` alone, bitwise its ``sf`` (no data is written).

    Args:
        x: ``(T, H)`` bf16 or fp32, rows as for :func:`per_token_cast`.
        layout: a per-token ScaleLayout spec.

    Returns:
        ``sf`` with ``layout.sf_shape / sf_dtype / sf_strides(T, H, backend)`` (docs/ops/quant.md#per_token_cast).
    """
    err = OpError("per_token_cast_sf")
    tokens, hidden = check_rows(err, "x", x)
    spec = check_layout(err, "layout", layout, ("per_token",))
    return spec.empty_sf(tokens, hidden, backend_of(x), like=x)


per_token_cast_sf.sharding({"x": "S0", "returns": "S0"})


@declare("per_token_cast_with_sf", vector_args={"x": 16}, tokens="x", outputs=("data",))
def per_token_cast_with_sf(x: Tensor, sf: Tensor, layout: str) -> Tensor:
    """The data of a per-token cast with precomputed scales: ``Q(fl(x * inv))``, ``inv = fl(1 / s)`` from the given
    scale ``s`` of each group (docs/ops/quant.md#per_token_cast). The scales are read, not written.

    Only metadata is validated: with ``round_sf`` (fp32 or UE8M0 scales) every given scale must be a power of two,
    and scales should be positive normal fp32 values (the Ascend division flushes subnormals); nothing checks it.

    Args:
        x: ``(T, H)`` bf16 or fp32, rows as for :func:`per_token_cast`.
        sf: the scales of ``x`` in ``layout`` for ``x``'s backend: ``layout.sf_shape / sf_dtype / sf_strides``
            (UE8M0 words 4 per int32 on CUDA, 2 per int16 on Ascend; col_tma the transposed padded view).
        layout: a per-token ScaleLayout spec.

    Returns:
        ``data`` ``(T, H)`` float8_e4m3fn, or ``(T, H / 2)`` uint8 (e2m1, low nibble first).
    """
    err = OpError("per_token_cast_with_sf")
    tokens, hidden = check_rows(err, "x", x)
    spec = check_layout(err, "layout", layout, ("per_token",))
    _check_scales(err, "sf", sf, spec, x, tokens, hidden)
    return spec.empty_data(tokens, hidden, like=x)


per_token_cast_with_sf.sharding({"x": "S0", "sf": "S0", "returns": "S0"})
