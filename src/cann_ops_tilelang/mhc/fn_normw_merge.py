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


@declare("mhc_fn_normw_merge_backward", mutates_args=("grad_fn", "grad_normw"),
         vector_args={"fn": 16, "normw": 16, "grad_out_fn": 16, "grad_fn": 16})
def mhc_fn_normw_merge_backward(fn: Tensor, normw: Tensor, grad_out_fn: Tensor, grad_fn: Tensor,
                                grad_normw: Tensor) -> None:
    """Accumulates ``grad_fn += grad_out_fn * normw`` and ``grad_normw += sum_r grad_out_fn[r] * fn[r]`` (rows
    in order into a local sum, added once).

    Args:
        fn: ``(M3, K)`` fp32; normw: ``(K,)`` fp32; grad_out_fn: ``(M3, K)`` fp32.
        grad_fn: ``(M3, K)`` fp32, accumulated.
        grad_normw: ``(K,)`` fp32, accumulated.
    """
    err = OpError("mhc_fn_normw_merge_backward")
    k = check_fn(err, "fn", fn)
    check_tensor(err, "normw", normw, dtype=F32, shape=(k,))
    check_tensor(err, "grad_out_fn", grad_out_fn, dtype=F32, shape=tuple(fn.shape))
    check_tensor(err, "grad_fn", grad_fn, dtype=F32, shape=tuple(fn.shape))
    check_tensor(err, "grad_normw", grad_normw, dtype=F32, shape=(k,))
    same_device(err, fn=fn, normw=normw, grad_out_fn=grad_out_fn, grad_fn=grad_fn, grad_normw=grad_normw)


# DTensor sharding (docs/distributed.md): no token dim, and the ops accept only the full (M3, K) shapes, so the
# weights stay replicated; in the backward both gradients are linear in grad_out_fn, so a Partial gradient
# (a sum over tokens not yet reduced) accumulates into Partial buffers without communication.
mhc_fn_normw_merge_forward.sharding()
mhc_fn_normw_merge_backward.sharding({"grad_out_fn": "P", "grad_fn": "P", "grad_normw": "P"})
