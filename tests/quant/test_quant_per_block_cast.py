"""``per_block_cast``, ``per_block_cast_sf`` and ``per_block_cast_with_sf`` (docs/ops/quant.md#per_block_cast):
validation, the fakes against the references on meta tensors on every per-block layout, the three ops against each
other, opcheck and torch.compile (CPU tier, the references as the CPU kernels); the CUDA kernels lowered to sm_90a
cubins and the Ascend 950 kernels to AscendC within the UB budget at the sizes that matter, their launch views and
keys (CPU tier); and on a GPU the CUDA kernels bitwise against the references (ragged T included) and against the
peer (DeepSeek's tile_kernels) where it has the layout."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from quant_cases import per_block_cast_call, per_block_cast_with_sf_call, sample
from quant_ref import (block_amax, per_block_cast_ref, per_block_cast_sf_ref, per_block_cast_with_sf_ref,
                       per_block_quantize_ref)
from quant_testing import assert_compiles_once, assert_same, layouts, metadata

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.quant import ScaleLayout

BF16, F32 = torch.bfloat16, torch.float32
HAVE_NVCC = shutil.which("nvcc") is not None
OPS = ("per_block_cast", "per_block_cast_sf", "per_block_cast_with_sf")


LAYOUTS = layouts("per_block")
SOME_LAYOUTS = ["128x128/e4m3/fp32/row/exact", "128x128/e4m3/ue8m0/col_tma/round", "32x32/e2m1/ue8m0/row/round",
                "32x32/e4m3/e4m3/col_tma/exact", "128x128/e2m1/fp32/col_tma/round"]


def as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


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
        ({"layout": 128}, TypeError, r"'layout': expected a str, got int 128"),
        ({"layout": "128x128/e4m3/fp32/row"}, ValueError, r"'layout': expected a ScaleLayout spec .* 5 parts"),
        ({"layout": "64x64/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a ScaleLayout spec .* 'block'"),
        ({"layout": "1x128/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-block layout, got "
                                                              r"'1x128/e4m3/fp32/row/exact' \(a per-token block"),
        ({"layout": "128x1/e4m3/fp32/row/exact"}, ValueError, r"'layout': expected a per-block layout"),
    ]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument(op, change, error, message):
    call = {**per_block_cast_with_sf_call(3, 256), **change}
    if op != "per_block_cast_with_sf":
        del call["sf"]
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::{op}: argument {message}"):
        getattr(ops, op)(**call)


def _bad_scales():
    call = per_block_cast_with_sf_call(130, 512, layout="128x128/e4m3/fp32/col_tma/exact")
    sf = call["sf"]  # (2, 4) fp32, strides (1, 4)
    return [
        (sf.to(torch.float64), TypeError, r"'sf': expected the scales of layout 128x128/e4m3/fp32/col_tma/exact "
                                          r"\(sf must be torch.float32 on cuda; got torch.float64\)"),
        (sf.contiguous(), ValueError, r"'sf': .*sf must have strides \(1, 4\) \(col_tma\); got \(4, 1\)"),
        (sf[:1], ValueError, r"'sf': .*must have shape \(2, 4\) for x \(130, 512\) on cuda; got \(1, 4\)"),
        (sf.reshape(-1), ValueError, r"'sf': expected a 2-D tensor of shape \(2, 4\) .*got shape \(8,\)"),
        (sf.to("meta"), ValueError, r"'sf': expected a tensor on x's device cpu, got one on meta"),
    ], call


@pytest.mark.parametrize("index", range(5))
def test_with_sf_validates_the_scales(index):
    bad, call = _bad_scales()
    sf, error, message = bad[index]
    with without_cpu_references(), pytest.raises(error, match=rf"per_block_cast_with_sf: argument {message}"):
        ops.per_block_cast_with_sf(call["x"], sf, call["layout"])


def test_with_sf_takes_each_backends_words():
    """UE8M0 words are int32 on CUDA (meta and CPU tensors too): an Ascend int16 scale tensor is refused."""
    layout = ScaleLayout.parse("32x32/e4m3/ue8m0/row/round")
    x = torch.zeros(40, 256, dtype=BF16, device="meta")
    with pytest.raises(TypeError, match=r"'sf': .*must be torch.int32 on cuda; got torch.int16"):
        ops.per_block_cast_with_sf(x, layout.empty_sf(40, 256, "ascend", like=x), layout.spec)
    data = ops.per_block_cast_with_sf(x, layout.empty_sf(40, 256, "cuda", like=x), layout.spec)
    assert data.shape == (40, 256) and data.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_validation_refuses_32_bit_offsets_past_the_limit(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = 4096
        tokens = 2**31 // hidden
        with pytest.raises(ValueError, match=r"'x': expected elements T \* row pitch of x in \[0, 2147483647\]"):
            ops.per_block_cast(torch.empty(tokens, hidden, dtype=BF16, device=device), SOME_LAYOUTS[0])
        data, sf = ops.per_block_cast(torch.empty(tokens - 1, hidden, dtype=BF16, device=device), SOME_LAYOUTS[1])
        nm = -(-(tokens - 1) // 128)
        assert data.shape == (tokens - 1, hidden) and sf.shape == (nm, 8) and sf.stride() == (1, -(-nm // 4) * 4)


def test_strided_rows_are_taken_and_never_read_past_h(seed):
    for dtype, pitch in ((BF16, 264), (F32, 260)):
        call = per_block_cast_call(37, 256, seed=seed, dtype=dtype, pitch=pitch)  # NaN past H
        assert call["x"].stride() == (pitch, 1)
        for layout in SOME_LAYOUTS:
            got = ops.per_block_cast(call["x"], layout)
            want = per_block_cast_ref(call["x"].contiguous(), layout)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), layout
            assert torch.equal(ops.per_block_cast_sf(call["x"], layout), want[1])


# --- the fakes, the references, the three ops together, opcheck, compile ------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fakes_match_the_references_on_every_layout(layout, seed):
    for tokens, dtype in ((0, BF16), (1, F32), (37, BF16), (130, F32)):
        real = ops.per_block_cast(**per_block_cast_call(tokens, 256, seed=seed, layout=layout, dtype=dtype))
        fake = ops.per_block_cast(**per_block_cast_call(tokens, 256, seed=seed, layout=layout, dtype=dtype,
                                                        device="meta"))
        assert [metadata(t) for t in fake] == [metadata(t) for t in real], (tokens, layout)
        for op, call in (("per_block_cast_sf", per_block_cast_call), ("per_block_cast_with_sf",
                                                                      per_block_cast_with_sf_call)):
            got = getattr(ops, op)(**call(tokens, 256, seed=seed, layout=layout, dtype=dtype))
            meta = getattr(ops, op)(**call(tokens, 256, seed=seed, layout=layout, dtype=dtype, device="meta"))
            assert metadata(got) == metadata(meta), (op, tokens, layout)
        s = ScaleLayout.parse(layout)
        assert real[0].shape == s.data_shape(tokens, 256) and real[1].shape == s.sf_shape(tokens, 256, "cuda")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sf_only_and_with_sf_agree_with_the_cast(layout, seed):
    """The scales alone are the cast's, bitwise; the data from the cast's own scales are the cast's data wherever
    ``inv = 1 / s`` is the cast's inverse (power-of-two and e4m3 scales; exact fp32 ones take ``max / a``)."""
    s = ScaleLayout.parse(layout)
    for tokens, dtype in ((37, BF16), (130, F32)):
        call = per_block_cast_with_sf_call(tokens, 512, seed=seed, layout=layout, dtype=dtype)
        data, sf = ops.per_block_cast(call["x"], layout)
        assert torch.equal(ops.per_block_cast_sf(call["x"], layout), sf)
        assert torch.equal(call["sf"], sf)
        again = ops.per_block_cast_with_sf(**call)
        if s.round_sf or s.sf == "e4m3":
            assert torch.equal(again.view(torch.uint8), data.view(torch.uint8)), (layout, tokens)


def test_a_ragged_last_block_row_takes_its_valid_rows_only(seed):
    x = sample(130, 256, seed=seed)
    x[128:] = 1e-3  # the ragged block row's 2 valid rows: its scale is theirs, not the full rows'
    for layout in ("128x128/e4m3/fp32/row/exact", "32x32/e4m3/fp32/row/exact"):
        _, sf = per_block_cast_ref(x, layout)
        amax = block_amax(x.float(), ScaleLayout.parse(layout).block)
        assert torch.equal(sf, amax / 448.0) and float(amax[-1, 0]) == pytest.approx(1e-3, rel=1e-2)


def test_the_op_references_are_the_contracts_cast(seed):
    x = sample(70, 512, seed=seed)
    for layout in SOME_LAYOUTS:
        q = per_block_quantize_ref(x, layout, backend="cuda")
        data, sf = per_block_cast_ref(x, layout)
        assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(sf, q.sf)
        assert sf.stride() == q.sf.stride() and torch.equal(per_block_cast_sf_ref(x, layout), sf)
        given = sf * 2 if ScaleLayout.parse(layout).sf == "fp32" else sf
        want = per_block_quantize_ref(x, layout, sf=given, backend="cuda")
        assert torch.equal(per_block_cast_with_sf_ref(x, given, layout).view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", SOME_LAYOUTS)
@pytest.mark.parametrize("tokens", [0, 37])
def test_opcheck(op, layout, tokens, seed):
    call = per_block_cast_with_sf_call(tokens, 256, seed=seed, layout=layout, dtype=F32 if "e2m1" in layout else BF16)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if op != "per_block_cast_with_sf":
        del call["sf"]
    else:
        if "/e4m3/col" in layout or "/e4m3/row" in layout:
            utils = utils[1:]  # torch's schema check multiplies every float input: no CPU kernel for an e4m3 product
        if "col_tma" in layout:  # that check clones the inputs densely: the TMA padding the op requires is lost
            utils = utils[:-1]
    torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, op).default, tuple(call.values()), test_utils=utils)


def block_model(x, layout):
    data, sf = ops.per_block_cast(x, layout)
    again = ops.per_block_cast_with_sf(x, ops.per_block_cast_sf(x, layout), layout)
    return data.view(torch.uint8).float().sum(dim=1), sf, again.view(torch.uint8).float().sum(dim=1)


def test_compile_fullgraph_dynamic_no_recompile(seed):
    # ceil(T / r) >= 2: Dynamo specializes a size of 1
    assert_compiles_once(block_model, (SOME_LAYOUTS[1], SOME_LAYOUTS[2]), (130, 259, 1000), seed)


def test_zero_tokens_launch_nothing(monkeypatch):
    from cann_ops_tilelang import _library

    calls = []
    monkeypatch.setattr(_library, "_backend_module", lambda *_: calls.append(1))
    for layout in SOME_LAYOUTS:
        call = per_block_cast_with_sf_call(0, 256, layout=layout)
        s = ScaleLayout.parse(layout)
        data, sf = ops.per_block_cast.backend_kernel("cuda")(call["x"], layout)
        assert data.shape == s.data_shape(0, 256) and sf.shape == s.sf_shape(0, 256, "cuda")
        assert ops.per_block_cast_sf.backend_kernel("cuda")(call["x"], layout).shape == sf.shape
        assert ops.per_block_cast_with_sf.backend_kernel("cuda")(**call).shape == data.shape
    assert calls == []


# --- the CUDA kernels: lowering, launch views, keys ----------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.quant import per_block_cast as cuda_block  # noqa: E402

HIDDEN = level_choice([128, 7168], list(limits.QUANT_HIDDEN_SIZES))
CUDA_KERNELS = [cuda_block.PER_BLOCK_CAST, cuda_block.PER_BLOCK_CAST_SF, cuda_block.PER_BLOCK_CAST_WITH_SF]
CASES = [(h, k.name, name) for h in HIDDEN for k in CUDA_KERNELS for name in sorted(k.case_keys(h, 4))]


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,kernel,name", CASES, ids=[f"H{h}-{n}" for h, _, n in CASES])
def test_cuda_compiles_to_sm90a_cubin(hidden, kernel, name):
    built = cuda_build.compile_cubin(cuda_block.lowering_cases(hidden)[name], arch="sm_90a")
    key = cuda_block.KERNELS[kernel].case_keys(hidden, 4)[name]
    plan = cuda_block.plan_of(key.block, hidden)
    assert built.cubin[:4] == b"\x7fELF" and built.fits
    assert built.threads == 32 * plan.warps_per_block * plan.blocks
    # the 128 x 128 block's 8 warps meet in shared memory (one float a warp); 32 x 32 is one warp a block
    reduces = key.block == 128 and key.mode != "with_sf"
    assert built.smem_bytes == (4 * 8 if reduces else 0)
    assert not undeclared(f"per_block_cast/{name}", built.source, declared_vector_args())
    src = built.source
    assert "*(uint4*)(x + " in src or "*(float4*)(x + " in src  # x in 16-byte vectors
    assert "__fdiv_rn(" in src
    if key.mode != "sf":
        assert "__fmul_rn(" in src
        if key.fmt == "e4m3":
            assert "__NV_SATFINITE, __NV_E4M3" in src
    if key.mode != "with_sf":
        assert "__shfl_xor_sync(" in src
    else:
        assert "__shfl_xor_sync(" not in src


def test_the_cases_cover_blocks_inputs_formats_scales_and_storages():
    keys = [k for kernel in CUDA_KERNELS for k in kernel.case_keys(7168, 4).values()]
    assert {k.block for k in keys} == {32, 128} and {k.in_dtype for k in keys} == {"bfloat16", "float32"}
    assert {k.fmt for k in keys} == {"e4m3", "e2m1"} and {k.sf for k in keys} == {"fp32", "e4m3", "ue8m0"}
    assert {k.storage for k in keys} == {"row", "col_tma"} and {k.mode for k in keys} == {"cast", "sf", "with_sf"}


def test_token_count_and_row_stride_are_dynamic():
    from tvm import tirx

    prim_func = cuda_block.lowering_cases(256)["per_block_cast_b128_e4m3_fp32_row_bf16"]
    x = prim_func.buffer_map[prim_func.params[0]]
    assert isinstance(x.shape[0], tirx.Var) and isinstance(x.strides[0], tirx.Var)


def test_plans_fit_every_hidden_size():
    for hidden in range(128, 4096 + 1, 128):
        for block in (128, 32):
            plan = cuda_block.plan_of(block, hidden)
            assert (hidden // block) % plan.blocks == 0 and plan.warps_per_block * plan.blocks in (4, 8)


@pytest.mark.parametrize("layout", SOME_LAYOUTS + ["128x128/e2m1/ue8m0/col_tma/round", "32x32/e4m3/ue8m0/row/round"])
@pytest.mark.parametrize("tokens", [1, 130])
def test_launchers_pass_the_views_the_kernels_declare(layout, tokens, monkeypatch):
    """Each launcher hands its kernel the buffers its parameters describe: col_tma scales as the transposed
    (padded) buffer, UE8M0 words as their bytes; the key ignores T and the row stride."""
    from tvm import tirx

    seen = []
    for kernel in CUDA_KERNELS:
        monkeypatch.setattr(kernel, "compiled", lambda key: lambda *args: seen.append((key, args)))
    hidden, nm = 512, -(-tokens // ScaleLayout.parse(layout).block[0])
    for dtype in (BF16, F32):
        call = per_block_cast_with_sf_call(tokens, hidden, layout=layout, dtype=dtype, pitch=hidden + 16)
        x, given = call["x"], call["sf"]
        data, sf = ops.per_block_cast.prepare(x, layout)
        launches = [(cuda_block.per_block_cast, dict(x=x, layout=layout, data=data, sf=sf), (x, data, sf)),
                    (cuda_block.per_block_cast_sf, dict(x=x, layout=layout, sf=sf), (x, sf)),
                    (cuda_block.per_block_cast_with_sf, dict(x=x, sf=given, layout=layout, data=data),
                     (x, given, data))]
        for launcher, kwargs, tensors in launches:
            launcher(**kwargs)
            key, args = seen[-1]
            prim_func = cuda_block.KERNELS[launcher.__name__].prim_func(key)
            buffers = [prim_func.buffer_map[p] for p in prim_func.params]
            assert len(buffers) == len(args) == len(tensors)
            for buffer, arg, tensor in zip(buffers, args, tensors):
                assert arg.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
                assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
                for dim, size in zip(buffer.shape, arg.shape):
                    if isinstance(dim, tirx.IntImm):
                        assert int(dim) == size, (buffer.name, list(buffer.shape), tuple(arg.shape))
                    elif isinstance(dim, tirx.Var):
                        assert size == (tokens if dim.name == "num_tokens" else nm), (buffer.name, dim.name)
                    else:  # the only expression: the UE8M0 bytes of the transposed words
                        assert size == 4 * nm, (buffer.name, str(dim))
                assert arg.stride(-1) == 1
    assert len({k for k, _ in seen}) == 6  # 3 ops x 2 input dtypes: neither T nor the row stride is in a key


def test_builders_refuse_what_the_limits_refuse():
    from cann_ops_tilelang.limits import LimitError

    build = cuda_block.build_per_block_cast
    for hidden in (limits.QUANT_HIDDEN.low - 128, limits.QUANT_HIDDEN.high + 128, 192):
        with pytest.raises(LimitError, match="hidden size"):
            build(hidden, 128, "bfloat16", "e4m3", "fp32", "row", False, "cast")
    with pytest.raises(LimitError, match="input dtype"):
        build(256, 128, "float16", "e4m3", "fp32", "row", False, "cast")
    with pytest.raises(LimitError, match="block must be 128 or 32"):
        build(256, 64, "bfloat16", "e4m3", "fp32", "row", False, "cast")
    with pytest.raises(LimitError, match="mode"):
        build(256, 128, "bfloat16", "e4m3", "fp32", "row", False, "both")
    with pytest.raises(ValueError, match="round_sf"):
        build(256, 128, "bfloat16", "e4m3", "ue8m0", "row", False, "cast")
    with pytest.raises(LimitError, match="per-block"):
        cuda_block.block_key("cast", 256, "bfloat16", ScaleLayout((1, 128)))


# --- the Ascend 950 kernels: lowered to AscendC within the UB budget at the sizes that matter ------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import quant as ascend_quant  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import per_block_cast as ascend_block  # noqa: E402

ASCEND_KERNELS = [ascend_block.PER_BLOCK_CAST, ascend_block.PER_BLOCK_CAST_SF, ascend_block.PER_BLOCK_CAST_WITH_SF]
ASCEND_CASES = [(k.name, name) for k in ASCEND_KERNELS for name in sorted(k.case_keys(limits.QUANT_HIDDEN_SIZES[0],
                                                                                       4))]


def _lowers_within_budget(key):
    lowered = ascend_build.lower_ascendc(ascend_block.build_per_block_cast(**{
        f: getattr(key, f) for f in key.__slots__}))
    assert "__global__" in lowered.source, lowered.source[:400]
    assert not lowered.has_simt
    til = ascend_block.tiling(key.hidden, key.block, key.in_dtype, key.fmt, key.sf, key.storage)
    assert 0 < lowered.ub_bytes <= til.ub_bytes <= ascend_build.UB_BUDGET_BYTES, (key, lowered.ub_bytes, til)
    assert key.hidden % til.hk == 0 and til.hk % 128 == 0
    return lowered


@pytest.mark.parametrize("hidden", limits.QUANT_HIDDEN_SIZES)
@pytest.mark.parametrize("kernel,name", ASCEND_CASES, ids=[n for _, n in ASCEND_CASES])
def test_ascend_per_block_cast_lowers_within_ub(hidden, kernel, name):
    key = ascend_block.KERNELS[kernel].case_keys(hidden, 4)[name]
    source = _lowers_within_budget(key).source
    if key.mode != "sf":
        assert ("float4_e2m1x2_t" in source) if key.fmt == "e2m1" else ("vcvt<fp8_e4_t>" in source)
    if key.mode == "with_sf" or not key.round_sf:
        assert "vdiv_0ulp_ftz_true" in source  # the correctly rounded divisions
    if key.mode != "with_sf" and key.sf != "fp32":
        assert "vsts_pack_quarter" in source  # e4m3 scales / UE8M0 bytes from 32-bit lanes


@pytest.mark.parametrize("hidden,block,in_dtype,storage,hk", [
    (384, 128, "bfloat16", "col_tma", 128),  # 3 blocks: one a tile, the last one's pad byte with it
    (384, 128, "bfloat16", "row", 128),  # the same, row-major: the pad byte after the last block's
    (128, 128, "float32", "col_tma", 128),  # the whole row, one block: its word, the pad byte zeroed in UB
    (128 * 63, 128, "float32", "col_tma", 128),
    (7168, 128, "float32", "col_tma", 128),  # 128 fp32 rows of 256 channels do not fit: one block a tile
    (7168, 32, "bfloat16", "col_tma", 1024),
])
def test_ascend_ue8m0_words_and_tiles_lower(hidden, block, in_dtype, storage, hk):
    til = ascend_block.tiling(hidden, block, in_dtype, "e4m3", "ue8m0", storage)
    assert til.hk == hk
    for mode in ("cast", "with_sf"):
        _lowers_within_budget(ascend_block.PerBlockCastKey(hidden, block, in_dtype, "e4m3", "ue8m0", storage, True,
                                                           mode, 64))


def test_ascend_scale_entries_sit_where_the_gm_rows_want_them():
    assert [ascend_block.entry("fp32", "row", j) for j in range(3)] == [0, 1, 2]
    assert [ascend_block.entry("fp32", "col_tma", j) for j in range(3)] == [0, 8, 16]  # 32-byte UB rows
    assert [ascend_block.entry("e4m3", "col_tma", j) for j in range(3)] == [0, 32, 64]
    assert [ascend_block.entry("ue8m0", "col_tma", j) for j in range(4)] == [0, 1, 32, 33]  # a word a row


def test_family_aggregates_the_cases():
    cases = ascend_quant.lowering_cases(limits.QUANT_HIDDEN_SIZES[0])
    assert {f"per_block_cast/{name}" for _, name in ASCEND_CASES} <= set(cases)


def test_ascend_per_block_cast_key_checks():
    LimitError = limits.LimitError
    good = dict(hidden=2048, block=128, in_dtype="bfloat16", fmt="e4m3", sf="fp32", storage="row", round_sf=False,
                mode="cast", num_cores=64)
    ascend_block.check_key("t", **good)
    for change, match in [
        (dict(hidden=100), "a multiple of 128"),
        (dict(block=64), "block must be one of"),
        (dict(in_dtype="float16"), "x must be one of"),
        (dict(mode="both"), "mode must be one of"),
        (dict(sf="ue8m0", round_sf=False), "round_sf"),
        (dict(sf="e4m3", round_sf=True), "round_sf"),
        (dict(num_cores=0), "num_cores"),
    ]:
        with pytest.raises(LimitError, match=match):
            ascend_block.check_key("t", **{**good, **change})
        with pytest.raises(LimitError, match=match):
            ascend_block.build_per_block_cast(**{**good, **change})


def test_ascend_launcher_arguments(monkeypatch):
    calls = []
    for kernel in ASCEND_KERNELS:
        monkeypatch.setattr(kernel, "compiled", lambda key: lambda *args: calls.append((key, args)))
    tokens, hidden = 130, 256
    x = torch.empty(tokens, hidden, dtype=BF16, device="meta")
    for spec in ("128x128/e4m3/ue8m0/col_tma/round", "32x32/e2m1/ue8m0/row/round", "32x32/e4m3/fp32/col_tma/exact"):
        layout = ScaleLayout.parse(spec)
        data = layout.empty_data(tokens, hidden, like=x)
        sf = layout.empty_sf(tokens, hidden, "ascend", like=x)
        ascend_block.per_block_cast(x=x, layout=spec, data=data, sf=sf)
        ascend_block.per_block_cast_sf(x=x, layout=spec, sf=sf)
        ascend_block.per_block_cast_with_sf(x=x, sf=sf, layout=spec, data=data)
        (k1, a1), (k2, a2), (k3, a3) = calls[-3:]
        assert [k.mode for k in (k1, k2, k3)] == ["cast", "sf", "with_sf"]
        assert k1.block == layout.block[0] and k1.sf == layout.sf and k1.storage == layout.storage
        assert a1[0] is x and a1[1] is data and a3[2] is data
        want = sf.t() if layout.storage == "col_tma" else sf  # the (cols, nm) buffer behind col_tma
        want_shape = tuple(want.shape[:-1]) + (want.shape[-1] * (2 if layout.sf == "ue8m0" else 1),)
        for view in (a1[2], a2[1], a3[1]):  # UE8M0 words as their bytes
            assert tuple(view.shape) == want_shape and view.stride(-1) == 1
            assert view.dtype == (torch.uint8 if layout.sf == "ue8m0" else sf.dtype)
    with pytest.raises(limits.LimitError, match="not per-block"):
        ascend_block.per_block_key("cast", x, "1x128/e4m3/fp32/row/exact", 64)


# --- device: the kernels bitwise against the references and the peer ----------------------------------------

DEVICE_TOKENS = level_choice([1, 130, 4001], [1, 31, 130, 513, 4001, 8192])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_kernels_bitwise(layout, seed):
    for hidden in (128, 384, 7168):
        for tokens in DEVICE_TOKENS:
            for dtype, pitch in ((BF16, None), (F32, None), (BF16, hidden + 64)):
                call = per_block_cast_with_sf_call(tokens, hidden, seed=seed + tokens, layout=layout, dtype=dtype,
                                                   pitch=pitch, device="cuda", sf_seed=seed + 1)
                x = call["x"].cpu().contiguous()
                got = ops.per_block_cast(call["x"], layout)
                want = per_block_cast_ref(x, layout)
                for g, w in zip(got, want):
                    assert_same(g, w)
                assert_same(ops.per_block_cast_sf(call["x"], layout), want[1])
                assert_same(ops.per_block_cast_with_sf(**call), per_block_cast_with_sf_ref(x, call["sf"].cpu(), layout))


@requires_cuda
@pytest.mark.device
def test_device_extremes_bitwise(seed):
    """All-zero blocks (the clamp), huge and tiny blocks (e4m3 scale saturation, subnormal data), exact midpoints of
    the e2m1 grid, a ragged last block row of one row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(257, 512, generator=gen)
    x[:128, :128] = 0.0
    x[:128, 128:256] *= 1e30
    x[128:256, :128] *= 1e-30
    x[3, 256:272] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, -6.0, 0.0, -0.0, 7, 1])
    for layout in LAYOUTS:
        want = per_block_cast_ref(x, layout)
        got = ops.per_block_cast(x.cuda(), layout)
        for g, w in zip(got, want):
            assert_same(g, w)
        assert_same(ops.per_block_cast_with_sf(x.cuda(), got[1], layout), per_block_cast_with_sf_ref(x, want[1], layout))


PEER_LAYOUTS = [s for s in LAYOUTS if "/e4m3/e4m3/" not in s and "/e2m1/e4m3/" not in s]  # no e4m3 scales there


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("layout", PEER_LAYOUTS)
def test_device_equals_the_peer(layout, seed):
    """DeepSeek's tile_kernels (when importable), bitwise on its sizes (T and H multiples of 128): the cast, the
    scales alone, and the cast with given row-major fp32 scales (the only ones it takes)."""
    peer = pytest.importorskip("tile_kernels.quant")
    s = ScaleLayout.parse(layout)
    options = dict(use_tma_aligned_col_major_sf=s.storage == "col_tma", round_sf=s.round_sf,
                   use_packed_ue8m0=s.sf == "ue8m0")
    for tokens, hidden in ((512, 2048), (4096, 7168)):
        x = sample(tokens, hidden, seed=seed).cuda()
        data, sf = ops.per_block_cast(x, layout)
        theirs = peer.per_block_cast(x, s.fmt, s.block, **options)
        assert_same(data, (theirs[0].view(torch.uint8) if s.fmt == "e2m1" else theirs[0]).cpu())
        assert_same(sf, theirs[1].cpu())
        assert_same(ops.per_block_cast_sf(x, layout), peer.per_block_cast_with_sf_only(x, s.fmt, s.block,
                                                                                       **options).cpu())
        if s.sf == "fp32" and s.storage == "row":
            mine = ops.per_block_cast_with_sf(x, sf, layout)
            given = peer.per_block_cast_with_precomputed_sf(x, s.fmt, s.block, sf, round_sf=s.round_sf)
            assert_same(mine, (given.view(torch.uint8) if s.fmt == "e2m1" else given).cpu())
