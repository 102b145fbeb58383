"""``mhc_pre_apply_mix_forward`` / ``_backward`` (docs/ops/mhc.md#pre_apply_mix): validation (the hidden sizes
out of range among it), fakes against the references and opcheck (CPU tier; the reference backward against float64
autograd is checked with the other primitives' in test_mhc_family.py); both kernels lowered for both targets
(Ascend 950 within the UB, CUDA sm_90a cubins) and the builders' declared ranges (CPU tier); both ops against their
references on the device, the backward's accumulation into its prior grad_x, and opcheck there (device tier)."""

import pytest
import torch
from _plugins.device import requires_device
from mhc_cases import M
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

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.kernels.ascend.mhc import pre_apply_mix

OPS = ops_of("pre_apply_mix")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("pre_apply_mix"))


# --- the reference's backward against float64 autograd (CPU tier) -----------------------------------------------------


@pytest.mark.parametrize("hidden", [100, 192, 8256])
def test_unsupported_hidden_size(hidden):
    x = torch.zeros(2, M, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="hidden size"):
        ops.mhc_pre_apply_mix_forward(x, torch.zeros(2, M), torch.zeros(2, hidden, dtype=torch.bfloat16))


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "pre_apply_mix"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "pre_apply_mix"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


OUT_OF_RANGE = {
    "pre_apply_mix hidden": lambda: pre_apply_mix.build_mhc_pre_apply_mix_forward(limits.MHC_HIDDEN.high + 64, 4, CORES),
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
@pytest.mark.parametrize("name", ["mhc_pre_apply_mix_backward"])
def test_accumulating_ops_use_the_prior_content(name, device, seed):
    check_accumulating_ops_use_the_prior_content(name, device, seed)

