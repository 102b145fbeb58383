"""The one way a kernel module declares its kernels (docs/layout.md#a-kernel-module).

A :class:`Kernel` holds everything of one kernel variant but its builder's body and its launcher:

* its compile-time **key**, a frozen dataclass with named fields (:func:`compile_key`), never the token count;
* ``derive``, the function that computes the key from a launch's arguments and checks it against
  :mod:`cann_ops_tilelang.limits` (``limits.LimitError`` outside a declared range);
* the **builder**, called with the key's fields by name (``build(**fields)``) and returning a prim_func;
* the **cache** of compiled kernels, one JIT compile per key, logged by the backend's ``_build.jit_compile``;
* its **lowering cases**: ``cases(hidden_size, hc_mult) -> {case name: key}`` (or one key, the case named as
  the kernel), the keys the CPU tier lowers.

:func:`kernel_module` then gives a kernel module its ``KERNELS`` (name -> Kernel), ``lowering_cases`` (every
case of its kernels, built) and ``__all__`` (its public names, read from its source). A launcher reads
``key = KERNEL.key(...)`` and launches ``KERNEL.compiled(key)``; tests replace ``KERNEL.compiled``.

Imports neither torch nor TileLang.
"""

import ast
import dataclasses
import importlib
import inspect
import itertools
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Kernel", "compile_key", "kernel_module", "public_names", "variant_prim_func"]


def compile_key(cls: type) -> type:
    """Declares a compile-time key: a frozen dataclass with slots (hashable, cheap to build on every launch)."""
    return dataclasses.dataclass(frozen=True, slots=True)(cls)


def _fields(key: Any) -> dict:
    return {f.name: getattr(key, f.name) for f in dataclasses.fields(key)}


def _backend(module: str) -> str:
    """``"cuda"`` or ``"ascend"``: the backend package a kernel module lives in."""
    parts = module.split(".")
    if "kernels" not in parts or parts.index("kernels") + 1 >= len(parts):
        raise ValueError(f"{module} is not a module of a kernel backend package")
    return parts[parts.index("kernels") + 1]


class Kernel:
    """One kernel variant: its key type, ``derive``, builder, compile cache and lowering cases.

    Args:
        name: The op (or launcher) name: the compile log line names it.
        key: The key type, a :func:`compile_key` dataclass; the builder takes each of its fields by name.
        build: The builder, ``build(**fields) -> prim_func`` (extra parameters keep their defaults).
        derive: ``derive(*launch arguments) -> key``, checking the key against the limits (None: the key is
            built by the launcher of another kernel, e.g. a second stage's).
        cases: ``cases(hidden_size, hc_mult) -> {case name: key}``, the variants the CPU tier lowers (a single
            key: one case named as the kernel).
        compile: ``compile(key) -> compiled`` where one key compiles more than one prim_func (default:
            :meth:`jit` of the key's prim_func).
    """

    def __init__(self, name: str, key: type, build: Callable[..., Any], *,
                 derive: Callable[..., Any] | None = None,
                 cases: Callable[[int, int], Mapping[str, Any]] | None = None,
                 compile: Callable[[Any], Any] | None = None):
        if not (dataclasses.is_dataclass(key) and key.__dataclass_params__.frozen):
            raise TypeError(f"{name}: the key {key!r} must be a frozen dataclass (compile_key)")
        params = inspect.signature(build).parameters
        missing = [f.name for f in dataclasses.fields(key) if f.name not in params]
        if missing:
            raise TypeError(f"{name}: {build.__qualname__} takes no parameter {missing} of {key.__name__}")
        self.name = name
        self.key_type = key
        self.build = build
        self.backend = _backend(build.__module__)
        self._derive = derive
        self._cases = cases
        self._compile = compile
        self._cache: dict = {}

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, {self.key_type.__name__})"

    def key(self, *args, **kwargs) -> Any:
        """The compile-time key of a launch with these arguments (``limits.LimitError`` outside the ranges)."""
        if self._derive is None:
            raise TypeError(f"{self.name}: no derive function (its key comes from another kernel's launcher)")
        key = self._derive(*args, **kwargs)
        if type(key) is not self.key_type:
            raise TypeError(f"{self.name}: derive returned {type(key).__name__}, not {self.key_type.__name__}")
        return key

    def prim_func(self, key: Any) -> Any:
        """The un-compiled prim_func of ``key``: the builder called with its fields by name."""
        return self.build(**_fields(key))

    def jit(self, key: Any, prim_func: Any = None, name: str | None = None) -> Any:
        """JIT-compiles ``prim_func`` (default: the key's) with the backend's ``_build.jit_compile`` (looked up on
        each call, so a harness may replace it there), logged under ``name`` (default: the kernel's)."""
        build = importlib.import_module(f"{__package__}.{self.backend}._build")
        return build.jit_compile(name or self.name, key, self.prim_func(key) if prim_func is None else prim_func)

    def compiled(self, key: Any) -> Any:
        """The compiled kernel of ``key``, compiled on first use and kept (one compile per key)."""
        try:
            return self._cache[key]
        except KeyError:
            pass
        value = self._compile(key) if self._compile is not None else self.jit(key)
        self._cache[key] = value
        return value

    def cache_clear(self) -> None:
        self._cache.clear()

    def case_keys(self, hidden_size: int, hc_mult: int) -> dict:
        """``{case name: key}`` of the CPU tier at ``hidden_size`` (none without ``cases``)."""
        if self._cases is None:
            return {}
        cases = self._cases(hidden_size, hc_mult)
        return dict(cases) if isinstance(cases, Mapping) else {self.name: cases}


def _module_names(tree: ast.Module, is_package: bool) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names |= {t.id for t in elts if isinstance(t, ast.Name)}
        elif is_package and isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            # a package re-exports what it imports from its own modules
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def public_names(module: str) -> list[str]:
    """The public names a module binds at top level (definitions, assignments and, in a package, the names it
    imports from its own modules), sorted: its ``__all__``, read from its source."""
    mod = sys.modules[module]
    with open(mod.__file__) as f:
        tree = ast.parse(f.read())
    names = _module_names(tree, mod.__file__.endswith("__init__.py"))
    return sorted(n for n in names if not n.startswith("_"))


def kernel_module(module: str, *kernels: Kernel) -> tuple[dict, Callable[..., dict], list[str]]:
    """``KERNELS, lowering_cases, __all__`` of the kernel module ``module`` (``__name__``) declaring ``kernels``.

    ``lowering_cases(hidden_size, hc_mult=4) -> {case: prim_func}`` builds every case of every kernel; case
    names are unique within the module (each names the launcher that launches it).
    """
    table = {}
    for kernel in kernels:
        if kernel.name in table:
            raise ValueError(f"{module}: two kernels named {kernel.name}")
        table[kernel.name] = kernel

    def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
        cases = {}
        for kernel in kernels:
            for case, key in kernel.case_keys(hidden_size, hc_mult).items():
                if case in cases:
                    raise ValueError(f"{module}: two lowering cases named {case}")
                cases[case] = kernel.prim_func(key)
        return cases

    lowering_cases.__module__ = module
    lowering_cases.__doc__ = (f"Every kernel variant of ``{module.rsplit('.', 1)[-1]}`` at ``hidden_size``, "
                              f"un-compiled: ``{{case: prim_func}}`` (kernels: {', '.join(table)}).")
    return table, lowering_cases, public_names(module)


_VARIANT_SOURCES = itertools.count()


def variant_prim_func(prim_func: Callable[..., Any], scalar_type: Any, name: str, params: list, scalars: tuple,
                      body: Any, order: tuple) -> Any:
    """A prim_func named ``name`` (built by the backend's ``T.prim_func``) whose parameters are the tensor
    ``params`` of one variant, ``(name, annotation)`` in order, then the ``scalars`` (of ``scalar_type``); it calls
    the macro ``body`` with every name of ``order`` (None where the variant has no such parameter) and the scalars.
    Variants whose signatures differ (an absent optional tensor is no parameter) share one body this way: the
    function's source is generated and registered with ``linecache``, where the TVMScript parser reads it."""
    import linecache

    names = [n for n, _ in params] + list(scalars)
    annotations = {f"{n}_param": a for n, a in params} | {f"{s}_param": scalar_type for s in scalars}
    lines = [f"def {name}({', '.join(f'{n}: {n}_param' for n in names)}):\n",
             f"    body({', '.join([n if n in names else 'None' for n in order] + list(scalars))})\n"]
    filename = f"<{name}:{'/'.join(names)}:{next(_VARIANT_SOURCES)}>"  # one source a build (parsers cache by file)
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    namespace = {"body": body, **annotations}
    exec(compile("".join(lines), filename, "exec"), namespace)  # noqa: S102 - the variant's signature
    return prim_func(namespace[name])
