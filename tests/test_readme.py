"""README.md stays true: its benchmark table is the committed baselines' (``tools/bench_table.py``), every
repository path it names exists (inline code, commands, links with their section anchors, the layout tree),
its test command is the one CI runs, its quickstarts and torch.compile code compute what they claim (run here on
the CPU, where the test references stand in for the kernels), the code of its section "Without a GPU" runs as
written on this CPU machine, and pyproject.toml declares the license of LICENSE. The device tier runs every
Python block as written on the GPU (or the NPU for the NPU's block)."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _plugins.device import requires_cuda, requires_npu

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PACKAGE = ROOT / "src" / "cann_ops_tilelang"
TOP_LEVEL = {"src", "tests", "docs", "tools", ".ci", "examples"}
FILE_SUFFIXES = (".py", ".md", ".toml", ".jsonl", ".json", ".txt", ".cfg")


def _load_bench_table():
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "tools" / "bench_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_table = _load_bench_table()


def readme() -> str:
    return README.read_text()


def fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, body, the heading above it)`` of every fenced code block."""
    blocks, heading, fence = [], "", None
    for line in text.splitlines(keepends=True):
        if fence is not None:
            if line.rstrip() == "```":
                blocks.append((fence, body, heading))
                fence = None
            else:
                body += line
        elif line.startswith("```"):
            fence, body = line[3:].strip(), ""
        elif re.match(r"#{1,6} ", line):
            heading = line.lstrip("#").strip()
    return blocks


def section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no section '## {heading}'"
    return match[1]


# --- the benchmark table --------------------------------------------------------------------------------


def test_readme_benchmark_table_is_the_committed_baselines(capsys):
    code = bench_table.main(["--check", str(README)])
    assert code == 0, capsys.readouterr().out + "\nrun: python tools/bench_table.py --write README.md"


def _write_run(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_bench_table_numbers(tmp_path):
    tests = tmp_path / "tests"
    _write_run(tests / "zeta" / "benchmark" / "h200" / "test_zeta_benchmark.jsonl", [
        {"case": "copy_1GiB", "impl": "copy", "bytes": 2_000_000, "time_us": 500.0},  # 4 GB/s... per µs: 4000 B
        {"case": "op_b-T8192-H4096", "impl": "ours", "bytes": 200_000, "time_us": 100.0},
        {"case": "op_b-T8192-H4096", "impl": "peer", "bytes": 200_000, "time_us": 150.0},
        {"case": "op_b-T512-H4096", "impl": "ours", "bytes": 100_000, "time_us": 40.0},
        {"case": "op_b-T512-H4096", "impl": "inductor", "bytes": 100_000, "time_us": 20.0},
        {"case": "op_b-T512-H4096", "impl": "eager", "bytes": 100_000, "time_us": 400.0},
        {"case": "other-T8192", "impl": "torch_tf32", "bytes": 1, "time_us": 1.0},  # no result of ours: no row
    ])
    _write_run(tests / "alpha" / "benchmark" / "h200" / "test_alpha_benchmark.jsonl", [
        {"case": "op_a-K16384", "impl": "ours", "bytes": 1000, "time_us": 1.2345},
        {"case": "op_a-K16384", "impl": "peer", "bytes": 1000, "time_us": 2.469},
        {"case": "op_a-K16384", "impl": "inductor", "bytes": 1000, "time_us": 3.7035},
    ])
    _write_run(tests / "alpha" / "benchmark" / "ascend950" / "test_alpha_benchmark.jsonl", [
        {"case": "op_a-K1", "impl": "ours", "bytes": 1, "time_us": 1.0},  # another chip: not in the h200 table
    ])
    rows = bench_table.rows(bench_table.read_runs(tests, "h200"))
    assert rows == [
        # family alpha first; its file has no copy record: no percentage
        ["alpha/op_a", "K=16384", "1.23", "2.47", "3.70", "2.00×", "3.00×", "—"],
        # then zeta, cases in natural order (T=512 before T=8192); % of copy = (bytes / time) / (2e6 / 500)
        ["zeta/op_b", "T=512, H=4096", "40.00", "—", "20.00", "—", "0.50×", "62.5"],
        ["zeta/op_b", "T=8192, H=4096", "100.0", "150.0", "—", "1.50×", "—", "50.0"],
    ]
    table = bench_table.generate(tests, "h200")
    assert table.splitlines()[0] == "| " + " | ".join(bench_table.COLUMNS) + " |"
    assert len(table.splitlines()) == 2 + len(rows)

    # --check / --write between the markers, the text around them untouched
    doc = tmp_path / "DOC.md"
    doc.write_text(f"intro\n\n{bench_table.START}\nstale\n{bench_table.END}\n\noutro\n")
    argv = ["--tests", str(tests)]
    assert bench_table.main(["--check", str(doc), *argv]) == 1
    assert bench_table.main(["--write", str(doc), *argv]) == 0
    assert doc.read_text() == f"intro\n\n{bench_table.START}\n{table}\n{bench_table.END}\n\noutro\n"
    assert bench_table.main(["--check", str(doc), *argv]) == 0
    doc.write_text(doc.read_text().replace("150.0", "151.0"))
    assert bench_table.main(["--check", str(doc), *argv]) == 1
    doc.write_text("no markers\n")
    assert bench_table.main(["--check", str(doc), *argv]) == 1


# --- paths ----------------------------------------------------------------------------------------------


def _looks_like_path(token: str) -> bool:
    token = token.strip("'\".,;:()")
    if not token or any(c in token for c in "<>*{}[]=$`|") or "://" in token or token.startswith("-"):
        return False
    if token.endswith(FILE_SUFFIXES) and "/" not in token.rstrip("/"):
        return True
    return token.split("/", 1)[0] in TOP_LEVEL and "/" in token


def _exists(path: str) -> bool:
    path = path.strip("'\".,;:()").split("#", 1)[0]
    return any((base / path).exists() for base in (ROOT, PACKAGE)) and (
        not path.endswith("/") or any((base / path).is_dir() for base in (ROOT, PACKAGE)))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def referenced_paths(text: str) -> list[str]:
    """Repository paths named in inline code, in shell code blocks and as relative link targets."""
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    tokens = [t for span in re.findall(r"`([^`\n]+)`", prose) for t in span.split()]
    tokens += [t for lang, body, _ in fenced_blocks(text) if lang in ("bash", "sh") for t in body.split()]
    paths = [t.strip("'\".,;:()") for t in tokens if _looks_like_path(t)]
    paths += [target for target in re.findall(r"\]\(([^)\s]+)\)", prose) if "://" not in target]
    return sorted(set(paths))


def layout_tree_paths(text: str) -> list[str]:
    """The paths of the layout tree (the code block of the section Layout): two spaces per level, a name
    ending in ``/`` is a directory, anything after the name is a comment."""
    blocks = [body for lang, body, heading in fenced_blocks(text) if heading == "Layout" and lang == ""]
    assert len(blocks) == 1, "README.md: the section Layout has no (or several) tree blocks"
    paths, stack = [], []
    for line in blocks[0].splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack[depth:] = [name]
        paths.append("".join(part if part.endswith("/") else part + "/" for part in stack[:-1]) + name)
    return paths


def test_readme_paths_exist():
    text = readme()
    missing = [p for p in referenced_paths(text) if not _exists(p)]
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_readme_link_anchors_exist():
    text = readme()
    wrong = []
    for target in re.findall(r"\]\(([^)\s#]+\.md)#([^)\s]+)\)", text):
        path, anchor = ROOT / target[0], target[1]
        if not path.exists():
            continue  # reported by test_readme_paths_exist
        anchors = {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", path.read_text(), re.M)}
        if anchor not in anchors:
            wrong.append(f"{target[0]}#{anchor}")
    assert not wrong, f"README.md links to sections that do not exist: {wrong}"


def test_readme_layout_tree_exists():
    paths = layout_tree_paths(readme())
    assert "src/cann_ops_tilelang/kernels/cuda/engram/" in paths  # the parser reads the tree
    missing = [p for p in paths if not (ROOT / p).exists() or (p.endswith("/") and not (ROOT / p).is_dir())]
    assert not missing, f"README.md's layout tree names paths that do not exist: {missing}"


def test_readme_anchors_within_the_readme_exist():
    text = readme()
    anchors = {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}
    targets = re.findall(r"\]\(#([^)\s]+)\)", text)
    assert targets, "the parser finds the README's own anchors"
    missing = sorted(set(targets) - anchors)
    assert not missing, f"README.md links to sections of its own that do not exist: {missing}"


def test_path_extraction():
    text = ("See `docs/ops/mhc.md#sinkhorn`, `limits.py`, `true/false`, `1/0`, `tests/<family>/x.jsonl`, "
            "`python tools/run_tests.py --benchmarks` and [a](docs/ops/engram.md#gate) or [b](https://x.y/z).\n"
            "```bash\npython -m pytest tests/engram/test_engram_gate.py -q\n```\n"
            "```python\nopen('tests/not/checked.py')\n```\n")
    assert referenced_paths(text) == ["docs/ops/engram.md#gate", "docs/ops/mhc.md#sinkhorn", "limits.py",
                                      "tests/engram/test_engram_gate.py", "tools/run_tests.py"]
    tree = "## Layout\n\n```\nsrc/pkg/\n  a.py     comment\n  sub/\n    b/     more\n  c/\ntools/   x\n```\n"
    assert layout_tree_paths(tree) == ["src/pkg/", "src/pkg/a.py", "src/pkg/sub/", "src/pkg/sub/b/", "src/pkg/c/",
                                       "tools/"]
    assert _slug("`engram_gate_forward` (out of place)") == "engram_gate_forward-out-of-place"
    assert _slug("fused_weight") == "fused_weight"


# --- the test command and the quickstart ---------------------------------------------------------------


def test_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    ci_commands = [line.strip() for line in ci if "python -m pytest" in line and not line.lstrip().startswith("#")]
    assert len(ci_commands) == 1, ci_commands
    blocks = [body.strip() for lang, body, heading in fenced_blocks(readme()) if heading == "Tests" and lang == "bash"]
    assert blocks and blocks[0] == ci_commands[0], (blocks[:1], ci_commands)


def test_quickstart_runs_on_the_cpu_references(capsys):
    """The quickstart with ``device = "cpu"``: the test references (registered as the ops' CPU kernels by
    the references plugin) stand in for the kernels, so its PyTorch expression and its tolerance are
    checked against the reference the device tests use."""
    blocks = [body for lang, body, heading in fenced_blocks(readme()) if heading.startswith("Quickstart")]
    assert len(blocks) == 3
    code = blocks[0]
    assert code.count('device = "cuda"') == 1
    code = code.replace('device = "cuda"', 'device = "cpu"')
    torch.manual_seed(0)
    exec(compile(code, "README.md (quickstart)", "exec"), {})
    out = capsys.readouterr().out
    match = re.search(r"engram_gate_forward matches PyTorch; max \|diff\| = (\S+)", out)
    assert match and 0 <= float(match[1]) < 0.1


def test_mhc_quickstart_runs_on_the_cpu_references():
    """The mHC quickstart with ``device = "cpu"`` and a few tokens (the references stand in for the kernels):
    the model builds, runs forward and backward, and every parameter gets a finite gradient."""
    blocks = [body for lang, body, heading in fenced_blocks(readme()) if heading.startswith("Quickstart")]
    code = blocks[1]
    assert code.count('device = 1024, "cuda"') == 1 and code.count("randn(8, 512, H,") == 1
    code = code.replace('device = 1024, "cuda"', 'device = 1024, "cpu"').replace("randn(8, 512, H,", "randn(2, 3, H,")
    torch.manual_seed(0)
    scope = {}
    exec(compile(code, "README.md (mHC quickstart)", "exec"), scope)
    assert scope["h"].shape == (2, 3, 1024) and torch.isfinite(scope["x"].grad.float()).all()
    for p in [*scope["blocks"].parameters(), *scope["head"].parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad.float()).all()


@pytest.mark.parametrize("name", ["OPS_TILELANG_DEBUG", "OPS_TILELANG_NUM_SMS", "OPS_TILELANG_NUM_VEC_CORES",
                                  "OPS_TILELANG_TEST_LEVEL"])
def test_environment_variables_are_read_by_the_code(name):
    assert f"`{name}`" in section(readme(), "Environment variables")
    sources = [p.read_text() for p in [*PACKAGE.rglob("*.py"), *(ROOT / "tests" / "_plugins").rglob("*.py")]]
    assert any(name in source for source in sources), f"{name} is documented but read nowhere"


def test_engram_quickstart_runs_on_the_cpu_references():
    """The Engram-layer quickstart with ``device = "cpu"`` and a short sequence (the references stand in for the
    gate's kernels): the layer runs forward and backward, and every parameter gets a finite gradient."""
    blocks = [body for lang, body, heading in fenced_blocks(readme()) if heading.startswith("Quickstart")]
    code = blocks[2]
    assert code.count('device = 4096, "cuda"') == 1 and code.count("(2, 512") == 3
    code = code.replace('device = 4096, "cuda"', 'device = 512, "cpu"').replace("(2, 512", "(2, 6")
    torch.manual_seed(0)
    scope = {}
    exec(compile(code, "README.md (Engram quickstart)", "exec"), scope)
    assert scope["y"].shape == (2, 6, 4, 512) and torch.isfinite(scope["x"].grad.float()).all()
    for p in scope["layer"].parameters():
        assert p.grad is not None and torch.isfinite(p.grad.float()).all()


# --- torch.compile ---------------------------------------------------------------------------------------------


def python_blocks(heading: str) -> list[str]:
    return [body for lang, body, h in fenced_blocks(readme()) if h == heading and lang == "python"]


def test_compile_model_runs_on_the_cpu_references_without_recompiling():
    """The section's first block on the CPU (``aot_eager``: inductor would generate C++ for the CPU) with three
    small token counts: forward and backward of every count through one compilation, as the block says."""
    code = python_blocks("torch.compile")[0]
    for old, new in [('H, device = 1024, "cuda"', 'H, device = 1024, "cpu"'),
                     ("torch.compile(model, fullgraph=True, dynamic=True)",
                      'torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)'),
                     ("for tokens in (512, 1000, 4096):", "for tokens in (5, 9, 14):")]:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    torch._dynamo.reset()
    scope = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        exec(compile(code, "README.md (torch.compile)", "exec"), scope)
    assert scope["x"].shape == (14, 1024) and torch.isfinite(scope["x"].grad.float()).all()
    assert all(p.grad is not None for p in scope["model"].parameters())


def test_default_dynamic_compiles_the_second_token_count_once_more():
    """The section's claim: with ``dynamic=None`` the second token count compiles once more, later ones reuse it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from cann_ops_tilelang.modeling import MHCSublayer

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(MHCSublayer(256, torch.nn.Identity()), backend=counter, fullgraph=True)
    frames = []
    for tokens in (5, 9, 14, 20):
        compiled(torch.randn(tokens, 4, 256, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
        frames.append(counter.frame_count)
    assert frames == [1, 2, 2, 2]
    assert "the second token count\nseen compiles once more" in section(readme(), "torch.compile")


def test_main_grad_is_ignored_under_compile():
    """The section's claim: compiled, the modules' parameters get ``.grad`` and their ``main_grad`` stays as it was
    (eager: the reverse)."""
    from cann_ops_tilelang.modeling import EngramGate, MHCSublayer

    layer, gate = MHCSublayer(512, torch.nn.Identity()), EngramGate(512)
    params = [*layer.parameters(), *gate.parameters()]

    def run(fn_layer, fn_gate):
        residual = torch.randn(3, 4, 512, dtype=torch.bfloat16)
        kv = torch.randn(3, 5 * 512, dtype=torch.bfloat16)
        fn_gate(fn_layer(residual), kv).float().square().sum().backward()

    for p in params:
        p.main_grad = torch.zeros(p.shape)
    torch._dynamo.reset()
    run(torch.compile(layer, backend="aot_eager", fullgraph=True), torch.compile(gate, backend="aot_eager",
                                                                                   fullgraph=True))
    assert all(p.grad is not None and not p.main_grad.any() for p in params)
    for p in params:
        p.grad = None
    run(layer, gate)
    assert all(p.grad is None and p.main_grad.any() for p in params)
    assert "`main_grad` is ignored under compile" in section(readme(), "torch.compile")


# --- without a GPU ---------------------------------------------------------------------------------------------


def _environ() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def test_without_a_gpu_python_blocks_run_as_written():
    """Each block of the section in a fresh interpreter from the repository root, verbatim; what it prints is
    what it says."""
    blocks = python_blocks("Without a GPU")
    assert len(blocks) == 2
    meta, refs = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                                 env=_environ(), timeout=600) for code in blocks)
    assert meta.returncode == 0, meta.stderr[-4000:]
    assert meta.stdout.splitlines() == ["eager: (2, 64, 512) torch.bfloat16 on meta",
                                        "aot_eager: (2, 64, 512) torch.bfloat16 on meta"]
    assert refs.returncode == 0, refs.stderr[-4000:]
    assert refs.stdout.splitlines() == ["fused weight exact: True"]


def _commands(heading: str) -> list[str]:
    """The commands of the section's bash blocks, one a line, comments dropped."""
    return [line.split("#", 1)[0].strip() for lang, body, h in fenced_blocks(readme()) if h == heading
            and lang == "bash" for line in body.splitlines() if line.split("#", 1)[0].strip()]


def test_without_a_gpu_commands_run_as_written():
    """Every command of the section, as written (``python`` is this interpreter), from the repository root: the
    example on meta and on the references (its loss falls), the data-parallel tool on gloo (every mode checked
    against one process), the main command's lowering (no failure)."""
    commands = _commands("Without a GPU")
    assert len(commands) == 4 and all(c.startswith("python ") for c in commands), commands
    outputs = []
    for command in commands:
        argv = [sys.executable, *shlex.split(command)[1:]]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=_environ(), timeout=600)
        assert done.returncode == 0, (command, (done.stdout + done.stderr)[-4000:])
        outputs.append(done.stdout)
    meta, cpu, distributed, lowering = outputs
    assert "on meta (shapes only)" in meta and "loss" not in meta.replace("loss ()", "")
    first, last = map(float, re.search(r"^loss (\S+) -> (\S+)$", cpu, re.M).groups())
    assert last < first, cpu
    rows = re.findall(r"^(ddp|megatron|fsdp2) .* (True|False)$", distributed, re.M)
    assert sorted(rows) == [("ddp", "True"), ("fsdp2", "True"), ("megatron", "True")], distributed
    assert "failures: 0" in lowering and "lowered 1/1 within the UB budget" in lowering, lowering


# --- pyproject and LICENSE -------------------------------------------------------------------------------------


def test_pyproject_declares_the_license_file():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT" and project["project"]["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["project"]["classifiers"])  # SPDX only
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read the SPDX form
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")


# --- device tier: every Python block as written ----------------------------------------------------------------


def _device_blocks() -> list:
    """Every Python block of the README as ``pytest.param(code, id=<index>-<heading>)``, split into those that
    need torch_npu and the rest."""
    npu, rest = [], []
    for index, (lang, body, heading) in enumerate(b for b in fenced_blocks(readme()) if b[0] == "python"):
        param = pytest.param(body, id=f"{index}-{_slug(heading)}")
        (npu if "import torch_npu" in body else rest).append(param)
    return npu, rest


NPU_BLOCKS, OTHER_BLOCKS = _device_blocks()


def _check_printed(out: str) -> None:
    """The claims the blocks print hold."""
    for line in out.splitlines():
        if ": " in line and line.rsplit(": ", 1)[1] in ("True", "False"):
            assert line.endswith(": True"), line
    match = re.search(r"engram_gate_forward matches PyTorch; max \|diff\| = (\S+)", out)
    assert match is None or 0 <= float(match[1]) < 0.1, out


@requires_cuda
@pytest.mark.parametrize("code", OTHER_BLOCKS)
def test_readme_python_block_runs_as_written_on_cuda(code, capsys):
    """Each block verbatim (the device ones use "cuda"; those of "Without a GPU" run on meta and the CPU), in a
    fresh scope of this process (the working directory: the repository root, as the README says)."""
    torch._dynamo.reset()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    finally:
        os.chdir(cwd)
    torch.cuda.synchronize()
    _check_printed(capsys.readouterr().out)


@requires_npu
@pytest.mark.parametrize("code", NPU_BLOCKS)
def test_readme_python_block_runs_as_written_on_npu(code):
    torch._dynamo.reset()
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def test_readme_blocks_are_sorted_by_device():
    """One block needs torch_npu (the npugraph_ex one); each of the others runs on "cuda" or is one of the section
    "Without a GPU" (meta, the CPU)."""
    assert [p.id for p in NPU_BLOCKS] == ["7-torchcompile"], [p.id for p in NPU_BLOCKS]
    assert len(OTHER_BLOCKS) == 7
    for param in OTHER_BLOCKS:
        assert param.id.endswith("-without-a-gpu") or re.search(r'device = (\d+, )?"cuda"', param.values[0]), param.id
