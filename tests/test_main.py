"""The main command (``python -m cann_ops_tilelang``), CPU tier.

Argument errors are argparse usage errors (exit status 2) that name the argument and the range declared in
``limits.py``; the lowering runs are restricted to a few kernels (``--family``, ``--target``, ``--match``)
and their summary counts are checked against the family aggregators' ``lowering_cases``. The whole Engram
family at H = 512 (about 40 s on two cores) runs at test level 2.
"""

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

from cann_ops_tilelang import limits
from cann_ops_tilelang.__main__ import _parse, main

ROOT = Path(__file__).resolve().parent.parent
H = 512
ASCEND_ROW = re.compile(r"^  ascend (\S+)\s+AscendC\s+\d+ chars, UB\s+(\d+) / (\d+) B", re.M)
CUBIN_ROW = re.compile(r"^  cuda   (\S+)\s+sm_90a cubin\s+\d+ B, shared\s+(\d+) / (\d+) B,\s+(\d+) threads", re.M)
SOURCE_ROW = re.compile(r"^  cuda   (\S+)\s+CUDA source\s+(\d+) chars", re.M)


def cases(backend: str, family: str, match: str = "") -> list[str]:
    """The names ``<family>/<case>`` the main command lowers for ``backend``, those containing ``match``."""
    module = importlib.import_module(f"cann_ops_tilelang.kernels.{backend}.{family}")
    names = [f"{family}/{case}" for case in module.lowering_cases(H)]
    return [name for name in names if match in name]


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


@given(st.integers(-10, 9000), st.sampled_from([["engram"], ["mhc"], ["engram", "mhc"]]))
def test_hidden_size_accepted_exactly_in_the_declared_ranges(hidden, families):
    ranges = {"engram": limits.ENGRAM_HIDDEN, "mhc": limits.MHC_HIDDEN}
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
    (["--family", "norm"], "argument --family: invalid choice: 'norm'"),
    (["--target", "rocm"], "argument --target: invalid choice: 'rocm'"),
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
    for option in ("--hidden-size", "--tokens", "--steps", "--lower", "--family", "--target", "--match", "--verbose"):
        assert option in out
    assert f"engram: {limits.ENGRAM_HIDDEN.describe()}" in out
    assert f"mhc: {limits.MHC_HIDDEN.describe()}" in out


def test_a_match_that_selects_no_kernel_is_a_usage_error(capsys):
    assert main(["--family", "mhc", "--hidden-size", "256", "--match", "no_such_kernel"]) == 2
    assert "--match 'no_such_kernel' selects no kernel of mhc" in capsys.readouterr().err


def test_defaults_select_every_family_and_target():
    args = _parse([])
    assert (args.family, args.target) == (["engram", "mhc"], ["ascend", "cuda"])
    assert (args.hidden_size, args.tokens, args.lower) == (4096, 8192, False)
    assert args.hidden_size in limits.ENGRAM_HIDDEN and args.hidden_size in limits.MHC_HIDDEN


# --- lowering: real kernels ---------------------------------------------------------------------------


def test_lower_subset_counts_without_nvcc():
    """Both targets, a few kernels, nvcc hidden: AscendC lowered within the UB budget, CUDA sources generated
    and the cubins reported as not built (never "all lowered")."""
    ascend, cuda = cases("ascend", "engram", "fused_weight"), cases("cuda", "engram", "fused_weight")
    assert ascend and cuda, "the Engram aggregators have no fused_weight case"
    proc = run_main("--family", "engram", "--match", "fused_weight", "--hidden-size", str(H), "--lower",
                    hide_nvcc=True)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    a, c = len(ascend), len(cuda)
    assert f"  AscendC (Ascend 950): lowered {a}/{a} within the UB budget\n" in out
    assert (f"  CUDA (sm_90a): cubins not built: nvcc is not on PATH; CUDA sources generated {c}/{c} "
            "(shared memory is checked on the cubins)\n") in out
    assert "  failures: 0\n" in out
    assert re.search(r"^  total time: \d+\.\d s$", out, re.M)
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
                    "--lower")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    n = len(expected)
    assert f"  CUDA (sm_90a): cubins built {n}/{n} within the shared-memory budget\n" in out
    rows = CUBIN_ROW.findall(out)
    assert sorted(row[0] for row in rows) == sorted(expected)
    assert all(int(smem) <= int(budget) and 0 < int(threads) <= 1024 for _, smem, budget, threads in rows)


@pytest.mark.skipif(test_level() < 2, reason="the whole Engram family takes ~40 s: level 2")
def test_lower_whole_engram_family():
    proc = run_main("--family", "engram", "--hidden-size", str(H), "--lower")
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
    code = main(["--family", "engram", "--target", "ascend", "--hidden-size", str(H), "--lower", "-v"])
    out, err = capfd.readouterr()
    assert code == 1
    assert len(calls) == n
    assert f"  AscendC (Ascend 950): lowered {n - 2}/{n} within the UB budget (1 over budget, 1 failed)\n" in out
    assert "  failures: 2\n" in out
    assert re.search(r"^    ascend engram/\S+: FAILED: RuntimeError: boom$", out, re.M)
    over = rf"^    ascend engram/\S+: AscendC\s+10 chars, UB {budget + 1} / {budget} B  OVER BUDGET$"
    assert re.search(over, out, re.M)
    # the line is counted on its kernel's row, shown under it with -v (time stamp dropped), and never leaks
    row = r"OVER BUDGET  \(\d+\.\d s\)  \[1 TileLang line\]\n           \| Warning: a line TileLang printed\n"
    assert re.search(row, out)
    assert "  TileLang printed 1 line while lowering 1 kernel" in out
    assert "TileLang printed" not in err and "a line TileLang printed" not in err
