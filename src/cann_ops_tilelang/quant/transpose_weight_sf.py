"""Weight scales to DeepGEMM's packed UE8M0 pairs (docs/ops/quant.md#transpose_weight_sf).

Op: ``transpose_weight_sf(sf, block_size, transpose_sf1) -> [sf0_0, sf1_0, sf0_1, sf1_1, ...]`` (a custom op returns
a flat list of tensors, not a list of pairs); the Python function :func:`transpose_weight_sf_pairs` returns the
list of ``(sf0, sf1)`` pairs.
"""

import torch
from torch import Tensor

from .._checks import OpError, check_bool, check_int, describe
from .._library import declare
from ._common import backend_of
from ._layout import UE8M0_WORDS

__all__ = ["transpose_weight_sf", "transpose_weight_sf_pairs"]

# the weight blocks whose scales are transposed (the peer's), and the multiple N and K must be of
WEIGHT_BLOCKS = (32, 128)
WEIGHT_ALIGN = 128


def _ceil_div(a, b):
    return -(-a // b)


def weight_sf_outputs(weight_sf: Tensor, block_size: int, transpose_sf1: bool, backend: str):
    """The new ``(sf0, sf1)`` of one weight's scales (uninitialized, on ``weight_sf``'s device): ``sf0 (G, N, W0)``
    strides ``(W0 N, 1, N)``, ``sf1 (G, K, W1)`` strides ``(W1 K, 1, K)`` or ``(G, W1, K)`` contiguous with
    ``transpose_sf1``; 2-D scales give 2-D outputs (``G`` dropped)."""
    pack, word = UE8M0_WORDS[backend]
    nn, nk = weight_sf.shape[-2:]
    n, k = nn * block_size, nk * block_size
    lead = tuple(weight_sf.shape[:-2])
    sf0 = weight_sf.new_empty((*lead, _ceil_div(nk, pack), n), dtype=word).transpose(-1, -2)
    sf1 = weight_sf.new_empty((*lead, _ceil_div(nn, pack), k), dtype=word)
    return sf0, sf1 if transpose_sf1 else sf1.transpose(-1, -2)


@declare("transpose_weight_sf", outputs=("outs",))
def transpose_weight_sf(sf: list[Tensor], block_size: int, transpose_sf1: bool) -> list[Tensor]:
    """The UE8M0 exponent bytes of each weight's power-of-two scales, packed along K for each weight row (``sf0``)
    and along N for each weight column (``sf1``): what DeepGEMM loads for the weight and its transpose.

    Each scale's byte is ``(bits >> 23) & 0xFF`` (a mantissa or a sign is dropped); bytes past the last scale of a
    word are 0. docs/ops/quant.md#transpose_weight_sf has the layout.

    Args:
        sf: one tensor per weight: fp32 scales ``(N / b, K / b)`` or grouped ``(G, N / b, K / b)`` of a weight
            ``(N, K)``, contiguous, all on one device; ``N`` and ``K`` positive multiples of 128; at least one.
        block_size: ``b``, the weight's scale block, 32 or 128.
        transpose_sf1: return every ``sf1`` as its row-major buffer ``(G, ceil(N / b / p), K)`` instead of the
            column-major ``(G, K, ceil(N / b / p))``.

    Returns:
        ``[sf0_0, sf1_0, sf0_1, sf1_1, ...]``, words of ``p`` bytes: int32 (``p = 4``) on CUDA, meta and CPU tensors,
        int16 (``p = 2``) on Ascend. ``sf0 (G, N, ceil(K / b / p))`` strides ``(., 1, N)``; ``sf1 (G, K, ceil(N / b /
        p))`` strides ``(., 1, K)``, or ``(G, ceil(N / b / p), K)`` contiguous with ``transpose_sf1``.
    """
    err = OpError("transpose_weight_sf")
    block_size = check_int(err, "block_size", block_size)
    if block_size not in WEIGHT_BLOCKS:
        raise err.value("block_size", f"expected one of {WEIGHT_BLOCKS}, got {block_size}")
    check_bool(err, "transpose_sf1", transpose_sf1)
    if not isinstance(sf, (list, tuple)):
        raise err.type("sf", f"expected a list of torch.Tensor, got {describe(sf)}")
    if len(sf) == 0:
        raise err.value("sf", "expected at least one tensor (transpose_weight_sf_pairs takes an empty list), got []")
    for i, weight_sf in enumerate(sf):
        arg = f"sf[{i}]"
        if not isinstance(weight_sf, torch.Tensor):
            raise err.type(arg, f"expected a torch.Tensor, got {describe(weight_sf)}")
        if weight_sf.dtype != torch.float32:
            raise err.type(arg, f"expected dtype torch.float32 (power-of-two scales), got {weight_sf.dtype}")
        if weight_sf.dim() not in (2, 3):
            raise err.value(arg, f"expected a 2-D (N/b, K/b) or 3-D (G, N/b, K/b) tensor, got shape "
                                 f"{tuple(weight_sf.shape)}")
        nn, nk = weight_sf.shape[-2:]
        for what, count in (("N", nn), ("K", nk)):
            if count < 1 or (count * block_size) % WEIGHT_ALIGN:
                raise err.value(arg, f"expected {what} = {what}/b * {block_size} a positive multiple of "
                                     f"{WEIGHT_ALIGN}, got shape {tuple(weight_sf.shape)} ({what} = "
                                     f"{count * block_size})")
        if not weight_sf.is_contiguous():
            raise err.value(arg, f"expected a contiguous tensor, got strides {tuple(weight_sf.stride())}")
        if weight_sf.device != sf[0].device:
            raise err.value(arg, f"expected a tensor on {sf[0].device} (the device of 'sf[0]'), got "
                                 f"{weight_sf.device}")
    backend = backend_of(sf[0])
    return [out for weight_sf in sf for out in weight_sf_outputs(weight_sf, block_size, transpose_sf1, backend)]


# DTensor sharding (docs/distributed.md): none. The outputs' words pack 2 or 4 scale blocks, which a split of N or K
# between ranks would cut; and the all-Replicate fallback cannot be declared either: the op returns one Tensor[] whose
# length follows the input list, for which DTensor's propagation (one placement per schema return) has no output spec.
transpose_weight_sf.sharding(unsupported="it returns a Tensor[] (one placement per schema return cannot describe "
                                         "it) and its words would straddle a split of N or K: pass the scales "
                                         "gathered (DTensor.full_tensor())")


def transpose_weight_sf_pairs(sf: list[Tensor], block_size: int, transpose_sf1: bool) -> list[tuple[Tensor, Tensor]]:
    """:func:`transpose_weight_sf` as one ``(sf0, sf1)`` pair per weight (``[]`` for no weights)."""
    if isinstance(sf, (list, tuple)) and len(sf) == 0:  # no weights: the scalar arguments are checked alike
        err = OpError("transpose_weight_sf")
        if check_int(err, "block_size", block_size) not in WEIGHT_BLOCKS:
            raise err.value("block_size", f"expected one of {WEIGHT_BLOCKS}, got {block_size}")
        check_bool(err, "transpose_sf1", transpose_sf1)
        return []
    outs = transpose_weight_sf(sf, block_size, transpose_sf1)
    return [(outs[2 * i], outs[2 * i + 1]) for i in range(len(outs) // 2)]
