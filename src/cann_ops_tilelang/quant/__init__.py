"""The quant family (docs/ops/quant.md): the scale-factor layout type and the quantized-tensor result (``_layout``)
and the casts to FP8 / FP4, one module per op (pair).

Ops: ``per_token_cast`` (its Python function :func:`quantize` returns a :class:`QuantTensor`), ``per_channel_cast``
(:func:`quantize_per_channel`), ``transpose_weight_sf``
(:func:`transpose_weight_sf_pairs`).
"""

from ._layout import AMAX_CLAMP, BLOCKS, FORMATS, SF_DTYPES, STORAGES, UE8M0_WORDS, Format, QuantTensor, ScaleLayout
from .per_channel_cast import per_channel_cast, quantize_per_channel
from .per_token_cast import per_token_cast, quantize
from .transpose_weight_sf import transpose_weight_sf, transpose_weight_sf_pairs

__all__ = ["AMAX_CLAMP", "BLOCKS", "FORMATS", "SF_DTYPES", "STORAGES", "UE8M0_WORDS", "Format", "QuantTensor",
           "ScaleLayout", "per_channel_cast", "per_token_cast", "quantize", "quantize_per_channel",
           "transpose_weight_sf", "transpose_weight_sf_pairs"]
