"""``rms_norm_forward`` / ``rms_norm_backward`` (docs/ops/norm.md#rms_norm): validation, the reference against the
float64 oracle within the stated tolerances, the fused cast as the quant reference's cast of the rounded y, the
fakes, opcheck and torch.compile (CPU tier, the reference as the CPU kernel); the CUDA kernels lowered to sm_90a
cubins and the Ascend 950 kernels to AscendC within the UB budget at the family's sizes, their launchers' arguments
(CPU tier); on a GPU the kernels against the oracle, the cast bitwise, the weight gradient bitwise run to run, and
against the peer (DeepSeek's tile_kernels) where it imports."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from norm_cases import norm_rows, rms_norm_backward_call, rms_norm_forward_call
from norm_ref import (quant_reference, rms_norm_backward_f64, rms_norm_forward_f64, rms_norm_forward_ref,
                      rms_norm_rows)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.policy import NORM_GRAD_WEIGHT_PARTITIONS
from cann_ops_tilelang.quant import ScaleLayout

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
HAVE_NVCC = shutil.which("nvcc") is not None
LAYOUTS = ["1x32/e4m3/ue8m0/col_tma/round", "1x128/e4m3/fp32/row/exact", "1x32/e2m1/ue8m0/row/round",
           "1x16/e2m1/e4m3/col_tma/exact", "1x64/e4m3/fp32/row/round"]
# docs/ops/norm.md#rms_norm: |got - oracle| <= rtol |oracle| + atol (y, grad_x); rstd relative; the weight gradient
# within WEIGHT_RTOL of the sum of its terms' magnitudes
TOL = {BF16: dict(rtol=2**-8, atol=1e-5), F32: dict(rtol=1e-5, atol=1e-5)}
GRAD_TOL = {BF16: dict(rtol=2**-8, atol=1e-4), F32: dict(rtol=1e-4, atol=1e-4)}
RSTD_RTOL = 1e-5
WEIGHT_RTOL = 2e-5
# two results each within half an ulp of the exact value (plus fp32 noise): within one ulp of each other
PEER_TOL = {BF16: dict(rtol=2**-7, atol=1e-5), F32: dict(rtol=2e-5, atol=1e-5)}


def assert_within(got, want, rtol, atol, what=""):
    err = (got.to(F64) - want).abs()
    bound = rtol * want.abs() + atol
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item():.3g}"


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.cpu()), bits(b.cpu()))


def check_forward(call, out):
    """The outputs of a forward call against the oracle and the contract's exact parts (residual_out, the cast)."""
    y, rstd, residual_out, data, sf = out
    x = call["x"].cpu()
    residual = None if call["residual"] is None else call["residual"].cpu()
    weight = None if call["weight"] is None else call["weight"].cpu()
    y64, rstd64 = rms_norm_forward_f64(x, weight, call["eps"], residual, call["out_scale"])
    assert_within(rstd.cpu(), rstd64, RSTD_RTOL, 0.0, "rstd")
    if residual is not None:
        assert same(residual_out, (x.float() + residual.float()).to(x.dtype))
    else:
        assert residual_out.shape == (0,)
    if call["layout"] is None or call["with_y"]:
        assert_within(y.cpu(), y64, what="y", **TOL[x.dtype])
    if call["layout"] is not None and call["with_y"]:
        cast = quant_reference().per_token_cast_ref(rms_norm_rows(y.cpu()), call["layout"])
        assert same(data, cast[0]) and same(sf, cast[1])


# --- validation -----------------------------------------------------------------------------------------------


def _forward_bad_calls():
    x = torch.zeros(3, 256, dtype=BF16)
    return [
        ({"x": x.double()}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32, got torch.float64"),
        ({"x": torch.zeros(3, 96, dtype=BF16)}, ValueError, r"'x': expected a hidden size"),
        ({"x": torch.zeros(3, 32768 + 64, dtype=BF16)}, ValueError, r"'x': expected a hidden size"),
        ({"x": torch.zeros(3, 260, dtype=BF16)[:, :256]}, ValueError, r"'x': expected leading dims that flatten"),
        ({"x": torch.zeros(256, 3, dtype=BF16).t()[:, :256]}, ValueError, r"'x'"),
        ({"weight": torch.zeros(256, dtype=F32)}, TypeError, r"'weight': expected dtype torch.bfloat16"),
        ({"weight": torch.zeros(128, dtype=BF16)}, ValueError, r"'weight': expected shape \(256,\)"),
        ({"eps": 0.0}, ValueError, r"'eps': expected a number > 0.0"),
        ({"eps": float("inf")}, ValueError, r"'eps': expected a number that is finite"),
        ({"eps": "1e-6"}, TypeError, r"'eps': expected a float"),
        ({"residual": torch.zeros(3, 256, dtype=F32)}, TypeError, r"'residual': expected dtype torch.bfloat16"),
        ({"residual": torch.zeros(2, 256, dtype=BF16)}, ValueError, r"'residual': expected shape \(3, 256\)"),
        ({"out_scale": float("nan")}, ValueError, r"'out_scale': expected a number that is finite"),
        ({"layout": 32}, TypeError, r"'layout': expected a str"),
        ({"layout": "128x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token layout"),
        ({"x": torch.zeros(3, 192, dtype=BF16), "residual": None, "weight": None,
          "layout": "1x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a group dividing H = 192"),
        ({"with_y": 1}, TypeError, r"'with_y': expected a bool"),
    ]


def _backward_bad_calls():
    g = torch.zeros(3, 256, dtype=BF16)
    return [
        ({"grad_y": g.half()}, TypeError, r"'grad_y': expected dtype torch.bfloat16 or torch.float32"),
        ({"x": torch.zeros(3, 256, dtype=F32)}, TypeError, r"'x': expected dtype torch.bfloat16 \(as grad_y\)"),
        ({"x": torch.zeros(4, 256, dtype=BF16)}, ValueError, r"'x': expected shape \(3, 256\) \(as grad_y\)"),
        ({"rstd": torch.zeros(3, dtype=BF16)}, TypeError, r"'rstd': expected dtype torch.float32"),
        ({"rstd": torch.zeros(4)}, ValueError, r"'rstd': expected shape \(3,\)"),
        ({"grad_weight": torch.zeros(256, dtype=BF16)}, TypeError, r"'grad_weight': expected dtype torch.float32"),
        ({"grad_weight": torch.zeros(128)}, ValueError, r"'grad_weight': expected shape \(256,\)"),
        ({"weight": None}, ValueError, r"'grad_weight': expected None without a weight"),
        ({"grad_residual_out": torch.zeros(3, 128, dtype=BF16)}, ValueError, r"'grad_residual_out': expected shape"),
        ({"out_scale": None}, TypeError, r"'out_scale': expected a float"),
    ]


@pytest.mark.parametrize("change,error,message", _forward_bad_calls(), ids=[str(i) for i in range(17)])
def test_forward_validation_names_op_and_argument(change, error, message):
    call = {**rms_norm_forward_call(3, 256), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::rms_norm_forward: argument "
                                                              rf"{message}"):
        ops.rms_norm_forward(**call)


@pytest.mark.parametrize("change,error,message", _backward_bad_calls(), ids=[str(i) for i in range(10)])
def test_backward_validation_names_op_and_argument_and_writes_nothing(change, error, message):
    call = {**rms_norm_backward_call(3, 256), **change}
    before = None if call["grad_weight"] is None else call["grad_weight"].clone()
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::rms_norm_backward: argument "
                                                              rf"{message}"):
        ops.rms_norm_backward(**call)
    assert before is None or torch.equal(before, call["grad_weight"])


# --- the reference against the float64 oracle, the cast, edge cases (CPU tier) -----------------------------------

FORWARD_VARIANTS = [
    dict(),  # weight, residual, cast with y
    dict(layout=None),
    dict(weight=False, residual=False, layout=None),
    dict(dtype=F32, layout="1x64/e4m3/fp32/row/exact"),
    dict(dtype=F32, weight=False, out_scale=1.0),
]


@pytest.mark.parametrize("variant", FORWARD_VARIANTS, ids=[str(i) for i in range(len(FORWARD_VARIANTS))])
@pytest.mark.parametrize("hidden", [64, 4096, 32768])
def test_forward_reference_within_tolerance_of_the_oracle(variant, hidden, seed):
    if hidden == 32768 and variant.get("dtype") == F32:
        pytest.skip("one fp32 case at 32768 is enough (below)")
    call = rms_norm_forward_call(5, hidden, seed=seed, **variant)
    check_forward(call, ops.rms_norm_forward(**call))


def test_forward_edges(seed):
    """Leading dims, strided rows (NaN past H never read), a 1-D row, fp32 at H = 32768, a large out_scale."""
    for kw in (dict(lead=(2, 3)), dict(pitch=264), dict(pitch=260, dtype=F32), dict(lead=()),
               dict(dtype=F32, weight=False), dict(out_scale=8.0, layout="1x16/e2m1/e4m3/col_tma/exact")):
        hidden = 32768 if kw.get("dtype") == F32 and not kw.get("weight", True) else 256
        call = rms_norm_forward_call(4, hidden, seed=seed, **kw)
        out = ops.rms_norm_forward(**call)
        assert out[0].shape == call["x"].shape and out[1].shape == call["x"].shape[:-1]
        check_forward(call, out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_cast_is_the_per_token_cast_of_the_rounded_y(layout, seed):
    """data / sf bitwise per_token_cast of rows(y); without with_y y is an empty and the cast the same bytes."""
    call = rms_norm_forward_call(6, 512, seed=seed, layout=layout, lead=(2, 3))
    y, _, _, data, sf = ops.rms_norm_forward(**call)
    q = ops.per_token_cast(rms_norm_rows(y), layout)
    assert same(data, q[0]) and same(sf, q[1]) and sf.stride() == q[1].stride()
    alone = ops.rms_norm_forward(**{**call, "with_y": False})
    assert alone[0].shape == (0,) and same(alone[3], data) and same(alone[4], sf)


def test_zero_tokens_and_absent_outputs(seed):
    for lead in ((0,), (2, 0)):
        call = rms_norm_forward_call(0, 256, seed=seed, lead=lead)
        y, rstd, residual_out, data, sf = ops.rms_norm_forward(**call)
        assert y.shape == (*lead, 256) and rstd.shape == lead and residual_out.shape == (*lead, 256)
        assert data.shape == (0, 256) and sf.shape[0] == 0 or sf.shape[-1] == 0
        back = rms_norm_backward_call(0, 256, seed=seed, lead=lead)
        back["grad_weight"] += 1.0
        assert ops.rms_norm_backward(**back).shape == (*lead, 256)
        assert torch.equal(back["grad_weight"], torch.ones(256))  # a sum over no tokens adds nothing
    out = ops.rms_norm_forward(**rms_norm_forward_call(3, 256, residual=False, layout=None, seed=seed))
    assert out[2].shape == (0,) and out[3].shape == (0,) and out[3].dtype == torch.float8_e4m3fn
    assert out[4].shape == (0,) and out[4].dtype == F32


BACKWARD_VARIANTS = [dict(), dict(grad_residual_out=False), dict(weight=False),
                     dict(dtype=F32, out_scale=1.0), dict(grad_weight=False)]


@pytest.mark.parametrize("variant", BACKWARD_VARIANTS, ids=[str(i) for i in range(len(BACKWARD_VARIANTS))])
@pytest.mark.parametrize("hidden", [64, 7168, 32768])
def test_backward_reference_within_tolerance_of_the_oracle(variant, hidden, seed):
    check_backward(rms_norm_backward_call(9, hidden, seed=seed, **variant))


def check_backward(call):
    """grad_x and the accumulated weight gradient (added to a nonzero buffer) against the oracle."""
    gw = call["grad_weight"]
    start = None
    if gw is not None:
        gw.copy_(torch.linspace(-1, 1, gw.shape[0], device=gw.device))
        start = gw.cpu().to(F64)
    grad_x = ops.rms_norm_backward(**call)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
    gx64, gw64, mag = rms_norm_backward_f64(cpu["grad_y"], cpu["x"], cpu["weight"], cpu["rstd"], call["out_scale"])
    if cpu["grad_residual_out"] is not None:
        gx64 = gx64 + cpu["grad_residual_out"].to(F64)
    assert grad_x.shape == call["x"].shape and grad_x.dtype == call["x"].dtype
    assert_within(grad_x.cpu(), gx64, what="grad_x", **GRAD_TOL[call["x"].dtype])
    if gw is not None:
        err = (gw.cpu().to(F64) - start - gw64).abs()
        assert bool((err <= WEIGHT_RTOL * (mag + start.abs()) + 1e-6).all()), err.max()


def test_backward_edges(seed):
    """Leading dims, strided rows, the weight gradient accumulating over two calls."""
    for kw in (dict(lead=(2, 3)), dict(pitch=264), dict(pitch=260, dtype=F32), dict(lead=())):
        check_backward(rms_norm_backward_call(4, 256, seed=seed, **kw))
    call = rms_norm_backward_call(5, 256, seed=seed)
    ops.rms_norm_backward(**call)
    once = call["grad_weight"].clone()
    ops.rms_norm_backward(**call)
    assert torch.allclose(call["grad_weight"], 2 * once, rtol=1e-6, atol=1e-6)


def test_backward_is_the_gradient_of_the_forward(seed):
    """Autograd of the forward's oracle (float64) gives the backward's oracle: the math of the contract."""
    x = norm_rows(4, 128, seed=seed, dtype=F64).requires_grad_()
    w = (1 + 0.1 * norm_rows(1, 128, seed=seed + 1, dtype=F64)[0]).requires_grad_()
    y, rstd = rms_norm_forward_f64(x, w, 1e-6, None, 0.5)
    g = norm_rows(4, 128, seed=seed + 2, dtype=F64)
    y.backward(g)
    gx, gw, _ = rms_norm_backward_f64(g, x.detach(), w.detach(), rstd.detach(), 0.5)
    assert torch.allclose(x.grad, gx, atol=1e-10) and torch.allclose(w.grad, gw, atol=1e-10)


# --- fakes, opcheck, compile --------------------------------------------------------------------------------


def _metadata(t):
    return t.shape, t.dtype, t.stride() if t.numel() else None


@pytest.mark.parametrize("layout", [None, *LAYOUTS])
def test_forward_fake_matches_the_reference(layout, seed):
    for tokens, dtype in ((0, BF16), (1, F32), (5, BF16)):
        real = ops.rms_norm_forward(**rms_norm_forward_call(tokens, 256, seed=seed, dtype=dtype, layout=layout))
        fake = ops.rms_norm_forward(**rms_norm_forward_call(tokens, 256, dtype=dtype, layout=layout, device="meta"))
        assert [_metadata(t) for t in fake] == [_metadata(t) for t in real], (tokens, layout)


@pytest.mark.parametrize("tokens", [0, 3])
@pytest.mark.parametrize("variant", [dict(), dict(layout=None, residual=False, weight=False)], ids=["full", "plain"])
def test_opcheck(tokens, variant, seed):
    call = rms_norm_forward_call(tokens, 256, seed=seed, **variant)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.rms_norm_forward.default, tuple(call.values()))
    back = rms_norm_backward_call(tokens, 256, seed=seed, weight=bool(variant.get("weight", True)))
    torch.library.opcheck(torch.ops.cann_ops_tilelang.rms_norm_backward.default, tuple(back.values()))


def norm_model(x, weight, residual, grad_weight):
    y, rstd, residual_out, data, sf = ops.rms_norm_forward(x, weight, 1e-6, residual, 1.0, LAYOUTS[0], True)
    grad_x = ops.rms_norm_backward(y, residual_out, weight, rstd, grad_weight, None, 1.0)
    return grad_x, data.view(torch.uint8).float().sum(dim=1), sf


def test_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(norm_model, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, tokens in enumerate((7, 9, 17)):
        call = rms_norm_forward_call(tokens, 256, seed=seed + tokens)
        gw1, gw2 = torch.zeros(256), torch.zeros(256)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(call["x"], call["weight"], call["residual"], gw1)
        want = norm_model(call["x"], call["weight"], call["residual"], gw2)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and torch.equal(gw1, gw2), tokens


# --- the CUDA kernels: lowering, launch arguments (CPU tier) -------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.norm import rms_norm as cuda_norm  # noqa: E402

HIDDEN = level_choice([64, 7168, 32768], list(limits.NORM_HIDDEN_SIZES))
CUDA_CASES = [(h, kernel.name, name) for h in HIDDEN for kernel in cuda_norm.KERNELS.values()
              for name in sorted(kernel.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,kernel,name", CUDA_CASES, ids=[f"H{h}-{n}" for h, _, n in CUDA_CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, kernel, name):
    kernel = cuda_norm.KERNELS[kernel]
    key = kernel.case_keys(hidden, 4)[name]
    built = cuda_build.compile_cubin(kernel.prim_func(key), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits
    assert not undeclared(f"rms_norm/{name}", built.source, declared_vector_args())
    src = built.source
    if kernel is cuda_norm.GRAD_WEIGHT_REDUCE:
        assert "*(float4*)(grad_weight + " in src and "atomic" not in src
        return
    # the rows read in 16-byte vectors, no atomics (the weight gradient's order is fixed)
    assert "*(uint4*)(x + " in src or "*(float4*)(x + " in src
    assert "atomic" not in src.lower()
    if kernel is cuda_norm.FORWARD and key.group:
        assert "__fdiv_rn(" in src and "__fmul_rn(" in src  # the cast's IEEE operations (the quant macros)
        assert ("__NV_E4M3" in src) == (key.fmt == "e4m3")
        assert ("y + " in src) == key.writes_y


def test_row_layouts_cover_the_range():
    """Every H of the range: whole rows over the CTA's slots, groups of lanes aligned (tpr a power of two up to a
    warp or whole warps), at most 1024 threads and 32 values a thread."""
    for hidden in range(64, limits.NORM_HIDDEN.high + 1, 64):
        for dtype in ("bfloat16", "float32"):
            for plan in (cuda_norm.FORWARD_PLAN, cuda_norm.BACKWARD_PLAN):
                lay = cuda_norm.row_layout(hidden, dtype, plan)
                assert lay.per * lay.tpr >= lay.nvec and lay.threads <= 1024 and lay.threads >= 32
                assert (lay.tpr <= 32 and lay.tpr & (lay.tpr - 1) == 0) or lay.tpr % 32 == 0, (hidden, lay)
                assert lay.per * cuda_norm.VEC_BYTES // {"bfloat16": 2, "float32": 4}[dtype] <= 32


def test_token_count_and_row_stride_are_dynamic():
    from tvm import tirx

    prim_func = cuda_norm.lowering_cases(256)["rms_norm_forward_bf16_residual_e4m3_ue8m0_col_g32"]
    x = prim_func.buffer_map[prim_func.params[0]]
    assert isinstance(x.shape[0], tirx.Var) and isinstance(x.strides[0], tirx.Var)


@pytest.mark.parametrize("backend", ["cuda", "ascend"])
@pytest.mark.parametrize("variant", [dict(), dict(layout=None, residual=False, weight=False),
                                     dict(with_y=False, dtype=F32, lead=(2, 3)), dict(pitch=528)],
                         ids=["full", "plain", "no_y", "strided"])
def test_forward_launcher_passes_the_views_the_kernel_declares(backend, variant, monkeypatch):
    """Every buffer the forward kernel takes has the dtype, shape and unit inner stride of its parameter; the
    key ignores T and the row strides."""
    from tvm import tirx

    module = cuda_norm if backend == "cuda" else pytest.importorskip(
        "cann_ops_tilelang.kernels.ascend.norm.rms_norm")
    seen = []
    monkeypatch.setattr(module.FORWARD, "compiled", lambda key: lambda *args: seen.append((key, args)))
    tokens = 6
    call = rms_norm_forward_call(tokens, 512, **variant)
    if backend == "ascend":
        call["layout"] = None
    outputs = dict(zip(("y", "rstd", "residual_out", "data", "sf"), ops.rms_norm_forward.prepare(*call.values())))
    module.rms_norm_forward(**call, **outputs)
    key, args = seen[-1]
    prim_func = module.FORWARD.prim_func(key)
    buffers = [prim_func.buffer_map[p] for p in prim_func.params if p in prim_func.buffer_map]
    assert len(args) == len(buffers) + 2  # eps, out_scale
    for buffer, arg in zip(buffers, args):
        assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
        for dim, size in zip(buffer.shape, arg.shape):
            want = int(dim) if isinstance(dim, tirx.IntImm) else tokens if isinstance(dim, tirx.Var) else 4 * tokens
            assert want == size, (buffer.name, list(buffer.shape), tuple(arg.shape))
        assert arg.stride(-1) == 1


@pytest.mark.parametrize("backend", ["cuda", "ascend"])
@pytest.mark.parametrize("variant", [dict(), dict(weight=False, grad_residual_out=False), dict(pitch=528)],
                         ids=["full", "plain", "strided"])
def test_backward_launcher_passes_the_views_the_kernels_declare(backend, variant, monkeypatch):
    from tvm import tirx

    module = cuda_norm if backend == "cuda" else pytest.importorskip(
        "cann_ops_tilelang.kernels.ascend.norm.rms_norm")
    seen = []
    for kernel in (module.BACKWARD, module.GRAD_WEIGHT_REDUCE):
        monkeypatch.setattr(kernel, "compiled", lambda key, kernel=kernel: lambda *args: seen.append((kernel, key,
                                                                                                      args)))
    tokens = 6
    call = rms_norm_backward_call(tokens, 512, **variant)
    module.rms_norm_backward(**call, grad_x=ops.rms_norm_backward.prepare(*call.values()))
    assert len(seen) == (2 if call["grad_weight"] is not None else 1)
    for kernel, key, args in seen:
        assert key.partitions == NORM_GRAD_WEIGHT_PARTITIONS[backend]
        prim_func = kernel.prim_func(key)
        buffers = [prim_func.buffer_map[p] for p in prim_func.params if p in prim_func.buffer_map]
        for buffer, arg in zip(buffers, args):
            assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
            for dim, size in zip(buffer.shape, arg.shape):
                assert (int(dim) if isinstance(dim, tirx.IntImm) else tokens) == size, (buffer.name, arg.shape)
            assert arg.stride(-1) == 1
        if kernel is module.GRAD_WEIGHT_REDUCE:
            assert args[1] is call["grad_weight"]


def test_keys_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    for hidden in (32, 32768 + 64, 96):
        with pytest.raises(LimitError, match="hidden size"):
            cuda_norm.build_rms_norm_forward(hidden, "bfloat16", True, False, True)
        with pytest.raises(LimitError, match="hidden size"):
            cuda_norm.build_rms_norm_backward(hidden, "bfloat16", True, True, False, 4)
    with pytest.raises(LimitError, match="input dtype"):
        cuda_norm.build_rms_norm_forward(256, "float16", True, False, True)
    with pytest.raises(LimitError, match="writes y, the cast or both"):
        cuda_norm.build_rms_norm_forward(256, "bfloat16", True, False, False)
    with pytest.raises(LimitError, match="does not divide"):
        cuda_norm.build_rms_norm_forward(192, "bfloat16", True, False, True, 128, "e4m3", "fp32", "row", False)
    with pytest.raises(LimitError, match="partitions"):
        cuda_norm.build_rms_norm_backward(256, "bfloat16", True, True, False, 0)


# --- the Ascend 950 kernels: lowered to AscendC within the UB budget ------------------------------------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend.norm import rms_norm as ascend_norm  # noqa: E402

ASCEND_CASES = [(h, kernel.name, name) for h in limits.NORM_HIDDEN_SIZES for kernel in ascend_norm.KERNELS.values()
                for name in sorted(kernel.case_keys(h, 4))]


@pytest.mark.parametrize("hidden,kernel,name", ASCEND_CASES, ids=[f"H{h}-{n}" for h, _, n in ASCEND_CASES])
def test_ascend_lowers_within_ub(hidden, kernel, name):
    kernel = ascend_norm.KERNELS[kernel]
    key = kernel.case_keys(hidden, 4)[name]
    lowered = ascend_build.lower_ascendc(kernel.prim_func(key))
    assert "__global__" in lowered.source and not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes
    source = lowered.source
    if kernel is ascend_norm.GRAD_WEIGHT_REDUCE:
        assert "vadd" in source
        return
    assert "vcadd" in source and "vmula" in source  # the row sums
    if kernel is ascend_norm.FORWARD:
        til = ascend_norm.forward_tiling(hidden, key.in_dtype, key.weight, key.residual)
        assert "vdiv" in source and "vsqrt" in source  # rstd = 1 / sqrt(.)
    else:
        til = ascend_norm.backward_tiling(hidden, key.in_dtype, key.weight, key.grad_weight, key.grad_residual_out)
    assert til.hk * til.n_tiles == hidden and (til.n_tiles > 1) == (til.stages == 1)
    assert hidden < 32768 or til.n_tiles > 1  # the longest rows are tiled
    if key.in_dtype == "bfloat16":
        assert "vsts_pack_b32" in source  # one rounding to bf16 at the store


@pytest.mark.parametrize("with_y", [True, False])
def test_ascend_cast_of_y_goes_through_per_token_cast(with_y, monkeypatch, seed):
    """On Ascend the launcher writes y (a scratch buffer without with_y) and casts its rows with per_token_cast:
    data / sf are that op's outputs for the y the kernel wrote (here a stub writing the reference's y)."""
    call = rms_norm_forward_call(6, 512, seed=seed, with_y=with_y, lead=(2, 3))
    want = rms_norm_forward_ref(**{**call, "with_y": True})
    monkeypatch.setattr(ascend_norm.FORWARD, "compiled", lambda key: lambda *args: args[3].copy_(
        rms_norm_rows(want[0])))
    outputs = dict(zip(("y", "rstd", "residual_out", "data", "sf"), ops.rms_norm_forward.prepare(*call.values())))
    ascend_norm.rms_norm_forward(**call, **outputs)
    data, sf = quant_reference().per_token_cast_ref(rms_norm_rows(want[0]), call["layout"])
    assert same(outputs["data"], data) and same(outputs["sf"], sf)
    assert same(outputs["y"], want[0]) if with_y else outputs["y"].shape == (0,)


def test_ascend_keys_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    with pytest.raises(LimitError, match="hidden size"):
        ascend_norm.build_rms_norm_forward(96, "bfloat16", True, True, 64)
    with pytest.raises(LimitError, match="input dtype"):
        ascend_norm.build_rms_norm_backward(256, "float16", True, True, True, 64, 64)
    with pytest.raises(LimitError, match="num_cores"):
        ascend_norm.build_rms_norm_forward(256, "bfloat16", True, True, 0)
    x = torch.empty(3, 192, dtype=BF16, device="meta")
    with pytest.raises(LimitError, match="hidden size"):  # the cast of y through per_token_cast: H % 128
        ascend_norm.forward_key(x, None, None, "1x64/e4m3/fp32/row/exact")


# --- device: the kernels against the oracle, the cast bitwise, the weight gradient reproducible, the peer ----------

DEVICE_TOKENS = level_choice([0, 1, 7, 4099], [0, 1, 2, 7, 513, 4099, 8195])
DEVICE_HIDDEN = level_choice([64, 7168, 32768], [64, 192, 2048, 4096, 7168, 8192, 32768])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("variant", FORWARD_VARIANTS + [dict(layout=l) for l in LAYOUTS[1:]] +
                         [dict(pitch="strided"), dict(lead="lead")], ids=lambda v: str(v))
def test_device_forward(hidden, variant, seed):
    """y and rstd within tolerance of the oracle, residual_out exact, the cast bitwise the quant reference's cast of
    the kernel's own y (and the same bytes without y)."""
    layout = variant.get("layout", "1x32/e4m3/ue8m0/col_tma/round")
    if layout is not None and hidden % ScaleLayout.parse(layout).block[1]:
        pytest.skip("the group does not divide H")
    for tokens in DEVICE_TOKENS:
        kw = dict(variant)
        if kw.get("pitch") == "strided":
            kw["pitch"] = hidden + 64
        if kw.get("lead") == "lead":
            if tokens % 7:
                continue
            kw["lead"] = (7, tokens // 7)
        call = rms_norm_forward_call(tokens, hidden, seed=seed + tokens, device="cuda", **kw)
        out = ops.rms_norm_forward(**call)
        check_forward(call, out)
        if call["layout"] is not None:
            y = out[0].cpu()
            data, sf = quant_reference().per_token_cast_ref(rms_norm_rows(y), call["layout"])
            assert same(out[3], data) and same(out[4], sf)
            alone = ops.rms_norm_forward(**{**call, "with_y": False})
            assert same(alone[3], out[3]) and same(alone[4], out[4])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("variant", BACKWARD_VARIANTS + [dict(pitch="strided")], ids=lambda v: str(v))
def test_device_backward_and_reproducible_weight_gradient(hidden, variant, seed):
    for tokens in DEVICE_TOKENS:
        kw = dict(variant)
        if kw.get("pitch") == "strided":
            kw["pitch"] = hidden + 64
        call = rms_norm_backward_call(tokens, hidden, seed=seed + tokens, device="cuda", **kw)
        check_backward(call)
        if call["grad_weight"] is not None:
            runs = []
            for _ in range(3):
                call["grad_weight"].zero_()
                ops.rms_norm_backward(**call)
                runs.append(call["grad_weight"].clone())
            assert all(torch.equal(runs[0], r) for r in runs[1:])  # bitwise run to run


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_device_against_the_peer(dtype, seed):
    """tile_kernels' norm_forward / norm_backward on the same inputs (its sizes: H <= 8192): residual_out bitwise, y
    and grad_x within one ulp of each other's, rstd relative 1e-5; its fused cast (e4m3, groups of 32) bitwise our
    cast on every row where the two y rows are bitwise equal (the cast of the same y is the same bytes)."""
    peer = pytest.importorskip("tile_kernels.quant")
    for tokens, hidden in ((4001, 2048), (4001, 7168), (8001, 4096)):
        call = rms_norm_forward_call(tokens, hidden, seed=seed, dtype=dtype, device="cuda", layout=None)
        y, rstd, residual_out, _, _ = ops.rms_norm_forward(**call)
        py, prstd, pres = peer.norm_forward(call["x"], call["weight"], call["eps"], call["residual"],
                                            call["out_scale"], with_rstd=True)
        assert same(residual_out, pres)
        assert_within(rstd.cpu(), prstd.cpu().to(F64), RSTD_RTOL, 0.0, "rstd vs peer")
        assert_within(y.cpu(), py.cpu().to(F64), what="y vs peer", **PEER_TOL[dtype])
        if dtype == BF16:
            for layout, opts in (("1x32/e4m3/ue8m0/col_tma/round", dict(use_tma_aligned_col_major_sf=True,
                                                                         round_sf=True, use_packed_ue8m0=True)),
                                 ("1x32/e4m3/fp32/row/exact", {})):
                ours = ops.rms_norm_forward(**{**call, "layout": layout, "with_y": True})
                (pdata, psf), pout, _, _ = peer.norm_forward_and_per_token_cast(
                    call["x"], call["weight"], call["eps"], "e4m3", 32, call["residual"], call["out_scale"],
                    with_out_bf16=True, **opts)
                rows_equal = (ours[0] == pout).all(dim=-1)
                assert rows_equal.any()
                assert torch.equal(ours[3].view(torch.uint8)[rows_equal], pdata.view(torch.uint8)[rows_equal])
                assert torch.equal(ours[4][rows_equal], psf[rows_equal])
        back = rms_norm_backward_call(tokens, hidden, seed=seed, dtype=dtype, device="cuda")
        gx = ops.rms_norm_backward(**back)
        pw = torch.zeros_like(back["grad_weight"])
        pgx, _ = peer.norm_backward(back["grad_y"], back["x"], back["weight"], back["rstd"],
                                    back["grad_residual_out"], back["out_scale"], pw)
        assert_within(gx.cpu(), pgx.cpu().to(F64), what="grad_x vs peer",
                      **{**PEER_TOL[dtype], "atol": GRAD_TOL[dtype]["atol"]})
        assert torch.allclose(back["grad_weight"], pw, rtol=1e-4, atol=1e-3)
