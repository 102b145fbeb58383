"""The quant family's types (docs/ops/quant.md): the scale-factor layout and the quantized-tensor result.

Not imported by ``cann_ops_tilelang`` yet: the casts (custom ops and kernels) come in a later step, and
this package registers no op.
"""

from .layout import AMAX_CLAMP, BLOCKS, FORMATS, SF_DTYPES, STORAGES, UE8M0_WORDS, Format, QuantTensor, ScaleLayout

__all__ = ["AMAX_CLAMP", "BLOCKS", "FORMATS", "SF_DTYPES", "STORAGES", "UE8M0_WORDS", "Format", "QuantTensor",
           "ScaleLayout"]
