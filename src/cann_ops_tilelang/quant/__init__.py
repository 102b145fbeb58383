"""The quant family (docs/ops/quant.md): the scale-factor layout type and the quantized-tensor result (``_layout``)
and the casts to FP8 / FP4, one module per op (pair).

Ops: ``per_token_cast``, ``per_token_cast_sf``, ``per_token_cast_with_sf`` (the Python function :func:`quantize`
returns a :class:`QuantTensor` of any layout kind), ``per_block_cast`` (weights; with ``per_block_cast_sf`` and
``per_block_cast_with_sf``),
``per_channel_cast``, ``cast_back``, ``per_token_cast_and_cast_back``, ``cast``
(element-wise narrowing without scales, round to nearest even or stochastic rounding), ``transpose_weight_sf``
(:func:`transpose_weight_sf_pairs`).
"""

from ._layout import AMAX_CLAMP, BLOCKS, FORMATS, SF_DTYPES, STORAGES, UE8M0_WORDS, Format, QuantTensor, ScaleLayout
from .cast import cast
from .cast_back import cast_back
from .per_block_cast import per_block_cast, per_block_cast_sf, per_block_cast_with_sf
from ._quantize import quantize
from .per_channel_cast import per_channel_cast
from .per_token_cast import per_token_cast, per_token_cast_sf, per_token_cast_with_sf
from .per_token_cast_and_cast_back import per_token_cast_and_cast_back
from .transpose_weight_sf import transpose_weight_sf, transpose_weight_sf_pairs

__all__ = ["AMAX_CLAMP", "BLOCKS", "FORMATS", "SF_DTYPES", "STORAGES", "UE8M0_WORDS", "Format", "QuantTensor",
           "ScaleLayout", "cast", "cast_back", "per_block_cast", "per_block_cast_sf", "per_block_cast_with_sf",
           "per_channel_cast", "per_token_cast", "per_token_cast_and_cast_back", "per_token_cast_sf",
           "per_token_cast_with_sf", "quantize", "transpose_weight_sf",
           "transpose_weight_sf_pairs"]
