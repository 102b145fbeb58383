"""Host time of the mHC chain: what a sublayer step costs the CPU, apart from the kernels.

    python tools/host_time.py [--device cpu|cuda] [--tokens 8] [--hidden 4096] [--steps 300] [--eager] [--per-op]

``--device cuda`` times the real thing on a GPU (the host's wall time per step while the launches queue, then
the wall time with the stream drained). ``--device cpu`` needs no GPU: every op's CUDA device path (prepare,
checks, launcher) is registered for the CPU with the TileLang kernels replaced by no-ops, so that the step's
host time can be measured and profiled on a development machine (the numbers of docs/perf/h200/mhc.md,
2026-12-03 and 2026-12-04). ``--per-op`` also times each op of the step alone: the dispatcher call, our device
path, its prepare function and its launcher.
"""

import argparse
import importlib
import os
import pkgutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from cann_ops_tilelang import _library, limits  # noqa: E402


# the Library holding the CPU stubs: replaced whole on each call (torch 2.11 refuses a second Python registration
# of one op and key; 2.13 overrides with a warning)
_STUBS: torch.library.Library | None = None


def _stub_cuda_paths_on_cpu(record: list | None) -> None:
    """Registers every op's CUDA device path for the CPU, its TileLang kernels no-ops; ``record`` collects the
    calls ``(name, args, kwargs)`` when given."""
    global _STUBS
    from cann_ops_tilelang.chips import H200

    os.environ.setdefault("OPS_TILELANG_NUM_SMS", str(H200.sms))  # for the launchers that size grids
    import cann_ops_tilelang.kernels.cuda as cuda_kernels

    def no_op(*args, **kwargs):
        return None

    for info in pkgutil.walk_packages(cuda_kernels.__path__, cuda_kernels.__name__ + "."):
        module = importlib.import_module(info.name)
        if hasattr(module, "jit_compile"):
            module.jit_compile = lambda op, key, prim_func: no_op
    if _STUBS is not None:
        _STUBS._destroy()
    _STUBS = torch.library.Library(_library.NAMESPACE, "IMPL")
    for name, public in _library.registered_ops().items():
        run = public.op_state.kernel("cuda")
        if record is not None:
            def run(*args, _run=run, _name=name, **kwargs):
                record.append((_name, args, kwargs))
                return _run(*args, **kwargs)
        _STUBS.impl(name, run, "CPU")


def _per_call_us(fn, calls: int) -> float:
    for _ in range(calls // 20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def _per_op(recorded: list) -> None:
    """Times each recorded op call: the dispatcher, the device path, its prepare function and its launcher."""
    ops = _library.registered_ops()
    backend = "cuda"
    print(f"{'op':44s} {'dispatcher':>10s} {'device path':>11s} {'prepare':>8s} {'launcher':>8s}  (us per call)")
    total = [0.0] * 4
    with torch.no_grad():
        for name, args, kwargs in recorded:
            state = ops[name].op_state
            overload = getattr(torch.ops.cann_ops_tilelang, name).default
            run = state.kernel(backend)
            full, arguments = state.bind(args, kwargs)
            module = _library._backend_module(backend, state.decl.family, state.decl.module)
            outputs = state.prepare(*full)
            times = [_per_call_us(fn, 2000) for fn in (
                lambda: overload(*args, **kwargs), lambda: run(*args, **kwargs), lambda: state.prepare(*full),
                lambda: state.launch(module, outputs, **arguments))]
            total = [t + u for t, u in zip(total, times)]
            print(f"{name:44s} {times[0]:10.2f} {times[1]:11.2f} {times[2]:8.2f} {times[3]:8.2f}")
    print(f"{'all ' + str(len(recorded)) + ' calls':44s} {total[0]:10.2f} {total[1]:11.2f} {total[2]:8.2f} "
          f"{total[3]:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eager", action="store_true", help="time the eager module instead of the compiled one")
    parser.add_argument("--per-op", action="store_true", help="also time each op of the step alone (cpu)")
    opts = parser.parse_args()
    if opts.per_op and opts.device != "cpu":
        parser.error("--per-op records the step's calls on the CPU harness: use it with --device cpu")
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if opts.tokens < 1 or opts.steps < 1:
        parser.error(f"--tokens and --steps must be >= 1, got {opts.tokens} and {opts.steps}")
    if opts.hidden not in limits.MHC_HIDDEN:
        parser.error(f"--hidden must be an mHC hidden size ({limits.MHC_HIDDEN.describe()}), got {opts.hidden}")

    if opts.device == "cpu":
        _stub_cuda_paths_on_cpu(None)
    from cann_ops_tilelang.modeling import MHCSublayer

    module = MHCSublayer(opts.hidden, torch.nn.Identity(), device=opts.device)
    x = torch.randn(opts.tokens, 4, opts.hidden, device=opts.device).bfloat16().requires_grad_()
    grad = torch.randn_like(x)
    step_module = module if opts.eager else torch.compile(module, fullgraph=True)

    def step():
        step_module(x).backward(grad)

    for _ in range(5):
        step()
    sync = torch.cuda.synchronize if opts.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(opts.steps):
        step()
    issued = time.perf_counter()
    sync()
    done = time.perf_counter()
    mode = "eager" if opts.eager else "compiled"
    print(f"{mode} MHCSublayer step, T={opts.tokens}, H={opts.hidden}, {opts.device}: host "
          f"{1e6 * (issued - start) / opts.steps:.0f} us per step, wall {1e6 * (done - start) / opts.steps:.0f} us")
    if opts.per_op:
        recorded: list = []
        _stub_cuda_paths_on_cpu(recorded)
        step()
        _stub_cuda_paths_on_cpu(None)
        _per_op(recorded)


if __name__ == "__main__":
    main()
