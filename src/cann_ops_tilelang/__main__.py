"""``python -m cann_ops_tilelang``: versions, devices and registered ops, then a demonstration.

With a CUDA GPU or an Ascend NPU it runs the Engram gate's ops once at a model shape and trains a small model
(mHC sublayers, an Engram gate, the mHC head) for a few steps, eager and compiled, with timings. Without one
(or with ``--lower``) it instead lowers kernels for both targets (AscendC source for Ascend 950, checked
against the UB budget; an sm_90a cubin for CUDA, checked against the shared-memory budget, when nvcc is
found) and ends with a summary, so the package can be seen working anywhere. By default it lowers a
representative set, the first case each kernel module lists (one kernel per module and target, 58 in all),
which takes well under two minutes on two cores; ``--all`` lowers every kernel variant (301 at H = 4096),
``--match`` those whose name contains a text. The kernels are lowered on ``--jobs`` worker processes (default:
one per core), a progress row printed as each finishes.

The kernels are enumerated as the family aggregators ``cann_ops_tilelang.kernels.<backend>.<family>
.lowering_cases(hidden_size)`` do it, one kernel module at a time (each module's ``lowering_cases``);
supported sizes come from :mod:`cann_ops_tilelang.limits`.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import multiprocessing
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
from ._library import registered_families, registered_ops
from ._version import __version__

# the families of the registered ops (their declarations), not a list kept here: a new family's package is enough
FAMILIES = tuple(registered_families())
TARGETS = ("ascend", "cuda")
CUDA_ARCH = "sm_90a"
# the hidden-size range of each family's kernels, (its name in limits.py, the range); the demonstration runs the
# Engram ops
HIDDEN_RANGES = {family: limits.hidden_sizes(family)[:2] for family in FAMILIES}
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


def _header(device: str | None, verbose: bool) -> str:
    lines = [
        f"cann_ops_tilelang {__version__} (python {platform.python_version()}, torch {torch.__version__}, "
        f"tilelang {_version('tilelang')})",
        _device_line(device),
    ]
    ops = registered_ops()
    by_family: dict[str, list[str]] = {}
    for name, public in ops.items():
        by_family.setdefault(public.declaration.family, []).append(name)
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
    name: str  # <family>/<op module>/<case>, or a kernel module's lowering_cases call
    kernel: bool = True  # False: a kernel module's enumeration (it gets a row only when it failed or printed)
    ok: bool = False  # built, and within its budget
    built: bool = False  # lowered (AscendC), cubin built or CUDA source generated
    over_budget: bool = False
    what: str = ""
    seconds: float = 0.0
    messages: list[str] = dataclasses.field(default_factory=list)

    @property
    def status(self) -> str:
        return "ok" if self.ok else "OVER BUDGET" if self.over_budget else "FAILED"


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
    result.ok = result.built and not result.over_budget


def _failed(exc: BaseException) -> str:
    text = str(exc).strip()
    return type(exc).__name__ + (f": {text.splitlines()[0]}" if text else "")


# The work runs in worker processes (``--jobs``; ``--jobs 1`` runs it in this process). A module is the unit of
# enumeration: ``lowering_cases`` of one kernel module, cached per process so that lowering several of its
# kernels in one worker builds them once.
Module = tuple[str, str, str]  # (target, family, op module)


def _kernel_modules(targets, families) -> list[Module]:
    """Every kernel module of the selected targets and families, in a fixed order (target, family, module name):
    the op modules each family aggregator discovers (importing them is left to the workers)."""
    from .kernels import _family

    modules = []
    for target in targets:
        for family in families:
            package = importlib.import_module(f"{__package__}.kernels.{target}.{family}").__name__
            modules += [(target, family, name) for name in _family.op_modules(package)]
    return modules


@functools.cache
def _module_cases(target: str, family: str, module: str, hidden_size: int) -> dict:
    """``{case: prim_func}`` of one kernel module at ``hidden_size`` (what its family aggregator collects)."""
    return importlib.import_module(f"{__package__}.kernels.{target}.{family}.{module}").lowering_cases(hidden_size)


def _enumerate(target: str, family: str, module: str, hidden_size: int) -> tuple[_Result, list[str]]:
    """The case names of one kernel module, and the row of its ``lowering_cases`` call (shown when it failed or
    printed something)."""
    step = _Result(target, f"{family}/{module}: lowering_cases({hidden_size})", kernel=False, ok=True, built=True)
    names: list[str] = []
    start = time.perf_counter()
    try:
        with _captured_output() as step.messages:
            names = list(_module_cases(target, family, module, hidden_size))
    except Exception as exc:  # report and go on: the point is to show every kernel
        step.ok = step.built = False
        step.what = _failed(exc)
    step.seconds = time.perf_counter() - start
    step.what = step.what or f"{len(names)} kernels"
    return step, names


def _lower_case(target: str, family: str, module: str, case: str, hidden_size: int, nvcc: str | None) -> _Result:
    """Lowers one kernel (``nvcc``: build a cubin with it; None: CUDA source only); its time is the lowering's."""
    result = _Result(target, f"{family}/{module}/{case}")
    try:
        with _captured_output() as result.messages:
            build = importlib.import_module(f"{__package__}.kernels.{target}._build")
            prim_func = _module_cases(target, family, module, hidden_size)[case]
            start = time.perf_counter()
            try:
                _lower_one(target, build, prim_func, nvcc, result)
            finally:
                result.seconds = time.perf_counter() - start
    except Exception as exc:
        result.ok = False
        result.what = _failed(exc)
    return result


def _select(listing: dict[Module, list[str]], every: bool, match: str | None) -> list[tuple[Module, str]]:
    """The kernels to lower, in listing order: with ``match``, every kernel whose name ``<family>/<module>/<case>``
    contains it; with ``every``, every kernel; else the representative set: the first case each kernel module
    lists (its primary variant; the modules list them in a fixed order), one per module and target."""
    chosen = []
    for (target, family, module), names in listing.items():
        if match is not None:
            names = [case for case in names if match in f"{family}/{module}/{case}"]
        elif not every:
            names = names[:1]
        chosen += [((target, family, module), case) for case in names]
    return chosen


@contextlib.contextmanager
def _workers(jobs: int, most: int):
    """A pool of ``min(jobs, most)`` worker processes for :func:`_run_tasks`, shut down on leaving (None: run
    in this process, for ``--jobs 1`` or a single task). One pool serves the enumeration and the lowering: a
    worker imports TileLang once, and lowers the kernels of the modules it enumerated without building them
    again."""
    if min(jobs, most) <= 1:
        yield None
        return
    # spawned, not forked: the workers import TileLang themselves, and this process (which holds torch's
    # threads, or pytest's) is never copied
    pool = concurrent.futures.ProcessPoolExecutor(min(jobs, most), mp_context=multiprocessing.get_context("spawn"))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_tasks(pool, tasks: list[tuple], on_done) -> None:
    """Runs ``fn(*args)`` for each ``(fn, *args)`` of ``tasks`` on the workers of ``pool`` (in this process when
    it is None), and calls ``on_done(index, result)`` in this process as each finishes; an exception of the
    machinery (a worker that died) is the result of its task."""
    if pool is None:
        for index, (fn, *args) in enumerate(tasks):
            on_done(index, fn(*args))
        return
    # run as ``python -m``, this module is __main__, which spawned workers do not import: they get the functions
    # by the module's own name
    module = importlib.import_module(f"{__package__}.__main__")
    futures = {pool.submit(getattr(module, fn.__name__), *args): index for index, (fn, *args) in enumerate(tasks)}
    for future in concurrent.futures.as_completed(futures):
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - a broken pool fails its tasks, never the run
            result = exc
        on_done(futures[future], result)


def _report(result: _Result, prefix: str, verbose: bool) -> None:
    """A row: the fixed-width fields (target, status, time) first, then the kernel's name and what it built."""
    lines = len(result.messages)
    note = f"  [{lines} TileLang line{'s' if lines > 1 else ''}]" if lines else ""
    print(f"{prefix}{result.target:6} {result.status:11} {result.seconds:5.1f} s  {result.name}  {result.what}{note}",
          flush=True)
    if verbose:
        for line in result.messages:
            print(f"           | {line}")


def _lower_all(hidden_size: int, families, targets, match: str | None, every: bool, jobs: int,
               verbose: bool) -> tuple[list[_Result], int]:
    """Enumerates the kernel modules' cases, selects the kernels (:func:`_select`), lowers them on ``jobs``
    workers and prints a progress row as each finishes. Returns the results (one per kernel, plus one per
    module enumeration that failed or printed) and the number of kernels enumerated."""
    nvcc = _nvcc()[0]
    modules = _kernel_modules(targets, families)
    listing: dict[Module, list[str]] = {}
    steps: list[_Result] = []

    def listed(index: int, outcome) -> None:
        if isinstance(outcome, BaseException):
            target, family, module = modules[index]
            outcome = _Result(target, f"{family}/{module}: lowering_cases", kernel=False, what=_failed(outcome)), []
        step, names = outcome
        listing[modules[index]] = names
        if step.messages or not step.ok:
            steps.append(step)

    chosen: list[tuple[Module, str]] = []
    results: list[_Result | None] = []
    count = 0

    def lowered(index: int, result) -> None:
        nonlocal count
        if isinstance(result, BaseException):
            (target, family, module), case = chosen[index]
            result = _Result(target, f"{family}/{module}/{case}", what=_failed(result))
        results[index] = result
        count += 1
        _report(result, f"[{count:>{len(str(len(chosen)))}}/{len(chosen)}] ", verbose)

    with _workers(jobs, len(modules)) as pool:
        _run_tasks(pool, [(_enumerate, *module, hidden_size) for module in modules], listed)
        listing = {module: listing[module] for module in modules}  # the fixed order, whatever finished first
        for step in steps:
            _report(step, "", verbose)
        chosen = _select(listing, every, match)
        results = [None] * len(chosen)
        _run_tasks(pool, [(_lower_case, *module, case, hidden_size, nvcc) for module, case in chosen], lowered)
    return steps + results, sum(len(names) for names in listing.values())


def _summary(results: list[_Result], targets, hidden_size: int, enumerated: int, seconds: float) -> list[str]:
    kernels = [r for r in results if r.kernel]
    lines = [f"summary (H={hidden_size}; {len(kernels)} of the {enumerated} kernels):"]
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
    lines.extend(f"    {r.target} {r.name}: {r.status}: {r.what.strip()}" for r in failures)
    noisy = [r for r in results if r.messages]
    if noisy:
        count = sum(len(r.messages) for r in noisy)
        lines.append(f"  TileLang printed {count} line{'s' if count > 1 else ''} while lowering {len(noisy)} "
                     f"kernel{'s' if len(noisy) > 1 else ''} (counted on their rows; --verbose shows them)")
    busy = sum(r.seconds for r in kernels)
    lines.append(f"  total time: {seconds:.1f} s (lowering {busy:.1f} s summed over the kernels)")
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
    out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, 1e-6, 1e-6)
    gx, gkv, part = ops.engram_gate_backward(x, x, kv, wf, dot, g, rx, rk, 1e-6)
    gwh = torch.zeros(m, hidden_size, device=device)
    gwe = torch.zeros_like(gwh)
    calls = {
        "engram_fused_weight": lambda: ops.engram_fused_weight(wh, we),
        "engram_gate_forward": lambda: ops.engram_gate_forward(x, kv, wf, 1e-6, 1e-6),
        "engram_gate_forward (no stats)": lambda: ops.engram_gate_forward(x, kv, wf, 1e-6, 1e-6, False),
        "engram_gate_backward": lambda: ops.engram_gate_backward(x, x, kv, wf, dot, g, rx, rk, 1e-6),
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


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


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
        "or, without one, lowers kernels for Ascend 950 and CUDA (one per kernel module; --all: every one) and checks "
        "each against its on-chip memory budget.",
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
    parser.add_argument("--all", action="store_true", dest="every",
                        help="lower every kernel variant (default: the first case of each kernel module, one kernel "
                        "per module and target)")
    parser.add_argument("-j", "--jobs", type=_int_at_least(1), default=_cores(), metavar="N",
                        help=f"worker processes that lower the kernels (>= 1; default: the cores, {_cores()} here; "
                        "1 lowers in this process)")
    parser.add_argument("--family", action="append", choices=FAMILIES,
                        help="only this family (repeatable; default: all); the demonstration on a device runs engram")
    parser.add_argument("--target", action="append", choices=TARGETS,
                        help="lower only for this target (repeatable; default: both)")
    parser.add_argument("--match", metavar="TEXT",
                        help="lower the kernels whose name <family>/<op module>/<case> contains TEXT (any variant, "
                        "as with --all)")
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
    if args.match:
        selected = f"the {', '.join(args.family)} kernels whose name contains {args.match!r}"
    elif args.every:
        selected = f"every {', '.join(args.family)} kernel"
    else:
        selected = f"the first kernel of each {', '.join(args.family)} kernel module (--all: every kernel)"
    jobs = min(args.jobs, len(_kernel_modules(args.target, args.family)))  # the pool's size (_workers)
    workers = "in this process" if jobs <= 1 else f"on {jobs} worker processes"
    print(f"{reason}lowering {selected} at H={args.hidden_size} for {targets}, {workers}", flush=True)
    results, enumerated = _lower_all(args.hidden_size, args.family, args.target, args.match, args.every, args.jobs,
                                     args.verbose)
    print("\n".join(_summary(results, args.target, args.hidden_size, enumerated, time.perf_counter() - start)))
    kernels = [r for r in results if r.kernel]
    if not kernels and args.match and all(r.ok for r in results):
        print(f"--match {args.match!r} selects no kernel of {', '.join(args.family)} (a usage error)", file=sys.stderr)
        return 2
    return 0 if kernels and all(r.ok for r in results) else 1

if __name__ == "__main__":
    sys.exit(main())
