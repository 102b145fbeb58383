"""CUDA (TileLang) kernels of the Engram family, one kernel module per op module: :mod:`.fused_weight`,
:mod:`.gate` (a package: forward and backward), :mod:`.grad_w_reduce`.

Launch pattern (uniform across the kernels, :mod:`..._kernel`): each kernel is a ``Kernel`` whose ``key(...)``
computes the compile-time key from tensor metadata and flags (never the token count, a dynamic dimension of the
kernels) and whose ``compiled(key)`` compiles ``build_<launcher>(**key fields)`` once per key and logs it;
``<launcher>(...)`` launches on the current torch stream into caller-allocated outputs. This package
only aggregates the kernel modules' lowering cases (importing it imports no kernel module).
"""

from ... import _family

__all__ = ["lowering_cases"]


def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every kernel variant of the family at ``hidden_size``, keyed ``"<op module>/<case>"``."""
    return _family.lowering_cases(__name__, hidden_size, hc_mult=hc_mult)
