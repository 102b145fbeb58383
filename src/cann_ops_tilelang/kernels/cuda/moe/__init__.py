"""CUDA (TileLang) kernels of the MoE routing family (docs/ops/moe.md): one module per op module (``topk_gate``,
``normalize_weight``), each with its ops' launchers (named as the op, keyword arguments named as the op's), their
``Kernel`` declarations (key, builder, compile cache) and its ``lowering_cases``; the op layer imports the module of
an op on its first launch. This package only aggregates the lowering cases (the gates' are at
their expert counts whatever the hidden size). Importing it imports neither TileLang nor a kernel module.
"""

from ... import _family

__all__ = ["lowering_cases"]


def lowering_cases(hidden_size: int) -> dict:
    """Every kernel variant of the family at ``hidden_size``, keyed ``"<op module>/<case>"``."""
    return _family.lowering_cases(__name__, hidden_size)
