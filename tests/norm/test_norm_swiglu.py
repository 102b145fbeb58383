"""Tests of ``swiglu_forward`` / ``swiglu_backward`` (docs/ops/norm.md#swiglu): the reference against the float64
oracle within the documented tolerances, the counters, the expert padding, the fused cast (the quant reference of
the op's own rounded result), validation, both backends' lowering, the launchers' views, and on a device the
kernels against the reference and the peer (DeepSeek's tile_kernels, when it imports)."""

import shutil

import pytest
import torch
from _plugins.device import requires_cuda, requires_device
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from norm_cases import SWIGLU_CLAMP, swiglu_backward_call, swiglu_expert_offsets, swiglu_forward_call, swiglu_x
from norm_ref import (quant_reference, swiglu_backward_f64, swiglu_backward_ref, swiglu_forward_f64,
                      swiglu_forward_ref, swiglu_rows_valid)

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
HAVE_NVCC = shutil.which("nvcc") is not None
# docs/ops/norm.md#swiglu: relative tolerances of y (and grad_x) against float64, by the result's dtype
RTOL = {F32: 2.0**-20, BF16: 2.0**-8}
# grad_x: the fp32 error relative to the magnitude of its terms; grad_routing_weight: relative to sum |dy act|
TERM_RTOL, SUM_RTOL = 2.0**-19, 2.0**-16
TINY = 2.0**-126


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).view(torch.uint8)


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (got.dtype, got.shape, want.shape)
    assert torch.equal(bits(got), bits(want))


def assert_y_close(y, want64, dtype):
    """``|y - y64| <= rtol |y64|`` (plus fp32's smallest normal)."""
    y = y.detach().cpu().reshape(want64.shape).double()
    bound = RTOL[dtype] * want64.abs() + TINY
    assert ((y - want64).abs() <= bound).all(), float(((y - want64).abs() - bound).max())


def assert_grads_close(grad_x, grad_w, call, x2):
    """grad_x: ``|e| <= rtol |ref| + 2^-19 M`` (M the magnitude of its terms); grad_routing_weight:
    ``|e| <= 2^-16 f sum |dy act|``."""
    want, size, want_w, size_w = swiglu_backward_f64(call["grad_y"].cpu(), x2.cpu(), _cpu(call["routing_weight"]),
                                                     call["routed_scaling_factor"], call["clamp"],
                                                     _cpu(call["expert_offsets"]), call["alignment"])
    got = grad_x.detach().cpu().reshape(want.shape).double()
    bound = RTOL[grad_x.dtype] * want.abs() + TERM_RTOL * size + TINY
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() - bound).max())
    if want_w is None:
        assert grad_w.shape == (0,)
    else:
        err = (grad_w.cpu().double() - want_w).abs()
        assert (err <= SUM_RTOL * size_w + TINY).all(), float(err.max())


def _cpu(t):
    return None if t is None else t.cpu()


def x_rows(call):
    """x's fp32 rows ``(T, 2 H)`` (a quantized x dequantized as cast_back does)."""
    if call.get("x_sf") is not None:
        return quant_reference().cast_back_ref(call["x"].cpu(), call["x_sf"].cpu(), call["x_layout"], F32)
    x = call["x"].cpu()
    return x.reshape(-1, x.shape[-1]).float()


def forward_oracle(call):
    return swiglu_forward_f64(call["x"].cpu(), _cpu(call["routing_weight"]), call["routed_scaling_factor"],
                              call["clamp"], _cpu(call["expert_offsets"]), call["alignment"])


def counts_of(call) -> torch.Tensor:
    """The counters one call adds, counted directly in float64."""
    x2 = call["x"].cpu().reshape(-1, call["x"].shape[-1]).double()
    hidden, c = x2.shape[1] // 2, call["clamp"]
    valid = swiglu_rows_valid(x2.shape[0], _cpu(call["expert_offsets"]), call["alignment"])
    g, u = x2[valid, :hidden], x2[valid, hidden:]
    return torch.tensor([(g > c).sum(), (u > c).sum(), (u < -c).sum(), valid.sum() * hidden], dtype=torch.int64)


# --- the reference against the float64 oracle ----------------------------------------------------------------

FORWARD_VARIANTS = {
    "plain": dict(weighted=False, clamp=None, layout=None),
    "weighted": dict(layout=None, clamp=None),
    "clamped": dict(weighted=False, layout=None),
    "all": dict(experts=True),
}


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("variant", sorted(FORWARD_VARIANTS))
@pytest.mark.parametrize("hidden", [64, 1024])
def test_forward_reference_within_tolerance_of_float64(dtype, variant, hidden, seed):
    call = swiglu_forward_call(37, hidden, seed=seed, dtype=dtype, **FORWARD_VARIANTS[variant])
    before = None if call["clamped_count"] is None else call["clamped_count"].clone()
    y, data, sf = swiglu_forward_ref(**call)
    assert_y_close(y, forward_oracle(call), dtype)
    assert y.dtype == dtype and y.shape == (37, hidden)
    if before is not None:
        assert torch.equal(call["clamped_count"] - before, counts_of(call))
    if call["layout"] is None:
        assert data.shape == (0,) and sf.shape == (0,)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("variant", ["plain", "weighted", "all", "quantized"])
@pytest.mark.parametrize("hidden", [64, 1024])
def test_backward_reference_within_tolerance_of_float64(dtype, variant, hidden, seed):
    options = {"plain": dict(weighted=False, clamp=None, layout=None, recompute=False),
               "weighted": dict(clamp=None, layout=None), "all": dict(experts=True),
               "quantized": dict(quantized="1x64/e4m3/fp32/row/exact", experts=True)}[variant]
    call = swiglu_backward_call(37, hidden, seed=seed, dtype=dtype, **options)
    grad_x, grad_w, y, data, sf = swiglu_backward_ref(**call)
    assert grad_x.dtype == call["grad_y"].dtype and grad_x.shape == (37, 2 * hidden)
    assert_grads_close(grad_x, grad_w, call, x_rows(call))
    if call["recompute"]:
        forward = swiglu_forward_ref(x_rows(call), call["routing_weight"], call["routed_scaling_factor"],
                                     call["clamp"], None, call["expert_offsets"], call["alignment"])[0]
        forward = forward.to(grad_x.dtype)  # exact for x's dtype (y of fp32 rows rounded once)
        assert_bitwise(y, forward)  # the recomputed y is the forward's, same order
    else:
        assert y.shape == (0,)


def test_clamped_gradients_are_zero_and_padding_rows_zero(seed):
    call = swiglu_backward_call(40, 128, seed=seed, dtype=F32, experts=True, layout=None)
    grad_x, grad_w, y, _, _ = swiglu_backward_ref(**call)
    x2, c = call["x"], SWIGLU_CLAMP
    assert (grad_x[:, :128][x2[:, :128] > c] == 0).all()
    assert (grad_x[:, 128:][x2[:, 128:].abs() > c] == 0).all()
    valid = swiglu_rows_valid(40, call["expert_offsets"], call["alignment"])
    assert not valid.all() and valid.any()
    assert (grad_x[~valid] == 0).all() and (grad_w[~valid] == 0).all() and (y[~valid] == 0).all()
    forward = swiglu_forward_call(40, 128, seed=seed, dtype=F32, experts=True, layout=None)
    forward["x"][~valid] = float("nan")  # padding rows are never read
    assert (swiglu_forward_ref(**forward)[0][~valid] == 0).all()


@pytest.mark.parametrize("tokens", [1, 5, 40, 300])
@pytest.mark.parametrize("alignment", [1, 4, 128])
def test_expert_rows(tokens, alignment):
    """The launchers' row flags (device ops) are the reference's segments, empty segments and trailing padding
    included."""
    from cann_ops_tilelang.norm.swiglu import expert_rows

    for offsets in (swiglu_expert_offsets(tokens, alignment=alignment), torch.tensor([0, tokens], dtype=torch.int32),
                    torch.tensor([tokens // 3, tokens // 3, tokens], dtype=torch.int32)):
        want = swiglu_rows_valid(tokens, offsets, alignment)
        assert torch.equal(expert_rows(offsets, tokens, alignment).bool(), want)


# --- the op on the CPU (the references as its kernels): shapes, the cast, edges --------------------------------


@pytest.mark.parametrize("layout", ["1x128/e4m3/fp32/row/exact", "1x32/e4m3/ue8m0/col_tma/round",
                                    "1x64/e2m1/e4m3/row/exact"])
@pytest.mark.parametrize("with_y", [False, True])
def test_forward_cast_is_the_per_token_cast_of_y(layout, with_y, seed):
    call = swiglu_forward_call(19, 256, seed=seed, layout=layout, with_y=with_y, lead=(19,))
    y, data, sf = ops.swiglu_forward(**call)
    plain = ops.swiglu_forward(**{**call, "layout": None, "clamped_count": None})[0]
    want = quant_reference().per_token_cast_ref(plain.reshape(19, 256), layout)
    assert_bitwise(data, want[0])
    assert_bitwise(sf, want[1])
    assert_bitwise(y, plain) if with_y else (y.shape == (0,))
    assert y.shape == ((19, 256) if with_y else (0,))


def test_backward_cast_is_the_per_token_cast_of_grad_x(seed):
    layout = "1x128/e4m3/ue8m0/row/round"
    call = swiglu_backward_call(21, 256, seed=seed, layout=layout)
    grad_x, _, _, data, sf = ops.swiglu_backward(**call)
    want = quant_reference().per_token_cast_ref(grad_x.reshape(21, 512), layout)
    assert_bitwise(data, want[0])
    assert_bitwise(sf, want[1])


def test_leading_dims_and_strided_rows(seed):
    flat = swiglu_forward_call(12, 128, seed=seed, layout=None, count=False)
    want = ops.swiglu_forward(**flat)[0]
    lead = ops.swiglu_forward(**{**flat, "x": flat["x"].reshape(3, 4, 256)})[0]
    assert lead.shape == (3, 4, 128) and torch.equal(lead.reshape(12, 128), want)
    wide = torch.full((12, 256 + 64), float("nan"), dtype=BF16)
    wide[:, :256] = flat["x"]
    assert torch.equal(ops.swiglu_forward(**{**flat, "x": wide[:, :256]})[0], want)
    back = swiglu_backward_call(12, 128, seed=seed, layout=None, lead=(3, 4), pitch=256 + 32)
    grad_x, _, y, _, _ = ops.swiglu_backward(**back)
    assert grad_x.shape == (3, 4, 256) and y.shape == (3, 4, 128)
    dense = ops.swiglu_backward(**{**back, "x": back["x"].contiguous()})
    assert torch.equal(grad_x, dense[0]) and torch.equal(y, dense[2])


def test_zero_tokens_write_nothing():
    call = swiglu_forward_call(0, 128, lead=(0, 5))
    before = call["clamped_count"].clone()
    y, data, sf = ops.swiglu_forward(**call)
    assert y.shape == (0, 5, 128) and data.shape == (0, 128) and torch.equal(call["clamped_count"], before)
    grad_x, grad_w, y, data, sf = ops.swiglu_backward(**swiglu_backward_call(0, 128, lead=(0, 5)))
    assert grad_x.shape == (0, 5, 256) and grad_w.shape == (0,) and y.shape == (0, 5, 128)
    assert data.shape == (0, 256)


@pytest.mark.parametrize("hidden", [64, 32768])
def test_hidden_size_edges(hidden, seed):
    call = swiglu_forward_call(2, hidden, seed=seed, dtype=F32)
    y = ops.swiglu_forward(**call)[0]
    assert_y_close(y, forward_oracle(call), F32)
    back = swiglu_backward_call(2, hidden, seed=seed, dtype=F32)  # no cast of grad_x rows past 32768
    assert (back["layout"] is None) == (hidden > limits.QUANT_HIDDEN.high // 2)
    grad_x, grad_w = ops.swiglu_backward(**back)[:2]
    assert_grads_close(grad_x, grad_w, back, x_rows(back))


# --- validation: the op and the argument named, nothing written ---------------------------------------------


def _forward_bad():
    x = torch.zeros(3, 256, dtype=BF16)
    return [
        ({"x": x.half()}, TypeError, r"'x': expected dtype"),
        ({"x": torch.zeros(3, 251, dtype=BF16)}, ValueError, r"'x': expected a last dim of 2 H"),
        ({"x": torch.zeros(3, 96, dtype=BF16)}, ValueError, r"'x': expected a hidden size a multiple of 64"),
        ({"routing_weight": torch.ones(3, dtype=BF16)}, TypeError, r"'routing_weight': expected dtype"),
        ({"routing_weight": torch.ones(4)}, ValueError, r"'routing_weight': expected shape \(3,\)"),
        ({"routing_weight": None}, ValueError, r"'routed_scaling_factor': expected 1.0 without a routing_weight"),
        ({"clamp": 0.0}, ValueError, r"'clamp': expected a number > 0"),
        ({"clamp": None}, ValueError, r"'clamped_count': expected a clamp"),
        ({"clamped_count": torch.zeros(4, dtype=torch.int32)}, TypeError, r"'clamped_count': expected dtype"),
        ({"clamped_count": torch.zeros(3, dtype=torch.int64)}, ValueError, r"'clamped_count': expected shape"),
        ({"expert_offsets": torch.zeros(2, dtype=torch.int64)}, TypeError, r"'expert_offsets': expected dtype"),
        ({"expert_offsets": torch.zeros(0, dtype=torch.int32)}, ValueError, r"'expert_offsets': expected the"),
        ({"alignment": 0}, ValueError, r"'alignment': expected an alignment"),
        ({"layout": "128x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token layout"),
        ({"layout": "1x128/e4m3/fp32/row/exact", "x": torch.zeros(3, 128, dtype=BF16)}, ValueError,
         r"'layout': expected a group dividing H = 64"),
        ({"layout": "1x32/e4m3/fp32/row/exact", "x": torch.zeros(3, 128, dtype=BF16)}, ValueError,
         r"'layout': expected a cast of rows of a multiple of 128"),
        ({"with_y": 1}, TypeError, r"'with_y': expected a bool"),
    ]


@pytest.mark.parametrize("change,error,message", _forward_bad(), ids=[str(i) for i in range(len(_forward_bad()))])
def test_forward_validation(change, error, message):
    call = {**swiglu_forward_call(3, 128), **change}
    before = call["clamped_count"].clone() if isinstance(call["clamped_count"], torch.Tensor) else None
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::swiglu_forward: argument "
                                                              rf"{message}"):
        ops.swiglu_forward(**call)
    if before is not None and call["clamped_count"].shape == before.shape:
        assert torch.equal(call["clamped_count"], before)


def _backward_bad():
    q = "1x64/e4m3/fp32/row/exact"
    return [
        ({"grad_y": torch.zeros(3, 128, dtype=F32)}, TypeError, r"'grad_y': expected dtype torch.bfloat16"),
        ({"grad_y": torch.zeros(3, 64, dtype=BF16)}, ValueError, r"'grad_y': expected shape \(3, 128\)"),
        ({"x_sf": torch.zeros(3, 4)}, ValueError, r"'x_layout': expected both x_sf and x_layout"),
        ({"x_layout": q}, ValueError, r"'x_sf': expected both"),
        ({"layout": "1x128/e4m3/fp32/row/exact", "grad_y": torch.zeros(3, 32768, dtype=BF16),
          "x": torch.zeros(3, 65536, dtype=BF16)}, ValueError, r"'layout': expected a cast of rows of"),
        ({"layout": "1x128/e4m3/fp32/row/exact", "grad_y": torch.zeros(3, 64, dtype=BF16),
          "x": torch.zeros(3, 128, dtype=BF16)}, ValueError, r"'layout': expected a group dividing H = 64"),
    ]


@pytest.mark.parametrize("change,error,message", _backward_bad(), ids=[str(i) for i in range(len(_backward_bad()))])
def test_backward_validation(change, error, message):
    call = {**swiglu_backward_call(3, 128), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::swiglu_backward: argument "
                                                              rf"{message}"):
        ops.swiglu_backward(**call)


def test_backward_quantized_x_validation():
    call = swiglu_backward_call(3, 128, quantized="1x64/e4m3/fp32/row/exact")
    with without_cpu_references(), pytest.raises(ValueError, match=r"'x_layout': expected an e4m3 layout"):
        ops.swiglu_backward(**{**call, "x_layout": "1x64/e2m1/fp32/row/exact"})
    with without_cpu_references(), pytest.raises(ValueError, match=r"'x_sf': expected shape"):
        ops.swiglu_backward(**{**call, "x_sf": call["x_sf"][:, :2]})


# --- the CUDA kernels: lowering, launch views --------------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.norm import swiglu as cuda_swiglu  # noqa: E402

HIDDEN = level_choice([64, 7168], list(limits.NORM_HIDDEN_SIZES))
CUDA_CASES = [(h, kernel.name, name) for h in HIDDEN for kernel in cuda_swiglu.KERNELS.values()
              for name in sorted(kernel.case_keys(h, 1))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,kernel,name", CUDA_CASES, ids=[f"H{h}-{n}" for h, _, n in CUDA_CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, kernel, name):
    kernel = cuda_swiglu.KERNELS[kernel]
    key = kernel.case_keys(hidden, 1)[name]
    built = cuda_build.compile_cubin(kernel.prim_func(key), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == cuda_swiglu.ROW_PLAN.warps * cuda_swiglu.WARP
    src = built.source
    # the contract's arithmetic: expf, IEEE division and products; the rows read in 16-byte vectors
    assert "expf(" in src and "__fdiv_rn(" in src and "__fmul_rn(" in src
    # x's rows in 16-byte vectors (8 bytes of e4m3 for a quantized x: one vector per bf16 gradient vector)
    assert any(f"*({kind}*)(x + " in src for kind in ("uint4", "float4", "fp8_e4_8_t"))
    if getattr(key, "weighted", False) and kernel is cuda_swiglu.BACKWARD or getattr(key, "counted", False):
        assert "__shfl_xor_sync(" in src  # the per-row sums: a butterfly, no atomics
    assert "atomic" not in src.lower()


def test_token_count_and_row_strides_are_dynamic():
    from tvm import tirx

    for kernel in cuda_swiglu.KERNELS.values():
        prim_func = next(iter(kernel.case_keys(256, 1).values()))
        prim_func = kernel.prim_func(prim_func)
        x = prim_func.buffer_map[prim_func.params[0]]
        assert isinstance(x.shape[0], tirx.Var) and isinstance(x.strides[0], tirx.Var)


def _check_views(kernel, key, args, tokens):
    from tvm import tirx

    prim_func = kernel.prim_func(key)
    params = [prim_func.buffer_map[p] for p in prim_func.params if p in prim_func.buffer_map]
    for buffer, arg in zip(params, args):
        assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
        for dim, size in zip(buffer.shape, arg.shape):
            if isinstance(dim, tirx.IntImm):
                assert int(dim) == size, (buffer.name, list(buffer.shape), tuple(arg.shape))
            elif buffer.name in ("x", "y", "grad_x", "grad_y", "counts") and dim.name == "num_tokens":
                assert size == tokens
        assert arg.numel() == 0 or arg.stride(-1) == 1


@pytest.mark.parametrize("backend", ["cuda", "ascend"])
@pytest.mark.parametrize("tokens", [1, 6])
def test_launchers_pass_the_views_the_kernels_declare(backend, tokens, monkeypatch):
    """Each launcher hands its kernel the buffers the prim_func describes (empty optional tensors included), adds
    the kernel's counters to clamped_count and runs the quant kernels for the cast and a quantized x."""
    module = cuda_swiglu if backend == "cuda" else pytest.importorskip(
        "cann_ops_tilelang.kernels.ascend.norm.swiglu")
    seen, casts = [], []
    for kernel in module.KERNELS.values():
        monkeypatch.setattr(kernel, "compiled", lambda key, kernel=kernel: lambda *args: seen.append((kernel, key,
                                                                                                      args)))
    monkeypatch.setattr(module.swiglu_op, "cast_into", lambda *args: casts.append(("cast", args)))

    def dequantized(x, x_sf, x_layout, dtype):
        casts.append(("cast_back", (x, x_sf, x_layout, dtype)))
        return x.new_empty(x.shape, dtype=dtype)

    if backend == "ascend":
        monkeypatch.setattr(module, "cast_back", dequantized)
    if backend == "ascend":
        monkeypatch.setattr(module, "num_vector_cores", lambda: 64)
    call = swiglu_forward_call(tokens, 256, experts=True, pitch=512 + 64)
    before = call["clamped_count"].clone()
    outputs = dict(zip(("y", "data", "sf"), ops.swiglu_forward.prepare(**call)))
    module.swiglu_forward(**call, **outputs)
    kernel, key, args = seen[-1]
    _check_views(kernel, key, args, tokens)
    assert key.weighted and key.clamped and key.counted and key.masked
    if backend == "cuda":  # the cast fused: data and the scales' buffer passed to the kernel, y not written
        assert (key.group, key.writes_y) == (128, True) and args[5] is outputs["data"] and not casts
    else:
        assert casts[-1][0] == "cast" and casts[-1][1][0].shape == (tokens, 256)
    partials = args[4]
    if backend == "cuda":  # uninitialized counts (the kernel did not run): the launcher adds their column sums
        assert torch.equal(call["clamped_count"] - before, partials.sum(0, dtype=torch.int64))
    back = swiglu_backward_call(tokens, 256, quantized="1x128/e4m3/fp32/row/exact", experts=True)
    outputs = dict(zip(("grad_x", "grad_routing_weight", "y", "data", "sf"), ops.swiglu_backward.prepare(**back)))
    module.swiglu_backward(**back, **outputs)
    kernel, key, args = seen[-1]
    _check_views(kernel, key, args, tokens)
    if backend == "cuda":  # dequantized and cast in the kernel: the data, its scales, the cast's buffers
        assert (key.in_dtype, key.x_group, key.x_sf, key.group) == ("e4m3", 128, "fp32", 64)
        assert args[0] is back["x"] and args[8] is outputs["data"] and not casts
    else:
        assert (key.in_dtype, key.out_dtype, key.recompute) == ("float32", "bfloat16", True)
        assert [c[0] for c in casts[-2:]] == ["cast_back", "cast"]
    assert len({k for _, k, _ in seen}) == 2  # neither T nor a stride is in the keys


def test_builders_refuse_what_the_limits_refuse():
    for hidden in (limits.NORM_HIDDEN.low - 64, limits.NORM_HIDDEN.high + 64, 96):
        with pytest.raises(limits.LimitError, match="hidden size"):
            cuda_swiglu.build_swiglu_forward(hidden, "bfloat16", False, False, False, False)
    with pytest.raises(limits.LimitError, match="bfloat16 or float32"):
        cuda_swiglu.build_swiglu_backward(256, "float16", "bfloat16", False, False, False, False)


# --- the Ascend 950 kernels: lowered to AscendC within the UB budget ------------------------------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend.norm import swiglu as ascend_swiglu  # noqa: E402

ASCEND_CASES = [(h, kernel.name, name) for h in HIDDEN for kernel in ascend_swiglu.KERNELS.values()
                for name in sorted(kernel.case_keys(h, 1))]


@pytest.mark.parametrize("hidden,kernel,name", ASCEND_CASES, ids=[f"H{h}-{n}" for h, _, n in ASCEND_CASES])
def test_ascend_lowers_within_ub(hidden, kernel, name):
    kernel = ascend_swiglu.KERNELS[kernel]
    key = kernel.case_keys(hidden, 1)[name]
    lowered = ascend_build.lower_ascendc(kernel.prim_func(key))
    assert "__global__" in lowered.source and not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (key, lowered.ub_bytes)
    assert "vexpdif" in lowered.source or "vexp" in lowered.source


def test_ascend_hidden_tiles():
    """The whole row up to H = 16384 in the bf16 forward; the tiles always divide H."""
    assert ascend_swiglu.forward_tile(16384, "bfloat16") == 16384
    for hidden in limits.NORM_HIDDEN_SIZES:
        for tile in (ascend_swiglu.forward_tile(hidden, "float32"),
                     ascend_swiglu.backward_tile(hidden, "float32", "bfloat16", True)):
            assert hidden % tile == 0 and tile % 64 == 0


def test_ascend_launcher_sums_the_partials(monkeypatch):
    """The counters are the int64 sums of the tasks' partial counts; grad_routing_weight the partial dots summed
    over the hidden tiles times the factor."""
    monkeypatch.setattr(ascend_swiglu, "num_vector_cores", lambda: 64)

    def forward_kernel(key):
        def run(x2, y2, weight, valid, partials, factor, clamp):
            partials.zero_()
            partials[:, :, 1:4] = torch.tensor([1.0, 2.0, 3.0])
        return run

    def backward_kernel(key):
        def run(x2, gy, gx, y2, weight, valid, partials, factor, clamp):
            partials.zero_()
            partials[:, :, 0] = torch.arange(partials.shape[1], dtype=F32) + 0.5
        return run

    monkeypatch.setattr(ascend_swiglu.FORWARD, "compiled", forward_kernel)
    monkeypatch.setattr(ascend_swiglu.BACKWARD, "compiled", backward_kernel)
    hidden, tokens = 32768, 3
    call = swiglu_forward_call(tokens, hidden, experts=True, alignment=1, layout=None)
    before = call["clamped_count"].clone()
    outputs = dict(zip(("y", "data", "sf"), ops.swiglu_forward.prepare(**call)))
    ascend_swiglu.swiglu_forward(**call, **outputs)
    tiles = hidden // ascend_swiglu.forward_tile(hidden, "bfloat16")
    valid = int(swiglu_rows_valid(tokens, call["expert_offsets"], 1).sum())
    assert torch.equal(call["clamped_count"] - before,
                       torch.tensor([tokens * tiles, 2 * tokens * tiles, 3 * tokens * tiles, valid * hidden]))
    back = swiglu_backward_call(tokens, hidden, layout=None, dtype=F32)
    outputs = dict(zip(("grad_x", "grad_routing_weight", "y", "data", "sf"), ops.swiglu_backward.prepare(**back)))
    ascend_swiglu.swiglu_backward(**back, **outputs)
    tiles = hidden // ascend_swiglu.backward_tile(hidden, "float32", "float32", True)
    assert tiles > 1
    want = sum(t + 0.5 for t in range(tiles)) * back["routed_scaling_factor"]
    assert torch.allclose(outputs["grad_routing_weight"], torch.full((tokens,), want))


# --- device: the kernels against the reference, the float64 oracle and the peer ------------------------------

DEVICE_TOKENS = level_choice([0, 1, 7, 4133], [0, 1, 7, 513, 4133], [0, 1, 7, 513, 4133, 16411])
DEVICE_HIDDEN = level_choice([64, 7168], [64, 2048, 7168], list(limits.NORM_HIDDEN_SIZES))


def _to(call, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}


@requires_device
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("variant", sorted(FORWARD_VARIANTS))
def test_device_forward(device, dtype, variant, seed):
    """y within tolerance of float64, the counters equal to the reference's, the cast's bytes equal to the quant
    reference of the kernel's own y, all bitwise the same on a second run."""
    for hidden in DEVICE_HIDDEN:
        for tokens in DEVICE_TOKENS:
            call = swiglu_forward_call(tokens, hidden, seed=seed + tokens, dtype=dtype, **FORWARD_VARIANTS[variant])
            cpu = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in call.items()}
            dev = _to(call, device)
            if dev["layout"] is not None:
                dev["with_y"] = True
            y, data, sf = ops.swiglu_forward(**dev)
            assert_y_close(y, forward_oracle(cpu), dtype)
            if cpu["clamped_count"] is not None:
                swiglu_forward_ref(**cpu)
                assert torch.equal(dev["clamped_count"].cpu(), cpu["clamped_count"])
            if dev["layout"] is not None:
                want = quant_reference().per_token_cast_ref(y.cpu().reshape(tokens, hidden), dev["layout"])
                assert_bitwise(data, want[0])
                assert_bitwise(sf, want[1])
            again = ops.swiglu_forward(**{**dev, "clamped_count": None})
            assert_bitwise(again[0], y)
            if dev["layout"] is not None:  # the cast alone: the same bytes
                alone = ops.swiglu_forward(**{**dev, "clamped_count": None, "with_y": False})
                assert alone[0].shape == (0,)
                assert_bitwise(alone[1], data)
                assert_bitwise(alone[2], sf)


CAST_LAYOUTS = ["1x128/e4m3/fp32/row/exact", "1x128/e4m3/ue8m0/col_tma/round", "1x32/e4m3/ue8m0/row/round",
                "1x16/e4m3/e4m3/col_tma/exact", "1x64/e4m3/fp32/row/round", "1x32/e2m1/ue8m0/row/round",
                "1x16/e2m1/e4m3/col_tma/exact"]


@requires_device
@pytest.mark.parametrize("layout", CAST_LAYOUTS)
def test_device_forward_cast_layouts(device, layout, seed):
    """The fused cast of every kind (formats, scales, storages, groups 16 to 128) bitwise the quant reference of the
    kernel's own y, with y and alone, from bf16 and fp32, ragged token counts and padding rows."""
    for dtype in (BF16, F32):
        for hidden, tokens in ((128, 7), (4096, 4133)):
            call = _to(swiglu_forward_call(tokens, hidden, seed=seed, dtype=dtype, layout=layout, experts=True,
                                           count=False), device)
            y, data, sf = ops.swiglu_forward(**call)
            want = quant_reference().per_token_cast_ref(y.cpu().reshape(tokens, hidden), layout)
            assert_bitwise(data, want[0])
            assert_bitwise(sf, want[1])
            alone = ops.swiglu_forward(**{**call, "with_y": False})
            assert_bitwise(alone[1], data)
            assert_bitwise(alone[2], sf)


@requires_device
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("variant", ["plain", "all", "quantized"])
def test_device_backward(device, dtype, variant, seed):
    """grad_x and grad_routing_weight within tolerance of float64, the recomputed y bitwise the forward kernel's,
    the cast's bytes the quant reference of the kernel's own grad_x, grad_routing_weight bitwise run to run."""
    options = {"plain": dict(weighted=False, clamp=None, layout=None, recompute=False), "all": dict(experts=True),
               "quantized": dict(quantized="1x128/e4m3/fp32/row/exact", experts=True)}[variant]
    for hidden in DEVICE_HIDDEN:
        if variant == "quantized" and 2 * hidden > limits.QUANT_HIDDEN.high:
            continue  # a quantized x's rows are per-token cast rows: 2 H <= 32768
        for tokens in DEVICE_TOKENS:
            call = swiglu_backward_call(tokens, hidden, seed=seed + tokens, dtype=dtype, **options)
            dev = _to(call, device)
            grad_x, grad_w, y, data, sf = ops.swiglu_backward(**dev)
            assert_grads_close(grad_x, grad_w, call, x_rows(call))
            if dev["recompute"]:
                x_for = dev["x"] if dev["x_sf"] is None else \
                    ops.cast_back(dev["x"], dev["x_sf"], dev["x_layout"], torch.float32)
                forward = ops.swiglu_forward(x_for, dev["routing_weight"], dev["routed_scaling_factor"], dev["clamp"],
                                             None, dev["expert_offsets"], dev["alignment"])[0]
                if dev["x_sf"] is None:
                    assert_bitwise(y, forward)
                else:
                    assert_y_close(y, forward.cpu().double(), BF16)
            if dev["layout"] is not None:
                want = quant_reference().per_token_cast_ref(grad_x.cpu().reshape(tokens, 2 * hidden), dev["layout"])
                assert_bitwise(data, want[0])
                assert_bitwise(sf, want[1])
            again = ops.swiglu_backward(**dev)
            assert_bitwise(again[0], grad_x)
            assert_bitwise(again[1], grad_w)


@requires_device
def test_device_strided_rows_and_leading_dims(device, seed):
    call = _to(swiglu_forward_call(4133, 7168, seed=seed, layout=None, count=False), device)
    want = ops.swiglu_forward(**call)[0]
    wide = torch.zeros(4133, 2 * 7168 + 64, dtype=BF16, device=device)
    wide[:, : 2 * 7168] = call["x"]
    assert_bitwise(ops.swiglu_forward(**{**call, "x": wide[:, : 2 * 7168]})[0], want)
    lead = ops.swiglu_forward(**{**call, "x": call["x"][:4128].reshape(4, 1032, 2 * 7168),
                                 "routing_weight": call["routing_weight"][:4128]})[0]
    assert_bitwise(lead.reshape(4128, 7168), want[:4128])
    back = _to(swiglu_backward_call(513, 7168, seed=seed, layout=None, pitch=2 * 7168 + 32), device)
    dense = ops.swiglu_backward(**{**back, "x": back["x"].contiguous()})
    for got, w in zip(ops.swiglu_backward(**back), dense):
        assert_bitwise(got, w)


# --- device: against the peer ------------------------------------------------------------------------------------


def _peer():
    peer = pytest.importorskip("tile_kernels.quant")
    from tile_kernels import config

    return peer, config


@requires_cuda
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("experts", [False, True])
def test_device_forward_equals_the_peer(dtype, experts, seed):
    """tile_kernels' swiglu_forward (its fp32 / bf16 output, weight, clamp and counters, 128-aligned segments) on
    the same inputs: y within tolerance (its rows of the segments; it leaves padding rows unwritten), the
    counters equal."""
    peer, config = _peer()
    config.set_token_alignment(128)
    for tokens, hidden in ((4001, 2048), (8001, 7168)):
        call = _to(swiglu_forward_call(tokens, hidden, seed=seed, dtype=dtype, layout=None, experts=experts,
                                       alignment=128), "cuda")
        clamped = torch.zeros(4, dtype=torch.int64, device="cuda")
        theirs = peer.swiglu_forward(call["x"], "fp32", call["expert_offsets"], call["routing_weight"],
                                     call["routed_scaling_factor"], call["clamp"], clamped)
        y = ops.swiglu_forward(**{**call, "clamped_count": torch.zeros(4, dtype=torch.int64, device="cuda")})
        counts = torch.zeros(4, dtype=torch.int64, device="cuda")
        ops.swiglu_forward(**{**call, "clamped_count": counts})
        assert torch.equal(counts, clamped)
        valid = swiglu_rows_valid(tokens, _cpu(call["expert_offsets"]), 128)
        ours = y[0].cpu()[valid]
        assert_y_close(ours, theirs.cpu()[valid].double(), dtype)


@requires_cuda
@pytest.mark.parametrize("layout", ["1x128/e4m3/fp32/row/exact", "1x32/e4m3/fp32/row/exact",
                                    "1x128/e4m3/ue8m0/col_tma/round", "1x32/e4m3/fp32/row/round"])
def test_device_forward_cast_equals_the_peer(layout, seed):
    """tile_kernels' swiglu_forward_and_per_token_cast: bitwise from fp32 x (its cast takes the same fp32 values
    that ours rounds to fp32, no change); from bf16 x it casts the unrounded fp32 values, ours the bf16-rounded y
    (the contract), so there only most bytes agree (a double rounding near e4m3 midpoints, scales of a different
amax)."""
    from cann_ops_tilelang.quant import ScaleLayout

    peer, config = _peer()
    s = ScaleLayout.parse(layout)
    for dtype in (F32, BF16):
        call = _to(swiglu_forward_call(4001, 4096, seed=seed, dtype=dtype, layout=layout, count=False), "cuda")
        _, data, sf = ops.swiglu_forward(**call)
        their_data, their_sf = peer.swiglu_forward_and_per_token_cast(
            call["x"], "e4m3", s.block[1], None, call["routing_weight"], call["routed_scaling_factor"],
            use_tma_aligned_col_major_sf=s.storage == "col_tma", round_sf=s.round_sf,
            use_packed_ue8m0=s.sf == "ue8m0", clamp_value=call["clamp"])
        if dtype == F32:
            assert_bitwise(data, their_data)
            assert_bitwise(sf, their_sf)
        else:
            same = (data.view(torch.uint8) == their_data.view(torch.uint8)).float().mean().item()
            assert same > 0.9


@requires_cuda
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("experts", [False, True])
def test_device_backward_equals_the_peer(dtype, experts, seed):
    """tile_kernels' swiglu_backward (weight, clamp, recompute, segments): grad_x, the routing weight's gradient
    and y within the tolerances against each other's float64 distance."""
    peer, config = _peer()
    config.set_token_alignment(128)
    for tokens, hidden in ((4001, 2048), (8001, 7168)):
        call = _to(swiglu_backward_call(tokens, hidden, seed=seed, dtype=dtype, layout=None, experts=experts,
                                        alignment=128), "cuda")
        fmt = "fp32" if dtype == F32 else "bf16"
        grad_x, weight_grad, act = peer.swiglu_backward(call["x"], call["grad_y"], fmt, call["expert_offsets"],
                                                        call["routing_weight"], call["routed_scaling_factor"],
                                                        call["clamp"], True)
        ours = ops.swiglu_backward(**call)
        cpu = {k: _cpu(v) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        assert_grads_close(grad_x, weight_grad, cpu, x_rows(cpu))
        assert_grads_close(ours[0], ours[1], cpu, x_rows(cpu))
        valid = swiglu_rows_valid(tokens, cpu["expert_offsets"], 128)
        assert_y_close(ours[2].cpu()[valid], act.cpu()[valid].double(), dtype)


@requires_cuda
def test_device_backward_quantized_equals_the_peer(seed):
    """tile_kernels' FP8 path (e4m3 x with fp32 1x128 scales, its e4m3 grad cast): grad_x within tolerance."""
    peer, config = _peer()
    config.set_token_alignment(128)
    layout = "1x128/e4m3/fp32/row/exact"
    call = _to(swiglu_backward_call(4001, 4096, seed=seed, quantized=layout, layout=layout), "cuda")
    result = peer.swiglu_backward_and_per_token_cast((call["x"], call["x_sf"]), call["grad_y"], "e4m3", 128, None,
                                                     call["routing_weight"], call["routed_scaling_factor"],
                                                     clamp_value=call["clamp"], do_recompute=True)
    cpu = {k: _cpu(v) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    assert_grads_close(result[0], result[2], cpu, x_rows(cpu))
    ours = ops.swiglu_backward(**call)
    assert_grads_close(ours[0], ours[1], cpu, x_rows(cpu))
