"""``cast_back`` (docs/ops/quant.md#cast_back): validation, the fake against the reference on every layout of every
kind on meta tensors, the contract's exact values, opcheck, torch.compile (CPU tier, the reference as the CPU
kernel); the CUDA kernel lowered to sm_90a cubins and the Ascend 950 kernel to AscendC within the UB budget at the
sizes that matter, their launch views and keys (CPU tier); and on a GPU the CUDA kernel bitwise against the
reference and against the peer (DeepSeek's tile_kernels) when it imports."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from quant_cases import cast_back_call, sample
from quant_ref import cast_back_ref, e2m1_decode, quantize
from quant_testing import layouts, metadata

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.quant import ScaleLayout

BF16, F32 = torch.bfloat16, torch.float32
HAVE_NVCC = shutil.which("nvcc") is not None
SF_KINDS = (("fp32", False), ("fp32", True), ("e4m3", False), ("ue8m0", True))


LAYOUTS = layouts()
SOME_LAYOUTS = ["1x128/e4m3/fp32/row/exact", "1x128/e4m3/ue8m0/col_tma/round", "1x16/e2m1/e4m3/col_tma/exact",
                "128x128/e4m3/fp32/row/round", "32x32/e2m1/ue8m0/col_tma/round", "128x1/e4m3/ue8m0/row/round",
                "32x1/e4m3/e4m3/row/exact"]


# --- validation -------------------------------------------------------------------------------------------


def _bad_calls():
    good = cast_back_call(3, 256)  # 1x128/e4m3/ue8m0/col_tma/round: sf (3, 1) int32 strides (1, 4)
    data, sf = good["data"], good["sf"]
    return [
        ({"data": data.view(torch.uint8)}, TypeError, r"'data': expected dtype torch.float8_e4m3fn \(the data of "
                                                      r"layout 1x128/e4m3/ue8m0/col_tma/round\), got torch.uint8"),
        ({"data": data[0]}, ValueError, r"'data': expected a 2-D tensor of shape \(T, H\), got shape \(256,\)"),
        ({"data": torch.zeros(3, 192, dtype=torch.float8_e4m3fn)}, ValueError,
         r"'data': expected a hidden size a multiple of 128 in \[128, 32768\], got 192"),
        ({"data": torch.zeros(3, 512, dtype=torch.float8_e4m3fn)[:, :256]}, ValueError,
         r"'data': expected a contiguous tensor, got strides \(512, 1\)"),
        ({"layout": "1x32/e2m1/ue8m0/row/round"}, TypeError, r"'data': expected dtype torch.uint8"),
        ({"sf": sf.view(torch.float32)}, TypeError, r"'sf': expected dtype torch.int32 \(layout "
                                                    r"1x128/e4m3/ue8m0/col_tma/round on cuda\), got torch.float32"),
        ({"sf": torch.zeros(3, 2, dtype=torch.int32)}, ValueError,
         r"'sf': expected shape \(3, 1\) \(layout 1x128/e4m3/ue8m0/col_tma/round of data \(3, 256\)"),
        ({"layout": "1x64/e4m3/fp32/row/exact", "sf": torch.zeros(4, 3).t()}, ValueError,
         r"'sf': expected strides \(4, 1\) \(row storage .*got \(1, 3\)"),
        ({"layout": "1x64/e4m3/fp32/col_tma/exact", "sf": torch.zeros(3, 4)}, ValueError,
         r"'sf': expected strides \(1, 4\) \(col_tma storage of layout 1x64/e4m3/fp32/col_tma/exact on cuda\), got "
         r"\(4, 1\)"),
        ({"sf": torch.zeros(4, 1, dtype=torch.int32, device="meta").as_strided((3, 1), (1, 4))}, ValueError,
         r"'sf': expected a tensor on cpu \(the device of 'data'\), got meta"),
        ({"out_dtype": "bf16"}, TypeError, r"'out_dtype': expected a torch.dtype, got str 'bf16'"),
        ({"out_dtype": torch.float16}, ValueError, r"'out_dtype': expected torch.bfloat16 or torch.float32, got "
                                                   r"torch.float16"),
        ({"layout": 128}, TypeError, r"'layout': expected a str, got int 128"),
        ({"layout": "1x128/e4m3/fp32/row"}, ValueError, r"'layout': expected a ScaleLayout spec .* must have 5 parts"),
        ({"layout": "1x128/e4m3/ue8m0/row/exact"}, ValueError, r"'layout': .*'round_sf' must be True"),
        ({"layout": "32x1/e2m1/fp32/row/exact"}, ValueError, r"'layout': .*'fmt' must be 'e4m3' with per-channel"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**cast_back_call(3, 256), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::cast_back: argument {message}"):
        ops.cast_back(**call)


def test_validation_refuses_32_bit_offsets_past_the_limit():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = ScaleLayout.parse("1x128/e4m3/fp32/row/exact")
    with FakeTensorMode():
        hidden = 4096
        tokens = 2**31 // hidden
        data = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device="meta")
        with pytest.raises(ValueError, match=r"'data': expected T \* H below 2\*\*31 elements, got 524288 \* 4096"):
            ops.cast_back(data, layout.empty_sf(tokens, hidden, "cuda", like=data), layout.spec, BF16)
        out = ops.cast_back(data[1:], layout.empty_sf(tokens - 1, hidden, "cuda", like=data), layout.spec, F32)
        assert out.shape == (tokens - 1, hidden) and out.dtype == F32


# --- the fake, the reference, opcheck, compile ------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_matches_reference_on_every_layout(layout, seed):
    for tokens, out_dtype in ((0, BF16), (1, F32), (37, BF16)):  # 37: a ragged last block row of 32 and 128
        real = ops.cast_back(**cast_back_call(tokens, 256, seed=seed, layout=layout, out_dtype=out_dtype))
        fake = ops.cast_back(**cast_back_call(tokens, 256, seed=seed, layout=layout, out_dtype=out_dtype,
                                              device="meta"))
        assert metadata(fake) == metadata(real) == ((tokens, 256), out_dtype, (256, 1) if tokens else None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_reference_is_one_product_of_the_decoded_scale(layout, seed):
    """The op's CPU kernel (the reference) against the contract computed here another way: the data's values and
    each element's scale decoded by hand from the stored words (float64 product: exact, then rounded once)."""
    s = ScaleLayout.parse(layout)
    tokens, hidden = 37, 256
    call = cast_back_call(tokens, hidden, seed=seed, layout=layout, out_dtype=F32)
    data, sf = call["data"], call["sf"]
    values = e2m1_decode(torch.stack((data & 0xF, data >> 4), -1).flatten(-2)) if s.fmt == "e2m1" else data.float()
    r, c = s.block
    scales = torch.empty(tokens, hidden, dtype=torch.float64)
    raw = sf.new_empty(sf.shape).copy_(sf)  # row-major copy (contiguous() may keep a size-1 dim's strides)
    for t in range(tokens):
        for h in range(0, hidden, c):
            i, g = t // r, h // c
            if s.sf == "ue8m0":
                word = int(raw[i // 4, g]) if s.kind == "per_channel" else int(raw[i, g // 4])
                byte = (word >> (8 * (i % 4 if s.kind == "per_channel" else g % 4))) & 0xFF
                value = 2.0 ** (byte - 127)
            else:
                value = float(raw[i, g].float())
            scales[t, h:h + c] = value
    want = (values.double() * scales).float()
    got = ops.cast_back(**call)
    assert torch.equal(got, want)
    assert torch.equal(ops.cast_back(**{**call, "out_dtype": BF16}), got.to(BF16))  # one rounding of the same product


def test_the_contracts_exact_values():
    """UE8M0 byte 0 gives 0.0 and 255 inf (not NaN: 0 * inf only where data is 0); e2m1 low nibble first; e4m3
    subnormal data times a tiny scale rounds once to bf16 (no double rounding through fp32 storage)."""
    layout = ScaleLayout.parse("1x128/e2m1/ue8m0/row/round")
    data = torch.zeros(2, 64, dtype=torch.uint8)
    data[0, 0] = 0x71  # value 0 = code 1 (0.5), value 1 = code 7 (6.0)
    data[1, 0] = 0xF2  # value 0 = code 2 (1.0), value 1 = code 15 (-6.0)
    sf = torch.tensor([[127 | (0 << 8)], [255]], dtype=torch.int32)
    out = ops.cast_back(data, sf, layout.spec, F32)
    assert out[0, :2].tolist() == [0.5, 6.0] and out[1, :2].tolist() == [float("inf"), float("-inf")]
    assert torch.isnan(out[1, 2])  # 0 * inf: the one IEEE product
    e4 = ScaleLayout.parse("1x128/e4m3/fp32/row/exact")
    d = torch.full((1, 128), 2.0**-9).to(torch.float8_e4m3fn)  # the smallest subnormal
    s = torch.tensor([[1.0 + 2.0**-8]])  # 2^-9 * s lies between two bf16 values: rounded once
    assert ops.cast_back(d, s, e4.spec, BF16)[0, 0] == torch.tensor(2.0**-9 * (1.0 + 2.0**-8)).to(BF16)


def test_round_trips_per_token_cast(seed):
    """``cast_back(per_token_cast(x))`` within the contract's bound (half a spacing plus the scale's absolute term)."""
    x = sample(9, 512, seed=seed, dtype=F32)
    for layout in ("1x128/e4m3/fp32/row/exact", "1x32/e2m1/ue8m0/col_tma/round"):
        data, sf = ops.per_token_cast(x, layout)
        back = ops.cast_back(data, sf, layout, F32)
        assert torch.equal(back, cast_back_ref(*quantize(x, layout)[:2], layout, F32))
        rel, scale_units = (2.0**-4, 2.0**-10) if "e4m3" in layout else (2.0**-2, 2.0**-2)
        g = ScaleLayout.parse(layout).block[1]
        amax = x.abs().view(9, -1, g).amax(-1, keepdim=True).clamp(min=1e-30)
        scale = (amax / ScaleLayout.parse(layout).fmax).expand(-1, -1, g).reshape(9, 512)
        bound = rel * x.abs() + scale_units * scale * 2  # s <= 2 a / max with round_sf
        assert bool(((back - x).abs() <= bound).all())


# not the fp32 / e4m3 col_tma scales: opcheck's data-specialization check clones floating inputs (dense strides)
@pytest.mark.parametrize("layout", [s for s in SOME_LAYOUTS if not ("col_tma" in s and "ue8m0" not in s)])
@pytest.mark.parametrize("tokens", [0, 3])
def test_opcheck(layout, tokens, seed):
    call = cast_back_call(tokens, 256, seed=seed, layout=layout, out_dtype=F32 if "e2m1" in layout else BF16)
    args = tuple(call.values())
    torch.library.opcheck(torch.ops.cann_ops_tilelang.cast_back.default, args, test_utils=opcheck_utils(args))


def opcheck_utils(args):
    """opcheck's tests but test_schema where data is float8: torch's SchemaCheckMode compares inputs with allclose,
    which CPU float8 tensors lack (as tests/test_example_calls.py does)."""
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    return tuple(u for u in torch.library._OPCHECK_DEFAULT_UTILS if not (fp8 and u == "test_schema"))


def dequant_model(x, layout):
    data, sf = ops.per_token_cast(x, layout)
    return ops.cast_back(data, sf, layout, torch.float32).sum(dim=1)


def test_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(dequant_model, backend="aot_eager", fullgraph=True, dynamic=True)
    for layout in ("1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/fp32/row/exact"):
        first = True
        for tokens in (7, 9, 17):
            x = sample(tokens, 256, seed=seed + tokens)
            with torch._dynamo.config.patch(error_on_recompile=not first):
                got = compiled(x, layout)
            first = False
            assert torch.equal(got, dequant_model(x, layout)), (layout, tokens)


def test_zero_tokens_launch_nothing(monkeypatch):
    from cann_ops_tilelang import _library

    calls = []
    monkeypatch.setattr(_library, "_backend_module", lambda *_: calls.append(1))
    for layout in SOME_LAYOUTS:
        call = cast_back_call(0, 256, layout=layout)
        out = ops.cast_back.backend_kernel("cuda")(**call)
        assert out.shape == (0, 256) and out.dtype == BF16
    assert calls == []


# --- the CUDA kernel: lowering, launch views, keys ----------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.quant import cast_back as cuda_cast_back  # noqa: E402

HIDDEN = level_choice([128, 7168], list(limits.QUANT_HIDDEN_SIZES))
CASES = [(h, name) for h in HIDDEN for name in sorted(cuda_cast_back.CAST_BACK.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", CASES, ids=[f"H{h}-{n}" for h, n in CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    built = cuda_build.compile_cubin(cuda_cast_back.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == cuda_cast_back.CAST_BACK_PLAN.threads
    assert not undeclared(f"cast_back/{name}", built.source, declared_vector_args())
    src = built.source
    assert "__fmul_rn(" in src  # the one IEEE product
    # 16-byte vectors of data in, 16-byte stores of out
    assert "*(fp8_e4_16_t*)(data + " in src or "*(uint4*)(data + " in src
    assert "*(uint4*)(out + " in src or "*(float4*)(out + " in src
    key = cuda_cast_back.CAST_BACK.case_keys(hidden, 4)[name]
    if key.cols == 1:  # per-channel scales: 16-byte vectors of the scale row
        assert "*(int4*)(sf_in + " in src or "*(fp8_e4_16_t*)(sf_in + " in src or "*(float4*)(sf_in + " in src


def test_the_cases_cover_every_kind_format_scale_storage_and_output():
    keys = cuda_cast_back.CAST_BACK.case_keys(7168, 4).values()
    assert {(k.rows, k.cols) for k in keys} >= {(1, 128), (1, 32), (1, 16), (128, 128), (32, 32), (128, 1), (32, 1)}
    assert {k.fmt for k in keys} == {"e4m3", "e2m1"} and {k.sf for k in keys} == {"fp32", "e4m3", "ue8m0"}
    assert {k.storage for k in keys} == {"row", "col_tma"} and {k.out_dtype for k in keys} == {"bfloat16", "float32"}


@pytest.mark.parametrize("layout", SOME_LAYOUTS + ["1x16/e4m3/ue8m0/row/round", "32x1/e4m3/fp32/row/exact"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_launcher_passes_the_views_the_kernel_declares(layout, tokens, monkeypatch):
    """The launcher hands the kernel the buffers its parameters describe (shapes evaluated at T, unit inner
    stride, the scale tensor's own storage); the key ignores T."""
    from tvm import arith, tirx

    seen = []
    monkeypatch.setattr(cuda_cast_back.CAST_BACK, "compiled", lambda key: lambda *args: seen.append((key, args)))
    hidden = 512
    for out_dtype in (BF16, F32):
        call = cast_back_call(tokens, hidden, layout=layout, out_dtype=out_dtype)
        out = ops.cast_back.prepare(**call)
        cuda_cast_back.cast_back(**call, out=out)
        key, (kdata, ksf, kout) = seen[-1]
        assert kdata is call["data"] and kout is out
        prim_func = cuda_cast_back.CAST_BACK.prim_func(key)
        buffers = [prim_func.buffer_map[p] for p in prim_func.params]
        num_tokens = buffers[0].shape[0]
        for buffer, arg in zip(buffers, (kdata, ksf, kout)):
            assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
            for dim, size in zip(buffer.shape, arg.shape):
                value = arith.Analyzer().simplify(tirx.stmt_functor.substitute(dim, {num_tokens: tirx.IntImm(
                    "int32", tokens)}) if not isinstance(dim, tirx.IntImm) else dim)
                assert int(value) == size, (buffer.name, list(buffer.shape), tuple(arg.shape))
            assert arg.stride(-1) == 1 or arg.shape[-1] == 1
        assert ksf.untyped_storage().data_ptr() == call["sf"].untyped_storage().data_ptr()
    assert len({k for k, _ in seen}) == 2  # one per out dtype


def test_builders_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    build = cuda_cast_back.build_cast_back
    for hidden in (limits.QUANT_HIDDEN.low - 128, limits.QUANT_HIDDEN.high + 128, 192):
        with pytest.raises(LimitError, match="hidden size"):
            build(hidden, 1, 128, "e4m3", "fp32", "row", "bfloat16")
    with pytest.raises(LimitError, match="out_dtype"):
        build(256, 1, 128, "e4m3", "fp32", "row", "float16")
    with pytest.raises(ValueError, match="block"):
        build(256, 1, 8, "e4m3", "fp32", "row", "bfloat16")
    with pytest.raises(ValueError, match="per-channel"):
        build(256, 32, 1, "e4m3", "fp32", "col_tma", "bfloat16")


# --- the Ascend 950 kernel: lowered to AscendC within the UB budget at the sizes that matter -----------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import quant as ascend_quant  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import cast_back as ascend_cast_back  # noqa: E402

ASCEND_CASES = sorted(ascend_cast_back.cast_back_cases(limits.QUANT_HIDDEN_SIZES[0], 4))


@pytest.mark.parametrize("hidden", limits.QUANT_HIDDEN_SIZES)
@pytest.mark.parametrize("name", ASCEND_CASES)
def test_ascend_cast_back_lowers_within_ub(hidden, name):
    key = ascend_cast_back.cast_back_cases(hidden, 4)[name]
    lowered = ascend_build.lower_ascendc(ascend_cast_back.CAST_BACK.prim_func(key))
    assert "__global__" in lowered.source and not lowered.has_simt
    til = ascend_cast_back.tiling(key.hidden, key.rows, key.cols, key.fmt, key.sf, key.storage, key.out_dtype)
    assert 0 < lowered.ub_bytes <= til.ub_bytes <= ascend_build.UB_BUDGET_BYTES, (key, lowered.ub_bytes, til)
    src = lowered.source
    assert "vlds_unpack4" in src  # the data widened from its bytes
    if key.out_dtype == "bfloat16":
        assert "vcvt<bfloat16_t>(v" in src and "vsts_pack_b32" in src  # one rounding to bf16
    if key.sf == "ue8m0":
        assert "2139095040" in src  # the exponent mask 0x7F800000 of the decoded words
    if key.sf == "e4m3":
        assert "vcvt<float>" in src


def test_ascend_tiles_hold_whole_block_rows_and_words():
    """Tiles of whole block rows; with UE8M0 words of 128-channel groups and an odd group count per tile (H = 128 *
    63), a tile may start at a word's odd byte: the word count covers it (and the odd case lowers)."""
    key = ascend_cast_back.CastBackKey(128 * 63, 128, 128, "e4m3", "ue8m0", "col_tma", "float32", 64)
    til = ascend_cast_back.tiling(128 * 63, 128, 128, "e4m3", "ue8m0", "col_tma", "float32")
    assert (til.hk // 128) % 2 == 1 and til.hk < 128 * 63
    assert ascend_build.lower_ascendc(ascend_cast_back.CAST_BACK.prim_func(key)).ub_bytes <= til.ub_bytes
    for spec in ("128x128/e4m3/ue8m0/col_tma/round", "32x1/e4m3/fp32/row/exact", "1x128/e4m3/ue8m0/row/round"):
        s = ScaleLayout.parse(spec)
        for hidden in limits.QUANT_HIDDEN_SIZES + (128 * 63,):
            til = ascend_cast_back.tiling(hidden, s.block[0], s.block[1], s.fmt, s.sf, s.storage, "float32")
            assert til.bm % s.block[0] == 0 and hidden % til.hk == 0 and til.hk % 128 == 0
            if s.sf == "ue8m0" and s.block[1] > 1:  # every word the tile needs, its first group odd or even
                assert til.nw == -(-til.ng // 2)


def test_family_aggregates_the_cases():
    cases = ascend_quant.lowering_cases(limits.QUANT_HIDDEN_SIZES[0])
    assert {f"cast_back/{name}" for name in ASCEND_CASES} <= set(cases)
    assert all(name.startswith("cast_back_") for name in ASCEND_CASES)


def test_ascend_cast_back_key_checks_and_launcher_arguments(monkeypatch):
    LimitError = limits.LimitError
    good = dict(hidden=2048, rows=1, cols=128, fmt="e4m3", sf="fp32", storage="row", out_dtype="bfloat16",
                num_cores=64)
    ascend_cast_back.check_key("t", **good)
    for change, match in [(dict(hidden=100), "a multiple of 128"), (dict(out_dtype="float16"), "out_dtype"),
                          (dict(cols=8), "block"), (dict(rows=32, cols=1, storage="col_tma"), "per-channel"),
                          (dict(num_cores=0), "num_cores")]:
        with pytest.raises(LimitError, match=match):
            ascend_cast_back.build_cast_back(**{**good, **change})
    calls = []
    monkeypatch.setattr(ascend_cast_back.CAST_BACK, "compiled", lambda key: lambda *args: calls.append((key, args)))
    tokens, hidden = 5, 256
    for spec in ("1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/ue8m0/row/round", "128x1/e4m3/ue8m0/row/round"):
        layout = ScaleLayout.parse(spec)
        data = layout.empty_data(tokens, hidden, device="meta")
        sf = layout.empty_sf(tokens, hidden, "ascend", device="meta")
        out = torch.empty(tokens, hidden, dtype=F32, device="meta")
        ascend_cast_back.cast_back(data=data, sf=sf, layout=spec, out_dtype=F32, out=out)
        key, (data_arg, sf_arg, out_arg) = calls[-1]
        assert key == ascend_cast_back.CastBackKey(hidden, *layout.block, layout.fmt, layout.sf, layout.storage,
                                                   "float32", key.num_cores)
        assert data_arg is data and out_arg is out and sf_arg.dtype == torch.int16
        if layout.storage == "col_tma":  # the (cols, rows) row-major buffer behind the transposed view
            assert sf_arg.shape == (sf.shape[1], sf.shape[0]) and sf_arg.is_contiguous()
        else:
            assert sf_arg is sf


# --- device: the kernel bitwise against the reference and the peer ------------------------------------------

DEVICE_TOKENS = level_choice([1, 37, 4001], [1, 2, 37, 129, 513, 4001, 8192])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_kernel_bitwise(layout, seed):
    for hidden in (128, 7168):
        for tokens in DEVICE_TOKENS:
            for out_dtype in (BF16, F32):
                call = cast_back_call(tokens, hidden, seed=seed + tokens, layout=layout, out_dtype=out_dtype)
                want = cast_back_ref(**call)
                got = ops.cast_back(**{**call, "data": call["data"].cuda(), "sf": _on_cuda(call["sf"])})
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), (layout, tokens, hidden)


def _on_cuda(sf):
    """The scale tensor on the GPU with its exact strides (TMA padding included)."""
    out = torch.empty_strided(sf.shape, sf.stride(), dtype=sf.dtype, device="cuda")
    out.copy_(sf)
    return out


def same_bits_or_both_nan(got, want):
    """Equal bits everywhere but at NaNs, which must be NaN at the same places (a NaN's payload is no value: CUDA's
    fmul returns the canonical NaN, the CPU keeps the operand's)."""
    got = got.cpu()
    nan = torch.isnan(want)
    bits = torch.int32 if want.dtype == F32 else torch.int16
    return torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan].view(bits), want[~nan].view(bits))


@requires_cuda
@pytest.mark.device
def test_device_extremes_bitwise(seed):
    """Every e4m3 byte (NaN and the subnormals included) and every e2m1 code against scales drawn from every UE8M0
    byte (0: 0.0, 255: inf), every e4m3 scale byte, and extreme fp32 scales: products overflow, underflow and round
    once."""
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden = 256, 256
    for layout in ("1x128/e4m3/ue8m0/row/round", "1x128/e2m1/ue8m0/col_tma/round", "1x16/e2m1/e4m3/row/exact",
                   "1x128/e4m3/fp32/col_tma/exact", "128x1/e4m3/ue8m0/row/round", "32x1/e4m3/e4m3/row/exact"):
        s = ScaleLayout.parse(layout)
        cols = hidden // s.format.per_element
        data = torch.arange(tokens * cols, dtype=torch.int64).remainder(256).to(torch.uint8).view(tokens, cols)
        data = data.view(torch.float8_e4m3fn) if s.fmt == "e4m3" else data
        sf = s.empty_sf(tokens, hidden, "cuda", device="cpu")
        if s.sf == "fp32":
            values = torch.tensor([1e-38, 3e38, 2.0**-149, 1.0, 0.75, 2.0**-126], dtype=F32)
            sf.copy_(values[torch.randint(0, len(values), sf.shape, generator=gen)])
        else:
            words = torch.randint(0, 256, (*sf.shape, sf.element_size()), generator=gen, dtype=torch.int64)
            words.view(-1)[:2] = torch.tensor([0, 255])
            sf.copy_(words.to(torch.uint8).view(sf.dtype).view(sf.shape))
        for out_dtype in (BF16, F32):
            want = cast_back_ref(data, sf, layout, out_dtype, "cuda")
            got = ops.cast_back(data.cuda(), _on_cuda(sf), layout, out_dtype)
            assert same_bits_or_both_nan(got, want), (layout, out_dtype)


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", [s for s in LAYOUTS if "/e4m3/col_tma" not in s])
def test_device_equals_the_peer(layout, seed):
    """DeepSeek's tile_kernels (when importable) on the same inputs, bitwise, where it has the layout (its H % 64 ==
    0 sizes; a layout its checks refuse is skipped, named)."""
    peer = pytest.importorskip("tile_kernels.quant")
    s = ScaleLayout.parse(layout)
    for tokens, hidden in ((512, 2048), (4001, 7168)):
        for out_dtype, fmt in ((BF16, "bf16"), (F32, "fp32")):
            call = cast_back_call(tokens, hidden, seed=seed, layout=layout, out_dtype=out_dtype)
            data, sf = call["data"].cuda(), _on_cuda(call["sf"])
            got = ops.cast_back(data, sf, layout, out_dtype)
            try:
                theirs = peer.cast_back((data.view(torch.int8) if s.fmt == "e2m1" else data, sf), fmt, s.block)
            except AssertionError as exc:
                pytest.skip(f"the peer refuses {layout}: {exc}")
            assert torch.equal(got.view(torch.uint8), theirs.view(torch.uint8)), (layout, tokens, out_dtype)
