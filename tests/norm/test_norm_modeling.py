"""The norm family's autograd modules (docs/ops/norm.md#modeling): ``RMSNorm``, ``LayerNorm``, ``add_rms_norm`` and
``SwiGLU`` against PyTorch's modules in float64 (forward and every gradient), drop-in state dicts, ``main_grad``,
compile without recompiles over T, and a small model trained with them against the same model with
``torch.nn.RMSNorm`` and a PyTorch SwiGLU (the curve of docs/perf/norm_training.md). On the CPU the ops run the test
references; on a GPU the kernels."""

import json
import os

import pytest
import torch
from _plugins.device import requires_cuda

import cann_ops_tilelang as ops
from cann_ops_tilelang._demo import SmallModel, train
from cann_ops_tilelang.modeling import LayerNorm, RMSNorm, SwiGLU, add_rms_norm, layer_norm, rms_norm, swiglu

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def randn(*shape, seed, dtype=BF16, device="cpu", scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def within(got, want, *, rel):
    """``|got - want| <= rel * (|want| + max|want| / 64)``: relative to each value, with a floor near zero."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bound = rel * (want.abs() + want.abs().max() / 64)
    worst = (got - want).abs() - bound
    assert worst.max().item() <= 0, f"error exceeds the bound by {worst.max().item():.3g}"


def float64_grads(fn, tensors, grad_out):
    """The outputs of ``fn`` on float64 copies of ``tensors`` and the gradients of ``<outputs, grad_out>``."""
    leaves = [None if t is None else t.detach().double().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [g.double() for g in grad_out])
    return outs, [None if t is None else t.grad for t in leaves]


# bf16: one rounding of each result (2^-8) and fp32 sums of H terms; fp32 inputs: fp32 arithmetic
TOLERANCE = {BF16: 2.0**-7, F32: 2.0**-18}


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(dtype, with_residual, seed):
    x, res = randn(3, 5, 256, seed=seed, dtype=dtype), randn(3, 5, 256, seed=seed + 1, dtype=dtype)
    w = randn(256, seed=seed + 2, dtype=dtype, scale=0.5) + 1
    g = [randn(3, 5, 256, seed=seed + 3, dtype=dtype)] + ([randn(3, 5, 256, seed=seed + 4, dtype=dtype)]
                                                           if with_residual else [])
    leaves = [t.clone().requires_grad_(True) for t in (x, res, w)]
    out = rms_norm(leaves[0], leaves[2], 1e-6, residual=leaves[1] if with_residual else None)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, g)

    def model(x, res, w):
        r = x + res if with_residual else x
        y = r * torch.rsqrt(r.square().mean(-1, keepdim=True) + 1e-6) * w
        return (y, r) if with_residual else y

    # the sum x + residual is rounded to x's dtype before the norm (docs): the oracle starts from that sum
    r = (x + res).to(dtype) if with_residual else x
    want, grads = float64_grads(lambda r_, w_: model(r_, torch.zeros_like(r_), w_) if with_residual
                                else model(r_, None, w_), (r, w), g)
    within(outs[0], want[0], rel=TOLERANCE[dtype])
    if with_residual:
        assert torch.equal(outs[1], r)
    within(leaves[0].grad, grads[0], rel=TOLERANCE[dtype])
    if with_residual:
        assert torch.equal(leaves[1].grad, leaves[0].grad)
    within(leaves[2].grad, grads[1], rel=TOLERANCE[dtype])


def test_rms_norm_module_is_a_drop_in(seed):
    theirs = torch.nn.RMSNorm(128, dtype=BF16)
    ours = RMSNorm(128, dtype=BF16)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = randn(7, 128, seed=seed)
    want = torch.nn.functional.rms_norm(x.double(), (128,), theirs.weight.double(), torch.finfo(BF16).eps)
    within(ours(x), want, rel=TOLERANCE[BF16])
    assert RMSNorm(128, elementwise_affine=False).weight is None
    with pytest.raises(ValueError, match="modeling.RMSNorm.*normalized_shape"):
        RMSNorm((4, 128))


def test_add_rms_norm_returns_the_norm_and_the_sum(seed):
    x, res, w = randn(9, 64, seed=seed), randn(9, 64, seed=seed + 1), randn(64, seed=seed + 2)
    y, total = add_rms_norm(x, res, w)
    assert torch.equal(total, (x + res).to(BF16))
    assert torch.equal(y, rms_norm(total, w))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_layer_norm_matches_float64(dtype, seed):
    x = randn(4, 3, 192, seed=seed, dtype=dtype, scale=2.0) + 3  # a large mean: the variance must not cancel
    w, b = randn(192, seed=seed + 1, dtype=dtype), randn(192, seed=seed + 2, dtype=dtype)
    g = randn(4, 3, 192, seed=seed + 3, dtype=dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    layer_norm(*leaves, 1e-5).backward(g)
    want, grads = float64_grads(lambda *t: torch.nn.functional.layer_norm(t[0], (192,), t[1], t[2], 1e-5),
                                (x, w, b), [g])
    within(leaves[0].grad, grads[0], rel=TOLERANCE[dtype])
    within(layer_norm(x, w, b, 1e-5), want[0], rel=TOLERANCE[dtype])
    for got, want_grad in zip((leaves[1].grad, leaves[2].grad), grads[1:]):
        within(got, want_grad, rel=TOLERANCE[dtype])


def test_layer_norm_module_is_a_drop_in(seed):
    theirs = torch.nn.LayerNorm(128, dtype=F32)
    ours = LayerNorm(128, dtype=F32)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = randn(5, 128, seed=seed, dtype=F32)
    want = torch.nn.functional.layer_norm(x.double(), (128,), theirs.weight.double(), theirs.bias.double())
    within(ours(x), want, rel=TOLERANCE[F32])
    assert LayerNorm(128, bias=False).bias is None


@pytest.mark.parametrize("routed", [False, True])
def test_swiglu_matches_float64(routed, seed):
    x, g = randn(6, 2 * 128, seed=seed, scale=2.0), randn(6, 128, seed=seed + 1)
    rw = randn(6, seed=seed + 2, dtype=F32).abs() if routed else None
    leaves = [x.clone().requires_grad_(True), None if rw is None else rw.clone().requires_grad_(True)]
    swiglu(leaves[0], leaves[1], 2.5 if routed else 1.0).backward(g)

    def model(x, rw):
        gate, up = x.chunk(2, -1)
        y = torch.nn.functional.silu(gate) * up
        return y * (rw[:, None] * 2.5) if rw is not None else y

    want, grads = float64_grads(model, (x, rw), [g])
    within(swiglu(x, rw, 2.5 if routed else 1.0), want[0], rel=TOLERANCE[BF16])
    within(leaves[0].grad, grads[0], rel=TOLERANCE[BF16])
    if routed:
        within(leaves[1].grad, grads[1], rel=2.0**-16)


def test_swiglu_clamp_stops_gradients(seed):
    x = randn(4, 128, seed=seed, scale=8.0).requires_grad_(True)
    SwiGLU(clamp=3.0)(x).sum().backward()
    gate, up = x.detach().float().chunk(2, -1)
    grad_gate, grad_up = x.grad.float().chunk(2, -1)
    assert torch.all(grad_gate[gate > 3.0] == 0) and torch.all(grad_up[up.abs() > 3.0] == 0)


def test_main_grad_takes_the_weight_gradient(seed):
    norm = RMSNorm(64, dtype=BF16)
    norm.weight.main_grad = torch.zeros(64)
    x = randn(5, 64, seed=seed)
    for _ in range(2):  # accumulated: the buffer holds twice the fp32 sum (doubling is exact)
        norm(x).sum().backward()
    reference = RMSNorm(64, dtype=BF16)
    reference(x).sum().backward()
    assert norm.weight.grad is None
    # .grad is the fp32 sum rounded to the weight's bf16
    assert torch.equal((norm.weight.main_grad / 2).to(BF16), reference.weight.grad)


def test_compiles_without_graph_break_or_recompile(seed):
    torch._dynamo.reset()
    norm, act = RMSNorm(128, dtype=BF16), SwiGLU()

    def step(x, res):
        y, total = norm(x, res)
        return act(torch.cat([y, y], -1)), total

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, tokens in enumerate((3, 17, 64)):
        x, res = randn(tokens, 128, seed=seed + i), randn(tokens, 128, seed=seed + 7)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(x, res)
        want = step(x, res)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_package_exports_the_modules():
    assert ops.modeling.RMSNorm is RMSNorm and ops.modeling.SwiGLU is SwiGLU


# --- the small model's loss curve ------------------------------------------------------------------------------

# the stated distance: with our RMSNorm and SwiGLU the loss stays within 5 % of the model built with
# torch.nn.RMSNorm and a PyTorch SwiGLU, step by step (means over windows of 10 steps)
CURVE_TOLERANCE = 0.05


def train_curves(steps, *, device, tokens, hidden=512):
    curves = {}
    for norms in ("torch", "ours"):
        torch.manual_seed(0)
        model = SmallModel(hidden=hidden, device=device, norms=norms)
        curves[norms], _ = train(model, steps, tokens, device,
                                 synchronize=torch.cuda.synchronize if device == "cuda" else lambda: None)
    return curves


def assert_curves_track(curves):
    theirs, ours = (torch.tensor(curves[k]).unfold(0, 10, 10).mean(1) for k in ("torch", "ours"))
    assert theirs[-1] < 0.5 * theirs[0], "the torch model does not learn: the comparison would be vacuous"
    rel = (ours - theirs).abs() / theirs
    assert rel.max() <= CURVE_TOLERANCE, rel


def test_small_model_trains_like_torch_norms():
    assert_curves_track(train_curves(40, device="cpu", tokens=64))


@requires_cuda
@pytest.mark.device
def test_device_small_model_trains_like_torch_norms():
    """300 steps at width 512 (the curve of docs/perf/norm_training.md; OPS_TILELANG_NORM_CURVE_OUT=<path> writes
    it as JSON)."""
    curves = train_curves(300, device="cuda", tokens=1024)
    if os.environ.get("OPS_TILELANG_NORM_CURVE_OUT"):
        with open(os.environ["OPS_TILELANG_NORM_CURVE_OUT"], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), **curves}, f)
    assert_curves_track(curves)
