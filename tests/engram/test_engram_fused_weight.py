"""``engram_fused_weight`` (docs/ops/engram.md#fused_weight): validation and a torch.compile trace (CPU tier), both
backends' kernels lowered at the sizes that matter (CPU tier), and on the device the kernel bitwise against the
reference, a misaligned view refused, torch.compile (inductor and CUDA graphs on CUDA, npugraph_ex on NPU) (device
tier). Its fakes and opcheck run with the gate's (test_engram_family.py)."""

import pytest
import torch
from _plugins.device import requires_cuda, requires_device, requires_npu
from engram_ref import engram_fused_weight_ref
from engram_testing import BF16, DEVICE_HIDDEN_SIZES, F32, assert_equal, expect, gen, lowering_tests, meta

import cann_ops_tilelang as ops


FUSED_SHAPES = [(4, h) for h in DEVICE_HIDDEN_SIZES] + [(1, 256), (0, 512), (8, 768)]


def fused_weight_model(weight_hidden, weight_embed):
    return ops.engram_fused_weight(-weight_hidden, weight_embed) + 1


# --- validation ---------------------------------------------------------------------------------------


def test_fused_weight_validation():
    wh = meta((4, 512), BF16)
    expect(ValueError, ops.engram_fused_weight, dict(weight_hidden=wh, weight_embed=meta((4, 256), BF16)),
           "engram_fused_weight", "weight_embed")
    expect(ValueError, ops.engram_fused_weight, dict(weight_hidden=meta((3, 100), BF16),
                                                     weight_embed=meta((3, 100), BF16)),
           "engram_fused_weight", "weight_hidden")
    expect(TypeError, ops.engram_fused_weight, dict(weight_hidden=wh, weight_embed=meta((4, 512), F32)),
           "engram_fused_weight", "weight_embed")
    expect(ValueError, ops.engram_fused_weight, dict(weight_hidden=meta((2048,), BF16),
                                                     weight_embed=meta((2048,), BF16)),
           "engram_fused_weight", "weight_hidden")


# --- torch.compile traces through the fakes -----------------------------------------------------------


def test_compile_fused_weight_fixed_shape(seed):
    torch._dynamo.reset()
    compiled = torch.compile(fused_weight_model, backend="aot_eager", fullgraph=True, dynamic=False)
    a = torch.randn(4, 4096, generator=gen(seed)).bfloat16()
    b = torch.randn(4, 4096, generator=gen(seed + 1)).bfloat16()
    with torch.inference_mode():
        got = compiled(a, b)
    assert torch.equal(got, (-a).float() * b.float() + 1)


# --- kernels: lowering --------------------------------------------------------------------------------


test_ascend_lowers_within_ub, test_cuda_compiles_to_sm90a_cubin = lowering_tests("fused_weight")


# --- device tier --------------------------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_fused_weight_bitwise(shape, device, seed):
    gen = torch.Generator().manual_seed(seed)
    wh = torch.randn(shape, generator=gen).bfloat16().to(device)
    we = torch.randn(shape, generator=gen).bfloat16().to(device)
    wh0, we0 = wh.clone(), we.clone()
    wf = ops.engram_fused_weight(wh, we)
    assert_equal(wf, engram_fused_weight_ref(wh, we))
    assert_equal(wh, wh0)
    assert_equal(we, we0)


@requires_device
def test_misaligned_view_is_rejected_on_device(device, seed):
    """A contiguous view 2 bytes past a 16-byte boundary gets the op's ValueError instead of a device
    fault (the kernels use 16-byte vector accesses), and the device stays usable."""
    gen = torch.Generator().manual_seed(seed)
    wh = torch.randn(4, 512, generator=gen).bfloat16().to(device)
    flat = torch.randn(4 * 512 + 8, generator=gen).bfloat16().to(device)
    with pytest.raises(ValueError, match="argument 'weight_embed': expected data starting on a 16-byte boundary"):
        ops.engram_fused_weight(wh, flat[1:1 + 4 * 512].view(4, 512))
    we = flat[8:8 + 4 * 512].view(4, 512)  # 16 bytes past: aligned, runs
    assert_equal(ops.engram_fused_weight(wh, we), engram_fused_weight_ref(wh, we))


@requires_device
@requires_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_fused_weight_cuda(mode, device, seed):
    torch._dynamo.reset()
    compiled = torch.compile(fused_weight_model, fullgraph=True, dynamic=False, mode=mode)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 4096, generator=gen).bfloat16().to(device)
    b = torch.randn(4, 4096, generator=gen).bfloat16().to(device)
    with torch.inference_mode():
        for _ in range(3):  # CUDA graphs record on a later call
            got = compiled(a, b).clone()
    assert torch.equal(got, (-a).float() * b.float() + 1)


@requires_device
@requires_npu
def test_npugraph_ex_fused_weight(device, seed):
    """The design's npugraph_ex example: fixed shape, inference mode, against the fp32 reference."""
    torch._dynamo.reset()
    compiled = torch.compile(fused_weight_model, backend="npugraph_ex", fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 4096, generator=gen).bfloat16().to(device)
    b = torch.randn(4, 4096, generator=gen).bfloat16().to(device)
    with torch.inference_mode():
        got = compiled(a, b)
    assert torch.equal(got.cpu(), (-a.cpu()).float() * b.cpu().float() + 1)
