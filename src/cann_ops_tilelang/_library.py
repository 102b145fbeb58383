"""The one helper that declares an operator of this package.

An operator is written as a *prepare* function in ``fakes/``: fully annotated (its annotations are
the schema), it validates the arguments (metadata only) and allocates the outputs with
``new_empty``. :func:`declare` turns it into the custom op ``cann_ops_tilelang::<name>``:

* the prepare function is the fake (meta) implementation, so fake and real outputs have identical
  metadata by construction;
* the kernels for ``"cuda"`` and ``"privateuseone"`` (Ascend NPUs through torch_npu) run the
  prepare function, check that every argument the kernels access in vectors (``vector_args``: the
  access width in bytes per argument) starts on a multiple of that width where it holds data (a
  misaligned view gets a ``ValueError`` naming the op and the argument instead of a device fault),
  then the op's *launch* function (registered with ``@op.launch``), which gets
  the lazily imported backend module ``cann_ops_tilelang.kernels.<backend>.<family>``, the
  outputs and the arguments; TileLang is imported only there, on first use;
* any other device (CPU, ...) gets a ``RuntimeError`` naming the op, the device and the devices
  that have kernels.

The returned object is a plain Python function with the prepare function's signature and
docstring that calls ``torch.ops.cann_ops_tilelang.<name>`` (so dynamo sees the custom op and
never traces into TileLang), with the ``CustomOpDef`` under ``.op`` and the qualified name under
``.qualname``.
"""

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import config
from ._checks import OpError, misalignment

__all__ = ["NAMESPACE", "declare", "registered_ops"]

NAMESPACE = "cann_ops_tilelang"

# device type of the dispatch key -> kernel backend package under cann_ops_tilelang.kernels
_BACKENDS = {"cuda": "cuda", "privateuseone": "ascend"}
_SUPPORTED = "cuda, npu"

_REGISTRY: dict[str, Callable[..., Any]] = {}


def registered_ops() -> dict[str, Callable[..., Any]]:
    """All operators declared so far, by short name (a copy)."""
    return dict(_REGISTRY)


def _first_device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device | None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    return item.device
    return None


def _describe(arguments: dict[str, Any]) -> str:
    parts = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}={tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}")
        else:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


def _device_name(device: torch.device | None) -> str:
    if device is None:
        return "none"
    return "npu" if device.type == "privateuseone" else device.type


@functools.cache
def _backend_module(backend: str, family: str):
    return importlib.import_module(f"{__package__}.kernels.{backend}.{family}")


def _check_aligned(name: str, arguments: dict[str, Any], vector_args: dict[str, int]) -> None:
    """``ValueError`` for the first argument of ``vector_args`` that holds data not starting on a multiple
    of its access width (e.g. a contiguous view at an odd storage offset)."""
    for arg, width in vector_args.items():
        value = arguments.get(arg)
        if isinstance(value, torch.Tensor) and misalignment(value, width):
            raise OpError(name).value(
                arg,
                f"expected data starting on a {width}-byte boundary (the kernels access it in {width}-byte "
                f"vectors), got an address {misalignment(value, width)} bytes past one (a view at storage "
                f"offset {value.storage_offset()}); pass a copy (.clone())",
            )


class _Op:
    """Binds a declared op's prepare function to its launch function for one backend."""

    def __init__(self, name: str, family: str, prepare: Callable[..., Any], vector_args: Mapping[str, int]):
        self.name = name
        self.family = family
        self.prepare = prepare
        self.signature = inspect.signature(prepare)
        unknown = sorted(set(vector_args) - set(self.signature.parameters))
        if unknown:
            raise ValueError(f"{NAMESPACE}::{name}: vector_args names no argument of the op: {unknown}")
        self.vector_args = dict(vector_args)
        self.launch: Callable[..., None] | None = None

    def unsupported(self, *args: Any, **kwargs: Any) -> Any:
        # Bad arguments are reported as such whatever the device; then the device itself.
        self.prepare(*args, **kwargs)
        device = _first_device(args, kwargs)
        raise RuntimeError(
            f"{NAMESPACE}::{self.name}: no kernel for tensors on device '{_device_name(device)}'; "
            f"supported devices: {_SUPPORTED}"
        )

    def kernel(self, backend: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            outputs = self.prepare(*bound.args, **bound.kwargs)
            _check_aligned(self.name, bound.arguments, self.vector_args)
            if config.debug_enabled():
                config.logger.debug("%s::%s on %s: %s", NAMESPACE, self.name, backend, _describe(bound.arguments))
            if self.launch is None:
                raise NotImplementedError(f"{NAMESPACE}::{self.name} has no launch function")
            self.launch(_backend_module(backend, self.family), outputs, **bound.arguments)
            return outputs

        run.__name__ = f"{self.name}_{backend}"
        return run


def declare(
    name: str, *, family: str, mutates_args: Sequence[str] = (), vector_args: Mapping[str, int] | None = None
) -> Callable[[Callable[..., Any]], Any]:
    """Declares ``cann_ops_tilelang::<name>`` from its prepare function (see the module docstring).

    Args:
        name: the op's short name.
        family: the kernel family, i.e. the module ``kernels.<backend>.<family>`` that holds its
            kernels (``"engram"``, ``"mhc"``...).
        mutates_args: names of the arguments the op writes to, exactly.
        vector_args: ``{argument: bytes}``, the arguments that the kernels read or write in vectors (or by
            cp.async / TMA) of that many bytes: each must start on a multiple of it where it holds data.
            The CUDA lowering tests check it against the generated sources.

    Returns:
        A decorator; applied to the prepare function it returns the public Python function. Register
        the launch function with ``@public.launch``: it is called as
        ``launch(kernels, outputs, **arguments)`` on every call on a supported device, with the
        prepare function's result as ``outputs``; it decides itself to launch nothing for empty
        inputs.
    """

    def wrap(prepare: Callable[..., Any]) -> Any:
        if name in _REGISTRY:
            raise RuntimeError(f"{NAMESPACE}::{name} is declared twice")
        op = _Op(name, family, prepare, vector_args or {})

        def default(*args: Any, **kwargs: Any) -> Any:
            return op.unsupported(*args, **kwargs)

        functools.update_wrapper(default, prepare)
        custom = torch.library.custom_op(f"{NAMESPACE}::{name}", default, mutates_args=tuple(mutates_args))
        custom.register_fake(prepare)
        for device_type, backend in _BACKENDS.items():
            custom.register_kernel(device_type, op.kernel(backend))
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default

        @functools.wraps(prepare)
        def public(*args: Any, **kwargs: Any) -> Any:
            return overload(*args, **kwargs)

        def set_launch(fn: Callable[..., None]) -> Callable[..., None]:
            op.launch = fn
            return fn

        public.op = custom
        public.backend_kernel = op.kernel  # backend -> the device kernel (prepare + launch), for tests
        public.qualname = f"{NAMESPACE}::{name}"
        public.launch = set_launch
        public.prepare = prepare
        public.vector_args = dict(op.vector_args)
        _REGISTRY[name] = public
        return public

    return wrap
