"""``quantize``: the one Python entry to the casts, a :class:`QuantTensor` of any layout kind (docs/ops/quant.md)."""

from torch import Tensor

from .._checks import OpError
from ._common import check_layout
from ._layout import QuantTensor, ScaleLayout
from .per_block_cast import per_block_cast
from .per_channel_cast import per_channel_cast
from .per_token_cast import per_token_cast

__all__ = ["quantize"]

_CASTS = {"per_token": ("per_token_cast", per_token_cast), "per_block": ("per_block_cast", per_block_cast),
          "per_channel": ("per_channel_cast", per_channel_cast)}


def quantize(x: Tensor | QuantTensor, layout: ScaleLayout | str) -> QuantTensor:
    """``x (T, H)`` quantized to ``layout`` (a :class:`ScaleLayout` or its spec string): ``QuantTensor(data, sf,
    layout)`` by the cast of the layout's kind, :func:`per_token_cast`, :func:`per_block_cast` or
    :func:`per_channel_cast`. A :class:`QuantTensor` ``x`` (per-token) is re-quantized, ``cast(x.data, layout, x.sf,
    x.layout)``, by the casts that re-quantize (per-token and per-channel).

    Raises ``TypeError`` / ``ValueError`` naming the cast and the argument (``per_token_cast`` and ``layout`` for a
    spec that does not parse).
    """
    spec = layout if isinstance(layout, ScaleLayout) else check_layout(OpError("per_token_cast"), "layout", layout,
                                                                      tuple(_CASTS))
    name, cast = _CASTS[spec.kind]
    if not isinstance(x, QuantTensor):
        data, sf = cast(x, spec.spec)
    elif spec.kind == "per_block":
        raise OpError(name).type("x", "expected a bf16 or fp32 tensor (a per-block cast does not re-quantize), got a "
                                      "QuantTensor")
    else:
        x_layout = x.layout.spec if isinstance(x.layout, ScaleLayout) else x.layout
        data, sf = cast(x.data, spec.spec, x.sf, x_layout)
    return QuantTensor(data, sf, spec)
