"""Device tier of the Engram family (CUDA GPU or Ascend NPU; skipped without one): every op against
the fp32 reference with the tolerances and bitwise contracts of docs/ops/engram.md#conventions, opcheck on the device,
torch.compile (inductor and CUDA graphs on CUDA, npugraph_ex on NPU) and the autograd wrapper."""

import pytest
import torch
from _plugins import cases
from _plugins.device import requires_cuda, requires_device, requires_npu
from _plugins.levels import level_choice
from engram_ref import (
    engram_fused_weight_ref,
    engram_gate_backward_ref,
    engram_gate_forward_ref,
    gate_model,
    engram_grad_w_reduce_ref,
    make_inputs,
)

import cann_ops_tilelang as ops
from cann_ops_tilelang import config, limits
from cann_ops_tilelang.modeling import EngramGate, engram_gate

pytestmark = requires_device

EPS, CLAMP = 1e-20, 1e-6
TOKENS = level_choice([1, 509], [0, 1, 509, 512, 8001], [0, 1, 509, 512, 4096, 8001, 16384])
HIDDEN_SIZES = level_choice([512, 4096], [512, 2560, 4096, 7168], [512, 768, 2560, 4096, 5120, 7168, 8192])
# One xdist group per hidden size (`--dist loadgroup`): a worker compiles the kernels of its sizes only.
HIDDEN = [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in HIDDEN_SIZES]
FUSED_SHAPES = [(4, h) for h in HIDDEN_SIZES] + [(1, 256), (0, 512), (8, 768)]


def assert_equal(got, want):
    """dtype, shape, stride and device identical, then the bytes."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert got.device == want.device
    assert torch.equal(got.view(torch.uint8) if got.numel() else got, want.view(torch.uint8) if want.numel() else want)


def inputs(tokens, hidden, masked, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x, kv, wh, we, mask = make_inputs(tokens, hidden, masked=masked, generator=gen)
    return [None if t is None else t.to(device) for t in (x, kv, wh, we, mask)]


# --- engram_fused_weight ----------------------------------------------------------------------------


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


# --- engram_gate_forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_fwd(tokens, hidden, masked, device, seed):
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    x0 = x.clone()
    out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)
    r_out, r_dot, r_g, r_rx, r_rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)
    assert_equal(x, x0)
    torch.testing.assert_close(out, r_out, rtol=8e-3, atol=8e-3)
    text = slice(None) if mask is None else ~mask
    torch.testing.assert_close(dot[text], r_dot[text], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(g[text], r_g[text], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rx[text], r_rx[text])
    torch.testing.assert_close(rk[text], r_rk[text])
    if mask is not None:
        assert_equal(out[mask], x[mask])
        for stat in (dot, g, rx, rk):
            assert torch.equal(stat[mask], torch.zeros_like(stat[mask]))
    # bitwise contracts: no statistics, and in place, give the very same output
    out_nosave, *nones = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, False, mask)
    assert nones == [None] * 4
    assert_equal(out_nosave, out)
    y = x.clone()
    out_inplace, *nones = ops.engram_gate_forward(y, kv, wf, EPS, CLAMP, False, mask, inplace=True)
    assert out_inplace is y and nones == [None] * 4
    assert_equal(y, out)


# --- engram_gate_backward ----------------------------------------------------------------------------------


def check_gate_bwd(tokens, hidden, masked, device, seed, mask=None):
    x, kv, wh, we, drawn = inputs(tokens, hidden, masked, device, seed)
    mask = drawn if mask is None else mask.to(device)
    wf = engram_fused_weight_ref(wh, we)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().to(device)
    _, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)  # statistics from the fp32 reference
    gx, gkv, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
    r_gx, r_gkv, r_part = engram_gate_backward_ref(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, partials=part.shape[0])
    torch.testing.assert_close(gx, r_gx, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(gkv, r_gkv, rtol=7e-3, atol=7e-3)
    gw, r_gw = part.sum(0), r_part.sum(0)
    torch.testing.assert_close(gw * we.float(), r_gw * we.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw * wh.float(), r_gw * wh.float(), rtol=1e-4, atol=2e-4)
    if x.device.type == "cuda":
        # CUDA partition: row p is the sum over worker p's contiguous token range
        torch.testing.assert_close(part, r_part, rtol=1e-4, atol=1e-4)
    if mask is not None:
        assert_equal(gx[mask], go[mask])
        assert torch.equal(gkv[mask], torch.zeros_like(gkv[mask]))
    if tokens == 0:
        assert torch.equal(part, torch.zeros_like(part))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_bwd(tokens, hidden, masked, device, seed):
    check_gate_bwd(tokens, hidden, masked, device, seed)


@requires_cuda
@pytest.mark.parametrize(
    "hidden",
    [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in (4352, 5120, 7424)],
    ids=["tile-in-smem", "cluster-split", "one-warp"],
)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [509, 4001])
def test_gate_bwd_other_schedules(tokens, hidden, masked, device, seed):
    """The CUDA schedules the model sizes above do not reach: the weight-gradient tile in shared memory
    (H = 4352), a second size of the two-CTA column split (H = 5120, P = 66; its token-pipelined kernel at
    T = 509, 8 tokens per worker, the other one at T = 4001, 61 per worker) and the untuned one-warp
    schedule of H / 256 prime (H = 7424: 29 column vectors per thread)."""
    check_gate_bwd(tokens, hidden, masked, device, seed)


@requires_cuda
@pytest.mark.parametrize(
    "hidden", [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in (5120, 7168)]
)
@pytest.mark.parametrize("tokens", [67, 133, 509, 2112])
def test_gate_bwd_image_tokens_at_worker_edges(tokens, hidden, device, seed):
    """Image tokens where the token-pipelined split kernel changes how it loads (CUDA, one worker of
    ``per`` tokens per cluster): in worker w, by w % 5, its first token (go/v and x/k loaded before the
    loop), its second (go/v in its x/k buffer), its third (the first from the prefetched go/v rows), its
    last, or none; at T = 67, 133, 509 and 2112, 2, 3, 8 and 32 tokens per worker at P = 66."""
    per = -(-tokens // config.grad_w_partials("cuda", hidden))
    t = torch.arange(tokens)
    worker, at = t // per, t % per
    edge = torch.tensor([0, 1, 2, per - 1, -1])[worker % 5]
    check_gate_bwd(tokens, hidden, False, device, seed, mask=at == edge)


def test_gate_bwd_is_deterministic(device, seed):
    x, kv, wh, we, mask = inputs(509, 4096, True, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    _, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)
    first = ops.engram_gate_backward(x, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
    for _ in range(3):
        for a, b in zip(ops.engram_gate_backward(x, x, kv, wf, dot, g, rx, rk, CLAMP, mask), first):
            assert_equal(a, b)


# --- engram_grad_w_reduce -----------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", HIDDEN)
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


# --- opcheck on the device ----------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
def test_opcheck_on_device(masked, device, seed):
    """The gate's ops on their example calls (tests/engram/engram_cases.py) at T = 37, H = 512, on the device."""
    gate = dict(masked=masked)
    variants = [("engram_fused_weight", {}), ("engram_gate_forward", {**gate, "save_for_backward": True}),
                ("engram_gate_forward", {**gate, "save_for_backward": False}), ("engram_gate_forward_inplace", gate),
                ("engram_gate_backward", gate), ("engram_grad_w_reduce", {"partials": 7})]
    for name, variant in variants:
        args = cases.call(name, 37, 512, seed=seed, device=device, **variant)
        torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, name).default, tuple(args.values()))


# --- autograd wrapper ---------------------------------------------------------------------------------


# Weight gradients: the wrapper's contract is exact, bf16 of the op chain's fp32 sums (fused weight -> forward ->
# backward -> grad_w_reduce into zeros), each op checked against its reference at the tolerances of §E with shared
# statistics. Against a float64 model they are ill-posed: the signed sqrt's derivative is singular at z = 0, so a
# token with |z| ~ 1e-5 turns the rounding of its dot product into errors of ~1e-3 of the largest gradient, and the
# bf16 rounding of the gradient alone gives calc_diff 1.3e-6 .. 1.8e-6 (the fp32 reference chain on the CPU).


def check_wrapper_vs_model(masked, device, seed, residual):
    """``modeling.engram_gate`` forward and backward (T = 509, H = 4096): output and activation gradients against
    autograd of the gate's fp32 model at the op tolerances, weight gradients bitwise against the op chain (see
    the note above)."""
    tokens, hidden = 509, 4096
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 2)).bfloat16().to(device)
    ours = [t.clone().requires_grad_() for t in (x, kv.view(tokens, -1), wh, we)]
    out = engram_gate(*ours, CLAMP, EPS, mask, residual=residual)
    out.backward(go)
    ref32 = [t.float().clone().requires_grad_() for t in (x, kv, wh, we)]
    ref_out = gate_model(*ref32, EPS, CLAMP, mask, residual=residual)
    ref_out.backward(go.float())
    torch.testing.assert_close(out.float(), ref_out, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(ours[0].grad.float(), ref32[0].grad, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(ours[1].grad.float().view(ref32[1].shape), ref32[1].grad, rtol=8e-3, atol=7e-3)
    wf = ops.engram_fused_weight(wh, we)
    _, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask, residual=residual)
    _, _, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, residual)
    want_h, want_e = torch.zeros_like(wf), torch.zeros_like(wf)
    ops.engram_grad_w_reduce(part, wh, we, want_h, want_e)
    assert_equal(ours[2].grad, want_h.bfloat16())
    assert_equal(ours[3].grad, want_e.bfloat16())


@pytest.mark.parametrize("masked", [False, True])
def test_autograd_wrapper_vs_reference(masked, device, seed):
    check_wrapper_vs_model(masked, device, seed, residual=True)


def test_autograd_wrapper_main_grad(device, seed):
    tokens, hidden = 257, 2560
    x, kv, wh, we, mask = inputs(tokens, hidden, True, device, seed)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 3)).bfloat16().to(device)
    module = EngramGate(hidden, device=device)
    with torch.no_grad():
        module.weight_hidden.copy_(wh)
        module.weight_embed.copy_(we)
    prior = torch.randn(2, 4, hidden, generator=torch.Generator().manual_seed(seed + 4)).to(device)
    module.weight_hidden.main_grad = prior[0].clone()
    module.weight_embed.main_grad = prior[1].clone()
    module(x, kv.view(tokens, -1), mask).backward(go)
    assert module.weight_hidden.grad is None and module.weight_embed.grad is None
    wf = ops.engram_fused_weight(wh, we)
    _, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, 1e-6, 1e-6, True, mask)
    _, _, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, 1e-6, mask)
    want_h, want_e = prior[0].clone(), prior[1].clone()
    ops.engram_grad_w_reduce(part, wh, we, want_h, want_e)
    assert_equal(module.weight_hidden.main_grad, want_h)
    assert_equal(module.weight_embed.main_grad, want_e)


# --- torch.compile ------------------------------------------------------------------------------------


def fused_weight_model(weight_hidden, weight_embed):
    return ops.engram_fused_weight(-weight_hidden, weight_embed) + 1


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


@requires_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_gate_training_step_cuda(mode, device, seed):
    """The gate module compiled (inductor, then CUDA graphs) gives the eager forward and gradients."""
    tokens, hidden = 512, 4096
    x, kv, wh, we, mask = inputs(tokens, hidden, True, device, seed)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 5)).bfloat16().to(device)
    module = EngramGate(hidden, device=device)
    with torch.no_grad():
        module.weight_hidden.copy_(wh)
        module.weight_embed.copy_(we)

    def run(fn):
        module.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        kvg = kv.view(tokens, -1).clone().requires_grad_()
        out = fn(xg, kvg, mask)
        out.backward(go)
        return [out.detach().clone(), xg.grad, kvg.grad, module.weight_hidden.grad.clone(),
                module.weight_embed.grad.clone()]

    want = run(module)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, mode=mode)
    for _ in range(3):  # CUDA graphs record on a later call
        got = run(compiled)
    for a, b in zip(got, want):
        assert_equal(a, b)


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


# --- the gate without its residual (residual=False) ------------------------------------------------------


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_fwd_no_residual(tokens, hidden, masked, device, seed):
    """``residual=False``: the output within the forward's tolerance of ``bf16(g·v)`` of the reference, and
    bitwise ``bf16(gate_score · f32(v))`` of the kernel's own gate (one fp32 product, one rounding); masked
    tokens 0; the statistics byte-equal to the residual forward's; saving or not gives the same output."""
    check_gate_fwd_no_residual(tokens, hidden, masked, device, seed)


@pytest.mark.parametrize("hidden", [2304, 6400])
@pytest.mark.parametrize("masked", [False, True])
def test_gate_fwd_no_residual_guarded_rows(hidden, masked, device, seed):
    """The same at hidden sizes whose last vector slot is guarded (the no-residual build has its own thread
    layout there: two warps per stream)."""
    check_gate_fwd_no_residual(509, hidden, masked, device, seed)


def check_gate_fwd_no_residual(tokens, hidden, masked, device, seed):
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask, residual=False)
    r_out = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask, residual=False)[0]
    torch.testing.assert_close(out, r_out, rtol=8e-3, atol=8e-3)
    for a, b in zip((dot, g, rx, rk), ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)[1:]):
        assert_equal(a, b)
    text = slice(None) if mask is None else ~mask
    own = (g.unsqueeze(-1) * kv[:, -1:].float()).bfloat16()
    assert_equal(out[text], own[text])
    if mask is not None:
        assert_equal(out[mask], torch.zeros_like(out[mask]))
    out_nosave, *nones = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, False, mask, residual=False)
    assert nones == [None] * 4
    assert_equal(out_nosave, out)


def check_gate_bwd_no_residual(tokens, hidden, masked, device, seed):
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().to(device)
    _, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)
    gx, gkv, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, False)
    r_gx = engram_gate_backward_ref(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, False, partials=part.shape[0])[0]
    torch.testing.assert_close(gx, r_gx, rtol=8e-3, atol=7e-3)
    # grad_kv and the partials do not depend on the residual: byte-equal to the residual backward's
    _, gkv_res, part_res = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
    assert_equal(gkv, gkv_res)
    assert_equal(part, part_res)
    if mask is not None:
        assert_equal(gx[mask], torch.zeros_like(gx[mask]))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_bwd_no_residual(tokens, hidden, masked, device, seed):
    check_gate_bwd_no_residual(tokens, hidden, masked, device, seed)


@requires_cuda
@pytest.mark.parametrize("hidden", [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in (4352, 7168)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [509, 4001])
def test_gate_bwd_no_residual_schedules(tokens, hidden, masked, device, seed):
    """The no-residual backward on the tile-in-shared-memory schedule (H = 4352) and on the split schedule,
    token-pipelined (H = 7168, T = 509: 8 tokens per worker) and not (T = 4001)."""
    check_gate_bwd_no_residual(tokens, hidden, masked, device, seed)


@pytest.mark.parametrize("masked", [False, True])
def test_autograd_wrapper_no_residual_vs_reference(masked, device, seed):
    """``modeling.engram_gate(..., residual=False)``: ``g*v`` alone, masked tokens 0."""
    check_wrapper_vs_model(masked, device, seed, residual=False)
