"""``python -m cann_ops_tilelang``: versions, backends and registered ops, then a demonstration.

With a CUDA GPU or an Ascend NPU it runs every Engram op once at a model shape and a few training
steps of a small model that uses the Engram gate, with timings (the mHC primitives join the
demonstration once their device tier has run). On a CPU-only machine it lowers every kernel
for both targets (AscendC source for Ascend 950; an sm_90a cubin for CUDA, when nvcc is present)
and reports each, so the package can be seen working anywhere.
"""

import argparse
import importlib.metadata
import platform
import shutil
import sys
import time

import torch

from . import config
from ._library import registered_ops
from ._version import __version__

FAMILIES = ("engram", "mhc")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _header() -> str:
    npu = "present" if config.npu_available() else ("torch_npu installed, no NPU" if config.has_torch_npu() else "no")
    cuda = torch.cuda.get_device_name() if config.cuda_available() else "no"
    lines = [
        f"cann_ops_tilelang {__version__}",
        f"python {platform.python_version()}, torch {torch.__version__}, tilelang {_version('tilelang')}",
        f"backends: cuda kernels ({cuda}), ascend 950 kernels (NPU: {npu})",
        f"registered ops ({len(registered_ops())}):",
    ]
    for name, public in sorted(registered_ops().items()):
        lines.append(f"  {public.op._opoverload._schema}")
    return "\n".join(lines)


def _lower_all(hidden_size: int) -> int:
    """Lowers every kernel of every family for both targets; returns the number of failures."""
    import importlib

    failures = 0
    have_nvcc = shutil.which("nvcc") is not None
    for family in FAMILIES:
        for backend in ("ascend", "cuda"):
            kernels = importlib.import_module(f"{__package__}.kernels.{backend}.{family}")
            build = importlib.import_module(f"{__package__}.kernels.{backend}._build")
            for name, prim_func in kernels.lowering_cases(hidden_size).items():
                start = time.perf_counter()
                try:
                    if backend == "ascend":
                        lowered = build.lower_ascendc(prim_func)
                        budget = lowered.budget_bytes
                        what = f"AscendC {len(lowered.source):>7} chars, UB {lowered.ub_bytes:>6} / {budget} B"
                        if lowered.ub_bytes > budget:
                            failures += 1
                            what += "  OVER BUDGET"
                    elif have_nvcc:
                        built = build.compile_cubin(prim_func, arch="sm_90a")
                        what = (
                            f"sm_90a cubin {len(built.cubin):>7} B, shared {built.smem_bytes:>6} / "
                            f"{built.budget_bytes} B, {built.threads:>4} threads"
                        )
                        if not built.fits:
                            failures += 1
                            what += "  OVER BUDGET"
                    else:
                        what = "skipped: nvcc not found"
                except Exception as exc:  # report and go on: the point is to show every kernel
                    failures += 1
                    what = f"FAILED: {type(exc).__name__}: {exc}"
                seconds = time.perf_counter() - start
                print(f"  {backend:6} {family}/{name:32} {what}  ({seconds:.1f} s)")
    return failures


def _bench(fn, reps: int = 20) -> float:
    """Mean wall time in µs of ``fn`` on the device after a warm-up (a demonstration, not a benchmark)."""
    fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else torch.npu.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else torch.npu.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def _run_on_device(device: str, tokens: int, hidden_size: int, steps: int) -> None:
    import cann_ops_tilelang as ops
    from cann_ops_tilelang.modeling import EngramGate

    m = 4
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    x, kv, wh, we = randn(tokens, m, hidden_size), randn(tokens, m + 1, hidden_size), randn(m, hidden_size), randn(
        m, hidden_size
    )
    print(f"every Engram op once at T={tokens}, m={m}, H={hidden_size} (first call compiles):")
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

    print(f"training {steps} steps of a small Engram-gated model (T={tokens}, H={hidden_size}):")
    torch.manual_seed(0)
    gate = EngramGate(hidden_size, device=device)
    embed_dim = 256
    proj = torch.nn.Linear(embed_dim, (m + 1) * hidden_size, device=device, dtype=torch.bfloat16)
    head = torch.nn.Linear(hidden_size, 1, device=device, dtype=torch.bfloat16)
    params = [*gate.parameters(), *proj.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    memory = torch.randn(tokens, embed_dim, device=device, dtype=torch.bfloat16)
    target = torch.randn(tokens, 1, device=device)
    for step in range(steps):
        start = time.perf_counter()
        hidden = gate(x, proj(memory), None)
        loss = (head(hidden.mean(1)).float() - target).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        _bench(lambda: None, reps=1)
        print(f"  step {step}: loss {loss.item():.5f}  {(time.perf_counter() - start) * 1e3:8.2f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cann_ops_tilelang", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=4096, help="hidden size H of the demonstration")
    parser.add_argument("--tokens", type=int, default=8192, help="token count T of the demonstration (device)")
    parser.add_argument("--steps", type=int, default=5, help="training steps of the demonstration (device)")
    parser.add_argument("--lower", action="store_true", help="lower every kernel even when a device is present")
    args = parser.parse_args(argv)

    print(_header())
    device = "cuda" if config.cuda_available() else ("npu" if config.npu_available() else None)
    if device is not None:
        _run_on_device(device, args.tokens, args.hidden_size, args.steps)
    if device is None or args.lower:
        print(f"no GPU or NPU here: lowering every kernel at H={args.hidden_size} for both targets" if device is None
              else f"lowering every kernel at H={args.hidden_size} for both targets")
        failures = _lower_all(args.hidden_size)
        print("all kernels lowered" if failures == 0 else f"{failures} kernel(s) failed to lower")
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
