"""``engram_grad_w_reduce`` (docs/ops/engram.md#grad_w_reduce): no partial rows, validation (every tensor argument,
one buffer for both gradients) (CPU tier); both backends' kernels lowered at the sizes that matter, the CUDA
reduction's TMA chunks and vector schedule, the launcher's choice between them by alignment (CPU tier); on the device
the reduction against the reference for every row count, bitwise in ascending order, into ``main_grad`` views at any
offset, both schedules bitwise equal (device tier). Its fakes and opcheck run with the gate's
(test_engram_family.py)."""

import re
import shutil

import pytest
import torch
from _plugins.device import requires_device
from engram_ref import engram_grad_w_reduce_ref
from engram_testing import DEVICE_HIDDEN, assert_equal, expect, lowering_tests, reduce_args, validation_tests

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.kernels.cuda import _build as cuda_build


# --- the reference ------------------------------------------------------------------------------------


def test_grad_w_reduce_of_no_partials_leaves_the_buffers(seed):
    """P = 0 (docs/ops/engram.md#grad_w_reduce): a gradient over no partial rows adds nothing."""
    gen = torch.Generator().manual_seed(seed)
    wh, we = (torch.randn(4, 512, generator=gen).bfloat16() for _ in range(2))
    gwh, gwe = torch.randn(4, 512, generator=gen), torch.randn(4, 512, generator=gen)
    want_h, want_e = gwh.clone(), gwe.clone()
    ops.engram_grad_w_reduce(torch.empty(0, 4, 512), wh, we, gwh, gwe)
    assert torch.equal(gwh, want_h) and torch.equal(gwe, want_e)
    engram_grad_w_reduce_ref(torch.empty(0, 4, 512), wh, we, want_h, want_e)
    assert torch.equal(gwh, want_h) and torch.equal(gwe, want_e)


# --- validation ---------------------------------------------------------------------------------------


# every tensor argument: wrong dtype -> TypeError, wrong rank/shape/layout -> ValueError, not a tensor -> TypeError
test_wrong_dtype, test_wrong_rank_or_shape, test_non_contiguous, test_not_a_tensor = validation_tests(
    "engram_grad_w_reduce")


def test_same_buffer_for_both_gradients():
    kwargs = reduce_args()
    kwargs["grad_weight_embed"] = kwargs["grad_weight_hidden"]
    expect(ValueError, ops.engram_grad_w_reduce, kwargs, "engram_grad_w_reduce", "grad_weight_embed")


# --- kernels: lowering, the CUDA schedules ------------------------------------------------------------


test_ascend_lowers_within_ub, test_cuda_compiles_to_sm90a_cubin = lowering_tests("grad_w_reduce")


@pytest.mark.parametrize("partials", [1, 2, 66, 113, 128, 129, 132, 133, 257, 400, 1000])
def test_cuda_grad_w_reduce_chunks_sum_every_row_once_in_order(partials):
    """The TMA chunks of the CUDA weight-gradient reduction (boxes of ``rows`` rows, the last one starting at
    ``P - rows`` and skipping what the one before summed) visit rows 0 .. P-1 exactly once, ascending, with
    every box inside the tensor, at most 128 rows per box, at least two boxes (the sum of one overlaps the
    load of the next) and the buffers in flight within shared memory."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    plan = gwr.chunk_plan(partials)
    chunks, rows, nbuf = plan.chunks, plan.rows, plan.buffers
    assert 1 <= rows <= 128 and 1 <= nbuf <= min(chunks, 3) and chunks >= min(2, partials)
    assert nbuf * rows * 128 * 4 <= 227 * 1024
    order = []
    for c in range(chunks):
        start = min(c * rows, partials - rows)
        assert 0 <= start and start + rows <= partials
        order += [start + i for i in range(rows) if start + i >= c * rows]
    assert order == list(range(partials))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("vector,partials", [(False, p) for p in (1, 2, 7, 133, 400, 1001)]
                         + [(True, p) for p in (1, 2, 5, 7, 64, 65, 66)])
def test_cuda_grad_w_reduce_paths_compile(vector, partials):
    """The reduction's paths the default P does not take compile within the per-CTA limits. TMA: one row (a
    1-D bulk copy), two chunks of one row, a last chunk that skips rows, a refilled buffer, a buffer filled
    three times. Vectors: one row in one group, two groups of one row, a short last group, the most rows."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    built = cuda_build.compile_cubin(gwr.build_engram_grad_w_reduce(512, 4, partials, vector), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits, (built.smem_bytes, built.budget_bytes)


@pytest.mark.parametrize("partials,rows,groups", [(1, 1, 1), (2, 1, 2), (5, 2, 3), (9, 3, 3), (66, 17, 4)])
def test_cuda_grad_w_reduce_vector_waits_for_each_group(partials, rows, groups):
    """The vector schedule commits ``groups`` groups of ``ceil(P / 4)`` row copies, then per summing step
    waits until at most ``groups - 1`` are pending and commits one (empty) group: so step g sums only rows
    whose groups 0 .. g have landed, whatever the number of groups."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    source = cuda_build.lower_source(gwr.build_engram_grad_w_reduce(512, 4, partials, vector=True))
    body = source[source.index("__global__ void __launch_bounds__"):]
    loops = re.findall(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\)", body)  # (variable, trips)
    # the issue loop (g, i) and the summing loop (g_1, i_1); one-trip loops are unrolled away
    assert loops == [(v, str(n)) for v, n in (("g", groups), ("i", rows), ("g_1", groups), ("i_1", rows)) if n > 1]
    assert re.findall(r"cp_async_wait<(\d+)>\(\)", body) == [str(groups - 1)]
    assert body.count("cp_async_commit()") == 2  # one in the issue loop, one (empty) per summing step
    assert body.index("cp_async_wait") < body.index("cp_async_commit", body.index("cp_async_wait"))


def test_cuda_grad_w_reduce_takes_vectors_only_where_aligned():
    """The launcher's key: the vector schedule for P <= 66 when the weights start on 8-byte and the buffers on
    16-byte boundaries; the TMA schedule for more rows or for any one of the four at a smaller offset (a
    main_grad view into a flat bucket); the builder refuses vectors beyond 66 rows."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    hidden = 512
    fresh = {
        "weight_hidden": torch.zeros(4, hidden, dtype=torch.bfloat16),
        "weight_embed": torch.zeros(4, hidden, dtype=torch.bfloat16),
        "grad_weight_hidden": torch.zeros(4, hidden),
        "grad_weight_embed": torch.zeros(4, hidden),
    }

    def key(partials, **tensors):
        args = {**fresh, **tensors}
        return gwr.KERNEL.key(
            torch.zeros(partials, 4, hidden), args["weight_hidden"], args["weight_embed"],
            args["grad_weight_hidden"], args["grad_weight_embed"],
        )

    assert key(66) == gwr.ReduceKey(hidden, 4, 66, True) and key(1) == gwr.ReduceKey(hidden, 4, 1, True)
    assert key(67) == gwr.ReduceKey(hidden, 4, 67, False) and key(132) == gwr.ReduceKey(hidden, 4, 132, False)
    for name, width in gwr.VECTOR_UPDATE_WIDTHS.items():
        t = fresh[name]
        for offset in range(1, width // t.element_size()):
            view = torch.zeros(t.numel() + offset, dtype=t.dtype)[offset:].view(t.shape)
            assert view.data_ptr() % width == offset * t.element_size()
            assert key(66, **{name: view}) == gwr.ReduceKey(hidden, 4, 66, False), (name, offset)
        step = width // t.element_size()
        aligned = torch.zeros(t.numel() + step, dtype=t.dtype)[step:].view(t.shape)
        assert key(66, **{name: aligned}) == gwr.ReduceKey(hidden, 4, 66, True), name
    with pytest.raises(ValueError, match="engram_grad_w_reduce"):
        gwr.build_engram_grad_w_reduce(hidden, 4, 67, vector=True)


# --- device tier --------------------------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("partials", [0, 1, 7, 66, 67, 113, 132, 133, 400, 1001])
def test_grad_w_reduce(hidden, partials, device, seed):
    gen = torch.Generator().manual_seed(seed)
    part = torch.randn(partials, 4, hidden, generator=gen).to(device)
    wh = torch.randn(4, hidden, generator=gen).bfloat16().to(device)
    we = torch.randn(4, hidden, generator=gen).bfloat16().to(device)
    gwh = torch.randn(4, hidden, generator=gen).to(device)
    gwe = torch.randn(4, hidden, generator=gen).to(device)
    r_gwh, r_gwe = gwh.clone(), gwe.clone()
    if partials not in limits.ENGRAM_GRAD_W_PARTIALS.of(part.device.type):
        # beyond the backend's declared rows (476 on Ascend): refused before anything is written
        with pytest.raises(ValueError, match="engram_grad_w_reduce: argument 'grad_w_partial': expected partial rows"):
            ops.engram_grad_w_reduce(part, wh, we, gwh, gwe)
        assert torch.equal(gwh, r_gwh) and torch.equal(gwe, r_gwe)
        return
    engram_grad_w_reduce_ref(part, wh, we, r_gwh, r_gwe)
    ops.engram_grad_w_reduce(part, wh, we, gwh, gwe)
    torch.testing.assert_close(gwh, r_gwh, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gwe, r_gwe, rtol=1e-4, atol=1e-4)


@requires_device
@pytest.mark.parametrize("partials", [1, 2, 3, 5, 65, 66, 67, 133, 1001])
def test_grad_w_reduce_sums_in_ascending_order(partials, device, seed):
    """With unit weights and zero buffers the update is exact, so the result is the fp32 sum itself: bitwise
    the reference's ascending-p sum (docs/ops/engram.md#grad_w_reduce), across commit groups (vector
    schedule, P <= 66), chunk boundaries and reused buffers (TMA)."""
    gen = torch.Generator().manual_seed(seed)
    part = torch.randn(partials, 4, 512, generator=gen).to(device)
    ones = torch.ones(4, 512, dtype=torch.bfloat16, device=device)
    gwh, gwe = torch.zeros(4, 512, device=device), torch.zeros(4, 512, device=device)
    want = torch.zeros(4, 512, device=device)
    from cann_ops_tilelang.kernels.cuda.engram.grad_w_reduce import KERNEL as reduce_kernel

    assert reduce_kernel.key(part, ones, ones, gwh, gwe).vector is (partials <= 66)  # fresh: aligned
    engram_grad_w_reduce_ref(part, ones, ones, want, torch.zeros_like(want))
    ops.engram_grad_w_reduce(part, ones, ones, gwh, gwe)
    assert_equal(gwh, want)
    assert_equal(gwe, want)


@requires_device
@pytest.mark.parametrize("partials", [66, 132])
def test_grad_w_reduce_into_main_grad_views_at_any_offset(partials, device, seed):
    """Megatron-style main_grad buffers are views into one flat fp32 bucket at any element offset: the
    update lands in them (here 4-byte aligned only, the bf16 weights 2-byte) and nowhere else in the bucket."""
    gen = torch.Generator().manual_seed(seed)
    hidden = 512
    part = torch.randn(partials, 4, hidden, generator=gen).to(device)
    wbucket = torch.randn(1 + 8 * hidden, generator=gen).bfloat16().to(device)
    wh, we = wbucket[1 : 1 + 4 * hidden].view(4, hidden), wbucket[1 + 4 * hidden :].view(4, hidden)
    bucket = torch.randn(3 + 8 * hidden + 5, generator=gen).to(device)
    gwh = bucket[3 : 3 + 4 * hidden].view(4, hidden)
    gwe = bucket[3 + 4 * hidden : 3 + 8 * hidden].view(4, hidden)
    want = bucket.clone()
    want_h, want_e = want[3 : 3 + 4 * hidden].view(4, hidden), want[3 + 4 * hidden : 3 + 8 * hidden].view(4, hidden)
    engram_grad_w_reduce_ref(part, wh, we, want_h, want_e)
    ops.engram_grad_w_reduce(part, wh, we, gwh, gwe)
    torch.testing.assert_close(bucket, want, rtol=1e-4, atol=1e-4)
    assert_equal(bucket[:3], want[:3])
    assert_equal(bucket[-5:], want[-5:])


@requires_device
@pytest.mark.parametrize("partials", [1, 7, 66])
def test_grad_w_reduce_schedules_agree_bitwise(partials, device, seed):
    """Up to 66 rows the launcher takes the vector schedule for aligned buffers and TMA for views at odd
    offsets: the same values give bitwise the same update either way (same order, same fused multiply-add)."""
    from cann_ops_tilelang.kernels.cuda.engram.grad_w_reduce import KERNEL as reduce_kernel

    gen = torch.Generator().manual_seed(seed)
    hidden = 1024
    part = torch.randn(partials, 4, hidden, generator=gen).to(device)
    wh, we = (torch.randn(4, hidden, generator=gen).bfloat16().to(device) for _ in range(2))
    gwh, gwe = (torch.randn(4, hidden, generator=gen).to(device) for _ in range(2))

    def at_offset(t, offset):
        view = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)[offset:].view(t.shape)
        return view.copy_(t)

    odd = [at_offset(wh, 1), at_offset(we, 3), at_offset(gwh, 1), at_offset(gwe, 2)]
    assert reduce_kernel.key(part, wh, we, gwh, gwe).vector is True
    assert reduce_kernel.key(part, *odd).vector is False
    want_h, want_e = gwh.clone(), gwe.clone()
    engram_grad_w_reduce_ref(part, wh, we, want_h, want_e)
    ops.engram_grad_w_reduce(part, wh, we, gwh, gwe)
    ops.engram_grad_w_reduce(part, *odd)
    assert_equal(odd[2], gwh)
    assert_equal(odd[3], gwe)
    torch.testing.assert_close(gwh, want_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gwe, want_e, rtol=1e-4, atol=1e-4)
