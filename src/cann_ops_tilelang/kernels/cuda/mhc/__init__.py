"""CUDA (TileLang) kernels of the mHC primitives (OPS.md §B.2, §C).

Three modules: ``streaming`` (expand, normw merge, pre apply mix, post: bandwidth-bound over H),
``gemm`` (the pre-norm GEMM with sum of squares and its backward) and ``small`` (per-token ops:
reduce + RMSNorm, split mixes, Sinkhorn, head mix). Every op has one launcher named as the op, taking
the op's arguments in schema order followed by its new outputs; see each module for the kernels.
"""

from . import gemm, small, streaming
from .gemm import *  # noqa: F403
from .small import *  # noqa: F403
from .streaming import *  # noqa: F403

_MODULES = {"streaming": streaming, "gemm": gemm, "small": small}


def lowering_cases(hidden_size: int) -> dict:
    """Every kernel variant of the family at ``hidden_size``, keyed ``<module>/<case>``."""
    return {
        f"{name}/{case}": prim_func
        for name, module in _MODULES.items()
        for case, prim_func in module.lowering_cases(hidden_size).items()
    }
