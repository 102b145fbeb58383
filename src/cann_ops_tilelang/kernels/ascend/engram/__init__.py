"""Ascend 950 kernels of the Engram family (hc_mult = 4), one kernel module per op module:
:mod:`.fused_weight`, :mod:`.gate` (forward and backward), :mod:`.grad_w_reduce`.

Uniform structure per launcher (:mod:`..._kernel`): a ``Kernel`` whose ``key(...)`` gives the compile-time key
from metadata (never the token count) and whose ``compiled(key)`` JIT-compiles ``build_<launcher>(**key fields)
-> prim_func`` for target ``ascend`` once per key (first compile logged at INFO; the token count is a dynamic
dim), and the launcher ``<launcher>(...)`` (validated tensors in, pre-allocated outputs, current stream, no
synchronization). This package only aggregates the kernel modules' lowering cases (importing it imports
neither a kernel module nor TileLang).
"""

from ... import _family

__all__ = ["lowering_cases"]


def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every kernel variant of the family at ``hidden_size``, keyed ``"<op module>/<case>"``."""
    return _family.lowering_cases(__name__, hidden_size, hc_mult=hc_mult)
