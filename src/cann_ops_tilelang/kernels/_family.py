"""The one aggregation of a backend family package (``kernels/<backend>/<family>/__init__.py``).

A family package holds one kernel module (or package) per op module; its public names (no leading ``_``) are
the op modules, discovered from the files, so adding an op adds no line here or in the family package.
"""

import importlib
import pkgutil
import sys


def op_modules(package: str) -> tuple:
    """The op modules of a family package, sorted: every public module or sub-package in its folder."""
    path = sys.modules[package].__path__
    return tuple(sorted(info.name for info in pkgutil.iter_modules(path) if not info.name.startswith("_")))


def lowering_cases(package: str, hidden_size: int, **kwargs) -> dict:
    """Every kernel variant of the family at ``hidden_size``, un-compiled: ``{"<op module>/<case>": prim_func}``.
    Imports each kernel module (and TileLang); the arguments go to each module's ``lowering_cases``."""
    cases = {}
    for name in op_modules(package):
        module = importlib.import_module(f"{package}.{name}")
        cases.update({f"{name}/{case}": fn for case, fn in module.lowering_cases(hidden_size, **kwargs).items()})
    return cases
