"""The example calls of every op: ``tests/<family>/<family>_cases.py``, found by name as the references are.

A family's cases module defines, for each op the family declares, ``<op>_call(tokens, hidden, *, seed=0,
device="cpu", **variant) -> dict``: a valid call of the op by argument name, in the schema's order, with
``tokens`` the size of the op's token dim (the rows of a table for the Sinkhorn optimizer's ops, the partial rows
of a reduction over them; ops without one ignore it) at the family's hidden size ``hidden``, and ``variant`` the
op's own options (a mask or none, a dtype...). Nothing else in the module is named ``*_call`` (no table: a
declared op without one, or one without a declared op, is an error of :func:`registry_problems`).

Every cross-op test draws its calls here (tests/test_bad_input.py, tests/test_dtensor.py, tests/test_layout.py,
tests/test_example_calls.py, tests/test_import.py). :func:`example_sizes` are the sizes that matter: T = 0 and
T > 0 at each hidden size limits.py declares for the family (``limits.hidden_sizes``: the range's low edge, then
the model sizes). Not a plugin (no hooks): imported by the tests that use it.
"""

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang._library import registered_families

_TESTS = Path(__file__).resolve().parent.parent
SUFFIX = "_call"
# T > 0 of the example calls: 3 tokens are not a multiple of 2 or 4 (no accidental match with m = 4 or a vector
# width), and small enough for every op's reference on the CPU at the largest hidden size
TOKENS = 3


def families() -> list[str]:
    """The families of the registered ops (``declaration.family``)."""
    return registered_families()


@functools.cache
def cases_module(family: str):
    """``tests/<family>/<family>_cases.py`` (its directory goes on ``sys.path``: it imports its references)."""
    path = str(_TESTS / family)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(f"{family}_cases")


def registry_files() -> dict[str, Path]:
    """``{family: path}`` of every cases module under tests/ (``<dir>/<dir>_cases.py``), registered ops or not."""
    return {path.parent.name: path for path in sorted(_TESTS.glob("*/*_cases.py"))
            if path.name == f"{path.parent.name}_cases.py"}


def builders(family: str) -> dict[str, Callable[..., dict]]:
    """``{op name: <op>_call}`` of a family's cases module (the functions defined there, not imported ones)."""
    module = cases_module(family)
    return {name[: -len(SUFFIX)]: fn for name, fn in vars(module).items()
            if name.endswith(SUFFIX) and inspect.isfunction(fn) and fn.__module__ == module.__name__}


def builder(name: str):
    """The ``<op>_call`` of a registered op."""
    family = ops.registered_ops()[name].declaration.family
    found = builders(family).get(name)
    if found is None:
        raise LookupError(f"no example call {name}{SUFFIX} in tests/{family}/{family}_cases.py")
    return found


def any_shape(name: str) -> tuple[str, ...]:
    """The tensor arguments the op ``name`` takes in any shape (its ``<op>_call.any_shape``, default none): reshaping
    or resizing them gives a valid call."""
    return tuple(getattr(builder(name), "any_shape", ()))


def smallest_hidden(family: str) -> int:
    return limits.hidden_sizes(family)[2][0]


def call(name: str, tokens: int = TOKENS, hidden: int | None = None, **options) -> dict:
    """A valid call of the op ``name`` by argument name (``hidden`` defaults to the family's smallest size)."""
    family = ops.registered_ops()[name].declaration.family
    return builder(name)(tokens, smallest_hidden(family) if hidden is None else hidden, **options)


def example_sizes(name: str) -> list[tuple[int, int]]:
    """``(tokens, hidden)`` of the op's example calls: T = 0 and ``TOKENS`` at every hidden size that matters."""
    family = ops.registered_ops()[name].declaration.family
    return [(tokens, hidden) for hidden in limits.hidden_sizes(family)[2] for tokens in (0, TOKENS)]


def registry_problems() -> list[str]:
    """What keeps the registries from holding exactly the registered ops: a family without a cases module, an op
    without an example call, an example call of no registered op of its family, a cases module of no family."""
    problems = []
    registered = ops.registered_ops()
    files = registry_files()
    for family in families():
        if family not in files:
            problems.append(f"family {family}: no tests/{family}/{family}_cases.py")
            continue
        declared = {n for n, p in registered.items() if p.declaration.family == family}
        found = set(builders(family))
        problems += [f"{n}: no {n}{SUFFIX} in tests/{family}/{family}_cases.py" for n in sorted(declared - found)]
        problems += [f"tests/{family}/{family}_cases.py: {n}{SUFFIX} calls no registered op of the family"
                     for n in sorted(found - declared)]
    problems += [f"{path.relative_to(_TESTS.parent)}: a cases module of no registered family"
                 for family, path in files.items() if family not in families()]
    return problems
