"""Reduction of the pre-norm GEMM's split partials with the RMSNorm of the mixes, and its backward
(docs/ops/mhc.md#reduce_partials_and_rmsnorm)."""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_float, check_int, check_tensor
from .._library import declare
from ._common import F32, MIX, check_groups, same_device

__all__ = ["mhc_reduce_partials_and_rmsnorm_backward", "mhc_reduce_partials_and_rmsnorm_forward"]

_GROUP_SIZE = limits.IntRange("rms_group_size", 1)


@declare("mhc_reduce_partials_and_rmsnorm_forward", mutates_args=("out_mul", "sqrsum", "out"),
         vector_args={"out_mul_splitted": 16, "out_mul": 16, "out": 16}, tokens="out")
def mhc_reduce_partials_and_rmsnorm_forward(out_mul_splitted: Tensor, sqrsum_splitted: Tensor, out_mul: Tensor,
                                            sqrsum: Tensor, out: Tensor, rms_group_size: int, rms_eps: float,
                                            n_splits: int) -> None:
    """Sums the ``S`` partials in split order into ``out_mul`` and ``sqrsum``, then
    ``out = sum_g out_mul[:, g] * rsqrt(sqrsum[:, g] / rms_group_size + rms_eps)``.

    Args:
        out_mul_splitted: ``(S, T, G, M3)`` fp32 (``G = 1``), from the GEMM forward.
        sqrsum_splitted: ``(S, T, G)`` fp32.
        out_mul: ``(T, G, M3)`` fp32, written.
        sqrsum: ``(T, G)`` fp32, written.
        out: ``(T, M3)`` fp32, written.
        rms_group_size: elements per RMS group (``K`` for ``G = 1``), >= 1.
        rms_eps: RMSNorm epsilon (>= 0, finite in fp32).
        n_splits: ``S``, >= 1.
    """
    err = OpError("mhc_reduce_partials_and_rmsnorm_forward")
    splits, tokens, groups, mixes = check_tensor(err, "out_mul_splitted", out_mul_splitted, dtype=F32, ndim=4).shape
    check_groups(err, "out_mul_splitted", groups)
    if mixes != MIX:
        raise err.value("out_mul_splitted", f"expected {MIX} mixes in the last dim, got {mixes}")
    limits.IntRange("n_splits", 1).check(err, "n_splits", check_int(err, "n_splits", n_splits))
    if splits != n_splits:
        raise err.value("out_mul_splitted", f"expected {n_splits} splits (n_splits) in dim 0, got {splits}")
    check_tensor(err, "sqrsum_splitted", sqrsum_splitted, dtype=F32, shape=(splits, tokens, groups))
    check_tensor(err, "out_mul", out_mul, dtype=F32, shape=(tokens, groups, mixes))
    check_tensor(err, "sqrsum", sqrsum, dtype=F32, shape=(tokens, groups))
    check_tensor(err, "out", out, dtype=F32, shape=(tokens, mixes))
    _GROUP_SIZE.check(err, "rms_group_size", check_int(err, "rms_group_size", rms_group_size))
    check_float(err, "rms_eps", rms_eps, minimum=0.0)
    same_device(err, out_mul_splitted=out_mul_splitted, sqrsum_splitted=sqrsum_splitted, out_mul=out_mul,
                sqrsum=sqrsum, out=out)


@declare("mhc_reduce_partials_and_rmsnorm_backward", mutates_args=("grad_out_mul", "grad_sqrsum"),
         vector_args={"grad_out": 16, "out_mul": 16, "grad_out_mul": 16}, tokens="grad_out")
def mhc_reduce_partials_and_rmsnorm_backward(grad_out: Tensor, out_mul: Tensor, sqrsum: Tensor,
                                             grad_out_mul: Tensor, grad_sqrsum: Tensor, rms_group_size: int,
                                             rms_eps: float) -> None:
    """``grad_out_mul = grad_out * r`` and ``grad_sqrsum = -rho * r / (2 * (sqrsum + eps * Rg))`` with
    ``r = rsqrt(sqrsum / Rg + eps)``, ``rho = sum_j grad_out * out_mul``, ``Rg = rms_group_size``.

    Args:
        grad_out: ``(T, M3)`` fp32.
        out_mul: ``(T, G, M3)`` fp32 and sqrsum ``(T, G)`` fp32, saved by the forward.
        grad_out_mul: ``(T, G, M3)`` fp32, written.
        grad_sqrsum: ``(T, G)`` fp32, written.
        rms_group_size, rms_eps: as in the forward.
    """
    err = OpError("mhc_reduce_partials_and_rmsnorm_backward")
    tokens, groups, mixes = check_tensor(err, "out_mul", out_mul, dtype=F32, ndim=3).shape
    check_groups(err, "out_mul", groups)
    if mixes != MIX:
        raise err.value("out_mul", f"expected {MIX} mixes in the last dim, got {mixes}")
    check_tensor(err, "grad_out", grad_out, dtype=F32, shape=(tokens, mixes))
    check_tensor(err, "sqrsum", sqrsum, dtype=F32, shape=(tokens, groups))
    check_tensor(err, "grad_out_mul", grad_out_mul, dtype=F32, shape=(tokens, groups, mixes))
    check_tensor(err, "grad_sqrsum", grad_sqrsum, dtype=F32, shape=(tokens, groups))
    _GROUP_SIZE.check(err, "rms_group_size", check_int(err, "rms_group_size", rms_group_size))
    check_float(err, "rms_eps", rms_eps, minimum=0.0)
    same_device(err, grad_out=grad_out, out_mul=out_mul, sqrsum=sqrsum, grad_out_mul=grad_out_mul,
                grad_sqrsum=grad_sqrsum)


# DTensor sharding (docs/distributed.md): token-wise (dim 1 of the split partials).
mhc_reduce_partials_and_rmsnorm_forward.sharding(
    {"out_mul_splitted": "S1", "sqrsum_splitted": "S1", "out_mul": "S0", "sqrsum": "S0", "out": "S0"})
mhc_reduce_partials_and_rmsnorm_backward.sharding(
    {"grad_out": "S0", "out_mul": "S0", "sqrsum": "S0", "grad_out_mul": "S0", "grad_sqrsum": "S0"})
