"""The per-token-group cast to FP8 / FP4 with scales (docs/ops/quant.md#per_token_cast).

Op: ``per_token_cast(x, layout) -> (data, sf)``, the layout as its spec string; the Python function
:func:`quantize` takes a :class:`ScaleLayout` or its spec and returns a :class:`QuantTensor`.
"""

from torch import Tensor

from .._checks import OpError
from .._library import declare
from ._common import backend_of, check_layout, check_rows
from ._layout import QuantTensor, ScaleLayout

__all__ = ["per_token_cast", "quantize"]


@declare("per_token_cast", vector_args={"x": 16}, tokens="x", outputs=("data", "sf"))
def per_token_cast(x: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    """Casts each group of ``g`` consecutive channels of each row of ``x`` to e4m3 / e2m1 with one scale per group.

    Per group: ``a = max(max |x|, clamp)``, the scale ``s`` and its inverse ``inv`` from ``a`` as the layout says
    (fp32 ``a / max``, rounded up to a power of two, or e4m3), the data ``Q(fl(x * inv))`` (round to nearest even,
    saturating); docs/ops/quant.md#layout has the math, the clamps and the stored bytes.

    Args:
        x: ``(T, H)`` bf16 or fp32; rows may be strided (unit column stride, row stride a multiple of 16 bytes);
            ``H`` a multiple of 128 up to 32768 (``limits.QUANT_HIDDEN``); any ``T >= 0``.
        layout: a per-token ScaleLayout spec, ``"1x<g>/<e4m3|e2m1>/<fp32|e4m3|ue8m0>/<row|col_tma>/<round|exact>"``,
            ``g`` in {16, 32, 64, 128}.

    Returns:
        ``(data, sf)``: ``data`` ``(T, H)`` float8_e4m3fn, or ``(T, H / 2)`` uint8 (two e2m1 per byte, low nibble
        first); ``sf`` with ``layout.sf_shape / sf_dtype / sf_strides(T, H, backend)``, the backend that of
        ``x``'s device (CUDA on meta and CPU tensors: UE8M0 packed 4 per int32, col_tma padded to 16 bytes).
    """
    err = OpError("per_token_cast")
    tokens, hidden = check_rows(err, "x", x)
    spec = check_layout(err, "layout", layout, ("per_token",))
    return spec.empty_data(tokens, hidden, like=x), spec.empty_sf(tokens, hidden, backend_of(x), like=x)


# DTensor sharding (docs/distributed.md): token-wise, so the token dim of x, data and sf is sharded. A col_tma
# sf shard is the column-major scales of its rank's tokens (its own TMA padding), which is what that rank's GEMM
# reads; its full_tensor() is the same values, row-major.
per_token_cast.sharding({"x": "S0", "returns": ("S0", "S0")})


def quantize(x: Tensor, layout: ScaleLayout | str) -> QuantTensor:
    """``x (T, H)`` quantized to ``layout`` (a :class:`ScaleLayout` or its spec string): the ``QuantTensor(data, sf,
    layout)`` of :func:`per_token_cast` for a per-token layout (per-block and per-channel casts come with their ops).

    Raises ``TypeError`` / ``ValueError`` naming ``per_token_cast`` and the argument (``layout`` for a bad spec).
    """
    err = OpError("per_token_cast")
    spec = layout if isinstance(layout, ScaleLayout) else check_layout(err, "layout", layout, ("per_token",))
    if spec.kind != "per_token":
        raise err.value("layout", f"expected a per-token layout (the only cast with kernels yet), got {spec.spec!r} "
                                  f"(a per-{spec.kind[4:]} block {spec.block})")
    data, sf = per_token_cast(x, spec.spec)
    return QuantTensor(data, sf, spec)
