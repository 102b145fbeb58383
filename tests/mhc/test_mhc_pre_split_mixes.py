"""``mhc_pre_split_mixes_forward`` / ``_backward`` (docs/ops/mhc.md#pre_split_mixes): validation, fakes against
the references and opcheck, the reference backward against float64 autograd (CPU tier); both per-token kernels
lowered for both targets (Ascend 950 within the UB, CUDA sm_90a cubins) and the builders' and key's declared
ranges (CPU tier); both ops against their references on the device and opcheck there (device tier)."""

import mhc_ref as ref
import pytest
import torch
from _plugins.device import requires_device
from mhc_cases import M, make_args
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

from cann_ops_tilelang.kernels.ascend.mhc import pre_split_mixes

OPS = ops_of("pre_split_mixes")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("pre_split_mixes"))


# --- the reference's backward against float64 autograd (CPU tier) -----------------------------------------------------


def test_split_mixes_backward_vs_autograd(seed):
    args = [a.double() if isinstance(a, torch.Tensor) else a for a in make_args("mhc_pre_split_mixes_backward", 19,
                                                                                 HIDDEN, seed=seed)]
    pre_g, post_g, comb_g, mixes, _, scale, base, grad_mixes, grad_scale, grad_base, mult = args
    leaves = [f64(mixes), f64(scale), f64(base)]
    pre, post, comb = ref.split_mixes_model(*leaves, M, mult, 1e-2)
    torch.autograd.backward([pre, post, comb], [pre_g, post_g, comb_g])
    ref.mhc_pre_split_mixes_backward_ref(pre_g, post_g, comb_g, mixes, post.detach(), scale, base, grad_mixes,
                                         grad_scale, grad_base, mult)
    for got, leaf in zip((grad_mixes, grad_scale, grad_base), leaves):
        close(got, leaf.grad)


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "pre_split_mixes"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "pre_split_mixes"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


OUT_OF_RANGE = {
    "split mixes hc_mult": lambda: pre_split_mixes.build_mhc_pre_split_mixes_forward(2, CORES),
    "split mixes key": lambda: pre_split_mixes.FORWARD.key(torch.empty((8, 32))),
    "split mixes partials": lambda: pre_split_mixes.build_mhc_pre_split_mixes_backward_reduce(0),
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

