"""The Engram Sinkhorn optimizer ops (docs/ops/engram.md#sinkhorn): the momentum update that produces the
Sinkhorn input, one row-normalization step of an implicitly scaled matrix with deterministic per-worker
column partials, their fixed-order reduction, and the final row-normalized, alpha-scaled matrix.

The matrix is never rescaled in memory: the iterate is ``X = diag(row_scale) @ A @ diag(col_scale)``, read
from ``A`` and the two scale vectors; a step writes ``row_scale`` (and the caller updates ``col_scale`` from
the reduced column sums in the reduction's epilogue). The finalize can also apply the update to the table
(``engram_sinkhorn_finalize_apply``), so that no element-wise float arithmetic of the optimizer is left to
PyTorch or a compiler (``cann_ops_tilelang.optim.EngramSinkhorn``: the same bits eager and compiled).
"""

from typing import Optional

from torch import Tensor

from .. import limits
from .._checks import OpError, check_bool, check_float, check_int, check_same_device, check_tensor, describe
from .._library import declare
from ..policy import SINKHORN_STEP_PARTIALS, per_backend
from ._common import BF16, F32

__all__ = [
    "engram_sinkhorn_finalize",
    "engram_sinkhorn_finalize_apply",
    "engram_sinkhorn_momentum_update",
    "engram_sinkhorn_step",
    "engram_sinkhorn_step_reduce",
    "sinkhorn_partials",
]

def sinkhorn_partials(device_type: str) -> int:
    """Rows ``P`` of ``engram_sinkhorn_step``'s column partials on ``device_type``, fixed per backend so that fakes
    allocate them without a device (device policy, ``policy.py``: on CUDA four CTAs per H200 SM, on the
    Ascend 950 one per vector core); any other device (CPU references, meta) takes the CUDA layout."""
    return per_backend(SINKHORN_STEP_PARTIALS, device_type)


def _check_scaled_matrix(op: str, matrix, row_scale, col_scale) -> tuple[OpError, int, int]:
    err = OpError(op)
    a = check_tensor(err, "matrix", matrix, dtype=F32, ndim=2)
    rows, cols = a.shape
    limits.ENGRAM_SINKHORN_COLS.check(err, "matrix", cols)
    limits.ENGRAM_SINKHORN_ELEMENTS.check(err, "matrix", a.numel())
    check_tensor(err, "row_scale", row_scale, dtype=F32, shape=(rows,))
    check_tensor(err, "col_scale", col_scale, dtype=F32, shape=(cols,))
    check_same_device(err, [("matrix", matrix), ("row_scale", row_scale), ("col_scale", col_scale)])
    return err, rows, cols


@declare("engram_sinkhorn_momentum_update", mutates_args=("momentum_buffer",),
         vector_args={"grad": 16, "momentum_buffer": 16}, outputs=("out",))
def engram_sinkhorn_momentum_update(grad: Tensor, momentum_buffer: Tensor, beta1: float, nesterov: bool) -> Tensor:
    """Momentum update in place and the fp32 Sinkhorn input.

    In fp32 with every product and sum rounded on its own (no fused multiply-add), ``b = beta1`` and
    ``b' = 1 - beta1`` (both rounded to fp32 from the double values):
    ``m = f32(momentum_buffer) * b + f32(grad) * b'``, stored back into ``momentum_buffer`` (one
    round-to-nearest-even cast where it is bf16); the result is ``m * b + f32(grad) * b'`` (the Nesterov
    look-ahead, from the unrounded fp32 ``m``) when ``nesterov`` else ``m``.

    Args:
        grad: any shape and element count (zero included), contiguous, bf16 or fp32.
        momentum_buffer: the shape of ``grad``, contiguous, bf16 or fp32; updated in place.
        beta1: momentum decay in [0, 1].
        nesterov: whether to return the look-ahead.

    Returns:
        fp32 tensor of ``momentum_buffer``'s shape (new).
    """
    err = OpError("engram_sinkhorn_momentum_update")
    for arg, value in (("grad", grad), ("momentum_buffer", momentum_buffer)):
        if not isinstance(value, Tensor):
            raise err.type(arg, f"expected a torch.Tensor, got {describe(value)}")
        if value.dtype not in (BF16, F32):
            raise err.type(arg, f"expected dtype torch.bfloat16 or torch.float32, got {value.dtype}")
        check_tensor(err, arg, value, dtype=value.dtype)
    if momentum_buffer.shape != grad.shape:
        raise err.value("momentum_buffer", f"expected the shape of grad {tuple(grad.shape)}, "
                                           f"got {tuple(momentum_buffer.shape)}")
    limits.ENGRAM_SINKHORN_ELEMENTS.check(err, "grad", grad.numel())
    beta = check_float(err, "beta1", beta1, minimum=0.0)
    if isinstance(beta, float) and beta > 1.0:
        raise err.value("beta1", f"expected a number in [0, 1], got {beta}")
    check_bool(err, "nesterov", nesterov)
    check_same_device(err, [("grad", grad), ("momentum_buffer", momentum_buffer)])
    return momentum_buffer.new_empty(momentum_buffer.shape, dtype=F32)


# its own binding: an empty gradient (no tokens argument to skip on) launches nothing
@engram_sinkhorn_momentum_update.launch
def _(kernels, out, grad, momentum_buffer, beta1, nesterov):
    if out.numel():
        kernels.engram_sinkhorn_momentum_update(grad=grad, momentum_buffer=momentum_buffer, beta1=beta1,
                                                nesterov=nesterov, out=out)


@declare("engram_sinkhorn_step", mutates_args=("row_scale",),
         vector_args={"matrix": 16, "row_scale": 4, "col_scale": 16}, tokens="matrix",
         outputs=("row_norm", "col_sumsq_partial"))
def engram_sinkhorn_step(matrix: Tensor, row_scale: Tensor, col_scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """One row-L2 normalization step of ``X = diag(row_scale) @ matrix @ diag(col_scale)``.

    Per row ``i`` (fp32): ``x_ij = (row_scale_i * A_ij) * col_scale_j``, ``row_norm_i = sqrt(sum_j x_ij^2)``,
    then in place ``row_scale_i <- row_scale_i / (row_norm_i + eps)`` (IEEE division). With the new scale the
    normalized iterate ``y_ij = (row_scale_i * A_ij) * col_scale_j`` contributes ``y_ij^2`` to the column sums
    of squares of the worker that owns row ``i``: worker ``p`` owns the contiguous rows
    ``[p * ceil(R / P), (p + 1) * ceil(R / P))`` and writes its sums to row ``p`` of the partials (zeros for
    a worker without rows). Reduce them with :func:`engram_sinkhorn_step_reduce`.

    Args:
        matrix: ``(R, D)`` fp32, contiguous, ``D`` in ``limits.ENGRAM_SINKHORN_COLS`` (multiples of 64 up to
            1024); ``R = 0`` writes nothing and returns zero partials.
        row_scale: ``(R,)`` fp32, updated in place.
        col_scale: ``(D,)`` fp32.
        eps: ``>= 0``, added to each row norm.

    Returns:
        ``(row_norm (R,) fp32, col_sumsq_partial (P, D) fp32)``, new; ``P`` is fixed per device type
        (:func:`sinkhorn_partials`: 528 on CUDA, 64 on the Ascend 950).
    """
    err, rows, cols = _check_scaled_matrix("engram_sinkhorn_step", matrix, row_scale, col_scale)
    check_float(err, "eps", eps, minimum=0.0)
    partials = sinkhorn_partials(matrix.device.type)
    return row_scale.new_empty((rows,)), matrix.new_empty((partials, cols))


@declare("engram_sinkhorn_step_reduce", mutates_args=("col_sumsq", "col_scale"),
         vector_args={"col_sumsq_partial": 16, "col_sumsq": 16, "col_scale": 16}, tokens="col_sumsq_partial",
         zero_when_empty=("col_sumsq",))
def engram_sinkhorn_step_reduce(col_sumsq_partial: Tensor, col_sumsq: Tensor, col_scale: Tensor, rows: int,
                                eps: float) -> None:
    """Fixed-order reduction of the column partials and the column-scale update that follows it.

    ``s_j = sum_p col_sumsq_partial[p, j]``, p ascending, one fp32 sum per column starting from row 0
    (deterministic, no atomics), written to ``col_sumsq``; then in place, in fp32 with every operation
    rounded on its own (IEEE square root and division, no fused multiply-add; ``eps`` rounded to fp32 from the
    double value): ``balance = f32(D) / f32(rows)``, ``col_scale_j <- col_scale_j / (sqrt(s_j * balance) + eps)``
    where ``s_j > 0``, else unchanged (a column of zeros keeps its scale). ``s_j * D / R`` is 1 where a column
    holds its share of ``R`` unit rows: the columns go to the norm ``sqrt(R / D)``.

    Args:
        col_sumsq_partial: ``(P, D)`` fp32, contiguous (``P = 0`` writes zeros and keeps ``col_scale``), ``D``
            in ``limits.ENGRAM_SINKHORN_COLS``.
        col_sumsq: ``(D,)`` fp32, written (not accumulated).
        col_scale: ``(D,)`` fp32, updated in place.
        rows: ``>= 1``, the row count ``R`` of the (whole, unsharded) matrix; an int (dynamic under
            ``torch.compile``).
        eps: ``>= 0``, added to each column norm.
    """
    err = OpError("engram_sinkhorn_step_reduce")
    partial = check_tensor(err, "col_sumsq_partial", col_sumsq_partial, dtype=F32, ndim=2)
    limits.ENGRAM_SINKHORN_COLS.check(err, "col_sumsq_partial", partial.shape[1])
    check_tensor(err, "col_sumsq", col_sumsq, dtype=F32, shape=(partial.shape[1],))
    check_tensor(err, "col_scale", col_scale, dtype=F32, shape=(partial.shape[1],))
    check_int(err, "rows", rows)
    if isinstance(rows, int) and not 1 <= rows <= limits.ENGRAM_SINKHORN_ELEMENTS.high:
        raise err.value("rows", f"expected a row count in [1, {limits.ENGRAM_SINKHORN_ELEMENTS.high}], got {rows}")
    check_float(err, "eps", eps, minimum=0.0)
    check_same_device(err, [("col_sumsq_partial", col_sumsq_partial), ("col_sumsq", col_sumsq),
                            ("col_scale", col_scale)])


@declare("engram_sinkhorn_finalize", vector_args={"matrix": 16, "col_scale": 16}, tokens="matrix", outputs=("out",))
def _engram_sinkhorn_finalize(matrix: Tensor, row_scale: Tensor, col_scale: Tensor, eps: float,
                              alpha: float) -> Tensor:
    """The final matrix into a new ``(R, D)`` fp32 tensor (see :func:`engram_sinkhorn_finalize`)."""
    err, _rows, _cols = _check_scaled_matrix("engram_sinkhorn_finalize", matrix, row_scale, col_scale)
    check_float(err, "eps", eps, minimum=0.0)
    check_float(err, "alpha", alpha, minimum=float("-inf"))
    return matrix.new_empty(matrix.shape)


@declare("engram_sinkhorn_finalize_out", mutates_args=("out",), vector_args={"matrix": 16, "col_scale": 16, "out": 16},
         tokens="matrix", kernel="engram_sinkhorn_finalize")
def _engram_sinkhorn_finalize_out(matrix: Tensor, row_scale: Tensor, col_scale: Tensor, eps: float, alpha: float,
                                  out: Tensor) -> None:
    """The final matrix written into ``out (R, D)`` fp32, which shares no memory with the inputs."""
    err, rows, cols = _check_scaled_matrix("engram_sinkhorn_finalize_out", matrix, row_scale, col_scale)
    check_float(err, "eps", eps, minimum=0.0)
    check_float(err, "alpha", alpha, minimum=float("-inf"))
    check_tensor(err, "out", out, dtype=F32, shape=(rows, cols))
    check_same_device(err, [("matrix", matrix), ("out", out)])


@declare("engram_sinkhorn_finalize_apply", mutates_args=("param",),
         vector_args={"matrix": 16, "col_scale": 16, "param": 16}, tokens="matrix", kernel="engram_sinkhorn_finalize")
def engram_sinkhorn_finalize_apply(matrix: Tensor, row_scale: Tensor, col_scale: Tensor, eps: float, alpha: float,
                                   param: Tensor, lr: float, decay: float) -> None:
    """The final matrix applied to the table: ``param <- param * decay - lr * U`` in place.

    ``U`` is :func:`engram_sinkhorn_finalize`'s result (bit for bit, never stored); per element, in fp32 with
    every operation rounded on its own (no fused multiply-add; ``lr`` and ``decay`` rounded to fp32 from the
    double values): ``param_ij <- (f32(param_ij) * decay) - (U_ij * lr)``, stored with one
    round-to-nearest-even cast where ``param`` is bf16. ``decay = 1 - lr * weight_decay`` gives decoupled
    weight decay (``decay = 1``: none, the product is exact).

    Args:
        matrix, row_scale, col_scale, eps, alpha: as for :func:`engram_sinkhorn_finalize`.
        param: ``(R, D)`` contiguous, bf16 or fp32, sharing no memory with the inputs; updated in place.
        lr: the learning rate (any finite number).
        decay: the weight-decay factor (any finite number).
    """
    err, rows, cols = _check_scaled_matrix("engram_sinkhorn_finalize_apply", matrix, row_scale, col_scale)
    check_float(err, "eps", eps, minimum=0.0)
    check_float(err, "alpha", alpha, minimum=float("-inf"))
    if not isinstance(param, Tensor):
        raise err.type("param", f"expected a torch.Tensor, got {describe(param)}")
    if param.dtype not in (BF16, F32):
        raise err.type("param", f"expected dtype torch.bfloat16 or torch.float32, got {param.dtype}")
    check_tensor(err, "param", param, dtype=param.dtype, shape=(rows, cols))
    check_float(err, "lr", lr, minimum=float("-inf"))
    check_float(err, "decay", decay, minimum=float("-inf"))
    check_same_device(err, [("matrix", matrix), ("param", param)])


def engram_sinkhorn_finalize(matrix: Tensor, row_scale: Tensor, col_scale: Tensor, eps: float, alpha: float,
                             out: Optional[Tensor] = None) -> Tensor:
    """The final row-normalized, alpha-scaled matrix.

    Per row (fp32): ``x_ij = (row_scale_i * A_ij) * col_scale_j``, ``n_i = sqrt(sum_j x_ij^2)``,
    ``out_ij = x_ij * (alpha / (n_i + eps))`` (IEEE division once per row). A row of zeros gives zeros.

    Args:
        matrix: ``(R, D)`` fp32, contiguous, ``D`` in ``limits.ENGRAM_SINKHORN_COLS``.
        row_scale: ``(R,)`` fp32 (read only).
        col_scale: ``(D,)`` fp32.
        eps: ``>= 0``.
        alpha: the norm of every output row (e.g. ``sqrt(D)``: entries of unit RMS).
        out: optional contiguous ``(R, D)`` fp32 buffer sharing no memory with the inputs.

    Returns:
        ``(R, D)`` fp32: ``out`` when given, else a new tensor.
    """
    if out is None:
        return _engram_sinkhorn_finalize(matrix, row_scale, col_scale, eps, alpha)
    _engram_sinkhorn_finalize_out(matrix, row_scale, col_scale, eps, alpha, out)
    return out


# DTensor sharding (docs/distributed.md). The table's rows are independent (FSDP2 shards dim 0): row-wise
# tensors shard with the rows, col_scale stays replicated, and the column partials are sums over each rank's
# rows, so they are Partial. The reduction's epilogue (the column-scale update) needs the whole sum: it has
# only the all-Replicate strategy (DTensor all-reduces the Partial partials first). The momentum update is
# element-wise: any dim, alike.
engram_sinkhorn_momentum_update.sharding({"grad": "S0", "momentum_buffer": "S0", "returns": "S0"},
                                         {"grad": "S1", "momentum_buffer": "S1", "returns": "S1"})
engram_sinkhorn_step.sharding({"matrix": "S0", "row_scale": "S0", "returns": ("S0", "P")})
engram_sinkhorn_step_reduce.sharding()  # all-Replicate only
_engram_sinkhorn_finalize.sharding({"matrix": "S0", "row_scale": "S0", "returns": "S0"})
_engram_sinkhorn_finalize_out.sharding({"matrix": "S0", "row_scale": "S0", "out": "S0"})
engram_sinkhorn_finalize_apply.sharding({"matrix": "S0", "row_scale": "S0", "param": "S0"})
