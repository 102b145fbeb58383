"""FP8 linear layer with the DeepSeek-V3 recipe (docs/ops/quant.md#fp8_linear): :func:`fp8_linear` and
:class:`FP8Linear`.

Forward: activations cast per token group ``1x128`` (``per_token_cast``), the weight per ``128x128`` block
(``per_block_cast``), one block-scaled FP8 GEMM. Backward: the output gradient cast per token group, ``grad_x`` by
the same GEMM against the transposed FP8 weight; ``grad_weight = grad_out^T @ x`` and ``grad_bias`` in the
activations' precision (not FP8). The GEMM is ``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` x
``BlockWise128x128`` scales where the installed PyTorch has it on the GPU (``gemm="scaled_mm"``), else the
dequantizing fallback (``gemm="dequant"``: both operands decoded to fp32 with their scales, one fp32 matmul).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import limits
from .._checks import OpError, describe
from ..quant import per_block_cast, per_token_cast
from ._buffers import flat_tokens, restore

__all__ = ["ACTIVATION_LAYOUT", "FP8Linear", "GEMMS", "WEIGHT_LAYOUT", "fp8_linear", "fp8_linear_gemm"]

_OP = "modeling.fp8_linear"
# activations and output gradients: fp32 scales per 128 channels, column-major with a padded leading dim (the
# GEMM's scale_a layout); weights: fp32 scales per 128x128 block, row-major (transposed, the GEMM's scale_b)
ACTIVATION_LAYOUT = "1x128/e4m3/fp32/col_tma/exact"
WEIGHT_LAYOUT = "128x128/e4m3/fp32/row/exact"
GEMMS = ("auto", "scaled_mm", "dequant")
_BLOCK = 128


@torch.compiler.assume_constant_result  # a constant under torch.compile (this imports Dynamo: modeling loads us lazily)
def _gemm_of(device_type: str, index: Optional[int]) -> str:
    """``"scaled_mm"`` where ``F.scaled_mm`` has block-wise FP8 scales (a PyTorch with the API on an SM90 or SM100
    GPU), else ``"dequant"``."""
    if device_type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return "dequant"
    index = torch.cuda.current_device() if index is None else index
    return "scaled_mm" if torch.cuda.get_device_capability(index)[0] in (9, 10) else "dequant"


def fp8_linear_gemm(device: torch.device | str) -> str:
    """The GEMM ``gemm="auto"`` takes on ``device``: ``"scaled_mm"`` or ``"dequant"``."""
    device = torch.device(device)
    return _gemm_of(device.type, device.index)


def _decode(data: Tensor, sf: Tensor, block: tuple[int, int]) -> Tensor:
    """fp32 values of e4m3 ``data (R, C)`` with fp32 scales of ``block`` (ragged last block row)."""
    rows, cols = data.shape
    scale = sf.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return data.float() * scale


def _block_gemm(a: Tensor, a_sf: Tensor, b: Tensor, b_sf: Tensor, out_dtype: torch.dtype, gemm: str) -> Tensor:
    """``a @ b^T`` of ``a (M, K)`` e4m3 with ``1x128`` scales ``a_sf (M, K/128)`` (column-major) and ``b (N, K)``
    e4m3 with ``128x128`` scales ``b_sf (N/128, K/128)``, accumulated in fp32, as ``out_dtype``."""
    if a.shape[0] == 0:
        return a.new_zeros(0, b.shape[0], dtype=out_dtype)
    if gemm == "dequant":
        with torch.autocast(a.device.type, enabled=False):  # an fp32 product, also inside an autocast region
            return (_decode(a, a_sf, (1, _BLOCK)) @ _decode(b, b_sf, (_BLOCK, _BLOCK)).t()).to(out_dtype)
    kb = b_sf.shape[1]
    if kb % 4 or b_sf.stride() != (kb, 1):  # the GEMM reads b's scales column-major with a 16-byte leading dim
        padded = b_sf.new_zeros(b_sf.shape[0], -(-kb // 4) * 4)
        padded[:, :kb] = b_sf
        b_sf = padded[:, :kb]
    return F.scaled_mm(a, b.t(), a_sf, F.ScalingType.BlockWise1x128, b_sf.t(), F.ScalingType.BlockWise128x128,
                       output_dtype=out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], gemm: str) -> Tensor:
        x_data, x_sf = per_token_cast(x, ACTIVATION_LAYOUT)
        w_data, w_sf = per_block_cast(weight, WEIGHT_LAYOUT)
        if bias is None:
            out = _block_gemm(x_data, x_sf, w_data, w_sf, x.dtype, gemm)
        else:  # the bias joins the fp32 accumulator: one rounding to x's dtype
            out = (_block_gemm(x_data, x_sf, w_data, w_sf, torch.float32, gemm) + bias.float()).to(x.dtype)
        ctx.save_for_backward(x, w_data, w_sf)
        ctx.gemm, ctx.weight_dtype = gemm, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, w_data, w_sf = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        grad_out = grad_out.contiguous()
        if ctx.needs_input_grad[0]:
            g_data, g_sf = per_token_cast(grad_out, ACTIVATION_LAYOUT)
            # W^T (K, N) per 128x128 block: the same blocks, so the same scales transposed
            grad_x = _block_gemm(g_data, g_sf, w_data.t().contiguous(), w_sf.t(), x.dtype, ctx.gemm)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out.t() @ x.to(grad_out.dtype)).to(ctx.weight_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_out.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None


def _check(err: OpError, x, weight, bias, gemm) -> None:
    for name, value in (("x", x), ("weight", weight)):
        if not isinstance(value, Tensor):
            raise err.type(name, f"expected a torch.Tensor, got {describe(value)}")
        if value.dtype not in (torch.bfloat16, torch.float32):
            raise err.type(name, f"expected dtype torch.bfloat16 or torch.float32, got {value.dtype}")
    if x.dim() < 1:
        raise err.value("x", f"expected shape (*, K), got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise err.value("weight", f"expected shape (N, K) with K = x.shape[-1] = {x.shape[-1]}, got shape "
                                  f"{tuple(weight.shape)}")
    if not torch.compiler.is_compiling():  # traced: the casts check K (Dynamo cannot trace the range check)
        limits.QUANT_HIDDEN.check(err, "x", x.shape[-1])
    if weight.shape[0] % _BLOCK or weight.shape[0] == 0:
        raise err.value("weight", f"expected N (out features) a positive multiple of {_BLOCK}, got shape "
                                  f"{tuple(weight.shape)}")
    if weight.device != x.device:
        raise err.value("weight", f"expected a tensor on x's device {x.device}, got {weight.device}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise err.type("bias", f"expected a torch.Tensor or None, got {describe(bias)}")
        if tuple(bias.shape) != (weight.shape[0],) or bias.device != x.device:
            raise err.value("bias", f"expected shape ({weight.shape[0]},) on {x.device}, got shape "
                                    f"{tuple(bias.shape)} on {bias.device}")
    if gemm not in GEMMS:
        raise err.value("gemm", f"expected one of {GEMMS}, got {gemm!r}")


def fp8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, gemm: str = "auto") -> Tensor:
    """``x @ weight^T + bias`` through FP8 (docs/ops/quant.md#fp8_linear), differentiable in all three.

    Args:
        x: ``(*, K)`` bf16 or fp32, ``K`` a multiple of 128 in ``limits.QUANT_HIDDEN``; any number of tokens.
        weight: ``(N, K)`` bf16 or fp32 (a master weight may be fp32), ``N`` a multiple of 128.
        bias: ``(N,)`` or None, added to the fp32 product before its one rounding to ``x``'s dtype.
        gemm: ``"auto"`` (``fp8_linear_gemm(x.device)``), ``"scaled_mm"`` or ``"dequant"``.

    Returns:
        ``(*, N)`` in ``x``'s dtype. Gradients: ``grad_x`` through the FP8 GEMM (the output gradient cast per
        ``1x128`` group), ``grad_weight = grad_out^T @ x`` in ``x``'s dtype returned as ``weight``'s dtype,
        ``grad_bias`` the fp32 sum over tokens (in ``bias``'s dtype).
    """
    err = OpError(_OP)
    _check(err, x, weight, bias, gemm)
    if gemm == "auto":
        gemm = fp8_linear_gemm(x.device)
    lead = tuple(x.shape[:-1])
    flat, back = flat_tokens(x, lead, x.shape[-1])
    return restore(_FP8Linear.apply(flat, weight, bias, gemm).view(*lead, weight.shape[0]), back)


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose product runs through :func:`fp8_linear` (its parameters, initialization and state dict are
    ``nn.Linear``'s; ``in_features`` and ``out_features`` multiples of 128). On an Ascend NPU it runs the
    dequantizing GEMM and is untested (no NPU here)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 gemm: str = "auto"):
        err = OpError("modeling.FP8Linear")
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % _BLOCK:
                raise err.value(name, f"expected a positive multiple of {_BLOCK}, got {value!r}")
        if gemm not in GEMMS:
            raise err.value("gemm", f"expected one of {GEMMS}, got {gemm!r}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.gemm = gemm

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, gemm=self.gemm)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gemm={self.gemm!r}"
