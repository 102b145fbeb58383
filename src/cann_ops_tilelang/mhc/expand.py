"""Expansion of a sublayer input to the ``m`` residual streams, and its backward (docs/ops/mhc.md#expand)."""

from torch import Tensor

from .._checks import OpError, check_tensor
from .._library import declare
from ._common import BF16, HC_MULT, check_hc, check_hidden, same_device

__all__ = ["expand_to_mhc_backward", "expand_to_mhc_forward"]


@declare("expand_to_mhc_forward", mutates_args=("out",), vector_args={"x": 16, "out": 16}, tokens="x")
def expand_to_mhc_forward(x: Tensor, out: Tensor) -> None:
    """``out[t, i, :] = x[t, :]`` for every stream ``i``.

    Args:
        x: ``(T, H)`` bf16.
        out: ``(T, m, H)`` bf16, written (must not share memory with ``x``).
    """
    err = OpError("expand_to_mhc_forward")
    tokens, hidden = check_tensor(err, "x", x, dtype=BF16, ndim=2).shape
    check_hidden(err, "x", hidden)
    check_hc(err, "out", check_tensor(err, "out", out, dtype=BF16, ndim=3).shape[1])
    check_tensor(err, "out", out, dtype=BF16, shape=(tokens, HC_MULT, hidden))
    same_device(err, x=x, out=out)


@declare("expand_to_mhc_backward", mutates_args=("x_grad",), vector_args={"out_grad": 16, "x_grad": 16},
         tokens="out_grad")
def expand_to_mhc_backward(out_grad: Tensor, x_grad: Tensor) -> None:
    """``x_grad = bf16(sum_i f32(out_grad[:, i]))``, streams ``i`` ascending.

    Args:
        out_grad: ``(T, m, H)`` bf16.
        x_grad: ``(T, H)`` bf16, overwritten.
    """
    err = OpError("expand_to_mhc_backward")
    tokens, m, hidden = check_tensor(err, "out_grad", out_grad, dtype=BF16, ndim=3).shape
    check_hc(err, "out_grad", m)
    check_hidden(err, "out_grad", hidden)
    check_tensor(err, "x_grad", x_grad, dtype=BF16, shape=(tokens, hidden))
    same_device(err, out_grad=out_grad, x_grad=x_grad)


# DTensor sharding (docs/distributed.md): token-wise, so sequence parallel shards the token dim of both tensors.
expand_to_mhc_forward.sharding({"x": "S0", "out": "S0"})
expand_to_mhc_backward.sharding({"out_grad": "S0", "x_grad": "S0"})
