"""Benchmark selection, the bench fixture, baseline comparison and refresh, chip names."""

import json

import pytest

from _plugins import benchmark
from _plugins.testing import INNER_ARGS

BASELINE = [
    {"case": "c1", "impl": "ours", "time_us": 100.0},
    {"case": "c2", "impl": "ours", "time_us": 100.0},
    {"case": "c3", "impl": "ours", "time_us": 100.0},
    {"case": "c4", "impl": "ours", "time_us": 1.0},
    {"case": "stale", "impl": "ours", "time_us": 5.0},
]

BENCH_TEST = """
import pytest

@pytest.mark.benchmark
def test_b(bench):
    bench.record("c1", impl="ours", time_us=110.0)   # +10%: regression
    bench.record("c2", impl="ours", time_us=90.0)    # -10%: improvement
    bench.record("c3", impl="ours", time_us=103.0)   # +3%: same
    bench.record("c4", impl="ours", time_us=1.5)     # +50% but +0.5 us < 0.8 us floor: same
    bench.record("c5", impl="ours", time_us=7.0, bytes=7000)  # new
    bench.record("c1", impl="eager", time_us=50.0)   # new (other impl)

def test_plain():
    pass
"""


@pytest.fixture
def tree(inner, monkeypatch):
    monkeypatch.setenv(benchmark.CHIP_ENV, "testchip")
    fam = inner.mkpydir("fam")
    (fam / "test_b.py").write_text(BENCH_TEST)
    base = fam / "benchmark" / "testchip" / "test_b.jsonl"
    base.parent.mkdir(parents=True)
    base.write_text("".join(json.dumps(r) + "\n" for r in BASELINE))
    return inner


def _base(tree):
    return tree.path / "fam" / "benchmark" / "testchip" / "test_b.jsonl"


def test_benchmarks_deselected_by_default(tree):
    tree.runpytest(*INNER_ARGS).assert_outcomes(passed=1, deselected=1)
    tree.runpytest(*INNER_ARGS, "-m", "not benchmark").assert_outcomes(passed=1, deselected=1)
    tree.runpytest(*INNER_ARGS, "-m", "benchmark").assert_outcomes(passed=1, deselected=1)
    tree.runpytest(*INNER_ARGS, "--run-benchmarks").assert_outcomes(passed=2)


def test_compare_with_baseline(tree):
    before = _base(tree).read_text()
    r = tree.runpytest(*INNER_ARGS, "-m", "benchmark", "--bench-out", str(tree.path / "out"))
    r.assert_outcomes(passed=1, deselected=1)
    lines = [line for line in r.stdout.lines if line.split(" ")[0] in ("REGRESSION", "IMPROVEMENT", "NEW")]
    assert lines == [
        "REGRESSION fam/test_b.py [testchip] c1 [ours]: 110.00 us vs baseline 100.00 us (+10.0%)",
        "IMPROVEMENT fam/test_b.py [testchip] c2 [ours]: 90.00 us vs baseline 100.00 us (-10.0%)",
        "NEW fam/test_b.py [testchip] c5 [ours]: 7.00 us (no baseline)",
        "NEW fam/test_b.py [testchip] c1 [eager]: 50.00 us (no baseline)",
    ]
    r.stdout.fnmatch_lines(["benchmarks: 1 regression, 1 improvement, 2 same, 2 new"])
    assert _base(tree).read_text() == before  # no refresh asked
    run = [json.loads(x) for x in (tree.path / "out" / "fam" / "testchip" / "test_b.jsonl").read_text().splitlines()]
    assert [(x["case"], x["impl"], x["time_us"]) for x in run] == [
        ("c1", "ours", 110.0), ("c2", "ours", 90.0), ("c3", "ours", 103.0), ("c4", "ours", 1.5),
        ("c5", "ours", 7.0), ("c1", "eager", 50.0)]
    assert run[4]["gbs"] == 1.0  # 7000 B / 7 us
    assert {(x["test"], x["chip"], x["timer"]) for x in run} == {("test_b", "testchip", None)}


def test_threshold_option(tree):
    r = tree.runpytest(*INNER_ARGS, "-m", "benchmark", "--bench-threshold", "15", "--bench-out", str(tree.path / "o"))
    r.stdout.fnmatch_lines(["benchmarks: 0 regression, 0 improvement, 4 same, 2 new"])


def test_refresh_rewrites_baseline(tree):
    r = tree.runpytest(*INNER_ARGS, "-m", "benchmark", "--refresh-bench-baseline", "--bench-out", str(tree.path / "o"))
    r.assert_outcomes(passed=1, deselected=1)
    r.stdout.fnmatch_lines(["baselines refreshed: fam/test_b.py [testchip]"])
    new = [json.loads(x) for x in _base(tree).read_text().splitlines()]
    assert [(x["case"], x["impl"], x["time_us"]) for x in new] == [
        ("c1", "eager", 50.0), ("c1", "ours", 110.0), ("c2", "ours", 90.0), ("c3", "ours", 103.0),
        ("c4", "ours", 1.5), ("c5", "ours", 7.0), ("stale", "ours", 5.0)]
    r = tree.runpytest(*INNER_ARGS, "-m", "benchmark", "--bench-out", str(tree.path / "o"))
    r.stdout.fnmatch_lines(["benchmarks: 0 regression, 0 improvement, 6 same, 0 new"])


def test_time_us_without_device_uses_wall_clock(inner, monkeypatch):
    monkeypatch.setenv(benchmark.CHIP_ENV, "testchip")
    inner.makepyfile(test_t="""
        import time, pytest

        @pytest.mark.benchmark
        def test_t(bench):
            t = bench.time_us(lambda: time.sleep(0.002))
            rec = bench.record("sleep", time_us=t)
            assert rec["timer"] == "wall" and rec["impl"] == "ours"
            assert 1900 < t < 20000, t
    """)
    inner.runpytest(*INNER_ARGS, "--run-benchmarks", "--bench-out", str(inner.path / "o")).assert_outcomes(passed=1)
    run = json.loads((inner.path / "o" / "testchip" / "test_t.jsonl").read_text())
    assert (run["case"], run["timer"], run["test"]) == ("sleep", "wall", "test_t")


def test_side_by_side_rotates_and_averages(inner, monkeypatch):
    monkeypatch.setenv(benchmark.CHIP_ENV, "testchip")
    inner.makepyfile(test_s="""
        import pytest
        from _plugins import benchmark

        @pytest.mark.benchmark
        def test_s(bench, monkeypatch):
            order = []
            fake = iter([99.0, 98.0, 97.0,  10.0, 20.0, 30.0,  22.0, 32.0, 12.0,  34.0, 14.0, 24.0])
            monkeypatch.setattr(bench, "time_us", lambda fn: (fn(), next(fake))[1])
            impls = {name: (lambda name=name: order.append(name)) for name in "abc"}
            out = bench.side_by_side("c", {"a": impls["a"], "none": None, "b": impls["b"], "c": impls["c"]},
                                     bytes=1000)
            # one untimed call each, a discarded warm-up round, then rounds a b c | b c a | c a b
            assert order == list("abc") + list("abc") + list("abc") + list("bca") + list("cab")
            assert out == {"a": 12.0, "b": 22.0, "c": 32.0}
            recs = {r["impl"]: r for r in bench.records}
            assert set(recs) == {"a", "b", "c"}
            assert recs["a"]["rounds_us"] == [10.0, 12.0, 14.0] and recs["a"]["time_us"] == 12.0
            assert recs["c"]["rounds_us"] == [30.0, 32.0, 34.0] and recs["c"]["bytes"] == 1000
            assert recs["b"]["gbs"] == 1000 / (22.0 * 1e3)
    """)
    inner.runpytest(*INNER_ARGS, "--run-benchmarks", "--bench-out", str(inner.path / "o")).assert_outcomes(passed=1)


@pytest.mark.parametrize(("name", "kind", "chip"), [
    ("NVIDIA H200", "cuda", "h200"), ("NVIDIA H20", "cuda", "h20"), ("NVIDIA H100 80GB HBM3", "cuda", "h100"),
    ("NVIDIA A100-SXM4-80GB", "cuda", "a100"), ("NVIDIA L40S", "cuda", "l40s"), ("NVIDIA GeForce RTX 4090", "cuda", "nvidia_geforce_rtx_4090"),
    ("Ascend910B3", "npu", "ascend910b"), ("Ascend950PR", "npu", "ascend950"), ("Ascend 910", "npu", "ascend910"),
])
def test_chip_from_name(name, kind, chip):
    assert benchmark.chip_from_name(name, kind) == chip


def test_compare_floor_and_threshold():
    v = benchmark.compare([{"case": "a", "impl": "ours", "time_us": 10.9}, {"case": "b", "time_us": 9.0}],
                          [{"case": "a", "impl": "ours", "time_us": 10.0}, {"case": "b", "impl": "ours", "time_us": 10.0}],
                          threshold_pct=5)
    assert [(x.status, x.case) for x in v] == [("regression", "a"), ("improvement", "b")]  # 0.9 us > 0.8 floor
