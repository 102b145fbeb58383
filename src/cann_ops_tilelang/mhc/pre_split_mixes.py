"""The split of the mixes into the pre, post and residual-combination mixes, and its backward
(docs/ops/mhc.md#pre_split_mixes)."""

from torch import Tensor

from .._checks import OpError, check_float, check_tensor
from .._library import declare
from ._common import COMB, F32, HC_MULT, MIX, check_mixes, same_device

__all__ = ["mhc_pre_split_mixes_backward", "mhc_pre_split_mixes_forward"]


@declare("mhc_pre_split_mixes_forward", mutates_args=("pre", "post", "comb"),
         vector_args={"input_mixes": 16, "mhc_base": 16, "pre": 16, "post": 16, "comb": 16}, tokens="input_mixes")
def mhc_pre_split_mixes_forward(input_mixes: Tensor, mhc_scale: Tensor, mhc_base: Tensor, pre: Tensor,
                                post: Tensor, comb: Tensor, post_mult_value: float, pre_eps: float) -> None:
    """``z = input_mixes * scale[segment] + base``; ``pre = sigmoid(z[:, :m]) + pre_eps``,
    ``post = sigmoid(z[:, m:2m]) * post_mult_value``, ``comb = z[:, 2m:]``.

    Args:
        input_mixes: ``(T, M3)`` fp32 (the normalized GEMM output).
        mhc_scale: ``(3,)`` fp32, one scale per segment (pre, post, comb).
        mhc_base: ``(M3,)`` fp32.
        pre: ``(T, m)`` fp32, written.
        post: ``(T, m)`` fp32, written.
        comb: ``(T, m*m)`` fp32, written (the Sinkhorn logits).
        post_mult_value: > 0 (2.0 in the model).
        pre_eps: >= 0.
    """
    err = OpError("mhc_pre_split_mixes_forward")
    tokens = check_mixes(err, "input_mixes", input_mixes)
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(MIX,))
    check_tensor(err, "pre", pre, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "post", post, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "comb", comb, dtype=F32, shape=(tokens, COMB))
    check_float(err, "post_mult_value", post_mult_value, minimum=0.0, inclusive=False)
    check_float(err, "pre_eps", pre_eps, minimum=0.0)
    same_device(err, input_mixes=input_mixes, mhc_scale=mhc_scale, mhc_base=mhc_base, pre=pre, post=post, comb=comb)


@declare("mhc_pre_split_mixes_backward", mutates_args=("input_mixes_grad", "mhc_scale_grad", "mhc_base_grad"),
         vector_args={"pre_grad": 16, "post_grad": 16, "comb_grad": 16, "input_mixes": 16, "post": 16,
                      "mhc_base": 16, "input_mixes_grad": 16},
         tokens="input_mixes", zero_when_empty=("mhc_scale_grad", "mhc_base_grad"))
def mhc_pre_split_mixes_backward(pre_grad: Tensor, post_grad: Tensor, comb_grad: Tensor, input_mixes: Tensor,
                                 post: Tensor, mhc_scale: Tensor, mhc_base: Tensor, input_mixes_grad: Tensor,
                                 mhc_scale_grad: Tensor, mhc_base_grad: Tensor, post_mult_value: float) -> None:
    """Backward of the split: writes ``input_mixes_grad`` and overwrites ``mhc_scale_grad`` and
    ``mhc_base_grad`` with sums over the tokens in a fixed order (deterministic; zeros for ``T = 0``).

    Args:
        pre_grad, post_grad: ``(T, m)`` fp32; comb_grad: ``(T, m*m)`` fp32.
        input_mixes: ``(T, M3)`` fp32; post: ``(T, m)`` fp32 (the forward's output); mhc_scale ``(3,)`` and
            mhc_base ``(M3,)`` fp32.
        input_mixes_grad: ``(T, M3)`` fp32, written.
        mhc_scale_grad: ``(3,)`` fp32, overwritten.
        mhc_base_grad: ``(M3,)`` fp32, overwritten.
        post_mult_value: as in the forward.
    """
    err = OpError("mhc_pre_split_mixes_backward")
    tokens = check_mixes(err, "input_mixes", input_mixes)
    check_tensor(err, "pre_grad", pre_grad, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "post_grad", post_grad, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "comb_grad", comb_grad, dtype=F32, shape=(tokens, COMB))
    check_tensor(err, "post", post, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(MIX,))
    check_tensor(err, "input_mixes_grad", input_mixes_grad, dtype=F32, shape=(tokens, MIX))
    check_tensor(err, "mhc_scale_grad", mhc_scale_grad, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base_grad", mhc_base_grad, dtype=F32, shape=(MIX,))
    check_float(err, "post_mult_value", post_mult_value, minimum=0.0, inclusive=False)
    same_device(err, pre_grad=pre_grad, post_grad=post_grad, comb_grad=comb_grad, input_mixes=input_mixes, post=post,
                mhc_scale=mhc_scale, mhc_base=mhc_base, input_mixes_grad=input_mixes_grad,
                mhc_scale_grad=mhc_scale_grad, mhc_base_grad=mhc_base_grad)


# DTensor sharding (docs/distributed.md): token-wise; scale and base replicated. The two parameter
# gradients are sums over tokens that the op overwrites with its own tokens' sum: Partial buffers.
mhc_pre_split_mixes_forward.sharding({"input_mixes": "S0", "pre": "S0", "post": "S0", "comb": "S0"})
mhc_pre_split_mixes_backward.sharding(
    {"pre_grad": "S0", "post_grad": "S0", "comb_grad": "S0", "input_mixes": "S0", "post": "S0",
     "input_mixes_grad": "S0", "mhc_scale_grad": "P", "mhc_base_grad": "P"})
