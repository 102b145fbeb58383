"""The main command (``python -m cann_ops_tilelang``), CPU tier.

Argument errors are argparse usage errors (exit status 2) that name the argument and the range declared in
``limits.py``. What is lowered (the representative set: the first case of every kernel module of both backends;
``--all``: everything; ``--match``), the progress rows, the summary and the exit status are checked in this
process with the kernel modules' cases and the lowering replaced (``--jobs 1``); real lowering runs are
restricted to a few kernels (``--family``, ``--target``, ``--match``), one of them on two worker processes, and
their summary counts are checked against the family aggregators' ``lowering_cases``. The whole Engram family at
H = 512 (about 40 s on two cores) runs at test level 2.
"""

import functools
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _plugins.levels import test_level
from hypothesis import given
from hypothesis import strategies as st

import cann_ops_tilelang as ops
from cann_ops_tilelang import __main__ as main_module
from cann_ops_tilelang import limits
from cann_ops_tilelang.__main__ import FAMILIES, TARGETS, _cores, _parse, _parser, _select, main

ROOT = Path(__file__).resolve().parent.parent
H = 512
# a progress row: "[ 3/32] ascend ok            1.2 s  engram/gate/<case>  AscendC ...", one per kernel as it finishes
ROW = re.compile(r"^\[ *(\d+)/(\d+)\] (ascend|cuda  ) (ok|FAILED|OVER BUDGET) +(\d+\.\d) s  (\S+)  (.*)$", re.M)
ASCEND_ROW = re.compile(r"^\[ *\d+/\d+\] ascend ok +\d+\.\d s  (\S+)  AscendC\s+\d+ chars, UB\s+(\d+) / (\d+) B", re.M)
CUBIN_ROW = re.compile(r"^\[ *\d+/\d+\] cuda   ok +\d+\.\d s  (\S+)  sm_90a cubin\s+\d+ B, shared\s+(\d+) / (\d+) B,"
                       r"\s+(\d+) threads", re.M)
SOURCE_ROW = re.compile(r"^\[ *\d+/\d+\] cuda   ok +\d+\.\d s  (\S+)  CUDA source\s+(\d+) chars", re.M)


@functools.cache
def _all_cases(backend: str, family: str) -> tuple[str, ...]:
    module = importlib.import_module(f"cann_ops_tilelang.kernels.{backend}.{family}")
    return tuple(f"{family}/{case}" for case in module.lowering_cases(H))


def cases(backend: str, family: str, match: str = "") -> list[str]:
    """The names ``<family>/<op module>/<case>`` of ``backend``'s kernels (the family aggregator's), those
    containing ``match``."""
    return [name for name in _all_cases(backend, family) if match in name]


def run_main(*args: str, hide_nvcc: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if hide_nvcc:
        env.pop("NVCC", None)
        env.pop("CUDA_HOME", None)
        dirs = env.get("PATH", "").split(os.pathsep)
        env["PATH"] = os.pathsep.join(d for d in dirs if not os.access(os.path.join(d, "nvcc"), os.X_OK))
    return subprocess.run([sys.executable, "-m", "cann_ops_tilelang", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


# --- arguments ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,range_", [
    (["--hidden-size", "100"], limits.ENGRAM_HIDDEN),
    (["--hidden-size", "320"], limits.ENGRAM_HIDDEN),  # an mHC size, not an Engram one
    (["--hidden-size", "8448"], limits.ENGRAM_HIDDEN),
    (["--family", "mhc", "--hidden-size", "100"], limits.MHC_HIDDEN),
    (["--family", "mhc", "--hidden-size", "8256"], limits.MHC_HIDDEN),
])
def test_bad_hidden_size_is_a_usage_error(argv, range_, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --hidden-size" in err
    assert f"{argv[-1]} is not supported" in err
    assert range_.describe() in err
    assert "Traceback" not in err and "AssertionError" not in err


@given(st.integers(-10, 9000), st.lists(st.sampled_from(FAMILIES), min_size=1, max_size=len(FAMILIES), unique=True))
def test_hidden_size_accepted_exactly_in_the_declared_ranges(hidden, families):
    ranges = {family: limits.hidden_sizes(family)[1] for family in FAMILIES}
    argv = ["--hidden-size", str(hidden)] + [arg for family in families for arg in ("--family", family)]
    if all(hidden in ranges[family] for family in families):
        assert _parse(argv).hidden_size == hidden
    else:
        with pytest.raises(SystemExit) as exit_:
            _parse(argv)
        assert exit_.value.code == 2


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "0"], "argument --tokens: expected an integer >= 1, got 0"),
    (["--tokens", "-3"], "argument --tokens: expected an integer >= 1, got -3"),
    (["--tokens", "many"], "argument --tokens: expected an integer >= 1, got 'many'"),
    (["--steps", "-1"], "argument --steps: expected an integer >= 0, got -1"),
    (["--family", "attention"], "argument --family: invalid choice: 'attention'"),
    (["--target", "rocm"], "argument --target: invalid choice: 'rocm'"),
    (["--jobs", "0"], "argument -j/--jobs: expected an integer >= 1, got 0"),
    (["-j", "-2"], "argument -j/--jobs: expected an integer >= 1, got -2"),
    (["--jobs", "two"], "argument -j/--jobs: expected an integer >= 1, got 'two'"),
])
def test_bad_counts_and_choices_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_help_names_the_options_and_the_ranges(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for option in ("--hidden-size", "--tokens", "--steps", "--lower", "--all", "--jobs", "--family", "--target",
                   "--match", "--verbose"):
        assert option in out
    for family in FAMILIES:
        assert f"{family}: {limits.hidden_sizes(family)[1].describe()}" in out
    assert f"engram: {limits.ENGRAM_HIDDEN.describe()}" in out


def test_a_match_that_selects_no_kernel_is_a_usage_error(capsys):
    assert main(["--family", "mhc", "--hidden-size", "256", "--match", "no_such_kernel", "--jobs", "1"]) == 2
    assert "--match 'no_such_kernel' selects no kernel of mhc" in capsys.readouterr().err


def test_defaults_select_every_family_and_target():
    args = _parse([])
    # the families are those of the registered ops (no list kept in __main__.py)
    assert FAMILIES == tuple(sorted({p.declaration.family for p in ops.registered_ops().values()}))
    assert "engram" in FAMILIES and "mhc" in FAMILIES
    assert (args.family, args.target) == (list(FAMILIES), ["ascend", "cuda"])
    assert (args.hidden_size, args.tokens, args.lower, args.every, args.match) == (4096, 8192, False, False, None)
    assert args.jobs == _cores() >= 1 and _parse(["--jobs", "3"]).jobs == 3 and _parse(["--all"]).every
    assert args.hidden_size in limits.ENGRAM_HIDDEN and args.hidden_size in limits.MHC_HIDDEN


# --- what is lowered: the kernel modules' cases and the lowering replaced, in this process (--jobs 1) -------


def kernel_modules() -> list[tuple[str, str, str]]:
    """``(target, family, op module)`` of every kernel module, from the folders (what the aggregators list)."""
    return [(t, f, path.stem) for t in TARGETS for f in FAMILIES
            for path in sorted((ROOT / "src/cann_ops_tilelang/kernels" / t / f).iterdir())
            if not path.name.startswith("_") and (path.suffix == ".py" or (path / "__init__.py").exists())]


def fake_cases(module: str) -> list[str]:
    """1 to 3 made-up case names per module (how many depends on the name), in a fixed order."""
    return [f"{module}_v{i}" for i in range(1 + len(module) % 3)]


@pytest.fixture
def fake_lowering(monkeypatch):
    """Kernel modules that list :func:`fake_cases`, and a lowering that succeeds unless the case is in ``fail``
    (raises) or ``over`` (over the budget); ``lowered`` records ``(target, name)`` in the order of the calls."""
    state = SimpleNamespace(fail=set(), over=set(), lowered=[], broken=set())

    def module_cases(target, family, module, hidden_size):
        if module in state.broken:
            raise ImportError(f"no module {module}")
        return {case: (family, case) for case in fake_cases(module)}

    def lower_one(target, build, prim_func, nvcc, result):
        _, case = prim_func
        state.lowered.append((target, result.name))
        if case in state.fail:
            raise RuntimeError("boom")
        result.built, result.over_budget = True, case in state.over
        result.what = f"fake {case}"
        result.ok = not result.over_budget

    monkeypatch.setattr(main_module, "_module_cases", module_cases)
    monkeypatch.setattr(main_module, "_lower_one", lower_one)
    return state


def progress_rows(out: str) -> list[tuple]:
    """The progress rows: ``(index, total, target, name, status, text)``."""
    return [(int(i), int(n), t.strip(), name, status, text) for i, n, t, status, _, name, text in ROW.findall(out)]


def test_default_lowers_the_first_case_of_every_kernel_module_of_both_backends(fake_lowering, capsys):
    modules = kernel_modules()
    for target in TARGETS:  # both backends, both families, every op module of each family has a kernel module
        for family in FAMILIES:
            declared = {p.declaration.module for p in ops.registered_ops().values() if p.declaration.family == family}
            assert {m for t, f, m in modules if (t, f) == (target, family)} == declared, (target, family)
    assert main(["--jobs", "1", "--hidden-size", str(H)]) == 0
    out = capsys.readouterr().out
    expected = [(t, f"{f}/{m}/{fake_cases(m)[0]}") for t, f, m in modules]
    assert fake_lowering.lowered == expected  # the first case of each module, in the modules' fixed order
    n, total = len(modules), sum(len(fake_cases(m)) for _, _, m in modules)
    assert [row[:5] for row in progress_rows(out)] == [
        (i + 1, n, t, name, "ok") for i, (t, name) in enumerate(expected)]
    assert (f"lowering the first kernel of each {', '.join(FAMILIES)} kernel module (--all: every kernel) at H=512 "
            f"for AscendC (Ascend 950) and CUDA (sm_90a), in this process\n") in out
    assert f"summary (H={H}; {n} of the {total} kernels):\n" in out
    assert f"  AscendC (Ascend 950): lowered {n // 2}/{n // 2} within the UB budget\n" in out
    assert "  failures: 0\n" in out


def test_selection_is_deterministic():
    listing = {(t, f, m): fake_cases(m) for t, f, m in kernel_modules()}
    first = _select(listing, False, None)
    assert first == _select(dict(listing), False, None)
    assert first == [(module, names[0]) for module, names in listing.items()]
    # the listing order is what counts, not the order in which the enumerations finished
    assert _select(dict(reversed(listing.items())), False, None) == first[::-1]
    everything = _select(listing, True, None)
    assert everything == [(module, case) for module, names in listing.items() for case in names]
    assert len(everything) > len(first)
    # --match selects among every case, whatever --all says
    matched = [(m, c) for m, c in everything if "sinkhorn/" in f"{m[1]}/{m[2]}/{c}"]
    assert matched and _select(listing, False, "sinkhorn/") == _select(listing, True, "sinkhorn/") == matched


def test_all_lowers_every_kernel(fake_lowering, capsys):
    assert main(["--jobs", "1", "--all", "--hidden-size", str(H)]) == 0
    out = capsys.readouterr().out
    expected = [(t, f"{f}/{m}/{case}") for t, f, m in kernel_modules() for case in fake_cases(m)]
    assert fake_lowering.lowered == expected
    assert [(row[0], row[1], row[2], row[3]) for row in progress_rows(out)] == [
        (i + 1, len(expected), t, name) for i, (t, name) in enumerate(expected)]
    assert f"summary (H={H}; {len(expected)} of the {len(expected)} kernels):\n" in out
    assert f"lowering every {', '.join(FAMILIES)} kernel at H=512" in out


def test_a_failed_lowering_makes_the_exit_status_1(fake_lowering, capsys):
    fake_lowering.fail = {"gate_v0"}
    fake_lowering.over = {"hash_v0"}
    assert main(["--jobs", "1", "--family", "engram", "--target", "cuda", "--hidden-size", str(H)]) == 1
    out = capsys.readouterr().out
    statuses = {name: (status, text) for _, _, _, name, status, text in progress_rows(out)}
    assert statuses["engram/gate/gate_v0"] == ("FAILED", "RuntimeError: boom")
    assert statuses["engram/hash/hash_v0"] == ("OVER BUDGET", "fake hash_v0")
    assert sum(status == "ok" for status, _ in statuses.values()) == len(statuses) - 2
    assert "  CUDA (sm_90a): cubins built 3/5 within the shared-memory budget (1 over budget, 1 failed)\n" in out \
        or "CUDA sources generated 3/5 (1 over budget, 1 failed)" in out
    assert "  failures: 2\n    cuda engram/gate/gate_v0: FAILED: RuntimeError: boom\n" \
           "    cuda engram/hash/hash_v0: OVER BUDGET: fake hash_v0\n" in out


def test_a_kernel_module_that_fails_to_list_its_cases_is_a_failure(fake_lowering, capsys):
    fake_lowering.broken = {"hash"}
    assert main(["--jobs", "1", "--family", "engram", "--target", "ascend", "--hidden-size", str(H)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^ascend FAILED +\d+\.\d s  engram/hash: lowering_cases\(512\)  ImportError: no module hash$",
                     out, re.M)
    assert len(progress_rows(out)) == 4 and all(row[4] == "ok" for row in progress_rows(out))
    assert "  failures: 1\n    ascend engram/hash: lowering_cases(512): FAILED: ImportError: no module hash\n" in out


# --- lowering: real kernels ---------------------------------------------------------------------------


def test_lower_subset_counts_without_nvcc():
    """Both targets, a few kernels, nvcc hidden: AscendC lowered within the UB budget, CUDA sources generated
    and the cubins reported as not built (never "all lowered")."""
    ascend, cuda = cases("ascend", "engram", "fused_weight"), cases("cuda", "engram", "fused_weight")
    assert ascend and cuda, "the Engram aggregators have no fused_weight case"
    proc = run_main("--family", "engram", "--match", "fused_weight", "--hidden-size", str(H), "--lower",
                    "--jobs", "2", hide_nvcc=True)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    a, c = len(ascend), len(cuda)
    assert ", on 2 worker processes\n" in out
    assert sorted(row[0] for row in progress_rows(out)) == list(range(1, a + c + 1))  # one progress row per kernel
    everything = len(cases("ascend", "engram")) + len(cases("cuda", "engram"))
    assert f"summary (H={H}; {a + c} of the {everything} kernels):\n" in out
    assert f"  AscendC (Ascend 950): lowered {a}/{a} within the UB budget\n" in out
    assert (f"  CUDA (sm_90a): cubins not built: nvcc is not on PATH; CUDA sources generated {c}/{c} "
            "(shared memory is checked on the cubins)\n") in out
    assert "  failures: 0\n" in out
    assert re.search(r"^  total time: \d+\.\d s \(lowering \d+\.\d s summed over the kernels\)$", out, re.M)
    assert "all lowered" not in out and "cubins built" not in out
    rows = ASCEND_ROW.findall(out)
    assert sorted(name for name, _, _ in rows) == sorted(ascend)
    assert all(0 < int(ub) <= int(budget) for _, ub, budget in rows)
    rows = SOURCE_ROW.findall(out)
    assert sorted(name for name, _ in rows) == sorted(cuda)
    assert all(int(chars) > 0 for _, chars in rows)
    assert not re.search(r"^\[\d\d:\d\d:\d\d\]", proc.stderr, re.M), proc.stderr  # no TileLang log line leaks


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_lower_cuda_cubins_within_shared_memory():
    expected = cases("cuda", "engram", "fused_weight")
    proc = run_main("--family", "engram", "--target", "cuda", "--match", "fused_weight", "--hidden-size", str(H),
                    "--lower", "--jobs", "1")  # the test runs beside others: one process (the pool is tested above)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    n = len(expected)
    assert f"  CUDA (sm_90a): cubins built {n}/{n} within the shared-memory budget\n" in out
    rows = CUBIN_ROW.findall(out)
    assert sorted(row[0] for row in rows) == sorted(expected)
    assert all(int(smem) <= int(budget) and 0 < int(threads) <= 1024 for _, smem, budget, threads in rows)


@pytest.mark.skipif(test_level() < 2, reason="the whole Engram family takes ~40 s: level 2")
def test_lower_whole_engram_family():
    proc = run_main("--family", "engram", "--hidden-size", str(H), "--lower", "--all")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    a, c = len(cases("ascend", "engram")), len(cases("cuda", "engram"))
    assert f"  AscendC (Ascend 950): lowered {a}/{a} within the UB budget\n" in out
    if shutil.which("nvcc"):
        assert f"  CUDA (sm_90a): cubins built {c}/{c} within the shared-memory budget\n" in out
    else:
        assert f"CUDA sources generated {c}/{c}" in out
    assert len(ASCEND_ROW.findall(out)) == a


# --- lowering: failures, budgets and TileLang's output (the builder replaced) -------------------------


def test_failures_budgets_and_tilelang_lines_are_reported(monkeypatch, capfd):
    build = importlib.import_module("cann_ops_tilelang.kernels.ascend._build")
    budget = 248 * 1024
    calls = []

    def fake_lower(prim_func):
        calls.append(prim_func)
        if len(calls) == 1:
            raise RuntimeError("boom")
        if len(calls) == 2:
            os.write(2, b"[12:34:56] : Warning: a line TileLang printed\n")
            return SimpleNamespace(source="x" * 10, ub_bytes=budget + 1, budget_bytes=budget)
        return SimpleNamespace(source="x" * 10, ub_bytes=1024, budget_bytes=budget)

    monkeypatch.setattr(build, "lower_ascendc", fake_lower)
    n = len(cases("ascend", "engram"))
    assert n >= 3
    capfd.readouterr()
    code = main(["--family", "engram", "--target", "ascend", "--hidden-size", str(H), "--lower", "--all", "-v",
                 "--jobs", "1"])
    out, err = capfd.readouterr()
    assert code == 1
    assert len(calls) == n
    assert f"  AscendC (Ascend 950): lowered {n - 2}/{n} within the UB budget (1 over budget, 1 failed)\n" in out
    assert "  failures: 2\n" in out
    assert re.search(r"^    ascend engram/\S+: FAILED: RuntimeError: boom$", out, re.M)
    over = rf"^    ascend engram/\S+: OVER BUDGET: AscendC\s+10 chars, UB {budget + 1} / {budget} B$"
    assert re.search(over, out, re.M)
    # the line is counted on its kernel's row, shown under it with -v (time stamp dropped), and never leaks
    row = (rf"\] ascend OVER BUDGET +\d+\.\d s  engram/\S+  AscendC\s+10 chars, UB {budget + 1} / {budget} B  "
           r"\[1 TileLang line\]\n           \| Warning: a line TileLang printed\n")
    assert re.search(row, out)
    assert "  TileLang printed 1 line while lowering 1 kernel" in out
    assert "TileLang printed" not in err and "a line TileLang printed" not in err


# --- README.md, section "Main command", and the install check --------------------------------------------


def readme_section(heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", (ROOT / "README.md").read_text(), re.M | re.S)
    assert match, f"README.md has no section '## {heading}'"
    return match[1]


def test_readme_main_command_names_every_option_and_the_representative_set():
    section = readme_section("Main command")
    options = [o for a in _parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert [o for o in options if o not in section] == []
    modules = kernel_modules()
    per_target = len(modules) // 2
    assert f"summary (H=4096; {len(modules)} of the " in section
    assert f"  AscendC (Ascend 950): lowered {per_target}/{per_target} within the UB budget\n" in section
    assert f"  CUDA (sm_90a): cubins built {per_target}/{per_target} within the shared-memory budget\n" in section
    assert f"{len(modules)} of the " in section and f"| `python -m cann_ops_tilelang` | {len(modules)} |" in section
    # the install section's check is the default command (the fast one), and points here
    install = readme_section("Install")
    assert re.search(r"^python -m cann_ops_tilelang +# check\b.*\"Main command\"", install, re.M), install


@pytest.mark.skipif(test_level() < 2, reason="enumerates every kernel at H = 4096 (about 10 s): level 2")
def test_readme_kernel_counts_at_the_default_size():
    """The counts the README and the help state: every kernel at H = 4096, and the representative set."""
    modules = main_module._kernel_modules(TARGETS, FAMILIES)
    total = sum(len(main_module._module_cases(*module, 4096)) for module in modules)
    section = readme_section("Main command")
    assert f"{len(modules)} of the {total} kernels" in section
    assert f"| `python -m cann_ops_tilelang --all` | {total} |" in section
    assert f"(one kernel per module and target, {len(modules)} in all)" in main_module.__doc__
    assert f"every kernel variant ({total} at H = 4096)" in main_module.__doc__
