"""``expand_to_mhc_forward`` / ``_backward`` (docs/ops/mhc.md#expand): validation, fakes against the references
and opcheck, the reference backward against float64 autograd (CPU tier); both kernels lowered for both targets
(Ascend 950 within the UB, CUDA sm_90a cubins) and the builders' declared ranges (CPU tier); both ops against their
references on the device and opcheck there (device tier)."""

import mhc_ref as ref
import pytest
import torch
from _plugins.device import requires_device
from mhc_cases import M
from mhc_testing import (
    CORES,
    DEVICE_HIDDEN,
    DEVICE_TOKENS,
    HAVE_NVCC,
    HIDDEN,
    ascend_mhc,
    check_ascend_lowers_within_ub,
    check_cuda_compiles_to_sm90a_cubin,
    check_streaming_op_vs_reference,
    check_values_outside_the_declared_ranges_raise_limit_error,
    close,
    cuda_mhc,
    f64,
    lowering_cases,
    op_module_tests,
    ops_of,
)

from cann_ops_tilelang.kernels.ascend.mhc import expand

OPS = ops_of("expand")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("expand"))


# --- the reference's backward against float64 autograd (CPU tier) -----------------------------------------------------


def test_expand_backward_vs_autograd(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, HIDDEN, generator=gen, dtype=torch.float64)
    g = torch.randn(6, M, HIDDEN, generator=gen, dtype=torch.float64)
    xa = f64(x)
    xa.unsqueeze(1).expand(6, M, HIDDEN).backward(g)
    got = torch.empty_like(x)
    ref.expand_to_mhc_backward_ref(g, got)
    close(got, xa.grad)


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "expand"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "expand"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


OUT_OF_RANGE = {
    "expand hc_mult": lambda: expand.build_expand_to_mhc_forward(2560, 3, CORES),
    "expand hidden": lambda: expand.build_expand_to_mhc_backward(2560 + 32, 4, CORES),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_values_outside_the_declared_ranges_raise_limit_error(case):
    check_values_outside_the_declared_ranges_raise_limit_error(OUT_OF_RANGE[case])


# --- on the device (device tier) --------------------------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("name", OPS)
def test_streaming_op_vs_reference(name, tokens, hidden, device, seed):
    check_streaming_op_vs_reference(name, tokens, hidden, device, seed)

