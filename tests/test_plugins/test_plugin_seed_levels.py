"""Per-test seeds (stable across start directories, rootdirs and workers) and test levels."""

import hashlib
import re

import pytest

from _plugins import levels
from _plugins.testing import INNER_ARGS

SEED_TEST = """
import random
import pytest
import torch

@pytest.mark.parametrize("k", [2])
def test_a(seed, k):
    g = torch.Generator().manual_seed(seed)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=g))  # torch was seeded with `seed`
    print(f"SEED {seed} RANDOM {random.random()!r}")
"""


def _expected(base: int, rel_nodeid: str) -> int:
    return (base + int(hashlib.sha256(rel_nodeid.encode()).hexdigest(), 16)) % 2**31


def _seeds(result) -> list[int]:
    return [int(m) for m in re.findall(r"SEED (\d+)", result.stdout.str())]


def test_seed_same_from_every_start_dir(inner, monkeypatch):
    fam = inner.mkpydir("fam")
    (fam / "test_s.py").write_text(SEED_TEST)
    want = _expected(0, "fam/test_s.py::test_a[2]")

    from_root = inner.runpytest(*INNER_ARGS, "-s", "fam/test_s.py")
    from_root.assert_outcomes(passed=1)
    assert _seeds(from_root) == [want]

    monkeypatch.chdir(fam)  # node id "test_s.py::..." would differ without the tests-root relativisation
    from_fam = inner.runpytest(*INNER_ARGS, "-s", "--rootdir", str(fam), "--confcutdir", str(inner.path), "test_s.py")
    from_fam.assert_outcomes(passed=1)
    assert _seeds(from_fam) == [want]

    monkeypatch.chdir(inner.path.parent)  # rootdir above the tests root: node id "<dir>/fam/test_s.py::..."
    from_above = inner.runpytest(*INNER_ARGS, "-s", "--rootdir", str(inner.path.parent), str(fam / "test_s.py"))
    from_above.assert_outcomes(passed=1)
    assert _seeds(from_above) == [want]
    # random was seeded identically too
    assert re.findall(r"RANDOM (\S+)", from_root.stdout.str()) == re.findall(r"RANDOM (\S+)", from_above.stdout.str())


def test_seed_option_changes_seed(inner):
    fam = inner.mkpydir("fam")
    (fam / "test_s.py").write_text(SEED_TEST)
    result = inner.runpytest(*INNER_ARGS, "-s", "--seed", "12345", "fam/test_s.py")
    result.assert_outcomes(passed=1)
    assert _seeds(result) == [_expected(12345, "fam/test_s.py::test_a[2]")]
    assert _seeds(result) != [_expected(0, "fam/test_s.py::test_a[2]")]


def test_seed_shown_on_failure(inner):
    inner.makepyfile(test_f="def test_fail():\n    assert False\n")
    result = inner.runpytest(*INNER_ARGS, "--seed", "3")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"seed={_expected(3, 'test_f.py::test_fail')} (--seed=3, node id test_f.py::test_fail)"])


@pytest.mark.parametrize(("value", "level", "choice"), [(None, 1, ["b"]), ("", 1, ["b"]), ("0", 0, ["a"]),
                                                        ("1", 1, ["b"]), ("2", 2, ["c"])])
def test_level_from_env(monkeypatch, value, level, choice):
    if value is None:
        monkeypatch.delenv(levels.LEVEL_ENV, raising=False)
    else:
        monkeypatch.setenv(levels.LEVEL_ENV, value)
    assert levels.test_level() == level
    assert levels.level_choice(["a"], ["b"], ["c"]) == choice


def test_level2_defaults_to_level1(monkeypatch):
    monkeypatch.setenv(levels.LEVEL_ENV, "2")
    assert levels.level_choice([1], [1, 2]) == [1, 2]


@pytest.mark.parametrize("value", ["3", "full", "-1", "1.0"])
def test_invalid_level_raises(monkeypatch, value):
    monkeypatch.setenv(levels.LEVEL_ENV, value)
    with pytest.raises(ValueError, match=re.escape(f"OPS_TILELANG_TEST_LEVEL={value!r} is invalid: use 0 (quick), 1 (default) or 2 (full)")):
        levels.test_level()


def test_invalid_level_is_usage_error(inner, monkeypatch):
    inner.makepyfile(test_l="def test_x():\n    pass\n")
    monkeypatch.setenv(levels.LEVEL_ENV, "9")
    result = inner.runpytest(*INNER_ARGS)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: OPS_TILELANG_TEST_LEVEL='9' is invalid: use 0 (quick), 1 (default) or 2 (full)"])


def test_level_grid_in_inner_run_and_helper_not_collected(inner, monkeypatch):
    inner.makepyfile(test_l="""
        import pytest
        from _plugins.levels import level_choice, test_level

        @pytest.mark.parametrize("n", level_choice([1], [1, 2], [1, 2, 3]))
        def test_n(n):
            assert test_level() == 0
    """)
    monkeypatch.setenv(levels.LEVEL_ENV, "0")
    result = inner.runpytest(*INNER_ARGS)
    result.assert_outcomes(passed=1)  # test_level imported into the module is not collected
    monkeypatch.setenv(levels.LEVEL_ENV, "2")
    result = inner.runpytest(*INNER_ARGS, "--collect-only", "-q")
    result.stdout.fnmatch_lines(["test_l.py::test_n[1]", "test_l.py::test_n[2]", "test_l.py::test_n[3]", "3 tests collected*"])
