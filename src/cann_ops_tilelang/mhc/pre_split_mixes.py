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


@declare("mhc_pre_split_mixes_backward", mutates_args=("grad_input_mixes", "grad_mhc_scale", "grad_mhc_base"),
         vector_args={"grad_pre": 16, "grad_post": 16, "grad_comb": 16, "input_mixes": 16, "post": 16,
                      "mhc_base": 16, "grad_input_mixes": 16},
         tokens="input_mixes", zero_when_empty=("grad_mhc_scale", "grad_mhc_base"))
def mhc_pre_split_mixes_backward(grad_pre: Tensor, grad_post: Tensor, grad_comb: Tensor, input_mixes: Tensor,
                                 post: Tensor, mhc_scale: Tensor, mhc_base: Tensor, grad_input_mixes: Tensor,
                                 grad_mhc_scale: Tensor, grad_mhc_base: Tensor, post_mult_value: float) -> None:
    """Backward of the split: writes ``grad_input_mixes`` and overwrites ``grad_mhc_scale`` and
    ``grad_mhc_base`` with sums over the tokens in a fixed order (deterministic; zeros for ``T = 0``).

    Args:
        grad_pre, grad_post: ``(T, m)`` fp32; grad_comb: ``(T, m*m)`` fp32.
        input_mixes: ``(T, M3)`` fp32; post: ``(T, m)`` fp32 (the forward's output); mhc_scale ``(3,)`` and
            mhc_base ``(M3,)`` fp32.
        grad_input_mixes: ``(T, M3)`` fp32, written.
        grad_mhc_scale: ``(3,)`` fp32, overwritten.
        grad_mhc_base: ``(M3,)`` fp32, overwritten.
        post_mult_value: as in the forward.
    """
    err = OpError("mhc_pre_split_mixes_backward")
    tokens = check_mixes(err, "input_mixes", input_mixes)
    check_tensor(err, "grad_pre", grad_pre, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "grad_post", grad_post, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "grad_comb", grad_comb, dtype=F32, shape=(tokens, COMB))
    check_tensor(err, "post", post, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(MIX,))
    check_tensor(err, "grad_input_mixes", grad_input_mixes, dtype=F32, shape=(tokens, MIX))
    check_tensor(err, "grad_mhc_scale", grad_mhc_scale, dtype=F32, shape=(3,))
    check_tensor(err, "grad_mhc_base", grad_mhc_base, dtype=F32, shape=(MIX,))
    check_float(err, "post_mult_value", post_mult_value, minimum=0.0, inclusive=False)
    same_device(err, grad_pre=grad_pre, grad_post=grad_post, grad_comb=grad_comb, input_mixes=input_mixes, post=post,
                mhc_scale=mhc_scale, mhc_base=mhc_base, grad_input_mixes=grad_input_mixes,
                grad_mhc_scale=grad_mhc_scale, grad_mhc_base=grad_mhc_base)


# DTensor sharding (docs/distributed.md): token-wise; scale and base replicated. The two parameter
# gradients are sums over tokens that the op overwrites with its own tokens' sum: Partial buffers.
mhc_pre_split_mixes_forward.sharding({"input_mixes": "S0", "pre": "S0", "post": "S0", "comb": "S0"})
mhc_pre_split_mixes_backward.sharding(
    {"grad_pre": "S0", "grad_post": "S0", "grad_comb": "S0", "input_mixes": "S0", "post": "S0",
     "grad_input_mixes": "S0", "grad_mhc_scale": "P", "grad_mhc_base": "P"})
