"""The buffers the modeling layer allocates for the ops to write, placed as the ops' DTensor rules expect.

On plain tensors these are ``torch.empty``/``torch.zeros``. On DTensors (docs/distributed.md) DTensor's own
``new_empty``/``new_zeros`` replicate, which makes every op writing such a buffer fall back to gathering its
token-sharded inputs. So here a token buffer takes the token sharding of a token-major tensor (its dim 0),
and a buffer of sums over tokens is ``Partial`` wherever the tokens are sharded (each rank writes the sum of
its own tokens; the rules declare these results ``P``). With fewer tokens than shards both are replicated
(the ops then gather, as the rules' fallback does). :func:`reduced` makes a parameter's gradient ``Replicate``.
"""

import sys
from typing import Optional

import torch
from torch import Tensor

__all__ = ["grad_buffers", "over_tokens", "per_token", "reduced"]


def _dtensor(value: Tensor):
    """The DTensor class where ``value`` is one (``torch.distributed.tensor`` is imported only by its users)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None and isinstance(value, module.DTensor) else None


def _token_sharded(tokens: Tensor) -> bool:
    """Whether a DTensor's dim 0 is sharded with at least one token per shard."""
    from torch.distributed.tensor import Shard

    sharded, shards = False, 1  # a loop, not math.prod over a generator: Dynamo traces this under torch.compile
    for i, placement in enumerate(tokens.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            sharded, shards = True, shards * tokens.device_mesh.size(i)
    return sharded and tokens.shape[0] >= shards


def _place(dtensor_cls, local: Tensor, tokens: Tensor, size: tuple[int, ...], sharded) -> Tensor:
    from torch.distributed.tensor import Replicate, Shard

    placements = [sharded() if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in tokens.placements]
    stride = torch.empty(size, device="meta").stride()
    return dtensor_cls.from_local(local, tokens.device_mesh, placements, run_check=False, shape=torch.Size(size),
                                  stride=stride)


def per_token(tokens: Tensor, *shape: int, dtype: Optional[torch.dtype] = None, zero: bool = False) -> Tensor:
    """A contiguous ``(T, *shape)`` buffer (``T = tokens.shape[0]``, zeros if ``zero``) on ``tokens``' device,
    of ``tokens``' dtype unless ``dtype`` is given; on a DTensor, sharded on dim 0 where ``tokens`` is."""
    dtype = tokens.dtype if dtype is None else dtype
    cls = _dtensor(tokens)
    if cls is None or not _token_sharded(tokens):
        make = tokens.new_zeros if zero else tokens.new_empty
        return make((tokens.shape[0], *shape), dtype=dtype)
    from torch.distributed.tensor import Shard

    local = tokens.to_local()
    buffer = (torch.zeros if zero else torch.empty)((local.shape[0], *shape), dtype=dtype, device=local.device)
    return _place(cls, buffer, tokens, (tokens.shape[0], *shape), lambda: Shard(0))


def over_tokens(tokens: Tensor, *shape: int, zero: bool = False) -> Tensor:
    """A contiguous fp32 ``shape`` buffer for a sum over the tokens of ``tokens`` (a parameter gradient or its
    partial rows; zeros if ``zero``); on a DTensor, ``Partial`` where ``tokens`` is sharded on dim 0."""
    cls = _dtensor(tokens)
    if cls is None or not _token_sharded(tokens):
        make = tokens.new_zeros if zero else tokens.new_empty
        return make(shape, dtype=torch.float32)
    from torch.distributed.tensor import Partial

    buffer = (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=tokens.device)
    return _place(cls, buffer, tokens, tuple(shape), Partial)


def grad_buffers(tokens: Tensor, params, mains) -> list[Tensor]:
    """The fp32 gradient buffers an op writes for ``params`` (all of them, in one call): each parameter's
    ``main_grad`` where ``mains`` has one, else zeros, which are :func:`over_tokens` sums unless another of
    them is a ``main_grad``: then they are allocated like their parameter (a rule takes all of them ``P`` or
    all like the parameters)."""
    like_params = any(main is not None for main in mains)
    return [main if main is not None
            else param.new_zeros(param.shape, dtype=torch.float32) if like_params
            else over_tokens(tokens, *param.shape, zero=True)
            for param, main in zip(params, mains)]


def reduced(total: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A parameter's gradient from an :func:`over_tokens` sum, in ``dtype`` (default: as it is). A ``Partial``
    DTensor is all-reduced first, in fp32: rounding each rank's share before the sum would lose precision, and
    some torch releases mishandle Partial gradients (2.11's foreach ``clip_grad_norm_`` leaves them unscaled)."""
    if _dtensor(total) is not None and any(p.is_partial() for p in total.placements):
        from torch.distributed.tensor import Replicate

        total = total.redistribute(total.device_mesh, [Replicate() if p.is_partial() else p for p in total.placements])
    return total if dtype is None or total.dtype == dtype else total.to(dtype)
