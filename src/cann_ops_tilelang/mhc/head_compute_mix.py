"""The head's mix (sigmoid of the scaled, biased mixes), and its backward (docs/ops/mhc.md#head_compute_mix)."""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_float, check_tensor
from .._library import declare
from ._common import F32, HC_MULT, check_hc, same_device

__all__ = ["mhc_head_compute_mix_backward", "mhc_head_compute_mix_forward"]


def _check_input_mix(err: OpError, input_mix) -> tuple[int, ...]:
    im = check_tensor(err, "input_mix", input_mix, dtype=F32, ndim=2)
    check_hc(err, "input_mix", im.shape[1])
    return tuple(im.shape)


@declare("mhc_head_compute_mix_forward", mutates_args=("output_mix",), tokens="input_mix")
def mhc_head_compute_mix_forward(input_mix: Tensor, mhc_scale: Tensor, mhc_base: Tensor, output_mix: Tensor,
                                 pre_eps: float) -> None:
    """``output_mix = sigmoid(input_mix * scale[0] + base) + pre_eps``.

    Args:
        input_mix: ``(T, m)`` fp32.
        mhc_scale: ``(1,)`` fp32; mhc_base: ``(m,)`` fp32.
        output_mix: ``(T, m)`` fp32, written.
        pre_eps: >= 0.
    """
    err = OpError("mhc_head_compute_mix_forward")
    shape = _check_input_mix(err, input_mix)
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(1,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(HC_MULT,))
    check_tensor(err, "output_mix", output_mix, dtype=F32, shape=shape)
    check_float(err, "pre_eps", pre_eps, minimum=0.0)
    same_device(err, input_mix=input_mix, mhc_scale=mhc_scale, mhc_base=mhc_base, output_mix=output_mix)


@declare("mhc_head_compute_mix_backward",
         mutates_args=("grad_input_mix", "grad_mhc_scale_partial", "grad_mhc_base_partial"),
         vector_args={"grad_output_mix": 16, "input_mix": 16, "grad_input_mix": 16}, tokens="input_mix",
         zero_when_empty=("grad_mhc_scale_partial", "grad_mhc_base_partial"))
def mhc_head_compute_mix_backward(grad_output_mix: Tensor, input_mix: Tensor, mhc_scale: Tensor, mhc_base: Tensor,
                                  grad_input_mix: Tensor, grad_mhc_scale_partial: Tensor,
                                  grad_mhc_base_partial: Tensor) -> None:
    """Writes ``grad_input_mix = dz * scale`` and per-worker partial rows of the scale and base gradients
    (``dz = g * s * (1 - s)``, ``s`` the sigmoid); every row is written (zeros for ``T = 0``); reduce them with
    ``.sum(0)``.

    Args:
        grad_output_mix: ``(T, m)`` fp32.
        input_mix: ``(T, m)`` fp32; mhc_scale ``(1,)`` and mhc_base ``(m,)`` fp32 (the forward's inputs).
        grad_input_mix: ``(T, m)`` fp32, written.
        grad_mhc_scale_partial: ``(P, 1)`` fp32, overwritten; ``P >= 1`` rows (at most 4096 on CUDA,
            ``limits.MHC_HEAD_MIX_PARTIALS``).
        grad_mhc_base_partial: ``(P, m)`` fp32, overwritten.
    """
    err = OpError("mhc_head_compute_mix_backward")
    shape = _check_input_mix(err, input_mix)
    check_tensor(err, "grad_output_mix", grad_output_mix, dtype=F32, shape=shape)
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(1,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(HC_MULT,))
    check_tensor(err, "grad_input_mix", grad_input_mix, dtype=F32, shape=shape)
    part = check_tensor(err, "grad_mhc_scale_partial", grad_mhc_scale_partial, dtype=F32, ndim=2)
    if part.shape[1] != 1:
        raise err.value("grad_mhc_scale_partial", f"expected shape (P, 1), got {tuple(part.shape)}")
    limits.MHC_HEAD_MIX_PARTIALS.of(part.device.type).check(err, "grad_mhc_scale_partial", part.shape[0])
    check_tensor(err, "grad_mhc_base_partial", grad_mhc_base_partial, dtype=F32, shape=(part.shape[0], HC_MULT))
    same_device(err, grad_output_mix=grad_output_mix, input_mix=input_mix, mhc_scale=mhc_scale, mhc_base=mhc_base,
                grad_input_mix=grad_input_mix, grad_mhc_scale_partial=grad_mhc_scale_partial,
                grad_mhc_base_partial=grad_mhc_base_partial)


# DTensor sharding (docs/distributed.md): token-wise; the partial rows of the parameter gradients are
# sums over each rank's tokens, so the partial buffers are Partial (their row sum is the gradient).
mhc_head_compute_mix_forward.sharding({"input_mix": "S0", "output_mix": "S0"})
mhc_head_compute_mix_backward.sharding(
    {"grad_output_mix": "S0", "input_mix": "S0", "grad_input_mix": "S0", "grad_mhc_scale_partial": "P",
     "grad_mhc_base_partial": "P"})
