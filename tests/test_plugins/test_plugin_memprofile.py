"""large_npu_mem classification from the profiles, and --refresh-mem-profiles."""

import json

import pytest

from _plugins import device, memprofile
from _plugins.testing import INNER_ARGS

MIB = 2**20

TESTS = """
import pytest
import _plugins.memprofile as mp
from _plugins.device import requires_device

@pytest.mark.device
def test_small():
    pass

@pytest.mark.device
def test_big():
    pass

@pytest.mark.device
def test_missing():
    pass

@pytest.mark.device
@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    pass

@requires_device
def test_requires_missing():  # `device` comes from requires_device: unprofiled, so large
    pass

def test_cpu():
    pass

def test_cpu_unprofiled():
    pass
"""

PROFILE = {"test_small": 1 * MIB, "test_big": 2048 * MIB, "test_cpu": 10**12, "test_param[1]": 5 * MIB,
           "test_param[2]": 100 * MIB}


def _collected(result) -> list[str]:
    return sorted(line.split("::", 1)[1] for line in result.stdout.lines if "::" in line)


@pytest.fixture
def tree(inner, monkeypatch):
    monkeypatch.setattr(device, "_DEVICE_TYPE", "npu")
    fam = inner.mkpydir("fam")
    (fam / "test_m.py").write_text(TESTS)
    (fam / "npu_mem_profiles").mkdir()
    (fam / "npu_mem_profiles" / "test_m.json").write_text(json.dumps(PROFILE))
    return inner


def test_large_and_missing_profiles_marked(tree):
    r = tree.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "large_npu_mem", "--large-mem-threshold", "64")
    assert _collected(r) == ["test_big", "test_missing", "test_param[2]", "test_requires_missing"]
    r = tree.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "not large_npu_mem", "--large-mem-threshold", "64")
    assert _collected(r) == ["test_cpu", "test_cpu_unprofiled", "test_param[1]", "test_small"]


def test_default_threshold_16gib(tree):
    r = tree.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "large_npu_mem")
    assert _collected(r) == ["test_missing", "test_requires_missing"]


def test_threshold_from_env(tree, monkeypatch):
    monkeypatch.setenv(memprofile.THRESHOLD_ENV, "4")  # MiB
    r = tree.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "large_npu_mem")
    assert _collected(r) == ["test_big", "test_missing", "test_param[1]", "test_param[2]", "test_requires_missing"]
    # the option wins over the environment
    r = tree.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "large_npu_mem", "--large-mem-threshold", "4096")
    assert _collected(r) == ["test_missing", "test_requires_missing"]


def test_cuda_uses_cuda_profiles(tree, monkeypatch):
    monkeypatch.setattr(device, "_DEVICE_TYPE", "cuda")
    r = tree.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "large_npu_mem")
    assert _collected(r) == ["test_big", "test_missing", "test_param[1]", "test_param[2]", "test_requires_missing",
                             "test_small"]  # no cuda file
    (tree.path / "fam" / "cuda_mem_profiles").mkdir()
    (tree.path / "fam" / "cuda_mem_profiles" / "test_m.json").write_text(json.dumps({"test_big": 1, "test_missing": 1}))
    r = tree.runpytest(*INNER_ARGS, "--collect-only", "-q", "-m", "large_npu_mem")
    assert _collected(r) == ["test_param[1]", "test_param[2]", "test_requires_missing", "test_small"]


class FakeMemory:
    kind = "npu"

    def __init__(self):
        self.value = -1
        self.resets = 0

    def reset(self):
        self.resets += 1
        self.value = 0

    def peak(self):
        return self.value


def test_refresh_merges_and_sorts(inner, monkeypatch):
    fake = FakeMemory()
    monkeypatch.setattr(memprofile, "backend_override", fake)
    fam = inner.mkpydir("fam")
    (fam / "npu_mem_profiles").mkdir()
    (fam / "npu_mem_profiles" / "test_r.json").write_text(json.dumps({"test_z_old": 5, "test_b": 1}))
    (fam / "test_r.py").write_text("""
import pytest
import _plugins.memprofile as mp

@pytest.mark.device
def test_b():
    mp.backend_override.value = 3000

@pytest.mark.device
@pytest.mark.parametrize("n", [7])
def test_a(n):
    mp.backend_override.value = 1000 * n

@pytest.mark.device
def test_fails():
    mp.backend_override.value = 99
    assert False

def test_cpu():
    mp.backend_override.value = 123
""")
    r = inner.runpytest(*INNER_ARGS, "--refresh-mem-profiles")
    r.assert_outcomes(passed=3, failed=1)
    text = (fam / "npu_mem_profiles" / "test_r.json").read_text()
    assert text == json.dumps({"test_a[7]": 7000, "test_b": 3000, "test_z_old": 5}, indent=1) + "\n"
    assert fake.resets == 3  # reset before each device test only
    r.stdout.fnmatch_lines(["recorded 2 test(s) into 1 profile file(s)"])


def test_no_refresh_writes_nothing(inner, monkeypatch):
    monkeypatch.setattr(memprofile, "backend_override", FakeMemory())
    inner.makepyfile(test_n="import pytest\n@pytest.mark.device\ndef test_x():\n    pass\n")
    inner.runpytest(*INNER_ARGS).assert_outcomes(passed=1)
    assert not (inner.path / "npu_mem_profiles").exists()
