"""``mhc_sinkhorn_forward`` / ``_backward`` (docs/ops/mhc.md#sinkhorn): validation, fakes against the references
and opcheck, the reference backward against float64 autograd at R in {1, 10, 20} (CPU tier); both per-token kernels
lowered for both targets (Ascend 950 within the UB, CUDA sm_90a cubins), the Ascend repeat range bounded by its
backward's UB (both edges fit the estimate, one past the high edge does not, out of range refused by builders and
keys) and the declared hc_mult (CPU tier); both ops against their references on the device, also at R in
{1, 10, 20} and with large logits, and opcheck there (device tier)."""

import mhc_ref as ref
import pytest
import torch
from _plugins.device import requires_device
from mhc_cases import M, make_args
from mhc_testing import (
    CORES,
    DEVICE_TOKENS,
    HAVE_NVCC,
    ascend_mhc,
    check,
    check_ascend_lowers_within_ub,
    check_cuda_compiles_to_sm90a_cubin,
    check_per_token_op_vs_reference,
    check_values_outside_the_declared_ranges_raise_limit_error,
    close,
    cuda_mhc,
    lowering_cases,
    op_module_tests,
    ops_of,
    run_both,
)

from cann_ops_tilelang import limits
from cann_ops_tilelang.kernels.ascend import _build
from cann_ops_tilelang.kernels.ascend.mhc import sinkhorn

OPS = ops_of("sinkhorn")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("sinkhorn"))


# --- the reference's backward against float64 autograd (CPU tier) -----------------------------------------------------


@pytest.mark.parametrize("repeat", [1, 10, 20])
def test_sinkhorn_backward_vs_autograd(repeat, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(17, M, M, generator=gen, dtype=torch.float64)
    g = torch.randn(17, M, M, generator=gen, dtype=torch.float64)
    xa = x.clone().requires_grad_()
    ref.sinkhorn_model(xa, repeat, 1e-6).backward(g)
    got = torch.empty_like(x)
    ref.mhc_sinkhorn_backward_ref(g, x, got, repeat, 1e-6)
    close(got, xa.grad)


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "sinkhorn"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "sinkhorn"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


REPEAT = limits.MHC_SINKHORN_REPEAT["ascend"]


@pytest.mark.parametrize("repeat", REPEAT.edges())
def test_sinkhorn_repeat_edges_fit_the_ub_estimate(repeat):
    # both kernels are lowered within the UB budget at both repeat edges by tests/test_limits.py (not twice)
    assert sinkhorn.mhc_sinkhorn_backward_ub_bytes(repeat) <= _build.UB_BUDGET_BYTES


def test_sinkhorn_repeat_limit_is_the_largest_that_fits():
    assert sinkhorn.mhc_sinkhorn_max_repeat() == REPEAT.high
    assert sinkhorn.mhc_sinkhorn_backward_ub_bytes(REPEAT.high + 1) > _build.UB_BUDGET_BYTES


@pytest.mark.parametrize("repeat", [REPEAT.low - 1, REPEAT.high + 1])
def test_sinkhorn_repeat_outside_the_range_is_refused(repeat):
    comb = torch.empty((8, 4, 4))
    calls = [
        lambda: sinkhorn.build_mhc_sinkhorn_forward(repeat, CORES),
        lambda: sinkhorn.build_mhc_sinkhorn_backward(repeat, CORES),
        lambda: sinkhorn.FORWARD.key(comb, repeat),
        lambda: sinkhorn.BACKWARD.key(comb, repeat),
    ]
    for call in calls:
        with pytest.raises(limits.LimitError, match=rf"mhc_sinkhorn_(forward|backward): repeat must be in \[1, {REPEAT.high}\]"):
            call()


OUT_OF_RANGE = {
    "sinkhorn m": lambda: sinkhorn.BACKWARD.key(torch.empty((8, 3, 3)), 10),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_values_outside_the_declared_ranges_raise_limit_error(case):
    check_values_outside_the_declared_ranges_raise_limit_error(OUT_OF_RANGE[case])


# --- on the device (device tier) --------------------------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("name", OPS)
def test_per_token_op_vs_reference(name, tokens, device, seed):
    check_per_token_op_vs_reference(name, tokens, device, seed)


@requires_device
@pytest.mark.parametrize("repeat", [1, 10, 20])
@pytest.mark.parametrize("name", ["mhc_sinkhorn_forward", "mhc_sinkhorn_backward"])
def test_sinkhorn_repeats(name, repeat, device, seed):
    args = make_args(name, 1001, 4096, seed=seed, device=device, repeat=repeat)
    check(name, *run_both(name, args), 1001)


@requires_device
@pytest.mark.parametrize("offset", [-100.0, 100.0])
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
@pytest.mark.parametrize("name", ["mhc_sinkhorn_forward", "mhc_sinkhorn_backward"])
def test_sinkhorn_large_logits(name, offset, eps, device, seed):
    args = make_args(name, 1024, 4096, seed=seed, device=device, logit_offset=offset, sinkhorn_eps=eps)
    _, oa, _, ra = run_both(name, args)
    out = 2 if name.endswith("backward") else 1
    assert torch.isfinite(oa[out]).all()
    torch.testing.assert_close(oa[out], ra[out], rtol=1e-5, atol=1e-6)

