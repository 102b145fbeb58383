"""``per_token_cast_and_cast_back`` (docs/ops/quant.md#per_token_cast_and_cast_back): validation, the fake on
meta tensors, the reference against the cast followed by the cast back, strided rows, opcheck, torch.compile (CPU
tier, the reference as the CPU kernel); the CUDA kernel lowered to sm_90a cubins and the Ascend 950 kernel to
AscendC within the UB budget at the sizes that matter, their launch arguments and keys (CPU tier); and on a GPU the
CUDA kernel bitwise against the reference and against the peer (DeepSeek's tile_kernels) when it imports."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from quant_cases import per_token_cast_and_cast_back_call, sample
from quant_ref import cast_back_ref, per_token_cast_and_cast_back_ref, quantize
from quant_testing import layouts

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.quant import ScaleLayout

BF16, F32 = torch.bfloat16, torch.float32
HAVE_NVCC = shutil.which("nvcc") is not None


LAYOUTS = layouts("per_token")
SOME_LAYOUTS = ["1x128/e4m3/fp32/row/exact", "1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/ue8m0/row/round",
                "1x16/e2m1/e4m3/col_tma/exact", "1x64/e4m3/fp32/col_tma/round"]


# --- validation -------------------------------------------------------------------------------------------


def _bad_calls():
    x = torch.zeros(3, 256, dtype=BF16)
    return [
        ({"x": x.double()}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32, got torch.float64"),
        ({"x": x[0]}, ValueError, r"'x': expected a 2-D tensor of shape \(T, H\), got shape \(256,\)"),
        ({"x": torch.zeros(3, 192, dtype=BF16)}, ValueError, r"'x': expected a hidden size a multiple of 128 in "
                                                             r"\[128, 32768\], got 192"),
        ({"x": torch.zeros(256, 3, dtype=BF16).t()}, ValueError, r"'x': expected rows of unit column stride"),
        ({"x": torch.zeros(3, 260, dtype=BF16)[:, :256]}, ValueError, r"'x': expected a row stride of at least H = "
                                                                      r"256 and a multiple of 8 elements"),
        ({"x": torch.zeros(3, 256, dtype=BF16, requires_grad=True)}, ValueError,
         r"'x': expected a buffer that autograd does not track"),
        ({"layout": 128}, TypeError, r"'layout': expected a str, got int 128"),
        ({"layout": "1x128/e4m3/fp32/row"}, ValueError, r"'layout': expected a ScaleLayout spec .* must have 5 parts"),
        ({"layout": "1x128/e4m3/e4m3/row/round"}, ValueError, r"'layout': .*'round_sf' must be False"),
        ({"layout": "128x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token layout, got "
                                                                r"'128x128/e4m3/fp32/row/exact' \(a per-block block"),
        ({"layout": "32x1/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token layout"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument_and_writes_nothing(change, error, message):
    call = {**per_token_cast_and_cast_back_call(3, 256), **change}
    before = call["x"].detach().clone() if isinstance(call["x"], torch.Tensor) else None
    with without_cpu_references(), pytest.raises(
            error, match=rf"cann_ops_tilelang::per_token_cast_and_cast_back: argument {message}"):
        ops.per_token_cast_and_cast_back(**call)
    assert torch.equal(call["x"].detach(), before)


# --- the reference, the fake, opcheck, compile ------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equals_the_cast_then_the_cast_back(layout, seed):
    """The op (its CPU kernel, the reference) equals per_token_cast followed by cast_back to x's dtype, bitwise, for
    bf16 and fp32 x (storage and packing do not change the values)."""
    for dtype in (BF16, F32):
        x = sample(7, 256, seed=seed, dtype=dtype)
        q = quantize(x, layout)
        want = cast_back_ref(q.data, q.sf, layout, dtype)
        ops.per_token_cast_and_cast_back(x, layout)
        assert torch.equal(x, want), (layout, dtype)


def test_storage_and_packing_do_not_matter_but_rounding_does(seed):
    x = sample(5, 512, seed=seed)
    outs = {}
    for layout in ("1x32/e4m3/fp32/row/round", "1x32/e4m3/ue8m0/col_tma/round", "1x32/e4m3/fp32/col_tma/round",
                   "1x32/e4m3/fp32/row/exact"):
        y = x.clone()
        ops.per_token_cast_and_cast_back(y, layout)
        outs[layout] = y
    first = outs["1x32/e4m3/fp32/row/round"]
    assert all(torch.equal(first, outs[k]) for k in list(outs)[1:3])
    assert not torch.equal(first, outs["1x32/e4m3/fp32/row/exact"])


def test_strided_rows_are_taken_and_never_touched_past_h(seed):
    for dtype, pitch in ((BF16, 264), (F32, 260)):
        call = per_token_cast_and_cast_back_call(5, 256, seed=seed, dtype=dtype, pitch=pitch)  # NaN past H
        x = call["x"]
        want = x.contiguous()
        per_token_cast_and_cast_back_ref(want, SOME_LAYOUTS[2])
        ops.per_token_cast_and_cast_back(x, SOME_LAYOUTS[2])
        assert torch.equal(x, want)
        base = x.as_strided((5, pitch), (pitch, 1))
        assert bool(torch.isnan(base[:, 256:]).all())


def test_fake_on_meta_returns_nothing_and_keeps_x():
    for tokens in (0, 5):
        x = torch.empty(tokens, 256, dtype=BF16, device="meta")
        assert ops.per_token_cast_and_cast_back(x, SOME_LAYOUTS[0]) is None
        assert x.shape == (tokens, 256) and x.dtype == BF16


@pytest.mark.parametrize("layout", SOME_LAYOUTS)
@pytest.mark.parametrize("tokens", [0, 3])
def test_opcheck(layout, tokens, seed):
    call = per_token_cast_and_cast_back_call(tokens, 256, seed=seed, layout=layout,
                                             dtype=F32 if "e2m1" in layout else BF16)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.per_token_cast_and_cast_back.default, tuple(call.values()))


def qat_model(x, layout):
    y = x * 2.0
    ops.per_token_cast_and_cast_back(y, layout)
    return y.sum(dim=1)


def test_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(qat_model, backend="aot_eager", fullgraph=True, dynamic=True)
    for layout in (SOME_LAYOUTS[1], SOME_LAYOUTS[2]):
        first = True
        for tokens in (7, 9, 17):
            x = sample(tokens, 256, seed=seed + tokens)
            with torch._dynamo.config.patch(error_on_recompile=not first):
                got = compiled(x, layout)
            first = False
            assert torch.equal(got, qat_model(x, layout)), (layout, tokens)


def test_zero_tokens_launch_nothing(monkeypatch):
    from cann_ops_tilelang import _library

    calls = []
    monkeypatch.setattr(_library, "_backend_module", lambda *_: calls.append(1))
    for layout in SOME_LAYOUTS:
        assert ops.per_token_cast_and_cast_back.backend_kernel("cuda")(torch.zeros(0, 256, dtype=BF16), layout) is None
    assert calls == []


# --- the CUDA kernel: lowering, launch arguments, keys -------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.quant import per_token_cast_and_cast_back as cuda_fq  # noqa: E402

HIDDEN = level_choice([128, 7168], list(limits.QUANT_HIDDEN_SIZES))
CASES = [(h, name) for h in HIDDEN for name in sorted(cuda_fq.FAKE_QUANT.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", CASES, ids=[f"H{h}-{n}" for h, n in CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    built = cuda_build.compile_cubin(cuda_fq.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == cuda_fq.FAKE_QUANT_PLAN.threads
    assert not undeclared(f"per_token_cast_and_cast_back/{name}", built.source, declared_vector_args())
    src = built.source
    assert "__fdiv_rn(" in src and "__fmul_rn(" in src and "__shfl_xor_sync(" in src
    # x read and written in 16-byte vectors
    assert src.count("*(uint4*)(x + ") + src.count("*(float4*)(x + ") >= 2
    key = cuda_fq.FAKE_QUANT.case_keys(hidden, 4)[name]
    if key.fmt == "e4m3":
        assert "(fp8_e4_t)__fmul_rn(" in src  # __nv_fp8_e4m3(float): RNE, __NV_SATFINITE


def test_the_key_ignores_storage_packing_tokens_and_stride(monkeypatch):
    seen = []
    monkeypatch.setattr(cuda_fq.FAKE_QUANT, "compiled", lambda key: lambda *args: seen.append((key, args)))
    for layout in ("1x32/e4m3/fp32/row/round", "1x32/e4m3/ue8m0/col_tma/round", "1x32/e4m3/fp32/col_tma/round"):
        for tokens, pitch in ((1, None), (9, 264)):
            x = sample(tokens, 256, dtype=BF16) if pitch is None else \
                per_token_cast_and_cast_back_call(tokens, 256, pitch=pitch)["x"]
            cuda_fq.per_token_cast_and_cast_back(x=x, layout=layout)
            assert seen[-1][1][0] is x
    assert {k for k, _ in seen} == {cuda_fq.FakeQuantKey(256, 32, "bfloat16", "e4m3", "round")}
    prim_func = cuda_fq.FAKE_QUANT.prim_func(seen[-1][0])
    from tvm import tirx

    x = prim_func.buffer_map[prim_func.params[0]]
    assert isinstance(x.shape[0], tirx.Var) and isinstance(x.strides[0], tirx.Var)


def test_builders_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    build = cuda_fq.build_per_token_cast_and_cast_back
    for hidden in (limits.QUANT_HIDDEN.low - 128, limits.QUANT_HIDDEN.high + 128, 192):
        with pytest.raises(LimitError, match="hidden size"):
            build(hidden, 128, "bfloat16", "e4m3", "exact")
    with pytest.raises(LimitError, match="input dtype"):
        build(256, 128, "float16", "e4m3", "exact")
    with pytest.raises(LimitError, match="scale must be"):
        build(256, 128, "bfloat16", "e4m3", "ue8m0")
    with pytest.raises(LimitError, match="per-token"):
        cuda_fq.fake_quant_key(256, "bfloat16", ScaleLayout((128, 128)))


# --- the Ascend 950 kernel ---------------------------------------------------------------------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import per_token_cast_and_cast_back as ascend_fq  # noqa: E402

ASCEND_CASES = sorted(ascend_fq.per_token_cast_and_cast_back_cases(limits.QUANT_HIDDEN_SIZES[0], 4))


@pytest.mark.parametrize("hidden", limits.QUANT_HIDDEN_SIZES)
@pytest.mark.parametrize("name", ASCEND_CASES)
def test_ascend_lowers_within_ub(hidden, name):
    key = ascend_fq.per_token_cast_and_cast_back_cases(hidden, 4)[name]
    lowered = ascend_build.lower_ascendc(ascend_fq.FAKE_QUANT.prim_func(key))
    assert "__global__" in lowered.source and not lowered.has_simt
    hk = ascend_fq.tiling(key.hidden, key.group, key.in_dtype, key.fmt)
    assert 0 < lowered.ub_bytes <= ascend_fq.tile_ub_bytes(hk, key.group, key.in_dtype, key.fmt) \
        <= ascend_build.UB_BUDGET_BYTES
    src = lowered.source
    if key.fmt == "e2m1":
        assert "float4_e2m1x2_t" in src and "vlds_unpack4" in src  # narrowed to e2m1 and widened back
    else:
        assert "vcvt<fp8_e4_t>" in src and "RS_ENABLE" in src
    if key.in_dtype == "bfloat16":
        assert "vcvt<bfloat16_t>" in src
    if key.scale != "round":
        assert "vdiv_0ulp_ftz_true" in src  # the correctly rounded divisions


def test_ascend_key_checks_and_launcher(monkeypatch):
    LimitError = limits.LimitError
    good = dict(hidden=2048, group=128, in_dtype="bfloat16", fmt="e4m3", scale="exact", num_cores=64)
    ascend_fq.check_key("t", **good)
    for change, match in [(dict(hidden=100), "a multiple of 128"), (dict(group=48), "group must be one of"),
                          (dict(in_dtype="float16"), "x must be one of"), (dict(scale="ue8m0"), "scale must be"),
                          (dict(num_cores=0), "num_cores")]:
        with pytest.raises(LimitError, match=match):
            ascend_fq.build_per_token_cast_and_cast_back(**{**good, **change})
    calls = []
    monkeypatch.setattr(ascend_fq.FAKE_QUANT, "compiled", lambda key: lambda *args: calls.append((key, args)))
    x = torch.empty(5, 256, dtype=F32, device="meta")
    ascend_fq.per_token_cast_and_cast_back(x=x, layout="1x16/e2m1/ue8m0/col_tma/round")
    key, (x_arg,) = calls[-1]
    assert x_arg is x and key == ascend_fq.FakeQuantKey(256, 16, "float32", "e2m1", "round", key.num_cores)


# --- device: the kernel bitwise against the reference and the peer ------------------------------------------

DEVICE_TOKENS = level_choice([1, 37, 4001], [1, 2, 37, 513, 4001, 8192])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_kernel_bitwise(layout, seed):
    for hidden in (128, 7168):
        for tokens in DEVICE_TOKENS:
            for dtype, pitch in ((BF16, None), (F32, None), (BF16, hidden + 64)):
                call = per_token_cast_and_cast_back_call(tokens, hidden, seed=seed + tokens, layout=layout,
                                                         dtype=dtype, pitch=pitch, device="cuda")
                want = call["x"].cpu().contiguous()
                per_token_cast_and_cast_back_ref(want, layout)
                ops.per_token_cast_and_cast_back(**call)
                assert torch.equal(call["x"].cpu(), want), (layout, tokens, hidden, dtype, pitch)
                if pitch is not None:  # the columns past H untouched
                    assert bool(torch.isnan(call["x"].as_strided((tokens, pitch), (pitch, 1))[:, hidden:]).all())


@requires_cuda
@pytest.mark.device
def test_device_extremes_bitwise(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 512, generator=gen)
    x[0] = 0.0
    x[1] *= 1e30
    x[2] *= 1e-30
    x[3, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -6.0, 0.0, -0.0, 7, 1])
    for layout in LAYOUTS:
        for dtype in (BF16, F32):
            want = x.to(dtype)
            per_token_cast_and_cast_back_ref(want, layout)
            got = x.to(dtype).cuda()
            ops.per_token_cast_and_cast_back(got, layout)
            assert torch.equal(got.cpu(), want), (layout, dtype)


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", [s for s in LAYOUTS if "/row/" in s])
def test_device_equals_the_peer(layout, seed):
    """DeepSeek's tile_kernels (when importable) on the same inputs, bitwise (its H % 64 == 0 sizes)."""
    peer = pytest.importorskip("tile_kernels.quant")
    s = ScaleLayout.parse(layout)
    for tokens, hidden in ((512, 2048), (4001, 7168)):
        for dtype in (BF16, F32):
            x = sample(tokens, hidden, seed=seed, dtype=dtype).cuda()
            mine, theirs = x.clone(), x.clone()
            ops.per_token_cast_and_cast_back(mine, layout)
            peer.per_token_cast_and_cast_back(theirs, s.fmt, s.block[1], round_sf=s.round_sf,
                                              use_e4m3_sf=s.sf == "e4m3")
            assert torch.equal(mine, theirs), (layout, tokens, dtype)
