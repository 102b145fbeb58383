"""CPU tier of the Engram family: fakes, opcheck, torch.compile traces, the references' backward
against float64 autograd, and the autograd wrapper over the CPU reference kernels."""

import pytest
import torch
from _plugins import cases
from _plugins.levels import level_choice
from engram_ref import (
    engram_fused_weight_ref,
    engram_gate_backward_ref,
    engram_gate_forward_ref,
    gate_model,
    engram_grad_w_reduce_ref,
    make_inputs,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import cann_ops_tilelang as ops
from cann_ops_tilelang import config
from cann_ops_tilelang.modeling import EngramGate, engram_gate

EPS, CLAMP = 1e-20, 1e-6
TOKENS = level_choice([0, 1, 7], [0, 1, 7, 33], [0, 1, 7, 33, 130])
HIDDEN = 512


def gen(seed):
    return torch.Generator().manual_seed(seed)


def all_args(tokens, masked, seed):
    x, kv, wh, we, mask = make_inputs(tokens, HIDDEN, masked=masked, generator=gen(seed))
    wf = engram_fused_weight_ref(wh, we)
    return x, kv, wh, we, wf, mask


def metadata(t):
    return (t.shape, t.dtype, t.stride(), t.device.type)


# --- fakes ----------------------------------------------------------------------------------------


def gate_calls(tokens, masked, seed):
    """The example calls (tests/engram/engram_cases.py) of the gate's ops: the fused weight, the forward saving the
    statistics or not, in place, the backward (given the reference forward's statistics), the weight reduction."""
    gate = dict(masked=masked)
    variants = [("engram_fused_weight", {}), ("engram_gate_forward", {**gate, "save_for_backward": True}),
                ("engram_gate_forward", {**gate, "save_for_backward": False}), ("engram_gate_forward_inplace", gate),
                ("engram_gate_backward", gate), ("engram_grad_w_reduce", {})]
    return [(name, cases.call(name, tokens, HIDDEN, seed=seed, **variant)) for name, variant in variants]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("save", [False, True])
def test_fakes_match_references(tokens, masked, save, seed):
    """The fakes on the example calls against the reference functions' own results."""
    fused = cases.call("engram_fused_weight", tokens, HIDDEN, seed=seed)
    fwd = cases.call("engram_gate_forward", tokens, HIDDEN, seed=seed, masked=masked, save_for_backward=save)
    bwd = cases.call("engram_gate_backward", tokens, HIDDEN, seed=seed, masked=masked)
    partials = config.grad_w_partials("cpu", HIDDEN)
    real = {
        "fused": [engram_fused_weight_ref(**fused)],
        "fwd": list(engram_gate_forward_ref(**fwd)),
        "bwd": list(engram_gate_backward_ref(**bwd, partials=partials)),
    }
    mode = FakeTensorMode()

    def faked(call):
        return {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in call.items()}

    with mode:
        fake = {
            "fused": [ops.engram_fused_weight(**faked(fused))],
            "fwd": list(torch.ops.cann_ops_tilelang.engram_gate_forward(**faked(fwd))),
            "bwd": list(ops.engram_gate_backward(**faked(bwd))),
        }
    for key in real:
        assert [metadata(t) for t in fake[key]] == [metadata(t) for t in real[key]], key


# --- opcheck --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(tokens, masked, seed):
    for name, call in gate_calls(tokens, masked, seed):
        torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, name).default, tuple(call.values()))


# --- torch.compile traces through the fakes --------------------------------------------------------


def gate_model_compiled(x, kv, wf, mask):
    out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)
    return out.float() * 2, dot + g, rx * rk


def test_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(gate_model_compiled, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (7, 9, 17):  # (not 4, 5: duck sizing would tie T to m or m + 1)
            x, kv, wh, we, wf, mask = all_args(tokens, True, seed + tokens)
            got = compiled(x, kv, wf, mask)
            want = gate_model_compiled(x, kv, wf, mask)
            for a, b in zip(got, want):
                assert torch.equal(a, b)


def fused_weight_model(weight_hidden, weight_embed):
    return ops.engram_fused_weight(-weight_hidden, weight_embed) + 1


def test_compile_fused_weight_fixed_shape(seed):
    torch._dynamo.reset()
    compiled = torch.compile(fused_weight_model, backend="aot_eager", fullgraph=True, dynamic=False)
    a = torch.randn(4, 4096, generator=gen(seed)).bfloat16()
    b = torch.randn(4, 4096, generator=gen(seed + 1)).bfloat16()
    with torch.inference_mode():
        got = compiled(a, b)
    assert torch.equal(got, (-a).float() * b.float() + 1)


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


def test_compile_inplace_and_bwd_graphs(seed):
    def step(x, kv, wf, mask):
        out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)
        gx, gkv, part = ops.engram_gate_backward(out, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
        gwh = torch.zeros_like(wf)
        gwe = torch.zeros_like(wf)
        ops.engram_grad_w_reduce(part, x[0], x[1], gwh, gwe)
        y = x.clone()
        ops.engram_gate_forward(y, kv, wf, EPS, CLAMP, False, mask, inplace=True)
        return gx, gkv, gwh, gwe, y

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (6, 11):
            x, kv, wh, we, wf, mask = all_args(tokens, True, seed + tokens)
            for a, b in zip(compiled(x, kv, wf, mask), step(x, kv, wf, mask)):
                assert torch.equal(a, b)


# --- references: backward vs float64 autograd ------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [1, 13])
def test_reference_backward_vs_float64_autograd(tokens, masked, seed):
    x, kv, wh, we, _, mask = all_args(tokens, masked, seed)
    d = torch.float64
    eps, clamp = 1e-6, 1e-6
    x64, kv64, wh64, we64 = (t.to(d).requires_grad_() for t in (x, kv, wh, we))
    out = gate_model(x64, kv64, wh64, we64, eps, clamp, mask)
    go = torch.randn(out.shape, generator=gen(seed + 1), dtype=d)
    out.backward(go)
    # closed-form backward in float64 from float64 statistics
    with torch.no_grad():
        m = x.shape[1]
        xd, kd = x64.detach(), kv64.detach()
        wf = wh64.detach() * we64.detach()
        raw = (xd * wf * kd[:, :m]).sum(-1)
        rx = torch.rsqrt(xd.square().mean(-1) + eps)
        rk = torch.rsqrt(kd[:, :m].square().mean(-1) + eps)
        z = raw * rx * rk / x.shape[-1] ** 0.5
        g = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp_min(z.abs(), clamp)), z))
        gx, gkv, part = engram_gate_backward_ref(go, xd, kd, wf, raw, g, rx, rk, clamp, mask, partials=3)
        gwh = torch.zeros_like(wf)
        gwe = torch.zeros_like(wf)
        gw = part.sum(0)
        gwh += gw * we64.detach()
        gwe += gw * wh64.detach()
    for name, got, want in (("x", gx, x64.grad), ("kv", gkv, kv64.grad), ("wh", gwh, wh64.grad),
                            ("we", gwe, we64.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)


# --- the autograd wrapper over the CPU reference kernels ---------------------------------------------


def wrapper_vs_reference(tokens, masked, seed, lead=None):
    x, kv, wh, we, _, mask = all_args(tokens, masked, seed)
    eps, clamp = 1e-6, 1e-6
    go = torch.randn(x.shape, generator=gen(seed + 2)).bfloat16()
    shape_x = x.shape if lead is None else (*lead, *x.shape[1:])
    ours = [t.clone().requires_grad_() for t in (x.view(shape_x), kv.view(*shape_x[:-2], -1), wh, we)]
    m_arg = None if mask is None else mask.view(shape_x[:-2])
    out = engram_gate(*ours, clamp, eps, m_arg)
    out.backward(go.view(shape_x))
    ref = [t.float().clone().requires_grad_() for t in (x, kv, wh, we)]
    ref_out = gate_model(*ref, eps, clamp, mask)
    ref_out.backward(go.float())
    return out.view(x.shape), ours, ref_out, ref


@pytest.mark.parametrize("masked", [False, True])
def test_autograd_wrapper_vs_reference_autograd(masked, seed):
    out, ours, ref_out, ref = wrapper_vs_reference(64, masked, seed, lead=(8, 8))
    torch.testing.assert_close(out.float(), ref_out, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(ours[0].grad.float().view(ref[0].shape), ref[0].grad, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(ours[1].grad.float().view(ref[1].shape), ref[1].grad, rtol=8e-3, atol=7e-3)
    # bf16 parameter gradients: compare at bf16 resolution
    torch.testing.assert_close(ours[2].grad.float(), ref[2].grad, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(ours[3].grad.float(), ref[3].grad, rtol=1.6e-2, atol=1e-3)
    assert ours[2].grad.dtype == torch.bfloat16


def test_autograd_wrapper_main_grad(seed):
    x, kv, wh, we, _, mask = all_args(16, True, seed)
    go = torch.randn(x.shape, generator=gen(seed + 3)).bfloat16()
    module = EngramGate(HIDDEN)
    with torch.no_grad():
        module.weight_hidden.copy_(wh)
        module.weight_embed.copy_(we)
    prior_h = torch.randn(4, HIDDEN, generator=gen(seed + 4))
    prior_e = torch.randn(4, HIDDEN, generator=gen(seed + 5))
    module.weight_hidden.main_grad = prior_h.clone()
    module.weight_embed.main_grad = prior_e.clone()
    module(x, kv.view(16, -1), mask).backward(go)
    assert module.weight_hidden.grad is None and module.weight_embed.grad is None
    # the expected increment: the reference partials reduced in order, as grad_w_reduce does
    out, dot, g, rx, rk = engram_gate_forward_ref(x, kv, engram_fused_weight_ref(wh, we), 1e-6, 1e-6, True, mask)
    _, _, part = engram_gate_backward_ref(go, x, kv, engram_fused_weight_ref(wh, we), dot, g, rx, rk, 1e-6, mask,
                              partials=config.grad_w_partials("cpu", HIDDEN))
    want_h, want_e = prior_h.clone(), prior_e.clone()
    engram_grad_w_reduce_ref(part, wh, we, want_h, want_e)
    assert torch.equal(module.weight_hidden.main_grad, want_h)
    assert torch.equal(module.weight_embed.main_grad, want_e)


def test_autograd_wrapper_compiled(seed):
    module = EngramGate(HIDDEN)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)

    def grads(fn, x, kv, mask):
        x = x.clone().requires_grad_()
        module.zero_grad()
        fn(x, kv, mask).float().square().sum().backward()
        return [x.grad, module.weight_hidden.grad.clone(), module.weight_embed.grad.clone()]

    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (8, 12):
            x, kv, wh, we, _, mask = all_args(tokens, True, seed + tokens)
            kv = kv.view(tokens, -1)
            for a, b in zip(grads(compiled, x, kv, mask), grads(module, x, kv, mask)):
                assert torch.equal(a, b)
