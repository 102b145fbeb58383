"""``mhc_post_forward`` (and its out= variant) / ``mhc_post_backward`` (docs/ops/mhc.md#post): validation, fakes
against the references and opcheck (CPU tier; the references' backward against float64 autograd is checked with
the other primitives' in test_mhc_family.py); the kernels lowered for both targets (Ascend 950 within the UB,
CUDA sm_90a cubins), the CUDA backward's cp.async ring within its annotated occupancy and the builders' declared
ranges (CPU tier); the ops against their references on the device and opcheck there (device tier)."""

import pytest
from _plugins.device import requires_device
from mhc_testing import (
    CORES,
    DEVICE_HIDDEN,
    DEVICE_TOKENS,
    HAVE_NVCC,
    ascend_mhc,
    check_ascend_lowers_within_ub,
    check_cuda_compiles_to_sm90a_cubin,
    check_streaming_op_vs_reference,
    check_values_outside_the_declared_ranges_raise_limit_error,
    cuda_mhc,
    lowering_cases,
    op_module_tests,
    ops_of,
)

from cann_ops_tilelang.kernels.ascend.mhc import post

OPS = ops_of("post")


# --- validation, fakes and opcheck (CPU tier; opcheck also on the device): the tests every op file runs alike ---

globals().update(op_module_tests("post"))


# --- the kernels lowered for both targets, the declared ranges (CPU tier) ---------------------------------------------


@pytest.mark.parametrize("hidden,name", lowering_cases(ascend_mhc, "post"))
def test_ascend_lowers_within_ub(hidden, name):
    check_ascend_lowers_within_ub(hidden, name)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", lowering_cases(cuda_mhc, "post"))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    check_cuda_compiles_to_sm90a_cubin(hidden, name)


def test_cuda_post_backward_ring_fits_its_annotated_occupancy():
    """The post backward's cp.async ring (every H % 64 == 0 up to 16384): used exactly where the layout is
    unguarded with >= 2 vectors per thread, never staging past the row (stages - 1 <= nv), and the CTAs
    per SM annotated on the kernel fit the SM's shared memory with the ring (1 KiB reserved per CTA) and
    the 128-register budget; at H = 2560 / 4096 the lowered kernel's shared memory is the ring's."""
    from cann_ops_tilelang.chips import H200
    from cann_ops_tilelang.kernels.cuda._build import compile_cubin
    from cann_ops_tilelang.kernels.cuda.mhc import _common, post

    m = 4
    for hidden in range(64, 16385, 64):
        schedule = post.backward_schedule(hidden, m)
        threads, nv, guarded = schedule.threads, schedule.nv, schedule.guarded
        stages, slots, blocks = schedule.stages, schedule.slots, schedule.blocks
        assert (stages > 0) == (not guarded and nv > 1), (hidden, stages)
        ring = slots * (2 * m + 1) * threads * 8 * 2
        if stages:
            assert 2 <= stages <= nv + 1 and slots == min(stages, nv), (hidden, stages, slots, nv)
        assert 1 <= blocks <= _common.min_blocks(threads, 128), (hidden, blocks)
        assert blocks * (ring + 1024) <= H200.arch.smem_per_sm == 228 * 1024, (hidden, blocks, ring)
    for hidden in (2560, 4096):
        schedule = post.backward_schedule(hidden, m)
        threads, slots = schedule.threads, schedule.slots
        build = compile_cubin(post.build_mhc_post_backward(hidden, m), arch="sm_90a")
        assert build.smem_bytes == slots * (2 * m + 1) * threads * 8 * 2, (hidden, build.smem_bytes)


OUT_OF_RANGE = {
    "post hc_mult": lambda: post.build_mhc_post_backward(2560, 8, CORES),
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

