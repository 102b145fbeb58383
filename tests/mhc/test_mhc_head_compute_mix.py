"""``mhc_head_compute_mix_forward`` / ``_backward`` (docs/ops/mhc.md#head_compute_mix): validation, fakes against
the references and opcheck (CPU tier; the reference backward against float64 autograd is checked with the other
primitives' in test_mhc_family.py); both per-token kernels lowered for both targets (Ascend 950 within the UB,
CUDA sm_90a cubins) and the builders' and keys' declared ranges (CPU tier); both ops against their references on
the device and opcheck there (device tier)."""

import pytest
import torch
from _plugins.device import requires_device
from mhc_testing import (
    CORES,
    DEVICE_TOKENS,
    HAVE_NVCC,
    ascend_mhc,
    check_ascend_lowers_within_ub,
    check_cuda_compiles_to_sm90a_cubin,
    check_per_token_op_vs_reference,
    check_values_outside_the_declared_ranges_raise_limit_error,
    cuda_mhc,
    lowering_cases,
    op_module_tests,
    ops_of,
)

from cann_ops_tilelang.kernels.ascend.mhc import head_compute_mix

OPS = ops_of("head_compute_mix")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("head_compute_mix"))


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "head_compute_mix"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "head_compute_mix"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


OUT_OF_RANGE = {
    "head mix key": lambda: head_compute_mix.FORWARD.key(torch.empty((8, 2))),
    "head mix partials": lambda: head_compute_mix.build_mhc_head_compute_mix_backward(4, 0, CORES),
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

