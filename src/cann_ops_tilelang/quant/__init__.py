"""The quant family (docs/ops/quant.md): the scale-factor layout type and the quantized-tensor result (``_layout``)
and the casts to FP8 / FP4, one module per op (pair).

Ops: ``per_token_cast`` (its Python function :func:`quantize` returns a :class:`QuantTensor`), ``cast`` (element-wise
narrowing without scales, round to nearest even or stochastic rounding).
"""

from ._layout import AMAX_CLAMP, BLOCKS, FORMATS, SF_DTYPES, STORAGES, UE8M0_WORDS, Format, QuantTensor, ScaleLayout
from .cast import cast
from .per_token_cast import per_token_cast, quantize

__all__ = ["AMAX_CLAMP", "BLOCKS", "FORMATS", "SF_DTYPES", "STORAGES", "UE8M0_WORDS", "Format", "QuantTensor",
           "ScaleLayout", "cast", "per_token_cast", "quantize"]
