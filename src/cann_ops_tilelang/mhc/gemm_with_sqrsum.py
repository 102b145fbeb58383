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


@declare("mhc_gemm_with_sqrsum_backward", mutates_args=("grad_x",),
         vector_args={"grad_out_mul": 16, "grad_sqrsum": 4, "x": 16, "fn": 16, "grad_x": 16},
         tokens="x", outputs=("grad_fn",))
def mhc_gemm_with_sqrsum_backward(grad_out_mul: Tensor, grad_sqrsum: Tensor, x: Tensor, fn: Tensor,
                                  grad_x: Tensor) -> Tensor:
    """Backward of the pre-norm GEMM: accumulates ``grad_x = bf16(f32(grad_x) + grad_out_mul @ fn +
    2*x*grad_sqrsum)`` in place and returns ``grad_fn = grad_out_mul.T @ f32(x)`` (deterministic).

    Args:
        grad_out_mul: ``(T, M3)`` fp32.
        grad_sqrsum: ``(T,)`` fp32.
        x: ``(T, K)`` bf16, the forward's input.
        fn: ``(M3, K)`` fp32.
        grad_x: ``(T, K)`` bf16, accumulated.

    Returns:
        ``grad_fn (M3, K)`` fp32, a new tensor (zeros for ``T = 0``).
    """
    err = OpError("mhc_gemm_with_sqrsum_backward")
    tokens, k = check_tensor(err, "x", x, dtype=BF16, ndim=2).shape
    check_width(err, "x", k)
    check_tensor(err, "grad_out_mul", grad_out_mul, dtype=F32, shape=(tokens, MIX))
    check_tensor(err, "grad_sqrsum", grad_sqrsum, dtype=F32, shape=(tokens,))
    check_tensor(err, "fn", fn, dtype=F32, shape=(MIX, k))
    check_tensor(err, "grad_x", grad_x, dtype=BF16, shape=(tokens, k))
    same_device(err, grad_out_mul=grad_out_mul, grad_sqrsum=grad_sqrsum, x=x, fn=fn, grad_x=grad_x)
    return fn.new_empty(fn.shape)


# DTensor sharding (docs/distributed.md): the token dim is dim 0 of x and dim 1 of the split partials;
# fn stays replicated (K is not split across ranks). grad_fn is a sum over tokens: Partial.
mhc_gemm_with_sqrsum_forward.sharding({"x": "S0", "returns": ("S1", "S1")})
mhc_gemm_with_sqrsum_backward.sharding(
    {"grad_out_mul": "S0", "grad_sqrsum": "S0", "x": "S0", "grad_x": "S0", "returns": "P"})
