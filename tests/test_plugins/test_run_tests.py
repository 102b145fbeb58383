"""tools/run_tests.py: phase commands, worker counts and exit codes."""

import importlib.util
import os
import sys

import pytest

from _plugins import device
from _plugins.testing import ENV_VARS, TESTS_DIR

_spec = importlib.util.spec_from_file_location("run_tests", TESTS_DIR.parent / "tools" / "run_tests.py")
run_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_tests)


@pytest.fixture
def devices(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)

    def set_count(kind, n):
        monkeypatch.setenv(device.KIND_ENV, kind)
        monkeypatch.setenv(device.COUNT_ENV, str(n))

    return set_count


def _cmds(monkeypatch, argv):
    calls = []
    monkeypatch.setattr(run_tests.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 0)
    assert run_tests.main(argv) == 0
    return [c[3:] for c in calls]  # drop python -m pytest


def test_phases_on_two_devices(devices, monkeypatch):
    devices("cuda", 2)
    t = str(TESTS_DIR)
    assert _cmds(monkeypatch, ["--benchmarks", "-x"]) == [
        ["-m", "not benchmark and not large_npu_mem", "-n", "8", "--dist", "loadgroup", t, "-x"],
        ["-m", "large_npu_mem and not benchmark", "-n", "2", "--dist", "loadgroup", t, "-x"],
        ["-m", "benchmark", "-n", "2", t, "-x"],
    ]


def test_phases_one_device_and_explicit_workers(devices, monkeypatch):
    devices("npu", 1)
    path = str(TESTS_DIR / "test_plugins")
    assert _cmds(monkeypatch, ["--workers", "3", "--large-workers", "1", "--benchmarks", path]) == [
        ["-m", "not benchmark and not large_npu_mem", "-n", "3", "--dist", "loadgroup", path],
        ["-m", "large_npu_mem and not benchmark", "-n", "1", "--dist", "loadgroup", path],
        ["-m", "benchmark", path],  # one device: no xdist
    ]


def test_cpu_host_defaults(devices, monkeypatch):
    devices("none", 0)
    cmds = _cmds(monkeypatch, [])
    assert [c[:4] for c in cmds] == [["-m", "not benchmark and not large_npu_mem", "-n", str(os.cpu_count())],
                                     ["-m", "large_npu_mem and not benchmark", "-n", "1"]]


@pytest.mark.parametrize(("codes", "rc"), [([0, 5], 0), ([5, 5, 0], 0), ([1, 0], 1), ([0, 0, 2], 1)])
def test_exit_code(devices, monkeypatch, capsys, codes, rc):
    devices("cuda", 2)
    it = iter(codes)
    monkeypatch.setattr(run_tests.subprocess, "call", lambda cmd, cwd: next(it))
    argv = ["--benchmarks"] if len(codes) == 3 else []
    assert run_tests.main(argv) == rc
    out = capsys.readouterr().out
    assert out.count("=== phase ") == 2 * len(codes)  # command line and result of every phase
    assert f"{sys.executable} -m pytest -m 'not benchmark and not large_npu_mem' -n 8" in out


def test_dry_run_runs_nothing(devices, monkeypatch, capsys):
    devices("cuda", 4)
    monkeypatch.setattr(run_tests.subprocess, "call", lambda *a, **k: pytest.fail("ran"))
    assert run_tests.main(["--dry-run", "--benchmarks"]) == 0
    assert "-m benchmark -n 4" in capsys.readouterr().out


def test_relative_paths_are_resolved_where_the_command_runs(devices, monkeypatch):
    """The phases run from the repository root: a path given relative to the current directory (with or
    without a node id) is passed as an absolute path, not dropped nor replaced by the whole tests/ tree."""
    devices("none", 0)
    monkeypatch.chdir(TESTS_DIR)
    cmds = _cmds(monkeypatch, ["--workers", "1", "test_limits.py::test_x", "-k", "y"])
    assert cmds[0][-3:] == [f"{TESTS_DIR / 'test_limits.py'}::test_x", "-k", "y"]
    assert str(TESTS_DIR) not in cmds[0][:-3]


@pytest.mark.parametrize("marker", [["-m", "device"], ["-mdevice"]])
def test_extra_marker_narrows_every_phase(devices, monkeypatch, marker):
    """pytest keeps the last -m only: a user's marker is joined to each phase's selection, not left to replace
    it (which would run the large-memory tests with the many workers of phase 1)."""
    devices("cuda", 1)
    cmds = _cmds(monkeypatch, ["--benchmarks", *marker, "-q"])
    assert [c[:2] for c in cmds] == [["-m", "(device) and (not benchmark and not large_npu_mem)"],
                                     ["-m", "(device) and (large_npu_mem and not benchmark)"],
                                     ["-m", "(device) and (benchmark)"]]
    assert all(c.count("-m") == 1 and c[-1] == "-q" for c in cmds)


def test_marker_without_expression_is_an_error(devices, monkeypatch, capsys):
    devices("none", 0)
    monkeypatch.setattr(run_tests.subprocess, "call", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exc:
        run_tests.main(["-m"])
    assert exc.value.code == 2 and "-m needs a marker expression" in capsys.readouterr().err
