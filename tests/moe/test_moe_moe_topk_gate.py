"""``moe_topk_gate_forward`` and ``moe_topk_gate_backward`` (docs/ops/moe.md#moe_topk_gate).

The forward: validation, the reference against its float64 oracle (the scores within ulps, the ids and the weights),
ties, masked tokens, fixed routing, shared experts and the replica map, the fake on meta tensors, opcheck,
torch.compile with a dynamic T and zero tokens (CPU tier, the reference as the CPU kernel); the CUDA kernel compiled
to sm_90a cubins and the Ascend 950 kernel lowered to AscendC within the UB at a few variants, their launch arguments
and keys (CPU tier); on the device the scores within ulps of the oracle, the rest bitwise against the reference
computed from the kernel's own scores, and against the peer (DeepSeek's tile_kernels) when it imports (device tier).
The backward: validation, the reference against its float64 oracle and the oracle against torch's autograd through
the float64 forward, repeated ids, masked tokens, the aux term, fakes, opcheck; both backends' lowering and launch
arguments; on the device the kernel within the bound of the oracle, run to run bitwise, and the peer's alike.
"""

import pytest
import torch
from _plugins.device import requires_device
from _plugins.references import without_cpu_references
from moe_cases import moe_topk_gate_backward_call, moe_topk_gate_forward_call
from moe_ref import (moe_topk_gate_backward_f64, moe_topk_gate_backward_ref, moe_topk_gate_forward_f64,
                     moe_topk_gate_forward_ref, moe_topk_gate_from_scores, pairwise_sum, softplus_derivative,
                     sqrt_softplus, sqrt_softplus_f64)
from moe_testing import (DEVICE_EXPERTS, DEVICE_TOKENS, HAVE_NVCC, assert_compiles_once, check_ascend_lowers_within_ub,
                         check_cuda_compiles_to_sm90a_cubin, check_zero_tokens_launch_nothing, lowering_cases,
                         metadata)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
OUTPUTS = ("topk_idx", "topk_weights", "unmapped_topk_idx", "scores")
# below this logit exp(x) is subnormal in fp32 (a device may flush it to zero): u is then within SUBNORMAL_U of 0
NORMAL_EXP = -87.0
SUBNORMAL_U = 1.1e-19


def ulps(got, want):
    """``|got - want|`` in units of fp32's last place at ``want`` (float64)."""
    w = want.to(F32).abs()
    ulp = (torch.nextafter(w, torch.full_like(w, float("inf"))) - w).to(F64)
    return (got.to(F64) - want.to(F64)).abs() / ulp


def check_scores(u, logits, max_ulps):
    """``u`` within ``max_ulps`` of the float64 oracle where ``exp(x)`` is normal, within ``SUBNORMAL_U`` below."""
    want = sqrt_softplus_f64(logits.cpu())
    u = u.cpu()
    normal = logits.cpu() >= NORMAL_EXP
    assert ulps(u[normal], want[normal]).max().item() <= max_ulps if normal.any() else True
    assert ((u[~normal].to(F64) - want[~normal]).abs() <= SUBNORMAL_U).all()


# --- validation ---------------------------------------------------------------------------------------------------


def _bad_calls():
    m, b = torch.ones(3, dtype=torch.bool), torch.zeros(16)
    return [
        ({"logits": torch.zeros(3, 16, dtype=torch.bfloat16)}, TypeError,
         r"'logits': expected dtype torch.float32, got torch.bfloat16"),
        ({"logits": torch.zeros(3, 0)}, ValueError, r"'logits': expected an expert count E in \[1, 512\], got 0"),
        ({"k": 17}, ValueError, r"'k': expected at most E = 16 \(the experts to pick from\), got 17"),
        ({"k": 0}, ValueError, r"'k': expected a top-k count k in \[1, 32\], got 0"),
        ({"num_shared_experts": -1}, ValueError,
         r"'num_shared_experts': expected 0 to 28 \(k \+ shared <= 32\), got -1"),
        ({"num_shared_experts": 29}, ValueError,
         r"'num_shared_experts': expected 0 to 28 \(k \+ shared <= 32\), got 29"),
        ({"num_shared_experts": 1.0}, TypeError, r"'num_shared_experts': expected an int, got float 1.0"),
        ({"routed_scaling_factor": float("inf")}, ValueError, r"'routed_scaling_factor': expected a number that is "
                                                              r"finite in fp32"),
        ({"ep_rank": -1}, ValueError, r"'ep_rank': expected an int >= 0, got -1"),
        ({"mask": m[:2]}, ValueError, r"'mask': expected shape \(3,\), got \(2,\)"),
        ({"mask": m.int()}, TypeError, r"'mask': expected dtype torch.bool, got torch.int32"),
        ({"bias": b[:15]}, ValueError, r"'bias': expected shape \(16,\), got \(15,\)"),
        ({"bias": b.double()}, TypeError, r"'bias': expected dtype torch.float32, got torch.float64"),
        ({"image_bias": b}, ValueError, r"'image_token_mask': expected a tensor since 'image_bias' is given \(both or "
                                        r"neither\), got None"),
        ({"image_token_mask": m}, ValueError, r"'image_bias': expected a tensor since 'image_token_mask' is given"),
        ({"fix_routing_mask": m}, ValueError, r"'fixed_topk_idx': expected a tensor since 'fix_routing_mask' is "
                                              r"given"),
        ({"fix_routing_mask": m, "fixed_topk_idx": torch.zeros(3, 4, dtype=I32)}, TypeError,
         r"'fixed_topk_idx': expected dtype torch.int64, got torch.int32"),
        ({"fix_routing_mask": m, "fixed_topk_idx": torch.zeros(3, 5, dtype=I64)}, ValueError,
         r"'fixed_topk_idx': expected shape \(3, 4\), got \(3, 5\)"),
        ({"to_physical_map": torch.zeros(17, 2, dtype=I32)}, ValueError,
         r"'logical_count': expected a tensor since 'to_physical_map' is given"),
        ({"to_physical_map": torch.zeros(16, 2, dtype=I32), "logical_count": torch.ones(17, dtype=I32)}, ValueError,
         r"'to_physical_map': expected shape \(17, \*\), got \(16, 2\)"),
        ({"to_physical_map": torch.zeros(17, 0, dtype=I32), "logical_count": torch.ones(17, dtype=I32)}, ValueError,
         r"'to_physical_map': expected at least one replica column"),
        ({"to_physical_map": torch.zeros(17, 2, dtype=I32), "logical_count": torch.ones(16, dtype=I32)}, ValueError,
         r"'logical_count': expected shape \(17,\), got \(16,\)"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**moe_topk_gate_forward_call(3, 64, experts=16, k=4, options=False), **change}
    with without_cpu_references(), pytest.raises(
            error, match=rf"cann_ops_tilelang::moe_topk_gate_forward: argument {message}"):
        ops.moe_topk_gate_forward(**call)


# --- the reference against the oracle, the contract's cases (CPU tier) ----------------------------------------------


def test_reference_scores_within_two_ulps_of_the_oracle(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(50000, generator=gen) * 8, torch.linspace(-120, 60, 20001),
                   torch.tensor([NORMAL_EXP, 0.0, 19.999, 20.0, 20.001, 1e30, -1e30])])
    check_scores(sqrt_softplus(x), x, 2)


@pytest.mark.parametrize("experts,k", [(1, 1), (72, 6), (256, 8), (512, 32)])
def test_reference_against_the_float64_oracle(experts, k, seed):
    call = moe_topk_gate_forward_call(64, 64, seed=seed, experts=experts, k=k, shared=0, options=False)
    bias = torch.rand(experts, generator=torch.Generator().manual_seed(seed)) * 0.3
    idx, w, unmapped, u = moe_topk_gate_forward_ref(**{**call, "bias": bias})
    u64, ids64, w64 = moe_topk_gate_forward_f64(call["logits"], k, call["routed_scaling_factor"], bias)
    check_scores(u, call["logits"], 2)
    # the ids: the oracle's wherever the ranking is not within a few ulps of a tie at the k-th pick
    ranked = torch.sort(u64 + bias.to(F64), dim=1, descending=True).values
    clear = (ranked[:, k - 1] - ranked[:, k]).abs() > 1e-5 if k < experts else torch.ones(64, dtype=torch.bool)
    assert clear.float().mean() > 0.9
    assert torch.equal(torch.sort(idx[clear], 1).values, torch.sort(ids64[clear], 1).values)
    assert torch.equal(idx, unmapped)
    rel = ((w[clear].to(F64) - w64[clear]).abs() / w64[clear].clamp(min=1e-30))
    assert rel.max().item() <= (k + 4) * 2.0 ** -23


def test_ties_go_to_the_smaller_id():
    """Equal biased scores: the smaller id first (the ranking is stable), ``-0.0`` equals ``+0.0``."""
    logits = torch.zeros(2, 6)
    logits[1] = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0, 1.0])
    idx, w, _, u = ops.moe_topk_gate_forward(logits, 4)
    assert idx.tolist() == [[0, 1, 2, 3], [1, 2, 4, 0]]
    # a bias that makes expert 5 tie with the leaders
    bias = torch.zeros(6)
    bias[5] = u[1, 1].item() - u[1, 5].item()
    idx = ops.moe_topk_gate_forward(logits, 4, bias=bias)[0]
    assert torch.equal(u[1, 5] + bias[5], u[1, 1])
    assert idx[1].tolist() == [1, 2, 4, 5]


def test_ties_in_random_rows_follow_the_stable_order(seed):
    call = moe_topk_gate_forward_call(33, 64, seed=seed, experts=72, k=6, options=False, ties=True)
    idx, _, unmapped, u = ops.moe_topk_gate_forward(**call)
    want = torch.sort(u, dim=1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(unmapped, want) and torch.equal(idx[:, :6], want)


def test_weights_are_the_pairwise_normalization_times_the_factor(seed):
    call = moe_topk_gate_forward_call(20, 64, seed=seed, experts=72, k=6, shared=2, options=False)
    idx, w, unmapped, u = ops.moe_topk_gate_forward(**call)
    picked = u.gather(1, unmapped)
    den = torch.tensor(1e-20) + pairwise_sum(picked)
    assert torch.equal(w[:, :6], picked / den[:, None] * torch.tensor(2.5))
    assert torch.equal(w[:, 6:], torch.ones(20, 2)) and idx[:, 6:].tolist() == [[72, 73]] * 20


def test_masked_tokens_get_no_experts(seed):
    call = moe_topk_gate_forward_call(10, 64, seed=seed, experts=72, k=6, shared=1, replicas=True)
    idx, w, unmapped, u = ops.moe_topk_gate_forward(**call)
    off = ~call["mask"]
    assert off.sum() == 2
    assert (idx[off] == -1).all() and (w[off] == 0).all() and (unmapped[off] == -1).all() and (u[off] == 0).all()
    ranked = ~off & ~call["fix_routing_mask"]  # the fixed rows hold a -1 id
    assert (idx[ranked] >= 0).all() and (u[~off] > 0).all()


def test_fixed_routing_takes_the_given_ids_and_a_minus_one_adds_nothing(seed):
    call = moe_topk_gate_forward_call(12, 64, seed=seed, experts=72, k=6, shared=0)
    call["mask"] = None
    idx, w, unmapped, u = ops.moe_topk_gate_forward(**call)
    fixed = call["fix_routing_mask"]
    assert fixed.sum() == 3
    assert torch.equal(unmapped[fixed], call["fixed_topk_idx"][fixed]) and (unmapped[fixed, -1] == -1).all()
    assert (w[fixed, -1] == 0).all()
    picked = u[fixed].gather(1, unmapped[fixed, :-1])
    assert torch.equal(w[fixed, :-1], picked / (torch.tensor(1e-20) + pairwise_sum(picked))[:, None] * 2.5)
    # the other rows rank, image tokens on the image bias
    image = call["image_token_mask"] & ~fixed
    ranked = u[image] + call["image_bias"]
    assert torch.equal(unmapped[image], torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :6])


def test_replica_map_picks_by_rank_and_row(seed):
    call = moe_topk_gate_forward_call(9, 64, seed=seed, experts=16, k=4, shared=2, options=False, replicas=True)
    idx, _, unmapped, _ = ops.moe_topk_gate_forward(**call)
    logical = torch.cat([unmapped, torch.tensor([[16, 17]] * 9)], dim=1)
    for t in range(9):
        for j in range(6):
            e = int(logical[t, j])
            replica = (3 + t * 23333) % int(call["logical_count"][e])
            assert int(idx[t, j]) == int(call["to_physical_map"][e, replica])


@pytest.mark.parametrize("replicas", [False, True])
def test_fake_matches_reference(replicas, seed):
    for tokens in (0, 1, 7):
        real = ops.moe_topk_gate_forward(**moe_topk_gate_forward_call(tokens, 64, seed=seed, replicas=replicas))
        fake = ops.moe_topk_gate_forward(**moe_topk_gate_forward_call(tokens, 64, seed=seed, replicas=replicas,
                                                                      device="meta"))
        assert [metadata(f) for f in fake] == [metadata(r) for r in real] == [
            ((tokens, 9), I64, (9, 1)), ((tokens, 9), F32, (9, 1)), ((tokens, 8), I64, (8, 1)),
            ((tokens, 256), F32, (256, 1))]
        want = moe_topk_gate_forward_ref(**moe_topk_gate_forward_call(tokens, 64, seed=seed, replicas=replicas))
        assert all(torch.equal(r, w) for r, w in zip(real, want))


@pytest.mark.parametrize("tokens", [0, 5])
def test_opcheck(tokens, seed):
    call = moe_topk_gate_forward_call(tokens, 64, seed=seed, replicas=True)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.moe_topk_gate_forward.default, tuple(call.values()))


def test_compile_fullgraph_dynamic_no_recompile(seed):
    def model(logits, mask, bias):
        return ops.moe_topk_gate_forward(logits, 6, 1, 2.5, 0, mask, bias)

    def make(tokens):
        call = moe_topk_gate_forward_call(tokens, 64, seed=seed + tokens, experts=72, k=6)
        return call["logits"], call["mask"], call["bias"]

    assert_compiles_once(model, make, (7, 9, 17))


def test_zero_tokens_launch_nothing(monkeypatch):
    check_zero_tokens_launch_nothing(monkeypatch, "moe_topk_gate_forward",
                                     moe_topk_gate_forward_call(0, 64, replicas=True))


# --- the kernels: lowering, launch arguments, keys (CPU tier) -------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.ascend.moe import moe_topk_gate as ascend_gate  # noqa: E402
from cann_ops_tilelang.kernels.cuda.moe import moe_topk_gate as cuda_gate  # noqa: E402


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("name", [n for n in lowering_cases(cuda_gate) if "forward" in n])
def test_cuda_compiles_to_sm90a_cubin(name):
    threads = 32 * cuda_gate.MOE_TOPK_GATE_FORWARD_PLAN.warps
    source = check_cuda_compiles_to_sm90a_cubin(cuda_gate, name, threads)
    # the scores: libdevice's expf and log1pf, a correctly rounded sqrt; the sum: the xor butterfly of IEEE adds
    assert "log1pf(expf(" in source and "__fsqrt_rn(" in source and "atomic" not in source
    assert source.count("__shfl_xor_sync(") == 5 and "__fdiv_rn(" in source and "__fmul_rn(" in source
    assert ("to_physical_map[" in source) == name.endswith("_all")


@pytest.mark.parametrize("name", lowering_cases(ascend_gate))
def test_ascend_lowers_within_ub(name):
    source = check_ascend_lowers_within_ub(ascend_gate, name)
    assert "exp" in source and ("log1p" in source) == ("forward" in name)


def test_cases_are_few_and_the_same_on_both_backends():
    """The forward's variants (the backward's: test_backward_cases_are_the_same_on_both_backends)."""
    want = sorted(f"moe_topk_gate_forward_{n}" for n in ("e1_k1", "e72_k6_s2_all", "e256_k8_bias_mask", "e512_k32"))
    for module in (cuda_gate, ascend_gate):
        for hidden in limits.MOE_HIDDEN_SIZES:
            assert sorted(module.MOE_TOPK_GATE_FORWARD.case_keys(hidden, 4)) == want


@pytest.mark.parametrize("module", [cuda_gate, ascend_gate], ids=["cuda", "ascend"])
def test_launcher_passes_the_arguments_the_kernel_declares(module, monkeypatch):
    """Given tensors as they are, absent ones as one-element placeholders of the parameter's dtype, the scalars as
    Python numbers, the outputs last; T is not in the key."""
    kernel = module.MOE_TOPK_GATE_FORWARD
    seen = []
    monkeypatch.setattr(kernel, "compiled", lambda key: lambda *args: seen.append((key, args)))
    public = ops.registered_ops()["moe_topk_gate_forward"]
    keys = set()
    for tokens in (1, 5):
        for options, replicas in ((False, False), (True, True)):
            call = moe_topk_gate_forward_call(tokens, 64, experts=72, k=6, shared=2, options=options,
                                              replicas=replicas)
            outputs = public.prepare(**call)
            module.moe_topk_gate_forward(**call, **dict(zip(OUTPUTS, outputs)))
            key, args = seen.pop()
            keys.add(key)
            assert (key.experts, key.k, key.shared, key.has_mask, key.has_map) == (72, 6, 2, options, replicas)
            prim_func = kernel.prim_func(key)
            assert len(args) == len(prim_func.params)
            for param, arg, (name, given) in zip(prim_func.params, args, list(call.items())[:1] + list(call.items())[5:]
                                                 + [("routed_scaling_factor", 2.5), ("ep_rank", 3)]
                                                 + list(zip(OUTPUTS, outputs))):
                if isinstance(arg, torch.Tensor):
                    buffer = prim_func.buffer_map[param]
                    assert arg.dtype == getattr(torch, str(buffer.dtype)) and arg.is_contiguous(), buffer.name
                    assert arg is given if given is not None else arg.shape[0] == 1, buffer.name
            assert args[1 + 8] == 2.5 and args[1 + 9] == 3 and args[-4:] == outputs
    assert len(keys) == 2


def test_builders_refuse_what_the_limits_refuse():
    for experts, k, shared in ((0, 1, 0), (513, 8, 0), (64, 0, 0), (64, 33, 0), (8, 9, 0), (64, 30, 3)):
        with pytest.raises(limits.LimitError, match="moe_topk_gate_forward: "):
            cuda_gate.build_moe_topk_gate_forward(experts, k, shared, *(False,) * 5)
        with pytest.raises(limits.LimitError, match="moe_topk_gate_forward: "):
            ascend_gate.build_moe_topk_gate_forward(experts, k, shared, *(False,) * 5, 64)


# --- on the device: the scores within ulps, the rest bitwise from them, the peer (device tier) --------------------


@requires_device
@pytest.mark.parametrize("experts", DEVICE_EXPERTS)
@pytest.mark.parametrize("options", [False, True])
def test_device_against_the_reference_from_its_own_scores(experts, options, device, seed):
    for tokens in DEVICE_TOKENS:
        for k in sorted({1, min(6, experts), min(8, experts), min(31, experts)}):
            call = moe_topk_gate_forward_call(tokens, 64, seed=seed + tokens, experts=experts, k=k, shared=1,
                                              options=options, replicas=options)
            got = ops.moe_topk_gate_forward(**{n: v.to(device) if isinstance(v, torch.Tensor) else v
                                               for n, v in call.items()})
            got = [g.cpu() for g in got]
            assert all(g.is_contiguous() for g in got)
            u = got[3]
            routed = call["mask"] if options else torch.ones(tokens, dtype=torch.bool)
            check_scores(u[routed], call["logits"][routed], 4)
            assert (u[~routed] == 0).all()
            want = moe_topk_gate_from_scores(u, **{n: v for n, v in call.items() if n != "logits"})
            for name, g, w in zip(OUTPUTS, got, want):
                assert torch.equal(g, w), (name, tokens, experts, k, options)


@requires_device
def test_device_zero_tokens_and_opcheck(device, seed):
    outs = ops.moe_topk_gate_forward(torch.empty(0, 256, device=device), 8, 1)
    assert [tuple(o.shape) for o in outs] == [(0, 9), (0, 9), (0, 8), (0, 256)]
    call = moe_topk_gate_forward_call(5, 64, seed=seed, device=device, replicas=True)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.moe_topk_gate_forward.default, tuple(call.values()))


@requires_device
@pytest.mark.parametrize("experts,k", [(72, 6), (256, 8)])
def test_device_equals_the_peer(experts, k, device, seed):
    """DeepSeek's tile_kernels (when importable) on the same logits, bias, mask and two shared experts: the same ids,
    weights and scores (the same formula; the fixed rows' ``-1`` ids are not given to the peer: it asserts ids
    >= 0; the replica map with rows below 92 000, where the peer's int32 product does not wrap)."""
    peer = pytest.importorskip("tile_kernels.moe")
    call = moe_topk_gate_forward_call(4001, 64, seed=seed, device=device, experts=experts, k=k, shared=2,
                                      replicas=True)
    # no -1 for the peer: the last fixed id of a row repeats its first (repeated fixed ids are valid on both sides)
    call["fixed_topk_idx"][:, -1] = call["fixed_topk_idx"][:, 0]
    idx, w, unmapped, u = ops.moe_topk_gate_forward(**call)
    theirs_unmapped = call["fixed_topk_idx"].clone()
    theirs_u = torch.empty_like(u)
    theirs_idx, theirs_w = peer.moe_topk_gate_forward(
        call["logits"], k, True, 2, 2.5, 3, "sqrtsoftplus", mask=call["mask"], bias=call["bias"],
        image_bias=call["image_bias"], image_token_mask=call["image_token_mask"],
        fix_routing_mask=call["fix_routing_mask"], to_physical_map=call["to_physical_map"],
        logical_count=call["logical_count"], unmapped_topk_idx=theirs_unmapped, scores=theirs_u)
    assert torch.equal(u, theirs_u) and torch.equal(unmapped, theirs_unmapped)
    assert torch.equal(idx, theirs_idx) and torch.equal(w, theirs_w)



# --- moe_topk_gate_backward ---------------------------------------------------------------------------------------


def backward_bound(call):
    """Per element, ``2^-16`` times the sum of the magnitudes of the terms of the float64 gradient (each sum of at most
    ``E`` fp32 values, about ``2^-24`` each, far below)."""
    u = call["scores"].cpu().to(F64)
    tokens, experts = u.shape
    idx = call["unmapped_topk_idx"].cpu()
    valid = idx >= 0
    g = call["grad_topk_weights"].cpu().to(F64) * valid
    w = call["topk_weights"].cpu().to(F64)
    den = (u.gather(1, idx.clamp(min=0)) * valid).sum(1, keepdim=True) + 1e-20
    route = ((call["routed_scaling_factor"] * g).abs() + (g * w).abs().sum(1, keepdim=True)) / den * valid
    mag = torch.zeros(tokens, experts, dtype=F64).scatter_add_(1, idx.clamp(min=0), route)
    if call["grad_scores_sum"] is not None and tokens:
        h = call["grad_scores_sum"].cpu().to(F64).repeat_interleave(tokens // call["grad_scores_sum"].shape[0], 0)
        mask = call["mask"]
        routed = torch.ones(tokens, 1, dtype=torch.bool) if mask is None else mask.cpu()[:, None]
        inv = torch.where(routed, 1 / u.sum(1, keepdim=True), torch.zeros((), dtype=F64))
        mag = mag + (h.abs() + (h * u).abs().sum(1, keepdim=True) * inv) * inv
    return 2.0 ** -16 * torch.where(u > 0, -torch.expm1(-u * u) / (2 * u), 0.0) * mag + 1e-30


def check_backward(got, call):
    want = moe_topk_gate_backward_f64(**{n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in call.items()})
    err = (got.cpu().to(F64) - want).abs()
    bound = backward_bound(call)
    assert (err <= bound).all(), (err / bound).max().item()


def _bad_backward_calls():
    return [
        ({"scores": torch.zeros(3, 16).double()}, TypeError, r"'scores': expected dtype torch.float32, got "
                                                              r"torch.float64"),
        ({"unmapped_topk_idx": torch.zeros(3, 4, dtype=I32)}, TypeError,
         r"'unmapped_topk_idx': expected dtype torch.int64, got torch.int32"),
        ({"unmapped_topk_idx": torch.zeros(3, 17, dtype=I64)}, ValueError,
         r"'unmapped_topk_idx': expected at most E = 16 \(the experts to pick from\), got 17"),
        ({"unmapped_topk_idx": torch.zeros(2, 4, dtype=I64)}, ValueError,
         r"'unmapped_topk_idx': expected shape \(3, \*\), got \(2, 4\)"),
        ({"grad_topk_weights": torch.zeros(3, 5)}, ValueError, r"'grad_topk_weights': expected shape \(3, 4\), got "
                                                                r"\(3, 5\)"),
        ({"topk_weights": torch.zeros(3, 4).t().contiguous().t()}, ValueError,
         r"'topk_weights': expected a contiguous tensor"),
        ({"routed_scaling_factor": "2"}, TypeError, r"'routed_scaling_factor': expected a float, got str"),
        ({"mask": torch.ones(4, dtype=torch.bool)}, ValueError, r"'mask': expected shape \(3,\), got \(4,\)"),
        ({"grad_scores_sum": torch.zeros(2, 16)}, ValueError, r"'grad_scores_sum': expected a number of sequences S "
                                                               r">= 1 that divides T = 3"),
        ({"grad_scores_sum": torch.zeros(0, 16)}, ValueError, r"'grad_scores_sum': expected a number of sequences"),
        ({"grad_scores_sum": torch.zeros(1, 15)}, ValueError, r"'grad_scores_sum': expected shape \(\*, 16\), got "
                                                               r"\(1, 15\)"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_backward_calls(),
                         ids=[str(i) for i in range(len(_bad_backward_calls()))])
def test_backward_validation_names_op_and_argument(change, error, message):
    call = {**moe_topk_gate_backward_call(3, 64, experts=16, k=4), **change}
    with without_cpu_references(), pytest.raises(
            error, match=rf"cann_ops_tilelang::moe_topk_gate_backward: argument {message}"):
        ops.moe_topk_gate_backward(**call)


@pytest.mark.parametrize("aux", [False, True])
def test_backward_oracle_is_autograd_through_the_float64_forward(aux, seed):
    """The oracle's formulas against torch's autograd of ``sum(g w) + sum(h · seq_sum(u / U))`` in float64, through
    ``u = sqrt(softplus(x))`` with the forward's ids (fixed rows with a -1 included, masked rows in the aux term)."""
    tokens, experts, k, seqs = 12, 24, 4, 3
    call = moe_topk_gate_forward_call(tokens, 64, seed=seed, experts=experts, k=k, shared=0)
    idx = moe_topk_gate_forward_ref(**call)[2]
    x = call["logits"].to(F64).requires_grad_()
    u = torch.nn.functional.softplus(x).sqrt()
    valid = idx >= 0
    picked = u.gather(1, idx.clamp(min=0)) * valid
    w = 2.5 * picked / (picked.sum(1, keepdim=True) + 1e-20)
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(tokens, k, generator=gen, dtype=F64)
    loss = (w * g * valid).sum()
    h = torch.randn(seqs, experts, generator=gen, dtype=F64) if aux else None
    mask = call["mask"]
    if aux:
        share = u / u.sum(1, keepdim=True) * mask[:, None]
        loss = loss + (share.reshape(seqs, tokens // seqs, experts).sum(1) * h).sum()
    loss.backward()
    want = moe_topk_gate_backward_f64(g, u.detach(), idx, w.detach(), 2.5, mask if aux else None, h)
    assert torch.allclose(x.grad, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("experts,k", [(1, 1), (72, 6), (256, 8), (512, 32)])
def test_backward_reference_within_the_bound_of_the_oracle(experts, k, aux, seed):
    call = moe_topk_gate_backward_call(40, 64, seed=seed, experts=experts, k=k, aux=aux)
    check_backward(moe_topk_gate_backward_ref(**call), call)


def test_backward_derivative_series_meets_the_exp_form():
    u = torch.linspace(0, 4, 40001)
    got = softplus_derivative(u).to(F64)
    want = torch.where(u > 0, -torch.expm1(-u.to(F64) ** 2) / (2 * u.to(F64)), 0.0)
    assert ((got - want).abs() <= 2.0 ** -19 * want.abs() + 1e-38).all()


def test_backward_repeated_ids_add_up_and_minus_one_adds_nothing():
    u = torch.tensor([[0.5, 1.0, 2.0, 0.25]])
    idx = torch.tensor([[2, 2, -1]])
    g = torch.tensor([[1.0, 3.0, 100.0]])
    w = torch.tensor([[0.4, 0.4, 0.0]])
    got = ops.moe_topk_gate_backward(g, u, idx, w, 2.0)
    den = 1e-20 + 4.0
    dot = 0.4 + 1.2
    route = (2.0 * 1.0 - dot) / den + (2.0 * 3.0 - dot) / den
    assert got[0, [0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    assert got[0, 2].item() == pytest.approx(route * (1 - torch.exp(torch.tensor(-4.0)).item()) / 4.0, rel=1e-6)


def test_backward_masked_tokens_get_no_aux_term(seed):
    call = moe_topk_gate_backward_call(10, 64, seed=seed, experts=72, k=6)
    got = ops.moe_topk_gate_backward(**call)
    off = ~call["mask"]
    assert off.any() and (got[off] == 0).all()  # masked: ids -1 and no aux term
    assert (got[~off] != 0).any()


def test_backward_fake_matches_reference(seed):
    for tokens in (0, 1, 7):
        for aux in (False, True):
            real = ops.moe_topk_gate_backward(**moe_topk_gate_backward_call(tokens, 64, seed=seed, aux=aux))
            fake = ops.moe_topk_gate_backward(**moe_topk_gate_backward_call(tokens, 64, seed=seed, aux=aux,
                                                                            device="meta"))
            assert metadata(fake) == metadata(real) == ((tokens, 256), F32, (256, 1))
            want = moe_topk_gate_backward_ref(**moe_topk_gate_backward_call(tokens, 64, seed=seed, aux=aux))
            assert torch.equal(real, want)


@pytest.mark.parametrize("tokens", [0, 5])
def test_backward_opcheck(tokens, seed):
    call = moe_topk_gate_backward_call(tokens, 64, seed=seed)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.moe_topk_gate_backward.default, tuple(call.values()))


def test_backward_zero_tokens_launch_nothing(monkeypatch):
    check_zero_tokens_launch_nothing(monkeypatch, "moe_topk_gate_backward", moe_topk_gate_backward_call(0, 64))


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("name", [n for n in lowering_cases(cuda_gate) if "backward" in n])
def test_backward_cuda_compiles_to_sm90a_cubin(name):
    source = check_cuda_compiles_to_sm90a_cubin(cuda_gate, name, 32 * cuda_gate.MOE_TOPK_GATE_FORWARD_PLAN.warps)
    # no atomics: the route terms go by shuffles, one pick after the other
    assert "atomic" not in source and "__shfl_sync(" in source
    assert ("grad_scores_sum[" in source) == name.endswith("_aux")


def test_backward_cases_are_the_same_on_both_backends():
    want = sorted(f"moe_topk_gate_backward_{n}" for n in ("e1_k1", "e72_k6_aux", "e256_k8", "e512_k32_aux"))
    for module in (cuda_gate, ascend_gate):
        assert sorted(module.MOE_TOPK_GATE_BACKWARD.case_keys(4096, 4)) == want


@pytest.mark.parametrize("module", [cuda_gate, ascend_gate], ids=["cuda", "ascend"])
def test_backward_launcher_passes_the_arguments_the_kernel_declares(module, monkeypatch):
    kernel = module.MOE_TOPK_GATE_BACKWARD
    seen = []
    monkeypatch.setattr(kernel, "compiled", lambda key: lambda *args: seen.append((key, args)))
    keys = set()
    for tokens in (1, 6):
        for aux in (False, True):
            call = moe_topk_gate_backward_call(tokens, 64, experts=72, k=6, aux=aux)
            grad = ops.registered_ops()["moe_topk_gate_backward"].prepare(**call)
            module.moe_topk_gate_backward(**call, grad_logits=grad)
            key, args = seen.pop()
            keys.add(key)
            assert (key.experts, key.k, key.has_aux) == (72, 6, aux)
            prim_func = kernel.prim_func(key)
            assert len(args) == len(prim_func.params)
            for param, arg in zip(prim_func.params, args):
                if isinstance(arg, torch.Tensor):
                    buffer = prim_func.buffer_map[param]
                    assert arg.dtype == getattr(torch, str(buffer.dtype)) and arg.is_contiguous(), buffer.name
            assert args[:4] == (call["grad_topk_weights"], call["scores"], call["unmapped_topk_idx"],
                                call["topk_weights"])
            assert args[4] == 2.5 and args[-1] is grad
            assert (args[5] is call["mask"] and args[6] is call["grad_scores_sum"]) if aux else args[5].numel() == 1
    assert len(keys) == 2


@requires_device
@pytest.mark.parametrize("experts", DEVICE_EXPERTS)
@pytest.mark.parametrize("aux", [False, True])
def test_device_backward_within_the_bound_of_the_oracle(experts, aux, device, seed):
    for tokens in DEVICE_TOKENS:
        for k in sorted({1, min(6, experts), min(8, experts), min(32, experts)}):
            call = moe_topk_gate_backward_call(tokens, 64, seed=seed + tokens, experts=experts, k=k, aux=aux,
                                               device=device)
            got = ops.moe_topk_gate_backward(**call)
            assert got.is_contiguous()
            check_backward(got, call)
            again = ops.moe_topk_gate_backward(**call)
            assert torch.equal(got, again)  # no atomics: the same bits run to run


@requires_device
@pytest.mark.parametrize("experts,k", [(72, 6), (256, 8)])
def test_device_backward_against_the_peer(experts, k, device, seed):
    """DeepSeek's tile_kernels (when importable): within the same bound of the oracle as ours (its repeated ids add
    up by atomics, its derivative is a polynomial: not bitwise)."""
    peer = pytest.importorskip("tile_kernels.moe")
    call = moe_topk_gate_backward_call(4001, 64, seed=seed, experts=experts, k=k, device=device)
    theirs = peer.moe_topk_gate_backward(call["scores"], call["unmapped_topk_idx"], call["topk_weights"],
                                         call["grad_topk_weights"], 2.5, "sqrtsoftplus", mask=call["mask"],
                                         grad_scores_sum=call["grad_scores_sum"])
    check_backward(theirs, call)
    check_backward(ops.moe_topk_gate_backward(**call), call)
