"""The buffers the modeling layer allocates for the ops to write, placed as the ops' DTensor rules expect.

On plain tensors these are ``torch.empty``/``torch.zeros``. On DTensors (docs/distributed.md) DTensor's own
``new_empty``/``new_zeros`` replicate, which makes every op writing such a buffer fall back to gathering its
token-sharded inputs. So here a token buffer takes the token sharding of a token-major tensor (its dim 0),
and a buffer of sums over tokens is ``Partial`` wherever the tokens are sharded (each rank writes the sum of
its own tokens; the rules declare these results ``P``).
"""

import sys
from typing import Optional

import torch
from torch import Tensor

__all__ = ["as_dtype", "over_tokens", "per_token"]


def _dtensor(value: Tensor):
    """The DTensor class where ``value`` is one (``torch.distributed.tensor`` is imported only by its users)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None and isinstance(value, module.DTensor) else None


def _place(dtensor_cls, local: Tensor, tokens: Tensor, size: tuple[int, ...], sharded) -> Tensor:
    from torch.distributed.tensor import Replicate, Shard

    placements = [sharded() if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in tokens.placements]
    stride = torch.empty(size, device="meta").stride()
    return dtensor_cls.from_local(local, tokens.device_mesh, placements, run_check=False, shape=torch.Size(size),
                                  stride=stride)


def per_token(tokens: Tensor, *shape: int, dtype: Optional[torch.dtype] = None, zero: bool = False) -> Tensor:
    """A contiguous ``(T, *shape)`` buffer (``T = tokens.shape[0]``, zeros if ``zero``) on ``tokens``' device,
    of ``tokens``' dtype unless ``dtype`` is given; on a DTensor, sharded on dim 0 where ``tokens`` is."""
    make = torch.zeros if zero else torch.empty
    dtype = tokens.dtype if dtype is None else dtype
    cls = _dtensor(tokens)
    if cls is None:
        return make((tokens.shape[0], *shape), dtype=dtype, device=tokens.device)
    from torch.distributed.tensor import Shard

    local = tokens.to_local()
    buffer = make((local.shape[0], *shape), dtype=dtype, device=local.device)
    return _place(cls, buffer, tokens, (tokens.shape[0], *shape), lambda: Shard(0))


def over_tokens(tokens: Tensor, *shape: int, zero: bool = False) -> Tensor:
    """A contiguous fp32 ``shape`` buffer for a sum over the tokens of ``tokens`` (a parameter gradient or its
    partial rows; zeros if ``zero``); on a DTensor, ``Partial`` where ``tokens`` is sharded on dim 0."""
    make = torch.zeros if zero else torch.empty
    buffer = make(shape, dtype=torch.float32, device=tokens.device)
    cls = _dtensor(tokens)
    if cls is None:
        return buffer
    from torch.distributed.tensor import Partial

    return _place(cls, buffer, tokens, tuple(shape), Partial)


def as_dtype(total: Tensor, dtype: torch.dtype) -> Tensor:
    """``total`` (an :func:`over_tokens` buffer) in ``dtype``; a ``Partial`` DTensor is summed over the ranks
    first, in fp32 (rounding each rank's share to a narrower dtype before the sum would lose precision)."""
    if total.dtype == dtype:
        return total
    if _dtensor(total) is not None and any(p.is_partial() for p in total.placements):
        from torch.distributed.tensor import Replicate

        total = total.redistribute(total.device_mesh, [Replicate() if p.is_partial() else p for p in total.placements])
    return total.to(dtype)
