"""The pre mix: the weighted sum of the ``m`` residual streams that forms a sublayer's input, and its backward
(docs/ops/mhc.md#pre_apply_mix)."""

from torch import Tensor

from .._checks import OpError, check_tensor
from .._library import declare
from ._common import BF16, F32, HC_MULT, check_residual, same_device

__all__ = ["mhc_pre_apply_mix_backward", "mhc_pre_apply_mix_forward"]


@declare("mhc_pre_apply_mix_forward", mutates_args=("out",), vector_args={"x": 16, "out": 16}, tokens="x")
def mhc_pre_apply_mix_forward(x: Tensor, mix: Tensor, out: Tensor) -> None:
    """``out = bf16(sum_i mix[:, i] * f32(x[:, i]))``, streams ``i`` ascending, accumulated in fp32.

    Args:
        x: ``(T, m, H)`` bf16, the residual streams.
        mix: ``(T, m)`` fp32, the pre mix.
        out: ``(T, H)`` bf16, written.
    """
    err = OpError("mhc_pre_apply_mix_forward")
    tokens, hidden = check_residual(err, "x", x)
    check_tensor(err, "mix", mix, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "out", out, dtype=BF16, shape=(tokens, hidden))
    same_device(err, x=x, mix=mix, out=out)


@declare("mhc_pre_apply_mix_backward", mutates_args=("grad_x",),
         vector_args={"grad_out": 16, "x": 16, "grad_x": 16}, tokens="x", outputs=("grad_mix",))
def mhc_pre_apply_mix_backward(grad_out: Tensor, x: Tensor, mix: Tensor, grad_x: Tensor) -> Tensor:
    """Accumulates ``grad_x = bf16(f32(grad_x) + mix * f32(grad_out))`` in place and returns
    ``grad_mix = sum_d f32(grad_out) * f32(x)``.

    Args:
        grad_out: ``(T, H)`` bf16.
        x: ``(T, m, H)`` bf16; mix: ``(T, m)`` fp32 (the forward's inputs).
        grad_x: ``(T, m, H)`` bf16, accumulated.

    Returns:
        ``grad_mix (T, m)`` fp32, a new tensor.
    """
    err = OpError("mhc_pre_apply_mix_backward")
    tokens, hidden = check_residual(err, "x", x)
    check_tensor(err, "grad_out", grad_out, dtype=BF16, shape=(tokens, hidden))
    check_tensor(err, "mix", mix, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "grad_x", grad_x, dtype=BF16, shape=(tokens, HC_MULT, hidden))
    same_device(err, grad_out=grad_out, x=x, mix=mix, grad_x=grad_x)
    return mix.new_empty(mix.shape)


# DTensor sharding (docs/distributed.md): token-wise (grad_mix is per token).
mhc_pre_apply_mix_forward.sharding({"x": "S0", "mix": "S0", "out": "S0"})
mhc_pre_apply_mix_backward.sharding({"grad_out": "S0", "x": "S0", "mix": "S0", "grad_x": "S0", "returns": "S0"})
