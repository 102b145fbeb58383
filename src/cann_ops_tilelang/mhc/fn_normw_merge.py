"""Merge of the pre-norm GEMM weight ``fn`` with the RMSNorm weight, and its backward
(docs/ops/mhc.md#fn_normw_merge)."""

from torch import Tensor

from .._checks import OpError, check_tensor
from .._library import declare
from ._common import F32, check_fn, same_device

__all__ = ["mhc_fn_normw_merge_backward", "mhc_fn_normw_merge_forward"]


@declare("mhc_fn_normw_merge_forward", mutates_args=("out_fn",),
         vector_args={"fn": 16, "normw": 16, "out_fn": 16})
def mhc_fn_normw_merge_forward(fn: Tensor, normw: Tensor, out_fn: Tensor) -> None:
    """``out_fn = fn * normw`` (each row times the weight).

    Args:
        fn: ``(M3, K)`` fp32.
        normw: ``(K,)`` fp32.
        out_fn: ``(M3, K)`` fp32, written.
    """
    err = OpError("mhc_fn_normw_merge_forward")
    k = check_fn(err, "fn", fn)
    check_tensor(err, "normw", normw, dtype=F32, shape=(k,))
    check_tensor(err, "out_fn", out_fn, dtype=F32, shape=tuple(fn.shape))
    same_device(err, fn=fn, normw=normw, out_fn=out_fn)


@declare("mhc_fn_normw_merge_backward", mutates_args=("fn_grad", "normw_grad"),
         vector_args={"fn": 16, "normw": 16, "out_fn_grad": 16, "fn_grad": 16})
def mhc_fn_normw_merge_backward(fn: Tensor, normw: Tensor, out_fn_grad: Tensor, fn_grad: Tensor,
                                normw_grad: Tensor) -> None:
    """Accumulates ``fn_grad += out_fn_grad * normw`` and ``normw_grad += sum_r out_fn_grad[r] * fn[r]`` (rows
    in order into a local sum, added once).

    Args:
        fn: ``(M3, K)`` fp32; normw: ``(K,)`` fp32; out_fn_grad: ``(M3, K)`` fp32.
        fn_grad: ``(M3, K)`` fp32, accumulated.
        normw_grad: ``(K,)`` fp32, accumulated.
    """
    err = OpError("mhc_fn_normw_merge_backward")
    k = check_fn(err, "fn", fn)
    check_tensor(err, "normw", normw, dtype=F32, shape=(k,))
    check_tensor(err, "out_fn_grad", out_fn_grad, dtype=F32, shape=tuple(fn.shape))
    check_tensor(err, "fn_grad", fn_grad, dtype=F32, shape=tuple(fn.shape))
    check_tensor(err, "normw_grad", normw_grad, dtype=F32, shape=(k,))
    same_device(err, fn=fn, normw=normw, out_fn_grad=out_fn_grad, fn_grad=fn_grad, normw_grad=normw_grad)


# DTensor sharding (docs/distributed.md): no token dim, and the ops accept only the full (M3, K) shapes, so the
# weights stay replicated; in the backward both gradients are linear in out_fn_grad, so a Partial gradient
# (a sum over tokens not yet reduced) accumulates into Partial buffers without communication.
mhc_fn_normw_merge_forward.sharding()
mhc_fn_normw_merge_backward.sharding({"out_fn_grad": "P", "fn_grad": "P", "normw_grad": "P"})
