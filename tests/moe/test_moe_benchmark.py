"""Benchmarks of the MoE routing gates (``topk_gate``, ``normalize_weight``, ``moe_topk_gate_forward`` /
``_backward``; run only when asked: ``-m benchmark``), side by side in one run: ours, the peer (DeepSeek tile_kernels
2.1.0, when importable), the reference under inductor (``torch.compile(fullgraph=True,
dynamic=True)``, one compile per reference and non-tensor arguments). The gates move a few bytes per token (they
are latency-bound, not bandwidth-bound): no copy ceiling here.

Shapes: the peer's (4001 tokens, k in {6, 8}, E in {72, 256}) and the issue's T = 8192, E = 256, k = 8 (target: the
forward gate within 10 us there). Bytes: what the op must read and write once. Results are compared with the
committed baseline of the chip (tests/moe/benchmark/<chip>/test_moe_benchmark.jsonl; none yet: no GPU run so far).
"""

import functools
import importlib.util

import pytest
import torch
from _plugins.device import requires_cuda
from moe_cases import moe_topk_gate_backward_call, moe_topk_gate_forward_call, scores, weights
from moe_ref import moe_topk_gate_backward_ref, moe_topk_gate_forward_ref, normalize_weight_ref, topk_gate_ref

import cann_ops_tilelang as ops

pytestmark = [pytest.mark.benchmark, requires_cuda]

HAVE_PEER = importlib.util.find_spec("tile_kernels") is not None
GATE_SHAPES = [(4001, e, k) for e in (72, 256) for k in (6, 8)] + [(8192, 256, 8)]


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@functools.cache
def inductor(fn, **static):
    """The reference ``fn`` with its non-tensor arguments bound, compiled once for the whole run (shapes dynamic)."""
    return torch.compile(functools.partial(fn, **static), fullgraph=True, dynamic=True)


@pytest.mark.parametrize("tokens,experts,k", GATE_SHAPES)
def test_bench_topk_gate(bench, device, tokens, experts, k):
    s = scores(tokens, experts).to(device)
    idx = ops.topk_gate(s, k)
    peer = None
    if HAVE_PEER:
        import tile_kernels.moe as tm

        def peer():
            return tm.topk_gate(s, k)
    ref = inductor(topk_gate_ref, k=k)
    bench.side_by_side(f"topk_gate-T{tokens}-E{experts}-k{k}", {
        "ours": lambda: ops.topk_gate(s, k),
        "peer": peer,
        "inductor": lambda: ref(s),
    }, bytes=nbytes(s, idx))


@pytest.mark.parametrize("tokens,k", sorted({(t, k) for t, _, k in GATE_SHAPES}))
def test_bench_normalize_weight(bench, device, tokens, k):
    w = weights(tokens, k).to(device)
    den, out = ops.normalize_weight(w)
    peer = None
    if HAVE_PEER:
        import tile_kernels.moe as tm

        def peer():
            return tm.normalize_weight(w)
    ref = inductor(normalize_weight_ref)
    bench.side_by_side(f"normalize_weight-T{tokens}-k{k}", {
        "ours": lambda: ops.normalize_weight(w),
        "peer": peer,
        "inductor": lambda: ref(w),
    }, bytes=nbytes(w, den, out))


@pytest.mark.parametrize("tokens,experts,k", GATE_SHAPES)
def test_bench_moe_topk_gate_forward(bench, device, tokens, experts, k):
    """The scored gate as DeepSeek runs it: a bias, one shared expert, no mask, no fixed routing, no replica map."""
    call = moe_topk_gate_forward_call(tokens, 64, experts=experts, k=k, options=False)
    logits, bias = call["logits"].to(device), scores(1, experts, seed=1)[0].abs().mul(0.1).to(device)
    outs = ops.moe_topk_gate_forward(logits, k, 1, 2.5, 0, bias=bias)
    peer = None
    if HAVE_PEER:
        import tile_kernels.moe as tm

        u = torch.empty_like(logits)

        def peer():
            return tm.moe_topk_gate_forward(logits, k, True, 1, 2.5, 0, "sqrtsoftplus", bias=bias, scores=u)
    ref = inductor(moe_topk_gate_forward_ref, k=k, num_shared_experts=1, routed_scaling_factor=2.5)
    bench.side_by_side(f"moe_topk_gate_forward-T{tokens}-E{experts}-k{k}", {
        "ours": lambda: ops.moe_topk_gate_forward(logits, k, 1, 2.5, 0, bias=bias),
        "peer": peer,
        "inductor": lambda: ref(logits, bias=bias),
    }, bytes=nbytes(logits, bias, *outs))


@pytest.mark.parametrize("tokens,experts,k", GATE_SHAPES)
def test_bench_moe_topk_gate_backward(bench, device, tokens, experts, k):
    """The backward with the aux term (one sequence per token), as the peer's benchmark shapes."""
    call = moe_topk_gate_backward_call(tokens, 64, experts=experts, k=k, device=device)
    grad = ops.moe_topk_gate_backward(**call)
    peer = None
    if HAVE_PEER:
        import tile_kernels.moe as tm

        def peer():
            return tm.moe_topk_gate_backward(call["scores"], call["unmapped_topk_idx"], call["topk_weights"],
                                             call["grad_topk_weights"], 2.5, "sqrtsoftplus", mask=call["mask"],
                                             grad_scores_sum=call["grad_scores_sum"])
    ref = inductor(moe_topk_gate_backward_ref, routed_scaling_factor=2.5)
    tensors = {n: v for n, v in call.items() if isinstance(v, torch.Tensor)}
    bench.side_by_side(f"moe_topk_gate_backward-T{tokens}-E{experts}-k{k}", {
        "ours": lambda: ops.moe_topk_gate_backward(**call),
        "peer": peer,
        "inductor": lambda: ref(**tensors),
    }, bytes=nbytes(*tensors.values(), grad))
