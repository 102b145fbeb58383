"""Sinkhorn-Knopp normalization of the residual-combination mixes, and its backward
(docs/ops/mhc.md#sinkhorn)."""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_float, check_int, check_tensor
from .._library import declare
from ._common import F32, HC_MULT, check_square, same_device

__all__ = ["mhc_sinkhorn_backward", "mhc_sinkhorn_forward"]


def _check_repeat(err: OpError, repeat, device) -> None:
    # the range depends on the backend (limits.MHC_SINKHORN_REPEAT): the Ascend backward's UB holds fewer steps
    limits.MHC_SINKHORN_REPEAT.of(device.type).check(err, "repeat", check_int(err, "repeat", repeat))


@declare("mhc_sinkhorn_forward", mutates_args=("comb_out",), tokens="comb")
def mhc_sinkhorn_forward(comb: Tensor, comb_out: Tensor, repeat: int, eps: float) -> None:
    """Sinkhorn-Knopp on ``(T, m, m)`` logits: row softmax, ``+eps``, column normalization, then
    ``repeat - 1`` (row, column) normalizations with ``+eps`` in the denominators.

    Args:
        comb: ``(T, m, m)`` fp32 logits.
        comb_out: ``(T, m, m)`` fp32, written (doubly stochastic up to ``eps``).
        repeat: iterations, in [1, 64] on CUDA and [1, 22] on Ascend (``limits.MHC_SINKHORN_REPEAT``).
        eps: >= 0.
    """
    err = OpError("mhc_sinkhorn_forward")
    tokens = check_square(err, "comb", comb)
    check_tensor(err, "comb_out", comb_out, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    _check_repeat(err, repeat, comb.device)
    check_float(err, "eps", eps, minimum=0.0)
    same_device(err, comb=comb, comb_out=comb_out)


@declare("mhc_sinkhorn_backward", mutates_args=("grad_comb",), tokens="comb")
def mhc_sinkhorn_backward(grad_comb_out: Tensor, comb: Tensor, grad_comb: Tensor, repeat: int, eps: float) -> None:
    """Gradient of :func:`mhc_sinkhorn_forward` with respect to the logits ``comb`` (recomputed from them).

    Args:
        grad_comb_out: ``(T, m, m)`` fp32.
        comb: ``(T, m, m)`` fp32, the forward's logits.
        grad_comb: ``(T, m, m)`` fp32, written.
        repeat, eps: as in the forward.
    """
    err = OpError("mhc_sinkhorn_backward")
    tokens = check_square(err, "comb", comb)
    check_tensor(err, "grad_comb_out", grad_comb_out, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    check_tensor(err, "grad_comb", grad_comb, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    _check_repeat(err, repeat, comb.device)
    check_float(err, "eps", eps, minimum=0.0)
    same_device(err, grad_comb_out=grad_comb_out, comb=comb, grad_comb=grad_comb)


# DTensor sharding (docs/distributed.md): per token.
mhc_sinkhorn_forward.sharding({"comb": "S0", "comb_out": "S0"})
mhc_sinkhorn_backward.sharding({"grad_comb_out": "S0", "comb": "S0", "grad_comb": "S0"})
