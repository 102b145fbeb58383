"""Ascend 950 (TileLang Ascend dialect) kernels of the mHC ops: one kernel module per op module
(``cann_ops_tilelang.mhc.<op module>``), with its launchers, key functions, builders and lowering cases;
``_common``, ``_streaming`` and ``_per_token`` hold what several of them share.

This package only aggregates the lowering cases; importing it imports no kernel module (nor TileLang).
"""

import importlib

__all__ = ["OP_MODULES", "lowering_cases"]

OP_MODULES = (
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
    """Every kernel variant of the family at ``hidden_size``, keyed ``<op module>/<case>``."""
    cases = {}
    for name in OP_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        cases.update({f"{name}/{case}": prim_func for case, prim_func in module.lowering_cases(hidden_size).items()})
    return cases
