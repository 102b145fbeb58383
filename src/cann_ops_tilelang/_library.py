"""The one helper that declares an operator of this package.

An op module (``cann_ops_tilelang/<family>/<op module>.py``) writes each op as a *prepare* function: fully
annotated (its annotations are the schema), it validates the arguments (metadata only) and allocates the
outputs with ``new_empty``. :func:`declare` turns it into the custom op ``cann_ops_tilelang::<name>``:

* the prepare function is the fake (meta) implementation, so fake and real outputs have identical
  metadata by construction;
* the kernels for ``"cuda"`` and ``"privateuseone"`` (Ascend NPUs through torch_npu) run the prepare
  function, check that no buffer the op writes shares memory with another argument, that every argument
  the kernels access in vectors (``vector_args``) starts on a multiple of the access width, then skip the
  launch for zero tokens (``tokens``) or call the op's launch binding (``@op.launch``) with the kernel
  module ``cann_ops_tilelang.kernels.<backend>.<family>.<op module>``, imported on first use (TileLang is
  imported only there);
* any other device (CPU, ...) runs the same checks, then gets a ``RuntimeError`` naming the op, the device
  and the devices that have kernels, and on a second line what works without them (meta tensors, the
  ``aot_eager`` backend of ``torch.compile``, the README section "Without a GPU");
* no backward formula (the modeling layer chains the backward ops): a backward through an op raises. The op
  is defined with the low-level ``torch.library`` API, not ``custom_op`` (host time, docs/perf 2026-12-04).

Each op module also declares the op's DTensor sharding rule with ``public.sharding(...)`` (see
:mod:`._sharding`); the rules are registered with DTensor on the first public call after
``torch.distributed.tensor`` is imported, never at import.

The returned public function has the prepare function's signature and docstring. Before it calls
``torch.ops.cann_ops_tilelang.<name>`` (so dynamo sees the custom op and never traces into TileLang) it
checks the kinds of the arguments against the annotations (a list where a tensor belongs, ``True`` for an
int, ...) and refuses to write a buffer that requires grad while autograd records: the dispatcher would
otherwise convert or accept them silently.
"""

import contextlib
import dataclasses
import functools
import importlib
import inspect
import numbers
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import _deprecated, _sharding, config
from ._checks import OpError, describe, misalignment, overlap, type_name

__all__ = ["NAMESPACE", "OpDeclaration", "declare", "register_sharding_rules", "registered_families", "registered_ops"]

NAMESPACE = "cann_ops_tilelang"

# dispatch key -> kernel backend package under cann_ops_tilelang.kernels
_BACKENDS = {"CUDA": "cuda", "PrivateUse1": "ascend"}
_SUPPORTED = "cuda, npu"
# the second line of the no-kernel error: what does work without a GPU or NPU (README.md, "Without a GPU")
_WITHOUT_KERNEL = ('without a GPU or NPU: device="meta" runs the modules forward and backward (shapes only) and '
                   'torch.compile(backend="aot_eager") traces a model on meta tensors (README.md, section '
                   '"Without a GPU")')

_REGISTRY: dict[str, Callable[..., Any]] = {}
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # the device kernels' registrations


def registered_ops() -> dict[str, Callable[..., Any]]:
    """All operators declared so far, by short name (a copy)."""
    return dict(_REGISTRY)


def registered_families() -> list[str]:
    """The families of the declared ops (their ``declaration.family``: the package an op module is in), sorted; the
    one list of families, so that a new family's package is all there is to add."""
    return sorted({public.declaration.family for public in _REGISTRY.values()})


def register_sharding_rules() -> list[str]:
    """Registers the DTensor sharding rule of every declared op that has one and is not registered yet
    (see :mod:`cann_ops_tilelang._sharding`); returns the names registered by this call. Called on its
    own by the public functions once ``torch.distributed.tensor`` is imported; call it yourself before
    calling ``torch.ops.cann_ops_tilelang.<name>`` directly on DTensors. ``[]`` without torch.distributed."""
    return _sharding.register_all({name: public.op_state for name, public in _REGISTRY.items()})


@dataclasses.dataclass(frozen=True)
class OpDeclaration:
    """What an op declares besides its schema (see :func:`declare`)."""

    name: str
    family: str
    module: str
    mutates_args: tuple[str, ...]
    vector_args: Mapping[str, int]
    tokens: str | None
    zero_when_empty: tuple[str, ...]
    kernel: str
    outputs: tuple[str, ...] = ()


def _first_device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device | None:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)):  # a list of tensors (an op whose only tensors are in one)
            value = next((t for t in value if isinstance(t, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _on_their_device(arguments: Mapping[str, Any]) -> contextlib.AbstractContextManager:
    """The kernels launch on the current device and its current stream: where the arguments (one device, checked
    by every op) live on another device of the same type, that device is made current for the launch (the device
    guard ATen's own kernels take), else nothing is done."""
    for value in arguments.values():
        if isinstance(value, (list, tuple)):
            value = next((t for t in value if isinstance(t, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            device = value.device
            if device.index is None or device.type in ("cpu", "meta"):
                break
            module = torch.get_device_module(device.type)
            if module.current_device() != device.index:
                return module.device(device.index)
            break
    return contextlib.nullcontext()


def _describe(arguments: Mapping[str, Any]) -> str:
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
def _backend_module(backend: str, family: str, module: str):
    return importlib.import_module(f"{__package__}.kernels.{backend}.{family}.{module}")


# annotation -> (check, what is expected) for the pre-dispatch kind check of the public function
def _is_int(value: Any) -> bool:
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def _is_float(value: Any) -> bool:
    return isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)) and not isinstance(value, bool)


_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _fits_int64(value: Any) -> bool:
    return isinstance(value, torch.SymInt) or _INT64_MIN <= int(value) <= _INT64_MAX


def _is_int_or_none(value: Any) -> bool:
    return value is None or _is_int(value)


def _fits_int64_or_none(value: Any) -> bool:
    return value is None or _fits_int64(value)


def _fits_double(value: Any) -> bool:
    if type(value) is float or isinstance(value, (torch.SymFloat, torch.SymInt)):
        return True
    try:
        float(value)
    except OverflowError:
        return False
    return True


# kind check -> (whether a scalar of that kind fits the schema's type, the type's name): what the dispatcher
# cannot convert is refused by name before it tries
_SCALARS = {_is_int: (_fits_int64, "int64"), _is_int_or_none: (_fits_int64_or_none, "int64"),
            _is_float: (_fits_double, "double")}

_KINDS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    torch.Tensor: (lambda v: isinstance(v, torch.Tensor), "a torch.Tensor"),
    typing.Optional[torch.Tensor]: (lambda v: v is None or isinstance(v, torch.Tensor), "a torch.Tensor or None"),
    int: (_is_int, "an int"),
    typing.Optional[int]: (_is_int_or_none, "an int or None"),
    torch.dtype: (lambda v: isinstance(v, torch.dtype), "a torch.dtype"),
    float: (_is_float, "a float"),
    bool: (lambda v: isinstance(v, bool), "a bool"),
    str: (lambda v: isinstance(v, str), "a str"),
    torch.dtype: (lambda v: isinstance(v, torch.dtype), "a torch.dtype"),
    typing.Optional[str]: (lambda v: v is None or isinstance(v, str), "a str or None"),
    list[torch.Tensor]: (lambda v: isinstance(v, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in v),
                         "a list of torch.Tensor"),
}


def _got(value: Any) -> str:
    """What a kind check got: :func:`describe`, and for a list or tuple its first element that is no tensor (a
    list of floats where a list of tensors belongs reads ``list whose element [0] is float 1.0``)."""
    if isinstance(value, (list, tuple)):
        for i, element in enumerate(value):
            if not isinstance(element, torch.Tensor):
                return f"{type_name(value)} whose element [{i}] is {describe(element)}"
    return describe(value)


def _tensors(arguments: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the arguments, list elements named ``arg[i]``."""
    out = []
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            out += [(f"{name}[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return out


class _NoFormula:
    """No backward formula: what torch's generated autograd node raises for at backward."""

    _backward_fn = None
    _setup_context_fn = None


class _Op:
    """Binds a declared op's prepare function to the checks that run before any launch, and to its launch."""

    def __init__(self, decl: OpDeclaration, prepare: Callable[..., Any]):
        self.decl = decl
        self.prepare = prepare
        self.signature = inspect.signature(prepare)
        params = set(self.signature.parameters)
        for what, names in (("vector_args", decl.vector_args), ("mutates_args", decl.mutates_args),
                            ("zero_when_empty", decl.zero_when_empty),
                            ("tokens", () if decl.tokens is None else (decl.tokens,))):
            unknown = sorted(set(names) - params)
            if unknown:
                raise ValueError(f"{NAMESPACE}::{decl.name}: {what} names no argument of the op: {unknown}")
        hints = typing.get_type_hints(prepare)
        self.check_outputs(hints.get("return"), params)
        self.kinds = {name: _KINDS[hints[name]] for name in self.signature.parameters if hints.get(name) in _KINDS}
        self.names = tuple(self.signature.parameters)
        self.positions = {name: i for i, name in enumerate(self.names)}
        parameters = tuple(self.signature.parameters.values())
        if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in parameters):
            raise ValueError(f"{NAMESPACE}::{decl.name}: declare every argument positional-or-keyword (no *, /, "
                             f"*args or **kwargs): the schema and the kernels take them in order")
        self.defaults = tuple(p.default for p in parameters)
        self.required = sum(p.default is p.empty for p in parameters)
        self.mutated = tuple(self.names.index(name) for name in decl.mutates_args)
        self.launch: Callable[..., None] = self.default_launch
        self.sharding: _sharding.Rule | None = None

    def check_outputs(self, returns: Any, params: set[str]) -> None:
        """``outputs`` names each tensor the prepare function returns (its return annotation: None, a Tensor or a
        tuple of them), once, and no argument."""
        decl = self.decl
        count = 0 if returns is type(None) else len(typing.get_args(returns)) if typing.get_origin(returns) is tuple \
            else 1
        if len(decl.outputs) != count or len(set(decl.outputs)) != count:
            raise ValueError(f"{NAMESPACE}::{decl.name}: outputs must name each of the {count} new outputs the prepare "
                             f"function returns, once (the launcher takes them by these names), got {decl.outputs}")
        clash = sorted(set(decl.outputs) & params)
        if clash:
            raise ValueError(f"{NAMESPACE}::{decl.name}: outputs names arguments of the op: {clash}")

    def default_launch(self, kernels: Any, outputs: Any, **arguments: Any) -> None:
        """The launch of an op without a binding of its own: the launcher gets the arguments and the new outputs
        by name (``outputs``), as the kernel modules name their parameters."""
        launcher = getattr(kernels, self.decl.kernel)
        names = self.decl.outputs
        if not names:
            launcher(**arguments)
        elif len(names) == 1:
            launcher(**arguments, **{names[0]: outputs})
        else:
            launcher(**arguments, **dict(zip(names, outputs)))

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(every argument in order, {name: argument})``, defaults filled. An all-positional call (how the
        dispatcher calls the kernels, trailing arguments equal to their defaults left out) binds by zip."""
        if not kwargs and self.required <= len(args) <= len(self.names):
            full = tuple(args) + self.defaults[len(args):]
            return full, dict(zip(self.names, full))
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{NAMESPACE}::{self.decl.name}: {exc}") from None
        bound.apply_defaults()
        return tuple(bound.arguments.values()), bound.arguments

    def check_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """The public function's checks before the dispatcher: the kinds of the given arguments against the
        annotations, and no written buffer that autograd tracks. Positional and keyword arguments are read
        in place (no signature binding: this runs on every eager call); defaults are valid by construction."""
        if kwargs or not self.required <= len(args) <= len(self.names):
            positions = self.positions
            if len(args) > len(self.names) or any(positions.get(k, -1) < len(args) for k in kwargs) \
                    or any(n not in kwargs for n in self.names[len(args):self.required]):
                self.bind(args, kwargs)  # a missing, unknown or repeated argument: a TypeError naming the op
        given = list(zip(self.names, args)) + list(kwargs.items())
        for name, value in given:
            kind = self.kinds.get(name)
            if kind is not None:
                check = kind[0]
                if not check(value):
                    raise OpError(self.decl.name).type(name, f"expected {kind[1]}, got {_got(value)}")
                scalar = _SCALARS.get(check)
                if scalar is not None and not scalar[0](value):
                    raise OpError(self.decl.name).value(name, f"expected {kind[1]} that fits the schema's "
                                                              f"{scalar[1]}, got {describe(value)}")
        if self.decl.mutates_args and torch.is_grad_enabled():
            for name, value in _tensors({k: v for k, v in given if k in self.decl.mutates_args}):
                if value.requires_grad:
                    what = "a leaf tensor that requires grad" if value.is_leaf else "a tensor that requires grad"
                    raise OpError(self.decl.name).value(
                        name, f"expected a buffer that autograd does not track (the op writes it in place), got "
                              f"{what}; pass a detached buffer or call under torch.no_grad()")

    def check_aliasing(self, arguments: Mapping[str, Any]) -> None:
        """No written buffer (or element of a written list) shares memory with another argument (on real,
        meta and fake tensors alike)."""
        if not self.decl.mutates_args:
            return
        tensors = _tensors(arguments)
        for name, buffer in _tensors({name: arguments[name] for name in self.decl.mutates_args}):
            for other, value in tensors:
                if other != name and overlap(buffer, value):
                    raise OpError(self.decl.name).value(
                        name, f"expected a buffer that shares no memory with '{other}' (the op writes '{name}' "
                              f"while it reads or writes '{other}'), got an overlapping one")

    def check_alignment(self, arguments: Mapping[str, Any]) -> None:
        """Every argument the kernels access in vectors (each element of a list argument) starts on a multiple
        of the access width (the device kernels and the no-kernel path get real tensors; meta and fake ones
        take the fake)."""
        for name, width in self.decl.vector_args.items():
            value = arguments[name]
            if isinstance(value, torch.Tensor):
                if value.data_ptr() % width and value.numel():  # the common case, without building a list
                    self.misaligned(name, value, width)
            elif value is not None:
                for arg, element in _tensors({name: value}):
                    if misalignment(element, width):
                        self.misaligned(arg, element, width)

    def misaligned(self, arg: str, value: torch.Tensor, width: int) -> None:
        raise OpError(self.decl.name).value(
            arg,
            f"expected data starting on a {width}-byte boundary (the kernels access it in {width}-byte vectors), "
            f"got an address {misalignment(value, width)} bytes past one (a view at storage offset "
            f"{value.storage_offset()}); pass a copy (.clone())",
        )

    def fake(self, *args: Any, **kwargs: Any) -> Any:
        full, arguments = self.bind(args, kwargs)
        outputs = self.prepare(*full)
        self.check_aliasing(arguments)
        return outputs

    def unsupported(self, *args: Any, **kwargs: Any) -> Any:
        # Bad arguments are reported as such whatever the device; then the device itself.
        full, arguments = self.bind(args, kwargs)
        self.prepare(*full)
        self.check_aliasing(arguments)
        self.check_alignment(arguments)
        raise RuntimeError(
            f"{NAMESPACE}::{self.decl.name}: no kernel for tensors on device "
            f"'{_device_name(_first_device(args, kwargs))}'; supported devices: {_SUPPORTED}\n{_WITHOUT_KERNEL}"
        )

    def bump_versions(self, args: Sequence[Any]) -> None:
        """Marks the written buffers modified for autograd (the dispatcher leaves out trailing defaults: a
        buffer not passed is None)."""
        for index in self.mutated:
            if index < len(args) and args[index] is not None:
                torch.autograd.graph.increment_version(args[index])

    def autograd_kernel(self, overload: torch._ops.OpOverload) -> Callable[..., Any]:
        """The op's Autograd kernel. No input needs a gradient (the common case: the modeling layer's autograd
        functions call the ops with gradients off): the written buffers' versions are bumped and the call goes
        straight below autograd. Otherwise torch's generated node for an op without a formula runs: the
        forward works, a backward through it raises."""
        without_formula = torch._library.autograd.make_autograd_impl(overload, _NoFormula)
        versions = self.version_kernel(overload)

        def autograd(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled() and torch._C._any_requires_grad(*args, **kwargs):
                return without_formula(keyset, *args, **kwargs)
            return versions(keyset, *args, **kwargs)

        return autograd

    def version_kernel(self, overload: torch._ops.OpOverload) -> Callable[..., Any]:
        """Bumps the written buffers' versions and calls the op below ADInplaceOrView: the Autograd kernel's
        path without gradients, and the ADInplaceOrView kernel of an op that writes buffers (reached under
        inference mode and through the node without a formula)."""
        below = torch._C._after_ADInplaceOrView_keyset

        def versions(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            self.bump_versions(args)
            with torch._C._AutoDispatchBelowADInplaceOrView():
                return overload.redispatch(keyset & below, *args, **kwargs)

        return versions

    def kernel(self, backend: str) -> Callable[..., Any]:
        decl = self.decl

        def run(*args: Any, **kwargs: Any) -> Any:
            full, arguments = self.bind(args, kwargs)
            outputs = self.prepare(*full)
            self.check_aliasing(arguments)
            self.check_alignment(arguments)
            if config.debug_enabled():
                config.logger.debug("%s::%s on %s: %s", NAMESPACE, decl.name, backend, _describe(arguments))
            if decl.tokens is not None and arguments[decl.tokens].shape[0] == 0:
                # No tokens: nothing to launch; sums over no tokens are defined zeros.
                new = () if outputs is None else (outputs if isinstance(outputs, tuple) else (outputs,))
                for buffer in (*new, *(arguments[a] for a in decl.zero_when_empty)):
                    buffer.zero_()
                return outputs
            with _on_their_device(arguments):
                self.launch(_backend_module(backend, decl.family, decl.module), outputs, **arguments)
            return outputs

        run.__name__ = f"{decl.name}_{backend}"
        return run


def declare(
    name: str,
    *,
    mutates_args: Sequence[str] = (),
    vector_args: Mapping[str, int] | None = None,
    tokens: str | None = None,
    zero_when_empty: Sequence[str] = (),
    kernel: str | None = None,
    outputs: Sequence[str] = (),
) -> Callable[[Callable[..., Any]], Any]:
    """Declares ``cann_ops_tilelang::<name>`` from its prepare function (see the module docstring).

    The op's family and op module are those of the prepare function (``cann_ops_tilelang.<family>.<module>``);
    its kernels are in ``cann_ops_tilelang.kernels.<backend>.<family>.<module>``.

    Args:
        name: the op's short name.
        mutates_args: the arguments the op writes, exactly. None of them may share memory with another
            argument (checked before launch).
        vector_args: ``{argument: bytes}``, the arguments that the kernels read or write in vectors (or by
            cp.async / TMA) of that many bytes: each must start on a multiple of it where it holds data.
            The CUDA lowering tests check it against the generated sources.
        tokens: the argument whose dim 0 is the token count; with zero tokens nothing is launched, the new
            outputs and the ``zero_when_empty`` buffers are zeroed (sums over no tokens).
        zero_when_empty: written buffers that hold a defined result (zeros) for zero tokens.
        kernel: the launcher's name in the kernel module (default ``name``; an op that launches another
            op's kernel names it, e.g. an ``out=`` variant).
        outputs: the names under which the launcher takes the new outputs the prepare function returns, in
            order (one per returned tensor; none for an op that only writes its arguments).

    Returns:
        A decorator; applied to the prepare function it returns the public Python function. The op launches
        ``kernels.<kernel>(**arguments, **{output name: new output})``; an op whose launch must do more (pass
        a buffer under another name, skip a launch, leave out an argument) registers its own binding with
        ``@public.launch``, called as ``launch(kernels, outputs, **arguments)`` with the backend's kernel
        module and the prepare function's result. Declare its DTensor sharding
        rule with ``public.sharding(strategy, ...)`` (each ``{argument: "R" | "S<d>" | "P", "returns": ...}``)
        or ``public.sharding(unsupported="why")`` for an op that cannot run sharded (it then raises).
    """

    def wrap(prepare: Callable[..., Any]) -> Any:
        if name in _REGISTRY:
            raise RuntimeError(f"{NAMESPACE}::{name} is declared twice")
        parts = prepare.__module__.split(".")
        if len(parts) != 3 or parts[0] != NAMESPACE:
            raise ValueError(f"{NAMESPACE}::{name}: declare ops in {NAMESPACE}.<family>.<op module>, "
                             f"not in {prepare.__module__}")
        decl = OpDeclaration(name=name, family=parts[1], module=parts[2], mutates_args=tuple(mutates_args),
                             vector_args=dict(vector_args or {}), tokens=tokens,
                             zero_when_empty=tuple(zero_when_empty), kernel=kernel or name,
                             outputs=tuple(outputs))
        op = _Op(decl, prepare)

        def default(*args: Any, **kwargs: Any) -> Any:
            return op.unsupported(*args, **kwargs)

        @functools.wraps(prepare)
        def fake(*args: Any, **kwargs: Any) -> Any:
            return op.fake(*args, **kwargs)

        # NOTE low-level definition, not torch.library.custom_op: its Python layers cost host time per call
        _LIBRARY.define(name + torch.library.infer_schema(prepare, mutates_args=decl.mutates_args),
                        tags=(torch.Tag.pt2_compliant_tag,))
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
        _LIBRARY.impl(name, default, "CompositeExplicitAutograd")
        for key, backend in _BACKENDS.items():
            _LIBRARY.impl(name, op.kernel(backend), key)
        _LIBRARY.impl(name, op.autograd_kernel(overload), "Autograd", with_keyset=True)
        if decl.mutates_args:
            _LIBRARY.impl(name, op.version_kernel(overload), "ADInplaceOrView", with_keyset=True)

        renamed = _deprecated.RENAMED_ARGUMENTS.get(name)

        @functools.wraps(prepare)
        def public(*args: Any, **kwargs: Any) -> Any:
            if renamed and kwargs:  # old keyword names, for one release
                kwargs = _deprecated.rename_keywords(name, renamed, kwargs)
            if not torch.compiler.is_compiling():  # a traced graph gets the schema's own conversion
                op.check_call(args, kwargs)
                if _sharding.PENDING and "torch.distributed.tensor" in sys.modules:
                    register_sharding_rules()  # DTensor is loaded: the rules go in once (one dict lookup after)
            return overload(*args, **kwargs)

        def set_launch(fn: Callable[..., None]) -> Callable[..., None]:
            op.launch = fn
            return fn

        def set_sharding(*strategies: Mapping[str, Any], unsupported: str | None = None) -> None:
            op.sharding = _sharding.Rule(decl, op.names, strategies, unsupported)
            _sharding.PENDING = True

        public.op = overload
        public.op_state = op
        public.sharding = set_sharding
        public.declaration = decl
        public.backend_kernel = op.kernel  # backend -> the device kernel (prepare, checks, launch), for tests
        public.qualname = f"{NAMESPACE}::{name}"
        public.launch = set_launch
        public.prepare = prepare
        public.vector_args = dict(decl.vector_args)
        _REGISTRY[name] = public
        return public

    return wrap
