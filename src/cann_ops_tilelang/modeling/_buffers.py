"""What the modeling layer shares: the buffers it allocates for the ops to write, the ``main_grad`` buffers it
honours, the gathering of DTensor leading dims that do not flatten into tokens, and the modules' device argument.

Buffers. On plain tensors these are ``torch.empty``/``torch.zeros``. On DTensors (docs/distributed.md) DTensor's own
``new_empty``/``new_zeros`` replicate, which makes every op writing such a buffer fall back to gathering its
token-sharded inputs. So here a token buffer takes the token sharding of a token-major tensor (its dim 0),
and a buffer of sums over tokens is ``Partial`` wherever the tokens are sharded (each rank writes the sum of
its own tokens; the rules declare these results ``P``). With fewer tokens than shards both are replicated
(the ops then gather, as the rules' fallback does). :func:`reduced` makes a parameter's gradient ``Replicate``.

Every check raises ``TypeError`` (a wrong kind) or ``ValueError`` (a wrong shape, device, placement or value)
naming the caller's function and the argument as the user knows it.
"""

import numbers
import sys
from typing import Optional

import torch
from torch import Tensor

from .._checks import OpError, describe, overlap

__all__ = ["check_device", "check_main_grads", "dtensor_class", "flat_tokens", "gather_lead", "grad_buffers",
           "honoured_main_grad", "local_view", "over_tokens", "per_token", "reduced", "restore"]


def dtensor_class(value: object):
    """The DTensor class where ``value`` is one, else None (``torch.distributed.tensor`` is imported only by its
    users: a module not yet loaded means no DTensor exists)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module.DTensor if module is not None and isinstance(value, module.DTensor) else None


def local_view(value: Tensor) -> Tensor:
    """The tensor that holds ``value``'s bytes: a DTensor's local shard (the wrapper has no storage), else
    ``value``. ``to_local()`` (public, a view: same storage and offset) rather than the private ``_local_tensor``."""
    return value.to_local() if dtensor_class(value) is not None else value


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
    cls = dtensor_class(tokens)
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
    cls = dtensor_class(tokens)
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
    if dtensor_class(total) is not None and any(p.is_partial() for p in total.placements):
        from torch.distributed.tensor import Replicate

        total = total.redistribute(total.device_mesh, [Replicate() if p.is_partial() else p for p in total.placements])
    return total if dtype is None or total.dtype == dtype else total.to(dtype)


# --- main_grad (Megatron style) ------------------------------------------------------------------------------


def honoured_main_grad(param: Optional[Tensor], op: str, arg: str) -> Optional[Tensor]:
    """The fp32 ``main_grad`` buffer of parameter ``arg`` of ``op`` (errors name it ``<arg>.main_grad``), or None
    where there is none to honour: it is a Python attribute, so it is honoured in eager mode only (a compiled graph
    sees tensors), and only where the parameter requires a gradient (a frozen one gets none, there either).

    On a DTensor parameter the buffer must be a DTensor (the backward's in-place adds cannot mix the two kinds) and
    replicated: the ops that write a ``main_grad`` (``engram_grad_w_reduce``, ``mhc_fn_normw_merge_backward``)
    write it next to the other parameter's fresh gradient, allocated like that (replicated) parameter, and their
    rules keep no other placement of it: a sharded or Partial buffer would fail in the backward, under the op's
    name. One rule for every parameter (mHC's ``scale``/``base``, added with ``add_``, would take a sharded one),
    as the buffers are views of one flat bucket, placed alike.
    """
    if param is None or not param.requires_grad or torch.compiler.is_compiling():
        return None
    buffer = getattr(param, "main_grad", None)
    if buffer is None:
        return None
    err, name = OpError(op), f"{arg}.main_grad"
    if not isinstance(buffer, Tensor):
        raise err.type(name, f"expected a torch.Tensor, got {describe(buffer)}")
    distributed = dtensor_class(param) is not None
    if (dtensor_class(buffer) is not None) != distributed:
        kinds = ("a DTensor", "a plain tensor") if distributed else ("a plain tensor", "a DTensor")
        raise err.type(name, f"expected {kinds[0]} like the parameter, got {kinds[1]}")
    if buffer.dtype != torch.float32 or buffer.shape != param.shape or buffer.device != param.device \
            or not buffer.is_contiguous():
        layout = "" if buffer.is_contiguous() else f", not contiguous (strides {tuple(buffer.stride())})"
        raise err.value(name, f"expected a contiguous fp32 buffer of the parameter's shape {tuple(param.shape)} on "
                              f"{param.device}, got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}{layout}")
    if distributed and not all(p.is_replicate() for p in buffer.placements):
        raise err.value(name, f"expected a replicated DTensor (Replicate on every mesh dim), got placements "
                              f"{tuple(buffer.placements)}")
    return buffer


def check_main_grads(op: str, params: tuple, mains: tuple, inputs: tuple) -> None:
    """No honoured ``main_grad`` (``mains``, one per ``(name, parameter)`` of ``params``) shares memory with another
    one, with a parameter of the call (its own included) or with an input ``(name, tensor)``: the backward adds
    each gradient into its buffer in place, so two gradients would be summed into the same memory, and a parameter
    or an input would change under the graph that saved it. Metadata only (storages and offsets)."""
    err = OpError(op)
    for j, ((name, _), main) in enumerate(zip(params, mains)):
        if main is None:
            continue
        here = local_view(main)
        for (other, _), earlier in zip(params[:j], mains[:j]):
            if earlier is not None and overlap(here, local_view(earlier)):
                raise err.value(name, f"expected a main_grad of its own, got one that overlaps the main_grad of "
                                      f"'{other}' (both gradients would be added into the same memory)")
        for other, tensor in (*params, *inputs):
            if isinstance(tensor, Tensor) and overlap(here, local_view(tensor)):
                what = "the parameter's own data" if other == name else f"'{other}'"
                raise err.value(name, f"expected a main_grad that shares no memory with the call's tensors, got one "
                                      f"that overlaps {what} (the backward would write the gradient into it)")


# --- DTensor leading dims ------------------------------------------------------------------------------------


def gather_lead(value: Optional[Tensor], lead: int, *, whole_rows: bool = False) -> tuple[Optional[Tensor],
                                                                                          Optional[dict]]:
    """``value`` with its ``lead`` leading dims ready to be flattened into tokens, and what :func:`restore` needs
    to give a result shaped like it (in its leading dims) the same placements (None: nothing to restore).

    DTensor flattens a ``Shard`` of the leading dims into a ``Shard(0)`` of the tokens only where it is dim 0,
    sharded evenly (or the only leading dim); for the rest (``(B, S)`` sharded on ``S``, ``B`` not a multiple of the
    shards) it raises or replicates silently. So those mesh dims are gathered here (the ops then run on whole
    tokens without communication) and the results sliced back. ``whole_rows``: also gather the shards of the dims
    after the leading ones (the Engram gate splits each token's ``kv`` row into ``m + 1`` rows of ``H``; DTensor's
    reshape of a ``kv`` sharded on its last dim raises); its :func:`restore` is then for results of ``value``'s
    shape only."""
    if dtensor_class(value) is None:
        return value, None
    from torch.distributed.tensor import Replicate, Shard

    gather, first, shards = {}, {}, 1
    for i, placement in enumerate(value.placements):
        if not isinstance(placement, Shard):
            continue
        dim = placement.dim % value.dim()
        if dim == 0 and lead > 0:
            first[i], shards = placement, shards * value.device_mesh.size(i)
        elif dim < lead or whole_rows:
            gather[i] = placement
    if first and lead > 1 and value.shape[0] % shards:  # uneven: DTensor's flatten would not keep it Shard(0)
        gather.update(first)
    if not gather:
        return value, None
    # the placements themselves are kept (not Shard(dim)): a _StridedShard comes back as it was
    placements = [Replicate() if i in gather else p for i, p in enumerate(value.placements)]
    return value.redistribute(value.device_mesh, placements), gather


def flat_tokens(value: Optional[Tensor], lead: tuple[int, ...], *rest: int, whole_rows: bool = False
                ) -> tuple[Optional[Tensor], Optional[dict]]:
    """A checked ``(*lead, *rest)`` tensor viewed as contiguous tokens ``(T, *rest)``, the one place where the modeling
    layer flattens leading dims: a DTensor is gathered first where its sharding does not flatten
    (:func:`gather_lead`, ``whole_rows`` as there); also returns what :func:`restore` needs for results shaped like
    it. None stays None."""
    value, back = gather_lead(value, len(lead), whole_rows=whole_rows)
    return (None if value is None else value.reshape(-1, *rest).contiguous()), back


def restore(value: Tensor, back: Optional[dict]) -> Tensor:
    """A result of a :func:`gather_lead`-ed input with that input's placements back (a local slice of a replicated
    tensor: no communication)."""
    if back is None:
        return value
    return value.redistribute(value.device_mesh, [back.get(i, p) for i, p in enumerate(value.placements)])


# --- the modules' device -------------------------------------------------------------------------------------


def check_device(err: OpError, device: object) -> Optional[torch.device]:
    """A module's ``device`` argument as a ``torch.device`` (None stays None), refused by name before any parameter
    is made (torch's own errors name neither the module nor the argument)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, numbers.Integral, torch.device)):
        raise err.type("device", f"expected a torch.device, a str, an int or None, got {describe(device)}")
    try:
        device = torch.device(device if isinstance(device, (str, torch.device)) else int(device))
    except (RuntimeError, ValueError) as exc:
        raise err.value("device", f"expected a device such as 'cpu' or 'cuda:0', got {device!r} ({exc})") from None
    try:  # an empty tensor allocates nothing; torch raises AssertionError for a backend it was not built with
        torch.empty(0, device=device)
    except (AssertionError, RuntimeError) as exc:
        raise err.value("device", f"expected a device this torch can use, got {device} ({exc})") from None
    return device
