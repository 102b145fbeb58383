"""The mHC training chain (docs/ops/mhc.md#modeling): autograd functions over the mHC primitives and the
modules that hold an mHC sublayer's parameters.

* :func:`expand_from_embedding` makes the ``m`` residual streams of a token from its embedding.
* :func:`mhc_pre` computes a sublayer's input and its post and combination mixes from the residual: the
  pre-norm GEMM, reduce + RMSNorm, split mixes, Sinkhorn and the pre mix with gradients, or
  ``mhc_pre_big_fuse`` in one pass when no gradient is needed (bitwise the same results).
* :func:`mhc_post` combines the sublayer output with the residual into the next residual.
* :func:`mhc_head` is the final mix of the streams before the LM head.
* :class:`MHCSublayer` wraps any sublayer (attention, FFN...) with its mHC parameters; :class:`MHCHead`
  holds the head's.

Residual gradient. The residual ``R`` of a sublayer receives three contributions: through the post mix's
combination term, through the pre mix and through the pre-norm GEMM. They are summed in one bf16 buffer in
that order (each kernel accumulates into it, one bf16 rounding per step). The mechanism is explicit: with
``return_residual=True`` :func:`mhc_pre` also returns ``residual`` as an output of its autograd node, and the
caller passes that tensor to :func:`mhc_post`; the gradient post writes for it reaches the pre node, which
then accumulates its own two contributions into that same buffer. :class:`MHCSublayer` always does this.
Without the link (plain functional calls) or where no post follows (the head), the pre node starts from
zeros and autograd adds the post's contribution afterwards (the same terms, rounded in another order).

Parameters with an fp32 ``main_grad`` attribute (Megatron style) get their gradients accumulated there in
eager mode (the parameter then gets no ``.grad``), as :mod:`.engram_gate` does; buffers that overlap each other,
a parameter or the residual are refused at the forward, and so is a DTensor parameter's buffer that is not a
replicated DTensor (:func:`._buffers.honoured_main_grad`).

DTensors whose leading dims do not flatten into a ``Shard(0)`` of the tokens are gathered on those dims and the
results sliced back to the input's placements (:func:`._buffers.gather_lead`).
"""

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .. import limits
from .._checks import OpError, check_bool, check_float, check_int, describe
from ..mhc import (
    expand_to_mhc_backward,
    expand_to_mhc_forward,
    mhc_fn_normw_merge_backward,
    mhc_fn_normw_merge_forward,
    mhc_gemm_with_sqrsum_backward,
    mhc_gemm_with_sqrsum_forward,
    mhc_head_compute_mix_backward,
    mhc_head_compute_mix_forward,
    mhc_multilayer_recompute,
    mhc_post_backward,
    mhc_post_forward,
    mhc_pre_apply_mix_backward,
    mhc_pre_apply_mix_forward,
    mhc_pre_big_fuse,
    mhc_pre_split_mixes_backward,
    mhc_pre_split_mixes_forward,
    mhc_reduce_partials_and_rmsnorm_backward,
    mhc_reduce_partials_and_rmsnorm_forward,
    mhc_sinkhorn_backward,
    mhc_sinkhorn_forward,
)
from ..mhc._common import check_hc, check_hidden
from ._buffers import (check_main_grads, flat_tokens, gather_lead, grad_buffers, honoured_main_grad, over_tokens,
                       per_token, reduced, restore)
from ._mhc_checks import (check_hyper, check_like_residual, check_module, check_params, check_residual,
                          check_sublayer_output)

__all__ = ["MHCHead", "MHCSublayer", "expand_from_embedding", "mhc_head", "mhc_multilayer_recompute", "mhc_post",
           "mhc_pre", "mhc_recompute_chunk"]

M = limits.MHC_HC_MULT.low
M3 = limits.MHC_MIX
# the rows of the head-mix backward's parameter-gradient partials (reduced here with .sum(0))
_HEAD_PARTIALS = 64


def _grad_out(grad: Optional[Tensor], main: Optional[Tensor]) -> Optional[Tensor]:
    """Accumulates a parameter gradient into its ``main_grad`` (returning None) or returns it (reduced over the
    ranks on DTensors)."""
    if main is None:
        return reduced(grad)
    main.add_(grad)
    return None


# --- expand ------------------------------------------------------------------------------------------------


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = per_token(x, M, x.shape[1])
        expand_to_mhc_forward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = per_token(grad, grad.shape[2])
        expand_to_mhc_backward(grad.contiguous(), grad_x)
        return grad_x


def expand_from_embedding(x: Tensor, hc_mult: int = M) -> Tensor:
    """The ``m`` residual streams of each token, copies of its embedding.

    Args:
        x: ``(*, H)`` bf16.
        hc_mult: ``m`` (4, the only value with kernels).

    Returns:
        ``(*, m, H)`` bf16; its gradient is the bf16 sum of the streams' gradients. A DTensor ``x`` keeps its
        placements (leading dims DTensor cannot flatten are gathered first, docs/distributed.md).
    """
    err = OpError("modeling.expand_from_embedding")
    if not isinstance(x, Tensor):
        raise err.type("x", f"expected a torch.Tensor, got {describe(x)}")
    check_hc(err, "hc_mult", check_int(err, "hc_mult", hc_mult))
    if x.dim() < 1:
        raise err.value("x", "expected (*, H), got a 0-D tensor")
    if x.dtype != torch.bfloat16:
        raise err.type("x", f"expected torch.bfloat16, got {x.dtype}")
    if not torch.compiler.is_compiling():  # traced: the op checks it (Dynamo cannot trace the ranges)
        check_hidden(err, "x", x.shape[-1])
    lead = tuple(x.shape[:-1])
    flat, back = flat_tokens(x, lead, x.shape[-1])
    return restore(_Expand.apply(flat).view(*lead, M, x.shape[-1]), back)


# --- pre ---------------------------------------------------------------------------------------------------


def _mixes_forward(residual, fn_m, norm_eps, n_splits):
    """GEMM partials, then reduce + RMSNorm: ``(out_mul, sqrsum, mixes)``; ``residual`` (T, m, H)."""
    tokens, m, hidden = residual.shape
    parts, sq_parts = mhc_gemm_with_sqrsum_forward(residual.view(tokens, m * hidden), fn_m, n_splits)
    f32 = torch.float32
    out_mul, sqrsum = per_token(residual, 1, fn_m.shape[0], dtype=f32), per_token(residual, 1, dtype=f32)
    mixes = per_token(residual, fn_m.shape[0], dtype=f32)
    # explicit sizes (a -1 is ambiguous at zero tokens)
    mhc_reduce_partials_and_rmsnorm_forward(parts.view(n_splits, tokens, 1, fn_m.shape[0]),
                                            sq_parts.view(n_splits, tokens, 1), out_mul, sqrsum, mixes, m * hidden,
                                            norm_eps, n_splits)
    return out_mul, sqrsum, mixes


def _mixes_backward(grad_mixes, residual, fn_m, out_mul, sqrsum, norm_eps, grad_residual):
    """Reduce + RMSNorm and GEMM backward; accumulates into ``grad_residual`` (T, m, H) and returns d fn_m."""
    tokens, m, hidden = residual.shape
    grad_out_mul, grad_sqrsum = torch.empty_like(out_mul), torch.empty_like(sqrsum)
    mhc_reduce_partials_and_rmsnorm_backward(grad_mixes, out_mul, sqrsum, grad_out_mul, grad_sqrsum, m * hidden,
                                             norm_eps)
    # explicit sizes (a -1 is ambiguous at zero tokens)
    k = m * hidden
    return mhc_gemm_with_sqrsum_backward(grad_out_mul.view(tokens, fn_m.shape[0]), grad_sqrsum.view(tokens),
                                         residual.view(tokens, k), fn_m, grad_residual.view(tokens, k))


def _merged_fn(fn, norm_weight):
    if norm_weight is None:
        return fn
    out = torch.empty_like(fn)
    mhc_fn_normw_merge_forward(fn, norm_weight, out)
    return out


def _fn_grads(fn, norm_weight, grad_fn_m, mains, tokens):
    """Gradients of ``fn`` and ``norm_weight`` from the merged weight's, into their main_grads where present
    (``tokens``: the residual, for the placement of fresh gradient buffers)."""
    main_fn, main_nw = mains
    if norm_weight is None:
        return _grad_out(grad_fn_m, main_fn), None
    grad_fn, grad_nw = grad_buffers(tokens, (fn, norm_weight), mains)
    mhc_fn_normw_merge_backward(fn, norm_weight, grad_fn_m, grad_fn, grad_nw)
    return (None if main_fn is not None else reduced(grad_fn)), (None if main_nw is not None else reduced(grad_nw))


def _pre_forward(residual, fn, scale, base, norm_weight, norm_eps, post_mult_value, pre_eps, sinkhorn_eps,
                 sinkhorn_repeat, n_splits):
    """The pre stage through the unfused primitives: ``(layer_input, post, comb, pre)`` and the intermediates
    its backward needs ``(fn_m, out_mul, sqrsum, mixes, comb_logits)``."""
    tokens, m, hidden = residual.shape
    fn_m = _merged_fn(fn, norm_weight)
    out_mul, sqrsum, mixes = _mixes_forward(residual, fn_m, norm_eps, n_splits)
    pre, post, comb_logits = (per_token(mixes, n) for n in (m, m, m * m))
    mhc_pre_split_mixes_forward(mixes, scale, base, pre, post, comb_logits, post_mult_value, pre_eps)
    comb = per_token(mixes, m, m)
    mhc_sinkhorn_forward(comb_logits.view(tokens, m, m), comb, sinkhorn_repeat, sinkhorn_eps)
    layer_input = per_token(residual, hidden)
    mhc_pre_apply_mix_forward(residual, pre, layer_input)
    return (layer_input, post, comb, pre), (fn_m, out_mul, sqrsum, mixes, comb_logits)


class _Pre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, fn, scale, base, norm_weight, norm_eps, post_mult_value, pre_eps, sinkhorn_eps,
                sinkhorn_repeat, n_splits, mains):
        (layer_input, post, comb, pre), (fn_m, out_mul, sqrsum, mixes, comb_logits) = _pre_forward(
            residual, fn, scale, base, norm_weight, norm_eps, post_mult_value, pre_eps, sinkhorn_eps, sinkhorn_repeat,
            n_splits)
        ctx.save_for_backward(residual, fn, fn_m, scale, base, norm_weight, out_mul, sqrsum, mixes, pre, post,
                              comb_logits)
        ctx.hyper = (norm_eps, post_mult_value, sinkhorn_eps, sinkhorn_repeat)
        ctx.mains = mains
        # the pre mix, for activation recomputation (no gradient flows through this copy)
        pre_out = pre.clone()
        ctx.mark_non_differentiable(pre_out)
        # the residual again, as this node's output: the gradient mhc_post writes for it arrives here
        return layer_input, post, comb, residual.view_as(residual), pre_out

    @staticmethod
    def backward(ctx, grad_layer_input, grad_post, grad_comb, grad_residual_link, _d_pre_out):
        residual, fn, fn_m, scale, base, norm_weight, out_mul, sqrsum, mixes, pre, post, comb_logits = \
            ctx.saved_tensors
        norm_eps, post_mult_value, sinkhorn_eps, sinkhorn_repeat = ctx.hyper
        tokens, m, hidden = residual.shape
        zeros = torch.zeros_like
        # the one bf16 buffer of the residual gradient: post's contribution first (or zeros), then ours
        grad_residual = grad_residual_link.contiguous().clone() if grad_residual_link is not None else zeros(residual)
        grad_li = (grad_layer_input.contiguous() if grad_layer_input is not None
                   else per_token(residual, hidden, zero=True))
        grad_pre = mhc_pre_apply_mix_backward(grad_li, residual, pre, grad_residual)
        grad_comb_logits = torch.empty_like(comb_logits)
        grad_comb = grad_comb.contiguous() if grad_comb is not None else per_token(comb_logits, m, m, zero=True)
        mhc_sinkhorn_backward(grad_comb, comb_logits.view(tokens, m, m), grad_comb_logits.view(tokens, m, m),
                              sinkhorn_repeat, sinkhorn_eps)
        grad_mixes = torch.empty_like(mixes)
        grad_scale, grad_base = over_tokens(mixes, *scale.shape), over_tokens(mixes, *base.shape)
        grad_post = grad_post.contiguous() if grad_post is not None else zeros(post)
        mhc_pre_split_mixes_backward(grad_pre, grad_post, grad_comb_logits, mixes, post, scale, base, grad_mixes,
                                     grad_scale, grad_base, post_mult_value)
        grad_fn_m = _mixes_backward(grad_mixes, residual, fn_m, out_mul, sqrsum, norm_eps, grad_residual)
        main_fn, main_scale, main_base, main_nw = ctx.mains
        grad_fn, grad_nw = _fn_grads(fn, norm_weight, grad_fn_m, (main_fn, main_nw), residual)
        return (grad_residual, grad_fn, _grad_out(grad_scale, main_scale), _grad_out(grad_base, main_base), grad_nw,
                None, None, None, None, None, None, None)


def mhc_pre(residual: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, norm_weight: Optional[Tensor] = None,
            norm_eps: float = 1e-6, post_mult_value: float = 2.0, pre_eps: float = 1e-6, sinkhorn_eps: float = 1e-6,
            sinkhorn_repeat: int = 20, n_splits: int = 16, return_residual: bool = False,
            return_pre_mix: bool = False):
    """The pre stage of an mHC sublayer.

    Args:
        residual: ``(*, m, H)`` bf16, the residual streams.
        fn: ``(M3, m*H)`` fp32, the pre-norm projection (``M3 = m*(m+2) = 24``).
        scale: ``(3,)`` fp32, the scales of the pre, post and combination logits.
        base: ``(M3,)`` fp32, their biases.
        norm_weight: optional ``(m*H,)`` fp32 RMSNorm weight of the flattened residual (folded into ``fn``).
        norm_eps, pre_eps, sinkhorn_eps: epsilons (>= 0); defaults of DeepSeek-V4.
        post_mult_value: the post mix's multiplier (2.0).
        sinkhorn_repeat: Sinkhorn iterations (20).
        n_splits: split-K count of the pre-norm GEMM (in [1, m*H/64]).
        return_residual: (a bool) also return ``residual`` as an output of this node, to be passed to
            :func:`mhc_post` so that the residual gradient is accumulated in one buffer (module docstring).
        return_pre_mix: (a bool) also return the pre mix ``(*, m)`` fp32 (no gradient), what
            :func:`mhc_recompute_chunk` needs to regenerate this layer's input.

    Returns:
        ``(layer_input (*, H) bf16, (post_mix (*, m, 1) fp32, comb_mix (*, m, m) fp32))``, then the linked
        residual ``(*, m, H)`` when ``return_residual``, then ``pre_mix`` when ``return_pre_mix``. With gradients
        enabled the unfused primitives run (their backward needs their intermediates); without,
        ``mhc_pre_big_fuse`` (or the unfused forwards where the pre mix is asked for) gives bitwise the same results.
    """
    op = "modeling.mhc_pre"
    err = OpError(op)
    lead, m, hidden = check_residual(op, residual)
    check_params(op, residual, fn, scale, base, norm_weight, M3, 3, M3)
    h = check_hyper(op, residual, {"norm_eps": norm_eps, "pre_eps": pre_eps, "sinkhorn_eps": sinkhorn_eps}, n_splits,
                    post_mult_value, sinkhorn_repeat)
    norm_eps, pre_eps, sinkhorn_eps, post_mult_value, sinkhorn_repeat, n_splits = (
        h[k] for k in ("norm_eps", "pre_eps", "sinkhorn_eps", "post_mult_value", "sinkhorn_repeat", "n_splits"))
    return_residual = check_bool(err, "return_residual", return_residual)
    return_pre_mix = check_bool(err, "return_pre_mix", return_pre_mix)
    tensors = (residual, fn, scale, base) + (() if norm_weight is None else (norm_weight,))
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if training:
        params = (("fn", fn), ("scale", scale), ("base", base), ("norm_weight", norm_weight))
        mains = tuple(honoured_main_grad(p, op, name) for name, p in params)
        check_main_grads(op, params, mains, (("residual", residual),))
    flat, back = flat_tokens(residual, lead, m, hidden)
    if training:
        layer_input, post, comb, link, pre = _Pre.apply(flat, fn, scale, base, norm_weight, norm_eps,
                                                        post_mult_value, pre_eps, sinkhorn_eps, sinkhorn_repeat,
                                                        n_splits, mains)
    elif return_pre_mix:  # the fused op does not write the pre mix
        (layer_input, post, comb, pre), _ = _pre_forward(flat, fn, scale, base, norm_weight, norm_eps,
                                                         post_mult_value, pre_eps, sinkhorn_eps, sinkhorn_repeat,
                                                         n_splits)
        link = flat
    else:
        tokens = flat.shape[0]
        fn_m = _merged_fn(fn, norm_weight)
        parts, sq_parts = mhc_gemm_with_sqrsum_forward(flat.view(tokens, m * hidden), fn_m, n_splits)
        post, comb = per_token(flat, m, dtype=torch.float32), per_token(flat, m, m, dtype=torch.float32)
        layer_input = per_token(flat, hidden)
        mhc_pre_big_fuse(parts, sq_parts, scale, base, flat, post, comb.view(tokens, m * m), layer_input, norm_eps,
                         pre_eps, sinkhorn_eps, post_mult_value, sinkhorn_repeat, n_splits)
        link = flat
    result = (restore(layer_input.view(*lead, hidden), back),
              (restore(post.view(*lead, m, 1), back), restore(comb.view(*lead, m, m), back)))
    if return_residual:
        result += (restore(link.view(residual.shape), back),)
    return result + (restore(pre.view(*lead, m), back),) if return_pre_mix else result


# --- post --------------------------------------------------------------------------------------------------


class _Post(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, post, comb):
        ctx.save_for_backward(x, residual, post, comb)
        return mhc_post_forward(x, residual, post, comb)

    @staticmethod
    def backward(ctx, grad_out):
        x, residual, post, comb = ctx.saved_tensors
        return mhc_post_backward(x, residual, post, comb, grad_out.contiguous())


def mhc_post(layer_output: Tensor, residual: Tensor, post_mix: Tensor, comb_mix: Tensor) -> Tensor:
    """The next residual: ``out[..., o, :] = post[..., o] * layer_output + sum_i comb[..., i, o] * residual[..., i, :]``.

    Args:
        layer_output: ``(*, H)`` bf16, the sublayer's output.
        residual: ``(*, m, H)`` bf16 (the linked residual of :func:`mhc_pre` for the ordered residual gradient).
        post_mix: ``(*, m, 1)`` or ``(*, m)`` fp32; comb_mix: ``(*, m, m)`` fp32 (from :func:`mhc_pre`).

    Returns:
        ``(*, m, H)`` bf16.
    """
    op = "modeling.mhc_post"
    lead, m, hidden = check_residual(op, residual)
    err = OpError(op)
    for arg, value, shapes in (("layer_output", layer_output, [lead + (hidden,)]),
                               ("post_mix", post_mix, [lead + (m, 1), lead + (m,)]),
                               ("comb_mix", comb_mix, [lead + (m, m)])):
        dtype = torch.bfloat16 if arg == "layer_output" else torch.float32
        check_like_residual(err, arg, value, dtype, shapes, residual)
    flat, back = flat_tokens(residual, lead, m, hidden)
    flat_output, output_back = flat_tokens(layer_output, lead, hidden)
    out = _Post.apply(flat_output, flat, flat_tokens(post_mix, lead, m)[0], flat_tokens(comb_mix, lead, m, m)[0])
    # the residual's placements, else the sublayer output's (a replicated residual with a sharded output)
    return restore(out.view(residual.shape), back if back is not None else output_back)


# --- head --------------------------------------------------------------------------------------------------


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, fn_head, scale, base, norm_weight, norm_eps, pre_eps, n_splits, mains):
        tokens, m, hidden = residual.shape
        fn_m = _merged_fn(torch.cat([fn_head, fn_head.new_zeros(M3 - m, fn_head.shape[1])]), norm_weight)
        out_mul, sqrsum, mixes = _mixes_forward(residual, fn_m, norm_eps, n_splits)
        input_mix = mixes[:, :m].contiguous()
        output_mix = per_token(input_mix, m)
        mhc_head_compute_mix_forward(input_mix, scale, base, output_mix, pre_eps)
        out = per_token(residual, hidden)
        mhc_pre_apply_mix_forward(residual, output_mix, out)
        ctx.save_for_backward(residual, fn_head, fn_m, scale, base, norm_weight, out_mul, sqrsum, input_mix,
                              output_mix)
        ctx.hyper = (norm_eps,)
        ctx.mains = mains
        return out

    @staticmethod
    def backward(ctx, grad_out):
        residual, fn_head, fn_m, scale, base, norm_weight, out_mul, sqrsum, input_mix, output_mix = ctx.saved_tensors
        (norm_eps,) = ctx.hyper
        tokens, m, hidden = residual.shape
        # no post follows the head: its residual gradient starts from zeros
        grad_residual = torch.zeros_like(residual)
        grad_output_mix = mhc_pre_apply_mix_backward(grad_out.contiguous(), residual, output_mix, grad_residual)
        grad_input_mix = torch.empty_like(input_mix)
        scale_part, base_part = over_tokens(input_mix, _HEAD_PARTIALS, 1), over_tokens(input_mix, _HEAD_PARTIALS, m)
        mhc_head_compute_mix_backward(grad_output_mix, input_mix, scale, base, grad_input_mix, scale_part, base_part)
        grad_mixes = per_token(input_mix, M3, zero=True)
        grad_mixes[:, :m] = grad_input_mix
        grad_fn_m = _mixes_backward(grad_mixes, residual, fn_m, out_mul, sqrsum, norm_eps, grad_residual)
        main_fn, main_scale, main_base, main_nw = ctx.mains
        if norm_weight is not None:
            padded = torch.cat([fn_head, fn_head.new_zeros(M3 - m, fn_head.shape[1])])
            grad_fn, grad_nw = grad_buffers(residual, (padded, norm_weight), (None, main_nw))
            mhc_fn_normw_merge_backward(padded, norm_weight, grad_fn_m, grad_fn, grad_nw)
            grad_nw = None if main_nw is not None else reduced(grad_nw)
        else:
            grad_fn, grad_nw = grad_fn_m, None
        return (grad_residual, _grad_out(grad_fn[:m].contiguous(), main_fn),
                _grad_out(scale_part.sum(0), main_scale), _grad_out(base_part.sum(0), main_base), grad_nw,
                None, None, None, None)


def mhc_head(residual: Tensor, fn_head: Tensor, scale_head: Tensor, base_head: Tensor, *,
             norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-6, pre_eps: float = 1e-6,
             n_splits: int = 16) -> Tensor:
    """The final mix of the residual streams before the LM head.

    ``mixes`` of the pre-norm GEMM with ``fn_head`` padded with zero rows to ``M3`` (reduce + RMSNorm), then
    ``w = sigmoid(mixes[:, :m] * scale_head + base_head) + pre_eps`` and ``out = sum_i w[:, i] * residual[:, i]``.

    Args:
        residual: ``(*, m, H)`` bf16.
        fn_head: ``(m, m*H)`` fp32; scale_head ``(1,)`` fp32; base_head ``(m,)`` fp32.
        norm_weight: optional ``(m*H,)`` fp32 RMSNorm weight folded into ``fn_head``.
        norm_eps, pre_eps: epsilons; n_splits: split-K count of the GEMM.

    Returns:
        ``(*, H)`` bf16. The residual gradient starts from zeros (no post follows the head).
    """
    op = "modeling.mhc_head"
    lead, m, hidden = check_residual(op, residual)
    names = ("fn_head", "scale_head", "base_head")
    check_params(op, residual, fn_head, scale_head, base_head, norm_weight, m, 1, m, names)
    h = check_hyper(op, residual, {"norm_eps": norm_eps, "pre_eps": pre_eps}, n_splits)
    norm_eps, pre_eps, n_splits = h["norm_eps"], h["pre_eps"], h["n_splits"]
    params = tuple(zip(names + ("norm_weight",), (fn_head, scale_head, base_head, norm_weight)))
    mains = tuple(honoured_main_grad(p, op, name) for name, p in params)
    check_main_grads(op, params, mains, (("residual", residual),))
    flat, back = flat_tokens(residual, lead, m, hidden)
    out = _Head.apply(flat, fn_head, scale_head, base_head, norm_weight, norm_eps, pre_eps, n_splits, mains)
    return restore(out.view(*lead, hidden), back)


# --- modules -----------------------------------------------------------------------------------------------


def _init_base(m: int) -> Tensor:
    """Biases that start the block as a plain residual connection: ``pre = 1/m`` (the layer input is the mean
    of the streams), ``post = 1`` (with post_mult_value 2: ``2 * sigmoid(0)``), ``comb`` near the identity
    (diagonal logits 4, off-diagonal 0: Sinkhorn keeps about 0.95 on the diagonal)."""
    base = torch.zeros(M3)
    base[:m] = math.log(1.0 / (m - 1))  # sigmoid(x) = 1/m
    base[2 * m:] = torch.eye(m).flatten() * 4.0
    return base


class MHCSublayer(nn.Module):
    """One sublayer (attention, FFN...) wrapped in manifold-constrained hyper-connections.

    ``forward(residual (*, m, H) bf16, *args, **kwargs) -> (*, m, H) bf16``: ``layer_input, mixes =
    mhc_pre(residual)``, ``y = sublayer(layer_input, *args, **kwargs)``, ``mhc_post(y, residual, *mixes)``, with
    the residual gradient accumulated in the order of the module docstring. The extra arguments go to the
    sublayer unchanged (an attention mask, positions...); ``y`` must be a tensor of ``layer_input``'s shape,
    dtype and device.

    Parameters (fp32): ``fn (M3, m*H)`` initialized normal with std ``1e-4`` (small: the mixes start from the
    biases), ``scale (3,)`` ones, ``base (M3,)`` as :func:`_init_base` (a plain residual connection at start),
    and with ``norm_weight=True`` an RMSNorm weight ``(m*H,)`` of ones.

    Args:
        hidden_size: ``H`` (a multiple of 64 in [256, 8192]).
        sublayer: an ``nn.Module`` or any callable mapping ``(*, H)`` bf16 (and the extra arguments of
            ``forward``) to ``(*, H)`` bf16.
        hc_mult: ``m`` (4).
        norm_weight: a bool: keep an RMSNorm weight of the flattened residual.
        post_mult_value, sinkhorn_repeat, eps, n_splits: as :func:`mhc_pre` (DeepSeek-V4 defaults; ``eps``
            is its three epsilons).
        device: where the parameters are created.
    """

    def __init__(self, hidden_size: int, sublayer: nn.Module, hc_mult: int = M, *, norm_weight: bool = False,
                 post_mult_value: float = 2.0, sinkhorn_repeat: int = 20, eps: float = 1e-6, n_splits: int = 16,
                 device=None):
        super().__init__()
        err = OpError("modeling.MHCSublayer")
        hidden_size, hc_mult, eps, n_splits, norm_weight, device = check_module(
            err, hidden_size, hc_mult, eps, n_splits, norm_weight, device)
        if not callable(sublayer):
            raise err.type("sublayer", f"expected an nn.Module or a callable, got {describe(sublayer)}")
        post_mult_value = check_float(err, "post_mult_value", post_mult_value, minimum=0.0, inclusive=False)
        # the widest range of the backends: a device's own is checked by the ops
        sinkhorn_repeat = limits.MHC_SINKHORN_REPEAT.of("cpu").check(
            err, "sinkhorn_repeat", check_int(err, "sinkhorn_repeat", sinkhorn_repeat))
        self.sublayer = sublayer
        self.hidden_size, self.hc_mult = hidden_size, hc_mult
        self.post_mult_value, self.sinkhorn_repeat, self.eps, self.n_splits = post_mult_value, sinkhorn_repeat, eps, \
            n_splits
        k = hc_mult * hidden_size
        self.fn = nn.Parameter(torch.randn(M3, k, device=device) * 1e-4)
        self.scale = nn.Parameter(torch.ones(3, device=device))
        self.base = nn.Parameter(_init_base(hc_mult).to(device))
        self.norm_weight = nn.Parameter(torch.ones(k, device=device)) if norm_weight else None

    def forward(self, residual: Tensor, *args, **kwargs) -> Tensor:
        op = "modeling.MHCSublayer"
        check_residual(op, residual, self.hidden_size)
        # a DTensor whose leading dims do not flatten is gathered once here, not again by mhc_post; the sublayer
        # sees its input with the residual's placements
        gathered, back = gather_lead(residual, residual.dim() - 2)
        layer_input, (post, comb), linked = mhc_pre(
            gathered, self.fn, self.scale, self.base, norm_weight=self.norm_weight, norm_eps=self.eps,
            post_mult_value=self.post_mult_value, pre_eps=self.eps, sinkhorn_eps=self.eps,
            sinkhorn_repeat=self.sinkhorn_repeat, n_splits=self.n_splits, return_residual=True)
        layer_input = restore(layer_input, back)
        output = check_sublayer_output(OpError(op), self.sublayer(layer_input, *args, **kwargs), layer_input)
        return restore(mhc_post(output, linked, post, comb), back)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, hc_mult={self.hc_mult}, post_mult_value={self.post_mult_value}, "
                f"sinkhorn_repeat={self.sinkhorn_repeat}, eps={self.eps}, n_splits={self.n_splits}")


class MHCHead(nn.Module):
    """The head's mix of the residual streams: ``forward(residual (*, m, H)) -> (*, H)`` (:func:`mhc_head`).

    Parameters (fp32): ``fn (m, m*H)`` normal with std ``1e-4``, ``scale (1,)`` ones, ``base (m,)`` with
    ``sigmoid(base) = 1/m`` (the mean of the streams at start), optional ``norm_weight (m*H,)`` ones.

    Args:
        hidden_size: ``H`` (a multiple of 64 in [256, 8192]).
        hc_mult: ``m`` (4).
        norm_weight: a bool: keep an RMSNorm weight of the flattened residual.
        eps: ``norm_eps`` and ``pre_eps`` of :func:`mhc_head`; n_splits: its split-K count.
        device: where the parameters are created.
    """

    def __init__(self, hidden_size: int, hc_mult: int = M, *, norm_weight: bool = False, eps: float = 1e-6,
                 n_splits: int = 16, device=None):
        super().__init__()
        hidden_size, hc_mult, eps, n_splits, norm_weight, device = check_module(
            OpError("modeling.MHCHead"), hidden_size, hc_mult, eps, n_splits, norm_weight, device)
        self.hidden_size = hidden_size
        k = hc_mult * hidden_size
        self.eps, self.n_splits = eps, n_splits
        self.fn = nn.Parameter(torch.randn(hc_mult, k, device=device) * 1e-4)
        self.scale = nn.Parameter(torch.ones(1, device=device))
        self.base = nn.Parameter(torch.full((hc_mult,), math.log(1.0 / (hc_mult - 1)), device=device))
        self.norm_weight = nn.Parameter(torch.ones(k, device=device)) if norm_weight else None

    def forward(self, residual: Tensor) -> Tensor:
        check_residual("modeling.MHCHead", residual, self.hidden_size)
        return mhc_head(residual, self.fn, self.scale, self.base, norm_weight=self.norm_weight, norm_eps=self.eps,
                        pre_eps=self.eps, n_splits=self.n_splits)


# --- activation recomputation -------------------------------------------------------------------------------


def mhc_recompute_chunk(residual: Tensor, pre_mixes: list, layer_outputs: list, post_mixes: list,
                        comb_mixes: list) -> tuple[list, list]:
    """A chunk's layer inputs and residuals regenerated (activation recomputation) from the residual entering
    it and the small tensors its forward kept, bitwise as :func:`mhc_pre` and :func:`mhc_post` computed them
    (one ``mhc_multilayer_recompute`` pass; no gradient flows through it).

    Args:
        residual: ``(*, m, H)`` bf16, the residual entering the chunk's first sublayer.
        pre_mixes: ``L`` tensors ``(*, m)`` fp32 (``mhc_pre(..., return_pre_mix=True)``), ``L`` in [1, 64].
        layer_outputs: ``Lp`` tensors ``(*, H)`` bf16, the sublayers' outputs, ``Lp`` in ``{L - 1, L}`` (``L - 1``:
            the last sublayer's post is left to the caller).
        post_mixes: ``Lp`` tensors ``(*, m, 1)`` or ``(*, m)`` fp32; comb_mixes: ``Lp`` tensors ``(*, m, m)`` fp32.

    Returns:
        ``(layer_inputs, residuals)``: ``L`` tensors ``(*, H)`` bf16 and ``Lp`` tensors ``(*, m, H)`` bf16, the
        residual after each post.
    """
    op = "modeling.mhc_recompute_chunk"
    err = OpError(op)
    lead, m, hidden = check_residual(op, residual)
    lists = {"pre_mixes": (pre_mixes, [lead + (m,)]), "layer_outputs": (layer_outputs, [lead + (hidden,)]),
             "post_mixes": (post_mixes, [lead + (m, 1), lead + (m,)]), "comb_mixes": (comb_mixes, [lead + (m, m)])}
    for arg, (items, shapes) in lists.items():
        if not isinstance(items, (list, tuple)):
            raise err.type(arg, f"expected a list of tensors, got {describe(items)}")
        for index, item in enumerate(items):
            dtype = torch.bfloat16 if arg == "layer_outputs" else torch.float32
            check_like_residual(err, f"{arg}[{index}]", item, dtype, shapes, residual)
    layers, kept = len(pre_mixes), len(layer_outputs)
    if not limits.MHC_RECOMPUTE_LAYERS.low <= layers <= limits.MHC_RECOMPUTE_LAYERS.high:
        raise err.value("pre_mixes", f"expected {limits.MHC_RECOMPUTE_LAYERS.describe()} tensors (one per sublayer), "
                                     f"got {layers}")
    if kept not in (layers - 1, layers):
        raise err.value("layer_outputs", f"expected L - 1 or L = {layers} tensors (L: pre_mixes), got {kept}")
    for arg in ("post_mixes", "comb_mixes"):
        if len(lists[arg][0]) != kept:
            raise err.value(arg, f"expected as many tensors as layer_outputs ({kept}), got {len(lists[arg][0])}")
    flat, back = flat_tokens(residual, lead, m, hidden)
    inputs = [per_token(flat, hidden) for _ in range(layers)]
    residuals = [torch.empty_like(flat) for _ in range(kept)]
    with torch.no_grad():
        mhc_multilayer_recompute(flat, [flat_tokens(t, lead, m)[0] for t in pre_mixes],
                                 [flat_tokens(t, lead, hidden)[0] for t in layer_outputs],
                                 [flat_tokens(t, lead, m)[0] for t in post_mixes],
                                 [flat_tokens(t, lead, m, m)[0] for t in comb_mixes], inputs, residuals)
    return ([restore(t.view(*lead, hidden), back) for t in inputs],
            [restore(t.view(residual.shape), back) for t in residuals])

