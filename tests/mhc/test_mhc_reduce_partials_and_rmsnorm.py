"""``mhc_reduce_partials_and_rmsnorm_forward`` / ``_backward`` (docs/ops/mhc.md#reduce_partials_and_rmsnorm):
validation, fakes against the references and opcheck, the reference backward against float64 autograd (CPU tier);
both per-token kernels lowered for both targets (Ascend 950 within the UB, CUDA sm_90a cubins) and the builders'
declared ranges (CPU tier); both ops against their references on the device and opcheck there (device tier)."""

import mhc_ref as ref
import pytest
import torch
from _plugins.device import requires_device
from mhc_cases import make_args
from mhc_testing import (
    CORES,
    DEVICE_TOKENS,
    HAVE_NVCC,
    HIDDEN,
    ascend_mhc,
    check_ascend_lowers_within_ub,
    check_cuda_compiles_to_sm90a_cubin,
    check_per_token_op_vs_reference,
    check_values_outside_the_declared_ranges_raise_limit_error,
    close,
    cuda_mhc,
    f64,
    lowering_cases,
    op_module_tests,
    ops_of,
)

from cann_ops_tilelang.kernels.ascend.mhc import reduce_partials_and_rmsnorm

OPS = ops_of("reduce_partials_and_rmsnorm")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("reduce_partials_and_rmsnorm"))


# --- the reference's backward against float64 autograd (CPU tier) -----------------------------------------------------


def test_reduce_rmsnorm_backward_vs_autograd(seed):
    grad_out, out_mul, sqrsum, omg, sqg, rg, eps = [
        a.double() if isinstance(a, torch.Tensor) else a
        for a in make_args("mhc_reduce_partials_and_rmsnorm_backward", 21, HIDDEN, seed=seed)]
    leaves = [f64(out_mul), f64(sqrsum)]
    ref.reduce_rmsnorm_model(*leaves, rg, eps).backward(grad_out)
    ref.mhc_reduce_partials_and_rmsnorm_backward_ref(grad_out, out_mul, sqrsum, omg, sqg, rg, eps)
    close(omg, leaves[0].grad)
    close(sqg, leaves[1].grad)


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "reduce_partials_and_rmsnorm"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "reduce_partials_and_rmsnorm"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


OUT_OF_RANGE = {
    "reduce n_splits": lambda: reduce_partials_and_rmsnorm.build_mhc_reduce_partials_and_rmsnorm_forward(0, CORES),
    "reduce M3": lambda: reduce_partials_and_rmsnorm.build_mhc_reduce_partials_and_rmsnorm_backward(33, CORES),
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

