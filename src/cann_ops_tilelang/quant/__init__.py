"""The quant family (docs/ops/quant.md): the scale-factor layout type and the quantized-tensor result (``_layout``)
and the casts to FP8 / FP4, one module per op (pair).

Ops: ``per_token_cast``, ``per_token_cast_sf``, ``per_token_cast_with_sf`` (the Python function :func:`quantize`
returns a :class:`QuantTensor`), ``per_block_cast`` (weights; with ``per_block_cast_sf`` and ``per_block_cast_with_sf``),
``cast_back``, ``per_token_cast_and_cast_back``.
"""

from ._layout import AMAX_CLAMP, BLOCKS, FORMATS, SF_DTYPES, STORAGES, UE8M0_WORDS, Format, QuantTensor, ScaleLayout
from .cast_back import cast_back
from .per_block_cast import per_block_cast, per_block_cast_sf, per_block_cast_with_sf
from .per_token_cast import per_token_cast, per_token_cast_sf, per_token_cast_with_sf, quantize
from .per_token_cast_and_cast_back import per_token_cast_and_cast_back

__all__ = ["AMAX_CLAMP", "BLOCKS", "FORMATS", "SF_DTYPES", "STORAGES", "UE8M0_WORDS", "Format", "QuantTensor",
           "ScaleLayout", "cast_back", "per_block_cast", "per_block_cast_sf", "per_block_cast_with_sf",
           "per_token_cast", "per_token_cast_and_cast_back", "per_token_cast_sf", "per_token_cast_with_sf", "quantize"]
