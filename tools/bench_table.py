#!/usr/bin/env python3
"""Markdown table of the committed benchmark baselines (``tests/<family>/benchmark/<chip>/*.jsonl``).

One row per case that has a result of ours, sorted by family then case: the op and the case's shape, the
times of ours, the peer (DeepSeek TileKernels) and inductor in µs, the peer's and inductor's time over ours
(above 1: ours is faster), and ours as a percentage of the copy ceiling measured in the same run (the
``copy`` record of the same file: bytes moved per µs by a device-to-device copy). A record's bytes are
what the op reads and writes once (see the benchmark files); a case without a peer or inductor result
shows a dash.

    python tools/bench_table.py                    # print the table (H200 baselines)
    python tools/bench_table.py --check README.md  # exit 1 if README's table differs from the baselines
    python tools/bench_table.py --write README.md  # rewrite README's table

The README's table sits between the lines ``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = "<!-- bench-table:start -->"
END = "<!-- bench-table:end -->"
COLUMNS = ("op", "shape", "ours µs", "peer µs", "inductor µs", "peer / ours", "inductor / ours", "% of copy")


def read_runs(tests: Path, chip: str) -> dict[str, list[dict]]:
    """``{family: records}`` of every ``tests/<family>/benchmark/<chip>/*.jsonl`` (sorted by path); each
    record gets ``_ceiling_gbs``, the copy ceiling of its own file (None where the file has none)."""
    runs: dict[str, list[dict]] = {}
    for path in sorted(tests.glob(f"*/benchmark/{chip}/*.jsonl")):
        family = path.relative_to(tests).parts[0]
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        copies = [r for r in records if r.get("impl") == "copy" and r.get("bytes") and r.get("time_us")]
        ceiling = max((r["bytes"] / r["time_us"] / 1e3 for r in copies), default=None)
        for record in records:
            record["_ceiling_gbs"] = ceiling
        runs.setdefault(family, []).extend(records)
    return runs


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _shape(parts: list[str]) -> str:
    """``["T512", "H4096", "save0"]`` -> ``"T=512, H=4096, save=0"``."""
    out = []
    for part in parts:
        if re.fullmatch(r"(bf|fp)\d+", part):  # a dtype ("bf16"), not a name and a value
            out.append(part)
            continue
        match = re.fullmatch(r"([A-Za-z_]+?)(\d+)", part)
        out.append(f"{match[1]}={match[2]}" if match else part)
    return ", ".join(out)


def _us(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if value < 100 else f"{value:.1f}"


def _ratio(other: float | None, ours: float) -> str:
    return "—" if other is None else f"{other / ours:.2f}×"


def rows(runs: dict[str, list[dict]]) -> list[list[str]]:
    """The table's rows (without the header)."""
    table = []
    for family in sorted(runs):
        by_case: dict[str, dict[str, dict]] = {}
        for record in runs[family]:
            if "case" in record and "impl" in record and record.get("time_us"):
                by_case.setdefault(record["case"], {})[record["impl"]] = record
        for case in sorted(by_case, key=_natural):
            impls = by_case[case]
            ours = impls.get("ours")
            if ours is None:
                continue
            time = ours["time_us"]
            op, *shape = case.split("-")
            ceiling = ours.get("_ceiling_gbs")
            percent = "—"
            if ceiling and ours.get("bytes"):
                percent = f"{100 * ours['bytes'] / time / 1e3 / ceiling:.1f}"
            peer = impls.get("peer", {}).get("time_us")
            inductor = impls.get("inductor", {}).get("time_us")
            table.append([f"{family}/{op}", _shape(shape), _us(time), _us(peer), _us(inductor), _ratio(peer, time),
                          _ratio(inductor, time), percent])
    return table


def markdown(table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---", "---"] + ["--:"] * (len(COLUMNS) - 2)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def generate(tests: Path = ROOT / "tests", chip: str = "h200") -> str:
    """The markdown table of the baselines of ``chip`` under ``tests``."""
    return markdown(rows(read_runs(tests, chip)))


def split_readme(text: str) -> tuple[str, str, str]:
    """``(before, table, after)`` around the markers; ``ValueError`` where they are missing or out of order."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"the markers {START} and {END} are missing or out of order")
    head = start + len(START)
    return text[:head], text[head:end], text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", metavar="FILE", type=Path, help="exit 1 if FILE's table differs from the baselines")
    group.add_argument("--write", metavar="FILE", type=Path, help="rewrite FILE's table from the baselines")
    parser.add_argument("--chip", default="h200", help="the baselines' chip directory (default h200)")
    parser.add_argument("--tests", type=Path, default=ROOT / "tests", help="the tests directory")
    args = parser.parse_args(argv)

    table = generate(args.tests, args.chip)
    if not table.count("\n") > 1:
        print(f"no benchmark results of ours under {args.tests}/*/benchmark/{args.chip}/", file=sys.stderr)
        return 1
    target = args.check or args.write
    if target is None:
        print(table)
        return 0
    try:
        text = target.read_text()
    except OSError as exc:
        print(f"{target}: {exc}", file=sys.stderr)
        return 1
    try:
        before, current, after = split_readme(text)
    except ValueError as exc:
        print(f"{target}: {exc}", file=sys.stderr)
        return 1
    if args.write:
        target.write_text(f"{before}\n{table}\n{after}")
        return 0
    if current.strip() == table.strip():
        return 0
    diff = difflib.unified_diff(current.strip().splitlines(), table.splitlines(), f"{target} (table)",
                                "baselines", lineterm="")
    print("\n".join(diff))
    print(f"{target}: the benchmark table differs from the baselines; "
          f"run: python tools/bench_table.py --write {target}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
