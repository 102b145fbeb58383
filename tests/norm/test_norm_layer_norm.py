"""``layer_norm_forward`` / ``layer_norm_backward`` (docs/ops/norm.md#layer_norm): the reference against the float64
oracle (``torch.nn.functional.layer_norm`` and its autograd gradients) at the contract's tolerances, the fused
cast as the quant reference of ``y``, zero tokens, leading dims, strided rows, validation (CPU tier, the reference
as the CPU kernel); the CUDA kernels lowered to sm_90a cubins and the Ascend 950 kernels to AscendC within the UB
budget at the sizes that matter, the launchers' views and keys (CPU tier); and on a GPU the kernels against the
float64 oracle, the cast's bytes against the quant reference of the kernel's own ``y`` and the weight gradients
bitwise run to run. The peer (DeepSeek's tile_kernels) has no LayerNorm: no comparison with it."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from norm_cases import (LAYER_NORM_EPS, layer_norm_backward_call, layer_norm_forward_call, layer_norm_param,
                        layer_norm_rows)
from norm_ref import (layer_norm_backward_f64, layer_norm_backward_ref, layer_norm_forward_f64,
                      layer_norm_forward_ref, layer_norm_residual, quant_reference)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits, policy
from cann_ops_tilelang.limits import LimitError

BF16, F32 = torch.bfloat16, torch.float32
HAVE_NVCC = shutil.which("nvcc") is not None
LAYOUTS = ["1x64/e4m3/ue8m0/col_tma/round", "1x128/e4m3/fp32/row/exact", "1x32/e2m1/ue8m0/row/round",
           "1x16/e2m1/e4m3/col_tma/exact", "1x128/e4m3/ue8m0/row/round"]


# --- tolerances (docs/ops/norm.md#layer_norm) --------------------------------------------------------------------

def y_tolerance(dtype) -> float:
    return 2.0**-7 if dtype == BF16 else 1e-5


# the fp32 mean of a row is within 16 fp32 ulps of |mean| (sums of at most a few dozen terms per thread or lane,
# then trees): y carries that error times rstd (times |w|)
MEAN_ERROR = 2.0**-20


def grad_tolerance(dtype) -> float:
    return 2.0**-7 if dtype == BF16 else 1e-4


def bits(t):
    """The values of ``t`` as comparable bits (fp8 through bytes, any strides)."""
    t = t.cpu().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_close_rel(got, want, tol, what):
    """``|got - want| <= tol * max(1, |want|)`` elementwise (``want`` float64)."""
    got, want = got.double().cpu(), want.double().cpu()
    if want.numel():
        err = (got - want).abs() / want.abs().clamp_min(1.0)
        assert err.max().item() <= tol, (what, err.max().item(), tol)


def assert_close_scaled(got, want, tol, scale, what):
    """``|got - want| <= tol * scale`` (``scale`` a tensor broadcasting to ``want``, or a number)."""
    got, want = got.double().cpu(), want.double().cpu()
    if not want.numel():
        return
    bound = tol * (scale if isinstance(scale, float) else scale.double().cpu())
    excess = ((got - want).abs() - bound).max().item()
    assert excess <= 0, (what, excess)


def check_forward(out, call, what=""):
    """The forward's outputs against the float64 oracle and the contract's shapes, cast bytes and empties."""
    x = call["x"].cpu()
    args = dict(weight=None if call["weight"] is None else call["weight"].cpu(),
                bias=None if call["bias"] is None else call["bias"].cpu(), eps=call["eps"])
    residual = None if call["residual"] is None else call["residual"].cpu()
    y64, mean64, rstd64 = layer_norm_forward_f64(x, residual=residual, **args)
    y, mean, rstd, residual_out, data, sf = out
    dt = x.dtype
    assert mean.shape == rstd.shape == x.shape[:-1] and mean.dtype == rstd.dtype == F32
    assert_close_rel(mean, mean64, 1e-5, f"mean {what}")
    assert_close_scaled(rstd, rstd64, 1e-5, rstd64.abs(), f"rstd {what}")
    layout, with_y = call["layout"], call["with_y"]
    if layout is None or with_y:
        assert y.shape == x.shape and y.dtype == dt and y.is_contiguous()
        # one rounding of y, plus the fp32 mean's error carried by every element of a row with a large mean
        scale = y64.abs().clamp_min(1.0) * y_tolerance(dt) + MEAN_ERROR * (mean64.abs() * rstd64)[..., None] * (
            1.0 if args["weight"] is None else args["weight"].double().abs())
        assert_close_scaled(y, y64, 1.0, scale, f"y {what}")
    else:
        assert y.shape == (0,)
    if residual is None:
        assert residual_out.shape == (0,)
    else:
        assert torch.equal(residual_out.cpu(), layer_norm_residual(x, residual))
    if layout is None:
        assert data.shape == (0,) and sf.shape == (0,)


# --- the reference against the float64 oracle ---------------------------------------------------------------------

FORWARD_VARIANTS = [dict(), dict(weight=False, bias=False), dict(bias=False, residual=False),
                    dict(dtype=F32), dict(dtype=F32, weight=False, residual=False), dict(offset=300.0),
                    dict(dtype=F32, offset=1e4)]


@pytest.mark.parametrize("variant", FORWARD_VARIANTS, ids=[str(i) for i in range(len(FORWARD_VARIANTS))])
@pytest.mark.parametrize("hidden", [64, 4096])
def test_forward_reference_matches_float64(variant, hidden, seed):
    call = layer_norm_forward_call(7, hidden, seed=seed, layout=None, **variant)
    check_forward(layer_norm_forward_ref(**call), call, str(variant))


def test_forward_reference_at_the_widest_row(seed):
    call = layer_norm_forward_call(2, limits.NORM_HIDDEN.high, seed=seed, layout=None)
    check_forward(layer_norm_forward_ref(**call), call)


BACKWARD_VARIANTS = [dict(), dict(weight=False), dict(residual=False, bias=False), dict(dtype=F32),
                     dict(dtype=F32, weight=False, bias=False, residual=False), dict(offset=100.0)]


def check_backward(grad_x, call, before, after, what=""):
    """``grad_x`` and the accumulated buffers against the float64 autograd gradients (``before`` / ``after`` the
    buffers' values around the call)."""
    x, gy = call["x"].cpu(), call["grad_y"].cpu()
    w = None if call["weight"] is None else call["weight"].cpu()
    gr = None if call["grad_residual_out"] is None else call["grad_residual_out"].cpu()
    gx64, gw64, gb64 = layer_norm_backward_f64(gy, x, w, LAYER_NORM_EPS, gr)
    dt = x.dtype
    assert grad_x.shape == x.shape and grad_x.dtype == dt and grad_x.is_contiguous()
    scale = max(gx64.abs().max().item(), 1e-30) if gx64.numel() else 1.0
    assert_close_scaled(grad_x, gx64, grad_tolerance(dt), scale, f"grad_x {what}")
    rows = x.reshape(-1, x.shape[-1]).double()
    g = gy.reshape(-1, x.shape[-1]).double()
    xhat = (rows - rows.mean(-1, keepdim=True)) * torch.rsqrt(rows.var(-1, unbiased=False, keepdim=True)
                                                              + LAYER_NORM_EPS)
    for name, want, terms in (("grad_weight", gw64, (xhat * g).abs().sum(0)), ("grad_bias", gb64, g.abs().sum(0))):
        if before.get(name) is None:
            continue
        assert_close_scaled(after[name] - before[name].double(), want, 1e-4, terms + 1e-30, f"{name} {what}")


@pytest.mark.parametrize("variant", BACKWARD_VARIANTS, ids=[str(i) for i in range(len(BACKWARD_VARIANTS))])
@pytest.mark.parametrize("hidden", [64, 4096])
def test_backward_reference_matches_float64(variant, hidden, seed):
    call = layer_norm_backward_call(7, hidden, seed=seed, **variant)
    before = {k: None if call[k] is None else call[k].clone() for k in ("grad_weight", "grad_bias")}
    grad_x = layer_norm_backward_ref(**call)
    after = {k: None if call[k] is None else call[k].double() for k in ("grad_weight", "grad_bias")}
    check_backward(grad_x, call, before, after, str(variant))


# --- the op through its prepare step (the reference as the CPU kernel) --------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_cast_is_the_per_token_cast_of_y(layout, seed):
    """``data`` / ``sf`` are per_token_cast's bytes of the rounded ``y`` rows (CUDA's bytes on the CPU), with and
    without ``with_y``; ``y`` empty without it."""
    call = layer_norm_forward_call(5, 256, seed=seed, layout=layout, lead=(5, 1))
    y, _, _, _, data, sf = ops.layer_norm_forward(**call)
    want = ops.per_token_cast(y.reshape(-1, 256), layout)
    assert torch.equal(bits(data), bits(want[0]))
    assert torch.equal(bits(sf), bits(want[1])) and sf.stride() == want[1].stride()
    y2, _, _, _, data2, sf2 = ops.layer_norm_forward(**{**call, "with_y": False})
    assert y2.shape == (0,) and torch.equal(bits(data2), bits(data))
    check_forward((y, *ops.layer_norm_forward(**call)[1:]), call)


def test_leading_dims_and_strided_rows_equal_the_flat_rows(seed):
    """x (2, 3, H) with rows strided by H + 64 gives the rows of the flat contiguous call, bitwise."""
    hidden = 128
    strided = layer_norm_forward_call(6, hidden, seed=seed, pitch=hidden + 64, lead=(2, 3))
    flat = layer_norm_forward_call(6, hidden, seed=seed)
    assert strided["x"].stride() == (3 * (hidden + 64), hidden + 64, 1)
    got, want = ops.layer_norm_forward(**strided), ops.layer_norm_forward(**flat)
    assert got[0].shape == (2, 3, hidden) and got[1].shape == (2, 3)
    for g, w in zip(got, want):
        assert torch.equal(bits(g.reshape(w.shape)), bits(w))
    bstrided = layer_norm_backward_call(6, hidden, seed=seed, pitch=hidden + 64, lead=(2, 3))
    bflat = layer_norm_backward_call(6, hidden, seed=seed)
    assert torch.equal(ops.layer_norm_backward(**bstrided).reshape(6, hidden), ops.layer_norm_backward(**bflat))
    assert torch.equal(bstrided["grad_weight"], bflat["grad_weight"])


def test_zero_tokens(seed):
    """T = 0 (leading dims with a zero): empty outputs, the gradient buffers left as they were."""
    call = layer_norm_forward_call(0, 256, seed=seed, lead=(0, 2))
    y, mean, rstd, residual_out, data, sf = ops.layer_norm_forward(**call)
    assert y.shape == (0, 2, 256) and mean.shape == rstd.shape == (0, 2) and residual_out.shape == (0, 2, 256)
    assert data.shape == (0, 256)
    bcall = layer_norm_backward_call(0, 256, seed=seed, lead=(0,))
    before = bcall["grad_weight"].clone(), bcall["grad_bias"].clone()
    grad_x = ops.layer_norm_backward(**bcall)
    assert grad_x.shape == (0, 256)
    assert torch.equal(bcall["grad_weight"], before[0]) and torch.equal(bcall["grad_bias"], before[1])


def test_one_dimensional_row(seed):
    call = layer_norm_forward_call(1, 64, seed=seed, lead=())
    y, mean, rstd, *_ = ops.layer_norm_forward(**call)
    assert y.shape == (64,) and mean.shape == () and rstd.shape == ()
    check_forward(ops.layer_norm_forward(**call), call)


def layer_norm_model(x, weight, bias, residual, grad_y, grad_weight):
    y, mean, rstd, residual_out, data, sf = ops.layer_norm_forward(x, weight, bias, LAYER_NORM_EPS, residual,
                                                                   "1x64/e4m3/fp32/row/exact", True)
    grad_x = ops.layer_norm_backward(grad_y, residual_out, weight, mean, rstd, grad_weight)
    return y, grad_x, data.view(torch.uint8), sf


def test_compile_fullgraph_dynamic_no_recompile(seed):
    """Forward and backward under ``torch.compile(fullgraph=True, dynamic=True)`` equal eager, with leading dims,
    compiled once over the token counts (a recompile fails)."""
    torch._dynamo.reset()
    compiled = torch.compile(layer_norm_model, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, tokens in enumerate((6, 10, 18)):
        call = layer_norm_forward_call(tokens, 128, seed=seed + tokens, lead=(2, tokens // 2))
        grad_y = layer_norm_rows(tokens, 128, seed=seed + 1, lead=(2, tokens // 2))
        args = (call["x"], call["weight"], call["bias"], call["residual"], grad_y)
        buffers = [torch.zeros(128), torch.zeros(128)]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(*args, buffers[0])
        want = layer_norm_model(*args, buffers[1])
        assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want)), tokens
        assert torch.equal(buffers[0], buffers[1])


# --- validation -----------------------------------------------------------------------------------------------------

def _forward_bad_calls():
    x = torch.zeros(3, 256, dtype=BF16)
    return [
        ({"x": x.half()}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32, got torch.float16"),
        ({"x": torch.zeros(3, 96, dtype=BF16)}, ValueError, r"'x': expected a hidden size"),
        ({"x": torch.zeros(3, 32768 + 64, dtype=BF16)}, ValueError, r"'x': expected a hidden size"),
        ({"x": torch.zeros(256, 3, dtype=BF16).t()}, ValueError, r"'x': expected rows of unit column stride"),
        ({"x": torch.zeros(3, 260, dtype=BF16)[:, :256]}, ValueError, r"'x': expected leading dims"),
        ({"weight": torch.zeros(256, dtype=F32)}, TypeError, r"'weight': expected dtype torch.bfloat16"),
        ({"weight": torch.zeros(128, dtype=BF16)}, ValueError, r"'weight': expected shape \(256,\)"),
        ({"bias": torch.zeros(2, 128, dtype=BF16)}, ValueError, r"'bias': expected a 1-D tensor"),
        ({"eps": 0.0}, ValueError, r"'eps': expected a number > 0.0"),
        ({"eps": float("inf")}, ValueError, r"'eps': expected a number that is finite"),
        ({"eps": "1e-5"}, TypeError, r"'eps': expected a float"),
        ({"residual": torch.zeros(3, 256, dtype=F32)}, TypeError, r"'residual': expected dtype torch.bfloat16"),
        ({"residual": torch.zeros(4, 256, dtype=BF16)}, ValueError, r"'residual': expected shape \(3, 256\)"),
        ({"layout": "1x128/e4m3/fp32/row"}, ValueError, r"'layout': expected a ScaleLayout spec"),
        ({"layout": "128x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token layout"),
        ({"x": torch.zeros(3, 192, dtype=BF16), "weight": None, "bias": None, "residual": None,
          "layout": "1x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a group dividing H = 192"),
        ({"with_y": 1}, TypeError, r"'with_y': expected a bool"),
    ]


@pytest.mark.parametrize("change,error,message", _forward_bad_calls(),
                         ids=[str(i) for i in range(len(_forward_bad_calls()))])
def test_forward_validation_names_op_and_argument(change, error, message):
    call = {**layer_norm_forward_call(3, 256), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::layer_norm_forward: argument "
                                                               rf"{message}"):
        ops.layer_norm_forward(**call)


def _backward_bad_calls():
    return [
        ({"grad_y": torch.zeros(3, 256, dtype=F32)}, TypeError, r"'grad_y': expected dtype torch.bfloat16"),
        ({"grad_y": torch.zeros(3, 128, dtype=BF16)}, ValueError, r"'grad_y': expected shape \(3, 256\)"),
        ({"mean": torch.zeros(3, dtype=BF16)}, TypeError, r"'mean': expected dtype torch.float32"),
        ({"rstd": torch.zeros(4, dtype=F32)}, ValueError, r"'rstd': expected shape \(3,\)"),
        ({"rstd": torch.zeros(6, dtype=F32)[::2]}, ValueError, r"'rstd': expected a contiguous tensor"),
        ({"weight": None}, ValueError, r"'grad_weight': expected None without a weight"),
        ({"grad_weight": torch.zeros(256, dtype=BF16)}, TypeError, r"'grad_weight': expected dtype torch.float32"),
        ({"grad_bias": torch.zeros(128, dtype=F32)}, ValueError, r"'grad_bias': expected shape \(256,\)"),
        ({"grad_residual_out": torch.zeros(3, 256, dtype=F32)}, TypeError,
         r"'grad_residual_out': expected dtype torch.bfloat16"),
    ]


@pytest.mark.parametrize("change,error,message", _backward_bad_calls(),
                         ids=[str(i) for i in range(len(_backward_bad_calls()))])
def test_backward_validation_names_op_and_argument_and_writes_nothing(change, error, message):
    call = {**layer_norm_backward_call(3, 256), **change}
    before = {k: call[k].clone() for k in ("grad_weight", "grad_bias") if call[k] is not None}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::layer_norm_backward: argument "
                                                               rf"{message}"):
        ops.layer_norm_backward(**call)
    for k, v in before.items():
        assert torch.equal(call[k], v)


# --- the CUDA kernels: lowering, launch views, keys -----------------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.norm import layer_norm as cuda_ln  # noqa: E402

HIDDEN = level_choice([64, 7168, 32768], list(limits.NORM_HIDDEN_SIZES))
CUDA_CASES = [(h, kernel, name) for h in HIDDEN for kernel in cuda_ln.KERNELS.values()
              for name in sorted(kernel.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,kernel,name", CUDA_CASES, ids=[f"H{h}-{n}" for h, _, n in CUDA_CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, kernel, name):
    key = kernel.case_keys(hidden, 4)[name]
    built = cuda_build.compile_cubin(kernel.prim_func(key), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits
    assert not undeclared(f"layer_norm/{name}", built.source, declared_vector_args())
    src = built.source
    if kernel is not cuda_ln.BACKWARD_REDUCE:
        assert "__shfl_xor_sync(" in src  # the warp butterflies
        # the rows are read in 16-byte vectors (the ops declare it)
        assert "*(uint4*)(x + " in src or "*(float4*)(x + " in src
    if kernel is cuda_ln.FORWARD and key.group:
        assert "__fmul_rn(" in src  # the cast's IEEE product, as per_token_cast


@pytest.mark.parametrize("backend", ["cuda", "ascend"])
def test_every_parameter_is_its_own_buffer(backend):
    """No two parameters of a prim_func share a buffer (one annotation object for two parameters aliases them: a
    kernel would write one output twice)."""
    module = cuda_ln if backend == "cuda" else ascend_ln
    for kernel in module.KERNELS.values():
        for name, key in kernel.case_keys(256, 4).items():
            prim_func = kernel.prim_func(key)
            data = [prim_func.buffer_map[p].data for p in prim_func.params if p in prim_func.buffer_map]
            assert len(set(data)) == len(data), name


def test_plans_cover_the_range():
    """Threads a multiple of a warp, at most 1024, every vector of the row owned by one thread."""
    for plan in (cuda_ln.ROW_PLAN, cuda_ln.BACKWARD_PLAN):
        for hidden in range(limits.NORM_HIDDEN.low, limits.NORM_HIDDEN.high + 1, 64):
            for vec in (4, 8):
                nvec = hidden // vec
                threads, nv = plan.of(nvec)
                assert threads % 32 == 0 and 32 <= threads <= 1024 and nv * threads >= nvec
                assert (nv - 1) * threads < nvec


def test_token_count_and_row_strides_are_dynamic():
    prim_func = cuda_ln.FORWARD.prim_func(cuda_ln.FORWARD.case_keys(256, 4)["layer_norm_forward_bf16"])
    text = prim_func.script()
    assert "num_tokens" in text and "x_stride" in text


def _capture(monkeypatch, kernel):
    seen = []
    monkeypatch.setattr(kernel, "compiled", lambda key: lambda *args: seen.append((key, args)))
    return seen


def _check_views(kernel, key, args, tokens):
    """Each argument has the dtype, shape and unit inner stride of its prim_func buffer."""
    from tvm import tirx

    prim_func = kernel.prim_func(key)
    buffers = [prim_func.buffer_map[p] for p in prim_func.params if p in prim_func.buffer_map]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert len(buffers) == len(tensors)
    for buffer, arg in zip(buffers, tensors):
        assert arg.dtype == getattr(torch, str(buffer.dtype)) or str(buffer.dtype) == "float8_e4m3fn", buffer.name
        for dim, size in zip(buffer.shape, arg.shape):
            if isinstance(dim, tirx.IntImm):
                assert int(dim) == size, (buffer.name, list(buffer.shape), tuple(arg.shape))
            elif isinstance(dim, tirx.Var):
                assert size == tokens, (buffer.name, list(buffer.shape), tuple(arg.shape))
        assert arg.stride(-1) == 1


@pytest.mark.parametrize("layout", [None, "1x64/e4m3/ue8m0/col_tma/round", "1x16/e2m1/e4m3/row/exact"])
def test_cuda_forward_launcher_passes_the_views_the_kernel_declares(layout, monkeypatch):
    seen = _capture(monkeypatch, cuda_ln.FORWARD)
    hidden, tokens = 256, 6
    for dtype in (BF16, F32):
        call = layer_norm_forward_call(tokens, hidden, dtype=dtype, layout=layout, pitch=hidden + 64, lead=(2, 3))
        outs = ops.layer_norm_forward.prepare(*call.values())
        cuda_ln.layer_norm_forward(**call, **dict(zip(("y", "mean", "rstd", "residual_out", "data", "sf"), outs)))
        key, args = seen[-1]
        assert key.hidden == hidden and key.write_y and (key.group > 0) == (layout is not None)
        assert args[0].stride() == (hidden + 64, 1) and args[0].shape == (tokens, hidden)
        if layout is None:
            _check_views(cuda_ln.FORWARD, key, args, tokens)
    assert len({k for k, _ in seen}) == 2  # one per dtype: neither T nor the row stride is in the key


def test_cuda_backward_launcher_partials_and_reduction(monkeypatch):
    seen = _capture(monkeypatch, cuda_ln.BACKWARD)
    reduced = _capture(monkeypatch, cuda_ln.BACKWARD_REDUCE)
    hidden, tokens = 256, 6
    call = layer_norm_backward_call(tokens, hidden, pitch=hidden + 64, lead=(3, 2))
    grad_x = ops.layer_norm_backward.prepare(*call.values())
    cuda_ln.layer_norm_backward(**call, grad_x=grad_x)
    key, args = seen[-1]
    P = policy.NORM_GRAD_WEIGHT_PARTITIONS["cuda"]
    assert key == cuda_ln.BackwardKey(hidden, "bfloat16", True, True, True, True, P)
    _check_views(cuda_ln.BACKWARD, key, args, tokens)
    assert [a[1] for _, a in reduced] == [call["grad_weight"], call["grad_bias"]]
    assert all(a[0].shape == (P, hidden) for _, a in reduced)
    call = layer_norm_backward_call(tokens, hidden, weight=False, bias=False, residual=False)
    cuda_ln.layer_norm_backward(**call, grad_x=ops.layer_norm_backward.prepare(*call.values()))
    assert len(reduced) == 2 and seen[-1][0].sums_weight is False and seen[-1][0].sums_bias is False


def test_cuda_builders_refuse_what_the_limits_refuse():
    for hidden in (limits.NORM_HIDDEN.low - 64, limits.NORM_HIDDEN.high + 64, 96):
        with pytest.raises(LimitError, match="hidden size"):
            cuda_ln.build_layer_norm_forward(hidden, "bfloat16", True, True, False, True)
        with pytest.raises(LimitError, match="hidden size"):
            cuda_ln.build_layer_norm_backward(hidden, "bfloat16", True, False, True, True, 132)
    with pytest.raises(LimitError, match="input dtype"):
        cuda_ln.build_layer_norm_forward(256, "float16", True, True, False, True)
    from cann_ops_tilelang.quant import ScaleLayout

    with pytest.raises(LimitError, match="per-token"):
        cuda_ln.forward_key("layer_norm_forward", 256, "bfloat16", True, True, False, True,
                            ScaleLayout.parse("128x128/e4m3/fp32/row/exact"))


# --- the Ascend 950 kernels: lowered to AscendC within the UB budget ------------------------------------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend.norm import layer_norm as ascend_ln  # noqa: E402

ASCEND_CASES = [(h, kernel, name) for h in HIDDEN for kernel in ascend_ln.KERNELS.values()
                for name in sorted(kernel.case_keys(h, 4))]


@pytest.mark.parametrize("hidden,kernel,name", ASCEND_CASES, ids=[f"H{h}-{n}" for h, _, n in ASCEND_CASES])
def test_ascend_lowers_within_ub(hidden, kernel, name):
    key = kernel.case_keys(hidden, 4)[name]
    lowered = ascend_build.lower_ascendc(kernel.prim_func(key))
    assert "__global__" in lowered.source and not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (name, lowered.ub_bytes)


def test_ascend_tiles_divide_the_row_and_fit():
    for hidden in range(limits.NORM_HIDDEN.low, limits.NORM_HIDDEN.high + 1, 64):
        for per_column in (4, 10, 20, 28):
            hb = ascend_ln.tile_of(hidden, per_column)
            assert hidden % hb == 0 and hb % 64 == 0 and hb * per_column <= ascend_ln.PLAN.budget


def test_ascend_launchers(monkeypatch):
    monkeypatch.setattr(ascend_ln, "num_vector_cores", lambda: 64)
    fwd = _capture(monkeypatch, ascend_ln.FORWARD)
    hidden, tokens = 256, 5
    call = layer_norm_forward_call(tokens, hidden, layout=None)
    outs = ops.layer_norm_forward.prepare(*call.values())
    ascend_ln.layer_norm_forward(**call, **dict(zip(("y", "mean", "rstd", "residual_out", "data", "sf"), outs)))
    key, args = fwd[-1]
    assert key == ascend_ln.ForwardKey(hidden, "bfloat16", True, True, True, 64)
    _check_views(ascend_ln.FORWARD, key, args, tokens)
    # with a layout: y (a temporary without with_y) cast by the per_token_cast op
    for with_y in (True, False):
        lcall = {**call, "layout": "1x128/e4m3/ue8m0/col_tma/round", "with_y": with_y}
        outs = ops.layer_norm_forward.prepare(*lcall.values())
        ascend_ln.layer_norm_forward(**lcall, **dict(zip(("y", "mean", "rstd", "residual_out", "data", "sf"), outs)))
        y = fwd[-1][1][4].view(tokens, hidden)
        want = ops.per_token_cast(y, lcall["layout"])
        assert torch.equal(bits(outs[4]), bits(want[0])) and torch.equal(bits(outs[5]), bits(want[1]))
        assert (outs[0].shape == (tokens, hidden)) == with_y
    seen = {k: _capture(monkeypatch, getattr(ascend_ln, k)) for k in ("BACKWARD_SUMS", "BACKWARD", "BACKWARD_REDUCE")}
    bcall = layer_norm_backward_call(tokens, hidden)
    ascend_ln.layer_norm_backward(**bcall, grad_x=ops.layer_norm_backward.prepare(*bcall.values()))
    key, args = seen["BACKWARD"][-1]
    assert key.partitions == policy.NORM_GRAD_WEIGHT_PARTITIONS["ascend"]
    _check_views(ascend_ln.BACKWARD, key, args, tokens)
    _check_views(ascend_ln.BACKWARD_SUMS, key, seen["BACKWARD_SUMS"][-1][1], tokens)
    assert [a[1] for _, a in seen["BACKWARD_REDUCE"]] == [bcall["grad_weight"], bcall["grad_bias"]]


# --- device: the kernels against the float64 oracle, the cast bitwise, the gradients reproducible ------------------

DEVICE_TOKENS = level_choice([0, 1, 7, 4099], [0, 1, 7, 513, 4099, 8193])
DEVICE_HIDDEN = level_choice([64, 4096, 7168, 32768], [64, 2048, 4096, 7168, 8192, 32768])


# the float64 oracle's size on the host: T * H up to 2**25 (T = 4099 up to H = 7168, 1027 rows at H = 32768)
ORACLE_ELEMENTS = 2**25


def _device_tokens(hidden):
    return sorted({min(t, ORACLE_ELEMENTS // hidden + 3) for t in DEVICE_TOKENS})


def _device_variants():
    return [dict(), dict(weight=False, bias=False), dict(residual=False), dict(dtype=F32),
            dict(dtype=F32, pitch_extra=64), dict(pitch_extra=64, lead=True), dict(offset=300.0)]


def _device_call(builder, tokens, hidden, seed, variant):
    v = dict(variant)
    extra = v.pop("pitch_extra", None)
    lead = v.pop("lead", False)
    if extra is not None:
        v["pitch"] = hidden + extra
    if lead and tokens:
        v["lead"] = (1, tokens)
    return builder(tokens, hidden, seed=seed, device="cuda", **v)


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("variant", _device_variants(), ids=[str(i) for i in range(len(_device_variants()))])
def test_device_forward_against_float64(variant, seed):
    for hidden in DEVICE_HIDDEN:
        for tokens in _device_tokens(hidden):
            call = _device_call(layer_norm_forward_call, tokens, hidden, seed + tokens, {**variant, "layout": None})
            check_forward(ops.layer_norm_forward(**call), call, f"T={tokens} H={hidden} {variant}")


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_fused_cast_bitwise(layout, seed):
    """The cast's bytes equal the quant reference of the kernel's own y (with_y), and the same without y."""
    per_token_quantize_ref = quant_reference().per_token_quantize_ref
    for hidden in (64, 7168, 32768):
        if hidden % int(layout.split("/")[0].split("x")[1]):
            continue
        for tokens in [t for t in _device_tokens(hidden) if t]:
            for dtype in (BF16, F32):
                call = layer_norm_forward_call(tokens, hidden, seed=seed, device="cuda", layout=layout, dtype=dtype)
                y, _, _, _, data, sf = ops.layer_norm_forward(**call)
                q = per_token_quantize_ref(y.cpu().reshape(-1, hidden), layout)
                assert torch.equal(bits(data.cpu()), bits(q.data))
                assert torch.equal(bits(sf.cpu()), bits(q.sf))
                check_forward((y, *ops.layer_norm_forward(**call)[1:]), call)
                _, _, _, _, data2, sf2 = ops.layer_norm_forward(**{**call, "with_y": False})
                assert torch.equal(bits(data2), bits(data))
                assert torch.equal(bits(sf2), bits(sf))


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("variant", _device_variants(), ids=[str(i) for i in range(len(_device_variants()))])
def test_device_backward_against_float64_and_reproducible(variant, seed):
    for hidden in DEVICE_HIDDEN:
        for tokens in _device_tokens(hidden):
            call = _device_call(layer_norm_backward_call, tokens, hidden, seed + tokens,
                                {k: v for k, v in variant.items()})
            before = {k: None if call[k] is None else call[k].clone() for k in ("grad_weight", "grad_bias")}
            grad_x = ops.layer_norm_backward(**call)
            after = {k: None if call[k] is None else call[k].double() for k in ("grad_weight", "grad_bias")}
            check_backward(grad_x, call, before, after, f"T={tokens} H={hidden} {variant}")
            # run to run: the same bytes from the same starting buffers
            for k, v in before.items():
                if v is not None:
                    call[k].copy_(v)
            assert torch.equal(ops.layer_norm_backward(**call), grad_x)
            for k in ("grad_weight", "grad_bias"):
                if call[k] is not None:
                    assert torch.equal(call[k].double(), after[k]), k


@requires_cuda
@pytest.mark.device
def test_device_backward_matches_torch_autograd_on_the_forward(seed):
    """The forward then the backward (with the forward's statistics) against torch's LayerNorm autograd in
    float64, weight, bias and residual on."""
    tokens, hidden = 4099, 4096
    call = layer_norm_forward_call(tokens, hidden, seed=seed, device="cuda", layout=None)
    y, mean, rstd, residual_out, _, _ = ops.layer_norm_forward(**call)
    gy = layer_norm_rows(tokens, hidden, seed=seed + 9, device="cuda")
    gw = torch.zeros(hidden, device="cuda")
    gb = torch.zeros(hidden, device="cuda")
    grad_x = ops.layer_norm_backward(gy, residual_out, call["weight"], mean, rstd, gw, gb)
    w = layer_norm_param(hidden, seed=seed + 1)
    gx64, gw64, gb64 = layer_norm_backward_f64(gy.cpu(), residual_out.cpu(), w, LAYER_NORM_EPS)
    assert_close_scaled(grad_x, gx64, grad_tolerance(BF16), gx64.abs().max().item(), "grad_x")
    assert_close_scaled(gw, gw64, 1e-3, gw64.abs().max().item(), "grad_weight")
    assert_close_scaled(gb, gb64, 1e-3, gb64.abs().max().item(), "grad_bias")
