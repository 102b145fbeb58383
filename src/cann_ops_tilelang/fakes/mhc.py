"""Fake (meta) implementations of the mHC primitives (OPS.md §B.2).

Each function is the op's prepare step (see ``_library.declare``): annotations = schema; it validates
and allocates the new outputs with ``new_empty``; buffers the op writes are arguments. Shapes use
``T`` tokens, ``m = 4`` streams, hidden size ``H``, ``K = m*H``, ``M3 = 24`` mixes, ``S`` splits.
Never imports TileLang, never queries a device.
"""

import torch
from torch import Tensor

from ..mhc import validation as v


def expand_to_mhc_forward(x: Tensor, out: Tensor) -> None:
    """``out[t, i, :] = x[t, :]`` for every stream i. x ``(T, H)`` bf16; out ``(T, m, H)`` bf16 (written)."""
    v.check_expand_to_mhc_forward(x, out)


def expand_to_mhc_backward(out_grad: Tensor, x_grad: Tensor) -> None:
    """``x_grad = bf16(sum_i f32(out_grad[:, i]))`` (i ascending). out_grad ``(T, m, H)`` bf16; x_grad
    ``(T, H)`` bf16 (overwritten)."""
    v.check_expand_to_mhc_backward(out_grad, x_grad)


def mhc_fn_normw_merge_forward(fn: Tensor, normw: Tensor, out_fn: Tensor) -> None:
    """``out_fn = fn * normw``. fn ``(M3, K)`` fp32, normw ``(K,)`` fp32, out_fn ``(M3, K)`` fp32 (written)."""
    v.check_mhc_fn_normw_merge_forward(fn, normw, out_fn)


def mhc_fn_normw_merge_backward(fn: Tensor, normw: Tensor, out_fn_grad: Tensor, fn_grad: Tensor,
                                normw_grad: Tensor) -> None:
    """Accumulates: ``fn_grad += out_fn_grad * normw``; ``normw_grad += sum_r out_fn_grad[r] * fn[r]``
    (rows in order into a local sum, added once). All fp32."""
    v.check_mhc_fn_normw_merge_backward(fn, normw, out_fn_grad, fn_grad, normw_grad)


def mhc_gemm_with_sqrsum_forward(x: Tensor, fn: Tensor, n_splits: int) -> tuple[Tensor, Tensor]:
    """Split-K pre-norm GEMM: ``out_mul_part[s] = x[:, K_s] @ tf32(fn[:, K_s]).T`` and
    ``sqrsum_part[s] = sum_{K_s} x^2``; ``K_s`` = 64-column blocks, split s gets ``nb // S`` (+1 when
    ``s < nb % S``) in order.

    Args:
        x: ``(T, K)`` bf16 (the residual ``(T, m, H)`` viewed flat).
        fn: ``(M3, K)`` fp32.
        n_splits: ``S`` in ``[1, K/64]``.

    Returns:
        ``(out_mul_part (S, T, M3) fp32, sqrsum_part (S, T) fp32)``.
    """
    v.check_mhc_gemm_with_sqrsum_forward(x, fn, n_splits)
    tokens = x.shape[0]
    return (x.new_empty((n_splits, tokens, fn.shape[0]), dtype=torch.float32),
            x.new_empty((n_splits, tokens), dtype=torch.float32))


def mhc_gemm_with_sqrsum_backward(out_mul_grad: Tensor, sqrsum_grad: Tensor, x: Tensor, fn: Tensor,
                                  x_grad: Tensor) -> Tensor:
    """``x_grad = bf16(f32(x_grad) + out_mul_grad @ fn + 2*x*sqrsum_grad)`` (accumulated in place) and
    returns ``fn_grad = out_mul_grad.T @ f32(x)`` ``(M3, K)`` fp32 (a new tensor, deterministic)."""
    v.check_mhc_gemm_with_sqrsum_backward(out_mul_grad, sqrsum_grad, x, fn, x_grad)
    return fn.new_empty(fn.shape)


def mhc_reduce_partials_and_rmsnorm_forward(out_mul_splitted: Tensor, sqrsum_splitted: Tensor, out_mul: Tensor,
                                            sqrsum: Tensor, out: Tensor, rms_group_size: int, rms_eps: float,
                                            n_splits: int) -> None:
    """Sums the S partials in order into ``out_mul (T, G, M3)`` and ``sqrsum (T, G)``, then
    ``out (T, M3) = sum_g out_mul[:, g] * rsqrt(sqrsum[:, g] / rms_group_size + rms_eps)``. G = 1."""
    v.check_mhc_reduce_partials_and_rmsnorm_forward(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out,
                                                    rms_group_size, rms_eps, n_splits)


def mhc_reduce_partials_and_rmsnorm_backward(out_grad: Tensor, out_mul: Tensor, sqrsum: Tensor,
                                             out_mul_grad: Tensor, sqrsum_grad: Tensor, rms_group_size: int,
                                             rms_eps: float) -> None:
    """``out_mul_grad = out_grad * r``; ``sqrsum_grad = -rho*r / (2*(sqrsum + eps*Rg))`` with
    ``r = rsqrt(sqrsum/Rg + eps)``, ``rho = sum_j out_grad*out_mul`` (both written)."""
    v.check_mhc_reduce_partials_and_rmsnorm_backward(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad,
                                                     rms_group_size, rms_eps)


def mhc_pre_split_mixes_forward(input_mixes: Tensor, mhc_scale: Tensor, mhc_base: Tensor, pre: Tensor,
                                post: Tensor, comb: Tensor, post_mult_value: float, pre_eps: float) -> None:
    """``z = input_mixes * scale[seg] + base``; ``pre = sigmoid(z[:, :m]) + pre_eps``,
    ``post = sigmoid(z[:, m:2m]) * post_mult_value``, ``comb = z[:, 2m:]`` (all written, fp32)."""
    v.check_mhc_pre_split_mixes_forward(input_mixes, mhc_scale, mhc_base, pre, post, comb, post_mult_value, pre_eps)


def mhc_pre_split_mixes_backward(pre_grad: Tensor, post_grad: Tensor, comb_grad: Tensor, input_mixes: Tensor,
                                 post: Tensor, mhc_scale: Tensor, mhc_base: Tensor, input_mixes_grad: Tensor,
                                 mhc_scale_grad: Tensor, mhc_base_grad: Tensor, post_mult_value: float) -> None:
    """Writes ``input_mixes_grad (T, M3)`` and OVERWRITES ``mhc_scale_grad (3,)`` and ``mhc_base_grad (M3,)``
    (deterministic fixed-order reductions over tokens)."""
    v.check_mhc_pre_split_mixes_backward(pre_grad, post_grad, comb_grad, input_mixes, post, mhc_scale, mhc_base,
                                         input_mixes_grad, mhc_scale_grad, mhc_base_grad, post_mult_value)


def mhc_sinkhorn_forward(comb: Tensor, comb_out: Tensor, repeat: int, eps: float) -> None:
    """Sinkhorn-Knopp on ``(T, m, m)`` logits into ``comb_out``: row softmax, ``+eps``, column normalize,
    then ``repeat - 1`` (row, column) normalizations with ``+eps`` denominators."""
    v.check_mhc_sinkhorn_forward(comb, comb_out, repeat, eps)


def mhc_sinkhorn_backward(grad_output: Tensor, x: Tensor, grad_input: Tensor, repeat: int, eps: float) -> None:
    """Gradient of the Sinkhorn forward w.r.t. the logits ``x`` (recomputed from them), into ``grad_input``."""
    v.check_mhc_sinkhorn_backward(grad_output, x, grad_input, repeat, eps)


def mhc_pre_apply_mix_forward(x: Tensor, mix: Tensor, out: Tensor) -> None:
    """``out = bf16(sum_i mix[:, i] * f32(x[:, i]))`` (i ascending). x ``(T, m, H)`` bf16, mix ``(T, m)`` fp32,
    out ``(T, H)`` bf16 (written)."""
    v.check_mhc_pre_apply_mix_forward(x, mix, out)


def mhc_pre_apply_mix_backward(out_grad: Tensor, x: Tensor, mix: Tensor, x_grad: Tensor) -> Tensor:
    """Accumulates ``x_grad = bf16(f32(x_grad) + mix * f32(out_grad))`` in place and returns
    ``mix_grad (T, m)`` fp32 ``= sum_d f32(out_grad) * f32(x)``."""
    v.check_mhc_pre_apply_mix_backward(out_grad, x, mix, x_grad)
    return mix.new_empty(mix.shape)


def mhc_post_forward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor) -> Tensor:
    """``out[:, o] = bf16(post[:, o]*f32(x) + sum_i comb[:, i, o]*f32(residual[:, i]))`` accumulated in that
    order. x ``(T, H)`` bf16, residual ``(T, m, H)`` bf16, post ``(T, m)`` fp32, comb ``(T, m, m)`` fp32
    → out ``(T, m, H)`` bf16 (new)."""
    v.check_mhc_post_forward(x, residual, post_layer_mix, comb_res_mix)
    return residual.new_empty(residual.shape)


def mhc_post_forward_out(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                         out: Tensor) -> None:
    """``mhc_post_forward`` written into a caller buffer ``out (T, m, H)`` bf16 (not aliasing the inputs)."""
    err, tokens, hidden = v.check_mhc_post_forward(x, residual, post_layer_mix, comb_res_mix,
                                                   op="mhc_post_forward_out")
    from .._checks import check_tensor

    check_tensor(err, "out", out, dtype=torch.bfloat16, shape=(tokens, v.HC_MULT, hidden))


def mhc_post_backward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                      d_o: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(d_x (T, H) bf16, d_residual (T, m, H) bf16, d_post (T, m) fp32, d_comb (T, m, m) fp32)``."""
    v.check_mhc_post_backward(x, residual, post_layer_mix, comb_res_mix, d_o)
    return (x.new_empty(x.shape), residual.new_empty(residual.shape), post_layer_mix.new_empty(post_layer_mix.shape),
            comb_res_mix.new_empty(comb_res_mix.shape))


def mhc_head_compute_mix_forward(input_mix: Tensor, mhc_scale: Tensor, mhc_base: Tensor, output_mix: Tensor,
                                 pre_eps: float) -> None:
    """``output_mix = sigmoid(input_mix * scale[0] + base) + pre_eps`` ``(T, m)`` fp32 (written)."""
    v.check_mhc_head_compute_mix_forward(input_mix, mhc_scale, mhc_base, output_mix, pre_eps)


def mhc_head_compute_mix_backward(output_mix_grad: Tensor, input_mix: Tensor, mhc_scale: Tensor, mhc_base: Tensor,
                                  input_mix_grad: Tensor, mhc_scale_grad_partial: Tensor,
                                  mhc_base_grad_partial: Tensor) -> None:
    """Writes ``input_mix_grad = dz * scale`` and the per-worker partial rows ``(P, 1)`` / ``(P, m)`` of the
    scale and base gradients (``dz = g*s*(1-s)``; every row written; reduce with ``sum(0)``)."""
    v.check_mhc_head_compute_mix_backward(output_mix_grad, input_mix, mhc_scale, mhc_base, input_mix_grad,
                                          mhc_scale_grad_partial, mhc_base_grad_partial)
