"""One real xdist run (two worker subprocesses): device binding per worker, and memory profiles and
benchmark records sent from the workers to the controller, which alone writes the files."""

import json

from _plugins import device
from _plugins.testing import ENV_VARS, INNER_ARGS, write_inner_tree

FAKE_MEMORY = """
import _plugins.memprofile as _mp

class _FakeMemory:
    kind = "npu"
    value = 0
    def reset(self):
        self.value = 0
    def peak(self):
        return self.value

_mp.backend_override = _FakeMemory()
"""


def test_xdist_workers_bind_and_report(pytester, monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # 3 fresh interpreters: keep them light
    monkeypatch.setenv(device.KIND_ENV, "cuda")
    monkeypatch.setenv(device.COUNT_ENV, "2")
    monkeypatch.setenv("OPS_TILELANG_BENCH_CHIP", "testchip")
    write_inner_tree(pytester, FAKE_MEMORY)
    fam = pytester.mkpydir("fam")
    (fam / "npu_mem_profiles").mkdir()
    (fam / "npu_mem_profiles" / "test_x.json").write_text(json.dumps({"test_old": 7}))
    (fam / "test_x.py").write_text(f"""
import os
import pytest
import _plugins.memprofile as mp

@pytest.mark.device
def test_bind():
    w = os.environ["PYTEST_XDIST_WORKER"]
    open(os.path.join({str(pytester.path)!r}, "bind-" + w), "w").write(os.environ["CUDA_VISIBLE_DEVICES"])
    mp.backend_override.value = 4096

@pytest.mark.benchmark
def test_bench(bench):
    bench.record("c", impl="ours", time_us=2.0, worker=os.environ["PYTEST_XDIST_WORKER"])
""")
    result = pytester.runpytest_subprocess(
        *INNER_ARGS, "-p", "xdist", "-n", "2", "--dist", "each", "--refresh-mem-profiles", "--run-benchmarks",
        "--bench-out", str(pytester.path / "out"))
    result.assert_outcomes(passed=4)
    assert (pytester.path / "bind-gw0").read_text() == "0"
    assert (pytester.path / "bind-gw1").read_text() == "1"
    profile = (fam / "npu_mem_profiles" / "test_x.json").read_text()
    assert json.loads(profile) == {"test_bind": 4096, "test_old": 7}
    assert profile.index('"test_bind"') < profile.index('"test_old"')
    records = [json.loads(line) for line in (pytester.path / "out" / "fam" / "testchip" / "test_x.jsonl").read_text().splitlines()]
    assert sorted(r["worker"] for r in records) == ["gw0", "gw1"]
    assert {(r["case"], r["impl"], r["time_us"], r["test"], r["chip"]) for r in records} == {("c", "ours", 2.0, "test_bench", "testchip")}


def test_loadgroup_names_drop_the_group_suffix(pytester, monkeypatch):
    """Under ``--dist loadgroup`` the profile entry of a grouped test is keyed by its plain name."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv(device.KIND_ENV, "cuda")
    monkeypatch.setenv(device.COUNT_ENV, "1")
    write_inner_tree(pytester, FAKE_MEMORY)
    fam = pytester.mkpydir("fam")
    (fam / "test_g.py").write_text("""
import pytest
import _plugins.memprofile as mp

@pytest.mark.device
@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.xdist_group("grp"))])
def test_grouped(n):
    mp.backend_override.value = 1024
""")
    result = pytester.runpytest_subprocess(*INNER_ARGS, "-p", "xdist", "-n", "1", "--dist", "loadgroup",
                                           "--refresh-mem-profiles")
    result.assert_outcomes(passed=1)
    assert json.loads((fam / "npu_mem_profiles" / "test_g.json").read_text()) == {"test_grouped[1]": 1024}
