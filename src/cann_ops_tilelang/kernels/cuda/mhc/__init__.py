"""CUDA (TileLang) kernels of the mHC primitives (docs/ops/mhc.md), one module per op module.

Each module (``expand``, ``fn_normw_merge``, ``gemm_with_sqrsum``, ...) holds its ops' launchers (named as the
op, keyword arguments named as the op's), their ``*_key``, ``get_*_kernel`` and ``build_*`` functions and its
``lowering_cases``; the op layer imports the module of an op on its first launch. This package only aggregates
the lowering cases. Importing it imports neither TileLang nor a kernel module.
"""

import importlib

MODULES = (
    "expand",
    "fn_normw_merge",
    "gemm_with_sqrsum",
    "reduce_partials_and_rmsnorm",
    "pre_split_mixes",
    "sinkhorn",
    "pre_apply_mix",
    "post",
    "head_compute_mix",
    "pre_big_fuse",
    "multilayer_recompute",
)


def lowering_cases(hidden_size: int) -> dict:
    """Every kernel variant of the family at ``hidden_size``, un-compiled: ``{"<op module>/<case>": prim_func}``."""
    cases = {}
    for name in MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        cases.update({f"{name}/{case}": prim_func for case, prim_func in module.lowering_cases(hidden_size).items()})
    return cases
