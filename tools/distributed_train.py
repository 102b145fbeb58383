"""Data-parallel training of the small Engram + mHC model (cann_ops_tilelang._demo.SmallModel) under DDP,
Megatron-style ``main_grad`` buffers and FSDP2, checked against one process on the same global batch.

    python tools/distributed_train.py --nproc 2                      # 2 GPUs, NCCL (the default on CUDA)
    python tools/distributed_train.py --nproc 1                      # the single-GPU baseline alone
    python tools/distributed_train.py --device cpu --cpu-references  # CPU, gloo, the test references

Every rank builds the model from the same seed; the global batch of ``nproc * tokens`` tokens is split in
equal contiguous token ranges (the model is token-wise: no attention). Each mode reports, after one step on
the same weights and batch:

* whether each rank's logits equal its slice of the single-process logits bit for bit (they do where the
  GEMM libraries pick the same kernels for both token counts);
* the gradients against the single-process ones as ``|g - g_ref|_max / |g_ref|_max`` per parameter, with
  the worst over bf16 and over fp32 parameters: they are averages of per-rank means instead of one mean
  over all tokens (another summation order), and DDP/FSDP2 reduce bf16 gradients in bf16, so the bound is
  bf16's (1e-2) for bf16 parameters and 1e-4 for the fp32 ones (mHC fn/scale/base, reduced in fp32);
* the median step time (forward, backward, gradient reduction, AdamW) and the scaling efficiency
  ``t_1(global batch) / t_N(per-rank batch)``: 1.0 is perfect weak scaling of the same global batch.

Modes: ``ddp`` (torch DistributedDataParallel, gradients averaged in bf16/fp32 per parameter dtype),
``megatron`` (a flat fp32 ``main_grad`` buffer per rank, every parameter a view into it: the Engram gate and
mHC modules accumulate into it themselves, the other layers through a post-accumulate-grad hook; one
all-reduce of the flat buffer, then the mean), ``fsdp2`` (``fully_shard`` per dtype group: FFN, mHC
parameters, head, root; parameters and gradients are Shard(0) DTensors outside forward/backward and full
tensors inside, so the ops see plain tensors). Results go to ``--out`` as JSON and a table on stdout; the
exit status is 1 when a check fails.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from cann_ops_tilelang import limits  # noqa: E402
from cann_ops_tilelang._demo import SmallModel, synthetic_batch  # noqa: E402

MODES = ("ddp", "megatron", "fsdp2")
BF16_BOUND, FP32_BOUND = 1e-2, 1e-4  # relative to the gradient's max: bf16 and fp32 reductions (see above)


def _device(args, rank: int) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _register_references() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from _plugins import references

    references.register()


def _model(args, device) -> SmallModel:
    torch.manual_seed(args.seed)
    return SmallModel(vocab=args.vocab, hidden=args.hidden, layers=args.layers, device=device)


def _grads(model) -> dict[str, torch.Tensor]:
    found = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        found[name] = None if g is None else g.detach().float().cpu().clone()
    return found


def _timed_steps(model, forward, opt, ids, target, steps: int, device, after_backward=lambda: None) -> list[float]:
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(forward(ids), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        after_backward()
        opt.step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def single(args) -> dict:
    """One process on the whole global batch: the reference logits, gradients and step time."""
    device = _device(args, 0)
    if args.cpu_references:
        _register_references()
    model = _model(args, device)
    ids, target = synthetic_batch(args.nproc * args.tokens, args.vocab, args.seed, device)
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits, target).backward()
    grads = _grads(model)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = _timed_steps(model, model, opt, ids, target, args.warmup + args.steps, device)
    return {"logits": logits.detach().float().cpu(), "grads": grads, "dtypes": dtypes,
            "step_ms": statistics.median(times[args.warmup:])}


def _megatron_buffers(model) -> tuple[torch.Tensor, list]:
    """A flat fp32 buffer with a ``main_grad`` view per parameter; layers that do not accumulate into
    ``main_grad`` themselves (Linear, Embedding, RMSNorm) get a hook that moves their ``.grad`` there."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    hooks, offset = [], 0
    for p in params:
        p.main_grad = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()

        def move(p):
            if p.grad is not None:  # the Engram gate and mHC parameters have no .grad: they wrote main_grad
                p.main_grad.add_(p.grad.float())
                p.grad = None

        hooks.append(p.register_post_accumulate_grad_hook(move))
    return flat, hooks


def _wrap(mode: str, model, device):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the mesh on the run's device type: FSDP2's default mesh is CUDA wherever CUDA exists, which would move
        # a CPU (gloo) run's parameters to the GPU of a GPU host
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        # FSDP2 all-gathers one dtype per group: the bf16 FFN of each block, then the block's fp32 mHC
        # parameters, the fp32 mHC head, and the root's bf16 rest (embedding, Engram gate, LM head)
        for block in model.blocks:
            fully_shard(block.sublayer, mesh=mesh)
            fully_shard(block, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model


def _run_mode(mode: str, args, device, ids, target) -> dict:
    model = _model(args, device)
    forward = _wrap(mode, model, device)
    flat, hooks = _megatron_buffers(model) if mode == "megatron" else (None, [])

    def reduce_main_grads():
        if flat is not None:
            dist.all_reduce(flat)
            flat.div_(args.nproc)

    logits = forward(ids)
    torch.nn.functional.cross_entropy(logits, target).backward()
    reduce_main_grads()
    grads = _grads(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if flat is not None:
        flat.zero_()

    def after():  # megatron: AdamW reads .grad, so it gets a copy of the reduced fp32 buffer in the param dtype
        if flat is not None:
            reduce_main_grads()
            for p in model.parameters():
                p.grad = p.main_grad.to(p.dtype, copy=True)
            flat.zero_()

    times = _timed_steps(model, forward, opt, ids, target, args.warmup + args.steps, device, after)
    for h in hooks:
        h.remove()
    return {"logits": logits.detach().float().cpu(), "grads": grads, "step_ms": statistics.median(times[args.warmup:])}


def worker(rank: int, args, store: str, outdir: str) -> None:
    device = _device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.cpu_references:
        _register_references()
    dist.init_process_group(args.backend, init_method=store, rank=rank, world_size=args.nproc)
    ids, target = synthetic_batch(args.nproc * args.tokens, args.vocab, args.seed, device)
    lo, hi = rank * args.tokens, (rank + 1) * args.tokens
    ids, target = ids[lo:hi], target[lo:hi]
    results = {}
    for mode in args.modes:
        try:
            results[mode] = _run_mode(mode, args, device, ids, target)
        except Exception as exc:  # e.g. a collective the backend lacks: reported, the other modes still run
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        dist.barrier()
    torch.save(results, Path(outdir) / f"rank{rank}.pt")  # a file: tensors through a queue die with the worker
    dist.barrier()
    dist.destroy_process_group()
    # NOTE gloo's worker thread may still hold the finished barrier, and through it tensors owned by Python;
    # freeing them while the interpreter finalizes aborts the process now and then (pytorch/pytorch#179291),
    # so the worker exits without finalizing once its results are saved and the group destroyed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _relative(g, ref) -> float:
    scale = ref.abs().max().item()
    return (g - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def compare(args, base: dict, per_rank: dict) -> dict:
    report = {"single_step_ms": base["step_ms"], "modes": {}}
    dtypes = base["dtypes"]
    for mode in args.modes:
        ranks = [per_rank[r][mode] for r in range(args.nproc)]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            report["modes"][mode] = {"ok": False, "error": errors[0]}
            continue
        logits_equal = all(torch.equal(ranks[r]["logits"], base["logits"][r * args.tokens:(r + 1) * args.tokens])
                           for r in range(args.nproc))
        worst = {"bf16": 0.0, "fp32": 0.0}
        missing = []
        for name, ref in base["grads"].items():
            got = ranks[0]["grads"].get(name)
            if got is None or ref is None:
                missing.append(name)
                continue
            kind = "bf16" if dtypes[name] == torch.bfloat16 else "fp32"
            worst[kind] = max(worst[kind], _relative(got, ref))
        same_on_ranks = all(all(torch.equal(ranks[0]["grads"][n], r["grads"][n]) for n in base["grads"]
                                if ranks[0]["grads"].get(n) is not None) for r in ranks)
        step = max(r["step_ms"] for r in ranks)
        report["modes"][mode] = {
            "logits_bitwise": logits_equal, "grad_rel_max_bf16": worst["bf16"], "grad_rel_max_fp32": worst["fp32"],
            "grads_missing": missing, "grads_equal_on_all_ranks": same_on_ranks, "step_ms": step,
            "scaling_efficiency": base["step_ms"] / step,
            "ok": not missing and same_on_ranks and worst["bf16"] <= BF16_BOUND and worst["fp32"] <= FP32_BOUND,
        }
    return report


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl on GPUs, gloo on the CPU")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-references", action="store_true",
                        help="register the test references as CPU kernels (tests/_plugins/references.py)")
    parser.add_argument("--out", type=Path, default=None, help="JSON report")
    args = parser.parse_args(argv)
    for flag, value, low in (("--nproc", args.nproc, 1), ("--tokens", args.tokens, 1), ("--layers", args.layers, 1),
                             ("--vocab", args.vocab, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if args.hidden not in limits.MHC_HIDDEN or args.hidden not in limits.ENGRAM_HIDDEN:
        parser.error(f"--hidden must be a hidden size of both the mHC modules ({limits.MHC_HIDDEN.describe()}) and "
                     f"the Engram gate ({limits.ENGRAM_HIDDEN.describe()}), got {args.hidden}")
    if args.device == "cpu" and not args.cpu_references:
        parser.error("--device cpu needs --cpu-references (the ops have no CPU kernels of their own)")
    if args.backend is None:
        args.backend = "gloo" if args.device == "cpu" else "nccl"
    # One GPU per rank: NCCL refuses two ranks on one GPU, and gloo's collectives on CUDA tensors crashed
    # there (a segfault in allgather_coalesced, PyTorch 2.11 on the H200).
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        parser.error(f"--nproc {args.nproc} needs {args.nproc} CUDA devices, found {torch.cuda.device_count()} "
                     f"(or use --device cpu --cpu-references)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    base = single(args)
    report = {"config": {k: str(v) for k, v in vars(args).items()}}
    if args.nproc > 1:
        ctx = mp.get_context("spawn")
        with tempfile.TemporaryDirectory() as tmp:
            store = f"file://{tmp}/store"
            procs = [ctx.Process(target=worker, args=(r, args, store, tmp)) for r in range(args.nproc)]
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs):  # one failed worker must not leave the others waiting
                time.sleep(0.2)
                if any(p.exitcode not in (None, 0) for p in procs):
                    for p in procs:
                        p.terminate()
            if any(p.exitcode != 0 for p in procs):
                print(f"a worker failed: exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
                return 1
            per_rank = {r: torch.load(Path(tmp) / f"rank{r}.pt") for r in range(args.nproc)}
        report.update(compare(args, base, per_rank))
    else:
        report["single_step_ms"] = base["step_ms"]
        report["modes"] = {}
    print(f"single process, {args.nproc * args.tokens} tokens: {report['single_step_ms']:.2f} ms/step")
    print(f"{'mode':10} {'logits bitwise':>15} {'grad bf16':>10} {'grad fp32':>10} {'ms/step':>9} "
          f"{'efficiency':>10} ok")
    for mode, r in report["modes"].items():
        if "error" in r:
            print(f"{mode:10} failed: {r['error']}")
            continue
        print(f"{mode:10} {str(r['logits_bitwise']):>15} {r['grad_rel_max_bf16']:10.2e} {r['grad_rel_max_fp32']:10.2e} "
              f"{r['step_ms']:9.2f} {r['scaling_efficiency']:10.2f} {r['ok']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if all(r["ok"] for r in report["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
