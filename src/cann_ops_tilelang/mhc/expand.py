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


@declare("expand_to_mhc_backward", mutates_args=("grad_x",), vector_args={"grad_out": 16, "grad_x": 16},
         tokens="grad_out")
def expand_to_mhc_backward(grad_out: Tensor, grad_x: Tensor) -> None:
    """``grad_x = bf16(sum_i f32(grad_out[:, i]))``, streams ``i`` ascending.

    Args:
        grad_out: ``(T, m, H)`` bf16.
        grad_x: ``(T, H)`` bf16, overwritten.
    """
    err = OpError("expand_to_mhc_backward")
    tokens, m, hidden = check_tensor(err, "grad_out", grad_out, dtype=BF16, ndim=3).shape
    check_hc(err, "grad_out", m)
    check_hidden(err, "grad_out", hidden)
    check_tensor(err, "grad_x", grad_x, dtype=BF16, shape=(tokens, hidden))
    same_device(err, grad_out=grad_out, grad_x=grad_x)


# DTensor sharding (docs/distributed.md): token-wise, so sequence parallel shards the token dim of both tensors.
expand_to_mhc_forward.sharding({"x": "S0", "out": "S0"})
expand_to_mhc_backward.sharding({"grad_out": "S0", "grad_x": "S0"})
