"""The MLP's SwiGLU activation, forward and backward, with an optional fused per-token cast
(docs/ops/norm.md#swiglu).

Ops: ``swiglu_forward(x, ...) -> (y, data, sf)`` and ``swiglu_backward(grad_y, x, ...) -> (grad_x,
grad_routing_weight, y, data, sf)``. ``x (..., 2H)`` is ``[gate | up]``; options: a per-row routing weight times
``routed_scaling_factor``, the DeepSeek-V4 clamp (with counters of the clamped elements), expert segments given by
prefix sums padded to an alignment (padding rows are zero), the per-token cast of the result, and (backward) the
forward recomputed and a per-token quantized ``x``.
"""

from typing import Optional

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, check_bool, check_float, check_int, check_same_device, check_tensor, describe
from .._library import declare
from ..quant._common import check_layout
from ..quant.cast_back import check_sf
from ..quant.per_token_cast import per_token_cast
from ._common import F32, absent_cast, backend_of, cast_outputs, check_cast_layout, check_rows

__all__ = ["swiglu_backward", "swiglu_forward"]

# the dtype of the prefix sums of tokens per expert and of the clamp counters
OFFSET_DTYPE, COUNT_DTYPE = torch.int32, torch.int64
# the clamp counters: gate > c, up > c, up < -c, the elements counted
COUNTERS = 4
# the data format of a quantized x (the peer's FP8 input)
QUANTIZED_FMT = "e4m3"


def expert_rows(expert_offsets: Tensor, tokens: int, alignment: int) -> Tensor:
    """int32 ``(T,)`` on the device of ``expert_offsets``: 1 on the rows of the expert segments
    (``[align(offsets[e - 1], alignment), offsets[e])``), 0 on padding rows; device ops only (no host sync), for
    the launchers of both backends."""
    rows = torch.arange(tokens, dtype=OFFSET_DTYPE, device=expert_offsets.device)
    expert = torch.searchsorted(expert_offsets, rows, right=True)  # the first segment ending after the row
    ends = torch.cat([expert_offsets.new_zeros(1), expert_offsets])
    start = (ends[expert] + (alignment - 1)) // alignment * alignment  # its first row
    return ((expert < expert_offsets.shape[0]) & (rows >= start)).to(OFFSET_DTYPE)


def cast_into(rows2d: Tensor, layout: str, data: Tensor, sf: Tensor) -> None:
    """The Ascend launchers' cast of the rounded result's rows ``rows2d (T, W)`` into the op's ``data`` / ``sf``:
    the quant family's ``per_token_cast`` op (its kernel, on the current stream), copied (not fused there yet)."""
    got_data, got_sf = per_token_cast(rows2d, layout)
    data.copy_(got_data)
    sf.copy_(got_sf)


def _check_options(err: OpError, x: Tensor, tokens: int, routing_weight, routed_scaling_factor, clamp,
                   expert_offsets, alignment) -> None:
    """The per-row routing weight (fp32 ``(T,)``), its factor (1.0 without it), the clamp (``> 0``) and the expert
    segments (int32 ``(E,)`` prefix sums, ``E >= 1``; ``alignment >= 1``)."""
    if routing_weight is not None:
        check_tensor(err, "routing_weight", routing_weight, dtype=F32, shape=(tokens,))
    factor = check_float(err, "routed_scaling_factor", routed_scaling_factor, minimum=-float("inf"))
    if routing_weight is None and not isinstance(factor, torch.SymFloat) and factor != 1.0:
        raise err.value("routed_scaling_factor", f"expected 1.0 without a routing_weight (it scales the routing "
                                                 f"weight), got {factor}")
    if clamp is not None:
        check_float(err, "clamp", clamp, minimum=0.0, inclusive=False)
    if expert_offsets is not None:
        check_tensor(err, "expert_offsets", expert_offsets, dtype=OFFSET_DTYPE, ndim=1)
        if expert_offsets.shape[0] < 1:
            raise err.value("expert_offsets", "expected the prefix sums of at least one expert, got shape (0,)")
    limits.IntRange("an alignment", 1, None).check(err, "alignment", check_int(err, "alignment", alignment))
    check_same_device(err, [("x", x), ("routing_weight", routing_weight), ("expert_offsets", expert_offsets)])


def _check_cast(err: OpError, layout, hidden: int, width: int):
    """The per-token layout of the fused cast of rows of ``width`` channels (``H`` or ``2 H``) whose group divides
    ``H`` (no group straddles the gate and up halves); on Ascend the cast is the quant family's per-token cast,
    whose row widths are ``limits.QUANT_HIDDEN``, and both backends take the same arguments."""
    spec = check_cast_layout(err, "layout", layout, hidden)
    if width not in limits.QUANT_HIDDEN:
        raise err.value("layout", f"expected a cast of rows of {limits.QUANT_HIDDEN.describe()} channels (the "
                                  f"per-token cast's), got rows of {width}")
    return spec


@declare("swiglu_forward", mutates_args=("clamped_count",), vector_args={"x": 16}, tokens="x",
         outputs=("y", "data", "sf"))
def swiglu_forward(x: Tensor, routing_weight: Optional[Tensor] = None, routed_scaling_factor: float = 1.0,
                   clamp: Optional[float] = None, clamped_count: Optional[Tensor] = None,
                   expert_offsets: Optional[Tensor] = None, alignment: int = 128, layout: Optional[str] = None,
                   with_y: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``y = silu(g) * u * (routing_weight * routed_scaling_factor)`` of the halves ``x = [g | u]``, with the
    optional clamp, expert padding and fused cast (docs/ops/norm.md#swiglu has the math and its order).

    Args:
        x: ``(..., 2 H)`` bf16 or fp32, ``[gate | up]``; rows may be strided (unit column stride, row stride a
            multiple of 16 bytes); ``H`` a multiple of 64 up to 32768 (``limits.NORM_HIDDEN``); any ``T >= 0``.
        routing_weight: None, or fp32 ``(T,)`` contiguous, one weight per row.
        routed_scaling_factor: the factor of the routing weight (1.0 without one).
        clamp: None, or ``c > 0``: ``g <= c`` and ``-c <= u <= c`` before the activation.
        clamped_count: None, or int64 ``(4,)`` contiguous (with ``clamp``), accumulated in place:
            ``[#g > c, #u > c, #u < -c, #elements]`` over the rows of the expert segments (all rows without them).
        expert_offsets: None, or int32 ``(E,)`` contiguous, the prefix sums of tokens per expert: expert ``e``'s
            rows are ``[align(offsets[e - 1], alignment), offsets[e])``, the other rows are padding (``y`` zero).
        alignment: the alignment of each expert's first row (with ``expert_offsets``).
        layout: None, or a per-token ScaleLayout spec whose group divides ``H`` (``H`` a multiple of 128): the
            per-token cast of ``y``'s rows ``(T, H)``.
        with_y: with a layout, return ``y`` too.

    Returns:
        ``(y, data, sf)``: ``y`` ``(..., H)`` of ``x``'s dtype (``(0,)`` with a layout and without ``with_y``);
        ``data`` / ``sf`` the cast of ``y`` (``per_token_cast(rows(y), layout)``), or ``(0,)`` without a layout.
    """
    err = OpError("swiglu_forward")
    tokens, hidden = check_rows(err, "x", x, factor=2)
    _check_options(err, x, tokens, routing_weight, routed_scaling_factor, clamp, expert_offsets, alignment)
    if clamped_count is not None:
        check_tensor(err, "clamped_count", clamped_count, dtype=COUNT_DTYPE, shape=(COUNTERS,))
        check_same_device(err, [("x", x), ("clamped_count", clamped_count)])
        if clamp is None:
            raise err.value("clamped_count", "expected a clamp with the clamp counters, got clamp=None")
    check_bool(err, "with_y", with_y)
    y_shape = (*x.shape[:-1], hidden)
    if layout is None:
        return x.new_empty(y_shape), *absent_cast(x)
    spec = _check_cast(err, layout, hidden, hidden)
    y = x.new_empty(y_shape) if with_y else x.new_empty((0,))
    return y, *cast_outputs(spec, tokens, hidden, x)


# DTensor sharding (docs/distributed.md): row-wise; the clamp counters are a sum over rows (P). Expert segments
# number the rows of the whole tensor: a token-sharded call with expert_offsets is not expressible (pass it
# replicated tensors).
swiglu_forward.sharding({"x": "S0", "routing_weight": "S0", "clamped_count": "P", "returns": ("S0", "S0", "S0")})


def _check_quantized_x(err: OpError, x, x_sf, x_layout) -> tuple[int, int]:
    """A per-token quantized ``x``: e4m3 data ``(T, 2 H)`` contiguous with its scales ``x_sf`` in ``x_layout``.
    Returns ``(T, H)``."""
    if x_sf is None or x_layout is None:
        missing, given = ("x_sf", "x_layout") if x_sf is None else ("x_layout", "x_sf")
        raise err.value(missing, f"expected both x_sf and x_layout (a quantized x) or neither, got {given} without "
                                 f"{missing}")
    spec = check_layout(err, "x_layout", x_layout, ("per_token",))
    if spec.fmt != QUANTIZED_FMT:
        raise err.value("x_layout", f"expected an {QUANTIZED_FMT} layout, got {x_layout!r}")
    check_tensor(err, "x", x, dtype=spec.data_dtype, shape=("T", "2 H"))
    tokens, width = x.shape
    if width % 2:
        raise err.value("x", f"expected a last dim of 2 H, got {width}")
    limits.NORM_HIDDEN.check(err, "x", width // 2)
    limits.QUANT_HIDDEN.check(err, "x", width)
    limits.NORM_ELEMENTS.check(err, "x", tokens * width)
    check_sf(err, "x_sf", x_sf, x, spec, tokens, width, backend_of(x))
    return tokens, width // 2


@declare("swiglu_backward", vector_args={"grad_y": 16, "x": 16}, tokens="x",
         outputs=("grad_x", "grad_routing_weight", "y", "data", "sf"))
def swiglu_backward(grad_y: Tensor, x: Tensor, routing_weight: Optional[Tensor] = None,
                    routed_scaling_factor: float = 1.0, clamp: Optional[float] = None,
                    expert_offsets: Optional[Tensor] = None, alignment: int = 128, recompute: bool = False,
                    x_sf: Optional[Tensor] = None, x_layout: Optional[str] = None,
                    layout: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`swiglu_forward`: ``grad_x = [grad_g | grad_u]`` (zero where the clamp clamped and
    on padding rows) and ``grad_routing_weight = routed_scaling_factor * sum_h grad_y * silu(g) * u``
    (docs/ops/norm.md#swiglu has the formulas and their order).

    Args:
        grad_y: ``(..., H)`` of ``grad_x``'s dtype (``x``'s; bf16 for a quantized ``x``), rows as ``x``'s.
        x: ``(..., 2 H)`` bf16 or fp32 ``[gate | up]`` (rows as for :func:`swiglu_forward`), or with ``x_sf`` /
            ``x_layout`` per-token quantized e4m3 data ``(T, 2 H)``, contiguous, dequantized as ``cast_back``
            does (``fl(f32(data) * s)``).
        routing_weight, routed_scaling_factor, clamp, expert_offsets, alignment: as for :func:`swiglu_forward`.
        recompute: also return the forward's ``y``.
        x_sf: None, or the scales of ``x`` in ``x_layout`` (its shape, strides and dtype for ``x``'s backend).
        x_layout: None, or a per-token e4m3 ScaleLayout spec (given with ``x_sf``: both or neither).
        layout: None, or a per-token ScaleLayout spec whose group divides ``H``: the per-token cast of
            ``grad_x``'s rows ``(T, 2 H)``.

    Returns:
        ``(grad_x, grad_routing_weight, y, data, sf)``: ``grad_x`` ``(..., 2 H)``; ``grad_routing_weight`` fp32
        ``(T,)`` (with a routing weight) or ``(0,)``; ``y`` ``(..., H)`` of ``grad_x``'s dtype with ``recompute``,
        else ``(0,)``; ``data`` / ``sf`` the cast of ``grad_x`` (``per_token_cast(rows(grad_x), layout)``) or
        ``(0,)``.
    """
    err = OpError("swiglu_backward")
    if x_sf is None and x_layout is None:
        tokens, hidden = check_rows(err, "x", x, factor=2)
        dtype = x.dtype
    else:
        tokens, hidden = _check_quantized_x(err, x, x_sf, x_layout)
        dtype = torch.bfloat16
    lead = tuple(x.shape[:-1])
    if not isinstance(grad_y, torch.Tensor):
        raise err.type("grad_y", f"expected a torch.Tensor, got {describe(grad_y)}")
    if grad_y.dtype != dtype:
        raise err.type("grad_y", f"expected dtype {dtype} (grad_x's), got {grad_y.dtype}")
    if tuple(grad_y.shape) != (*lead, hidden):
        raise err.value("grad_y", f"expected shape {(*lead, hidden)} (x's rows of H = {hidden}), got "
                                  f"{tuple(grad_y.shape)}")
    check_rows(err, "grad_y", grad_y, dtypes=(dtype,))
    check_same_device(err, [("x", x), ("grad_y", grad_y)])
    _check_options(err, x, tokens, routing_weight, routed_scaling_factor, clamp, expert_offsets, alignment)
    check_bool(err, "recompute", recompute)
    grad_x = grad_y.new_empty((*lead, 2 * hidden))
    # fp32 present or absent: the kernels' parameter is fp32 either way
    grad_routing_weight = grad_y.new_empty((tokens if routing_weight is not None else 0,), dtype=F32)
    y = grad_y.new_empty((*lead, hidden)) if recompute else grad_y.new_empty((0,))
    if layout is None:
        return grad_x, grad_routing_weight, y, *absent_cast(grad_y)
    spec = _check_cast(err, layout, hidden, 2 * hidden)
    return grad_x, grad_routing_weight, y, *cast_outputs(spec, tokens, 2 * hidden, grad_y)


swiglu_backward.sharding({"grad_y": "S0", "x": "S0", "x_sf": "S0", "routing_weight": "S0",
                          "returns": ("S0", "S0", "S0", "S0", "S0")})
