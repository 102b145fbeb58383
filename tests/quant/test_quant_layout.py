"""The quant family's layout type (docs/ops/quant.md#layout): validation messages, the spec string, shapes,
dtypes and strides of data and scales for every block (T = 0, ragged T), allocation on meta and fake
tensors, and the QuantTensor result under torch.compile."""

import itertools
import math

import pytest
import torch

from cann_ops_tilelang.quant import AMAX_CLAMP, BLOCKS, QuantTensor, ScaleLayout

ALL_BLOCKS = [b for blocks in BLOCKS.values() for b in blocks]
BACKENDS = ("cuda", "ascend")


def valid_layouts():
    """Every valid layout (the combinations the rules allow)."""
    out = []
    for block, fmt, sf, storage, round_sf in itertools.product(ALL_BLOCKS, ("e4m3", "e2m1"), ("fp32", "e4m3", "ue8m0"),
                                                               ("row", "col_tma"), (False, True)):
        try:
            out.append(ScaleLayout(block, fmt, sf, storage, round_sf))
        except ValueError:
            pass
    return out


LAYOUTS = valid_layouts()


def test_the_rules_leave_the_expected_layouts():
    # per-token / per-block: 2 fmts x (fp32 exact, fp32 round, e4m3, ue8m0) x 2 storages; per-channel: e4m3, row
    assert len(LAYOUTS) == 6 * 2 * 4 * 2 + 2 * 4
    assert len(set(LAYOUTS)) == len(LAYOUTS) and len({x.spec for x in LAYOUTS}) == len(LAYOUTS)


# --- validation --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(block=(1, 48)), ValueError, ["'block'", "per_token [(1, 16)", "got (1, 48)"]),
    (dict(block=(64, 64)), ValueError, ["'block'", "per_block [(128, 128), (32, 32)]", "got (64, 64)"]),
    (dict(block=(1, 128, 1)), TypeError, ["'block'", "two ints", "(1, 128, 1)"]),
    (dict(block=(1.0, 128)), TypeError, ["'block'", "two ints"]),
    (dict(block=(True, 128)), TypeError, ["'block'", "two ints"]),
    (dict(block="1x128"), TypeError, ["'block'", "two ints", "'1x128'"]),
    (dict(block=(1, 128), fmt="e5m2"), ValueError, ["'fmt'", "('e4m3', 'e2m1')", "'e5m2'"]),
    (dict(block=(1, 128), fmt=torch.float8_e4m3fn), TypeError, ["'fmt'", "must be a str", "float8_e4m3fn"]),
    (dict(block=(1, 128), sf="bf16"), ValueError, ["'sf'", "('fp32', 'e4m3', 'ue8m0')", "'bf16'"]),
    (dict(block=(1, 128), storage="col"), ValueError, ["'storage'", "('row', 'col_tma')", "'col'"]),
    (dict(block=(1, 128), round_sf=1), TypeError, ["'round_sf'", "bool", "int 1"]),
    (dict(block=(1, 128), sf="ue8m0"), ValueError, ["'round_sf'", "True with sf 'ue8m0'", "got False"]),
    (dict(block=(1, 128), sf="e4m3", round_sf=True), ValueError, ["'round_sf'", "False with sf 'e4m3'", "got True"]),
    (dict(block=(128, 1), storage="col_tma"), ValueError, ["'storage'", "'row' with per-channel", "'col_tma'"]),
    (dict(block=(32, 1), fmt="e2m1"), ValueError, ["'fmt'", "'e4m3' with per-channel", "'e2m1'"]),
])
def test_invalid_layouts_name_the_field_what_was_expected_and_what_came(kwargs, error, words):
    with pytest.raises(error) as info:
        ScaleLayout(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_block_given_as_a_list_is_kept_as_a_tuple_and_the_layout_is_frozen_and_hashable():
    layout = ScaleLayout([1, 128], "e4m3", "ue8m0", "col_tma", True)
    assert layout.block == (1, 128) and layout == ScaleLayout((1, 128), "e4m3", "ue8m0", "col_tma", True)
    assert hash(layout) == hash(ScaleLayout((1, 128), "e4m3", "ue8m0", "col_tma", True))
    with pytest.raises(AttributeError):
        layout.fmt = "e2m1"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.spec)
def test_the_spec_string_round_trips(layout):
    assert ScaleLayout.parse(layout.spec) == layout and ScaleLayout.parse(layout) is layout


@pytest.mark.parametrize("spec, error, words", [
    ("1x128/e4m3/fp32/row", ValueError, ["5 parts", "'1x128/e4m3/fp32/row'"]),
    ("1*128/e4m3/fp32/row/exact", ValueError, ["block part", "'1*128'"]),
    ("1x128/e4m3/fp32/row/yes", ValueError, ["'round' or 'exact'", "'yes'"]),
    ("1x128/e4m3/ue8m0/row/exact", ValueError, ["'round_sf'", "True with sf 'ue8m0'"]),
    ("1x100/e4m3/fp32/row/exact", ValueError, ["'block'", "got (1, 100)"]),
    (128, TypeError, ["spec must be a str", "int 128"]),
])
def test_bad_specs_are_refused_by_part(spec, error, words):
    with pytest.raises(error) as info:
        ScaleLayout.parse(spec)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_formats_and_amax_clamps_are_the_peers():
    e4m3, e2m1 = ScaleLayout((1, 128)), ScaleLayout((1, 32), "e2m1")
    assert (e4m3.fmax, e2m1.fmax) == (448.0, 6.0)
    assert (e4m3.data_dtype, e2m1.data_dtype) == (torch.float8_e4m3fn, torch.uint8)
    assert e4m3.fmax == torch.finfo(torch.float8_e4m3fn).max
    assert AMAX_CLAMP == {("e4m3", False): 1e-4, ("e4m3", True): 0.875, ("e2m1", False): 6 * 2.0**-126,
                          ("e2m1", True): 0.01171875}
    assert ScaleLayout((1, 16), "e2m1", "e4m3").amax_clamp == 6 * 2**-9
    assert ScaleLayout((1, 32), "e2m1", "ue8m0", round_sf=True).amax_clamp == 6 * 2**-126
    # each clamp is exact in fp32 (the kernels compare in fp32)
    for value in AMAX_CLAMP.values():
        assert value == 1e-4 or torch.tensor(value, dtype=torch.float32).item() == value


# --- shapes ----------------------------------------------------------------------------------------------

TOKENS = (0, 1, 31, 32, 33, 127, 128, 129, 1000)


def expected_sf(layout, tokens, hidden, backend):
    """(shape, strides, dtype) from the rules of docs/ops/quant.md#layout, written out independently."""
    rows, cols = layout.block
    nm, nk = math.ceil(tokens / rows), hidden // cols
    pack, word = {"cuda": (4, torch.int32), "ascend": (2, torch.int16)}[backend]
    if layout.sf != "ue8m0":
        pack, word = 1, {"fp32": torch.float32, "e4m3": torch.float8_e4m3fn}[layout.sf]
    shape = (math.ceil(nm / pack), nk) if cols == 1 else (nm, math.ceil(nk / pack))
    if layout.storage == "row":
        return shape, (shape[1], 1), word
    unit = 16 // word.itemsize if backend == "cuda" else 1
    return shape, (1, math.ceil(shape[0] / unit) * unit), word


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.spec)
def test_shapes_dtypes_and_strides_for_every_token_count(layout, backend):
    rows, cols = layout.block
    for tokens, hidden in itertools.product(TOKENS, (cols * 4, 7168 if 7168 % cols == 0 else cols * 56)):
        assert layout.data_shape(tokens, hidden) == (tokens, hidden // (2 if layout.fmt == "e2m1" else 1))
        assert layout.sf_grid(tokens, hidden) == (math.ceil(tokens / rows), hidden // cols)
        shape, strides, dtype = expected_sf(layout, tokens, hidden, backend)
        assert layout.sf_shape(tokens, hidden, backend) == shape, (tokens, hidden)
        assert layout.sf_strides(tokens, hidden, backend) == strides, (tokens, hidden)
        assert layout.sf_dtype(backend) == dtype
        sf = layout.empty_sf(tokens, hidden, backend)
        assert (tuple(sf.shape), sf.stride(), sf.dtype) == (shape, strides, dtype)
        assert sf.untyped_storage().nbytes() == layout.sf_numel(tokens, hidden, backend) * dtype.itemsize
        layout.check_sf(sf, tokens, hidden, backend)
        data = layout.empty_data(tokens, hidden)
        assert (tuple(data.shape), data.dtype) == (layout.data_shape(tokens, hidden), layout.data_dtype)
        assert layout.hidden_of(data) == hidden


def test_the_deepgemm_layouts_at_a_model_size():
    """SM90 DeepGEMM: fp32 1x128 activations in TMA-aligned column-major (T padded to 4 floats); SM100: packed
    UE8M0, 4 per int32, T padded to 4 words; Ascend: 2 per int16, no padding."""
    sm90 = ScaleLayout((1, 128), "e4m3", "fp32", "col_tma")
    assert sm90.sf_shape(4001, 7168, "cuda") == (4001, 56) and sm90.sf_strides(4001, 7168, "cuda") == (1, 4004)
    sm100 = ScaleLayout((1, 128), "e4m3", "ue8m0", "col_tma", True)
    assert sm100.sf_shape(4001, 7168, "cuda") == (4001, 14) and sm100.sf_strides(4001, 7168, "cuda") == (1, 4004)
    assert sm100.sf_shape(4001, 7168, "ascend") == (4001, 28) and sm100.sf_strides(4001, 7168, "ascend") == (1, 4001)
    weights = ScaleLayout((128, 128), "e4m3", "fp32")
    assert weights.sf_shape(7168, 18432, "cuda") == (56, 144)
    channel = ScaleLayout((128, 1), "e4m3", "ue8m0", round_sf=True)
    assert channel.sf_shape(8192, 7168, "cuda") == (16, 7168) and channel.sf_shape(8192, 7168, "ascend") == (32, 7168)


def test_equal_layouts_give_equal_shapes_on_both_backends_where_the_bytes_do_not_depend_on_it():
    for layout in LAYOUTS:
        same = layout.sf != "ue8m0" and layout.storage == "row"
        for tokens in TOKENS:
            hidden = layout.block[1] * 8
            args = (tokens, hidden)
            if same:
                assert layout.sf_shape(*args, "cuda") == layout.sf_shape(*args, "ascend")
                assert layout.sf_strides(*args, "cuda") == layout.sf_strides(*args, "ascend")


@pytest.mark.parametrize("call, error, words", [
    (lambda x: x.data_shape(4, 100), ValueError, ["H must be a multiple of the block's cols 128", "got 100"]),
    (lambda x: x.data_shape(-1, 128), ValueError, ["T must be >= 0", "got -1"]),
    (lambda x: x.data_shape(4.0, 128), TypeError, ["T must be an int", "float 4.0"]),
    (lambda x: x.sf_shape(4, 128.0, "cuda"), TypeError, ["H must be an int", "float 128.0"]),
    (lambda x: x.sf_shape(4, True, "cuda"), TypeError, ["H must be an int", "bool True"]),
    (lambda x: x.sf_shape(4, 128, "npu"), ValueError, ["backend must be one of ('cuda', 'ascend')", "'npu'"]),
    (lambda x: x.sf_dtype("gpu"), ValueError, ["backend", "'gpu'"]),
])
def test_bad_sizes_and_backends_are_refused_by_name(call, error, words):
    with pytest.raises(error) as info:
        call(ScaleLayout((1, 128), "e4m3", "ue8m0", "col_tma", True))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_check_sf_names_dtype_shape_and_strides():
    layout = ScaleLayout((1, 128), "e4m3", "fp32", "col_tma")
    good = layout.empty_sf(8, 512, "cuda")
    layout.check_sf(good, 8, 512, "cuda")
    with pytest.raises(TypeError, match="x_sf must be torch.float32 on cuda; got torch.int32"):
        layout.check_sf(good.view(torch.int32), 8, 512, "cuda", name="x_sf")
    with pytest.raises(ValueError, match=r"must have shape \(9, 4\) .* got \(8, 4\)"):
        layout.check_sf(good, 9, 512, "cuda")
    with pytest.raises(ValueError, match=r"must have strides \(1, 8\) \(col_tma\); got \(4, 1\)"):
        layout.check_sf(torch.empty(8, 4), 8, 512, "cuda")


def test_allocation_on_meta_and_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = ScaleLayout((1, 32), "e2m1", "ue8m0", "col_tma", True)
    meta = torch.empty(3, 3, device="meta")
    sf = layout.empty_sf(33, 256, "cuda", like=meta)
    assert sf.device.type == "meta" and sf.shape == (33, 2) and sf.stride() == (1, 36)
    with FakeTensorMode():
        x = torch.empty(33, 256, dtype=torch.bfloat16)
        sf = layout.empty_sf(x.shape[0], x.shape[1], "ascend", like=x)
        data = layout.empty_data(x.shape[0], x.shape[1], like=x)
        assert sf.shape == (33, 4) and sf.stride() == (1, 33) and sf.dtype == torch.int16
        assert data.shape == (33, 128) and data.dtype == torch.uint8


def test_symbolic_token_counts_under_compile():
    """Fakes get T as a SymInt under dynamic shapes: the layout's sizes are symbolic expressions (one graph for
    every T, no recompilation)."""
    from torch._dynamo.testing import CompileCounter

    layout = ScaleLayout((1, 128), "e4m3", "fp32", "col_tma")

    def fn(x):
        sf = layout.empty_sf(x.shape[0], x.shape[1], "cuda", like=x)
        return torch.full((sf.shape[0] + sf.stride(1),), 1.0).sum()

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for tokens in (5, 9, 4001):
        assert compiled(torch.empty(tokens, 256)) == tokens + math.ceil(tokens / 4) * 4
    assert counter.frame_count == 1


def test_quant_tensor_is_a_named_tuple_that_compile_traces():
    layout = ScaleLayout((1, 32), "e2m1", "fp32")
    data, sf = layout.empty_data(4, 64), layout.empty_sf(4, 64, "cuda")
    q = QuantTensor(data, sf, layout)
    assert (q.tokens, q.hidden) == (4, 64) and tuple(q) == (data, sf, layout) and q._fields == ("data", "sf", "layout")

    def make(x):
        return QuantTensor(x[:, :32].to(torch.uint8), x[:, ::32].float(), ScaleLayout((1, 32), "e2m1", "fp32"))

    def use(q):
        return q.sf.sum() * q.layout.block[1] + q.data.float().sum() * q.layout.fmax

    torch._dynamo.reset()
    x = torch.arange(256.0).view(4, 64)
    made = torch.compile(make, backend="aot_eager", fullgraph=True)(x)
    assert isinstance(made, QuantTensor) and made.layout == layout
    assert torch.compile(use, backend="aot_eager", fullgraph=True)(made) == use(made)
