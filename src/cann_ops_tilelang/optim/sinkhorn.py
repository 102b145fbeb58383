"""``EngramSinkhorn``: momentum + Sinkhorn (row/column) normalization for Engram embedding tables.

One update of a ``(R, D)`` table with gradient ``G`` (docs/ops/engram.md#sinkhorn):

1. ``M <- beta1 * M + (1 - beta1) * G`` in place; ``A = beta1 * M + (1 - beta1) * G`` with Nesterov, else
   ``A = M`` (fp32, ``engram_sinkhorn_momentum_update``).
2. ``sinkhorn_iters`` times, on the implicit iterate ``X = diag(r) A diag(c)`` (``c = 1`` at first):
   rows to unit L2 norm (``r_i = 1 / (||A_i c|| + eps)``: ``engram_sinkhorn_step`` from ``r = 1``), then
   columns to the balanced norm ``sqrt(R / D)`` that unit rows give on average
   (``c_j <- c_j / (sqrt(s_j * D / R) + eps)`` from the column sums of squares ``s_j``: the epilogue of
   ``engram_sinkhorn_step_reduce``; a column of zeros keeps its scale).
3. ``U = alpha * rownormalize(X)`` (``alpha = sqrt(D)`` by default: every update row has norm ``sqrt(D)``,
   entries of unit RMS, the scale of SinkGD's final row normalization) and
   ``W <- W * (1 - lr * weight_decay) - lr * U`` (decoupled weight decay) in one pass,
   ``engram_sinkhorn_finalize_apply`` (``U`` is never stored).

Every float operation of the update runs inside the ops, each rounded on its own as their contracts say; the
optimizer itself only fills scales with 1 (exact). So ``torch.compile`` (any backend) cannot fuse, contract or
reorder any of the arithmetic: a compiled step gives the eager step's bits.

This is SinkGD's alternating row/column L2 normalization (Scetbon et al., 2025, "Gradient Multi-Normalization
for Stateless and Scalable LLM Training") applied to the momentum, ending with a row normalization so that
every embedding row moves by the same norm. ``r`` restarts from 1 at every step, so a row of zeros (an n-gram
no token has touched yet) keeps ``r = 1 / eps`` instead of growing by ``1 / eps`` per step into ``inf``
(``inf * 0`` would be NaN); its update is exactly zero. All reductions are fixed-order: the same inputs give
bitwise the same update on every run.
"""

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import limits
from ..engram.sinkhorn import (
    engram_sinkhorn_finalize,
    engram_sinkhorn_finalize_apply,
    engram_sinkhorn_momentum_update,
    engram_sinkhorn_step,
    engram_sinkhorn_step_reduce,
)

__all__ = ["EngramSinkhorn", "sinkhorn_update"]

_FP32 = torch.finfo(torch.float32)  # tiny: the smallest normal number (a smaller eps would be flushed); max


def _sinkhorn_scales(matrix: torch.Tensor, iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 above on an ``(R, D)`` fp32 Sinkhorn input (R >= 1): the final ``(row_scale, col_scale)``."""
    rows, cols = matrix.shape
    row_scale = matrix.new_empty((rows,))
    col_scale = matrix.new_ones((cols,))
    col_sumsq = matrix.new_empty((cols,))
    for _ in range(iters):
        row_scale.fill_(1.0)
        _row_norm, partial = engram_sinkhorn_step(matrix, row_scale, col_scale, eps)
        engram_sinkhorn_step_reduce(partial, col_sumsq, col_scale, rows, eps)  # and col_scale in place
    if iters == 0:
        row_scale.fill_(1.0)
    return row_scale, col_scale


def sinkhorn_update(matrix: torch.Tensor, iters: int, eps: float, alpha: float) -> torch.Tensor:
    """Steps 2-3 above on an ``(R, D)`` fp32 Sinkhorn input: the ``(R, D)`` fp32 update ``U`` (``iters >= 0``;
    the ops check the rest; ``R = 0`` gives an empty update)."""
    if isinstance(iters, bool) or not isinstance(iters, int):
        raise TypeError(f"sinkhorn_update: iters must be an int, got {type(iters).__name__}")
    if iters < 0:
        raise ValueError(f"sinkhorn_update: iters must be >= 0, got {iters!r}")
    if isinstance(matrix, torch.Tensor) and matrix.dim() == 2 and matrix.shape[0] == 0:
        return engram_sinkhorn_finalize(matrix, matrix.new_empty((0,)), matrix.new_ones((matrix.shape[1],)), eps,
                                        alpha)  # no rows: nothing to normalize (the column reduction needs R >= 1)
    row_scale, col_scale = _sinkhorn_scales(matrix, iters, eps)
    return engram_sinkhorn_finalize(matrix, row_scale, col_scale, eps, alpha)


class EngramSinkhorn(torch.optim.Optimizer):
    """Sinkhorn-normalized momentum SGD for 2-D embedding tables (module docstring).

    Args:
        params: ``(R, D)`` tables (or param groups), contiguous, bf16 or fp32, ``D`` in
            ``limits.ENGRAM_SINKHORN_COLS`` (64..1024, multiples of 64), any row count.
            Dense floating-point gradients (another dtype than the table's is cast to it first). On CUDA or
            Ascend devices (the ops have no CPU kernels).
        lr: learning rate (the update has entries of RMS ``alpha / sqrt(D)``, 1 by default).
        beta1: momentum decay in [0, 1], 0.9 when not given (``momentum`` is accepted as an alias; giving both
            with different values is an error).
        nesterov: use the look-ahead ``beta1 * M + (1 - beta1) * G`` as the Sinkhorn input.
        sinkhorn_iters: row/column normalization rounds before the final row normalization (SinkGD: 5).
        eps: added to every row and column norm; rows whose momentum norm is far below it get a proportionally
            smaller update (in [1.2e-38, 1): at least fp32's smallest normal number).
        alpha: norm of every update row; ``None``: ``sqrt(D)``.
        weight_decay: decoupled weight decay (``W *= 1 - lr * weight_decay`` before the update).

    ``lr``, ``beta1``, ``alpha`` and ``1 - lr * weight_decay`` must be finite in fp32 and zero or at least its
    smallest normal number (as the ops take them); ``weight_decay`` finite. Every group is checked when added, and
    all of them again at every ``step()`` (a scheduler's or ``load_state_dict``'s values too) before any table or
    state changes.

    State per table: ``momentum_buffer`` (the table's dtype and shape) and ``step``; ``state_dict()`` /
    ``load_state_dict()`` restore them exactly, so a resumed run repeats the updates bit for bit.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, beta1: float | None = None,
                 nesterov: bool = True, sinkhorn_iters: int = 5, eps: float = 1e-8, alpha: float | None = None,
                 weight_decay: float = 0.0, *, momentum: float | None = None):
        if beta1 is not None and momentum is not None and beta1 != momentum:
            raise ValueError(f"EngramSinkhorn: beta1 {beta1!r} and its alias momentum {momentum!r} both given")
        beta1 = 0.9 if beta1 is None and momentum is None else (momentum if beta1 is None else beta1)
        defaults = dict(lr=lr, beta1=beta1, nesterov=nesterov,
                        sinkhorn_iters=sinkhorn_iters, eps=eps, alpha=alpha, weight_decay=weight_decay)
        self._check_hyper(defaults)
        super().__init__(params, defaults)  # each group through add_param_group (checked there)

    @staticmethod
    def _check_hyper(group: dict[str, Any]) -> None:
        """The hyper-parameters of a group (the constructor's defaults or a group's own values)."""
        def number(value: Any, op_takes: bool = True) -> bool:
            # a real number finite in fp32; one an op takes also zero or at least fp32's smallest normal number
            # (check_float's rule, written traceably: step() runs it under torch.compile, check_float's
            # struct packing does not trace)
            return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= _FP32.max \
                and (not op_takes or value == 0 or abs(value) >= _FP32.tiny)

        lr, beta1, iters, eps = group["lr"], group["beta1"], group["sinkhorn_iters"], group["eps"]
        alpha, weight_decay = group["alpha"], group["weight_decay"]
        if not (number(lr) and lr >= 0.0):
            raise ValueError(f"EngramSinkhorn: lr must be 0 or a finite number >= 1.18e-38 (fp32's smallest normal), "
                             f"got {lr!r}")
        if not (number(beta1) and 0.0 <= beta1 <= 1.0):
            raise ValueError(f"EngramSinkhorn: beta1 must be 0 or in [1.18e-38, 1], got {beta1!r}")
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"EngramSinkhorn: nesterov must be a bool, got {type(group['nesterov']).__name__}")
        if isinstance(iters, bool) or not isinstance(iters, int):
            raise TypeError(f"EngramSinkhorn: sinkhorn_iters must be an int, got {type(iters).__name__}")
        if iters < 0:
            raise ValueError(f"EngramSinkhorn: sinkhorn_iters must be >= 0, got {iters!r}")
        if not (number(eps) and _FP32.tiny <= eps < 1.0):
            raise ValueError(f"EngramSinkhorn: eps must be in [1.2e-38, 1), got {eps!r}")
        if alpha is not None and not (number(alpha) and alpha > 0):
            raise ValueError(f"EngramSinkhorn: alpha must be None or a finite number >= 1.18e-38 (fp32's smallest "
                             f"normal), got {alpha!r}")
        if not (number(weight_decay, op_takes=False) and weight_decay >= 0.0):
            raise ValueError(f"EngramSinkhorn: weight_decay must be a finite number >= 0, got {weight_decay!r}")
        if not number(1.0 - lr * weight_decay):
            raise ValueError(f"EngramSinkhorn: the decay 1 - lr * weight_decay must be finite in fp32 and zero or "
                             f"normal there, got {1.0 - lr * weight_decay!r} (lr {lr!r}, weight_decay "
                             f"{weight_decay!r})")

    @staticmethod
    def _check_param(p: torch.Tensor) -> None:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"EngramSinkhorn: expected tensors (tables), got {type(p).__name__}")
        if p.dim() != 2:
            raise ValueError(f"EngramSinkhorn: expected 2-D (rows, dim) tables, got shape {tuple(p.shape)}")
        if p.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"EngramSinkhorn: expected bf16 or fp32 tables, got {p.dtype}")
        if p.shape[1] not in limits.ENGRAM_SINKHORN_COLS:
            raise ValueError(f"EngramSinkhorn: expected a table width {limits.ENGRAM_SINKHORN_COLS.describe()}, "
                             f"got {p.shape[1]}")
        limits.ENGRAM_SINKHORN_ELEMENTS.require("EngramSinkhorn", p.numel())
        if not p.is_contiguous():
            raise ValueError("EngramSinkhorn: expected contiguous tables")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group (``momentum`` accepted as an alias of ``beta1``) after checking its tables and its
        hyper-parameters, so that a refused group is never registered."""
        hyper = {**self.defaults, **param_group}
        if "momentum" in param_group:
            momentum = hyper.pop("momentum")
            if "beta1" in param_group and param_group["beta1"] != momentum:
                raise ValueError(f"EngramSinkhorn: a group gives both beta1 {param_group['beta1']!r} and its alias "
                                 f"momentum {momentum!r}")
            hyper["beta1"] = momentum
        self._check_hyper(hyper)
        params = param_group["params"]
        if not isinstance(params, set):  # torch refuses sets (unordered) itself
            params = [params] if isinstance(params, torch.Tensor) else list(params)  # a generator: read once
            for p in params:
                self._check_param(p[1] if isinstance(p, tuple) else p)  # (name, table) pairs are torch's too
            param_group["params"] = params
        if "momentum" in param_group:  # the caller's dict is the group, as torch keeps it
            param_group["beta1"] = param_group.pop("momentum")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every table that has a gradient; returns ``closure()`` when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # changed since added (a scheduler, load_state_dict): all checked first
            self._check_hyper(group)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("EngramSinkhorn: sparse gradients are not supported (use dense embeddings)")
                if not grad.is_floating_point():
                    raise TypeError(f"EngramSinkhorn: expected a floating-point gradient, got {grad.dtype}")
                # a new table's state is registered once its first update went through (a refused call, e.g.
                # a table on a device without kernels, leaves the state as it was)
                state = self.state.get(p)
                fresh = state is None or "momentum_buffer" not in state
                buffer = torch.zeros_like(p, memory_format=torch.contiguous_format) if fresh \
                    else state["momentum_buffer"]
                rows, cols = p.shape
                if rows > 0:
                    sinkhorn_input = engram_sinkhorn_momentum_update(grad.contiguous().to(p.dtype), buffer,
                                                                     group["beta1"], group["nesterov"])
                    alpha = math.sqrt(cols) if group["alpha"] is None else group["alpha"]
                    row_scale, col_scale = _sinkhorn_scales(sinkhorn_input, group["sinkhorn_iters"], group["eps"])
                    # W <- W * (1 - lr * wd) - lr * U inside the op: no float arithmetic left to PyTorch/inductor
                    engram_sinkhorn_finalize_apply(sinkhorn_input, row_scale, col_scale, group["eps"], alpha, p,
                                                   lr, 1.0 - lr * wd)
                if fresh:
                    state = self.state[p]
                    state.setdefault("step", torch.zeros((), dtype=torch.float32))
                    state["momentum_buffer"] = buffer
                state["step"] += 1
        return loss
