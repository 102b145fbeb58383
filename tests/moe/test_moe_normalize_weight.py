"""``normalize_weight`` (docs/ops/moe.md#normalize_weight): validation, the reference against its float64 oracle and
the contract's summation order, the fake on meta tensors, opcheck, torch.compile with a dynamic T and zero tokens
(CPU tier, the reference as the CPU kernel); the CUDA kernel compiled to sm_90a cubins and the Ascend 950 kernel
lowered to AscendC within the UB, their launch views and keys (CPU tier); on the device the kernel bitwise against
the reference and against the peer (DeepSeek's tile_kernels) when it imports (device tier)."""

import pytest
import torch
from _plugins.device import requires_device
from _plugins.references import without_cpu_references
from moe_cases import normalize_weight_call, weights
from moe_ref import normalize_weight_f64, normalize_weight_ref, pairwise_sum
from moe_testing import (DEVICE_TOKENS, HAVE_NVCC, assert_compiles_once, check_ascend_lowers_within_ub,
                         check_cuda_compiles_to_sm90a_cubin, check_launcher_views, check_zero_tokens_launch_nothing,
                         lowering_cases, metadata)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.moe._common import DENOMINATOR_EPS, pairwise_steps

F32 = torch.float32


# --- validation ---------------------------------------------------------------------------------------------------


def _bad_calls():
    return [
        ({"topk_weights": torch.zeros(3, 8, dtype=torch.bfloat16)}, TypeError,
         r"'topk_weights': expected dtype torch.float32, got torch.bfloat16"),
        ({"topk_weights": torch.zeros(8)}, ValueError, r"'topk_weights': expected a 2-D tensor, got shape \(8,\)"),
        ({"topk_weights": torch.zeros(8, 3).t()}, ValueError, r"'topk_weights': expected a contiguous tensor"),
        ({"topk_weights": torch.zeros(3, 0)}, ValueError, r"'topk_weights': expected a top-k count k in \[1, 32\], "
                                                          r"got 0"),
        ({"topk_weights": torch.zeros(3, 33)}, ValueError, r"'topk_weights': expected a top-k count k in \[1, 32\], "
                                                           r"got 33"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**normalize_weight_call(3, 64), **change}
    with without_cpu_references(), pytest.raises(error,
                                                 match=rf"cann_ops_tilelang::normalize_weight: argument {message}"):
        ops.normalize_weight(**call)


# --- the reference, the fake, opcheck, compile (CPU tier) ----------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 6, 8, 9, 16, 17, 31, 32])
def test_the_pairwise_order_is_the_kernels(k, seed):
    """The reference's halving (zero-padded to 32 lanes) and the kernels' additions (``pairwise_steps``) give the same
    bits, each addition exact or not."""
    w = weights(64, k, seed=seed)
    acc = [w[:, i].clone() for i in range(k)]
    for dst, src in pairwise_steps(k):
        acc[dst] = acc[dst] + acc[src]
    assert torch.equal(acc[0], pairwise_sum(w))
    assert len(pairwise_steps(k)) == k - 1  # a tree: every value is added once


def test_the_order_is_pairwise_not_sequential():
    """At k = 3 lane 2 goes to lane 0 first, then lane 1: ``(2^-24 + 2^-24) + 1`` is exact, where left to right
    ``(2^-24 + 1) + 2^-24`` rounds twice back to 1."""
    w = torch.tensor([[2.0**-24, 1.0, 2.0**-24]])
    assert pairwise_steps(3) == [(0, 2), (0, 1)]
    assert pairwise_sum(w).item() == 1.0 + 2.0**-23
    assert ((w[0, 0] + w[0, 1]) + w[0, 2]).item() == 1.0


@pytest.mark.parametrize("k", [1, 6, 8, 32])
def test_reference_vs_float64(k, seed):
    w = weights(257, k, seed=seed)
    den, out = normalize_weight_ref(w)
    den64, out64 = normalize_weight_f64(w)
    torch.testing.assert_close(den.double(), den64, rtol=k * 2.0**-24, atol=0)
    torch.testing.assert_close(out.double(), out64, rtol=(k + 1) * 2.0**-24, atol=0)
    assert torch.equal(den, torch.tensor(DENOMINATOR_EPS, dtype=F32) + pairwise_sum(w))


def test_zero_rows_give_zeros_not_nan():
    den, out = ops.normalize_weight(torch.zeros(2, 8))
    assert torch.equal(den, torch.full((2,), 1e-20)) and torch.equal(out, torch.zeros(2, 8))


def test_fake_matches_reference(seed):
    for tokens in (0, 1, 5):
        real = ops.normalize_weight(**normalize_weight_call(tokens, 64, seed=seed, k=6))
        fake = ops.normalize_weight(**normalize_weight_call(tokens, 64, seed=seed, k=6, device="meta"))
        assert [metadata(t) for t in fake] == [metadata(t) for t in real] == [((tokens,), F32, (1,)),
                                                                              ((tokens, 6), F32, (6, 1))]


@pytest.mark.parametrize("tokens", [0, 3])
def test_opcheck(tokens, seed):
    call = normalize_weight_call(tokens, 64, seed=seed)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.normalize_weight.default, tuple(call.values()))


def test_compile_fullgraph_dynamic_no_recompile(seed):
    assert_compiles_once(ops.normalize_weight, lambda tokens: (weights(tokens, 8, seed=seed + tokens),), (7, 9, 17))


def test_zero_tokens_launch_nothing(monkeypatch):
    check_zero_tokens_launch_nothing(monkeypatch, "normalize_weight", normalize_weight_call(0, 64))


# --- the kernels: lowering, launch views, keys (CPU tier) ----------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.ascend.moe import normalize_weight as ascend_norm  # noqa: E402
from cann_ops_tilelang.kernels.cuda.moe import normalize_weight as cuda_norm  # noqa: E402


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("name", lowering_cases(cuda_norm))
def test_cuda_compiles_to_sm90a_cubin(name):
    source = check_cuda_compiles_to_sm90a_cubin(cuda_norm, name, cuda_norm.NORMALIZE_WEIGHT_PLAN.threads)
    k = int(name.rsplit("_k", 1)[1])
    # the contract's arithmetic: k - 1 IEEE additions of the tree and the epsilon's, k IEEE divisions
    assert source.count("__fadd_rn(") == k and "__fdiv_rn(" in source


@pytest.mark.parametrize("name", lowering_cases(ascend_norm))
def test_ascend_lowers_within_ub(name):
    check_ascend_lowers_within_ub(ascend_norm, name)


@pytest.mark.parametrize("module", [cuda_norm, ascend_norm], ids=["cuda", "ascend"])
def test_launcher_passes_the_views_the_kernel_declares(module, monkeypatch):
    keys = {check_launcher_views(monkeypatch, module, "normalize_weight", normalize_weight_call(tokens, 64, k=k))
            for tokens in (1, 5) for k in (6, 32)}
    assert sorted(key.k for key in keys) == [6, 32]  # T is not in the key


def test_builders_refuse_what_the_limits_refuse():
    for k in (0, 33):
        with pytest.raises(limits.LimitError, match="normalize_weight: "):
            cuda_norm.build_normalize_weight(k)
        with pytest.raises(limits.LimitError, match="normalize_weight: "):
            ascend_norm.build_normalize_weight(k, 64)


# --- on the device: bitwise against the reference and the peer (device tier) -------------------------------------


@requires_device
@pytest.mark.parametrize("k", [1, 2, 6, 8, 9, 17, 32])
def test_device_bitwise(k, device, seed):
    for tokens in DEVICE_TOKENS:
        w = weights(tokens, k, seed=seed + tokens)
        w[::7] = 0.0  # rows of zeros: the epsilon alone
        den, out = ops.normalize_weight(w.to(device))
        want = normalize_weight_ref(w)
        assert torch.equal(den.cpu(), want[0]) and torch.equal(out.cpu(), want[1]), (tokens, k)


@requires_device
def test_device_zero_tokens_and_opcheck(device, seed):
    den, out = ops.normalize_weight(torch.empty(0, 8, device=device))
    assert den.shape == (0,) and out.shape == (0, 8)
    call = normalize_weight_call(5, 64, seed=seed, device=device)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.normalize_weight.default, tuple(call.values()))


@requires_device
@pytest.mark.parametrize("k", [6, 8, 32])
def test_device_equals_the_peer(k, device, seed):
    """DeepSeek's tile_kernels (when importable) on the same weights: the same bits."""
    peer = pytest.importorskip("tile_kernels.moe")
    w = weights(4001, k, seed=seed).to(device)
    for got, theirs in zip(ops.normalize_weight(w), peer.normalize_weight(w)):
        assert torch.equal(got, theirs)
