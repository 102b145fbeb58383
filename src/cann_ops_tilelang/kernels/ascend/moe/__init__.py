"""Ascend 950 (TileLang Ascend dialect) kernels of the MoE routing ops (docs/ops/moe.md): one kernel module per op
module (``cann_ops_tilelang.moe.<op module>``), with its launchers, ``Kernel`` declarations (key, builder, compile
cache) and lowering cases (the gates' are at their expert counts whatever the hidden size).

This package only aggregates the lowering cases; importing it imports no kernel module (nor TileLang).
"""

from ... import _family

__all__ = ["lowering_cases"]


def lowering_cases(hidden_size: int) -> dict:
    """Every kernel variant of the family at ``hidden_size``, keyed ``"<op module>/<case>"``."""
    return _family.lowering_cases(__name__, hidden_size)
