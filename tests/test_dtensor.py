"""DTensor sharding rules of every op (docs/distributed.md), checked on 2 CPU processes over gloo.

Two worker processes (this file run as a script) call every op on its example call (tests/<family>/
<family>_cases.py) with the test references as CPU kernels (tests/_plugins/references.py, registered in each
worker): for every strategy an op's rule declares, the
arguments are distributed as the strategy says (token dims ``Shard``, weights ``Replicate``, ``Partial``
inputs split element by element between the ranks, which is exact), the op runs on the DTensors under
``CommDebugMode``, and ``full_tensor()`` of every result and written buffer is compared with one unsharded call.
Token-wise results must be bitwise equal and the call must communicate nothing (no gather). Results that are
sums over tokens come back ``Partial``: their ranks' sums are added by the all-reduce, a different order
than the single sequential sum, so they are compared within fp32 tolerance (and partial-row buffers by
their row sums, since each row covers other tokens once the tokens are split).
The workers also check the Replicate fallback (it gathers and still matches), the clear error for a written
buffer whose placement no strategy keeps, and one training step of MHCSublayer and EngramGate on
sequence-sharded DTensors against the same step on plain tensors.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cann_ops_tilelang as ops
from cann_ops_tilelang import _sharding

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
WORLD = 2
# uneven over 2 ranks (8 + 7 rows, DTensor's uneven Shard(0)); rank 0's 8 rows keep every rank's elements on
# the same side of the CPU vector loops as in the unsharded call (a scalar tail rounds exp/sigmoid otherwise)
TOKENS = 15
MHC_HIDDEN, ENGRAM_HIDDEN = 256, 512  # the modeling checks' hidden sizes
# Partial results: the all-reduce adds the 2 ranks' fp32 sums, a reassociation of the unsharded sum; the
# values are O(1..100) sums of up to 9 * 1024 products, so 1e-5 relative is far above the rounding seen.
RTOL, ATOL = 1e-5, 1e-5
# results holding per-worker partial rows over tokens: only their row sum is the contract
ROW_SUM_RESULTS = {("engram_gate_backward", "returns[2]"), ("mhc_head_compute_mix_backward", "grad_mhc_scale_partial"),
                   ("mhc_head_compute_mix_backward", "grad_mhc_base_partial"), ("engram_sinkhorn_step", "returns[1]")}


# --------------------------------------------------------------------------------------------------------
# worker side (this file run as a script, one process per rank)


def make_call(name: str) -> dict:
    """A valid call of ``name`` by argument name: its example call (tests/<family>/<family>_cases.py) at ``TOKENS``
    tokens and the family's smallest hidden size."""
    from _plugins import cases

    return cases.call(name, TOKENS)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [v.clone() for v in value]
    return value


def _distribute(value, code: str, mesh, rank: int):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    if code == "P":
        # rank r holds the elements whose flat index is r mod WORLD, zeros elsewhere: the sum is exact
        keep = (torch.arange(value.numel()) % WORLD == rank).view(value.shape)
        local = torch.where(keep, value, torch.zeros((), dtype=value.dtype))
        return DTensor.from_local(local, mesh, [Partial("sum")], run_check=False)
    placement = Replicate() if code == "R" else Shard(int(code[1:]))
    return distribute_tensor(value, mesh, [placement])


def _results(public, call: dict, outputs) -> dict:
    """Every output (``returns[i]``) and written buffer (list elements ``name[i]``) of a call."""
    found = {}
    outs = outputs if isinstance(outputs, tuple) else (() if outputs is None else (outputs,))
    for i, out in enumerate(outs):
        found[f"returns[{i}]"] = out
    for arg in public.declaration.mutates_args:
        value = call[arg]
        if isinstance(value, list):
            found.update({f"{arg}[{i}]": v for i, v in enumerate(value)})
        else:
            found[arg] = value
    return found


def _compare(name: str, key: str, code: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    base = key.split("[")[0] if not key.startswith("returns") else key
    if code == "P" and (name, base) in ROW_SUM_RESULTS:  # replicated, the rows are the unsharded call's
        got, want = got.sum(0), want.sum(0)
    if got.shape != want.shape or got.dtype != want.dtype:
        detail = f"{tuple(got.shape)}:{got.dtype} vs {tuple(want.shape)}:{want.dtype}"
        return {"ok": False, "how": "shape", "detail": detail}
    if code == "P":
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        ok = torch.allclose(got, want, rtol=RTOL, atol=ATOL)
        return {"ok": bool(ok), "how": "fp32 tolerance", "max_abs_diff": diff}
    return {"ok": bool(torch.equal(got, want)), "how": "bitwise",
            "max_abs_diff": (got.double() - want.double()).abs().max().item() if got.numel() else 0.0}


def _full_tensor(dt):
    """``dt.full_tensor()``; a float8 tensor gathered as its bytes (gloo has no float8 type)."""
    if dt.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return dt.full_tensor()
    from torch.distributed.tensor import DTensor

    raw = DTensor.from_local(dt.to_local().view(torch.uint8), dt.device_mesh, dt.placements, run_check=False,
                             shape=dt.shape, stride=dt.stride())
    return raw.full_tensor().view(dt.dtype)


def run_strategy(name: str, index: int, codes: dict, returns: tuple, mesh, rank: int) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    public = ops.registered_ops()[name]
    names = public.op_state.names
    call = make_call(name)
    ref_call = {k: _clone(v) for k, v in call.items()}
    ref_out = public(*[ref_call[n] for n in names])
    d_call = {}
    for n in names:
        value, code = call[n], codes.get(n, "R")
        if isinstance(value, torch.Tensor):
            d_call[n] = _distribute(value, code, mesh, rank)
        elif isinstance(value, list):
            d_call[n] = [_distribute(v, code, mesh, rank) for v in value]
        else:
            d_call[n] = value
    with CommDebugMode() as comm:
        d_out = public(*[d_call[n] for n in names])
    collectives = comm.get_total_counts()
    want = _results(public, ref_call, ref_out)
    got = _results(public, d_call, d_out)
    checks = {}
    for key, ref in want.items():
        if ref is None:
            continue
        code = returns[int(key[8:-1])] if key.startswith("returns[") and returns else codes.get(key.split("[")[0], "R")
        dt = got[key]
        checks[key] = {"placement": str(dt.placements), **_compare(name, key, code, _full_tensor(dt), ref)}
    return {"op": name, "strategy": index, "collectives": collectives, "checks": checks}


def check_fallback_and_refusal(mesh, rank: int) -> dict:
    """A Replicate written buffer with Shard(0) inputs takes the all-Replicate strategy (gathers, still
    right); a written Replicate parameter-gradient buffer next to a Shard(0) token buffer has no strategy
    that keeps both, so the call raises instead of writing into a redistributed copy."""
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    public = ops.registered_ops()["mhc_post_forward_out"]
    call = make_call("mhc_post_forward_out")
    ref = {k: _clone(v) for k, v in call.items()}
    public(*ref.values())
    d = {k: _distribute(v, "S0", mesh, rank) for k, v in call.items() if k != "out"}
    d["out"] = _distribute(call["out"], "R", mesh, rank)
    with CommDebugMode() as comm:
        public(*d.values())
    out["fallback"] = {"equal": bool(torch.equal(d["out"].full_tensor(), ref["out"])),
                       "placement": str(d["out"].placements), "collectives": comm.get_total_counts()}
    public = ops.registered_ops()["mhc_pre_split_mixes_backward"]
    call = make_call("mhc_pre_split_mixes_backward")
    codes = dict(public.op_state.sharding.strategies[0][0])
    codes["grad_mhc_scale"] = "R"
    before = call["grad_mhc_scale"].clone()
    d = {k: _distribute(v, codes.get(k, "R"), mesh, rank) if isinstance(v, torch.Tensor) else v
         for k, v in call.items()}
    try:
        public(*d.values())
        out["refusal"] = {"raised": False}
    except RuntimeError as exc:
        out["refusal"] = {"raised": True, "message": str(exc),
                          "untouched": bool(torch.equal(d["grad_mhc_scale"].full_tensor(), before))}
    return out


def check_modeling_step(mesh, rank: int, tokens: int = TOKENS, main_grads: tuple[str, ...] = ()) -> dict:
    """One forward and backward of expand_from_embedding, MHCSublayer (with a norm weight), EngramGate and
    MHCHead on sequence-sharded embeddings (Shard(0) of the tokens, parameters Replicate) against the same step
    on plain tensors; the parameters named in ``main_grads`` get an fp32 ``main_grad`` buffer (zeros)."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from cann_ops_tilelang.modeling import EngramGate, MHCHead, MHCSublayer, expand_from_embedding

    hidden = ENGRAM_HIDDEN  # in both ranges (mHC: multiple of 64 from 256; Engram: multiple of 256 from 512)
    torch.manual_seed(0)
    modules = {"sub": MHCSublayer(hidden, torch.nn.Identity(), norm_weight=True), "gate": EngramGate(hidden),
               "head": MHCHead(hidden, norm_weight=True)}
    with torch.no_grad():
        modules["gate"].weight_hidden.copy_(torch.rand_like(modules["gate"].weight_hidden) + 0.5)
        for key in ("sub", "head"):
            modules[key].norm_weight.copy_(torch.rand_like(modules[key].norm_weight) + 0.5)
    embedding = torch.randn(tokens, hidden).bfloat16()
    kv = torch.randn(tokens, 5 * hidden).bfloat16()

    def step(embedding, kv):
        params = {f"{k}.{n}": p for k, m in modules.items() for n, p in m.named_parameters()}
        for name in main_grads:
            params[name].main_grad = torch.zeros_like(params[name], dtype=torch.float32)
        x = embedding.detach().requires_grad_()
        out = modules["head"](modules["gate"](modules["sub"](expand_from_embedding(x)), kv))
        (out.float().square().sum()).backward()
        return out, x.grad, {n: p.main_grad if n in main_grads else p.grad for n, p in params.items()}

    ref_out, ref_grad, ref_pgrads = step(embedding, kv)
    for module in modules.values():
        module.zero_grad(set_to_none=True)
        distribute_module(module, mesh)  # every parameter becomes a replicated DTensor parameter
    d_embedding, d_kv = distribute_tensor(embedding, mesh, [Shard(0)]), distribute_tensor(kv, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        out, grad, pgrads = step(d_embedding, d_kv)
    return {
        "collectives": {str(k): v for k, v in comm.get_comm_counts().items()},
        "out_placement": str(out.placements), "out_equal": bool(torch.equal(out.full_tensor(), ref_out)),
        "grad_equal": bool(torch.equal(grad.full_tensor(), ref_grad)),
        "param_grads": {name: {"placement": str(g.placements),
                               "close": bool(torch.allclose(g.full_tensor().float(), ref_pgrads[name].float(),
                                                            rtol=1e-2, atol=1e-4))}
                        for name, g in pgrads.items()},
    }


def check_modeling_variants(mesh, rank: int) -> dict:
    """The step with Megatron-style main_grad buffers on some parameters (mixed with plain gradients in one op),
    and with fewer tokens than ranks (the buffers are then replicated and the ops gather)."""
    mains = ("sub.fn", "sub.scale", "head.norm_weight", "gate.weight_hidden")
    return {"main_grad": check_modeling_step(mesh, rank, main_grads=mains),
            "one_token": check_modeling_step(mesh, rank, tokens=1)}


def check_modeling_batch_dims(mesh, rank: int) -> dict:
    """Embeddings ``(B, S, H)`` sharded on B or S, evenly or not, through the mHC modules (expand_from_embedding,
    MHCSublayer with an element-wise sublayer, MHCHead) and through the functions (mhc_pre with the link and the
    pre mix, mhc_post, mhc_head, mhc_recompute_chunk), against the same calls on plain tensors. Where the
    sharding does not flatten into a Shard(0) of the tokens the modeling layer gathers and slices back."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from cann_ops_tilelang.modeling import (MHCHead, MHCSublayer, expand_from_embedding, mhc_head, mhc_post, mhc_pre,
                                            mhc_recompute_chunk)

    def sublayer(x):
        return torch.tanh(x.float() * 2).to(x.dtype)

    found = {}
    for batch, seq, dim in ((3, 5, 0), (1, 7, 0), (2, 7, 1), (4, 3, 0)):  # the last: even, no gather
        torch.manual_seed(0)
        sub, head = MHCSublayer(MHC_HIDDEN, sublayer, norm_weight=True), MHCHead(MHC_HIDDEN, norm_weight=True)
        embedding = torch.randn(batch, seq, MHC_HIDDEN).bfloat16()

        def step(x):
            for module in (sub, head):
                module.zero_grad(set_to_none=True)
            x = x.detach().requires_grad_()
            out = head(sub(expand_from_embedding(x)))
            residual = expand_from_embedding(x.detach())  # the functions, by hand
            li, (post, comb), link, pre = mhc_pre(residual, sub.fn, sub.scale, sub.base, return_residual=True,
                                                  return_pre_mix=True)
            y = sublayer(li)
            out2 = mhc_head(mhc_post(y, link, post, comb), head.fn, head.scale, head.base)
            (out.float().square().sum() + out2.float().sum()).backward()
            with torch.no_grad():
                inputs, residuals = mhc_recompute_chunk(residual, [pre], [y], [post], [comb])
            grads = [p.grad for m in (sub, head) for p in m.parameters()]
            return [out, out2, inputs[0], residuals[0]], x.grad, grads

        ref_outs, ref_grad, ref_pgrads = step(embedding)
        for module in (sub, head):
            distribute_module(module, mesh)
        d_embedding = distribute_tensor(embedding, mesh, [Shard(dim)])
        try:
            with CommDebugMode() as comm:
                outs, grad, pgrads = step(d_embedding)
        except Exception as exc:  # reported per case by the test
            found[f"{batch}x{seq}/S{dim}"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        found[f"{batch}x{seq}/S{dim}"] = {
            "placements": sorted({str(t.placements) for t in (*outs, grad)}),
            "equal": [bool(torch.equal(t.full_tensor(), r)) for t, r in zip((*outs, grad), (*ref_outs, ref_grad))],
            "param_grads_close": all(torch.allclose(g.full_tensor(), r, rtol=1e-2, atol=1e-4)
                                     for g, r in zip(pgrads, ref_pgrads)),
            "collectives": {str(k): v for k, v in comm.get_comm_counts().items()},
        }
    # a plain main_grad on a DTensor parameter: the backward's add_ could not mix them, so the forward refuses it
    sub.fn.main_grad = torch.zeros(sub.fn.shape)
    try:
        sub(expand_from_embedding(distribute_tensor(embedding, mesh, [Shard(0)]).requires_grad_()))
        found["plain_main_grad"] = "accepted"
    except TypeError as exc:
        found["plain_main_grad"] = str(exc)
    # a sharded DTensor main_grad: mhc_fn_normw_merge_backward's rule keeps it next to norm_weight's fresh
    # (replicated) gradient in no strategy, so the backward would fail under the op's name; refused at the forward
    sub.fn.main_grad = distribute_tensor(torch.zeros(sub.fn.shape), mesh, [Shard(0)])
    try:
        sub(expand_from_embedding(distribute_tensor(embedding, mesh, [Shard(0)]).requires_grad_()))
        found["sharded_main_grad"] = "accepted"
    except ValueError as exc:
        found["sharded_main_grad"] = str(exc)
    return found


def check_sinkhorn_optimizer(mesh, rank: int) -> dict:
    """EngramSinkhorn on tables sharded Shard(0) as FSDP2 shards them: (1, 64), fewer rows than ranks (rank 1 holds
    none), and (15, 64) split 8 + 7, two steps each against the same steps on plain tensors; then tables and
    gradients placed otherwise, refused by name before anything changes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from cann_ops_tilelang.optim import EngramSinkhorn

    kwargs = dict(lr=0.1, sinkhorn_iters=3, weight_decay=0.01)
    out = {}
    for rows in (1, TOKENS):
        gen = torch.Generator().manual_seed(rows)
        w = torch.randn(rows, 64, generator=gen)
        grads = [torch.randn(rows, 64, generator=gen) for _ in range(2)]
        p = torch.nn.Parameter(w.clone())
        opt = EngramSinkhorn([p], **kwargs)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        dp = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        dopt = EngramSinkhorn([dp], **kwargs)
        dgrads = [distribute_tensor(g, mesh, [Shard(0)]) for g in grads]
        with CommDebugMode() as comm:
            for g in dgrads:
                dp.grad = g
                dopt.step()
        got, buffer = dp.full_tensor(), dopt.state[dp]["momentum_buffer"]
        local_rows = [None] * WORLD
        dist.all_gather_object(local_rows, dp.to_local().shape[0])
        out[f"rows{rows}"] = {
            "local_rows": local_rows, "placement": str(dp.placements), "buffer_placement": str(buffer.placements),
            "table_equal": bool(torch.equal(got, p.detach())),
            "table_close": bool(torch.allclose(got, p.detach(), rtol=RTOL, atol=ATOL)),
            "max_abs_diff": (got - p.detach()).abs().max().item(),
            "buffer_equal": bool(torch.equal(buffer.full_tensor(), opt.state[p]["momentum_buffer"])),
            "step": float(dopt.state[dp]["step"]),
            "collectives": {str(k): v for k, v in comm.get_comm_counts().items()}}

    def refused(make) -> dict:
        """``make() -> (optimizer or None, tables)``; the step (or the constructor) must refuse and change nothing."""
        tables = []
        try:
            opt, tables = make()
            before = [t.to_local().clone() for t in tables]
            opt.step()
            return {"raised": None}
        except (TypeError, ValueError) as exc:
            unchanged = all(torch.equal(t.to_local(), b) for t, b in zip(tables, before)) if tables else True
            return {"raised": type(exc).__name__, "message": str(exc), "unchanged": unchanged,
                    "no_state": not tables or not opt.state}

    def table(rows, placements, on=mesh):
        return torch.nn.Parameter(distribute_tensor(torch.randn(rows, 64), on, placements))

    def column_sharded():
        EngramSinkhorn([table(4, [Shard(1)])])

    def replicated_grad():  # the first table is fine: it must not be updated either
        a, b = table(TOKENS, [Shard(0)]), table(4, [Shard(0)])
        a.grad = distribute_tensor(torch.randn(TOKENS, 64), mesh, [Shard(0)])
        b.grad = distribute_tensor(torch.randn(4, 64), mesh, [Replicate()])
        return EngramSinkhorn([a, b]), [a, b]

    def other_mesh_grad():
        a = table(4, [Shard(0)])
        a.grad = distribute_tensor(torch.randn(4, 64), DeviceMesh("cpu", [[0, 1]]), [Replicate(), Shard(0)])
        return EngramSinkhorn([a]), [a]

    out["refusals"] = {"column_sharded": refused(column_sharded), "replicated_grad": refused(replicated_grad),
                       "other_mesh_grad": refused(other_mesh_grad)}
    return out


def check_engram_gate_gathers(mesh, rank: int) -> dict:
    """EngramGate (forward and backward, a mask) on inputs whose sharding does not flatten into a Shard(0) of the
    tokens: a kv sharded on its last dim (a column-parallel projection's output), (B, S) leading dims sharded on S
    or on B unevenly; and (4, 3) on B, which flattens as it is. Against the same step on plain tensors; then the
    refusals of main_grad buffers that DTensor weights cannot use (a plain tensor, one buffer for both weights)."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from cann_ops_tilelang.modeling import EngramGate

    found = {}
    for name, lead, x_dim, kv_dim in (("kv_last_dim", (TOKENS,), 0, 1), ("seq_uneven", (2, 7), 1, 1),
                                      ("batch_uneven", (3, 5), 0, 0), ("batch_even", (4, 3), 0, 0)):
        torch.manual_seed(0)
        gate = EngramGate(ENGRAM_HIDDEN)
        with torch.no_grad():
            gate.weight_hidden.copy_(torch.rand_like(gate.weight_hidden) + 0.5)
        x = torch.randn(*lead, 4, ENGRAM_HIDDEN).bfloat16()
        kv = torch.randn(*lead, 5 * ENGRAM_HIDDEN).bfloat16()
        mask = (torch.arange(x[..., 0, 0].numel()) % 3 == 1).view(lead)

        def step(x, kv, mask):
            gate.zero_grad(set_to_none=True)
            x, kv = x.detach().requires_grad_(), kv.detach().requires_grad_()
            out = gate(x, kv, mask)
            out.float().square().sum().backward()
            return [out, x.grad, kv.grad], [gate.weight_hidden.grad, gate.weight_embed.grad]

        ref, ref_pgrads = step(x, kv, mask)
        distribute_module(gate, mesh)
        d_x, d_kv, d_mask = (distribute_tensor(t, mesh, [Shard(d)]) for t, d in ((x, x_dim), (kv, kv_dim),
                                                                                  (mask, x_dim)))
        try:
            with CommDebugMode() as comm:
                got, pgrads = step(d_x, d_kv, d_mask)
        except Exception as exc:  # reported per case by the test
            found[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        found[name] = {
            # output and hidden_states' gradient like hidden_states, kv's gradient like kv
            "placements": [str(t.placements) for t in got], "want": [str(d_x.placements)] * 2 + [str(d_kv.placements)],
            "equal": [bool(torch.equal(t.full_tensor(), r)) for t, r in zip(got, ref)],
            "param_grads_close": all(torch.allclose(g.full_tensor().float(), r.float(), rtol=1e-2, atol=1e-4)
                                     for g, r in zip(pgrads, ref_pgrads)),
            "collectives": {str(k): v for k, v in comm.get_comm_counts().items()},
        }
    # main_grad buffers refused at the forward, before anything runs
    gate = EngramGate(ENGRAM_HIDDEN)
    distribute_module(gate, mesh)
    x = distribute_tensor(torch.randn(TOKENS, 4, ENGRAM_HIDDEN).bfloat16(), mesh, [Shard(0)])
    kv = distribute_tensor(torch.randn(TOKENS, 5 * ENGRAM_HIDDEN).bfloat16(), mesh, [Shard(0)])
    shared = torch.zeros_like(gate.weight_hidden, dtype=torch.float32)
    sharded = distribute_tensor(torch.zeros(gate.weight_hidden.shape), mesh, [Shard(0)])
    for name, mains in (("plain", (torch.zeros(gate.weight_hidden.shape), None)), ("shared", (shared, shared)),
                        ("sharded", (sharded, None))):
        gate.weight_hidden.main_grad, gate.weight_embed.main_grad = mains
        try:
            gate(x, kv)
            found[f"refused_{name}"] = {"raised": False}
        except (TypeError, ValueError) as exc:
            found[f"refused_{name}"] = {"raised": True, "kind": type(exc).__name__, "message": str(exc)}
    return found


def worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh

    sys.path.insert(0, str(TESTS))  # _plugins (the cases registries put their own directories on the path)
    from _plugins import references

    references.register()  # the conftest does this in the pytest process; a worker must do it itself
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mesh = DeviceMesh("cpu", list(range(WORLD)))
    report = {"strategies": [], "errors": {}}
    for name, public in sorted(ops.registered_ops().items()):
        rule = public.op_state.sharding
        if rule is None or rule.unsupported is not None:
            continue
        for index, (codes, returns) in enumerate((*rule.strategies, ({}, ()))):  # and the all-Replicate one
            try:
                report["strategies"].append(run_strategy(name, index, codes, returns, mesh, rank))
            except Exception as exc:  # reported per op by the test, not fatal to the other ops
                report["errors"][f"{name}/{index}"] = f"{type(exc).__name__}: {exc}"
    for key, check in (("fallback_refusal", check_fallback_and_refusal), ("modeling", check_modeling_step),
                       ("modeling_variants", check_modeling_variants),
                       ("modeling_batch_dims", check_modeling_batch_dims),
                       ("engram_gate_gathers", check_engram_gate_gathers),
                       ("sinkhorn_optimizer", check_sinkhorn_optimizer)):
        try:
            report[key] = check(mesh, rank)
        except Exception as exc:
            report["errors"][key] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------
# pytest side


def test_every_op_has_a_sharding_rule():
    missing = sorted(n for n, p in ops.registered_ops().items() if p.op_state.sharding is None)
    assert not missing, f"ops without a DTensor sharding rule (public.sharding(...) in the op module): {missing}"


def test_rules_are_checked_when_declared():
    decl = ops.registered_ops()["mhc_sinkhorn_forward"].declaration
    names = ("comb", "comb_out", "repeat", "eps")
    with pytest.raises(ValueError, match="names no argument"):
        _sharding.Rule(decl, names, [{"combo": "S0"}], None)
    with pytest.raises(ValueError, match="placement code"):
        _sharding.Rule(decl, names, [{"comb": "Shard(0)"}], None)
    with pytest.raises(ValueError, match="not both"):
        _sharding.Rule(decl, names, [{"comb": "S0"}], "reason")


def test_unsupported_rule_raises_instead_of_gathering():
    decl = ops.registered_ops()["mhc_sinkhorn_forward"].declaration
    rule = _sharding.Rule(decl, ("comb", "comb_out", "repeat", "eps"), [], "lists of lists are not expressible")
    with pytest.raises(NotImplementedError, match="mhc_sinkhorn_forward has no DTensor sharding rule: lists"):
        _sharding._strategy(rule, (), op_schema=None)


def test_registration_degrades_without_torch_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    states = {n: p.op_state for n, p in ops.registered_ops().items()}
    assert _sharding.register_all(states) == []


def test_uneven_sharding_is_asked_for_only_where_torch_has_the_argument(monkeypatch):
    """torch 2.10 and 2.11 have no ``allow_uneven_sharding``: the rules then pass nothing (passing it was a
    TypeError on every DTensor call there)."""
    from torch.distributed.tensor._ops import utils

    def older(mesh, op_schema, single_mesh_dim_strategies, *, input_index=1):
        raise AssertionError("not called")

    try:
        monkeypatch.setattr(utils, "expand_to_full_mesh_op_strategy", older)
        _sharding._uneven_sharding.cache_clear()
        assert _sharding._uneven_sharding() == {}
    finally:
        monkeypatch.undo()
        _sharding._uneven_sharding.cache_clear()


def test_import_does_not_load_dtensor_and_a_later_call_registers_every_rule():
    # torch itself imports torch.distributed.tensor on the first custom-op call (dynamo's import chain), so in
    # practice the rules go in on the second public call; registering them takes well under a millisecond
    code = ("import json, sys, torch, cann_ops_tilelang as ops, cann_ops_tilelang.modeling\n"
            "loaded = 'torch.distributed.tensor' in sys.modules\n"
            "import torch.distributed.tensor\n"
            "x = torch.ones(4, 512).bfloat16()\n"
            "try:\n    ops.engram_fused_weight(x, x)\nexcept RuntimeError as e:\n    assert 'no kernel' in str(e), e\n"
            "rules = [p.op_state.sharding for p in ops.registered_ops().values()]\n"
            "print(json.dumps([loaded, all(r.registered for r in rules), len(rules)]))")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, registered, count = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded is False and registered is True and count == len(ops.registered_ops())


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    tmp = tmp_path_factory.mktemp("dtensor")
    out = tmp / "report.json"
    init = f"file://{tmp / 'store'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--init", init, "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(WORLD)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-6000:]
    found = json.loads(out.read_text())
    found["seconds"] = time.perf_counter() - start
    return found


@pytest.mark.parametrize("name", sorted(ops.registered_ops()))
def test_op_on_sharded_dtensors_matches_the_unsharded_call(report, name):
    rule = ops.registered_ops()[name].op_state.sharding
    if rule is not None and rule.unsupported is not None:
        pytest.skip(f"no rule by design: {rule.unsupported}")
    errors = {k: v for k, v in report["errors"].items() if k.startswith(f"{name}/")}
    assert not errors, errors
    runs = [r for r in report["strategies"] if r["op"] == name]
    assert rule is not None and len(runs) == len(rule.strategies) + 1
    for run in runs:
        assert run["collectives"] == 0, f"strategy {run['strategy']} communicated: {run}"
        assert run["checks"], run
        bad = {k: c for k, c in run["checks"].items() if not c["ok"]}
        assert not bad, f"strategy {run['strategy']}: {bad}"


def test_partial_results_are_partial_and_token_results_sharded(report):
    by_op = {(r["op"], r["strategy"]): r["checks"] for r in report["strategies"]}
    assert by_op[("mhc_gemm_with_sqrsum_backward", 0)]["returns[0]"]["placement"] == "(Partial(sum),)"
    assert by_op[("engram_gate_backward", 0)]["returns[2]"]["placement"] == "(Partial(sum),)"
    assert by_op[("engram_gate_backward", 0)]["returns[0]"]["placement"] == "(Shard(dim=0),)"
    assert by_op[("mhc_pre_split_mixes_backward", 0)]["grad_mhc_base"]["placement"] == "(Partial(sum),)"
    assert by_op[("mhc_gemm_with_sqrsum_forward", 0)]["returns[0]"]["placement"] == "(Shard(dim=1),)"
    # Partial results (sums over tokens) were compared within fp32 tolerance, every other one bit for bit
    hows = [(check["placement"], check["how"]) for checks in by_op.values() for check in checks.values()]
    assert all(how == ("fp32 tolerance" if "Partial" in placement else "bitwise") for placement, how in hows), hows
    assert sum(how == "bitwise" for _, how in hows) > 3 * sum(how != "bitwise" for _, how in hows)


def test_replicated_written_buffer_falls_back_to_gathering(report):
    assert "fallback_refusal" in report, report["errors"]
    fb = report["fallback_refusal"]["fallback"]
    assert fb["equal"] and fb["placement"] == "(Replicate(),)" and fb["collectives"] > 0


def test_written_buffer_that_no_strategy_keeps_is_refused(report):
    refusal = report["fallback_refusal"]["refusal"]
    assert refusal["raised"], "a Replicate grad_mhc_scale next to Shard(0) tokens must raise"
    assert "cannot be redistributed" in refusal["message"] and "grad_mhc_scale" in refusal["message"]
    assert refusal["untouched"]


def test_modeling_step_on_sequence_sharded_dtensors(report):
    assert "modeling" in report, report["errors"].get("modeling")
    step = report["modeling"]
    assert step["out_placement"] == "(Shard(dim=0),)"
    assert step["out_equal"] and step["grad_equal"]
    grads = step["param_grads"]
    assert sorted(grads) == ["gate.weight_embed", "gate.weight_hidden", "head.base", "head.fn", "head.norm_weight",
                             "head.scale", "sub.base", "sub.fn", "sub.norm_weight", "sub.scale"]
    assert all(g["close"] for g in grads.values()), grads
    # no activation is gathered: the buffers the modeling layer allocates are token-sharded and the sums over
    # tokens Partial; each parameter's gradient is all-reduced once (fp32) and comes back Replicate
    assert step["collectives"] == {"c10d_functional.all_reduce": len(grads)}, step["collectives"]
    assert {g["placement"] for g in grads.values()} == {"(Replicate(),)"}


def test_modeling_step_with_main_grads_and_with_fewer_tokens_than_ranks(report):
    assert "modeling_variants" in report, report["errors"].get("modeling_variants")
    for name, step in report["modeling_variants"].items():
        assert step["out_equal"] and step["grad_equal"], name
        assert all(g["close"] for g in step["param_grads"].values()), (name, step["param_grads"])
        assert {g["placement"] for g in step["param_grads"].values()} == {"(Replicate(),)"}, name
    assert "c10d_functional.all_gather_into_tensor" not in report["modeling_variants"]["main_grad"]["collectives"]


def test_modeling_with_batch_dims_sharded_unevenly(report):
    """(B, S) leading dims sharded where DTensor cannot flatten them into a Shard(0) of the tokens (B = 3 or 1 on
    2 ranks, or S sharded): the modules and functions gather those dims and slice the results back, so every
    result keeps the input's placement and equals the unsharded call bit for bit (the same tokens, computed
    whole on each rank). An even Shard(0) of B flattens as it is: no gather."""
    assert "modeling_batch_dims" in report, report["errors"].get("modeling_batch_dims")
    found = report["modeling_batch_dims"]
    assert found.pop("plain_main_grad") == ("cann_ops_tilelang::modeling.mhc_pre: argument 'fn.main_grad': expected "
                                            "a DTensor like the parameter, got a plain tensor")
    assert found.pop("sharded_main_grad") == ("cann_ops_tilelang::modeling.mhc_pre: argument 'fn.main_grad': expected "
                                              "a replicated DTensor (Replicate on every mesh dim), got placements "
                                              "(Shard(dim=0),)")
    assert sorted(found) == ["1x7/S0", "2x7/S1", "3x5/S0", "4x3/S0"], found
    for case, result in found.items():
        assert "error" not in result, (case, result)
        assert result["placements"] == [f"(Shard(dim={case[-1]}),)"], (case, result)
        assert all(result["equal"]) and result["param_grads_close"], (case, result)
    for case in ("1x7/S0", "2x7/S1", "3x5/S0"):
        assert found[case]["collectives"].get("c10d_functional.all_gather_into_tensor", 0) > 0, found[case]
    assert "c10d_functional.all_gather_into_tensor" not in found["4x3/S0"]["collectives"], found["4x3/S0"]


def test_sinkhorn_optimizer_on_row_sharded_tables(report):
    """EngramSinkhorn on FSDP2-style Shard(0) tables (docs/ops/engram.md#sinkhorn): each rank updates its rows and
    only the column sums of squares are all-reduced (once per Sinkhorn round, never a gather). With one row on two
    ranks the other rank's sums are zeros, so the update is bitwise the unsharded one; 8 + 7 rows add the ranks'
    sums in another order (fp32 tolerance). The momentum is element-wise: bitwise in both."""
    assert "sinkhorn_optimizer" in report, report["errors"].get("sinkhorn_optimizer")
    got = report["sinkhorn_optimizer"]
    for key, local_rows in (("rows1", [1, 0]), (f"rows{TOKENS}", [8, 7])):
        run = got[key]
        assert run["local_rows"] == local_rows, run
        assert run["placement"] == run["buffer_placement"] == "(Shard(dim=0),)", run
        assert run["buffer_equal"] and run["step"] == 2.0, run
        assert run["collectives"] == {"c10d_functional.all_reduce": 2 * 3}, run  # 2 steps of 3 rounds
        assert run["table_close"], run
    assert got["rows1"]["table_equal"], got["rows1"]
    expected = {"column_sharded": "expected a DTensor table Replicate or Shard(0) on every mesh dim",
                "replicated_grad": "expected a gradient placed as the table",
                "other_mesh_grad": "expected a gradient placed as the table"}
    for case, text in expected.items():
        refusal = got["refusals"][case]
        assert refusal["raised"] == "ValueError" and refusal["message"].startswith(f"EngramSinkhorn: {text}"), refusal
        assert refusal["unchanged"] and refusal["no_state"], refusal


def test_engram_gate_gathers_what_does_not_flatten(report):
    """kv sharded on its last dim, (B, S) sharded on S or on B unevenly: gathered where needed (no DTensor error),
    results equal to the unsharded step and in the inputs' placements; an even B flattens as it is (no gather)."""
    assert "engram_gate_gathers" in report, report["errors"].get("engram_gate_gathers")
    found = report["engram_gate_gathers"]
    for name in ("kv_last_dim", "seq_uneven", "batch_uneven", "batch_even"):
        case = found[name]
        assert "error" not in case, (name, case)
        assert case["equal"] == [True, True, True] and case["param_grads_close"], (name, case)
        assert case["placements"] == case["want"], (name, case)
    assert "c10d_functional.all_gather_into_tensor" not in found["batch_even"]["collectives"], found["batch_even"]
    plain, shared, sharded = found["refused_plain"], found["refused_shared"], found["refused_sharded"]
    assert plain["raised"] and plain["kind"] == "TypeError", plain
    # one wording with mHC's (modeling._buffers.honoured_main_grad)
    assert "modeling.engram_gate: argument 'weight_hidden.main_grad': expected a DTensor like the parameter" in \
        plain["message"], plain
    assert sharded["raised"] and sharded["kind"] == "ValueError", sharded
    assert "modeling.engram_gate: argument 'weight_hidden.main_grad': expected a replicated DTensor" in \
        sharded["message"], sharded
    assert shared["raised"] and shared["kind"] == "ValueError", shared
    assert "modeling.engram_gate: argument 'weight_embed'" in shared["message"] and \
        "'weight_hidden'" in shared["message"], shared


def test_the_distributed_run_is_quick(report):
    assert report["seconds"] < 90, f"the 2-process run took {report['seconds']:.0f} s"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    worker(cli.rank, cli.init, cli.out)
    # NOTE gloo's worker thread may still hold the finished barrier, and through it tensors owned by Python;
    # freeing them while the interpreter finalizes aborts the process now and then (pytorch/pytorch#179291),
    # so the worker exits without finalizing once its report is written and the group destroyed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
