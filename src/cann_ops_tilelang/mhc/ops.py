"""The mHC primitives (OPS.md §B.2, §C) as ``cann_ops_tilelang::*`` custom ops.

Buffers an op writes are arguments declared in ``mutates_args`` (exactly the OUT / in-place buffers of
the contract); everything else an op produces is a new tensor it returns. Kernels: CUDA
(``kernels/cuda/mhc``) and Ascend 950 (``kernels/ascend/mhc``); each backend module has one launcher per
op, named as the op, taking the op's arguments in schema order followed by its new outputs.
"""

from typing import Optional

from torch import Tensor

from .._library import declare
from ..fakes import mhc as fakes

_FAMILY = "mhc"

# op -> (buffers it writes, the argument whose dim 0 is the token count, buffers that hold a defined
# result even for zero tokens and are zeroed then)
_OPS = {
    "expand_to_mhc_forward": (("out",), "x", ()),
    "expand_to_mhc_backward": (("x_grad",), "out_grad", ()),
    "mhc_fn_normw_merge_forward": (("out_fn",), None, ()),
    "mhc_fn_normw_merge_backward": (("fn_grad", "normw_grad"), None, ()),
    "mhc_gemm_with_sqrsum_forward": ((), "x", ()),
    "mhc_gemm_with_sqrsum_backward": (("x_grad",), "x", ()),
    "mhc_reduce_partials_and_rmsnorm_forward": (("out_mul", "sqrsum", "out"), "out", ()),
    "mhc_reduce_partials_and_rmsnorm_backward": (("out_mul_grad", "sqrsum_grad"), "out_grad", ()),
    "mhc_pre_split_mixes_forward": (("pre", "post", "comb"), "input_mixes", ()),
    "mhc_pre_split_mixes_backward": (("input_mixes_grad", "mhc_scale_grad", "mhc_base_grad"), "input_mixes",
                                     ("mhc_scale_grad", "mhc_base_grad")),
    "mhc_sinkhorn_forward": (("comb_out",), "comb", ()),
    "mhc_sinkhorn_backward": (("grad_input",), "x", ()),
    "mhc_pre_apply_mix_forward": (("out",), "x", ()),
    "mhc_pre_apply_mix_backward": (("x_grad",), "x", ()),
    "mhc_post_forward": ((), "x", ()),
    "mhc_post_forward_out": (("out",), "x", ()),
    "mhc_post_backward": ((), "x", ()),
    "mhc_head_compute_mix_forward": (("output_mix",), "input_mix", ()),
    "mhc_head_compute_mix_backward": (("input_mix_grad", "mhc_scale_grad_partial", "mhc_base_grad_partial"),
                                      "input_mix", ("mhc_scale_grad_partial", "mhc_base_grad_partial")),
}

# op -> the arguments its kernels access in vectors, with the access width in bytes (each must start on a
# multiple of it; the CUDA lowering tests check this table against the generated sources)
_VECTOR_ARGS = {
    "expand_to_mhc_forward": {"x": 16, "out": 16},
    "expand_to_mhc_backward": {"out_grad": 16, "x_grad": 16},
    "mhc_fn_normw_merge_forward": {"fn": 16, "normw": 16, "out_fn": 16},
    "mhc_fn_normw_merge_backward": {"fn": 16, "normw": 16, "out_fn_grad": 16, "fn_grad": 16},
    "mhc_gemm_with_sqrsum_forward": {"x": 16, "fn": 16},
    "mhc_gemm_with_sqrsum_backward": {"out_mul_grad": 16, "x": 4, "fn": 8, "x_grad": 4},
    "mhc_reduce_partials_and_rmsnorm_forward": {"out_mul_splitted": 16, "out_mul": 16, "out": 16},
    "mhc_reduce_partials_and_rmsnorm_backward": {"out_grad": 16, "out_mul": 16, "out_mul_grad": 16},
    "mhc_pre_split_mixes_forward": {"input_mixes": 16, "mhc_base": 16, "pre": 16, "post": 16, "comb": 16},
    "mhc_pre_split_mixes_backward": {"pre_grad": 16, "post_grad": 16, "comb_grad": 16, "input_mixes": 16,
                                     "post": 16, "mhc_base": 16, "input_mixes_grad": 16},
    "mhc_sinkhorn_forward": {},
    "mhc_sinkhorn_backward": {},
    "mhc_pre_apply_mix_forward": {"x": 16, "out": 16},
    "mhc_pre_apply_mix_backward": {"out_grad": 16, "x": 16, "x_grad": 16},
    "mhc_post_forward": {"x": 16, "residual": 16},
    "mhc_post_forward_out": {"x": 16, "residual": 16, "out": 16},
    "mhc_post_backward": {"x": 16, "residual": 16, "d_o": 16},
    "mhc_head_compute_mix_forward": {},
    "mhc_head_compute_mix_backward": {"output_mix_grad": 16, "input_mix": 16, "input_mix_grad": 16},
}

# The out-variant of the post forward runs the post-forward kernel with the caller's buffer.
_KERNEL_NAME = {"mhc_post_forward_out": "mhc_post_forward"}


def _declare(name: str):
    mutated, token_arg, zero_when_empty = _OPS[name]
    public = declare(name, family=_FAMILY, mutates_args=mutated, vector_args=_VECTOR_ARGS[name])(getattr(fakes, name))
    kernel_name = _KERNEL_NAME.get(name, name)

    @public.launch
    def _(kernels, outputs, **arguments):
        new = () if outputs is None else (outputs if isinstance(outputs, tuple) else (outputs,))
        if token_arg is not None and arguments[token_arg].shape[0] == 0:
            # No tokens: nothing to launch; sums over no tokens are defined zeros.
            for buffer in (*new, *(arguments[a] for a in zero_when_empty)):
                buffer.zero_()
            return
        getattr(kernels, kernel_name)(*arguments.values(), *new)

    return public


expand_to_mhc_forward = _declare("expand_to_mhc_forward")
expand_to_mhc_backward = _declare("expand_to_mhc_backward")
mhc_fn_normw_merge_forward = _declare("mhc_fn_normw_merge_forward")
mhc_fn_normw_merge_backward = _declare("mhc_fn_normw_merge_backward")
mhc_gemm_with_sqrsum_forward = _declare("mhc_gemm_with_sqrsum_forward")
mhc_gemm_with_sqrsum_backward = _declare("mhc_gemm_with_sqrsum_backward")
mhc_reduce_partials_and_rmsnorm_forward = _declare("mhc_reduce_partials_and_rmsnorm_forward")
mhc_reduce_partials_and_rmsnorm_backward = _declare("mhc_reduce_partials_and_rmsnorm_backward")
mhc_pre_split_mixes_forward = _declare("mhc_pre_split_mixes_forward")
mhc_pre_split_mixes_backward = _declare("mhc_pre_split_mixes_backward")
mhc_sinkhorn_forward = _declare("mhc_sinkhorn_forward")
mhc_sinkhorn_backward = _declare("mhc_sinkhorn_backward")
mhc_pre_apply_mix_forward = _declare("mhc_pre_apply_mix_forward")
mhc_pre_apply_mix_backward = _declare("mhc_pre_apply_mix_backward")
_mhc_post_forward = _declare("mhc_post_forward")
_mhc_post_forward_out = _declare("mhc_post_forward_out")
_mhc_post_backward = _declare("mhc_post_backward")
mhc_head_compute_mix_forward = _declare("mhc_head_compute_mix_forward")
mhc_head_compute_mix_backward = _declare("mhc_head_compute_mix_backward")


def _flat(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor):
    """Views of the post arguments with the leading dims flattened: (T, H), (T, m, H), (T, m), (T, m, m)."""
    m, hidden = residual.shape[-2:]
    return (x.reshape(-1, hidden), residual.reshape(-1, m, hidden), post_layer_mix.reshape(-1, m),
            comb_res_mix.reshape(-1, m, m))


def mhc_post_forward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                     out: Optional[Tensor] = None) -> Tensor:
    """mHC post mix (OPS.md B.2.8): ``out[..., o, :] = post[..., o]*x + sum_i comb[..., i, o]*residual[..., i, :]``.

    Accumulated in fp32 in exactly that order (post term first, then i ascending), one bf16 rounding.

    Args:
        x: ``(*, H)`` bf16, the sublayer output.
        residual: ``(*, m, H)`` bf16.
        post_layer_mix: ``(*, m, 1)`` or ``(*, m)`` fp32.
        comb_res_mix: ``(*, m, m)`` fp32 (after Sinkhorn; ``comb[i, o]`` from input i to output o).
        out: optional ``(*, m, H)`` bf16 buffer to write (must not alias the inputs).

    Returns:
        ``(*, m, H)`` bf16: ``out`` when given, else a new tensor.
    """
    flat = _flat(x, residual, post_layer_mix, comb_res_mix)
    if out is None:
        return _mhc_post_forward(*flat).view(residual.shape)
    _mhc_post_forward_out(*flat, out.view(flat[1].shape))
    return out


def mhc_post_backward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                      d_o: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of :func:`mhc_post_forward` (OPS.md B.2.8).

    Returns:
        ``(d_x, d_residual, d_post_layer_mix, d_comb_res_mix)`` shaped like ``x`` (bf16), ``residual``
        (bf16), ``post_layer_mix`` (fp32) and ``comb_res_mix`` (fp32).
    """
    flat = _flat(x, residual, post_layer_mix, comb_res_mix)
    d_x, d_res, d_post, d_comb = _mhc_post_backward(*flat, d_o.reshape(flat[1].shape))
    return (d_x.view(x.shape), d_res.view(residual.shape), d_post.view(post_layer_mix.shape),
            d_comb.view(comb_res_mix.shape))
