"""``per_channel_cast`` (docs/ops/quant.md#per_channel_cast): validation, the fake against the reference on meta
tensors, opcheck, torch.compile and the ``quantize`` wrapper (CPU tier, the reference as the CPU
kernel); the CUDA kernel lowered to sm_90a cubins and the Ascend 950 kernel to AscendC within the UB budget at the
sizes that matter, their launch views and keys (CPU tier); and on a GPU the CUDA kernel bitwise against the
reference and against the peer (DeepSeek's tile_kernels) when it imports."""

import itertools
import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from quant_cases import per_channel_cast_call, sample
from quant_ref import decode_sf, expand, per_channel_cast_ref, per_channel_quantize_ref
from quant_testing import assert_compiles_once, assert_same, layouts, metadata, same

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.quant import ScaleLayout

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
HAVE_NVCC = shutil.which("nvcc") is not None


def input_layouts():
    """The per-token layouts a re-quantized input may come in: e4m3 of group 32 or 128, every scale kind and
    storage."""
    return [ScaleLayout((1, g), "e4m3", sf, storage, round_sf).spec for g in (32, 128)
            for sf, round_sf in (("fp32", False), ("e4m3", False), ("ue8m0", True)) for storage in ("row", "col_tma")]


LAYOUTS = layouts("per_channel")
INPUTS = input_layouts()
SOME_LAYOUTS = ["128x1/e4m3/ue8m0/row/round", "32x1/e4m3/fp32/row/exact", "32x1/e4m3/e4m3/row/exact",
                "128x1/e4m3/fp32/row/round"]
SM100 = "1x128/e4m3/ue8m0/col_tma/round"


# --- validation -------------------------------------------------------------------------------------------


def _bad_calls():
    x = torch.zeros(3, 256, dtype=BF16)
    q = per_channel_cast_call(3, 256, x_layout=SM100)
    q32 = per_channel_cast_call(3, 256, x_layout="1x32/e4m3/ue8m0/col_tma/round")
    return [
        ({"x": x.double()}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32, got torch.float64"),
        ({"x": x[0]}, ValueError, r"'x': expected a 2-D tensor of shape \(T, H\), got shape \(256,\)"),
        ({"x": torch.zeros(3, 192, dtype=BF16)}, ValueError, r"'x': expected a hidden size a multiple of 128"),
        ({"x": torch.zeros(256, 3, dtype=BF16).t()}, ValueError, r"'x': expected rows of unit column stride"),
        ({"x": torch.zeros(3, 260, dtype=BF16)[:, :256]}, ValueError, r"'x': expected a row stride of at least H"),
        ({"x": q["x"]}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32, got torch.float8_e4m3fn"),
        ({"layout": 128}, TypeError, r"'layout': expected a str, got int 128"),
        ({"layout": "128x1/e4m3/fp32/row"}, ValueError, r"'layout': expected a ScaleLayout spec .* 5 parts"),
        ({"layout": "128x1/e2m1/fp32/row/exact"}, ValueError, r"'layout': .*'fmt' must be 'e4m3'"),
        ({"layout": "128x1/e4m3/fp32/col_tma/exact"}, ValueError, r"'layout': .*'storage' must be 'row'"),
        ({"layout": "64x1/e4m3/fp32/row/exact"}, ValueError, r"'layout': .*'block'"),
        ({"layout": "1x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-channel layout, got "
                                                              r"'1x128/e4m3/fp32/row/exact' \(a per-token block"),
        ({"x_layout": SM100}, ValueError, r"'x_layout': expected None without x_sf \(x is not quantized\)"),
        ({"x_layout": 3}, TypeError, r"'x_layout': expected a str or None, got int 3"),
        ({"x_sf": [1.0]}, TypeError, r"'x_sf': expected a torch.Tensor or None, got list"),
        ({**q, "x_layout": None}, ValueError, r"'x_layout': expected the per-token layout spec of x_sf"),
        ({**q, "x": q["x"].float()}, TypeError, r"'x': expected dtype torch.float8_e4m3fn with x_sf"),
        ({**q, "x": torch.zeros(3, 192, dtype=E4M3)}, ValueError, r"'x': expected a hidden size"),
        ({**q, "x": torch.zeros(3, 264, dtype=E4M3)[:, :256]}, ValueError, r"'x': expected a row stride of at "
                                                                           r"least H = 256 and a multiple of 16"),
        ({**q, "x_layout": "128x1/e4m3/fp32/row/exact"}, ValueError, r"'x_layout': expected a per-token layout"),
        ({**q, "x_layout": "1x64/e4m3/ue8m0/col_tma/round"}, ValueError, r"'x_layout': expected an e4m3 per-token "
                                                                         r"layout of group 32 or 128"),
        ({**q, "x_layout": "1x128/e2m1/ue8m0/col_tma/round"}, ValueError, r"'x_layout': expected an e4m3"),
        ({**q, "x_sf": q["x_sf"].float()}, TypeError, r"'x_sf': expected dtype torch.int32 \(x_layout "
                                                      r"1x128/e4m3/ue8m0/col_tma/round on cuda\), got torch.float32"),
        ({**q, "x_sf": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, r"'x_sf': expected shape \(3, 1\)"),
        ({**q32, "x_sf": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, r"'x_sf': expected strides \(1, 4\) "
                                                                          r"\(col_tma storage"),
        ({**q, "x_sf": q["x_sf"].to("meta")}, ValueError, r"'x_sf': expected a tensor on cpu"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("change,error,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**per_channel_cast_call(3, 256), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::per_channel_cast: argument "
                                                              rf"{message}"):
        ops.per_channel_cast(**call)


def test_strided_rows_are_taken_and_never_read_past_h(seed):
    for dtype, pitch, x_layout in ((BF16, 264, None), (F32, 260, None), (BF16, 272, SM100)):
        call = per_channel_cast_call(37, 256, seed=seed, dtype=dtype, pitch=pitch, x_layout=x_layout)  # NaN past H
        assert call["x"].stride() == (pitch, 1)
        for layout in SOME_LAYOUTS:
            got = ops.per_channel_cast(**{**call, "layout": layout})
            want = per_channel_cast_ref(**{**call, "x": call["x"].contiguous(), "layout": layout})
            assert all(same(g, w) for g, w in zip(got, want)), layout


# --- the fake, the reference, opcheck, compile ------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_matches_reference_on_every_layout(layout, seed):
    for tokens, dtype, x_layout in ((0, BF16, None), (1, F32, None), (5, BF16, None), (129, BF16, None),
                                    (0, BF16, SM100), (37, BF16, "1x32/e4m3/fp32/row/exact")):
        kw = dict(seed=seed, layout=layout, dtype=dtype, x_layout=x_layout)
        real = ops.per_channel_cast(**per_channel_cast_call(tokens, 256, **kw))
        fake = ops.per_channel_cast(**per_channel_cast_call(tokens, 256, device="meta", **kw))
        assert [metadata(t) for t in fake] == [metadata(t) for t in real], (tokens, layout)
        s = ScaleLayout.parse(layout)
        assert real[0].shape == (tokens, 256) and real[0].dtype == E4M3
        assert real[1].shape == s.sf_shape(tokens, 256, "cuda") and real[1].dtype == s.sf_dtype("cuda")


@pytest.mark.parametrize("x_layout", INPUTS)
def test_requantized_inputs_are_taken_in_every_input_layout(x_layout, seed):
    """Every per-token input layout: validation passes, and the op (the reference on the CPU) equals the contract's
    ``Q(fl(fl(f32(data) * sx) * inv))``, the scales from the amax of ``fl(f32(data) * sx)``."""
    call = per_channel_cast_call(45, 512, seed=seed, x_layout=x_layout, layout="32x1/e4m3/fp32/row/exact")
    data, sf = ops.per_channel_cast(**call)
    xl = ScaleLayout.parse(x_layout)
    v = call["x"].float() * expand(decode_sf(call["x_sf"], xl, 45, 512, "cuda"), xl.block, 45, 512)
    want = per_channel_quantize_ref(v, "32x1/e4m3/fp32/row/exact")
    assert same(data, want.data) and same(sf, want.sf)


def test_the_op_reference_is_the_contracts_cast(seed):
    """per_channel_cast_ref (the op's CPU kernel) is the contract's cast on CUDA bytes (test_quant_ref.py checks
    it against the float64 oracle); UE8M0 words pack 4 consecutive token blocks of a channel, the bytes past the
    last block 0."""
    x = sample(5 * 32 + 7, 256, seed=seed)
    data, sf = per_channel_cast_ref(x, "32x1/e4m3/ue8m0/row/round")
    assert sf.shape == (2, 256) and sf.dtype == torch.int32
    exact, sf32 = per_channel_cast_ref(x, "32x1/e4m3/fp32/row/round")
    assert same(data, exact)
    exps = ((sf32.view(torch.int32) >> 23) & 0xFF).long()  # (6, 256) token blocks
    words = sf.long() & 0xFFFFFFFF
    for blk in range(8):
        byte = (words[blk // 4] >> (8 * (blk % 4))) & 0xFF
        assert torch.equal(byte, exps[blk] if blk < 6 else torch.zeros(256, dtype=torch.long)), blk


@pytest.mark.parametrize("layout", SOME_LAYOUTS)
@pytest.mark.parametrize("tokens", [0, 3, 130])
def test_opcheck(layout, tokens, seed):
    op = torch.ops.cann_ops_tilelang.per_channel_cast.default
    torch.library.opcheck(op, tuple(per_channel_cast_call(tokens, 256, seed=seed, layout=layout).values()))
    # e4m3 input: opcheck's schema test compares the inputs before and after with a product that torch (2.13)
    # does not implement for float8 on the CPU, so it runs the other three tests
    call = per_channel_cast_call(tokens, 256, seed=seed, layout=layout, x_layout=SM100)
    torch.library.opcheck(op, tuple(call.values()), test_utils=("test_autograd_registration", "test_faketensor",
                                                                "test_aot_dispatch_dynamic"))


def quant_model(x, layout):
    q = ops.quantize(x, layout)
    return q.data.view(torch.uint8).float().sum(dim=0), q.sf


def test_compile_fullgraph_dynamic_no_recompile(seed):
    assert_compiles_once(quant_model, (ScaleLayout.parse(SOME_LAYOUTS[0]), SOME_LAYOUTS[1]), (37, 129, 300), seed)


def test_zero_tokens_launch_nothing(monkeypatch):
    """On the device path (the CUDA kernel of declare, its launcher stubbed): T = 0 gives empty outputs of the
    layout's shapes and calls no launcher."""
    from cann_ops_tilelang import _library

    calls = []
    monkeypatch.setattr(_library, "_backend_module", lambda *_: calls.append(1))
    for layout in SOME_LAYOUTS:
        for x_layout in (None, SM100):
            call = per_channel_cast_call(0, 256, layout=layout, x_layout=x_layout)
            data, sf = ops.per_channel_cast.backend_kernel("cuda")(*call.values())
            s = ScaleLayout.parse(layout)
            assert data.shape == (0, 256) and sf.shape == s.sf_shape(0, 256, "cuda")
    assert calls == []


# --- the CUDA kernel: lowering, launch views, keys ----------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.quant import per_channel_cast as cuda_cast  # noqa: E402

HIDDEN = level_choice([128, 7168], list(limits.QUANT_HIDDEN_SIZES))
CASES = [(h, name) for h in HIDDEN for name in sorted(cuda_cast.PER_CHANNEL_CAST.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", CASES, ids=[f"H{h}-{n}" for h, n in CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    key = cuda_cast.PER_CHANNEL_CAST.case_keys(hidden, 4)[name]
    built = cuda_build.compile_cubin(cuda_cast.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits
    assert built.threads == cuda_cast.CHANNEL_PLAN.threads
    lanes = cuda_cast.lanes_of(hidden, key.in_dtype)
    width = lanes * 16 // {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}[key.in_dtype]
    assert built.smem_bytes == 4 * (cuda_cast.CHANNEL_PLAN.threads // lanes + 1) * width  # maxima + inverses
    assert not undeclared(f"per_channel_cast/{name}", built.source, declared_vector_args())
    src = built.source
    # the reference's arithmetic: IEEE divisions and products, the amax reduction through shared memory
    assert "__fdiv_rn(" in src and "__fmul_rn(" in src and "__syncthreads()" in src
    # x is read in 16-byte vectors (the op declares it), the data written in vectors of V bytes
    assert "*(uint4*)(x + " in src or "*(float4*)(x + " in src or "*(fp8_e4_16_t*)(x + " in src
    assert "*(fp8_e4_" in src and "_t*)(data + " in src


def test_the_cases_cover_inputs_blocks_scales_and_input_storages():
    keys = cuda_cast.PER_CHANNEL_CAST.case_keys(7168, 4).values()
    assert {k.in_dtype for k in keys} == {"bfloat16", "float32", "float8_e4m3fn"}
    assert {k.block for k in keys} == {32, 128} and {k.sf for k in keys} == {"fp32", "e4m3", "ue8m0"}
    assert {k.x_storage for k in keys} == {"", "row", "col_tma"} and {k.x_group for k in keys} == {0, 32, 128}


def test_token_count_and_row_stride_are_dynamic():
    from tvm import tirx

    prim_func = cuda_cast.lowering_cases(256)["per_channel_cast_bf16_ue8m0_b128"]
    x = prim_func.buffer_map[prim_func.params[0]]
    assert isinstance(x.shape[0], tirx.Var) and isinstance(x.strides[0], tirx.Var)


def test_strips_divide_every_hidden_size():
    for hidden in range(128, 32768 + 1, 128):
        for dtype, vec in (("bfloat16", 8), ("float32", 4), ("float8_e4m3fn", 16)):
            lanes = cuda_cast.lanes_of(hidden, dtype)
            assert hidden % (lanes * vec) == 0 and lanes >= 8
            assert all(block % (cuda_cast.CHANNEL_PLAN.threads // lanes) == 0 for block in (32, 128))


@pytest.mark.parametrize("layout", SOME_LAYOUTS)
@pytest.mark.parametrize("x_layout", [None, SM100, "1x32/e4m3/fp32/row/exact", "1x32/e4m3/e4m3/col_tma/exact"])
def test_launcher_passes_the_views_the_kernel_declares(layout, x_layout, monkeypatch):
    """The launcher hands the kernel the buffers its parameters describe (UE8M0 words as bytes, col_tma input
    scales as the transposed padded buffer), each with the shape and unit inner stride of the prim_func's buffer;
    the key ignores T and the row stride."""
    from tvm import tirx

    seen = []
    monkeypatch.setattr(cuda_cast.PER_CHANNEL_CAST, "compiled", lambda key: lambda *args: seen.append((key, args)))
    hidden = 512
    for tokens in (1, 130):
        call = per_channel_cast_call(tokens, hidden, layout=layout, x_layout=x_layout, pitch=hidden + 16)
        data, sf = ops.per_channel_cast.prepare(**call)
        cuda_cast.per_channel_cast(**call, data=data, sf=sf)
        key, args = seen[-1]
        assert args[0] is call["x"] and args[1] is data
        prim_func = cuda_cast.PER_CHANNEL_CAST.prim_func(key)
        buffers = [prim_func.buffer_map[p] for p in prim_func.params]
        assert len(buffers) == len(args) == (3 if x_layout is None else 4)
        nm = -(-tokens // ScaleLayout.parse(layout).block[0])
        dynamic = {"num_tokens": tokens, "sf_rows": -(-nm // 4) if key.sf == "ue8m0" else nm}
        for buffer, arg in zip(buffers, args):
            assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
            for dim, size in zip(buffer.shape, arg.shape):
                want = int(dim) if isinstance(dim, tirx.IntImm) else dynamic[dim.name] if isinstance(dim, tirx.Var) \
                    else 4 * tokens  # the only expression: the UE8M0 bytes of the transposed input words
                assert want == size, (buffer.name, list(buffer.shape), tuple(arg.shape))
            assert arg.stride(-1) == 1
        assert args[2].untyped_storage().data_ptr() == sf.untyped_storage().data_ptr()
    assert len({k for k, _ in seen}) == 1  # neither T nor the row stride is in the key


def test_builders_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    build = cuda_cast.build_per_channel_cast
    for hidden in (limits.QUANT_HIDDEN.low - 128, limits.QUANT_HIDDEN.high + 128, 192):
        with pytest.raises(LimitError, match="hidden size"):
            build(hidden, 128, "bfloat16", "fp32", False, 0, "", "")
    with pytest.raises(LimitError, match="input dtype"):
        build(256, 128, "float16", "fp32", False, 0, "", "")
    with pytest.raises(ValueError, match="block"):
        build(256, 64, "bfloat16", "fp32", False, 0, "", "")
    with pytest.raises(LimitError, match="input group"):
        build(256, 128, "float8_e4m3fn", "fp32", False, 64, "fp32", "row")
    with pytest.raises(LimitError, match="takes no input scales"):
        build(256, 128, "bfloat16", "fp32", False, 32, "fp32", "row")
    with pytest.raises(LimitError, match="per-channel"):
        cuda_cast.channel_key("per_channel_cast", 256, "bfloat16", ScaleLayout((1, 128)), None)
    with pytest.raises(LimitError, match="comes with its per-token scales"):
        cuda_cast.channel_key("per_channel_cast", 256, "float8_e4m3fn", ScaleLayout((32, 1)), None)


# --- the Ascend 950 kernel: lowered to AscendC within the UB budget at the sizes that matter ---------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import quant as ascend_quant  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import per_channel_cast as ascend_cast  # noqa: E402

ASCEND_CASES = sorted(ascend_cast.per_channel_cast_cases(limits.QUANT_HIDDEN_SIZES[0], 4))
ASCEND_HIDDEN = level_choice([128, 7168], list(limits.QUANT_HIDDEN_SIZES))


def _lowers_within_budget(key):
    lowered = ascend_build.lower_ascendc(ascend_cast.PER_CHANNEL_CAST.prim_func(key))
    assert "__global__" in lowered.source, lowered.source[:400]
    assert not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, f"{key}: UB {lowered.ub_bytes} B > {lowered.budget_bytes} B"
    til = ascend_cast.tiling(key.hidden, key.block, key.in_dtype, key.sf, key.x_group, key.x_sf, key.x_storage)
    assert lowered.ub_bytes <= til.ub_bytes <= ascend_build.UB_BUDGET_BYTES, (key, lowered.ub_bytes, til)
    return lowered


@pytest.mark.parametrize("hidden", ASCEND_HIDDEN)
@pytest.mark.parametrize("name", ASCEND_CASES)
def test_ascend_per_channel_cast_lowers_within_ub(hidden, name):
    key = ascend_cast.per_channel_cast_cases(hidden, 4)[name]
    source = _lowers_within_budget(key).source
    assert "vcvt<fp8_e4_t>" in source and "RS_ENABLE" in source  # fp32 -> e4m3, saturating
    if key.sf == "ue8m0":
        assert "vsts_pack_b32" in source  # the int16 words
    if not key.round_sf:
        assert "vdiv_0ulp_ftz_true" in source  # the correctly rounded a / max, max / a (or 1 / s)


@pytest.mark.parametrize("hidden,x_group", [(384, 128), (128 * 63, 128), (32768, 32)])
def test_ascend_requant_odd_word_offsets_and_edges_lower(hidden, x_group):
    """Hidden tiles that start on the second byte of a UE8M0 input word (an odd count of 128-groups per tile), and
    the largest row."""
    key = ascend_cast.PerChannelCastKey(hidden, 128, "float8_e4m3fn", "ue8m0", True, x_group, "ue8m0", "col_tma", 64)
    til = ascend_cast.tiling(hidden, 128, "float8_e4m3fn", "ue8m0", x_group, "ue8m0", "col_tma")
    assert hidden % til.hk == 0 and til.hk % max(64, x_group) == 0
    if hidden != 32768:
        assert (til.hk // x_group) % 2 == 1 or til.n_tiles == 1
    _lowers_within_budget(key)


def test_ascend_tiles_divide_and_fit_every_hidden_size():
    for hidden in range(128, 32768 + 1, 128):
        for in_dtype, sf, xg, xs, st in (("float32", "ue8m0", 0, "", ""), ("bfloat16", "fp32", 0, "", ""),
                                         ("float8_e4m3fn", "ue8m0", 128, "ue8m0", "col_tma"),
                                         ("float8_e4m3fn", "fp32", 32, "fp32", "row")):
            for block in (32, 128):
                til = ascend_cast.tiling(hidden, block, in_dtype, sf, xg, xs, st)
                assert hidden % til.hk == 0 and til.ub_bytes <= ascend_build.UB_BUDGET_BYTES


def test_family_aggregates_the_cases():
    cases = ascend_quant.lowering_cases(limits.QUANT_HIDDEN_SIZES[0])
    assert {f"per_channel_cast/{name}" for name in ASCEND_CASES} <= set(cases)
    assert all(name.startswith("per_channel_cast_") for name in ASCEND_CASES)


def test_ascend_per_channel_cast_key_checks():
    LimitError = limits.LimitError
    good = dict(hidden=2048, block=128, in_dtype="bfloat16", sf="fp32", round_sf=False, x_group=0, x_sf="",
                x_storage="", num_cores=64)
    ascend_cast.check_key("t", **good)
    for change, match in [
        (dict(hidden=100), "a multiple of 128"),
        (dict(block=64), "block must be one of"),
        (dict(in_dtype="float16"), "x must be one of"),
        (dict(sf="ue8m0", round_sf=False), "round_sf"),
        (dict(sf="e4m3", round_sf=True), "round_sf"),
        (dict(in_dtype="float8_e4m3fn"), "comes with its per-token scales"),
        (dict(x_group=32, x_sf="fp32", x_storage="row"), "comes with its per-token scales"),
        (dict(in_dtype="float8_e4m3fn", x_group=64, x_sf="fp32", x_storage="row"), "input group"),
        (dict(num_cores=0), "num_cores"),
    ]:
        with pytest.raises(LimitError, match=match):
            ascend_cast.check_key("t", **{**good, **change})
        with pytest.raises(LimitError, match=match):
            ascend_cast.build_per_channel_cast(**{**good, **change})


def test_ascend_per_channel_cast_launcher_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(ascend_cast.PER_CHANNEL_CAST, "compiled", lambda key: lambda *args: calls.append((key, args)))
    tokens, hidden = 37, 256
    for spec, x_layout in (("128x1/e4m3/ue8m0/row/round", None), ("32x1/e4m3/fp32/row/exact", SM100),
                           ("32x1/e4m3/e4m3/row/exact", "1x32/e4m3/fp32/row/exact")):
        layout = ScaleLayout.parse(spec)
        x = torch.empty(tokens, hidden, dtype=BF16 if x_layout is None else E4M3, device="meta")
        x_sf = None
        if x_layout is not None:
            x_sf = ScaleLayout.parse(x_layout).empty_sf(tokens, hidden, "ascend", like=x)
        data = layout.empty_data(tokens, hidden, like=x)
        sf = layout.empty_sf(tokens, hidden, "ascend", like=x)
        ascend_cast.per_channel_cast(x=x, layout=spec, x_sf=x_sf, x_layout=x_layout, data=data, sf=sf)
        key, args = calls[-1]
        assert key.block == layout.block[0] and key.sf == layout.sf and key.in_dtype == str(x.dtype)[6:]
        assert args[0] is x and args[1] is data and args[2] is sf
        if x_layout == SM100:  # the (words, T) int16 row-major buffer behind the transposed view
            assert args[3].shape == (1, tokens) and args[3].is_contiguous() and args[3].dtype == torch.int16
        elif x_layout is not None:
            assert args[3] is x_sf
    with pytest.raises(limits.LimitError, match="not per-channel"):
        ascend_cast.per_channel_cast_key(x, "1x128/e4m3/fp32/row/exact", None, 64)


# --- device: the kernel bitwise against the reference and the peer ------------------------------------------

DEVICE_TOKENS = level_choice([1, 37, 4001], [1, 2, 37, 128, 513, 4001, 8192])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_kernel_bitwise(layout, seed):
    for hidden in (128, 7168):
        for tokens in DEVICE_TOKENS:
            for dtype, pitch in ((BF16, None), (F32, None), (BF16, hidden + 64)):
                call = per_channel_cast_call(tokens, hidden, seed=seed + tokens, layout=layout, dtype=dtype,
                                             pitch=pitch, device="cuda")
                want = per_channel_cast_ref(**{**call, "x": call["x"].cpu().contiguous()})
                got = ops.per_channel_cast(**call)
                for g, w in zip(got, want):
                    assert_same(g, w)


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("x_layout", INPUTS)
def test_device_requantization_bitwise(x_layout, seed):
    for layout, hidden, tokens in itertools.product(("128x1/e4m3/ue8m0/row/round", "32x1/e4m3/fp32/row/exact"),
                                                    (128, 7168), DEVICE_TOKENS):
        call = per_channel_cast_call(tokens, hidden, seed=seed + tokens, layout=layout, x_layout=x_layout,
                                     device="cuda")
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        want = per_channel_cast_ref(**cpu)
        got = ops.per_channel_cast(**call)
        for g, w in zip(got, want):
            assert_same(g, w)


@requires_cuda
@pytest.mark.device
def test_device_extremes_bitwise(seed):
    """All-zero channels (the clamp), huge and tiny channels (saturation of e4m3 scales, subnormal data), a ragged
    last block of one token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(257, 512, generator=gen)
    x[:, 0] = 0.0
    x[:, 1] *= 1e30
    x[:, 2] *= 1e-30
    x[:, 3] = torch.where(torch.arange(257) % 2 == 0, 448.0 * 448.0 * 4, -1e-3)
    for layout in LAYOUTS:
        want = per_channel_cast_ref(x, layout)
        got = ops.per_channel_cast(x.cuda(), layout)
        for g, w in zip(got, want):
            assert_same(g, w)


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_equals_the_peer(layout, seed):
    """DeepSeek's tile_kernels (when importable) on the same inputs, bitwise (its sizes: T and H multiples of 128;
    its layouts: fp32 or UE8M0 scales), plain and re-quantized from 1x128 / 1x32 UE8M0 col_tma scales."""
    peer = pytest.importorskip("tile_kernels.quant")
    s = ScaleLayout.parse(layout)
    if s.sf == "e4m3":
        pytest.skip("the peer's per-channel cast has no e4m3 scales")
    for tokens, hidden in ((512, 2048), (4096, 7168)):
        x = sample(tokens, hidden, seed=seed).cuda()
        theirs = peer.per_channel_cast(x, "e4m3", s.block[0], round_sf=s.round_sf, use_packed_ue8m0=s.sf == "ue8m0")
        for g, w in zip(ops.per_channel_cast(x, layout), theirs):
            assert_same(g, w.cpu())
        for x_layout in (SM100, "1x32/e4m3/ue8m0/col_tma/round"):
            q = ops.quantize(x, x_layout)
            theirs = peer.per_channel_cast((q.data, q.sf), "e4m3", s.block[0], round_sf=s.round_sf,
                                           num_per_channels=q.layout.block[1], use_packed_ue8m0=s.sf == "ue8m0")
            for g, w in zip(ops.per_channel_cast(q.data, layout, q.sf, x_layout), theirs):
                assert_same(g, w.cpu())
