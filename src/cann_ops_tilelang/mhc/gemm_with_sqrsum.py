"""The split-K pre-norm GEMM with the sum of squares, and its backward (docs/ops/mhc.md#gemm_with_sqrsum)."""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_int, check_tensor
from .._library import declare
from ._common import BF16, F32, MIX, check_width, same_device

__all__ = ["mhc_gemm_with_sqrsum_backward", "mhc_gemm_with_sqrsum_forward"]


@declare("mhc_gemm_with_sqrsum_forward", vector_args={"x": 16, "fn": 16}, tokens="x",
         outputs=("out_mul_part", "sqrsum_part"))
def mhc_gemm_with_sqrsum_forward(x: Tensor, fn: Tensor, n_splits: int) -> tuple[Tensor, Tensor]:
    """Split-K pre-norm GEMM: ``out_mul_part[s] = x[:, K_s] @ tf32(fn[:, K_s]).T`` and
    ``sqrsum_part[s] = sum_{K_s} f32(x)^2``; the ``K_s`` are 64-column blocks, split ``s`` getting
    ``nb // S`` of them (one more when ``s < nb % S``), in order.

    Args:
        x: ``(T, K)`` bf16 (the residual ``(T, m, H)`` viewed flat, ``K = m*H``).
        fn: ``(M3, K)`` fp32.
        n_splits: ``S`` in ``[1, K/64]``.

    Returns:
        ``(out_mul_part (S, T, M3) fp32, sqrsum_part (S, T) fp32)``, new tensors (zeros for ``T = 0``).
    """
    err = OpError("mhc_gemm_with_sqrsum_forward")
    k = check_tensor(err, "x", x, dtype=BF16, ndim=2).shape[1]
    check_width(err, "x", k)
    check_tensor(err, "fn", fn, dtype=F32, shape=(MIX, k))
    limits.mhc_gemm_splits(k).check(err, "n_splits", check_int(err, "n_splits", n_splits))
    same_device(err, x=x, fn=fn)
    tokens = x.shape[0]
    return (x.new_empty((n_splits, tokens, fn.shape[0]), dtype=F32), x.new_empty((n_splits, tokens), dtype=F32))


@declare("mhc_gemm_with_sqrsum_backward", mutates_args=("x_grad",),
         vector_args={"out_mul_grad": 16, "sqrsum_grad": 4, "x": 16, "fn": 16, "x_grad": 16},
         tokens="x", outputs=("fn_grad",))
def mhc_gemm_with_sqrsum_backward(out_mul_grad: Tensor, sqrsum_grad: Tensor, x: Tensor, fn: Tensor,
                                  x_grad: Tensor) -> Tensor:
    """Backward of the pre-norm GEMM: accumulates ``x_grad = bf16(f32(x_grad) + out_mul_grad @ fn +
    2*x*sqrsum_grad)`` in place and returns ``fn_grad = out_mul_grad.T @ f32(x)`` (deterministic).

    Args:
        out_mul_grad: ``(T, M3)`` fp32.
        sqrsum_grad: ``(T,)`` fp32.
        x: ``(T, K)`` bf16, the forward's input.
        fn: ``(M3, K)`` fp32.
        x_grad: ``(T, K)`` bf16, accumulated.

    Returns:
        ``fn_grad (M3, K)`` fp32, a new tensor (zeros for ``T = 0``).
    """
    err = OpError("mhc_gemm_with_sqrsum_backward")
    tokens, k = check_tensor(err, "x", x, dtype=BF16, ndim=2).shape
    check_width(err, "x", k)
    check_tensor(err, "out_mul_grad", out_mul_grad, dtype=F32, shape=(tokens, MIX))
    check_tensor(err, "sqrsum_grad", sqrsum_grad, dtype=F32, shape=(tokens,))
    check_tensor(err, "fn", fn, dtype=F32, shape=(MIX, k))
    check_tensor(err, "x_grad", x_grad, dtype=BF16, shape=(tokens, k))
    same_device(err, out_mul_grad=out_mul_grad, sqrsum_grad=sqrsum_grad, x=x, fn=fn, x_grad=x_grad)
    return fn.new_empty(fn.shape)


# DTensor sharding (docs/distributed.md): the token dim is dim 0 of x and dim 1 of the split partials;
# fn stays replicated (K is not split across ranks). fn_grad is a sum over tokens: Partial.
mhc_gemm_with_sqrsum_forward.sharding({"x": "S0", "returns": ("S1", "S1")})
mhc_gemm_with_sqrsum_backward.sharding(
    {"out_mul_grad": "S0", "sqrsum_grad": "S0", "x": "S0", "x_grad": "S0", "returns": "P"})
