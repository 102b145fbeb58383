"""Public names renamed in 0.2 (one name per concept, docs/layout.md#names), kept for one release.

Each old name still works and raises a ``DeprecationWarning`` naming the new one:

* :data:`RENAMED_OPS`: op and function names (``_fwd`` / ``_bwd`` became ``_forward`` / ``_backward``), as
  attributes of the package, of its family package and of ``torch.ops.cann_ops_tilelang`` (eager calls);
* :data:`RENAMED_ARGUMENTS`: keyword arguments of the public op functions (gradients are ``grad_<name>``,
  ``<name>`` the forward's tensor). Positions are unchanged, so positional calls never warn.

Remove this module, its two uses in ``_library.declare`` and ``engram/__init__.py``, and
``tests/test_deprecated.py`` in 0.3.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

REMOVED_IN = "0.3"

RENAMED_OPS = {
    "engram_gate_fwd": "engram_gate_forward",
    "engram_gate_fwd_inplace": "engram_gate_forward_inplace",
    "engram_gate_bwd": "engram_gate_backward",
}

RENAMED_ARGUMENTS: dict[str, dict[str, str]] = {
    "expand_to_mhc_backward": {"out_grad": "grad_out", "x_grad": "grad_x"},
    "mhc_fn_normw_merge_backward": {"out_fn_grad": "grad_out_fn", "fn_grad": "grad_fn", "normw_grad": "grad_normw"},
    "mhc_gemm_with_sqrsum_backward": {"out_mul_grad": "grad_out_mul", "sqrsum_grad": "grad_sqrsum",
                                      "x_grad": "grad_x"},
    "mhc_head_compute_mix_backward": {"output_mix_grad": "grad_output_mix", "input_mix_grad": "grad_input_mix",
                                      "mhc_scale_grad_partial": "grad_mhc_scale_partial",
                                      "mhc_base_grad_partial": "grad_mhc_base_partial"},
    "mhc_post_backward": {"d_o": "grad_out"},
    "mhc_pre_apply_mix_backward": {"out_grad": "grad_out", "x_grad": "grad_x"},
    "mhc_pre_split_mixes_backward": {"pre_grad": "grad_pre", "post_grad": "grad_post", "comb_grad": "grad_comb",
                                     "input_mixes_grad": "grad_input_mixes", "mhc_scale_grad": "grad_mhc_scale",
                                     "mhc_base_grad": "grad_mhc_base"},
    "mhc_reduce_partials_and_rmsnorm_backward": {"out_grad": "grad_out", "out_mul_grad": "grad_out_mul",
                                                 "sqrsum_grad": "grad_sqrsum"},
    "mhc_sinkhorn_backward": {"grad_output": "grad_comb_out", "x": "comb", "grad_input": "grad_comb"},
}


def warn(old: str, new: str, what: str) -> None:
    warnings.warn(f"cann_ops_tilelang: the {what} {old!r} is deprecated and will be removed in {REMOVED_IN}; "
                  f"use {new!r}", DeprecationWarning, stacklevel=3)


def rename_keywords(op: str, renamed: Mapping[str, str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each old keyword of ``op`` replaced by its new name (warning once per old name);
    both names at once are refused as Python refuses a duplicate keyword."""
    out = dict(kwargs)
    for old, new in renamed.items():
        if old in out:
            if new in out:
                raise TypeError(f"{op}() got the argument {new!r} twice (also as its deprecated name {old!r})")
            warn(old, new, f"argument of {op}()")
            out[new] = out.pop(old)
    return out


def module_getattr(module_name: str, namespace: Mapping[str, Any]):
    """A module ``__getattr__`` that resolves the old names of :data:`RENAMED_OPS` found in ``namespace``."""

    def __getattr__(name: str) -> Any:
        new = RENAMED_OPS.get(name)
        if new is None or new not in namespace:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        warn(name, new, "function")
        return namespace[new]

    return __getattr__


class _OpAlias:
    """``torch.ops.cann_ops_tilelang.<old name>``: warns, then behaves as the new op's overload packet."""

    def __init__(self, old: str, new: str):
        self._old, self._new = old, new

    def _target(self) -> Any:
        import torch

        warn(f"torch.ops.cann_ops_tilelang.{self._old}", f"torch.ops.cann_ops_tilelang.{self._new}", "op")
        return getattr(torch.ops.cann_ops_tilelang, self._new)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._target(), name)


def install_op_aliases() -> None:
    """Puts an alias of each renamed op in ``torch.ops.cann_ops_tilelang`` (called once, at import)."""
    import torch

    namespace = torch.ops.cann_ops_tilelang
    for old, new in RENAMED_OPS.items():
        if hasattr(namespace, new):
            setattr(namespace, old, _OpAlias(old, new))
