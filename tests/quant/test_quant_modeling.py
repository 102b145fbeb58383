"""``modeling.fp8_linear`` and ``FP8Linear`` (docs/ops/quant.md#fp8_linear): the forward and the backward against the
float64 product of the operands the recipe quantizes (their casts by the references), the distance to the
unquantized linear within the bound the casts' error gives, compile, validation, the module; on a GPU the
``scaled_mm`` GEMM against the same oracle and a small model's loss curve against bf16 (the curve of the docs)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from _plugins.device import requires_cuda
from quant_cases import sample
from quant_ref import data_values, decode_sf, expand, per_block_cast_ref, per_token_cast_ref

import cann_ops_tilelang as ops
from cann_ops_tilelang.modeling import FP8Linear, fp8_linear, fp8_linear_gemm
from cann_ops_tilelang.modeling.fp8_linear import ACTIVATION_LAYOUT, WEIGHT_LAYOUT
from cann_ops_tilelang.quant import ScaleLayout

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def decoded(t, layout):
    """float64 values of ``t (R, C)`` cast to ``layout`` by the reference (per-token or per-block), and the float64
    scale of each element."""
    spec = ScaleLayout.parse(layout)
    cast = per_token_cast_ref if spec.kind == "per_token" else per_block_cast_ref
    data, sf = cast(t.detach().cpu(), layout)[:2]
    rows, cols = t.shape
    scale = expand(decode_sf(sf, spec, rows, cols, "cuda"), spec.block, rows, cols).double()
    return data_values(data, spec.fmt).double() * scale, scale


def oracle(a, b):
    """``a @ b^T`` of the recipe in float64 and the sum of the magnitudes of its products (the accumulation bound)."""
    (av, _), (bv, _) = decoded(a, ACTIVATION_LAYOUT), decoded(b, WEIGHT_LAYOUT)
    return av @ bv.t(), av.abs() @ bv.abs().t()


def assert_within(got, want, magnitude, *, accumulation, what):
    """``|got - want| <= ulp/2 of got's dtype * |want| + accumulation * magnitude`` element-wise."""
    rounding = 2.0**-8 if got.dtype == BF16 else 2.0**-24
    err = (got.cpu().double() - want).abs()
    bound = rounding * want.abs() + accumulation * magnitude
    worst = (err - bound).max().item() if err.numel() else 0.0
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} (max error {err.max().item():.3g})"


def linear_case(tokens, k, n, *, dtype=BF16, seed=0, device="cpu"):
    x = sample(tokens, k, seed=seed, dtype=dtype, spread=1.0).to(device)
    w = (sample(n, k, seed=seed + 1, dtype=F32, spread=0.5) / k**0.5).to(device)
    return x, w.to(dtype)


# --- the recipe against float64 -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_forward_is_the_float64_product_of_the_cast_operands(tokens, dtype, seed):
    x, w = linear_case(tokens, 256, 384, dtype=dtype, seed=seed)
    bias = torch.randn(384, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out = fp8_linear(x, w, bias, gemm="dequant")
    assert out.shape == (tokens, 384) and out.dtype == dtype
    want, magnitude = oracle(x, w)
    # fp32 accumulation over K = 256 products of fp32-decoded operands (below 2**-16 of the magnitudes), the bias
    # added in fp32, one rounding to x's dtype
    assert_within(out, want + bias.double(), magnitude + bias.double().abs(), accumulation=2.0**-16, what="out")


def test_leading_dims_are_tokens(seed):
    x, w = linear_case(6, 128, 128, seed=seed)
    out = fp8_linear(x.view(2, 3, 128), w)
    assert out.shape == (2, 3, 128) and torch.equal(out.view(6, 128), fp8_linear(x, w))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_backward_is_the_recipe(dtype, seed):
    x, w = linear_case(33, 256, 128, dtype=dtype, seed=seed)
    bias = torch.zeros(128, dtype=dtype, requires_grad=True)
    x.requires_grad_(True)
    w.requires_grad_(True)
    grad_out = sample(33, 128, seed=seed + 7, dtype=dtype, spread=1.0)
    fp8_linear(x, w, bias, gemm="dequant").backward(grad_out)
    assert x.grad.dtype == w.grad.dtype == bias.grad.dtype == dtype
    # grad_x: grad_out cast per 1x128 group along N, times the FP8 weight (its 128x128 blocks, transposed)
    gv, _ = decoded(grad_out, ACTIVATION_LAYOUT)
    wv, _ = decoded(w.detach(), WEIGHT_LAYOUT)
    assert_within(x.grad, gv @ wv, gv.abs() @ wv.abs(), accumulation=2.0**-16 + (2.0**-8 if dtype == BF16 else 0),
                  what="grad_x")
    # grad_weight and grad_bias are not quantized
    g64, x64 = grad_out.double(), x.detach().double()
    assert_within(w.grad, g64.t() @ x64, g64.abs().t() @ x64.abs(), accumulation=2.0**-8 if dtype == BF16 else 2**-18,
                  what="grad_weight")
    assert_within(bias.grad, g64.sum(0), g64.abs().sum(0), accumulation=2.0**-20, what="grad_bias")


def test_distance_to_the_unquantized_linear_is_the_casts_error(seed):
    """Each operand element is within ``2^-4 |v| + 2^-10 s`` of its cast (docs/ops/quant.md#layout), so the product
    is within ``sum_k e_x |w'| + |x| e_w`` of the unquantized one (plus the fp32 accumulation)."""
    x, w = linear_case(64, 512, 256, dtype=F32, seed=seed)
    out = fp8_linear(x, w, gemm="dequant")
    (xv, xs), (wv, ws) = decoded(x, ACTIVATION_LAYOUT), decoded(w, WEIGHT_LAYOUT)
    x64, w64 = x.double(), w.double()
    ex, ew = 2.0**-4 * x64.abs() + 2.0**-10 * xs, 2.0**-4 * w64.abs() + 2.0**-10 * ws
    assert ((xv - x64).abs() <= ex).all() and ((wv - w64).abs() <= ew).all()
    bound = ex @ wv.abs().t() + x64.abs() @ ew.t() + 2.0**-15 * (xv.abs() @ wv.abs().t())
    assert ((out.double() - x64 @ w64.t()).abs() <= bound).all()
    # and the bound is not vacuous: the FP8 error is visible and well below the output's scale
    rel = (out.double() - x64 @ w64.t()).norm() / (x64 @ w64.t()).norm()
    assert 2.0**-12 < rel < 2.0**-4


def test_compile_fullgraph_forward_and_backward_bitwise(seed):
    """The forward traced whole (one graph, its backward compiled by AOT autograd), bitwise eager, over T dynamic."""
    torch._dynamo.reset()
    compiled = torch.compile(fp8_linear, backend="aot_eager", fullgraph=True, dynamic=True)
    first = True
    for tokens in (5, 9, 130):
        args = [t.requires_grad_(True) for t in (*linear_case(tokens, 128, 256, seed=seed + tokens),
                                                 torch.zeros(256, dtype=BF16))]
        eager = [t.detach().clone().requires_grad_(True) for t in args]
        with torch._dynamo.config.patch(error_on_recompile=not first):
            got = compiled(*args)
        first = False
        want = fp8_linear(*eager)
        assert torch.equal(got, want)
        got.float().square().sum().backward()
        want.float().square().sum().backward()
        for a, e in zip(args, eager):
            assert torch.equal(a.grad, e.grad)


# --- validation and the module --------------------------------------------------------------------------------


@pytest.mark.parametrize("change,error,message", [
    (dict(x=torch.zeros(4, 128, dtype=torch.float16)), TypeError, r"'x': expected dtype torch.bfloat16 or"),
    (dict(x=torch.zeros(4, 192, dtype=BF16)), ValueError, r"'weight': expected shape \(N, K\) with K = "),
    (dict(x=torch.zeros(4, 192, dtype=BF16), weight=torch.zeros(128, 192)), ValueError, r"'x': expected a hidden "),
    (dict(weight=torch.zeros(100, 128)), ValueError, r"'weight': expected N \(out features\) a positive multiple"),
    (dict(weight=torch.zeros(128, 128, dtype=torch.int8)), TypeError, r"'weight': expected dtype"),
    (dict(bias=torch.zeros(127)), ValueError, r"'bias': expected shape \(128,\)"),
    (dict(bias=3.0), TypeError, r"'bias': expected a torch.Tensor or None, got float"),
    (dict(gemm="cublas"), ValueError, r"'gemm': expected one of \('auto', 'scaled_mm', 'dequant'\), got 'cublas'"),
])
def test_validation_names_the_argument(change, error, message):
    call = dict(x=torch.zeros(4, 128, dtype=BF16), weight=torch.zeros(128, 128), bias=None, gemm="auto")
    call.update(change)
    with pytest.raises(error, match=rf"cann_ops_tilelang::modeling.fp8_linear: argument {message}"):
        fp8_linear(call.pop("x"), call.pop("weight"), call.pop("bias"), **call)


def test_fp8_linear_module_is_nn_linear(seed):
    torch.manual_seed(seed)
    layer = FP8Linear(256, 128, dtype=BF16)
    plain = torch.nn.Linear(256, 128, dtype=BF16)
    assert layer.state_dict().keys() == plain.state_dict().keys() and "gemm='auto'" in repr(layer)
    layer.load_state_dict(plain.state_dict())
    x = sample(9, 256, seed=seed)
    assert torch.equal(layer(x), fp8_linear(x, plain.weight, plain.bias))
    for kwargs, message in ((dict(in_features=100, out_features=128), "'in_features': expected a positive multiple"),
                            (dict(in_features=128, out_features=0), "'out_features'"),
                            (dict(in_features=128, out_features=128, gemm="x"), "'gemm'")):
        with pytest.raises(ValueError, match=f"modeling.FP8Linear: argument {message}"):
            FP8Linear(**kwargs)
    assert fp8_linear_gemm("cpu") == "dequant"


# --- training: a small model against its bf16 twin ---------------------------------------------------------------


def train_curves(steps, *, device, width=256, tokens=256, seed=0):
    """Losses of a 3-layer MLP regressing a fixed random teacher, with ``FP8Linear`` and with ``nn.Linear`` (bf16
    activations, fp32 master weights, Adam), from the same initialization and the same batches."""
    gen = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(width, width, generator=gen) / width**0.5 for _ in range(2)]
    curves = {}
    for name, linear in (("bf16", torch.nn.Linear), ("fp8", FP8Linear)):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(linear(width, 2 * width), torch.nn.GELU(), linear(2 * width, 2 * width),
                                    torch.nn.GELU(), linear(2 * width, width)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        batches = torch.Generator().manual_seed(seed + 1)
        losses = []
        for _ in range(steps):
            x = torch.randn(tokens, width, generator=batches)
            y = torch.tanh(x @ teacher[0]) @ teacher[1]
            with torch.autocast(device_type=torch.device(device).type, dtype=BF16):
                pred = model(x.to(device).to(BF16))
            loss = F.mse_loss(pred.float(), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[name] = losses
    return curves


# the stated distance: the FP8 model's loss within 10 % of the bf16 model's, step by step (means over windows of 10
# steps); measured on the CPU (reference kernels) at width 256 over 300 steps: at most 4.2 %
CURVE_TOLERANCE = 0.10


def assert_curves_track(curves):
    bf16, fp8 = (torch.tensor(curves[k]).unfold(0, 10, 10).mean(1) for k in ("bf16", "fp8"))
    assert bf16[-1] < 0.5 * bf16[0], "the bf16 model does not learn: the comparison would be vacuous"
    rel = (fp8 - bf16).abs() / bf16
    assert rel.max() <= CURVE_TOLERANCE, rel


def test_small_model_trains_like_bf16():
    assert_curves_track(train_curves(60, device="cpu", width=128, tokens=128))


# --- device -------------------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("gemm", ["dequant", "scaled_mm"])
def test_device_forward_and_backward_against_float64(gemm, seed):
    if gemm == "scaled_mm" and fp8_linear_gemm("cuda") != "scaled_mm":
        pytest.skip("this PyTorch or GPU has no block-scaled F.scaled_mm")
    for tokens, k, n in ((1, 128, 128), (257, 512, 384), (1000, 7168, 256)):
        x, w = linear_case(tokens, k, n, seed=seed + tokens, device="cuda")
        x.requires_grad_(True)
        out = fp8_linear(x, w, gemm=gemm)
        grad_out = sample(tokens, n, seed=seed + 3, spread=1.0).cuda()
        out.backward(grad_out)
        want, magnitude = oracle(x.detach(), w)
        # the FP8 tensor cores accumulate with fewer bits than fp32 between cuBLAS's promotions
        accumulation = 2.0**-8 + (2.0**-13 if gemm == "scaled_mm" else 2.0**-16)
        assert_within(out, want, magnitude, accumulation=accumulation, what=f"out {gemm} {tokens}x{k}x{n}")
        gv, _ = decoded(grad_out, ACTIVATION_LAYOUT)
        wv, _ = decoded(w, WEIGHT_LAYOUT)
        assert_within(x.grad, gv @ wv, gv.abs() @ wv.abs(), accumulation=accumulation, what="grad_x")


@requires_cuda
@pytest.mark.device
def test_device_small_model_trains_like_bf16():
    """300 steps at width 512 (the curve of docs/perf/fp8_linear_training.md; OPS_TILELANG_CURVE_OUT=<path> writes
    it as JSON)."""
    curves = train_curves(300, device="cuda", width=512, tokens=1024)
    if os.environ.get("OPS_TILELANG_CURVE_OUT"):
        with open(os.environ["OPS_TILELANG_CURVE_OUT"], "w") as f:
            json.dump({"gemm": fp8_linear_gemm("cuda"), "device": torch.cuda.get_device_name(), **curves}, f)
    assert_curves_track(curves)


def test_the_package_exports_the_module():
    assert ops.modeling.FP8Linear is FP8Linear and ops.modeling.fp8_linear is fp8_linear
