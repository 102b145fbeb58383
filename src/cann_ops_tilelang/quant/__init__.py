"""The quant family (docs/ops/quant.md): the scale-factor layout type and the quantized-tensor result (``_layout``)
and the casts to FP8 / FP4, one module per op (pair).

Ops: ``per_token_cast`` (its Python function :func:`quantize` returns a :class:`QuantTensor`).
"""

import sys as _sys

from . import _layout
from ._layout import AMAX_CLAMP, BLOCKS, FORMATS, SF_DTYPES, STORAGES, UE8M0_WORDS, Format, QuantTensor, ScaleLayout
from .per_token_cast import per_token_cast, quantize

# NOTE the layout module's first name, ``cann_ops_tilelang.quant.layout``, still imported by the Ascend kernel (which
# is to import these names from this package); remove once nothing does. A family package holds only op modules
# besides private helpers (tests/test_layout.py), so the module itself is ``_layout``.
_sys.modules[f"{__name__}.layout"] = _layout

__all__ = ["AMAX_CLAMP", "BLOCKS", "FORMATS", "SF_DTYPES", "STORAGES", "UE8M0_WORDS", "Format", "QuantTensor",
           "ScaleLayout", "per_token_cast", "quantize"]
