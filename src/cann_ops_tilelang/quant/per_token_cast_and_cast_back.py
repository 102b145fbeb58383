"""Fake quantization for QAT: the per-token cast and its cast back, in place
(docs/ops/quant.md#per_token_cast_and_cast_back).

Op: ``per_token_cast_and_cast_back(x, layout) -> None`` overwrites ``x`` with its own dequantized quantization;
nothing else is stored (the layout's scale storage and packing do not matter).
"""

from torch import Tensor

from .._checks import OpError
from .._library import declare
from ._common import check_layout, check_rows

__all__ = ["per_token_cast_and_cast_back"]


@declare("per_token_cast_and_cast_back", mutates_args=("x",), vector_args={"x": 16}, tokens="x")
def per_token_cast_and_cast_back(x: Tensor, layout: str) -> None:
    """In place: ``x = x.dtype(fl(f32(Q(fl(x * inv))) * s))``, the per-token cast of ``x`` followed by its cast back.

    Per group of ``g`` channels of a row: ``a = max(max |x|, clamp)``, the scale ``s`` and its inverse ``inv`` from
    ``a`` as the layout says (docs/ops/quant.md#layout), the data ``Q(fl(x * inv))`` widened back and multiplied by
    ``s`` (one fp32 product), rounded once to ``x``'s dtype. ``"ue8m0"`` scales are ``"fp32"`` with ``round_sf``;
    the storage does not matter (no scale is stored). docs/ops/quant.md#per_token_cast_and_cast_back has the contract.

    Args:
        x: ``(T, H)`` bf16 or fp32, written in place; rows may be strided (unit column stride, row stride a multiple
            of 16 bytes); ``H`` a multiple of 128 up to 32768 (``limits.QUANT_HIDDEN``); any ``T >= 0``.
        layout: a per-token ScaleLayout spec, ``"1x<g>/<e4m3|e2m1>/<fp32|e4m3|ue8m0>/<row|col_tma>/<round|exact>"``.
    """
    err = OpError("per_token_cast_and_cast_back")
    check_rows(err, "x", x)
    check_layout(err, "layout", layout, ("per_token",))


# DTensor sharding (docs/distributed.md): token-wise, each rank's rows in place.
per_token_cast_and_cast_back.sharding({"x": "S0"})
