"""``topk_gate`` (docs/ops/moe.md#topk_gate): validation, the fake against the reference on meta tensors, the
reference against a brute-force oracle (ties to the smaller id), opcheck, torch.compile with a dynamic T and zero
tokens (CPU tier, the reference as the CPU kernel); the CUDA kernel compiled to sm_90a cubins and the Ascend 950
kernel lowered to AscendC within the UB at the edges of E and k and the models' (E, k), their launch views and keys
(CPU tier);
on the device the kernel bitwise against the reference and against the peer (DeepSeek's tile_kernels) when it
imports (device tier)."""

import pytest
import torch
from _plugins.device import requires_device
from _plugins.references import without_cpu_references
from moe_cases import scores, topk_gate_call
from moe_ref import topk_gate_ref
from moe_testing import (DEVICE_EXPERTS, DEVICE_TOKENS, HAVE_NVCC, assert_compiles_once,
                         check_ascend_lowers_within_ub, check_cuda_compiles_to_sm90a_cubin, check_launcher_views,
                         check_zero_tokens_launch_nothing, lowering_cases, metadata)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

F32, I32, I64 = torch.float32, torch.int32, torch.int64


# --- validation ---------------------------------------------------------------------------------------------------


def _bad_calls():
    s = torch.zeros(3, 16)
    return [
        ({"scores": s.double()}, TypeError, r"'scores': expected dtype torch.float32, got torch.float64"),
        ({"scores": s[0]}, ValueError, r"'scores': expected a 2-D tensor, got shape \(16,\)"),
        ({"scores": torch.zeros(16, 3).t()}, ValueError, r"'scores': expected a contiguous tensor"),
        ({"scores": torch.zeros(3, 0)}, ValueError, r"'scores': expected an expert count E in \[1, 512\], got 0"),
        ({"scores": torch.zeros(3, 513)}, ValueError, r"'scores': expected an expert count E in \[1, 512\], got 513"),
        ({"k": 2.0}, TypeError, r"'k': expected an int, got float 2.0"),
        ({"k": True}, TypeError, r"'k': expected an int, got bool True"),
        ({"k": 0}, ValueError, r"'k': expected a top-k count k in \[1, 32\], got 0"),
        ({"scores": torch.zeros(3, 64), "k": 33}, ValueError, r"'k': expected a top-k count k in \[1, 32\], got 33"),
        ({"k": 17}, ValueError, r"'k': expected at most E = 16 \(the experts to pick from\), got 17"),
        ({"int32": 1}, TypeError, r"'int32': expected a bool, got int 1"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**topk_gate_call(3, 64, experts=16), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::topk_gate: argument {message}"):
        ops.topk_gate(**call)


# --- the reference, the fake, opcheck, compile (CPU tier) ----------------------------------------------------------


def _brute_force(row: list[float], k: int) -> list[int]:
    """``k`` times: the first id of the highest score left (ascending scan, strictly greater replaces)."""
    left = list(range(len(row)))
    picked = []
    for _ in range(k):
        best = left[0]
        for e in left[1:]:
            if row[e] > row[best]:
                best = e
        picked.append(best)
        left.remove(best)
    return picked


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("experts,k", [(1, 1), (7, 3), (72, 6), (256, 8), (512, 32)])
def test_reference_is_the_stable_order(experts, k, ties, seed):
    s = scores(5, experts, seed=seed, ties=ties)
    got = topk_gate_ref(s, k)
    assert got.dtype == I64 and got.is_contiguous()
    assert got.tolist() == [_brute_force(row, k) for row in s.tolist()]
    assert torch.equal(topk_gate_ref(s, k, int32=True), got.to(I32))


def test_ties_go_to_the_smaller_id():
    s = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0], [-0.0, 0.0, -1.0, 0.0, 2.0]])
    assert ops.topk_gate(s, 4).tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [4, 0, 1, 3]]


@pytest.mark.parametrize("int32", [False, True])
def test_fake_matches_reference(int32, seed):
    for tokens in (0, 1, 5):
        real = ops.topk_gate(**topk_gate_call(tokens, 64, seed=seed, experts=72, int32=int32))
        fake = ops.topk_gate(**topk_gate_call(tokens, 64, seed=seed, experts=72, int32=int32, device="meta"))
        assert metadata(fake) == metadata(real) == ((tokens, 8), I32 if int32 else I64, (8, 1))
        assert torch.equal(real, topk_gate_ref(scores(tokens, 72, seed=seed), 8, int32))


@pytest.mark.parametrize("int32", [False, True])
@pytest.mark.parametrize("tokens", [0, 3])
def test_opcheck(tokens, int32, seed):
    call = topk_gate_call(tokens, 64, seed=seed, int32=int32)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.topk_gate.default, tuple(call.values()))


def test_compile_fullgraph_dynamic_no_recompile(seed):
    def model(s):
        idx = ops.topk_gate(s, 8)
        return idx, s.gather(1, idx)

    assert_compiles_once(model, lambda tokens: (scores(tokens, 72, seed=seed + tokens),), (7, 9, 17))


def test_zero_tokens_launch_nothing(monkeypatch):
    check_zero_tokens_launch_nothing(monkeypatch, "topk_gate", topk_gate_call(0, 64, int32=True))


# --- the kernels: lowering, launch views, keys (CPU tier) ----------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.ascend.moe import topk_gate as ascend_topk  # noqa: E402
from cann_ops_tilelang.kernels.cuda.moe import topk_gate as cuda_topk  # noqa: E402


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("name", lowering_cases(cuda_topk))
def test_cuda_compiles_to_sm90a_cubin(name):
    threads = 32 * cuda_topk.TOPK_GATE_PLAN.warps
    source = check_cuda_compiles_to_sm90a_cubin(cuda_topk, name, threads)
    # the warp's max and min: full-warp reductions, no shared memory, no atomics
    assert "tl::warp_reduce_max(" in source and "tl::warp_reduce_min(" in source and "atomic" not in source
    assert ("int* __restrict__ topk_idx" in source) == name.endswith("_int32")


@pytest.mark.parametrize("name", lowering_cases(ascend_topk))
def test_ascend_lowers_within_ub(name):
    source = check_ascend_lowers_within_ub(ascend_topk, name)
    assert ("int32_t* topk_idx" in source) == name.endswith("_int32")


def test_cases_cover_the_edges_of_e_and_k_and_both_id_dtypes():
    """The same cases on both backends at every hidden size (the gate does not read it)."""
    want = ["topk_gate_e1_k1", "topk_gate_e256_k8", "topk_gate_e256_k8_int32", "topk_gate_e512_k32",
            "topk_gate_e72_k6"]
    for module in (cuda_topk, ascend_topk):
        for hidden in limits.MOE_HIDDEN_SIZES:
            keys = module.TOPK_GATE.case_keys(hidden, 4)
            assert sorted(keys) == want
        assert {(key.experts, key.k) for key in keys.values()} >= {(limits.MOE_EXPERTS.low, limits.MOE_TOPK.low),
                                                                   (limits.MOE_EXPERTS.high, limits.MOE_TOPK.high)}


@pytest.mark.parametrize("module", [cuda_topk, ascend_topk], ids=["cuda", "ascend"])
def test_launcher_passes_the_views_the_kernel_declares(module, monkeypatch):
    keys = set()
    for tokens in (1, 5):
        for int32 in (False, True):
            call = topk_gate_call(tokens, 64, experts=72, int32=int32)
            key = check_launcher_views(monkeypatch, module, "topk_gate", call)
            assert (key.experts, key.k, key.int32) == (72, 8, int32)
            keys.add(key)
    assert len(keys) == 2  # T is not in the key


@pytest.mark.parametrize("experts,k", [(0, 1), (513, 8), (64, 0), (64, 33), (8, 9)])
def test_builders_refuse_what_the_limits_refuse(experts, k):
    with pytest.raises(limits.LimitError, match="topk_gate: "):
        cuda_topk.build_topk_gate(experts, k, False)
    with pytest.raises(limits.LimitError, match="topk_gate: "):
        ascend_topk.build_topk_gate(experts, k, False, 64)


# --- on the device: bitwise against the reference and the peer (device tier) -------------------------------------


@requires_device
@pytest.mark.parametrize("experts", DEVICE_EXPERTS)
@pytest.mark.parametrize("ties", [False, True])
def test_device_bitwise(experts, ties, device, seed):
    for tokens in DEVICE_TOKENS:
        for k in sorted({1, min(6, experts), min(8, experts), min(32, experts)}):
            for int32 in (False, True):
                s = scores(tokens, experts, seed=seed + tokens, ties=ties)
                got = ops.topk_gate(s.to(device), k, int32)
                assert got.is_contiguous()
                assert torch.equal(got.cpu(), topk_gate_ref(s, k, int32)), (tokens, experts, k, int32)


@requires_device
def test_device_zero_tokens_and_opcheck(device, seed):
    assert ops.topk_gate(torch.empty(0, 256, device=device), 8).shape == (0, 8)
    call = topk_gate_call(5, 64, seed=seed, device=device)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.topk_gate.default, tuple(call.values()))


@requires_device
@pytest.mark.parametrize("experts,k", [(72, 6), (256, 8), (512, 32)])
def test_device_equals_the_peer(experts, k, device, seed):
    """DeepSeek's tile_kernels (when importable) on the same scores, random and tied: the same ids."""
    peer = pytest.importorskip("tile_kernels.moe")
    for ties in (False, True):
        s = scores(4001, experts, seed=seed, ties=ties).to(device)
        assert torch.equal(ops.topk_gate(s, k), peer.topk_gate(s, k))
