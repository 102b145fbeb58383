"""``mhc_multilayer_recompute``: every layer input and residual of a chunk of ``L`` sublayers regenerated from
the chunk's first residual and the small saved tensors, for activation recomputation
(docs/ops/mhc.md#multilayer_recompute).

Bitwise equal to the chain of :func:`mhc_pre_apply_mix_forward` and :func:`mhc_post_forward`.
"""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_tensor
from .._library import declare
from ._common import BF16, F32, HC_MULT, check_residual, same_device

__all__ = ["mhc_multilayer_recompute"]


def _check_list(err: OpError, arg: str, values, count: int, dtype, shape) -> None:
    if len(values) != count:
        raise err.value(arg, f"expected {count} tensors, got {len(values)}")
    for i, value in enumerate(values):
        check_tensor(err, f"{arg}[{i}]", value, dtype=dtype, shape=shape)


@declare("mhc_multilayer_recompute", mutates_args=("layer_input_list", "residual_list"),
         vector_args={"initial_residual": 16, "layer_output_list": 16, "layer_input_list": 16,
                      "residual_list": 16},
         tokens="initial_residual")
def mhc_multilayer_recompute(initial_residual: Tensor, pre_mix_list: list[Tensor], layer_output_list: list[Tensor],
                             post_mix_list: list[Tensor], comb_mix_list: list[Tensor],
                             layer_input_list: list[Tensor], residual_list: list[Tensor]) -> None:
    """Recomputes a chunk of ``L`` sublayers' inputs and ``Lp`` residuals (``Lp`` in ``{L - 1, L}``)::

        R = initial_residual
        for l in range(L):
            layer_input_list[l] = pre_apply_mix(R, pre_mix_list[l])
            if l < Lp:
                R = residual_list[l] = post(layer_output_list[l], R, post_mix_list[l], comb_mix_list[l])

    Args:
        initial_residual: ``(T, m, H)`` bf16, the chunk's first residual.
        pre_mix_list: ``L`` tensors ``(T, m)`` fp32, ``L`` in ``[1, 64]`` (``limits.MHC_RECOMPUTE_LAYERS``).
        layer_output_list: ``Lp`` tensors ``(T, H)`` bf16 (the sublayers' outputs).
        post_mix_list: ``Lp`` tensors ``(T, m)`` fp32.
        comb_mix_list: ``Lp`` tensors ``(T, m, m)`` fp32.
        layer_input_list: ``L`` tensors ``(T, H)`` bf16, written.
        residual_list: ``Lp`` tensors ``(T, m, H)`` bf16, written.
    """
    err = OpError("mhc_multilayer_recompute")
    tokens, hidden = check_residual(err, "initial_residual", initial_residual)
    layers, kept = len(pre_mix_list), len(layer_output_list)
    if layers < 1:
        raise err.value("pre_mix_list", "expected at least one layer, got an empty list")
    limits.MHC_RECOMPUTE_LAYERS.check(err, "pre_mix_list", layers)  # one kernel parameter per list element
    if kept not in (layers - 1, layers):
        raise err.value("layer_output_list", f"expected L - 1 or L = {layers} tensors (L: pre_mix_list), got {kept}")
    _check_list(err, "pre_mix_list", pre_mix_list, layers, F32, (tokens, HC_MULT))
    _check_list(err, "layer_output_list", layer_output_list, kept, BF16, (tokens, hidden))
    _check_list(err, "post_mix_list", post_mix_list, kept, F32, (tokens, HC_MULT))
    _check_list(err, "comb_mix_list", comb_mix_list, kept, F32, (tokens, HC_MULT, HC_MULT))
    _check_list(err, "layer_input_list", layer_input_list, layers, BF16, (tokens, hidden))
    _check_list(err, "residual_list", residual_list, kept, BF16, (tokens, HC_MULT, hidden))
    named = {"initial_residual": initial_residual}
    for arg, values in (("pre_mix_list", pre_mix_list), ("layer_output_list", layer_output_list),
                        ("post_mix_list", post_mix_list), ("comb_mix_list", comb_mix_list),
                        ("layer_input_list", layer_input_list), ("residual_list", residual_list)):
        named.update({f"{arg}[{i}]": t for i, t in enumerate(values)})
    same_device(err, **named)


# DTensor sharding (docs/distributed.md): every list element is token-wise; each code applies to every
# element of a list argument.
mhc_multilayer_recompute.sharding({"initial_residual": "S0", "pre_mix_list": "S0", "layer_output_list": "S0",
                                   "post_mix_list": "S0", "comb_mix_list": "S0", "layer_input_list": "S0",
                                   "residual_list": "S0"})
