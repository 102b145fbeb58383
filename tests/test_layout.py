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


_TIER_FILE = re.compile(r"test_\w+_(cpu|device|lowering|validation|ascend|cuda)\.py$")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_op_module_has_one_test_file_and_no_tier_files(family):
    """docs/adding-an-op.md: the tests of op module ``<family>/<module>.py`` are in
    ``tests/<family>/test_<family>_<module>.py``, every tier in that file (tiers are markers: ``device``,
    ``benchmark``), never in a file per tier."""
    declared = {p.declaration.module for p in ops.registered_ops().values() if p.declaration.family == family}
    folder = ROOT / "tests" / family
    missing = [m for m in sorted(declared) if not (folder / f"test_{family}_{m}.py").is_file()]
    assert missing == [], f"op modules of {family} without their test file: {missing}"
    assert [f.name for f in sorted(folder.glob("test_*.py")) if _TIER_FILE.search(f.name)] == []


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


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path):
    """``(line, module, name)`` of every ``from module import name`` in ``path`` (relative imports resolved), and
    ``(line, module, None)`` of every ``import module``."""
    module = _module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                yield node.lineno, source, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None


def _is_module(module: str) -> bool:
    """Whether ``module`` (a dotted name in the package) is a module or package of the source tree."""
    path = SRC.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_kernel_modules_import_no_private_names():
    """A kernel module reads what it shares with other kernels from public names of private helper modules
    (``kernels/_kernel.py``, the backend's ``_build``, its family's ``_common``, ``_streaming``, ...): it imports no
    ``_name`` of another module, reads no ``module._name``, and imports nothing from another op's kernel module
    (a fused kernel shares its stages with the unfused ones through the helper modules)."""
    problems = []
    for path in (p for p in _python_files() if "kernels" in p.relative_to(SRC).parts):
        here = _module_of(path)
        modules = set()  # names this file binds to modules of the package
        for line, source, name in _imported(path):
            where = f"{path.relative_to(SRC)}:{line}"
            target = f"{source}.{name}" if name else source
            if name and _is_module(target):
                modules.add(name)
                source, name = target, None
            if name and name.startswith("_"):
                problems.append(f"{where}: imports the private name {name} of {source}")
            # another op's kernel module: kernels.<backend>.<family>.<public module> outside this file's own package
            parts = source.split(".")
            if (source.startswith("cann_ops_tilelang.kernels.") and len(parts) >= 5 and not parts[4].startswith("_")
                    and not here.startswith(".".join(parts[:5]))):
                problems.append(f"{where}: imports {source}, another op's kernel module")
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                problems.append(f"{path.relative_to(SRC)}:{node.lineno}: reads {node.value.id}.{node.attr}")
    assert not problems, "\n".join(dict.fromkeys(problems))


# config.py, the device policy, chips and limits, and the op layer (what fakes run): none of them may reach a
# backend's kernel package, whose modules build kernels (the device policy fakes need lives in policy.py)
_FAKE_SIDE = ("config.py", "policy.py", "chips.py", "limits.py", "_checks.py", "_sharding.py", *FAMILIES)


def test_config_and_op_layer_import_no_backend_kernel_module():
    problems = []
    for path in _python_files():
        if path.relative_to(SRC).parts[0] not in _FAKE_SIDE:
            continue
        for line, source, name in _imported(path):
            target = f"{source}.{name}" if name else source
            if target.startswith(("cann_ops_tilelang.kernels.cuda", "cann_ops_tilelang.kernels.ascend")):
                problems.append(f"{path.relative_to(SRC)}:{line}: imports {target}")
    assert not problems, "\n".join(problems)


_FAKES_PROBE = r"""
import json, sys
import torch
import cann_ops_tilelang as ops
sys.path.insert(0, sys.argv[1])
from test_bad_input import valid_call

for name, public in sorted(ops.registered_ops().items()):
    call = {k: (v.to("meta") if isinstance(v, torch.Tensor) else
                [t.to("meta") for t in v] if isinstance(v, list) else v) for k, v in valid_call(name).items()}
    public.prepare(**call)  # the op's fake: validation and the new outputs' shapes
for device_type in ("cuda", "npu", "meta"):
    ops.config.grad_w_partials(device_type, 7168)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("cann_ops_tilelang.kernels"))))
"""


def test_fakes_import_no_kernel_module():
    """Every op's fake (its prepare function, on meta tensors) and the partial-row counts of ``config`` run without
    importing any kernel module: the counts they need are the device policy of ``policy.py``."""
    import json
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(SRC.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _FAKES_PROBE, str(Path(__file__).parent)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


_OLD_SPELLINGS = re.compile(r"^(\w+_grad(_\w+)?|d_\w+|grad_(output|input))$")


@pytest.mark.parametrize("name", sorted(ops.registered_ops()))
def test_names_ops_forward_backward_and_gradients_grad_name(name):
    """docs/layout.md#names: no `_fwd` / `_bwd` op, gradients `grad_<name>` (no `<name>_grad`, `d_<name>`,
    `grad_output`), in the schema and in the outputs the launcher takes."""
    public = ops.registered_ops()[name]
    assert not re.search(r"_(fwd|bwd)(_|$)", name), name
    names = [a.name for a in public.op._schema.arguments] + list(public.declaration.outputs)
    assert [n for n in names if _OLD_SPELLINGS.match(n)] == [], name
    if name.endswith("_backward"):
        grads = [n for n in names if n.startswith("grad")]
        assert grads and all(n.startswith("grad_") for n in grads), name
