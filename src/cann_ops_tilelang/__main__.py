"""``python -m cann_ops_tilelang``: versions, devices and registered ops, then a demonstration.

With a CUDA GPU or an Ascend NPU it runs the Engram gate's ops once at a model shape and trains a small model
(mHC sublayers, an Engram gate, the mHC head) for a few steps, eager and compiled, with timings. Without one
(or with ``--lower``) it
instead lowers every kernel for both targets (AscendC source for Ascend 950, checked against the UB
budget; an sm_90a cubin for CUDA, checked against the shared-memory budget, when nvcc is found) and ends
with a summary, so the package can be seen working anywhere.

The kernels are enumerated by the family aggregators ``cann_ops_tilelang.kernels.<backend>.<family>
.lowering_cases(hidden_size)``; supported sizes come from :mod:`cann_ops_tilelang.limits`.
"""

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import os
import platform
import re
import shutil
import sys
import tempfile
import textwrap
import time

import torch

from . import config, limits
from ._library import registered_ops
from ._version import __version__

FAMILIES = ("engram", "mhc")
TARGETS = ("ascend", "cuda")
CUDA_ARCH = "sm_90a"
# the hidden-size range of each family's kernels (limits.py); the demonstration runs the Engram ops
HIDDEN_RANGES = {"engram": ("ENGRAM_HIDDEN", limits.ENGRAM_HIDDEN), "mhc": ("MHC_HIDDEN", limits.MHC_HIDDEN)}
TARGET_NAMES = {"ascend": "AscendC (Ascend 950)", "cuda": f"CUDA ({CUDA_ARCH})"}


# --- header -----------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _device() -> str | None:
    """``"cuda"``, ``"npu"`` or None: the accelerator the demonstration runs on."""
    if config.cuda_available():
        return "cuda"
    if config.npu_available():
        return "npu"
    return None


def _device_line(device: str | None) -> str:
    if device == "cuda":
        return f"device: CUDA GPU {torch.cuda.get_device_name()} (runs the CUDA kernels)"
    if device == "npu":
        return "device: Ascend NPU (runs the Ascend 950 kernels)"
    why = []
    if config.has_torch_npu():
        why.append("torch_npu is installed but sees no NPU")
    if torch.version.cuda is None:
        why.append(f"torch {torch.__version__} is a CPU build")
    else:
        why.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
    return f"device: no GPU or NPU found ({'; '.join(why)})"


def _family_of(name: str, public) -> str:
    declaration = getattr(public, "declaration", None)
    family = getattr(declaration, "family", None)
    return family or ("engram" if name.startswith("engram") else "mhc")


def _header(device: str | None, verbose: bool) -> str:
    lines = [
        f"cann_ops_tilelang {__version__} (python {platform.python_version()}, torch {torch.__version__}, "
        f"tilelang {_version('tilelang')})",
        _device_line(device),
    ]
    ops = registered_ops()
    by_family: dict[str, list[str]] = {}
    for name, public in ops.items():
        by_family.setdefault(_family_of(name, public), []).append(name)
    lines.append(f"registered ops: {len(ops)} (torch.ops.cann_ops_tilelang.<name>)")
    for family, names in sorted(by_family.items()):
        text = f"{family} ({len(names)}): " + ", ".join(sorted(names))
        lines.extend(textwrap.wrap(text, 110, initial_indent="  ", subsequent_indent="    "))
    if verbose:
        for name in sorted(ops):
            packet = getattr(torch.ops.cann_ops_tilelang, name, None)
            if packet is not None:
                lines.append(f"  {packet.default._schema}")
    return "\n".join(lines)


# --- lowering ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _captured_output():
    """Collects what is written to file descriptors 1 and 2 inside the block (TileLang's and TVM's log
    lines, Python warnings and prints) into the yielded list, one entry per non-empty line."""
    lines: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            # TVM's log lines start with a time stamp: drop it, the kernel is what matters
            lines.extend(re.sub(r"^\[\d\d:\d\d:\d\d\]\s*:?\s*", "", line) for line in text.splitlines() if line.strip())


def _nvcc() -> tuple[str | None, str]:
    """``(path, "")`` of the nvcc that ``kernels.cuda._build.compile_cubin`` runs, or ``(None, why not)``."""
    if os.environ.get("NVCC"):
        path = shutil.which(os.environ["NVCC"])
        return path, "" if path else f"$NVCC ({os.environ['NVCC']}) is not an executable"
    if os.environ.get("CUDA_HOME"):
        path = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
        return (path, "") if os.access(path, os.X_OK) else (None, f"$CUDA_HOME/bin has no nvcc ({path})")
    path = shutil.which("nvcc")
    return path, "" if path else "nvcc is not on PATH"


@dataclasses.dataclass
class _Result:
    target: str
    name: str  # <family>/<case>, or the family aggregator's call
    kernel: bool = True  # False: the family aggregator (it gets a row only when it failed or printed)
    ok: bool = False  # built, and within its budget
    built: bool = False  # lowered (AscendC), cubin built or CUDA source generated
    over_budget: bool = False
    what: str = ""
    seconds: float = 0.0
    messages: list[str] = dataclasses.field(default_factory=list)


def _lower_one(target: str, build, prim_func, nvcc: str | None, result: _Result) -> None:
    if target == "ascend":
        lowered = build.lower_ascendc(prim_func)
        result.built = True
        result.over_budget = lowered.ub_bytes > lowered.budget_bytes
        result.what = f"AscendC {len(lowered.source):>7} chars, UB {lowered.ub_bytes:>6} / {lowered.budget_bytes} B"
    elif nvcc is not None:
        built = build.compile_cubin(prim_func, arch=CUDA_ARCH)
        result.built = True
        result.over_budget = not built.fits
        result.what = (
            f"{CUDA_ARCH} cubin {len(built.cubin):>7} B, "
            f"shared {built.smem_bytes:>6} / {built.budget_bytes} B, {built.threads:>4} threads"
        )
    else:
        source = build.lower_source(prim_func, arch=CUDA_ARCH)
        result.built = True
        result.what = f"CUDA source {len(source):>7} chars (no cubin: nvcc not found)"
    if result.over_budget:
        result.what += "  OVER BUDGET"
    result.ok = result.built and not result.over_budget


def _failed(exc: Exception) -> str:
    text = str(exc).strip()
    return f"FAILED: {type(exc).__name__}" + (f": {text.splitlines()[0]}" if text else "")


def _report(result: _Result, width: int, verbose: bool) -> None:
    lines = len(result.messages)
    note = f"  [{lines} TileLang line{'s' if lines > 1 else ''}]" if lines else ""
    print(f"  {result.target:6} {result.name:{width}}  {result.what}  ({result.seconds:.1f} s){note}", flush=True)
    if verbose:
        for line in result.messages:
            print(f"           | {line}")


def _lower_all(hidden_size: int, families, targets, match: str | None, verbose: bool) -> list[_Result]:
    """Lowers every selected kernel and prints a row for each; returns the results: one per kernel, plus
    one per family aggregator that failed or printed something."""
    nvcc = _nvcc()[0]
    work = []  # (result, build module, prim_func)
    steps: list[_Result] = []  # the aggregators that failed or printed
    for target in targets:
        for family in families:
            step = _Result(target, f"{family}: lowering_cases({hidden_size})", kernel=False, ok=True, built=True)
            start = time.perf_counter()
            try:
                with _captured_output() as step.messages:
                    build = importlib.import_module(f"{__package__}.kernels.{target}._build")
                    kernels = importlib.import_module(f"{__package__}.kernels.{target}.{family}")
                    cases = kernels.lowering_cases(hidden_size)
            except Exception as exc:  # report and go on: the point is to show every kernel
                step.ok = step.built = False
                step.what = _failed(exc)
                cases = {}
            step.seconds = time.perf_counter() - start
            if step.messages or not step.ok:
                step.what = step.what or f"{len(cases)} kernels"
                steps.append(step)
            for case, prim_func in cases.items():
                name = f"{family}/{case}"
                if match is None or match in name:
                    work.append((_Result(target, name), build, prim_func))

    width = max((len(result.name) for result, _, _ in work), default=0)
    for step in steps:
        _report(step, width, verbose)
    for result, build, prim_func in work:
        start = time.perf_counter()
        try:
            with _captured_output() as result.messages:
                _lower_one(result.target, build, prim_func, nvcc, result)
        except Exception as exc:
            result.what = _failed(exc)
        result.seconds = time.perf_counter() - start
        _report(result, width, verbose)
    return steps + [result for result, _, _ in work]


def _summary(results: list[_Result], targets, hidden_size: int, seconds: float) -> list[str]:
    kernels = [r for r in results if r.kernel]
    lines = [f"summary (H={hidden_size}):"]
    nvcc, why = _nvcc()
    for target in TARGETS:
        name = TARGET_NAMES[target]
        if target not in targets:
            lines.append(f"  {name}: skipped (--target {' '.join(targets)})")
            continue
        mine = [r for r in kernels if r.target == target]
        n, ok = len(mine), sum(r.ok for r in mine)
        over, failed = sum(r.over_budget for r in mine), sum(not r.built for r in mine)
        extra = f" ({over} over budget, {failed} failed)" if over or failed else ""
        if target == "ascend":
            lines.append(f"  {name}: lowered {ok}/{n} within the UB budget{extra}")
        elif nvcc is not None:
            lines.append(f"  {name}: cubins built {ok}/{n} within the shared-memory budget{extra}")
        else:
            lines.append(f"  {name}: cubins not built: {why}; CUDA sources generated {ok}/{n}{extra} "
                         "(shared memory is checked on the cubins)")
    if not kernels:
        lines.append("  no kernel was selected")
    failures = [r for r in results if not r.ok]
    lines.append(f"  failures: {len(failures)}")
    lines.extend(f"    {r.target} {r.name}: {r.what.strip()}" for r in failures)
    noisy = [r for r in results if r.messages]
    if noisy:
        count = sum(len(r.messages) for r in noisy)
        lines.append(f"  TileLang printed {count} line{'s' if count > 1 else ''} while lowering {len(noisy)} "
                     f"kernel{'s' if len(noisy) > 1 else ''} (counted on their rows; --verbose shows them)")
    lines.append(f"  total time: {seconds:.1f} s")
    return lines


# --- demonstration on a device ----------------------------------------------------------------------


def _synchronize() -> None:
    torch.cuda.synchronize() if torch.cuda.is_available() else torch.npu.synchronize()


def _bench(fn, reps: int = 20) -> float:
    """Mean wall time in µs of ``fn`` on the device after a warm-up (a demonstration, not a benchmark)."""
    fn()
    _synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def _run_on_device(device: str, tokens: int, hidden_size: int, steps: int) -> None:
    import cann_ops_tilelang as ops
    from cann_ops_tilelang.modeling import EngramGate

    m = 4
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    x, kv = randn(tokens, m, hidden_size), randn(tokens, m + 1, hidden_size)
    wh, we = randn(m, hidden_size), randn(m, hidden_size)
    print(f"the Engram gate's ops once at T={tokens}, m={m}, H={hidden_size} (first call compiles):")
    wf = ops.engram_fused_weight(wh, we)
    out, dot, g, rx, rk = ops.engram_gate_fwd(x, kv, wf, 1e-6, 1e-6)
    gx, gkv, part = ops.engram_gate_bwd(x, x, kv, wf, dot, g, rx, rk, 1e-6)
    gwh = torch.zeros(m, hidden_size, device=device)
    gwe = torch.zeros_like(gwh)
    calls = {
        "engram_fused_weight": lambda: ops.engram_fused_weight(wh, we),
        "engram_gate_fwd": lambda: ops.engram_gate_fwd(x, kv, wf, 1e-6, 1e-6),
        "engram_gate_fwd (no stats)": lambda: ops.engram_gate_fwd(x, kv, wf, 1e-6, 1e-6, False),
        "engram_gate_bwd": lambda: ops.engram_gate_bwd(x, x, kv, wf, dot, g, rx, rk, 1e-6),
        "engram_grad_w_reduce": lambda: ops.engram_grad_w_reduce(part, wh, we, gwh, gwe),
    }
    for name, fn in calls.items():
        print(f"  {name:28} {_bench(fn):9.1f} µs (wall, incl. launch)")

    if steps == 0:
        return
    from cann_ops_tilelang._demo import SmallModel, train

    print(f"training a small model (embedding, 3 mHC-wrapped FFNs, an Engram gate, the mHC head; H=512) for "
          f"{steps} steps of {tokens} tokens:")
    for compiled in (False, True):
        torch.manual_seed(0)
        model = SmallModel(device=device)
        losses, times = train(model, steps, tokens, device, compiled=compiled, synchronize=_synchronize)
        label = "torch.compile" if compiled else "eager"
        steady = times[1:] or times
        print(f"  {label:13} loss {losses[0]:.4f} -> {losses[-1]:.4f}   step {sum(steady) / len(steady):8.2f} ms "
              f"(first {times[0]:.0f} ms, with compilation)")


# --- arguments --------------------------------------------------------------------------------------


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    ranges = "; ".join(f"{family}: {r.describe()}" for family, (_, r) in HIDDEN_RANGES.items())
    parser = argparse.ArgumentParser(
        prog="python -m cann_ops_tilelang",
        description="Prints versions, the device and the registered ops, then runs the Engram ops on a GPU or NPU, "
        "or, without one, lowers every kernel for Ascend 950 and CUDA and checks each against its on-chip "
        "memory budget.",
        epilog="Without a GPU or NPU the kernels are lowered (AscendC, and sm_90a cubins when nvcc is found); "
        "the supported ranges are those of cann_ops_tilelang/limits.py.",
    )
    parser.add_argument("--hidden-size", type=int, default=4096, metavar="H",
                        help=f"hidden size H of the demonstration and the lowering ({ranges}; default 4096)")
    parser.add_argument("--tokens", type=_int_at_least(1), default=8192, metavar="T",
                        help="token count T of the demonstration on a device (>= 1; default 8192)")
    parser.add_argument("--steps", type=_int_at_least(0), default=5,
                        help="training steps of the demonstration on a device (>= 0; default 5)")
    parser.add_argument("--lower", action="store_true",
                        help="lower the kernels instead of running the demonstration (what runs without a GPU or NPU)")
    parser.add_argument("--family", action="append", choices=FAMILIES,
                        help="only this family (repeatable; default: all); the demonstration on a device runs engram")
    parser.add_argument("--target", action="append", choices=TARGETS,
                        help="lower only for this target (repeatable; default: both)")
    parser.add_argument("--match", metavar="TEXT",
                        help="lower only the kernels whose name <family>/<case> contains TEXT")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the op schemas and what TileLang printed while lowering each kernel")
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    args.family = [f for f in FAMILIES if f in (args.family or FAMILIES)]
    args.target = [t for t in TARGETS if t in (args.target or TARGETS)]
    for family in args.family:
        name, allowed = HIDDEN_RANGES[family]
        if args.hidden_size not in allowed:
            parser.error(
                f"argument --hidden-size: {args.hidden_size} is not supported by the {family} kernels: "
                f"expected {allowed.describe()} (limits.{name})"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    start = time.perf_counter()
    device = _device()
    print(_header(device, args.verbose))
    if device is not None and "engram" in args.family and not args.lower:
        _run_on_device(device, args.tokens, args.hidden_size, args.steps)
        return 0
    reason = ""
    if device is None:
        reason = "no GPU or NPU found: "
    elif not args.lower:
        reason = "the demonstration runs the Engram ops (--family engram): "
    targets = " and ".join(TARGET_NAMES[t] for t in args.target)
    selected = f" whose name contains {args.match!r}" if args.match else ""
    print(f"{reason}lowering the {', '.join(args.family)} kernels{selected} at H={args.hidden_size} for {targets}")
    results = _lower_all(args.hidden_size, args.family, args.target, args.match, args.verbose)
    print("\n".join(_summary(results, args.target, args.hidden_size, time.perf_counter() - start)))
    kernels = [r for r in results if r.kernel]
    if not kernels and args.match and all(r.ok for r in results):
        print(f"--match {args.match!r} selects no kernel of {', '.join(args.family)} (a usage error)", file=sys.stderr)
        return 2
    return 0 if kernels and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
