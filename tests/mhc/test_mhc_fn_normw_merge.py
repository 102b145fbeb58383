"""``mhc_fn_normw_merge_forward`` / ``_backward`` (docs/ops/mhc.md#fn_normw_merge): validation, fakes against the
references and opcheck (CPU tier; the reference backward against float64 autograd is checked with the other
primitives' in test_mhc_family.py); both kernels lowered for both targets (Ascend 950 within the UB, CUDA sm_90a
cubins) and the builders' declared ranges (CPU tier); both ops against their references on the device, the
backward's accumulation into its prior gradients, and opcheck there (device tier)."""

import pytest
from _plugins.device import requires_device
from mhc_testing import (
    CORES,
    DEVICE_HIDDEN,
    DEVICE_TOKENS,
    HAVE_NVCC,
    ascend_mhc,
    check_accumulating_ops_use_the_prior_content,
    check_ascend_lowers_within_ub,
    check_cuda_compiles_to_sm90a_cubin,
    check_streaming_op_vs_reference,
    check_values_outside_the_declared_ranges_raise_limit_error,
    cuda_mhc,
    lowering_cases,
    op_module_tests,
    ops_of,
)

from cann_ops_tilelang.kernels.ascend.mhc import fn_normw_merge

OPS = ops_of("fn_normw_merge")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("fn_normw_merge"))


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "fn_normw_merge"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "fn_normw_merge"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


OUT_OF_RANGE = {
    "fn_normw_merge K": lambda: fn_normw_merge.build_mhc_fn_normw_merge_forward(24, 4 * 2560 + 64, CORES),
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


@requires_device
@pytest.mark.parametrize("name", ["mhc_fn_normw_merge_backward"])
def test_accumulating_ops_use_the_prior_content(name, device, seed):
    check_accumulating_ops_use_the_prior_content(name, device, seed)

