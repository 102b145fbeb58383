"""The post mix: the sublayer output and the residual streams combined into the next residual, and its
backward (docs/ops/mhc.md#post).

Ops ``mhc_post_forward`` (a new output), ``mhc_post_forward_out`` (into a caller's buffer) and
``mhc_post_backward`` take flat ``(T, ...)`` tensors; the Python functions :func:`mhc_post_forward` and
:func:`mhc_post_backward` accept any leading dims and check them before flattening.
"""

import math
from typing import Optional

from torch import Tensor

from .._checks import OpError, check_tensor, describe
from .._library import declare
from ._common import BF16, F32, HC_MULT, check_residual, same_device

__all__ = ["mhc_post_backward", "mhc_post_forward"]

_INPUT_VECTORS = {"x": 16, "residual": 16}


def _check_inputs(op: str, x, residual, post_layer_mix, comb_res_mix) -> tuple[OpError, int, int]:
    err = OpError(op)
    tokens, hidden = check_residual(err, "residual", residual)
    check_tensor(err, "x", x, dtype=BF16, shape=(tokens, hidden))
    check_tensor(err, "post_layer_mix", post_layer_mix, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "comb_res_mix", comb_res_mix, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    same_device(err, x=x, residual=residual, post_layer_mix=post_layer_mix, comb_res_mix=comb_res_mix)
    return err, tokens, hidden


@declare("mhc_post_forward", vector_args=_INPUT_VECTORS, tokens="x", outputs=("out",))
def _mhc_post_forward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor) -> Tensor:
    """The post mix into a new ``(T, m, H)`` bf16 tensor (see :func:`mhc_post_forward`)."""
    _check_inputs("mhc_post_forward", x, residual, post_layer_mix, comb_res_mix)
    return residual.new_empty(residual.shape)


@declare("mhc_post_forward_out", mutates_args=("out",), vector_args={**_INPUT_VECTORS, "out": 16}, tokens="x",
         kernel="mhc_post_forward")
def _mhc_post_forward_out(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                          out: Tensor) -> None:
    """The post mix written into ``out (T, m, H)`` bf16, which shares no memory with the inputs."""
    err, tokens, hidden = _check_inputs("mhc_post_forward_out", x, residual, post_layer_mix, comb_res_mix)
    check_tensor(err, "out", out, dtype=BF16, shape=(tokens, HC_MULT, hidden))
    same_device(err, x=x, out=out)


@declare("mhc_post_backward", vector_args={**_INPUT_VECTORS, "grad_out": 16}, tokens="x",
         outputs=("grad_x", "grad_residual", "grad_post", "grad_comb"))
def _mhc_post_backward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                       grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of the post mix on flat tensors (see :func:`mhc_post_backward`)."""
    err, tokens, hidden = _check_inputs("mhc_post_backward", x, residual, post_layer_mix, comb_res_mix)
    check_tensor(err, "grad_out", grad_out, dtype=BF16, shape=(tokens, HC_MULT, hidden))
    same_device(err, x=x, grad_out=grad_out)
    return (x.new_empty(x.shape), residual.new_empty(residual.shape), post_layer_mix.new_empty(post_layer_mix.shape),
            comb_res_mix.new_empty(comb_res_mix.shape))


def _flat(op: str, x, residual, post_layer_mix, comb_res_mix, **buffers):
    """Checks the leading dims of every argument against ``residual (*, m, H)`` before any reshape (a wrong
    shape with the right element count must not be reinterpreted) and that every tensor is contiguous (so that
    flattening is a view, never a silent copy), then flattens them to ``(T, ...)``."""
    err = OpError(op)
    named = dict(x=x, residual=residual, post_layer_mix=post_layer_mix, comb_res_mix=comb_res_mix, **buffers)
    for arg, value in named.items():
        if not isinstance(value, Tensor):
            raise err.type(arg, f"expected a torch.Tensor, got {describe(value)}")
    if residual.dim() < 2:
        raise err.value("residual", f"expected (*, m, H), got shape {tuple(residual.shape)}")
    lead, (m, hidden) = tuple(residual.shape[:-2]), tuple(residual.shape[-2:])
    expected = {"x": [lead + (hidden,)], "post_layer_mix": [lead + (m,), lead + (m, 1)],
                "comb_res_mix": [lead + (m, m)], **{arg: [lead + (m, hidden)] for arg in buffers}}
    for arg, shapes in expected.items():
        got = tuple(named[arg].shape)
        if got not in shapes:
            want = " or ".join(str(s) for s in shapes)
            raise err.value(arg, f"expected shape {want} (the leading dims of residual {tuple(residual.shape)}), "
                                 f"got {got}")
    for arg, value in named.items():
        if not value.is_contiguous():
            raise err.value(arg, f"expected a contiguous tensor, got strides {tuple(value.stride())}")
    tokens = math.prod(lead)  # not -1: ambiguous where m or H is 0 (the flat op then names the size)
    flat = (x.view(tokens, hidden), residual.view(tokens, m, hidden), post_layer_mix.view(tokens, m),
            comb_res_mix.view(tokens, m, m))
    return flat, tuple(named[arg].view(tokens, m, hidden) for arg in buffers)


def mhc_post_forward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                     out: Optional[Tensor] = None) -> Tensor:
    """mHC post mix: ``out[..., o, :] = post[..., o] * x + sum_i comb[..., i, o] * residual[..., i, :]``.

    Accumulated in fp32 in exactly that order (the post term first, then ``i`` ascending), one bf16 rounding.

    Args:
        x: ``(*, H)`` bf16, the sublayer output.
        residual: ``(*, m, H)`` bf16.
        post_layer_mix: ``(*, m)`` or ``(*, m, 1)`` fp32.
        comb_res_mix: ``(*, m, m)`` fp32 (after Sinkhorn; ``comb[i, o]`` from input stream i to output o).
        out: optional contiguous ``(*, m, H)`` bf16 buffer to write; it must share no memory with the inputs.

    Returns:
        ``(*, m, H)`` bf16: ``out`` when given, else a new tensor.
    """
    if out is None:
        flat, _ = _flat("mhc_post_forward", x, residual, post_layer_mix, comb_res_mix)
        return _mhc_post_forward(*flat).view(residual.shape)
    flat, (out_flat,) = _flat("mhc_post_forward_out", x, residual, post_layer_mix, comb_res_mix, out=out)
    _mhc_post_forward_out(*flat, out_flat)
    return out


def mhc_post_backward(x: Tensor, residual: Tensor, post_layer_mix: Tensor, comb_res_mix: Tensor,
                      grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of :func:`mhc_post_forward`.

    Args:
        x, residual, post_layer_mix, comb_res_mix: the forward's inputs (shapes as there).
        grad_out: ``(*, m, H)`` bf16, the gradient of the forward's output.

    Returns:
        ``(grad_x, grad_residual, grad_post_layer_mix, grad_comb_res_mix)``, new tensors shaped like ``x`` (bf16),
        ``residual`` (bf16), ``post_layer_mix`` (fp32) and ``comb_res_mix`` (fp32).
    """
    flat, (grad_out_flat,) = _flat("mhc_post_backward", x, residual, post_layer_mix, comb_res_mix, grad_out=grad_out)
    grad_x, grad_res, grad_post, grad_comb = _mhc_post_backward(*flat, grad_out_flat)
    return (grad_x.view(x.shape), grad_res.view(residual.shape), grad_post.view(post_layer_mix.shape),
            grad_comb.view(comb_res_mix.shape))


mhc_post_forward.op = _mhc_post_forward.op
mhc_post_backward.op = _mhc_post_backward.op

# DTensor sharding (docs/distributed.md): per token (grad_post and grad_comb are per-token sums over d).
_mhc_post_forward.sharding({"x": "S0", "residual": "S0", "post_layer_mix": "S0", "comb_res_mix": "S0",
                            "returns": "S0"})
_mhc_post_forward_out.sharding({"x": "S0", "residual": "S0", "post_layer_mix": "S0", "comb_res_mix": "S0",
                                "out": "S0"})
_mhc_post_backward.sharding({"x": "S0", "residual": "S0", "post_layer_mix": "S0", "comb_res_mix": "S0",
                             "grad_out": "S0", "returns": ("S0", "S0", "S0", "S0")})
