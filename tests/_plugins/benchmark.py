"""Benchmarks: the ``benchmark`` marker, the ``bench`` fixture, JSONL results and baselines per chip.

Tests marked ``benchmark`` are deselected unless the ``-m`` expression names ``benchmark`` or
``--run-benchmarks`` is given. In a benchmark test::

    @pytest.mark.benchmark
    @requires_device
    @pytest.mark.parametrize("tokens", [4096, 65536])
    def test_bench_engram_gate_forward(bench, tokens):
        x = ...
        bench.side_by_side(f"fwd-t{tokens}", {
            "ours": lambda: cann_ops_tilelang.engram_gate_forward(x, ...),
            "eager": lambda: ref(x),
        }, bytes=x.nbytes * 3)

Implementations compared with each other go through ``bench.side_by_side(case, {"ours": f, "peer": g, ...},
bytes=...)``: after a discarded warm-up round each is timed in ``ROUNDS`` rounds in rotated order and the mean
of the rounds recorded, so that none of them is systematically measured first after an idle device (slower
clocks) or after the same neighbour.

``bench.time_us(fn)`` is device time in microseconds: CUDA ``tilelang.profiler.bench.do_bench(fn, warmup=0,
rep=30, backend="cupti")`` (falling back to CUDA events when CUPTI yields nothing), NPU ``backend="msprof"``
(falling back to events); without a device, host wall clock. The timer used is stored in every record
(``timer``). ``bench.record(case, **fields)`` appends one JSON object: ``case``, ``test``, ``chip``, ``timer``
and the fields (``gbs`` is derived from ``bytes`` and ``time_us`` when not given).

Files: baselines ``<test dir>/benchmark/<chip>/<test file stem>.jsonl`` (committed); this run's results
``<--bench-out>/<test dir relative to tests root>/<chip>/<stem>.jsonl`` (default
``<rootdir>/.pytest_cache/ops_tilelang_bench``). Results are compared with the baseline per (case, impl) and
reported in the terminal summary; ``--refresh-bench-baseline`` merges them into the baselines.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from _plugins import device as _device
from _plugins.paths import test_name_in_file, tests_root

CHIP_ENV = "OPS_TILELANG_BENCH_CHIP"
ABS_FLOOR_US = 0.8
ROUNDS = 3  # rounds of Bench.side_by_side
_RESULTS = pytest.StashKey[list[dict[str, Any]]]()  # each: {"file": test file, **record}

# Checked in order; a token matches when not surrounded by letters/digits ("H20" is not "H200").
_CUDA_CHIPS = ("gb200", "b200", "b100", "h200", "h100", "h800", "h20", "gh200", "a100", "a800", "a10g", "a10",
               "l40s", "l40", "l4", "v100", "t4")


def chip_from_name(name: str, kind: str | None) -> str:
    """Chip family of a device name: 'NVIDIA H200' -> 'h200', 'Ascend910B3' -> 'ascend910b',
    'Ascend950PR' -> 'ascend950'; anything else -> the name lower-cased with non-alphanumerics as '_'."""
    low = name.lower()
    if kind == "npu" or "ascend" in low:
        if re.search(r"ascend\s*910b", low):
            return "ascend910b"
        m = re.search(r"ascend\s*(\d+)", low)
        if m:
            return f"ascend{m.group(1)}"
    else:
        for chip in _CUDA_CHIPS:
            if re.search(rf"(?<![a-z0-9]){chip}(?![a-z0-9])", low):
                return chip
    return re.sub(r"[^a-z0-9]+", "_", low).strip("_") or "unknown"


_CHIP: str | None = None


def detect_chip() -> str:
    """``$OPS_TILELANG_BENCH_CHIP`` if set, else the chip family of device 0, else 'cpu'."""
    global _CHIP
    forced = os.environ.get(CHIP_ENV, "").strip()
    if forced:
        return forced
    if _CHIP is None:
        kind = _device.device_type()
        if kind is None:
            _CHIP = "cpu"
        else:
            _CHIP = chip_from_name(_device_module(kind).get_device_name(0), kind)
    return _CHIP


# ----------------------------------------------------------------------------- timing
_CUPTI_BROKEN = False


def _device_module(kind: str):
    import torch

    return torch.cuda if kind == "cuda" else torch.npu


def _time_cuda_events(fn: Callable[[], Any], kind: str, rep_ms: float = 30.0) -> float:
    mod = _device_module(kind)
    fn()
    mod.synchronize()
    start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    n = max(1, int(rep_ms / max(start.elapsed_time(end) / 5, 1e-4)))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n * 1e3


def _time_wall(fn: Callable[[], Any], rep_ms: float = 30.0) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    est = max(time.perf_counter() - t0, 1e-7)
    n = max(1, min(10000, int(rep_ms * 1e-3 / est)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _synchronize(kind: str | None) -> None:
    if kind is not None:
        _device_module(kind).synchronize()


def device_time_us(fn: Callable[[], Any], kind: str | None) -> tuple[float, str]:
    """(microseconds, timer name) for one call of ``fn``."""
    # do_bench flushes L2 by zeroing a 256 MB buffer, so every timed call also pays the write-back of those dirty
    # lines: a fixed cost that weighs on kernels streaming a few hundred MB (docs/perf/h100/engram.md, 2026-12-06)
    global _CUPTI_BROKEN
    if kind is None:
        return _time_wall(fn), "wall"
    try:
        from tilelang.profiler.bench import do_bench
    except ImportError:
        return _time_cuda_events(fn, kind), "torch-event"
    if kind == "cuda":
        if not _CUPTI_BROKEN:
            try:
                ms = do_bench(fn, warmup=0, rep=30, backend="cupti")
                if ms and ms > 0 and math.isfinite(ms):
                    return ms * 1e3, "cupti"
            except Exception:
                pass
            _CUPTI_BROKEN = True  # do not pay for a failing CUPTI on every case
        return do_bench(fn, warmup=0, rep=30, backend="event") * 1e3, "event"
    try:
        ms = do_bench(fn, warmup=0, rep=30, backend="msprof")
        if ms and ms > 0 and math.isfinite(ms):
            return ms * 1e3, "msprof"
    except Exception:
        pass
    return do_bench(fn, warmup=0, rep=30, backend="event") * 1e3, "event"


@dataclass
class Bench:
    """The ``bench`` fixture: time callables and record results for the current test."""

    test: str
    file: str
    chip: str
    kind: str | None
    sink: list[dict[str, Any]]
    last_timer: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)

    def time_us(self, fn: Callable[[], Any]) -> float:
        """Mean device time of ``fn()`` in microseconds (see the module docstring for the timers)."""
        us, self.last_timer = device_time_us(fn, self.kind)
        return us

    def stream_time_us(self, fn: Callable[[], Any]) -> float:
        """Time of ``fn()`` on the device stream between CUDA events, launch gaps included (``time_us`` with the
        CUPTI timer sums kernel durations only); wall time without a device."""
        if self.kind is None:
            return _time_wall(fn)
        return _time_cuda_events(fn, self.kind)

    def side_by_side(self, case: str, impls: dict[str, Callable[[], Any] | None], rounds: int = ROUNDS,
                     **fields: Any) -> dict[str, float]:
        """Times several implementations of one case against each other and records each one.

        Every implementation is called once untimed (JIT, compilation, allocator) and timed once in a
        discarded warm-up round (the device clocks rise after the idle time of a compilation), then
        ``rounds`` rounds time each of them with :meth:`time_us`, the order rotated by one place per round
        so that no implementation is always the first of a round or always follows the same neighbour.
        Records ``time_us`` = the mean of the rounds (each round a mean over its repetitions) and
        ``rounds_us`` (the rounds, in order) plus ``fields`` (``bytes`` etc.); ``None`` entries are skipped.

        Returns:
            ``{impl: time_us}``.
        """
        live = [(impl, fn) for impl, fn in impls.items() if fn is not None]
        for _, fn in live:
            fn()
        _synchronize(self.kind)
        for _, fn in live:  # warm-up round, discarded
            self.time_us(fn)
        per: dict[str, list[float]] = {impl: [] for impl, _ in live}
        timers: dict[str, str | None] = {}
        for r in range(max(1, rounds)):
            k = r % len(live) if live else 0
            for impl, fn in live[k:] + live[:k]:
                per[impl].append(self.time_us(fn))
                timers[impl] = self.last_timer
        out = {}
        for impl, _ in live:
            out[impl] = sum(per[impl]) / len(per[impl])
            self.record(case, impl=impl, time_us=out[impl], rounds_us=per[impl], timer=timers[impl], **fields)
        return out

    def record(self, case: str, **fields: Any) -> dict[str, Any]:
        """Append one result. ``case`` plus ``impl`` identify it in the baseline (keep them unique per file).

        Typical fields: impl ("ours", "peer", "eager", "inductor"), time_us, bytes, gbs, flops, anything
        JSON-serializable. ``gbs`` = bytes / time when both are given and gbs is not.
        """
        rec: dict[str, Any] = {"case": case, "impl": fields.pop("impl", "ours")}
        rec.update(fields)
        if "gbs" not in rec and rec.get("bytes") and rec.get("time_us"):
            rec["gbs"] = rec["bytes"] / (rec["time_us"] * 1e3)
        rec.setdefault("timer", self.last_timer)
        rec.setdefault("test", self.test)
        rec.setdefault("chip", self.chip)
        self.records.append(rec)
        self.sink.append({"file": self.file, **rec})
        return rec


@pytest.fixture
def bench(request: pytest.FixtureRequest) -> Bench:
    """Time callables on the device and record benchmark results (see ``_plugins.benchmark``)."""
    item = request.node
    return Bench(test=test_name_in_file(item), file=str(Path(item.path).resolve()), chip=detect_chip(),
                 kind=_device.device_type(), sink=item.config.stash[_RESULTS])


# ----------------------------------------------------------------------------- files and comparison
def baseline_path(test_file: Path, chip: str) -> Path:
    test_file = Path(test_file)
    return test_file.parent / "benchmark" / chip / f"{test_file.stem}.jsonl"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".jsonl.tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    tmp.replace(path)


def _key(rec: dict[str, Any]) -> tuple[str, str]:
    return (str(rec.get("case")), str(rec.get("impl", "ours")))


def merge_baseline(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Baseline after a refresh: new records replace old ones of the same (case, impl); sorted by key."""
    merged = {_key(r): r for r in old}
    merged.update({_key(r): r for r in new})
    return [merged[k] for k in sorted(merged)]


@dataclass
class Verdict:
    status: str  # "regression", "improvement", "same", "new", "untimed"
    case: str
    impl: str
    time_us: float | None
    base_us: float | None

    @property
    def delta_pct(self) -> float | None:
        if self.time_us is None or not self.base_us:
            return None
        return (self.time_us - self.base_us) / self.base_us * 100


def compare(new: list[dict[str, Any]], base: list[dict[str, Any]], threshold_pct: float,
            floor_us: float = ABS_FLOOR_US) -> list[Verdict]:
    """Compare ``time_us`` per (case, impl): a change counts when it exceeds both ``threshold_pct`` of the
    baseline and ``floor_us``."""
    base_by_key = {_key(r): r for r in base}
    out = []
    for rec in new:
        case, impl = _key(rec)
        t = rec.get("time_us")
        b = base_by_key.get((case, impl))
        if b is None:
            out.append(Verdict("new", case, impl, t, None))
            continue
        bt = b.get("time_us")
        if t is None or bt is None:
            out.append(Verdict("untimed", case, impl, t, bt))
            continue
        margin = max(threshold_pct / 100 * bt, floor_us)
        status = "regression" if t - bt > margin else "improvement" if bt - t > margin else "same"
        out.append(Verdict(status, case, impl, t, bt))
    return out


# ----------------------------------------------------------------------------- hooks
def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("cann_ops_tilelang")
    g.addoption("--run-benchmarks", action="store_true", default=False,
                help="run tests marked benchmark (also selected by a -m expression naming benchmark)")
    g.addoption("--bench-threshold", type=float, default=5.0, metavar="PCT",
                help=f"report a benchmark change beyond PCT percent of the baseline and {ABS_FLOOR_US} us (default 5)")
    g.addoption("--refresh-bench-baseline", action="store_true", default=False,
                help="merge this run's results into <test dir>/benchmark/<chip>/<file>.jsonl")
    g.addoption("--bench-out", default=None, metavar="DIR",
                help="where this run's benchmark results go (default <rootdir>/.pytest_cache/ops_tilelang_bench)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "benchmark: performance test; runs only with -m benchmark or --run-benchmarks")
    config.stash[_RESULTS] = []


def benchmarks_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("run_benchmarks")) or bool(
        re.search(r"\bbenchmark\b", config.getoption("markexpr", "") or ""))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if benchmarks_requested(config):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("benchmark") is not None else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    node.config.stash[_RESULTS].extend(getattr(node, "workeroutput", {}).get("ops_tilelang_bench", []))


def _out_dir(config: pytest.Config) -> Path:
    opt = config.getoption("bench_out")
    return Path(opt) if opt else config.rootpath / ".pytest_cache" / "ops_tilelang_bench"


def _group(results: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        rec = {k: v for k, v in r.items() if k != "file"}
        groups.setdefault((r["file"], rec["chip"]), []).append(rec)
    return groups


_VERDICTS = pytest.StashKey[list[tuple[str, Verdict]]]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    results = config.stash[_RESULTS]
    if hasattr(config, "workerinput"):
        config.workeroutput["ops_tilelang_bench"] = results
        return
    verdicts: list[tuple[str, Verdict]] = []
    root = tests_root(config)
    for (file, chip), recs in sorted(_group(results).items()):
        test_file = Path(file)
        try:
            rel_dir = test_file.parent.relative_to(root)
        except ValueError:
            rel_dir = Path(test_file.parent.name)
        write_jsonl(_out_dir(config) / rel_dir / chip / f"{test_file.stem}.jsonl", recs)
        base_file = baseline_path(test_file, chip)
        base = read_jsonl(base_file)
        label = f"{test_file.parent.name}/{test_file.name} [{chip}]"
        verdicts += [(label, v) for v in compare(recs, base, config.getoption("bench_threshold"))]
        if config.getoption("refresh_bench_baseline"):
            write_jsonl(base_file, merge_baseline(base, recs))
    config.stash[_VERDICTS] = verdicts


def _fmt(v: Verdict) -> str:
    t = "-" if v.time_us is None else f"{v.time_us:.2f} us"
    if v.status == "new":
        return f"{v.case} [{v.impl}]: {t} (no baseline)"
    b = "-" if v.base_us is None else f"{v.base_us:.2f} us"
    d = "" if v.delta_pct is None else f" ({v.delta_pct:+.1f}%)"
    return f"{v.case} [{v.impl}]: {t} vs baseline {b}{d}"


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    verdicts = config.stash.get(_VERDICTS, None)
    if not verdicts:
        return
    tr = terminalreporter
    tr.write_sep("-", f"cann_ops_tilelang benchmarks (threshold {config.getoption('bench_threshold')}% "
                      f"and {ABS_FLOOR_US} us; results in {_out_dir(config)})")
    for status, title in (("regression", "REGRESSION"), ("improvement", "IMPROVEMENT"), ("new", "NEW"),
                          ("untimed", "UNTIMED")):
        for label, v in verdicts:
            if v.status == status:
                tr.write_line(f"{title} {label} {_fmt(v)}")
    counts = {s: sum(1 for _, v in verdicts if v.status == s) for s in ("regression", "improvement", "same", "new")}
    tr.write_line("benchmarks: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if config.getoption("refresh_bench_baseline"):
        tr.write_line("baselines refreshed: " + ", ".join(sorted({lbl for lbl, _ in verdicts})))
