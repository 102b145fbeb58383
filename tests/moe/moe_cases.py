"""Example calls of the MoE routing ops, the family's cases registry (read through tests/_plugins/cases.py): for each
op ``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema
order. The gates do not read the hidden size (``hidden`` is ignored): their sizes are the expert count ``E`` and
``k``, options of the calls.
"""

import torch
from moe_ref import moe_topk_gate_forward_ref

import cann_ops_tilelang as ops

F32 = torch.float32

# the family's ops as registered, not listed here (each has an <op>_call below: tests/test_example_calls.py)
OPS = [name for name, public in ops.registered_ops().items() if public.declaration.family == "moe"]
# E and k of the example calls (DeepSeek-V3's)
EXPERTS, TOPK = 256, 8


def scores(tokens, experts, *, seed=0, ties=False):
    """``(T, E)`` fp32 router scores drawn on the CPU; with ``ties`` every score is one of four values, so that most
    picks break a tie (the smaller id first)."""
    gen = torch.Generator().manual_seed(seed)
    if ties:
        return torch.randint(0, 4, (tokens, experts), generator=gen).to(F32) * 0.25
    return torch.randn(tokens, experts, generator=gen)


def weights(tokens, k, *, seed=0):
    """``(T, k)`` positive fp32 routing weights of very different magnitudes from row to row."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, k, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen) * 4)


def topk_gate_call(tokens, hidden, *, seed=0, device="cpu", experts=EXPERTS, k=TOPK, int32=False, ties=False):
    """Scores ``(T, E)``, ``k`` and the id dtype's flag."""
    return {"scores": scores(tokens, experts, seed=seed, ties=ties).to(device), "k": k, "int32": int32}


def normalize_weight_call(tokens, hidden, *, seed=0, device="cpu", k=TOPK):
    """Routing weights ``(T, k)``."""
    return {"topk_weights": weights(tokens, k, seed=seed).to(device)}


# one dim larger, each stays valid (E is free above k, k is free up to 32): their shapes are checked in the op files
topk_gate_call.any_shape = ("scores",)
normalize_weight_call.any_shape = ("topk_weights",)


def moe_topk_gate_forward_call(tokens, hidden, *, seed=0, device="cpu", experts=EXPERTS, k=TOPK, shared=1,
                               options=True, replicas=False, ties=False):
    """Logits ``(T, E)``, ``k``, ``shared`` shared experts, a scaling factor and an EP rank; with ``options`` a token
    mask (every fifth token off), a bias, an image bias for every third token and fixed routing for every fourth
    (one of its ids -1); with ``replicas`` a replica map of up to 3 replicas per logical expert (off by default: the
    replica of a token follows its row in the local tensor, so a token-sharded call picks others,
    docs/ops/moe.md#moe_topk_gate). ``ties`` draws logits of four values (ties in the ranking)."""
    gen = torch.Generator().manual_seed(seed + 1)
    call = {"logits": scores(tokens, experts, seed=seed, ties=ties).mul(3).to(device), "k": k,
            "num_shared_experts": shared, "routed_scaling_factor": 2.5, "ep_rank": 3}
    call.update(dict.fromkeys(("mask", "bias", "image_bias", "image_token_mask", "fix_routing_mask", "fixed_topk_idx",
                               "to_physical_map", "logical_count")))  # every argument, in schema order
    rows = torch.arange(tokens)
    if options:
        fixed = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]) if tokens else \
            torch.empty(0, k, dtype=torch.int64)
        if tokens and k > 1:
            fixed[:, -1] = -1
        call.update({"mask": (rows % 5 != 4).to(device), "bias": (torch.rand(experts, generator=gen) * 0.5).to(device),
                     "image_bias": (torch.rand(experts, generator=gen) * 0.5).to(device),
                     "image_token_mask": (rows % 3 == 1).to(device), "fix_routing_mask": (rows % 4 == 2).to(device),
                     "fixed_topk_idx": fixed.contiguous().to(device)})
    if replicas:
        logical = experts + shared
        count = torch.randint(1, 4, (logical,), generator=gen, dtype=torch.int32)
        physical = torch.randperm(logical * 3, generator=gen).to(torch.int32).reshape(logical, 3)
        call.update({"to_physical_map": physical.to(device), "logical_count": count.to(device)})
    return call




def moe_topk_gate_backward_call(tokens, hidden, *, seed=0, device="cpu", experts=EXPERTS, k=TOPK, aux=True):
    """The forward's outputs on :func:`moe_topk_gate_forward_call` (every option, no shared expert), random gradients
    of the routed weights and, with ``aux``, of one sequence per token (``S = T``, so that any token sharding keeps
    whole sequences) and the forward's mask."""
    fwd = moe_topk_gate_forward_call(tokens, hidden, seed=seed, experts=experts, k=k, shared=0)
    _, w, unmapped, u = moe_topk_gate_forward_ref(**fwd)
    gen = torch.Generator().manual_seed(seed + 2)
    call = {"grad_topk_weights": torch.randn(tokens, k, generator=gen), "scores": u, "unmapped_topk_idx": unmapped,
            "topk_weights": w, "routed_scaling_factor": fwd["routed_scaling_factor"],
            "mask": fwd["mask"] if aux else None,
            "grad_scores_sum": torch.randn(tokens, experts, generator=gen) * 0.1 if aux else None}
    return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in call.items()}
