"""The layout the package keeps (docs/layout.md): one op module per forward/backward pair, its kernels in
files of the same name under each backend, launches that pass every launcher exactly its parameters by name
(the default launch of declare(); a binding of its own only where an op's launch does more), limits and chip
facts declared once, no measurement diaries in the code."""

import ast
import importlib
import inspect
import io
import pkgutil
import re
import sys
import tokenize
import types
from pathlib import Path

import pytest
import torch

import cann_ops_tilelang as ops
from cann_ops_tilelang import _library, limits

SRC = Path(ops.__file__).resolve().parent
ROOT = SRC.parent.parent
BACKENDS = ("cuda", "ascend")
FAMILIES = sorted({p.declaration.family for p in ops.registered_ops().values()})


def _public_modules(package: str) -> set[str]:
    module = importlib.import_module(package)
    return {info.name for info in pkgutil.iter_modules(module.__path__) if not info.name.startswith("_")}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_op_module_has_kernel_modules_of_its_name_on_both_backends(family):
    pytest.importorskip("tilelang")
    declared = {p.declaration.module for p in ops.registered_ops().values() if p.declaration.family == family}
    assert _public_modules(f"cann_ops_tilelang.{family}") == declared
    for backend in BACKENDS:
        assert _public_modules(f"cann_ops_tilelang.kernels.{backend}.{family}") == declared, backend


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_has_a_cases_registry(family):
    """tests/<family>/<family>_cases.py holds an example call ``<op>_call(tokens, hidden, ...)`` of each op of the
    family and nothing else named so (found by name, as the references ``<op>_ref`` are): every cross-op test
    draws its calls there (tests/_plugins/cases.py), so a new op or family adds its calls in that one place."""
    from _plugins import cases

    assert (ROOT / "tests" / family / f"{family}_cases.py").is_file()
    assert [p for p in cases.registry_problems() if family in p] == []
    declared = {n for n, p in ops.registered_ops().items() if p.declaration.family == family}
    assert set(cases.builders(family)) == declared


def _recorded_launch(public, backend: str, call: dict, monkeypatch) -> tuple[str, dict]:
    calls = []
    stub = types.SimpleNamespace(**{public.declaration.kernel: lambda **kw: calls.append(kw)})
    monkeypatch.setattr(_library, "_backend_module", lambda *_: stub)
    public.backend_kernel(backend)(**call)
    (kwargs,) = calls
    return public.declaration.kernel, kwargs


@pytest.mark.parametrize("name", sorted(ops.registered_ops()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_launch_binding_passes_the_launcher_its_parameters_by_name(name, backend, monkeypatch):
    """The op's launch (declare()'s default or the op's own binding) calls the launcher of its kernel module on
    each backend with keyword arguments that are exactly the launcher's parameters (no positional order to keep
    in step)."""
    pytest.importorskip("tilelang")
    from _plugins import cases

    public = ops.registered_ops()[name]
    decl = public.declaration
    call = cases.call(name)
    launcher_name, kwargs = _recorded_launch(public, backend, call, monkeypatch)
    module = importlib.import_module(f"cann_ops_tilelang.kernels.{backend}.{decl.family}.{decl.module}")
    launcher = getattr(module, launcher_name)
    params = inspect.signature(launcher).parameters
    required = {k for k, p in params.items() if p.default is inspect.Parameter.empty}
    assert required <= set(kwargs) <= set(params), (backend, name, sorted(kwargs), list(params))
    for arg in decl.mutates_args:  # every written buffer reaches the launcher, itself
        assert any(value is call[arg] for value in kwargs.values()), (name, arg)


def pass_through_bindings(source: str) -> list[int]:
    """Lines of the launch bindings (``@<op>.launch``) in ``source`` that only call one launcher with their own
    arguments and outputs, each under its own name (the outputs unpacked first or not): what declare()'s
    default launch does, so such a binding is not written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not any(
                isinstance(d, ast.Attribute) and d.attr == "launch" for d in node.decorator_list):
            continue
        params = [a.arg for a in node.args.args]
        body, names = list(node.body), set(params[1:])
        first = body[0] if body else None
        if isinstance(first, ast.Assign) and isinstance(first.value, ast.Name) and first.value.id == params[1]:
            target = first.targets[0]
            unpacked = target.elts if isinstance(target, ast.Tuple) else [target]
            if all(isinstance(e, ast.Name) for e in unpacked):
                names |= {e.id for e in unpacked}
                body = body[1:]
        if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
            continue
        call = body[0].value
        on_kernels = isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) \
            and call.func.value.id == params[0]
        if on_kernels and not call.args and all(isinstance(k.value, ast.Name) and k.arg == k.value.id in names
                                                for k in call.keywords):
            found.append(node.lineno)
    return found


def test_pass_through_bindings_are_found():
    """The rule below, on a binding of each kind: pass-through ones (outputs unpacked or not) and ones that do
    more (a buffer under another name, a condition, a constant)."""
    bindings = {
        "def _(kernels, outs, x, n):\n    a, b = outs\n    kernels.f(x=x, n=n, a=a, b=b)": True,
        "def _(kernels, out, x):\n    kernels.f(x=x, out=out)": True,
        "def _(kernels, _none, x, out):\n    kernels.g(x=x, out=out)": True,
        "def _(kernels, _none, x):\n    kernels.f(x=x, out=x)": False,
        "def _(kernels, out, x):\n    if out.numel():\n        kernels.f(x=x, out=out)": False,
        "def _(kernels, out, x):\n    kernels.f(x=x, out=out, dot=None)": False,
    }
    for body, passes in bindings.items():
        assert bool(pass_through_bindings(f"@op.launch\n{body}\n")) is passes, body


def test_no_op_module_writes_a_pass_through_binding():
    """declare() launches ``kernels.<kernel>(**arguments, **{output name: output})`` itself (its ``outputs``): an
    op module writes a binding only where the launch does more than hand over the arguments and outputs."""
    found = [f"{path.relative_to(SRC)}:{line}" for family in FAMILIES for path in sorted((SRC / family).glob("*.py"))
             for line in pass_through_bindings(path.read_text())]
    assert not found, f"launch bindings that declare()'s default launch replaces (delete them): {found}"
    own = [n for n, p in ops.registered_ops().items() if p.op_state.launch != p.op_state.default_launch]
    assert len(own) < len(ops.registered_ops()) // 4, own  # the exceptions stay exceptions


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_declares_its_hidden_sizes_in_limits(family):
    """limits.py holds each family's hidden-size range and the sizes that matter (``<FAMILY>_HIDDEN`` and
    ``<FAMILY>_HIDDEN_SIZES``, found by name): sorted, in the range, from its low edge. The main command, the kernel
    manifest and the tests' example calls read them; nothing lists the families (they are the declared ops')."""
    from cann_ops_tilelang import __main__ as main_module

    name, allowed, sizes = limits.hidden_sizes(family)
    assert name == f"{family.upper()}_HIDDEN" and getattr(limits, name) is allowed
    assert sizes == tuple(sorted(set(sizes))) and sizes[0] == allowed.low and all(h in allowed for h in sizes)
    assert main_module.FAMILIES == tuple(FAMILIES) and main_module.HIDDEN_RANGES[family] == (name, allowed)
    sys.path.insert(0, str(ROOT / "tools"))
    import kernel_manifest

    assert kernel_manifest.HIDDEN[family] == sizes and list(kernel_manifest.HIDDEN) == FAMILIES


def _python_files():
    return sorted(p for p in SRC.rglob("*.py"))


def test_no_module_over_700_lines():
    long = {str(p.relative_to(SRC)): n for p in _python_files() if (n := len(p.read_text().splitlines())) > 700}
    assert not long, long


def test_no_comment_block_or_docstring_over_20_lines():
    """Measurement diaries belong in docs/perf/<chip>/<family>.md; code keeps what was chosen and why."""
    problems = []
    for path in _python_files():
        text = path.read_text()
        run = 0
        for number, line in enumerate(text.splitlines(), 1):
            run = run + 1 if line.strip().startswith("#") else 0
            if run == 21:
                problems.append(f"{path.relative_to(SRC)}:{number}: comment block over 20 lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc.splitlines()) > 30:
                    problems.append(f"{path.relative_to(SRC)}: docstring of {getattr(node, 'name', 'module')} "
                                    f"has {len(doc.splitlines())} lines")
    assert not problems, "\n".join(problems)


def test_chip_facts_are_not_repeated_as_literals():
    """The H200's SM count and the per-CTA shared memory appear in chips.py alone (as code, not in comments)."""
    problems = []
    for path in _python_files():
        if path.name == "chips.py":
            continue
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                  if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                    tokenize.DEDENT, tokenize.STRING)]
        for i, tok in enumerate(tokens):
            if tok.type == tokenize.NUMBER and tok.string == "132":
                problems.append(f"{path.relative_to(SRC)}:{tok.start[0]}: 132")
            if tok.string in ("227", "228", "248", "216") and i + 2 < len(tokens) and tokens[i + 1].string == "*" \
                    and tokens[i + 2].string == "1024":
                problems.append(f"{path.relative_to(SRC)}:{tok.start[0]}: {tok.string} * 1024")
    assert not problems, problems


def test_no_assert_in_kernel_builders_or_launchers():
    """A value outside a declared range gets limits.LimitError (a ValueError), never an AssertionError."""
    found = [f"{p.relative_to(SRC)}:{node.lineno}" for p in _python_files() if "kernels" in p.parts
             for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Assert)]
    assert not found, found


def test_the_operator_contracts_live_in_the_repository():
    """Docstrings and tests cite docs/ops/<family>.md, whose sections are the op modules; no file cites the
    design's operator specification, which is not in the repository."""
    design = "OPS" + ".md"
    cited = []
    for path in [*_python_files(), *(ROOT / "tests").rglob("*.py"), ROOT / "README.md"]:
        if path.exists() and design in path.read_text():
            cited.append(str(path.relative_to(ROOT)))
    assert not cited, cited
    for family in FAMILIES:
        doc = (ROOT / "docs" / "ops" / f"{family}.md").read_text()
        headings = set(re.findall(r"^## (\S+)\s*$", doc, flags=re.M))
        modules = {p.declaration.module for p in ops.registered_ops().values() if p.declaration.family == family}
        assert modules <= headings, (family, modules - headings)
        for path in _python_files():
            for anchor in re.findall(rf"docs/ops/{family}\.md#(\w+)", path.read_text()):
                assert anchor in headings, (str(path), anchor)
