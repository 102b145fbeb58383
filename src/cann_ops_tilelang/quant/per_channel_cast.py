"""The per-channel cast to FP8 with scales along tokens (docs/ops/quant.md#per_channel_cast).

Op: ``per_channel_cast(x, layout, x_sf=None, x_layout=None) -> (data, sf)``, the layouts as spec strings; the
Python function ``quantize`` (quant/_quantize.py) takes a :class:`ScaleLayout` or its spec (and a per-token
:class:`QuantTensor` to re-quantize) and returns a :class:`QuantTensor`.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, check_same_device, describe
from .._library import declare
from ._common import backend_of, check_layout, check_rows
from ._layout import QuantTensor, ScaleLayout

__all__ = ["per_channel_cast"]

E4M3 = torch.float8_e4m3fn
# the per-token groups a re-quantized input may come in (the peer's: one 16-byte vector of e4m3 stays in a group)
INPUT_GROUPS = (32, 128)
ROW_ALIGN_BYTES = 16


def _check_quantized_rows(err: OpError, x) -> tuple[int, int]:
    """``x (T, H)`` e4m3 data of a per-token cast: rows as :func:`check_rows` takes them (unit column stride,
    row pitch a multiple of 16 bytes), ``H`` in ``limits.QUANT_HIDDEN``. Returns ``(T, H)``."""
    if not isinstance(x, torch.Tensor):
        raise err.type("x", f"expected a torch.Tensor, got {describe(x)}")
    if x.dtype != E4M3:
        raise err.type("x", f"expected dtype torch.float8_e4m3fn with x_sf (quantized data), got {x.dtype}")
    if x.dim() != 2:
        raise err.value("x", f"expected a 2-D tensor of shape (T, H), got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    limits.QUANT_HIDDEN.check(err, "x", hidden)
    if x.stride(1) != 1:
        raise err.value("x", f"expected rows of unit column stride (strided rows are allowed), got strides "
                             f"{tuple(x.stride())}")
    pitch = x.stride(0) if tokens > 1 else hidden
    if pitch < hidden or pitch % ROW_ALIGN_BYTES:
        raise err.value("x", f"expected a row stride of at least H = {hidden} and a multiple of {ROW_ALIGN_BYTES} "
                             f"elements ({ROW_ALIGN_BYTES} bytes), got strides {tuple(x.stride())}")
    limits.QUANT_ELEMENTS.check(err, "x", tokens * pitch)
    return tokens, hidden


def check_input_scales(err: OpError, x, x_sf, x_layout, tokens: int, hidden: int) -> ScaleLayout:
    """The layout of a re-quantized input: ``x_layout`` a per-token e4m3 spec of group 32 or 128, ``x_sf`` its
    scales of ``x (T, H)`` as that layout stores them on ``x``'s backend (dtype, shape, strides)."""
    xl = check_layout(err, "x_layout", x_layout, ("per_token",))
    if xl.fmt != "e4m3" or xl.block[1] not in INPUT_GROUPS:
        raise err.value("x_layout", f"expected an e4m3 per-token layout of group {' or '.join(map(str, INPUT_GROUPS))} "
                                    f"(1x32 or 1x128), got {x_layout!r}")
    if not isinstance(x_sf, torch.Tensor):
        raise err.type("x_sf", f"expected a torch.Tensor, got {describe(x_sf)}")
    backend = backend_of(x)
    dtype = xl.sf_dtype(backend)
    if x_sf.dtype != dtype:
        raise err.type("x_sf", f"expected dtype {dtype} (x_layout {xl.spec} on {backend}), got {x_sf.dtype}")
    shape = tuple(xl.sf_shape(tokens, hidden, backend))
    if x_sf.dim() != 2 or tuple(x_sf.shape) != shape:
        raise err.value("x_sf", f"expected shape {shape} (x_layout {xl.spec} of x ({tokens}, {hidden}) on "
                                f"{backend}), got {tuple(x_sf.shape)}")
    strides = tuple(xl.sf_strides(tokens, hidden, backend))
    if x_sf.numel() and any(shape[d] > 1 and x_sf.stride(d) != strides[d] for d in range(2)):
        raise err.value("x_sf", f"expected strides {strides} ({xl.storage} storage of x_layout {xl.spec}), got "
                                f"{tuple(x_sf.stride())}")
    check_same_device(err, (("x", x), ("x_sf", x_sf)))
    return xl


@declare("per_channel_cast", vector_args={"x": 16}, tokens="x", outputs=("data", "sf"))
def per_channel_cast(x: Tensor, layout: str, x_sf: Optional[Tensor] = None,
                     x_layout: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """Casts ``x (T, H)`` to e4m3 with one scale per channel for every ``r`` tokens (blocks ``(r, 1)``).

    Per block of ``r`` consecutive tokens of one channel (the last one ragged): ``a = max(max |v|, clamp)``, the
    scale ``s`` and its inverse ``inv`` from ``a`` as the layout says, the data ``Q(fl(v * inv))``; ``v`` is ``x``
    itself, or for quantized input ``v = fl(f32(x) * sx)`` with ``sx`` the per-token scale of ``x``'s element.
    docs/ops/quant.md#per_channel_cast has the math, the clamps and the stored bytes.

    Args:
        x: ``(T, H)`` bf16 or fp32; or, with ``x_sf``, float8_e4m3fn data of a per-token cast. Rows may be strided
            (unit column stride, row stride a multiple of 16 bytes); ``H`` a multiple of 128 up to 32768; any
            ``T >= 0``.
        layout: a per-channel ScaleLayout spec, ``"<32|128>x1/e4m3/<fp32|e4m3|ue8m0>/row/<round|exact>"``.
        x_sf: the scales of quantized ``x`` in ``x_layout`` (as :func:`per_token_cast` returns them), or None.
        x_layout: the per-token layout of ``x_sf`` (an e4m3 spec of group 32 or 128, any scale kind and storage);
            given exactly when ``x_sf`` is.

    Returns:
        ``(data, sf)``: ``data`` ``(T, H)`` float8_e4m3fn; ``sf`` ``(ceil(T / r), H)`` fp32 / e4m3, or UE8M0 words
        ``(ceil(ceil(T / r) / p), H)`` (byte ``b`` of word ``[i, c]`` the scale of token block ``p * i + b`` of
        channel ``c``; int32 ``p = 4`` on CUDA, meta and CPU tensors; int16 ``p = 2`` on Ascend).
    """
    err = OpError("per_channel_cast")
    spec = check_layout(err, "layout", layout, ("per_channel",))
    if x_sf is None:
        if x_layout is not None:
            raise err.value("x_layout", f"expected None without x_sf (x is not quantized), got {x_layout!r}")
        tokens, hidden = check_rows(err, "x", x)
    else:
        if x_layout is None:
            raise err.value("x_layout", "expected the per-token layout spec of x_sf (x_sf is given), got None")
        tokens, hidden = _check_quantized_rows(err, x)
        check_input_scales(err, x, x_sf, x_layout, tokens, hidden)
    return spec.empty_data(tokens, hidden, like=x), spec.empty_sf(tokens, hidden, backend_of(x), like=x)


# DTensor sharding (docs/distributed.md): none but the all-Replicate fallback. Tokens cannot be split: a scale
# covers r consecutive tokens (and a UE8M0 word p blocks of them), which a rank boundary would cut; channels could
# be, but a rank's share of H must stay a multiple of 128 (and of x_sf's groups), which DTensor's even split does
# not promise.
per_channel_cast.sharding()
