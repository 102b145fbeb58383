"""Dequantization of FP8 / FP4 data with its scales (docs/ops/quant.md#cast_back).

Op: ``cast_back(data, sf, layout, out_dtype) -> out``, the layout as its spec string: any layout kind
(per-token, per-block, per-channel), any scale storage (fp32, e4m3, UE8M0 words; row or col_tma).
"""

import torch
from torch import Tensor

from .. import limits
from .._checks import OpError, describe
from .._library import declare
from ._common import backend_of, check_layout
from ._layout import BLOCKS

__all__ = ["cast_back"]

OUT_DTYPES = (torch.bfloat16, torch.float32)


def check_sf(err: OpError, arg: str, sf, data: Tensor, layout, tokens: int, hidden: int, backend: str) -> None:
    """``sf`` has exactly the layout's dtype, shape and strides at ``(T, H)`` for ``backend`` (the strides of a dim
    of size 1, of a col_tma tensor of one row, and of an empty tensor, are free: torch leaves them so) and lives on
    ``data``'s device."""
    if not isinstance(sf, torch.Tensor):
        raise err.type(arg, f"expected a torch.Tensor, got {describe(sf)}")
    dtype = layout.sf_dtype(backend)
    if sf.dtype != dtype:
        raise err.type(arg, f"expected dtype {dtype} (layout {layout.spec} on {backend}), got {sf.dtype}")
    shape = tuple(layout.sf_shape(tokens, hidden, backend))
    if tuple(sf.shape) != shape:
        raise err.value(arg, f"expected shape {shape} (layout {layout.spec} of data ({tokens}, {hidden}) on "
                             f"{backend}), got {tuple(sf.shape)}")
    strides = layout.sf_strides(tokens, hidden, backend)
    # a col_tma tensor of one scale row reads its columns through their stride, whatever it is (compiled graphs
    # may re-stride such an input: torch treats the strides next to a size-1 dim as free)
    free = (True, shape[0] > 1 or layout.storage != "col_tma")
    if sf.numel() and any(shape[d] > 1 and free[d] and sf.stride(d) != strides[d] for d in range(2)):
        raise err.value(arg, f"expected strides {tuple(strides)} ({layout.storage} storage of layout {layout.spec} on "
                             f"{backend}), got {tuple(sf.stride())}")
    if sf.device != data.device:
        raise err.value(arg, f"expected a tensor on {data.device} (the device of 'data'), got {sf.device}")


# sf: the CUDA kernel reads per-channel scale rows in 16-byte vectors
@declare("cast_back", vector_args={"data": 16, "sf": 16}, tokens="data", outputs=("out",))
def cast_back(data: Tensor, sf: Tensor, layout: str, out_dtype: torch.dtype) -> Tensor:
    """Dequantizes ``data`` with its scales: ``out = out_dtype(fl(f32(data) * s))``, ``s`` the element's scale.

    One fp32 product and one rounding (to nearest even) per element: e4m3 data widened, e2m1 data unpacked (two per
    byte, low nibble first); ``s`` decoded from the storage: fp32 as is, e4m3 widened, a UE8M0 byte ``e`` as the fp32
    of bits ``e << 23``. docs/ops/quant.md#cast_back has the contract.

    Args:
        data: ``(T, H)`` float8_e4m3fn, or ``(T, H / 2)`` uint8 (e2m1), contiguous; ``H`` a multiple of 128 up to
            32768 (``limits.QUANT_HIDDEN``); any ``T >= 0``.
        sf: the scales of ``layout`` at ``(T, H)``: exactly ``layout.sf_shape / sf_strides / sf_dtype(T, H,
            backend)``, the backend that of ``data``'s device (CUDA on meta and CPU tensors).
        layout: a ScaleLayout spec of any kind, ``"<r>x<c>/<e4m3|e2m1>/<fp32|e4m3|ue8m0>/<row|col_tma>/<round|exact>"``.
        out_dtype: ``torch.bfloat16`` or ``torch.float32``.

    Returns:
        ``out`` ``(T, H)`` of ``out_dtype``, contiguous.
    """
    err = OpError("cast_back")
    spec = check_layout(err, "layout", layout, tuple(BLOCKS))
    if not isinstance(data, torch.Tensor):
        raise err.type("data", f"expected a torch.Tensor, got {describe(data)}")
    if data.dtype != spec.data_dtype:
        raise err.type("data", f"expected dtype {spec.data_dtype} (the data of layout {spec.spec}), got {data.dtype}")
    if data.dim() != 2:
        raise err.value("data", f"expected a 2-D tensor of shape (T, H{' / 2' if spec.fmt == 'e2m1' else ''}), got "
                                f"shape {tuple(data.shape)}")
    tokens, hidden = data.shape[0], spec.hidden_of(data)
    limits.QUANT_HIDDEN.check(err, "data", hidden)
    if not data.is_contiguous():
        raise err.value("data", f"expected a contiguous tensor, got strides {tuple(data.stride())}")
    if tokens * hidden > limits.QUANT_ELEMENTS.high:  # the kernels' 32-bit element offsets
        raise err.value("data", f"expected T * H below 2**31 elements, got {tokens} * {hidden}")
    backend = backend_of(data)
    check_sf(err, "sf", sf, data, spec, tokens, hidden, backend)
    if not isinstance(out_dtype, torch.dtype):
        raise err.type("out_dtype", f"expected a torch.dtype, torch.bfloat16 or torch.float32, got "
                                    f"{describe(out_dtype)}")
    if out_dtype not in OUT_DTYPES:
        raise err.value("out_dtype", f"expected torch.bfloat16 or torch.float32, got {out_dtype}")
    return data.new_empty((tokens, hidden), dtype=out_dtype)


# DTensor sharding (docs/distributed.md): token-wise. A rank's sf shard holds the scales of its own tokens (what a
# cast of its shard returns, its own col_tma padding, its own ragged last block row), so each rank dequantizes its
# shard locally.
cast_back.sharding({"data": "S0", "sf": "S0", "returns": "S0"})
