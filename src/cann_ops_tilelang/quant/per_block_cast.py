"""The per-block cast of weights to FP8 / FP4, one scale per ``r x c`` tile (docs/ops/quant.md#per_block_cast).

Ops: ``per_block_cast(x, layout) -> (data, sf)``, ``per_block_cast_sf(x, layout) -> sf`` (the scales alone, bitwise
those of the cast) and ``per_block_cast_with_sf(x, sf, layout) -> data`` (the data from given scales, ``inv = fl(1 /
s)``); the layout as its spec string, a per-block block ``(128, 128)`` or ``(32, 32)``.
"""

from torch import Tensor

from .._checks import OpError, describe
from .._library import declare
from ._common import backend_of, check_layout, check_rows

__all__ = ["per_block_cast", "per_block_cast_sf", "per_block_cast_with_sf"]

_KINDS = ("per_block",)


@declare("per_block_cast", vector_args={"x": 16}, tokens="x", outputs=("data", "sf"))
def per_block_cast(x: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """Casts each ``r x c`` tile of ``x`` to e4m3 / e2m1 with one scale per tile (weights; ``r = c = 128`` or 32).

    Per tile: ``a = max(max |x|, clamp)`` over its valid elements (a ragged last tile row: its rows ``< T``), the
    scale ``s`` and its inverse ``inv`` from ``a`` as the layout says (fp32 ``a / max``, rounded up to a power of
    two, or e4m3), the data ``Q(fl(x * inv))``; docs/ops/quant.md#layout has the math, the clamps and the bytes.

    Args:
        x: ``(T, H)`` bf16 or fp32; rows may be strided (unit column stride, row stride a multiple of 16 bytes);
            ``H`` a multiple of 128 up to 32768 (``limits.QUANT_HIDDEN``); any ``T >= 0``.
        layout: a per-block ScaleLayout spec, ``"<r>x<r>/<e4m3|e2m1>/<fp32|e4m3|ue8m0>/<row|col_tma>/<round|exact>"``,
            ``r`` 128 or 32.

    Returns:
        ``(data, sf)``: ``data`` ``(T, H)`` float8_e4m3fn or ``(T, H / 2)`` uint8 (two e2m1 per byte, low nibble
        first); ``sf`` ``(ceil(T / r), H / c)`` scales with ``layout.sf_shape / sf_dtype / sf_strides(T, H,
        backend)``, the backend that of ``x``'s device (CUDA on meta and CPU tensors: UE8M0 packed 4 per int32
        along H, col_tma padded to 16 bytes).
    """
    err = OpError("per_block_cast")
    tokens, hidden = check_rows(err, "x", x)
    spec = check_layout(err, "layout", layout, _KINDS)
    return spec.empty_data(tokens, hidden, like=x), spec.empty_sf(tokens, hidden, backend_of(x), like=x)


@declare("per_block_cast_sf", vector_args={"x": 16}, tokens="x", outputs=("sf",))
def per_block_cast_sf(x: Tensor, layout: str) -> Tensor:
    """The scales of :func:`per_block_cast` alone (bitwise its ``sf``; no data is written).

    Args:
        x: ``(T, H)`` bf16 or fp32, as for :func:`per_block_cast`.
        layout: a per-block ScaleLayout spec.

    Returns:
        ``sf`` with ``layout.sf_shape / sf_dtype / sf_strides(T, H, backend)`` (docs/ops/quant.md#per_block_cast).
    """
    err = OpError("per_block_cast_sf")
    tokens, hidden = check_rows(err, "x", x)
    spec = check_layout(err, "layout", layout, _KINDS)
    return spec.empty_sf(tokens, hidden, backend_of(x), like=x)


@declare("per_block_cast_with_sf", vector_args={"x": 16}, tokens="x", outputs=("data",))
def per_block_cast_with_sf(x: Tensor, sf: Tensor, layout: str) -> Tensor:
    """Casts ``x`` with precomputed per-block scales: ``data = Q(fl(x * inv))``, ``inv = fl(1 / s)`` with ``s`` the
    tile's scale decoded from ``sf`` (fp32 as is, e4m3 widened, a UE8M0 byte ``e`` as ``2^(e - 127)``).

    Args:
        x: ``(T, H)`` bf16 or fp32, as for :func:`per_block_cast`.
        sf: the scales in ``layout`` for ``x``'s backend: ``layout.sf_shape / sf_dtype / sf_strides(T, H,
            backend)`` (``col_tma``: the transposed view of its padded buffer, as :func:`per_block_cast` returns it).
            With ``round_sf`` each scale is expected a power of two (its values are not checked).
        layout: a per-block ScaleLayout spec.

    Returns:
        ``data`` ``(T, H)`` float8_e4m3fn or ``(T, H / 2)`` uint8 (docs/ops/quant.md#per_block_cast).
    """
    err = OpError("per_block_cast_with_sf")
    tokens, hidden = check_rows(err, "x", x)
    spec = check_layout(err, "layout", layout, _KINDS)
    backend = backend_of(x)
    if not isinstance(sf, Tensor):
        raise err.type("sf", f"expected a torch.Tensor, got {describe(sf)}")
    if sf.device != x.device:
        raise err.value("sf", f"expected a tensor on x's device {x.device}, got one on {sf.device}")
    if sf.dim() != 2:
        raise err.value("sf", f"expected a 2-D tensor of shape {tuple(spec.sf_shape(tokens, hidden, backend))} "
                              f"(layout {spec.spec}, x ({tokens}, {hidden})), got shape {tuple(sf.shape)}")
    try:
        spec.check_sf(sf, tokens, hidden, backend)
    except (TypeError, ValueError) as exc:  # "ScaleLayout <spec>: sf must ...; got ...": said by this op instead
        what = str(exc).removeprefix(f"ScaleLayout {spec.spec}: ")
        raise (err.type if isinstance(exc, TypeError) else err.value)(
            "sf", f"expected the scales of layout {spec.spec} ({what})") from None
    return spec.empty_data(tokens, hidden, like=x)


# DTensor sharding (docs/distributed.md): a tile spans r tokens and c channels, so a shard of either dim computes
# other scales unless its bounds fall on tile bounds (nothing guarantees that): replicated only.
per_block_cast.sharding()
per_block_cast_sf.sharding()
per_block_cast_with_sf.sharding()
