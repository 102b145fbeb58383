"""Helpers shared by the Engram test files (not a test module; tests/engram/conftest.py has pytest rewrite its
asserts).

* CPU tier: the gate's inputs at H = 512 (``all_args``, ``gate_args``).
* Validation: the meta arguments of the gate's ops and of the weight reduction, ``expect``, and
  ``validation_tests(*ops)``: the tests every tensor argument gets, for an op file's own ops.
* Lowering: ``lowering_tests(op_module)``: the tests every kernel gets at the sizes that matter (AscendC within
  the UB, sm_90a cubins within the per-CTA limits), for an op file's own kernel module.
* Device tier: the token counts and hidden sizes (one xdist group per hidden size), ``inputs``, ``assert_equal``.

An op's test file takes the shared tests under its own names, e.g.
``test_ascend_lowers_within_ub, test_cuda_compiles_to_sm90a_cubin = lowering_tests("gate")``.
"""

import functools
import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.levels import level_choice
from engram_ref import engram_fused_weight_ref, make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cann_ops_tilelang as ops
from cann_ops_tilelang.kernels.ascend import _build as ascend_build
from cann_ops_tilelang.kernels.ascend import engram as ascend_engram
from cann_ops_tilelang.kernels.cuda import _build as cuda_build
from cann_ops_tilelang.kernels.cuda import engram as cuda_engram


# --- CPU tier: the gate's inputs ----------------------------------------------------------------------


EPS, CLAMP = 1e-20, 1e-6
HIDDEN = 512


def gen(seed):
    return torch.Generator().manual_seed(seed)


def all_args(tokens, masked, seed):
    x, kv, wh, we, mask = make_inputs(tokens, HIDDEN, masked=masked, generator=gen(seed))
    wf = engram_fused_weight_ref(wh, we)
    return x, kv, wh, we, wf, mask


gate_args = all_args  # (the name the no-residual tests use)


# --- validation ---------------------------------------------------------------------------------------


M = 4
BF16, F32 = torch.bfloat16, torch.float32
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def gate_fwd_args(tokens=3, hidden=512):
    return dict(
        hidden_states=meta((tokens, M, hidden), BF16),
        kv=meta((tokens, M + 1, hidden), BF16),
        weight_fused=meta((M, hidden), F32),
        eps=1e-6,
        clamp_value=1e-6,
        save_for_backward=True,
        image_token_mask=None,
    )


def gate_bwd_args(tokens=3, hidden=512):
    return dict(
        grad_out=meta((tokens, M, hidden), BF16),
        hidden_states=meta((tokens, M, hidden), BF16),
        kv=meta((tokens, M + 1, hidden), BF16),
        weight_fused=meta((M, hidden), F32),
        dot=meta((tokens, M), F32),
        gate_score=meta((tokens, M), F32),
        rstd_x=meta((tokens, M), F32),
        rstd_k=meta((tokens, M), F32),
        clamp_value=1e-6,
        image_token_mask=None,
    )


def reduce_args(partials=5, hidden=512):
    return dict(
        grad_w_partial=meta((partials, M, hidden), F32),
        weight_hidden=meta((M, hidden), BF16),
        weight_embed=meta((M, hidden), BF16),
        grad_weight_hidden=meta((M, hidden), F32),
        grad_weight_embed=meta((M, hidden), F32),
    )


OPS = {
    "engram_gate_forward": (ops.engram_gate_forward, gate_fwd_args),
    "engram_gate_backward": (ops.engram_gate_backward, gate_bwd_args),
    "engram_grad_w_reduce": (ops.engram_grad_w_reduce, reduce_args),
}


def expect(exc, fn, kwargs, op, arg):
    with pytest.raises(exc) as info:
        fn(**kwargs)
    message = str(info.value)
    assert f"cann_ops_tilelang::{op}" in message, message
    assert f"'{arg}'" in message, message
    return message


TENSOR_ARGS = [
    (name, arg)
    for name, (_, make) in OPS.items()
    for arg, value in make().items()
    if isinstance(value, torch.Tensor)
]


def validation_tests(*names):
    """The tests every tensor argument of the ops ``names`` gets (wrong dtype: TypeError; wrong rank or shape,
    non-contiguous: ValueError; not a tensor: TypeError), parametrized over those arguments only; an op's test
    file assigns them to its own names."""
    assert set(names) <= set(OPS), names
    tensor_args = [(name, arg) for name, arg in TENSOR_ARGS if name in names]

    @pytest.mark.parametrize("name,arg", tensor_args)
    @given(dtype=st.sampled_from([torch.float16, torch.float64, torch.int32, torch.uint8]))
    @SETTINGS
    def test_wrong_dtype(name, arg, dtype):
        fn, make = OPS[name]
        kwargs = make()
        kwargs[arg] = meta(kwargs[arg].shape, dtype)
        message = expect(TypeError, fn, kwargs, name, arg)
        assert str(dtype) in message

    @pytest.mark.parametrize("name,arg", tensor_args)
    @given(extra=st.integers(1, 3), where=st.sampled_from(["rank", "shape"]))
    @SETTINGS
    def test_wrong_rank_or_shape(name, arg, extra, where):
        fn, make = OPS[name]
        kwargs = make()
        good = kwargs[arg]
        if where == "rank":
            shape = (*good.shape, extra)
        else:
            # grow the last dim by a non-multiple of 256, or the first one for the leading argument
            shape = list(good.shape)
            shape[-1] += extra
            shape = tuple(shape)
        kwargs[arg] = meta(shape, good.dtype)
        expect(ValueError, fn, kwargs, name, arg)

    @pytest.mark.parametrize("name,arg", [(n, a) for n, a in tensor_args if OPS[n][1]()[a].dim() >= 2])
    def test_non_contiguous(name, arg):
        fn, make = OPS[name]
        kwargs = make()
        good = kwargs[arg]
        kwargs[arg] = meta(tuple(reversed(good.shape)), good.dtype).transpose(0, -1)
        assert kwargs[arg].shape == good.shape
        message = expect(ValueError, fn, kwargs, name, arg)
        assert "contiguous" in message

    @pytest.mark.parametrize("name,arg", tensor_args)
    def test_not_a_tensor(name, arg):
        fn, make = OPS[name]
        kwargs = make()
        kwargs[arg] = [1.0, 2.0]
        message = expect(TypeError, fn, kwargs, name, arg)  # the public function's kind check, before the schema's
        assert "expected a torch.Tensor" in message, message

    return test_wrong_dtype, test_wrong_rank_or_shape, test_non_contiguous, test_not_a_tensor


# --- lowering -----------------------------------------------------------------------------------------


# The sizes that matter: the model sizes H = 4096 and 7168 here (CUDA: sm_90a cubins, their vector accesses checked
# against the ops' declarations; budgets checked at the largest, 7168); the range's edges (512, 8192) are lowered on
# both backends with their budgets by tests/test_limits.py. Other sizes take the same code paths.
LOWERING_HIDDEN = [4096, 7168]


# op modules whose kernels do not depend on the hidden size: lowered at the first H only
SIZE_FREE = ("hash/", "sinkhorn/")


@functools.cache  # (built once per backend, not once per op file)
def lowering_cases(module):
    return [(h, name) for h in LOWERING_HIDDEN for name in sorted(module.lowering_cases(h))
            if h == LOWERING_HIDDEN[0] or not name.startswith(SIZE_FREE)]


def lowering_params(module, op_module):
    """``(hidden, name)`` of the lowering cases of ``op_module`` in the family ``module`` (one backend)."""
    params = [(h, name) for h, name in lowering_cases(module) if name.startswith(op_module + "/")]
    assert params, (module.__name__, op_module)
    return params


def lowering_tests(op_module):
    """The tests every kernel of the kernel modules ``<backend>/engram/<op_module>.py`` gets at the sizes that
    matter: lowered to AscendC within the UB budget, compiled to an sm_90a cubin within the per-CTA limits with
    its vector accesses declared; an op's test file assigns them to its own names."""

    @pytest.mark.parametrize("hidden,name", lowering_params(ascend_engram, op_module))
    def test_ascend_lowers_within_ub(hidden, name):
        prim_func = ascend_engram.lowering_cases(hidden)[name]
        lowered = ascend_build.lower_ascendc(prim_func)
        assert "__aicore__" in lowered.source or "__global__" in lowered.source, lowered.source[:400]
        assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (
            f"{name} at H={hidden}: UB {lowered.ub_bytes} B > budget {lowered.budget_bytes} B"
        )

    @pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build CUDA cubins here")
    @pytest.mark.parametrize("hidden,name", lowering_params(cuda_engram, op_module))
    def test_cuda_compiles_to_sm90a_cubin(hidden, name):
        prim_func = cuda_engram.lowering_cases(hidden)[name]
        built = cuda_build.compile_cubin(prim_func, arch="sm_90a")
        assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
        # launch resources of the lowered kernel within the H200's per-CTA limits
        assert built.fits, (
            f"{name} at H={hidden}: shared memory {built.smem_bytes} B (budget {built.budget_bytes} B), "
            f"{built.threads} threads per CTA"
        )
        # every argument its ops pass in and the kernel accesses in vectors is declared (op helper's alignment check)
        assert not undeclared(name, built.source, declared_vector_args())

    return test_ascend_lowers_within_ub, test_cuda_compiles_to_sm90a_cubin


# --- device tier --------------------------------------------------------------------------------------


DEVICE_TOKENS = level_choice([1, 509], [0, 1, 509, 512, 8001], [0, 1, 509, 512, 4096, 8001, 16384])
DEVICE_HIDDEN_SIZES = level_choice([512, 4096], [512, 2560, 4096, 7168], [512, 768, 2560, 4096, 5120, 7168, 8192])
# One xdist group per hidden size (`--dist loadgroup`): a worker compiles the kernels of its sizes only.
DEVICE_HIDDEN = [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in DEVICE_HIDDEN_SIZES]


def assert_equal(got, want):
    """dtype, shape, stride and device identical, then the bytes."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert got.device == want.device
    assert torch.equal(got.view(torch.uint8) if got.numel() else got, want.view(torch.uint8) if want.numel() else want)


def inputs(tokens, hidden, masked, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x, kv, wh, we, mask = make_inputs(tokens, hidden, masked=masked, generator=gen)
    return [None if t is None else t.to(device) for t in (x, kv, wh, we, mask)]
