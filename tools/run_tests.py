#!/usr/bin/env python3
"""Run the cann_ops_tilelang tests in phases (see tests/_plugins/README.md).

    python tools/run_tests.py [--workers N] [--large-workers M] [--benchmarks] [--dry-run] [pytest args...]

phase 1  -m "not benchmark and not large_npu_mem" -n N --dist loadgroup   ordinary tests, N workers share the devices
phase 2  -m "large_npu_mem and not benchmark"    -n M --dist loadgroup   large or unprofiled device tests
phase 3  -m benchmark -n <devices> (only with --benchmarks; no -n with one device): one worker per device

Each xdist worker gwK is bound to device K % <devices> by tests/_plugins/device.py. Defaults: N = devices x 4
on an accelerator host, else the CPU count; M = the number of devices (1 without devices). A phase that
selects no test (pytest exit 5) counts as passed; the exit code is 1 if any phase failed, else 0.
Extra arguments go to every phase (the tests/ directory is added unless one of them is an existing path); an
extra ``-m EXPR`` narrows each phase's selection (``-m device``: "(device) and (not benchmark and ...)").
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


def device_count() -> int:
    sys.path.insert(0, str(TESTS))
    try:
        from _plugins.device import device_count as count
    finally:
        sys.path.remove(str(TESTS))
    return count()


def _absolute(extra: list[str]) -> list[str]:
    """The extra arguments with every existing path (``path[::node id]``, relative to the current directory)
    made absolute: the phases run pytest from the repository root."""
    out = []
    for arg in extra:
        path, sep, node = arg.partition("::")
        if not arg.startswith("-") and path and Path(path).exists():
            arg = str(Path(path).resolve()) + sep + node
        out.append(arg)
    return out


def _split_marker(extra: list[str]) -> tuple[str | None, list[str]]:
    """``(EXPR, rest)``: the last ``-m EXPR`` / ``-mEXPR`` of the extra arguments (pytest keeps only the last,
    which would replace a phase's own selection) and the other arguments."""
    marker, rest, args = None, [], iter(extra)
    for arg in args:
        if arg == "-m":
            marker = next(args, None)
            if marker is None:
                raise ValueError("run_tests: -m needs a marker expression")
        elif arg.startswith("-m") and not arg.startswith("--"):
            marker = arg[2:]
        else:
            rest.append(arg)
    return marker, rest


def phase_commands(workers: int, large_workers: int, devices: int, benchmarks: bool,
                   extra: list[str]) -> list[tuple[str, list[str]]]:
    base = [sys.executable, "-m", "pytest"]
    user_marker, extra = _split_marker(extra)
    extra = _absolute(extra)
    if not any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in extra):
        extra = [str(TESTS), *extra]
    # loadgroup: tests of one xdist_group (e.g. one hidden size) share a worker and so its compiled kernels
    dist = ["--dist", "loadgroup"]

    def select(marker: str) -> list[str]:
        return ["-m", marker if user_marker is None else f"({user_marker}) and ({marker})"]

    phases = [
        ("phase 1: ordinary tests",
         [*base, *select("not benchmark and not large_npu_mem"), "-n", str(workers), *dist, *extra]),
        ("phase 2: large / unprofiled device memory",
         [*base, *select("large_npu_mem and not benchmark"), "-n", str(large_workers), *dist, *extra]),
    ]
    if benchmarks:
        n = ["-n", str(devices)] if devices > 1 else []
        phases.append(("phase 3: benchmarks, one worker per device", [*base, *select("benchmark"), *n, *extra]))
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=None, help="xdist workers of phase 1")
    parser.add_argument("--large-workers", type=int, default=None, help="xdist workers of phase 2")
    parser.add_argument("--benchmarks", action="store_true", help="also run phase 3 (benchmarks)")
    parser.add_argument("--dry-run", action="store_true", help="print the phase commands without running them")
    args, extra = parser.parse_known_args(argv)
    try:
        devices = device_count()
    except ValueError as exc:  # a malformed OPS_TILELANG_TEST_DEVICE_* variable
        parser.error(str(exc))
    workers = args.workers if args.workers is not None else (devices * 4 if devices else (os.cpu_count() or 1))
    large = args.large_workers if args.large_workers is not None else max(devices, 1)
    try:
        phases = phase_commands(workers, large, devices, args.benchmarks, extra)
    except ValueError as exc:  # -m without an expression
        parser.error(str(exc))
    failed = []
    for title, cmd in phases:
        print(f"=== {title}: {shlex.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        rc = subprocess.call(cmd, cwd=REPO)
        ok = rc in (0, 5)
        print(f"=== {title}: exit {rc} ({'passed' if ok else 'FAILED'})", flush=True)
        if not ok:
            failed.append(title)
    if failed:
        print("=== failed: " + "; ".join(failed), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
