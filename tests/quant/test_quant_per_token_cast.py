"""``per_token_cast`` and its variants ``per_token_cast_sf``, ``per_token_cast_with_sf`` and re-quantization
(``x_sf`` / ``x_layout``) (docs/ops/quant.md#per_token_cast): validation, the fake against the reference on meta
tensors, opcheck, torch.compile and the ``quantize`` wrapper (CPU tier, the reference as the CPU kernel); the CUDA
kernels lowered to sm_90a cubins and the Ascend 950 kernels to AscendC within the UB budget at the sizes that
matter, their launch views and keys (CPU tier); and on a GPU the CUDA kernels bitwise against the reference and
against the peer (DeepSeek's tile_kernels) when it imports."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from quant_cases import per_token_cast_call, per_token_cast_sf_call, per_token_cast_with_sf_call, sample, to_device
from quant_ref import (per_token_cast_ref, per_token_cast_sf_ref, per_token_cast_with_sf_ref,
                       per_token_quantize_ref)
from quant_testing import assert_compiles_once, assert_same, layouts, metadata

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.quant import QuantTensor, ScaleLayout

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
        ({"x": torch.zeros(3, 32768 + 128, dtype=BF16)}, ValueError, r"'x': expected a hidden size"),
        ({"x": torch.zeros(256, 3, dtype=BF16).t()}, ValueError, r"'x': expected rows of unit column stride"),
        ({"x": torch.zeros(3, 260, dtype=BF16)[:, :256]}, ValueError, r"'x': expected a row stride of at least H = "
                                                                      r"256 and a multiple of 8 elements"),
        ({"x": torch.zeros(3, 258, dtype=F32)[:, :256]}, ValueError, r"'x': .*multiple of 4 elements \(16 bytes\)"),
        ({"layout": 128}, TypeError, r"'layout': expected a str, got int 128"),
        ({"layout": "1x128/e4m3/fp32/row"}, ValueError, r"'layout': expected a ScaleLayout spec .* must have 5 parts"),
        ({"layout": "1x8/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a ScaleLayout spec .* 'block'"),
        ({"layout": "1x128/e4m3/ue8m0/row/exact"}, ValueError, r"'layout': .*'round_sf' must be True"),
        ({"layout": "1x128/e5m2/fp32/row/exact"}, ValueError, r"'layout': .*'fmt' must be one of"),
        ({"layout": "128x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token layout, got "
                                                                r"'128x128/e4m3/fp32/row/exact' \(a per-block block"),
        ({"layout": "32x1/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token layout"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**per_token_cast_call(3, 256), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::per_token_cast: argument {message}"):
        ops.per_token_cast(**call)


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_validation_refuses_32_bit_offsets_past_the_limit(device):
    """T times the row pitch reaches 2**31 elements: refused by name (on fake tensors, no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = 4096
        tokens = 2**31 // hidden
        with pytest.raises(ValueError, match=r"'x': expected elements T \* row pitch of x in \[0, 2147483647\], got "
                                             r"2147483648"):
            ops.per_token_cast(torch.empty(tokens, hidden, dtype=BF16, device=device), SOME_LAYOUTS[0])
        data, sf = ops.per_token_cast(torch.empty(tokens - 1, hidden, dtype=BF16, device=device), SOME_LAYOUTS[1])
        assert data.shape == (tokens - 1, hidden) and sf.shape == (tokens - 1, 8) and sf.stride() == (1, tokens)


def test_strided_rows_are_taken_and_never_read_past_h(seed):
    for dtype, pitch in ((BF16, 264), (F32, 260)):
        call = per_token_cast_call(5, 256, seed=seed, dtype=dtype, pitch=pitch)  # NaN past H
        assert call["x"].stride() == (pitch, 1)
        for layout in SOME_LAYOUTS:
            got = ops.per_token_cast(call["x"], layout)
            want = per_token_cast_ref(call["x"].contiguous(), layout)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), layout


# --- the fake, the reference, opcheck, compile ------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_matches_reference_on_every_layout(layout, seed):
    for tokens, dtype in ((0, BF16), (1, F32), (5, BF16)):
        real = ops.per_token_cast(**per_token_cast_call(tokens, 256, seed=seed, layout=layout, dtype=dtype))
        fake = ops.per_token_cast(**per_token_cast_call(tokens, 256, seed=seed, layout=layout, dtype=dtype,
                                                        device="meta"))
        assert [metadata(t) for t in fake] == [metadata(t) for t in real], (tokens, layout)
        s = ScaleLayout.parse(layout)
        assert real[0].shape == s.data_shape(tokens, 256) and real[1].dtype == s.sf_dtype("cuda")


def test_the_op_reference_is_the_contracts_cast(seed):
    """per_token_cast_ref (the op's CPU kernel) is the contract's cast on CUDA bytes, tested in test_quant_ref.py."""
    x = sample(9, 512, seed=seed)
    for layout in SOME_LAYOUTS:
        data, sf = per_token_cast_ref(x, layout)
        q = per_token_quantize_ref(x, layout, backend="cuda")
        assert torch.equal(data, q.data) and torch.equal(sf, q.sf) and sf.stride() == q.sf.stride()


@pytest.mark.parametrize("layout", SOME_LAYOUTS)
@pytest.mark.parametrize("tokens", [0, 3])
def test_opcheck(layout, tokens, seed):
    call = per_token_cast_call(tokens, 256, seed=seed, layout=layout, dtype=F32 if "e2m1" in layout else BF16)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.per_token_cast.default, tuple(call.values()))


def quant_model(x, layout):
    q = ops.quantize(x, layout)
    return q.data.view(torch.uint8).float().sum(dim=1), q.sf


def test_compile_fullgraph_dynamic_no_recompile(seed):
    assert_compiles_once(quant_model, (ScaleLayout.parse(SOME_LAYOUTS[1]), SOME_LAYOUTS[2]), (7, 9, 17), seed)


def test_zero_tokens_launch_nothing(monkeypatch):
    """On the device path (the CUDA kernel of declare, its launcher stubbed): T = 0 gives empty outputs of the
    layout's shapes and calls no launcher."""
    from cann_ops_tilelang import _library

    calls = []
    monkeypatch.setattr(_library, "_backend_module", lambda *_: calls.append(1))
    for layout in SOME_LAYOUTS:
        data, sf = ops.per_token_cast.backend_kernel("cuda")(torch.zeros(0, 256, dtype=BF16), layout)
        s = ScaleLayout.parse(layout)
        assert data.shape == s.data_shape(0, 256) and sf.shape == s.sf_shape(0, 256, "cuda")
    assert calls == []


# --- the variants: scales alone, data from given scales, re-quantization (CPU tier) ------------------------------

REQUANT_PAIRS = [  # (x_layout, layout): each input format, scale kind and storage, groups both ways
    ("1x128/e4m3/fp32/row/exact", "1x128/e4m3/ue8m0/col_tma/round"),
    ("1x32/e2m1/ue8m0/row/round", "1x128/e4m3/fp32/row/exact"),
    ("1x128/e4m3/ue8m0/col_tma/round", "1x16/e2m1/e4m3/col_tma/exact"),
    ("1x16/e2m1/e4m3/col_tma/exact", "1x64/e4m3/fp32/col_tma/round"),
    ("1x64/e4m3/e4m3/row/exact", "1x32/e2m1/ue8m0/row/round"),
]


def _variant_bad_calls():
    x = torch.zeros(3, 256, dtype=BF16)
    q = per_token_quantize_ref(x, "1x128/e4m3/ue8m0/col_tma/round")
    row = per_token_quantize_ref(x, "1x128/e4m3/fp32/row/exact")
    fp4 = per_token_quantize_ref(x, "1x32/e2m1/ue8m0/row/round")
    cols = "1x128/e4m3/ue8m0/col_tma/round"
    wide = torch.zeros(3, 1024, dtype=BF16)
    return [
        ("per_token_cast", {"x": q.data, "x_sf": q.sf}, ValueError, r"'x_layout': expected both x_sf and x_layout "
                                                                    r"\(re-quantization\) or neither"),
        ("per_token_cast", {"x": q.data, "x_layout": cols}, ValueError, r"'x_sf': expected both x_sf and x_layout"),
        ("per_token_cast", {"x": q.data, "x_sf": q.sf, "x_layout": "128x128/e4m3/fp32/row/exact"}, ValueError,
         r"'x_layout': expected a per-token layout"),
        ("per_token_cast", {"x": q.data, "x_sf": q.sf, "x_layout": "1x128/e4m3"}, ValueError,
         r"'x_layout': expected a ScaleLayout spec"),
        ("per_token_cast", {"x": x, "x_sf": q.sf, "x_layout": cols}, TypeError,
         r"'x': expected dtype torch.float8_e4m3fn \(the data of x_layout 1x128/e4m3/ue8m0/col_tma/round\), got "
         r"torch.bfloat16"),
        ("per_token_cast", {"x": fp4.data, "x_sf": fp4.sf, "x_layout": cols}, TypeError,
         r"'x': expected dtype torch.float8_e4m3fn"),
        ("per_token_cast", {"x": q.data, "x_sf": fp4.sf, "x_layout": "1x32/e2m1/ue8m0/row/round"}, TypeError,
         r"'x': expected dtype torch.uint8"),
        ("per_token_cast", {"x": fp4.data[:, :96], "x_sf": fp4.sf, "x_layout": "1x32/e2m1/ue8m0/row/round"},
         ValueError, r"'x': expected a hidden size a multiple of 128 in \[128, 32768\], got 192"),
        ("per_token_cast", {"x": torch.zeros(3, 264, dtype=torch.float8_e4m3fn)[:, :256], "x_sf": q.sf,
                            "x_layout": cols}, ValueError, r"'x': expected a row stride of at least 256 and a "
                                                           r"multiple of 16"),
        ("per_token_cast", {"x": q.data, "x_sf": row.sf, "x_layout": cols}, TypeError,
         r"'x_sf': expected the scales of layout 1x128/e4m3/ue8m0/col_tma/round .* must be torch.int32 on cuda"),
        ("per_token_cast", {"x": q.data, "x_sf": q.sf.contiguous()[:2], "x_layout": cols}, ValueError,
         r"'x_sf': .*must have shape \(3, 1\)"),
        ("per_token_cast", {"x": row.data, "x_sf": row.sf.t().contiguous().t(), "x_layout": row.layout.spec},
         ValueError, r"'x_sf': .*must have strides \(2, 1\) \(row\); got \(1, 3\)"),
        ("per_token_cast", {"x": q.data, "x_sf": [1], "x_layout": cols}, TypeError, r"'x_sf': expected a torch.Tensor "
                                                                                    r"or None"),
        ("per_token_cast_sf", {"x": x.double()}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32"),
        ("per_token_cast_sf", {"layout": "32x1/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-token"),
        ("per_token_cast_with_sf", {"sf": row.sf}, TypeError, r"'sf': expected the scales of layout "
                                                              r"1x128/e4m3/ue8m0/col_tma/round .* torch.int32"),
        ("per_token_cast_with_sf", {"x": wide, "sf": per_token_quantize_ref(wide, cols).sf.contiguous()}, ValueError,
         r"'sf': .*must have strides \(1, 4\) \(col_tma\); got \(2, 1\)"),
        ("per_token_cast_with_sf", {"sf": q.sf[:2]}, ValueError, r"'sf': .*must have shape \(3, 1\)"),
        ("per_token_cast_with_sf", {"layout": "1x128/e4m3/fp32/row/exact"}, TypeError,
         r"'sf': expected the scales of layout 1x128/e4m3/fp32/row/exact .* torch.float32"),
        ("per_token_cast_with_sf", {"sf": 1.0}, TypeError, r"'sf': expected a torch.Tensor, got float 1.0"),
        ("per_token_cast_with_sf", {"sf": q.sf.to("meta")}, ValueError, r"'sf': expected a tensor on cpu"),
    ]


VARIANT_CALLS = {"per_token_cast": per_token_cast_call, "per_token_cast_sf": per_token_cast_sf_call,
                 "per_token_cast_with_sf": per_token_cast_with_sf_call}


@pytest.mark.parametrize("op,change,error,message", _variant_bad_calls(),
                         ids=[str(i) for i in range(len(_variant_bad_calls()))])
def test_variant_validation_names_op_and_argument(op, change, error, message):
    call = {**VARIANT_CALLS[op](3, 256), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::{op}: argument {message}"):
        getattr(ops, op)(**call)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_variant_fakes_match_the_references_and_the_cast(layout, seed):
    """On every layout: the scales alone are the cast's scales, and the data from the cast's own scales is its data
    wherever the cast's ``inv`` is ``fl(1 / s)`` (power-of-two and e4m3 scales); fakes shaped as the references."""
    s = ScaleLayout.parse(layout)
    for tokens in (0, 5):
        call = per_token_cast_sf_call(tokens, 256, seed=seed, layout=layout)
        data, sf = ops.per_token_cast(**call)
        alone = ops.per_token_cast_sf(**call)
        assert torch.equal(alone, sf) and alone.stride() == sf.stride() or tokens == 0
        assert metadata(ops.per_token_cast_sf(**per_token_cast_sf_call(tokens, 256, layout=layout, device="meta"))) \
            == metadata(alone)
        given = ops.per_token_cast_with_sf(call["x"], sf, layout)
        fake = ops.per_token_cast_with_sf(**per_token_cast_with_sf_call(tokens, 256, layout=layout, device="meta"))
        assert metadata(fake) == metadata(given) == metadata(data)
        if s.round_sf or s.sf == "e4m3":
            assert torch.equal(given.view(torch.uint8), data.view(torch.uint8)), layout


def test_data_from_given_scales_uses_their_reciprocal(seed):
    """Scales of another draw (values far off their groups' amax: saturation and underflow): the data is
    ``Q(fl(x * fl(1 / s)))`` of the decoded scales, on the oracle's terms."""
    for layout in SOME_LAYOUTS:
        call = per_token_cast_with_sf_call(9, 512, seed=seed, layout=layout, sf_seed=seed + 1)
        got = ops.per_token_cast_with_sf(**call)
        s = ScaleLayout.parse(layout)
        from quant_ref import data_values, decode_sf, expand

        scale = expand(decode_sf(call["sf"], s, 9, 512, "cuda"), s.block, 9, 512)
        want = per_token_quantize_ref(call["x"].float() * (torch.ones_like(scale) / scale), ScaleLayout(
            s.block, s.fmt, "fp32", "row", True), sf=torch.ones(9, 512 // s.block[1]), backend="cuda")
        assert torch.equal(data_values(got, s.fmt), data_values(want, s.fmt)), layout
        assert (data_values(got, s.fmt).abs() == s.fmax).any()  # the other draw saturates somewhere


@pytest.mark.parametrize("x_layout,layout", REQUANT_PAIRS)
def test_requant_fake_matches_reference_and_quantize_takes_a_quant_tensor(x_layout, layout, seed):
    for tokens in (0, 5):
        call = per_token_cast_call(tokens, 512, seed=seed, layout=layout, x_layout=x_layout)
        real = ops.per_token_cast(**call)
        fake = ops.per_token_cast(**per_token_cast_call(tokens, 512, layout=layout, x_layout=x_layout,
                                                        device="meta"))
        assert [metadata(t) for t in fake] == [metadata(t) for t in real]
        q = ops.quantize(QuantTensor(call["x"], call["x_sf"], ScaleLayout.parse(x_layout)), layout)
        assert q.layout == ScaleLayout.parse(layout) and all(torch.equal(a, b) for a, b in zip(q[:2], real))
        # CUDA's order on the CPU (the reference's bytes): f32(data) * fl(sx * inv)
        want = per_token_quantize_ref(call["x"], layout, x_sf=call["x_sf"], x_layout=x_layout, backend="cuda")
        assert torch.equal(real[0].view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(real[1], want.sf)


def test_requant_from_power_of_two_scales_is_the_cast_of_the_values(seed):
    """From UE8M0 scales the two orders agree (``fl(sx * inv)`` is exact): re-quantizing equals casting the fp32
    values ``f32(data) * sx`` themselves, to any layout."""
    from quant_ref import cast_back_ref

    for source in ("1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/ue8m0/row/round"):
        q = ops.quantize(sample(7, 1024, seed=seed), source)
        values = cast_back_ref(q.data, q.sf, source, torch.float32)
        for layout in ("1x16/e2m1/e4m3/col_tma/exact", "1x128/e4m3/fp32/row/exact", "1x64/e4m3/ue8m0/row/round"):
            again, direct = ops.quantize(q, layout), ops.quantize(values, layout)
            assert torch.equal(again.data.view(torch.uint8), direct.data.view(torch.uint8)), (source, layout)
            assert torch.equal(again.sf, direct.sf), (source, layout)


VARIANT_OPCHECK = [("per_token_cast_sf", per_token_cast_sf_call, {}),
                   ("per_token_cast_with_sf", per_token_cast_with_sf_call, {}),
                   ("per_token_cast", per_token_cast_call, {"x_layout": REQUANT_PAIRS[1][0]})]


@pytest.mark.parametrize("op,make,extra", VARIANT_OPCHECK, ids=[f"{o}-{bool(e)}" for o, _, e in VARIANT_OPCHECK])
@pytest.mark.parametrize("tokens", [0, 3])
def test_variant_opcheck(op, make, extra, tokens, seed):
    call = make(tokens, 256, seed=seed, **extra)
    torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, op).default, tuple(call.values()))


def bits(t):
    """A tensor torch.equal can compare: float8 as its bytes."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def variant_model(x, sf, source, layout):
    q = ops.quantize(QuantTensor(*ops.quantize(x, source)[:2], source), layout)
    return q.data.view(torch.uint8).float().sum(dim=1), ops.per_token_cast_sf(x, layout.spec), \
        ops.per_token_cast_with_sf(x, sf, layout.spec)


def test_variants_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(variant_model, backend="aot_eager", fullgraph=True, dynamic=True)
    source, layout = ScaleLayout.parse(REQUANT_PAIRS[0][0]), ScaleLayout.parse(REQUANT_PAIRS[0][1])
    for i, tokens in enumerate((7, 9, 17)):
        call = per_token_cast_with_sf_call(tokens, 256, seed=seed + tokens, layout=layout.spec)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(call["x"], call["sf"], source, layout)
        want = variant_model(call["x"], call["sf"], source, layout)
        assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want)), tokens


def test_variants_launch_nothing_for_zero_tokens(monkeypatch):
    from cann_ops_tilelang import _library

    calls = []
    monkeypatch.setattr(_library, "_backend_module", lambda *_: calls.append(1))
    layout = SOME_LAYOUTS[1]
    sf = ops.per_token_cast_sf.backend_kernel("cuda")(torch.zeros(0, 256, dtype=BF16), layout)
    assert sf.shape == (0, 1) and sf.dtype == torch.int32
    data = ops.per_token_cast_with_sf.backend_kernel("cuda")(torch.zeros(0, 256, dtype=BF16), sf, layout)
    assert data.shape == (0, 256) and data.dtype == torch.float8_e4m3fn
    call = per_token_cast_call(0, 256, layout=layout, x_layout=REQUANT_PAIRS[1][0])
    data, sf = ops.per_token_cast.backend_kernel("cuda")(**call)
    assert data.shape == (0, 256) and sf.shape == (0, 1)
    assert calls == []


# --- the CUDA kernel: lowering, launch views, keys ----------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.quant import per_token_cast as cuda_cast  # noqa: E402

HIDDEN = level_choice([128, 7168], list(limits.QUANT_HIDDEN_SIZES))
CASES = [(h, name) for h in HIDDEN for name in sorted(cuda_cast.PER_TOKEN_CAST.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", CASES, ids=[f"H{h}-{n}" for h, n in CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    key = cuda_cast.PER_TOKEN_CAST.case_keys(hidden, 4)[name]
    built = cuda_build.compile_cubin(cuda_cast.PER_TOKEN_CAST.prim_func(key), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == cuda_cast.CAST_PLAN.threads
    assert not undeclared(f"per_token_cast/{name}", built.source, declared_vector_args())
    src = built.source
    # the reference's arithmetic: IEEE divisions and product, the hardware's RNE saturating e4m3 conversion
    assert "__fdiv_rn(" in src and "__fmul_rn(" in src and "__shfl_xor_sync(" in src
    if key.fmt == "e4m3":
        assert "__NV_SATFINITE, __NV_E4M3" in src
    # x is read in 16-byte vectors (the op declares it)
    assert "*(uint4*)(x + " in src or "*(float4*)(x + " in src


def test_the_cases_cover_both_inputs_formats_scales_and_storages():
    keys = cuda_cast.PER_TOKEN_CAST.case_keys(7168, 4).values()
    assert {k.in_dtype for k in keys} == {"bfloat16", "float32"} and {k.fmt for k in keys} == {"e4m3", "e2m1"}
    assert {k.sf for k in keys} == {"fp32", "e4m3", "ue8m0"} and {k.storage for k in keys} == {"row", "col_tma"}
    assert {k.group for k in keys} == {16, 32, 64, 128} and {k.round_sf for k in keys} == {False, True}


def test_token_count_and_row_stride_are_dynamic():
    from tvm import tirx

    prim_func = cuda_cast.lowering_cases(256)["per_token_cast_e4m3_fp32_row_bf16"]
    x = prim_func.buffer_map[prim_func.params[0]]
    assert isinstance(x.shape[0], tirx.Var) and isinstance(x.strides[0], tirx.Var)


@pytest.mark.parametrize("layout", SOME_LAYOUTS + ["1x128/e2m1/ue8m0/col_tma/round", "1x16/e4m3/ue8m0/row/round"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_launcher_passes_the_views_the_kernel_declares(layout, tokens, monkeypatch):
    """The launcher hands the kernel the buffers its parameters describe: col_tma scales as the transposed
    (padded) buffer, UE8M0 words as their bytes, each with the shape and unit inner stride of the prim_func's
    buffer; the key ignores T and the row stride."""
    from tvm import tirx

    seen = []
    monkeypatch.setattr(cuda_cast.PER_TOKEN_CAST, "compiled", lambda key: lambda *args: seen.append((key, args)))
    hidden = 512
    for dtype in (BF16, F32):
        x = sample(tokens, hidden + 16, dtype=dtype)[:, :hidden]
        data, sf = ops.per_token_cast.prepare(x, layout)
        cuda_cast.per_token_cast(x=x, layout=layout, x_sf=None, x_layout=None, data=data, sf=sf)
        key, (kx, kdata, ksf) = seen[-1]
        assert kx is x and kdata is data
        prim_func = cuda_cast.PER_TOKEN_CAST.prim_func(key)
        buffers = [prim_func.buffer_map[p] for p in prim_func.params]
        for buffer, arg in zip(buffers, (kx, kdata, ksf)):
            assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
            for dim, size in zip(buffer.shape, arg.shape):
                want = int(dim) if isinstance(dim, tirx.IntImm) else tokens if isinstance(dim, tirx.Var) else \
                    4 * tokens  # the only expression: the UE8M0 bytes of the transposed words
                assert want == size, (buffer.name, list(buffer.shape), tuple(arg.shape))
            assert arg.stride(-1) == 1
        assert ksf.untyped_storage().data_ptr() == sf.untyped_storage().data_ptr()
    keys = {k for k, _ in seen}
    assert len(keys) == 2  # one per input dtype: neither T nor the row stride is in the key


def test_builders_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    build = cuda_cast.build_per_token_cast
    for hidden in (limits.QUANT_HIDDEN.low - 128, limits.QUANT_HIDDEN.high + 128, 192):
        with pytest.raises(LimitError, match="hidden size"):
            build(hidden, 128, "bfloat16", "e4m3", "fp32", "row", False)
    with pytest.raises(LimitError, match="input dtype"):
        build(256, 128, "float16", "e4m3", "fp32", "row", False)
    with pytest.raises(ValueError, match="block"):
        build(256, 8, "bfloat16", "e4m3", "fp32", "row", False)
    with pytest.raises(LimitError, match="per-token"):
        cuda_cast.cast_key("per_token_cast", 256, "bfloat16", ScaleLayout((128, 128)))

VARIANT_KERNELS = (cuda_cast.PER_TOKEN_CAST_SF, cuda_cast.PER_TOKEN_CAST_WITH_SF, cuda_cast.PER_TOKEN_CAST_REQUANT)
VARIANT_CASES = [(h, kernel.name, name) for h in HIDDEN for kernel in VARIANT_KERNELS
                 for name in sorted(kernel.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,kernel,name", VARIANT_CASES, ids=[f"H{h}-{n}" for h, _, n in VARIANT_CASES])
def test_cuda_variants_compile_to_sm90a_cubins(hidden, kernel, name):
    kernel = cuda_cast.KERNELS[kernel]
    key = kernel.case_keys(hidden, 4)[name]
    built = cuda_build.compile_cubin(kernel.prim_func(key), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == cuda_cast.CAST_PLAN.threads
    assert not undeclared(f"per_token_cast/{name}", built.source, declared_vector_args())
    src = built.source
    if kernel is cuda_cast.PER_TOKEN_CAST_SF:  # the amax and the scales, no data
        assert "__shfl_xor_sync(" in src and "__NV_E4M3" not in src and "data" not in src
    elif kernel is cuda_cast.PER_TOKEN_CAST_WITH_SF:  # inv = 1 / s from the given scale, no amax, no scale written
        assert "__fdiv_rn(1." in src.replace("0x1p+0f", "1.") and "__shfl_xor_sync(" not in src
        assert "sf_out" not in src and "__NV_SATFINITE, __NV_E4M3" in src
    else:  # the input read in vectors (16 e4m3 bytes or 8 of e2m1 pairs), the factor fl(sx * inv) applied
        assert "*(uint2*)(x + " in src or "*(uint4*)(x + " in src
        assert src.count("__fmul_rn(") >= 3 and "__shfl_xor_sync(" in src


@pytest.mark.parametrize("tokens", [1, 5])
def test_variant_launchers_pass_the_views_the_kernels_declare(tokens, monkeypatch):
    """As for the cast: every buffer a variant's kernel takes has the shape, dtype and unit inner stride of its
    parameter (given scales and input scales included), and the keys ignore T."""
    from tvm import tirx

    seen = []
    for kernel in VARIANT_KERNELS:
        monkeypatch.setattr(kernel, "compiled", lambda key, kernel=kernel: lambda *args: seen.append((kernel, key,
                                                                                                      args)))
    hidden = 512
    for layout in ("1x128/e4m3/ue8m0/col_tma/round", "1x16/e2m1/e4m3/row/exact"):
        call = per_token_cast_with_sf_call(tokens, hidden, layout=layout)
        cuda_cast.per_token_cast_sf(x=call["x"], layout=layout, sf=call["sf"])
        cuda_cast.per_token_cast_with_sf(data=ops.per_token_cast_with_sf.prepare(**call), **call)
        for x_layout in ("1x32/e2m1/ue8m0/col_tma/round", "1x128/e4m3/fp32/row/exact"):
            req = per_token_cast_call(tokens, hidden, layout=layout, x_layout=x_layout)
            data, sf = ops.per_token_cast.prepare(**req)
            cuda_cast.per_token_cast(data=data, sf=sf, **req)
    assert len(seen) == 8
    for kernel, key, args in seen:
        prim_func = kernel.prim_func(key)
        for buffer, arg in zip([prim_func.buffer_map[p] for p in prim_func.params], args):
            assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
            for dim, size in zip(buffer.shape, arg.shape):
                want = int(dim) if isinstance(dim, tirx.IntImm) else tokens if isinstance(dim, tirx.Var) else \
                    4 * tokens  # the UE8M0 bytes of the transposed words
                assert want == size, (kernel.name, buffer.name, list(buffer.shape), tuple(arg.shape))
            assert arg.stride(-1) == 1
    assert {k.variant for _, k, _ in seen if isinstance(k, cuda_cast.CastKey)} == {"sf_only", "with_sf"}


def test_variant_keys_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    with pytest.raises(LimitError, match="variant must be one of"):
        cuda_cast.build_per_token_cast(256, 128, "bfloat16", "e4m3", "fp32", "row", False, "requant")
    with pytest.raises(LimitError, match="input layout must be per-token"):
        cuda_cast.requant_key("per_token_cast", 256, ScaleLayout((1, 128)), ScaleLayout((128, 128)))
    with pytest.raises(ValueError, match="block"):  # the input's layout checks itself
        cuda_cast.build_per_token_cast_requant(256, 128, "e4m3", "fp32", "row", False, "e4m3", 8, "fp32", "row")
    key = cuda_cast.requant_key("per_token_cast", 512, ScaleLayout.parse(SOME_LAYOUTS[1]),
                                ScaleLayout.parse("1x32/e2m1/ue8m0/row/round"))
    assert (key.x_fmt, key.x_group, key.x_sf, key.x_storage, key.hidden) == ("e2m1", 32, "ue8m0", "row", 512)


# --- the Ascend 950 kernel: lowered to AscendC within the UB budget at the sizes that matter ---------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import quant as ascend_quant  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import per_token_cast as ascend_cast  # noqa: E402

ASCEND_CASES = sorted(ascend_cast.per_token_cast_cases(limits.QUANT_HIDDEN_SIZES[0], 4))


def _lowers_within_budget(key):
    lowered = ascend_build.lower_ascendc(ascend_cast.PER_TOKEN_CAST.prim_func(key))
    assert "__global__" in lowered.source, lowered.source[:400]
    assert not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, f"{key}: UB {lowered.ub_bytes} B > {lowered.budget_bytes} B"
    # the tile formula the hidden tile is chosen by counts at least what the kernel requests
    til = ascend_cast.tiling(key.hidden, key.group, key.in_dtype, key.fmt, key.sf, key.storage, key.variant,
                             key.x_group, key.x_sf, key.x_storage)
    assert lowered.ub_bytes <= til.ub_bytes <= ascend_build.UB_BUDGET_BYTES, (key, lowered.ub_bytes, til)
    return lowered


@pytest.mark.parametrize("hidden", limits.QUANT_HIDDEN_SIZES)
@pytest.mark.parametrize("name", ASCEND_CASES)
def test_ascend_per_token_cast_lowers_within_ub(hidden, name):
    key = ascend_cast.per_token_cast_cases(hidden, 4)[name]
    lowered = _lowers_within_budget(key)
    source = lowered.source
    if key.variant == "requant":  # the input's data widened (e2m1 through bf16) and multiplied by its scales
        assert ("float4_e2m1x2_t" in source) == (key.in_dtype == "e2m1") and "vmul" in source
    if key.fmt == "e2m1":
        assert "float4_e2m1x2_t" in source  # bf16 (with the sticky bit) -> e2m1
    else:
        assert "vcvt<fp8_e4_t>" in source and "RS_ENABLE" in source  # fp32 -> e4m3, saturating
    if key.sf == "ue8m0":
        assert "vsts_pack_b32" in source  # the int16 words
    if not key.round_sf:
        assert "vdiv_0ulp_ftz_true" in source  # the correctly rounded a / max, max / a (or 1 / s)


def test_family_aggregates_the_cases():
    hidden = limits.QUANT_HIDDEN_SIZES[0]
    cases = ascend_quant.lowering_cases(hidden)
    assert {f"per_token_cast/{name}" for name in ASCEND_CASES} <= set(cases)
    assert all(name.startswith("per_token_cast_") for name in ASCEND_CASES)
    variants = {f"per_token_cast/{name}" for kernel in ascend_cast.KERNELS.values()
                for name in kernel.case_keys(hidden, 4)}
    assert variants <= set(cases) and len(variants) == len(ASCEND_CASES) + 2  # one case of sf only, one of with sf


@pytest.mark.parametrize("hidden,storage,in_dtype", [
    (384, "row", "bfloat16"),  # one tile, 3 groups: the second byte of word 1 zeroed (a lane mask)
    (384, "col_tma", "bfloat16"),  # the same, a zeroed word row half
    (128 * 63, "row", "bfloat16"),  # no 256-multiple divides H: a ragged last tile of 7 groups
    (128 * 63, "col_tma", "float32"),  # ragged last tile of 1 group
])
def test_ascend_per_token_cast_odd_words_and_ragged_tiles_lower(hidden, storage, in_dtype):
    key = ascend_cast.PerTokenCastKey(hidden, 128, in_dtype, "e4m3", "ue8m0", storage, True, 64)
    til = ascend_cast.tiling(hidden, 128, in_dtype, "e4m3", "ue8m0", storage)
    assert (til.last // 128) % 2 == 1
    assert til.ragged == (hidden > 384)
    _lowers_within_budget(key)


def test_ascend_per_token_cast_key_checks():
    LimitError = limits.LimitError
    good = dict(hidden=2048, group=128, in_dtype="bfloat16", fmt="e4m3", sf="fp32", storage="row",
                round_sf=False, num_cores=64)
    ascend_cast.check_key("t", **good)
    for change, match in [
        (dict(hidden=100), "a multiple of 128"),
        (dict(hidden=32768 + 128), r"in \[128, 32768\]"),
        (dict(group=48), "group must be one of"),
        (dict(in_dtype="float16"), "x must be one of"),
        (dict(sf="ue8m0", round_sf=False), "round_sf"),
        (dict(sf="e4m3", round_sf=True), "round_sf"),
        (dict(num_cores=0), "num_cores"),
    ]:
        with pytest.raises(LimitError, match=match):
            ascend_cast.check_key("t", **{**good, **change})
        with pytest.raises(LimitError, match=match):
            ascend_cast.build_per_token_cast(**{**good, **change})


def test_ascend_per_token_cast_launcher_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(ascend_cast.PER_TOKEN_CAST, "compiled", lambda key: lambda *args: calls.append((key, args)))
    tokens, hidden = 5, 256
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
    for spec in ("1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/ue8m0/row/round", "1x16/e4m3/fp32/row/exact"):
        layout = ScaleLayout.parse(spec)
        data = layout.empty_data(tokens, hidden, like=x)
        sf = layout.empty_sf(tokens, hidden, "ascend", like=x)
        ascend_cast.per_token_cast(x=x, layout=spec, x_sf=None, x_layout=None, data=data, sf=sf)
        key, (x_arg, data_arg, sf_arg) = calls[-1]
        assert key == ascend_cast.PerTokenCastKey(hidden, layout.block[1], "bfloat16", layout.fmt, layout.sf,
                                             layout.storage, layout.round_sf, key.num_cores)
        assert x_arg is x and data_arg is data
        if layout.storage == "col_tma":  # the (cols, T) row-major buffer behind the transposed view
            assert sf_arg.shape == (sf.shape[1], tokens) and sf_arg.is_contiguous()
        else:
            assert sf_arg is sf
    with pytest.raises(limits.LimitError, match="not per-token"):
        ascend_cast.per_token_cast_key(x, "128x128/e4m3/fp32/row/exact", 64)


ASCEND_VARIANTS = [(kernel.name, name) for kernel in (ascend_cast.PER_TOKEN_CAST_SF, ascend_cast.PER_TOKEN_CAST_WITH_SF)
                   for name in sorted(kernel.case_keys(limits.QUANT_HIDDEN_SIZES[0], 4))]


@pytest.mark.parametrize("hidden", limits.QUANT_HIDDEN_SIZES)
@pytest.mark.parametrize("kernel,name", ASCEND_VARIANTS, ids=[n for _, n in ASCEND_VARIANTS])
def test_ascend_variants_lower_within_ub(hidden, kernel, name):
    kernel = ascend_cast.KERNELS[kernel]
    key = kernel.case_keys(hidden, 4)[name]
    lowered = ascend_build.lower_ascendc(kernel.prim_func(key))
    assert "__global__" in lowered.source and not lowered.has_simt
    til = ascend_cast.tiling(key.hidden, key.group, key.in_dtype, key.fmt, key.sf, key.storage, key.variant)
    assert 0 < lowered.ub_bytes <= til.ub_bytes <= ascend_build.UB_BUDGET_BYTES, (key, lowered.ub_bytes, til)
    source = lowered.source
    if key.variant == "sf_only":  # the scales' words, no data conversion
        assert "vsts_pack_b32" in source and "fp8_e4_t" not in source
    else:  # the given words' bytes widened to fp32 scales, inverted, the data narrowed
        assert "vdiv" in source and "vand" in source and "vcvt<fp8_e4_t>" in source


def test_ascend_variant_keys_and_launchers(monkeypatch):
    calls = []
    for kernel in ascend_cast.KERNELS.values():
        monkeypatch.setattr(kernel, "compiled", lambda key: lambda *args: calls.append((key, args)))
    tokens, hidden = 5, 256
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
    layout = ScaleLayout.parse("1x128/e4m3/ue8m0/col_tma/round")
    sf = layout.empty_sf(tokens, hidden, "ascend", like=x)
    data = layout.empty_data(tokens, hidden, like=x)
    ascend_cast.per_token_cast_sf(x=x, layout=layout.spec, sf=sf)
    ascend_cast.per_token_cast_with_sf(x=x, sf=sf, layout=layout.spec, data=data)
    source = ScaleLayout.parse("1x32/e2m1/ue8m0/row/round")
    q = source.empty_data(tokens, hidden, like=x), source.empty_sf(tokens, hidden, "ascend", like=x)
    ascend_cast.per_token_cast(x=q[0], layout=layout.spec, x_sf=q[1], x_layout=source.spec, data=data, sf=sf)
    (k_sf, a_sf), (k_with, a_with), (k_req, a_req) = calls
    assert (k_sf.variant, k_with.variant, k_req.variant) == ("sf_only", "with_sf", "requant")
    assert a_sf[1].shape == (sf.shape[1], tokens) and a_with[1].shape == (sf.shape[1], tokens) and a_with[2] is data
    assert (k_req.in_dtype, k_req.x_group, k_req.x_sf, k_req.x_storage, k_req.hidden) == ("e2m1", 32, "ue8m0", "row",
                                                                                          hidden)
    assert a_req[0] is q[0] and a_req[1] is q[1] and a_req[2] is data
    for change, match in [(dict(variant="requant", x_group=8, x_sf="fp32", x_storage="row"), "block"),
                          (dict(variant="stochastic"), "variant must be one of"),
                          (dict(variant="requant", in_dtype="bfloat16", x_group=32, x_sf="fp32", x_storage="row"),
                           "x must be one of")]:
        fields = dict(hidden=256, group=128, in_dtype="e4m3", fmt="e4m3", sf="fp32", storage="row", round_sf=False,
                      num_cores=64)
        with pytest.raises(limits.LimitError, match=match):
            ascend_cast.build_per_token_cast(**{**fields, **change})


# --- device: the kernel bitwise against the reference and the peer ------------------------------------------

DEVICE_TOKENS = level_choice([1, 37, 4001], [1, 2, 37, 513, 4001, 8192])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_kernel_bitwise(layout, seed):
    for hidden in (128, 7168):
        for tokens in DEVICE_TOKENS:
            for dtype, pitch in ((BF16, None), (F32, None), (BF16, hidden + 64)):
                call = per_token_cast_call(tokens, hidden, seed=seed + tokens, layout=layout, dtype=dtype,
                                           pitch=pitch, device="cuda")
                want = per_token_cast_ref(call["x"].cpu().contiguous(), layout)
                got = ops.per_token_cast(**call)
                for g, w in zip(got, want):
                    assert_same(g, w)


@requires_cuda
@pytest.mark.device
def test_device_extremes_bitwise(seed):
    """All-zero groups (the clamp), huge and tiny groups (saturation of e4m3 scales, subnormal data), exact
    midpoints of the e2m1 grid."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 512, generator=gen)
    x[0] = 0.0
    x[1] *= 1e30
    x[2] *= 1e-30
    x[3, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -6.0, 0.0, -0.0, 7, 1])
    for layout in LAYOUTS:
        want = per_token_cast_ref(x, layout)
        got = ops.per_token_cast(x.cuda(), layout)
        for g, w in zip(got, want):
            assert_same(g, w)


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", [s for s in LAYOUTS if "/e4m3/col_tma" not in s])
def test_device_equals_the_peer(layout, seed):
    """DeepSeek's tile_kernels (when importable) on the same inputs, bitwise (its H % 64 == 0 sizes)."""
    peer = pytest.importorskip("tile_kernels.quant")
    s = ScaleLayout.parse(layout)
    for tokens, hidden in ((512, 2048), (4001, 7168)):
        x = sample(tokens, hidden, seed=seed).cuda()
        data, sf = ops.per_token_cast(x, layout)
        theirs = peer.per_token_cast(x, s.fmt, s.block[1], use_tma_aligned_col_major_sf=s.storage == "col_tma",
                                     round_sf=s.round_sf, use_packed_ue8m0=s.sf == "ue8m0", use_e4m3_sf=s.sf == "e4m3")
        assert_same(data, (theirs[0].view(torch.uint8) if s.fmt == "e2m1" else theirs[0]).cpu())
        assert_same(sf, theirs[1].cpu())


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_variants_bitwise(layout, seed):
    """The scales alone and the data from given scales (its own, and another draw's: saturation, underflow)
    bitwise against the references, strided rows included."""
    for hidden in (128, 7168):
        for tokens in DEVICE_TOKENS:
            for dtype, pitch in ((BF16, None), (F32, hidden + 64)):
                call = per_token_cast_with_sf_call(tokens, hidden, seed=seed + tokens, layout=layout, dtype=dtype,
                                                   pitch=pitch, device="cuda", sf_seed=seed + tokens + 1)
                x = call["x"].cpu().contiguous()
                assert_same(ops.per_token_cast_sf(call["x"], layout), per_token_cast_sf_ref(x, layout))
                sf_cpu = to_device(call["sf"], "cpu")
                assert_same(ops.per_token_cast_with_sf(**call), per_token_cast_with_sf_ref(x, sf_cpu, layout))


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("x_layout", [s for s in LAYOUTS if s.startswith(("1x16/", "1x32/", "1x128/"))])
def test_device_requant_bitwise(x_layout, seed):
    """Re-quantization from every input layout (groups 16, 32, 128) to a few outputs, bitwise against the
    reference (CUDA's order), strided data rows included."""
    for layout in SOME_LAYOUTS:
        for hidden, tokens in ((128, 37), (7168, 513)):
            call = per_token_cast_call(tokens, hidden, seed=seed, layout=layout, x_layout=x_layout)
            want = per_token_cast_ref(**call)
            strided = torch.zeros(tokens, call["x"].shape[1] + 32, dtype=call["x"].dtype, device="cuda")
            strided[:, : call["x"].shape[1]] = call["x"].cuda()
            for x in (call["x"].cuda(), strided[:, : call["x"].shape[1]]):
                got = ops.per_token_cast(x, layout, to_device(call["x_sf"], "cuda"), x_layout)
                for g, w in zip(got, want):
                    assert_same(g, w)


@requires_cuda
@pytest.mark.device
def test_device_variants_equal_the_peer(seed):
    """tile_kernels' sf-only, precomputed-sf (its row, unpacked scales) and re-quantization (a tuple input) on
    the same inputs, bitwise."""
    peer = pytest.importorskip("tile_kernels.quant")

    def options(s):
        return dict(use_tma_aligned_col_major_sf=s.storage == "col_tma", round_sf=s.round_sf,
                    use_packed_ue8m0=s.sf == "ue8m0", use_e4m3_sf=s.sf == "e4m3")

    x = sample(4001, 7168, seed=seed).cuda()
    for layout in ("1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/ue8m0/row/round", "1x128/e4m3/fp32/row/exact"):
        s = ScaleLayout.parse(layout)
        assert_same(ops.per_token_cast_sf(x, layout), peer.per_token_cast_with_sf_only(x, s.fmt, s.block[1],
                                                                                       **options(s)).cpu())
    for layout in ("1x128/e4m3/fp32/row/exact", "1x64/e4m3/fp32/row/round", "1x32/e2m1/fp32/row/round",
                   "1x16/e2m1/e4m3/row/exact"):
        s = ScaleLayout.parse(layout)
        sf = ops.per_token_cast_sf(sample(4001, 7168, seed=seed + 1).cuda(), layout)
        theirs = peer.per_token_cast_with_precomputed_sf(x, s.fmt, s.block[1], sf, **options(s))
        assert_same(ops.per_token_cast_with_sf(x, sf, layout), (theirs.view(torch.uint8) if s.fmt == "e2m1"
                                                                else theirs).cpu())
    for source, layout in (("1x128/e4m3/fp32/row/exact", "1x128/e4m3/ue8m0/col_tma/round"),
                           ("1x128/e4m3/ue8m0/row/round", "1x32/e2m1/ue8m0/row/round"),
                           ("1x32/e2m1/ue8m0/row/round", "1x128/e4m3/fp32/row/exact")):
        q, s, si = ops.quantize(x, source), ScaleLayout.parse(layout), ScaleLayout.parse(source)
        data, sf = ops.per_token_cast(q.data, layout, q.sf, source)
        raw = q.data.view(torch.int8) if si.fmt == "e2m1" else q.data
        theirs = peer.per_token_cast((raw, q.sf), s.fmt, s.block[1], x_block_size=si.block, **options(s))
        assert_same(data, (theirs[0].view(torch.uint8) if s.fmt == "e2m1" else theirs[0]).cpu())
        assert_same(sf, theirs[1].cpu())
