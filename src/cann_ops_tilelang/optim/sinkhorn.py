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

SinkGD's alternating row/column L2 normalization (Scetbon et al., 2025) applied to the momentum, ending with a
row normalization; ``r`` restarts from 1 at every step, so a row of zeros gets an update of exactly zero. All
reductions are fixed-order (bitwise run to run). DTensor tables (``Shard(0)``, any row count) and the checks
that make a refused ``step()`` change nothing: docs/ops/engram.md#sinkhorn.
"""

import math
import numbers
import operator
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from .. import limits
from .._checks import describe, misalignment, overlap
from ..engram.sinkhorn import (
    engram_sinkhorn_finalize,
    engram_sinkhorn_finalize_apply,
    engram_sinkhorn_momentum_update,
    engram_sinkhorn_step,
    engram_sinkhorn_step_reduce,
)

__all__ = ["EngramSinkhorn", "sinkhorn_update"]

_FP32 = torch.finfo(torch.float32)  # tiny: the smallest normal number (a smaller eps would be flushed); max
# the ops read tables, gradients and momentum buffers in 16-byte vectors (their vector_args)
_VECTOR_BYTES = 16
# the value beta1 and its alias momentum both had after the last step (or when the group was added): at step()
# the key that differs from it is the one set since (a scheduler writes "momentum", a user may write "beta1")
_SYNCED = "beta1_synced"
_FLOAT_KEYS = ("lr", "beta1", "momentum", "eps", "alpha", "weight_decay")


def _real(value: Any) -> bool:
    """A real number that is no bool: Python's and numpy's alike (numpy bools are no ``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fp32_number(value: Any, op_takes: bool = True) -> bool:
    """A real number finite in fp32; one an op takes also zero or at least fp32's smallest normal number.

    check_float's rule written traceably: step() and sinkhorn_update() run under torch.compile, and
    check_float's struct packing does not trace."""
    return _real(value) and abs(value) <= _FP32.max and (not op_takes or value == 0 or abs(value) >= _FP32.tiny)


def _dtensor_spec(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]] | None:
    """``(device_mesh, placements)`` of a DTensor, None for any other tensor. torch.distributed.tensor is imported
    only for a tensor of another type than Tensor or Parameter (it costs 0.6 s, and a DTensor implies it)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return (tensor.device_mesh, tuple(tensor.placements)) if isinstance(tensor, DTensor) else None


def _row_sharded(placements: tuple[Any, ...]) -> bool:
    """Whether every placement is Replicate or Shard(0): the rows are independent, so the row-wise ops run on each
    rank's rows and only the column sums are all-reduced; a column or Partial split has no such strategy."""
    from torch.distributed.tensor import Replicate, Shard

    return all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _dtensor_spec(tensor) is not None else tensor


def _has_kernels(device: torch.device) -> bool:
    """Whether the ops have a kernel for ``device``'s type (the dispatcher's registrations; a device type it does
    not know is left to the ops)."""
    try:
        key = torch._C._dispatch_key_for_device(device.type)
        return torch._C._dispatch_has_kernel_for_dispatch_key(engram_sinkhorn_momentum_update.qualname, key)
    except RuntimeError:
        return True


def _new_row_scale(matrix: torch.Tensor, rows: int) -> torch.Tensor:
    """An ``(R,)`` fp32 row scale placed like the matrix's rows: on a DTensor sharded on rows each rank holds its
    rows' scales (DTensor's own new_empty would replicate them, and a step writing a replicated row scale would
    gather the whole matrix on every rank; with fewer rows than ranks the update could not be applied at all)."""
    spec = _dtensor_spec(matrix)
    if spec is None:
        return matrix.new_empty((rows,))
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, placements = spec
    local = matrix.to_local()
    placements = [Shard(0) if type(p) is Shard and p.dim == 0 else Replicate() for p in placements]
    return DTensor.from_local(local.new_empty((local.shape[0],)), mesh, placements, run_check=False,
                              shape=torch.Size((rows,)), stride=(1,))


def _sinkhorn_scales(matrix: torch.Tensor, iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 above on an ``(R, D)`` fp32 Sinkhorn input (R >= 1): the final ``(row_scale, col_scale)``."""
    rows, cols = matrix.shape
    row_scale = _new_row_scale(matrix, rows)
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
    """Steps 2-3 above on a Sinkhorn input: the update ``U``.

    Args:
        matrix: ``(R, D)`` fp32, contiguous, ``D`` in ``limits.ENGRAM_SINKHORN_COLS``; ``R = 0`` gives an empty
            update. A DTensor must be Replicate or Shard(0) on every mesh dim (any row count, fewer rows than
            ranks included): the update comes back placed alike, its column sums all-reduced.
        iters: int (Python or numpy) >= 0, the row/column rounds.
        eps: ``>= 0``, finite in fp32 and zero or normal there.
        alpha: the norm of every update row, finite in fp32 and zero or normal there.

    Returns:
        ``(R, D)`` fp32 (new).

    Raises ``TypeError``/``ValueError`` naming ``sinkhorn_update`` and the argument (the ops check the width and
    the layout, naming themselves).
    """
    if not isinstance(matrix, torch.Tensor):
        raise TypeError(f"sinkhorn_update: matrix must be a torch.Tensor, got {describe(matrix)}")
    if matrix.dim() != 2:
        raise ValueError(f"sinkhorn_update: matrix must be 2-D (R, D), got shape {tuple(matrix.shape)}")
    if matrix.dtype != torch.float32:
        raise TypeError(f"sinkhorn_update: matrix must be torch.float32, got {matrix.dtype}")
    spec = _dtensor_spec(matrix)
    if spec is not None and not _row_sharded(spec[1]):
        raise ValueError(f"sinkhorn_update: matrix must be Replicate or Shard(0) on every mesh dim (its rows are "
                         f"independent, its columns are not), got {spec[1]}")
    if isinstance(iters, bool) or not isinstance(iters, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"sinkhorn_update: iters must be an int, got {describe(iters)}")
    if not isinstance(iters, torch.SymInt):
        iters = operator.index(iters)  # numpy ints: range() and the ops take Python ints
        if iters < 0:
            raise ValueError(f"sinkhorn_update: iters must be >= 0, got {iters!r}")
    for name, value, nonnegative in (("eps", eps, True), ("alpha", alpha, False)):
        if isinstance(value, (torch.SymFloat, torch.SymInt)):
            continue  # traced: the ops check the value when the graph runs
        if not _real(value):
            raise TypeError(f"sinkhorn_update: {name} must be a real number, got {describe(value)}")
        if not (_fp32_number(value) and (value >= 0 or not nonnegative)):
            raise ValueError(f"sinkhorn_update: {name} must be {'>= 0, ' if nonnegative else ''}finite in fp32 "
                             f"and zero or at least 1.18e-38 (fp32's smallest normal) in magnitude, got {value!r}")
    eps = eps if isinstance(eps, (torch.SymFloat, torch.SymInt)) else float(eps)
    alpha = alpha if isinstance(alpha, (torch.SymFloat, torch.SymInt)) else float(alpha)
    if matrix.shape[0] == 0:
        return engram_sinkhorn_finalize(matrix, _new_row_scale(matrix, 0), matrix.new_ones((matrix.shape[1],)), eps,
                                        alpha)  # no rows: nothing to normalize (the column reduction needs R >= 1)
    row_scale, col_scale = _sinkhorn_scales(matrix, iters, eps)
    return engram_sinkhorn_finalize(matrix, row_scale, col_scale, eps, alpha)


class _Hyper(NamedTuple):
    """A group's hyper-parameters as the ops take them (Python numbers)."""

    lr: float
    beta1: float
    nesterov: bool
    iters: int
    eps: float
    alpha: float | None
    weight_decay: float
    decay: float  # 1 - lr * weight_decay (Python double, rounded to fp32 by the op as lr is)


class EngramSinkhorn(torch.optim.Optimizer):
    """Sinkhorn-normalized momentum SGD for 2-D embedding tables (module docstring).

    Args:
        params: an iterable of ``(R, D)`` tables (or of param groups, or of ``(name, table)`` pairs), each
            contiguous, bf16 or fp32, ``D`` in ``limits.ENGRAM_SINKHORN_COLS`` (64..1024, multiples of 64), any
            row count, each at most once. Dense (strided) floating-point gradients of the table's shape, device
            and placement (another dtype than the table's is cast to it first). On CUDA or Ascend devices (the
            ops have no CPU kernels). A DTensor table (FSDP2) must be Replicate or Shard(0) on every mesh dim,
            any row count (ranks without rows included).
        lr: learning rate (the update has entries of RMS ``alpha / sqrt(D)``, 1 by default).
        beta1: momentum decay in [0, 1], 0.9 when not given. ``momentum`` is its alias: every group holds both
            keys (so torch's schedulers with ``cycle_momentum`` drive it); where they differ at ``step()`` the one
            set since the last step wins, and both set to different values is an error.
        nesterov: bool, use the look-ahead ``beta1 * M + (1 - beta1) * G`` as the Sinkhorn input.
        sinkhorn_iters: int >= 0, row/column normalization rounds before the final row normalization (SinkGD: 5).
        eps: added to every row and column norm; rows whose momentum norm is far below it get a proportionally
            smaller update (in [1.2e-38, 1): at least fp32's smallest normal number).
        alpha: norm of every update row; ``None``: ``sqrt(D)``.
        weight_decay: decoupled weight decay (``W *= 1 - lr * weight_decay`` before the update).

    Numbers may be numpy's (stored as Python numbers); flags are bools only. ``lr``, ``beta1``, ``alpha`` and
    ``1 - lr * weight_decay`` must be finite in fp32 and zero or normal there (as the ops take them). Groups are
    checked when added, and ``step()`` checks every group, table, gradient and state before the first op: a refused
    step (``TypeError``/``ValueError`` naming the group and table) changes nothing (docs/ops/engram.md#sinkhorn).

    State per table: ``momentum_buffer`` (the table's dtype, shape, device and placement) and ``step``;
    ``state_dict()`` / ``load_state_dict()`` restore them exactly, so a resumed run repeats the updates bit for bit.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, beta1: float | None = None,
                 nesterov: bool = True, sinkhorn_iters: int = 5, eps: float = 1e-8, alpha: float | None = None,
                 weight_decay: float = 0.0, *, momentum: float | None = None):
        if isinstance(params, (torch.Tensor, dict)) or not isinstance(params, Iterable):
            hint = " (pass a list: [table] or [group])" if isinstance(params, (torch.Tensor, dict)) else ""
            raise TypeError(f"EngramSinkhorn: params must be an iterable of tables or param groups, got "
                            f"{describe(params)}{hint}")
        params = list(params)  # a generator: read once
        if not params:
            raise ValueError("EngramSinkhorn: params is empty (no table to optimize)")
        if beta1 is not None and momentum is not None and beta1 != momentum:
            raise ValueError(f"EngramSinkhorn: beta1 {beta1!r} and its alias momentum {momentum!r} both given")
        beta1 = 0.9 if beta1 is None and momentum is None else (momentum if beta1 is None else beta1)
        defaults = dict(lr=lr, beta1=beta1, momentum=beta1, nesterov=nesterov, sinkhorn_iters=sinkhorn_iters, eps=eps,
                        alpha=alpha, weight_decay=weight_decay)
        self._hyper(defaults, "")
        self._normalize(defaults)
        super().__init__(params, defaults)  # each group through add_param_group (checked there)

    @staticmethod
    def _hyper(group: dict[str, Any], where: str) -> _Hyper:
        """The hyper-parameters of a group (the constructor's defaults or a group's own values), checked: every key
        present, numbers real (numpy's too), flags bools, ranges as the ops take them. Changes nothing."""
        for key in ("lr", "nesterov", "sinkhorn_iters", "eps", "alpha", "weight_decay"):
            if key not in group:
                raise ValueError(f"EngramSinkhorn: {key} is missing{where} (a state_dict saved without it?)")
        beta1 = EngramSinkhorn._beta1(group, where)
        lr, iters, eps = group["lr"], group["sinkhorn_iters"], group["eps"]
        alpha, weight_decay, nesterov = group["alpha"], group["weight_decay"], group["nesterov"]
        if not (_fp32_number(lr) and lr >= 0.0):
            raise ValueError(f"EngramSinkhorn: lr must be 0 or a finite number >= 1.18e-38 (fp32's smallest normal), "
                             f"got {lr!r}{where}")
        if not isinstance(nesterov, bool):
            raise TypeError(f"EngramSinkhorn: nesterov must be a bool, got {describe(nesterov)}{where}")
        if isinstance(iters, bool) or not isinstance(iters, numbers.Integral):
            raise TypeError(f"EngramSinkhorn: sinkhorn_iters must be an int, got {describe(iters)}{where}")
        if iters < 0:
            raise ValueError(f"EngramSinkhorn: sinkhorn_iters must be >= 0, got {iters!r}{where}")
        if not (_fp32_number(eps) and _FP32.tiny <= eps < 1.0):
            raise ValueError(f"EngramSinkhorn: eps must be in [1.2e-38, 1), got {eps!r}{where}")
        if alpha is not None and not (_fp32_number(alpha) and alpha > 0):
            raise ValueError(f"EngramSinkhorn: alpha must be None or a finite number >= 1.18e-38 (fp32's smallest "
                             f"normal), got {alpha!r}{where}")
        if not (_fp32_number(weight_decay, op_takes=False) and weight_decay >= 0.0):
            raise ValueError(f"EngramSinkhorn: weight_decay must be a finite number >= 0, got {weight_decay!r}{where}")
        lr, weight_decay = float(lr), float(weight_decay)
        decay = 1.0 - lr * weight_decay  # in Python doubles whatever the numbers' types (numpy's float32 too)
        if not _fp32_number(decay):
            raise ValueError(f"EngramSinkhorn: the decay 1 - lr * weight_decay must be finite in fp32 and zero or "
                             f"normal there, got {decay!r} (lr {lr!r}, weight_decay {weight_decay!r}){where}")
        return _Hyper(lr, beta1, nesterov, operator.index(iters), float(eps), None if alpha is None else float(alpha),
                      weight_decay, decay)

    @staticmethod
    def _beta1(group: dict[str, Any], where: str) -> float:
        """beta1 from a group's ``beta1`` and its alias ``momentum``: one given, or equal, or the one that differs
        from their value at the last step (``beta1_synced``); both changed to different values is refused."""
        if "beta1" not in group and "momentum" not in group:
            raise ValueError(f"EngramSinkhorn: beta1 (or its alias momentum) is missing{where}")
        values = {key: group[key] for key in ("beta1", "momentum") if key in group}
        for key, value in values.items():
            if not (_fp32_number(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"EngramSinkhorn: {key} must be 0 or in [1.18e-38, 1], got {value!r}{where}")
        beta1, momentum = values.get("beta1", values.get("momentum")), values.get("momentum", values.get("beta1"))
        if beta1 != momentum:
            synced = group.get(_SYNCED)
            if _real(synced) and momentum == synced:
                momentum = beta1  # beta1 set since the last step
            elif _real(synced) and beta1 == synced:
                beta1 = momentum  # momentum set since (a scheduler's cycle_momentum)
            else:
                raise ValueError(f"EngramSinkhorn: beta1 {beta1!r} and its alias momentum {momentum!r} differ{where} "
                                 f"and both changed since the last step (set one, or both alike)")
        return float(beta1)

    @staticmethod
    def _normalize(group: dict[str, Any], hyper: _Hyper | None = None) -> None:
        """Stores numpy numbers as Python ones, and beta1's resolved value under beta1, momentum and beta1_synced
        (only where a value changes: a compiled step writes nothing when nothing changed)."""
        for key in _FLOAT_KEYS:
            value = group.get(key)
            if value is not None and type(value) not in (int, float):
                group[key] = float(value)
        iters = group.get("sinkhorn_iters")
        if iters is not None and type(iters) is not int:
            group["sinkhorn_iters"] = operator.index(iters)
        if hyper is not None:
            for key in ("beta1", "momentum", _SYNCED):
                if group.get(key) != hyper.beta1:
                    group[key] = hyper.beta1

    @staticmethod
    def _check_param(p: Any, where: str) -> None:
        """A table: a 2-D bf16/fp32 contiguous tensor of a width and size the ops take, placed as they can shard it."""
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"EngramSinkhorn: expected tensors (tables), got {describe(p)}{where}")
        if p.dim() != 2:
            raise ValueError(f"EngramSinkhorn: expected 2-D (rows, dim) tables, got shape {tuple(p.shape)}{where}")
        if p.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"EngramSinkhorn: expected bf16 or fp32 tables, got {p.dtype}{where}")
        if p.layout != torch.strided:
            raise TypeError(f"EngramSinkhorn: expected dense (torch.strided) tables, got {p.layout}{where}")
        if p.shape[1] not in limits.ENGRAM_SINKHORN_COLS:
            raise ValueError(f"EngramSinkhorn: expected a table width {limits.ENGRAM_SINKHORN_COLS.describe()}, "
                             f"got {p.shape[1]}{where}")
        if p.numel() not in limits.ENGRAM_SINKHORN_ELEMENTS:
            raise ValueError(f"EngramSinkhorn: expected a table of {limits.ENGRAM_SINKHORN_ELEMENTS.describe()} "
                             f"elements, got {p.numel()}{where}")
        if not p.is_contiguous():
            raise ValueError(f"EngramSinkhorn: expected contiguous tables, got strides {tuple(p.stride())}{where}")
        spec = _dtensor_spec(p)
        if spec is not None and not _row_sharded(spec[1]):
            raise ValueError(f"EngramSinkhorn: expected a DTensor table Replicate or Shard(0) on every mesh dim (its "
                             f"rows are independent, its columns are not), got {spec[1]}{where}")

    @staticmethod
    def _check_like(p: torch.Tensor, what: str, t: Any, where: str, dtype: torch.dtype | None) -> None:
        """``t`` (a gradient or momentum buffer) is a dense tensor with the table's shape, device and placement
        (and ``dtype`` when given; a gradient may be any floating-point dtype)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"EngramSinkhorn: expected a tensor {what}, got {describe(t)}{where}")
        if t.layout != torch.strided:
            raise TypeError(f"EngramSinkhorn: expected a dense (torch.strided) {what}, got {t.layout} (use dense "
                            f"embeddings: nn.Embedding(sparse=False)){where}")
        if dtype is None and not t.is_floating_point():
            raise TypeError(f"EngramSinkhorn: expected a floating-point {what}, got {t.dtype}{where}")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"EngramSinkhorn: expected a {what} of the table's dtype {dtype}, got {t.dtype}{where}")
        if t.shape != p.shape:
            raise ValueError(f"EngramSinkhorn: expected a {what} of the table's shape {tuple(p.shape)}, got "
                             f"{tuple(t.shape)}{where}")
        if t.device != p.device:
            raise ValueError(f"EngramSinkhorn: expected a {what} on the table's device {p.device}, got "
                             f"{t.device}{where}")
        spec, table_spec = _dtensor_spec(t), _dtensor_spec(p)
        if (spec is None) != (table_spec is None) or (spec is not None and spec != table_spec):
            def show(s):
                return "a plain tensor" if s is None else f"a DTensor {s[1]} on {s[0]}"
            raise ValueError(f"EngramSinkhorn: expected a {what} placed as the table ({show(table_spec)}), got "
                             f"{show(spec)}{where}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group after checking its tables and its hyper-parameters, so that a refused group is never
        registered. ``momentum`` is accepted as the alias of ``beta1`` (giving both, different, is an error); the
        group then holds both."""
        where = f" (param group {len(self.param_groups)})"
        if not isinstance(param_group, dict):
            raise TypeError(f"EngramSinkhorn: a param group must be a dict, got {describe(param_group)}")
        if "params" not in param_group:
            raise ValueError(f"EngramSinkhorn: a param group needs 'params' (its tables){where}")
        given = {key: param_group[key] for key in ("beta1", "momentum") if key in param_group}
        if len(given) == 2 and given["beta1"] != given["momentum"]:
            raise ValueError(f"EngramSinkhorn: a group gives both beta1 {given['beta1']!r} and its alias momentum "
                             f"{given['momentum']!r}{where}")
        hyper = {**{k: v for k, v in self.defaults.items() if k not in ("beta1", "momentum")}, **param_group}
        hyper.pop(_SYNCED, None)
        if not given:
            hyper["beta1"] = self.defaults["beta1"]
        resolved = self._hyper(hyper, where)
        params = param_group["params"]
        if not isinstance(params, set):  # torch refuses sets (unordered) itself
            if isinstance(params, torch.Tensor):
                params = [params]
            elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, dict)):
                params = list(params)  # a generator: read once
            else:
                raise TypeError(f"EngramSinkhorn: a group's params must be an iterable of tables, got "
                                f"{describe(params)}{where}")
            seen = {id(p) for g in self.param_groups for p in g["params"]}
            for j, p in enumerate(params):
                table = p[1] if isinstance(p, tuple) and len(p) == 2 else p  # (name, table) pairs are torch's too
                self._check_param(table, f" (param group {len(self.param_groups)}, table {j})")
                if id(table) in seen:
                    raise ValueError(f"EngramSinkhorn: a table appears twice (it would be updated twice per step)"
                                     f" (param group {len(self.param_groups)}, table {j})")
                seen.add(id(table))
            param_group["params"] = params
        self._normalize(param_group, resolved)  # the caller's dict is the group, as torch keeps it
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` (values are checked at the next ``step()``); a group saved with only one of
        ``beta1`` / ``momentum`` (saved before both were kept) gets the other, marked as synced."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            one = [key for key in ("beta1", "momentum") if key in group]
            if len(one) == 1 and _SYNCED not in group:
                group["momentum" if one[0] == "beta1" else "beta1"] = group[_SYNCED] = group[one[0]]

    def _plan(self) -> list[tuple[dict[str, Any], _Hyper, list[tuple[torch.Tensor, torch.Tensor, Any]]]]:
        """Checks every group, table, gradient and state before anything changes: ``[(group, hyper-parameters,
        [(table, gradient, state or None), ...])]`` for the tables with a gradient."""
        eager = not torch.compiler.is_compiling()  # identities, addresses and dispatch tables: eager only
        seen: set[int] = set()
        with_kernels: set[str] = set()  # device types already asked about in this step
        plan = []
        for i, group in enumerate(self.param_groups):
            hyper = self._hyper(group, f" (param group {i})")
            params = group.get("params")
            if not isinstance(params, list):
                raise TypeError(f"EngramSinkhorn: expected a list of tables under 'params', got "
                                f"{describe(params)} (param group {i})")
            work = []
            for j, p in enumerate(params):
                where = f" (param group {i}, table {j})"
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"EngramSinkhorn: expected tensors (tables), got {describe(p)}{where}")
                if eager:
                    if id(p) in seen:
                        raise ValueError(f"EngramSinkhorn: a table appears twice (it would be updated twice){where}")
                    seen.add(id(p))
                grad = p.grad
                if grad is None:
                    continue
                self._check_param(p, where)
                self._check_like(p, "gradient", grad, where, None)
                state = self.state.get(p)
                if state:
                    missing = [key for key in ("momentum_buffer", "step") if key not in state]
                    if missing:
                        raise ValueError(f"EngramSinkhorn: a table's state needs momentum_buffer and step, it has no "
                                         f"{' and no '.join(missing)}{where}")
                    buffer, step = state["momentum_buffer"], state["step"]
                    self._check_like(p, "momentum_buffer", buffer, where, p.dtype)
                    if not buffer.is_contiguous():
                        raise ValueError(f"EngramSinkhorn: expected a contiguous momentum_buffer, got strides "
                                         f"{tuple(buffer.stride())}{where}")
                    if isinstance(step, torch.Tensor):
                        if step.numel() != 1 or step.dtype == torch.bool or step.is_complex():
                            raise ValueError(f"EngramSinkhorn: expected a one-element real step count, got a "
                                             f"{step.dtype} tensor of shape {tuple(step.shape)}{where}")
                    elif not _real(step):
                        raise TypeError(f"EngramSinkhorn: expected a step count (a number or a tensor), got "
                                        f"{describe(step)}{where}")
                else:
                    state = None
                if eager:
                    if p.device.type not in with_kernels:
                        if not _has_kernels(p.device):
                            raise RuntimeError(f"EngramSinkhorn: no kernel for tensors on device '{p.device.type}'"
                                               f"{where}; the ops run on cuda and npu devices")
                        with_kernels.add(p.device.type)
                    self._check_memory(p, grad, None if state is None else state["momentum_buffer"], where)
                work.append((p, grad, state))
            plan.append((group, hyper, work))
        return plan

    @staticmethod
    def _check_memory(p: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor | None, where: str) -> None:
        """What the ops would refuse once running (misaligned or overlapping buffers), checked up front so that no
        earlier table is updated by then."""
        table = _local(p)
        if misalignment(table, _VECTOR_BYTES):
            raise ValueError(f"EngramSinkhorn: expected a table starting on a {_VECTOR_BYTES}-byte boundary (the "
                             f"ops read it in vectors), got one {misalignment(table, _VECTOR_BYTES)} bytes past "
                             f"one{where}")
        if buffer is not None:
            local = _local(buffer)
            if misalignment(local, _VECTOR_BYTES):
                raise ValueError(f"EngramSinkhorn: expected a momentum_buffer starting on a {_VECTOR_BYTES}-byte "
                                 f"boundary, got one {misalignment(local, _VECTOR_BYTES)} bytes past one{where}")
            for name, other in (("the table", table), ("the gradient", _local(grad))):
                if overlap(local, other):
                    raise ValueError(f"EngramSinkhorn: expected a momentum_buffer that shares no memory with "
                                     f"{name}{where}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every table that has a gradient; returns ``closure()`` when given (a callable or None).

        Every group, table, gradient and state is checked first (``_plan``): a refused step changes nothing."""
        if closure is not None and not callable(closure):
            raise TypeError(f"EngramSinkhorn.step: closure must be callable or None, got {describe(closure)}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan()
        for group, hyper, work in plan:
            self._normalize(group, hyper)  # beta1 and momentum alike again; numpy numbers stored as Python's
            for p, grad, state in work:
                fresh = state is None
                buffer = torch.zeros_like(p, memory_format=torch.contiguous_format) if fresh \
                    else state["momentum_buffer"]
                rows, cols = p.shape
                if rows > 0:
                    grad = grad.contiguous().to(p.dtype)
                    if not torch.compiler.is_compiling() and misalignment(_local(grad), _VECTOR_BYTES):
                        grad = grad.clone()  # a view at an odd offset: the ops read it in vectors
                    sinkhorn_input = engram_sinkhorn_momentum_update(grad, buffer, hyper.beta1, hyper.nesterov)
                    alpha = math.sqrt(cols) if hyper.alpha is None else hyper.alpha
                    row_scale, col_scale = _sinkhorn_scales(sinkhorn_input, hyper.iters, hyper.eps)
                    # W <- W * (1 - lr * wd) - lr * U inside the op: no float arithmetic left to PyTorch/inductor
                    engram_sinkhorn_finalize_apply(sinkhorn_input, row_scale, col_scale, hyper.eps, alpha, p,
                                                   hyper.lr, hyper.decay)
                if fresh:
                    state = self.state[p]
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum_buffer"] = buffer
                state["step"] += 1
        return loss
