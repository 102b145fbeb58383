"""``cast`` (docs/ops/quant.md#cast, #stochastic_rounding): validation, the fake against the reference on meta tensors,
opcheck, torch.compile (a new offset reuses the graph), zero elements, stochastic rounding's unbiasedness and
reproducibility (CPU tier, the reference as the CPU kernel); the kernels' rounding recipes emulated against the
definition; the CUDA kernel lowered to sm_90a cubins and the Ascend 950 kernel to AscendC within the UB budget,
their launch arguments and keys (CPU tier); and on a GPU the CUDA kernel bitwise against the reference, unbiased,
reproducible, and against the peer (DeepSeek's tile_kernels, round to nearest) when it imports."""

import math
import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.levels import level_choice
from _plugins.references import without_cpu_references
from quant_cases import cast_call
from quant_ref import GRIDS, cast_ref, fmix32, random_bits, stochastic_round

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits
from cann_ops_tilelang.quant.cast import COUNTER_MUL, sr_scalars

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
HAVE_NVCC = shutil.which("nvcc") is not None
CONVERSIONS = [(F32, BF16), (F32, E4M3), (BF16, E4M3)]
FMT = {BF16: "bf16", E4M3: "e4m3"}
M32 = 0xFFFFFFFF


def bits_of(t):
    """Unsigned bit patterns (int64) of a bf16 / e4m3 / fp32 tensor."""
    if t.dtype == E4M3:
        return t.view(torch.uint8).long()
    if t.dtype == BF16:
        return t.view(torch.int16).long() & 0xFFFF
    return t.view(torch.int32).long() & M32


def assert_same_bits(got, want):
    """Equal dtype, shape and bits; NaN only where NaN (its payload and sign are not part of the contract)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    nan_got, nan_want = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(nan_got, nan_want)
    bad = (bits_of(got) != bits_of(want)) & ~nan_want
    assert not bad.any(), f"{int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}"


def edge_values(dtype):
    """Signed zeros, the e4m3 max and its rounding edges, huge, inf, NaN, fp32 and e4m3 subnormals, bf16 max."""
    v = [0.0, -0.0, 448.0, -448.0, 464.0, 463.99, 480.0, -1e6, 3.0e38, -3.4e38, float("inf"), -float("inf"),
         float("nan"), 2.0**-9, 2.0**-10, 3 * 2.0**-10, -2.0**-7, 2.0**-6, 1e-40, -1e-45, 1.0, 1.0625, 1.1875,
         3.3895e38, 3.39e38, -65504.0, 2.0**-133, 2.0**-134]
    return torch.tensor(v, dtype=F32).to(dtype)


# --- validation -------------------------------------------------------------------------------------------------


def _bad_calls():
    x = torch.zeros(3, 5)
    return [
        ({"x": [1.0, 2.0]}, TypeError, r"'x': expected a torch.Tensor, got list"),
        ({"x": x.double()}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32, got torch.float64"),
        ({"x": x.half()}, TypeError, r"'x': expected dtype torch.bfloat16 or torch.float32, got torch.float16"),
        ({"x": torch.zeros(5, 3).t()}, ValueError, r"'x': expected a contiguous tensor .*strides \(1, 3\)"),
        ({"dtype": "bfloat16"}, TypeError, r"'dtype': expected a torch.dtype, got str 'bfloat16'"),
        ({"dtype": torch.float16}, ValueError, r"'dtype': expected torch.bfloat16 or torch.float8_e4m3fn \(a "
                                               r"narrowing cast of torch.float32\), got torch.float16"),
        ({"dtype": torch.float32}, ValueError, r"'dtype': expected torch.bfloat16 or torch.float8_e4m3fn"),
        ({"x": x.bfloat16(), "dtype": BF16}, ValueError, r"'dtype': expected torch.float8_e4m3fn \(a narrowing cast "
                                                          r"of torch.bfloat16\), got torch.bfloat16"),
        ({"dtype": torch.float8_e5m2}, ValueError, r"'dtype': expected torch.bfloat16 or torch.float8_e4m3fn"),
        ({"seed": True}, TypeError, r"'seed': expected an int or None, got bool True"),
        ({"seed": 1.0}, TypeError, r"'seed': expected an int or None, got float 1.0"),
        ({"seed": 2**63}, ValueError, r"'seed': expected an int or None that fits the schema's int64"),
        ({"seed": -2**63 - 1}, ValueError, r"'seed': expected an int or None that fits the schema's int64"),
        ({"offset": -1}, ValueError, r"'offset': expected a counter offset in \[0, 9223372036854775807\], got -1"),
        ({"offset": 2**63}, ValueError, r"'offset': expected an int that fits the schema's int64"),
        ({"offset": True}, TypeError, r"'offset': expected an int, got bool True"),
        ({"offset": None}, TypeError, r"'offset': expected an int, got None"),
    ]


@pytest.mark.parametrize("change,error,message", _bad_calls(), ids=[str(i) for i in range(len(_bad_calls()))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**cast_call(3, 5, sr_seed=7, offset=11), **change}
    before = call["x"].clone() if isinstance(call["x"], torch.Tensor) else None
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::cast: argument {message}"):
        ops.cast(**call)
    if before is not None:
        assert torch.equal(call["x"], before)


def test_prepare_refuses_what_the_public_checks_refuse():
    """The prepare function (the fake, and the device kernels' first step) checks the scalars itself too."""
    x = torch.zeros(4)
    for kwargs, error, message in (({"seed": True}, TypeError, "'seed': expected an int"),
                                   ({"offset": -3}, ValueError, r"'offset': expected a counter offset"),
                                   ({"seed": 2**64}, ValueError, "'seed': expected a seed that fits int64")):
        with pytest.raises(error, match=message):
            ops.cast.prepare(x, BF16, **{"seed": 1, "offset": 0, **kwargs})


@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_validation_refuses_32_bit_offsets_past_the_limit(device):
    """2**31 elements are refused by name (fake tensors: no memory); 2**31 - 1 pass."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with pytest.raises(ValueError, match=r"'x': expected elements of x in \[0, 2147483647\], got 2147483648"):
            ops.cast(torch.empty(2**16, 2**15, device=device), BF16)
        out = ops.cast(torch.empty(2**31 - 1, device=device), E4M3, 5, 2**63 - 1)
        assert out.shape == (2**31 - 1,) and out.dtype == E4M3


# --- the fake, the reference, opcheck, compile --------------------------------------------------------------------

SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 37), (0,), (4, 0, 3)]


@pytest.mark.parametrize("source,target", CONVERSIONS, ids=["f32-bf16", "f32-e4m3", "bf16-e4m3"])
def test_fake_matches_reference_on_every_shape(source, target, seed):
    for shape in SHAPES:
        for sr_seed in (None, 3):
            call = cast_call(0, 0, seed=seed, dtype=source, to=target, sr_seed=sr_seed, offset=9, shape=shape)
            real = ops.cast(**call)
            fake = ops.cast(**{**call, "x": call["x"].to("meta")})
            assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride()) == \
                (call["x"].shape, target, call["x"].stride())
            assert_same_bits(real, cast_ref(call["x"], target, sr_seed, 9))


def test_round_to_nearest_is_tensor_to_and_the_saturating_q():
    """The reference op: bf16 as Tensor.to (overflow to inf); e4m3 RNE saturating at +-448, inf too."""
    x = edge_values(F32)
    assert_same_bits(ops.cast(x, BF16), x.to(BF16))
    got = ops.cast(x, E4M3).float()
    want = torch.tensor([0.0, -0.0, 448, -448, 448, 448, 448, -448, 448, -448, 448, -448, float("nan"), 2.0**-9, 0.0,
                         2.0**-8, -2.0**-7, 2.0**-6, 0.0, -0.0, 1.0, 1.0, 1.25, 448, 448, -448, 0, 0])
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got[:12], want[:12])
    assert torch.equal(got[13:], want[13:]) and torch.equal(torch.signbit(got[:12]), torch.signbit(want[:12]))


@pytest.mark.parametrize("sr_seed", [None, 5])
@pytest.mark.parametrize("shape", [(3, 7), (0, 4), (5,)])
def test_opcheck(shape, sr_seed, seed):
    for source, target in CONVERSIONS:
        call = cast_call(0, 0, seed=seed, dtype=source, to=target, sr_seed=sr_seed, offset=123, shape=shape)
        torch.library.opcheck(torch.ops.cann_ops_tilelang.cast.default, tuple(call.values()))


def cast_model(x, seed, offset):
    return ops.cast(x, E4M3, seed, offset).view(torch.uint8).float().sum(dim=-1), ops.cast(x, BF16)


def test_compile_fullgraph_dynamic_reuses_the_graph_for_new_sizes_seeds_and_offsets(seed):
    """dynamic=True: the seed and offset are SymInts of the schema (their range checked by a guard that holds for
    every valid value), so new values reuse the graph, as new sizes do (0 and 1 are specialized, as sizes are)."""
    torch._dynamo.reset()
    compiled = torch.compile(cast_model, backend="aot_eager", fullgraph=True, dynamic=True)
    first = True
    for tokens, sr_seed, offset in ((7, 11, 100), (9, 12, 2**40 + 3), (17, -5, 2**63 - 200), (33, 2**62, 5000)):
        x = cast_call(tokens, 64, seed=seed + tokens)["x"]
        with torch._dynamo.config.patch(error_on_recompile=not first):
            got = compiled(x, sr_seed, offset)
        first = False
        want = cast_model(x, sr_seed, offset)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (tokens, offset)
        assert torch.equal(got[0], cast_ref(x, E4M3, sr_seed, offset).view(torch.uint8).float().sum(dim=-1))


def test_compile_round_to_nearest_without_a_seed(seed):
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ops.cast(x, E4M3), backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (5, 300):
        x = cast_call(0, 0, seed=seed, shape=(n,))["x"]
        assert_same_bits(compiled(x), cast_ref(x, E4M3))


def test_zero_elements_launch_nothing(monkeypatch):
    """On the device path (the CUDA kernel of declare, its launcher stubbed): empty x of any shape gives an empty
    result of its shape and launches nothing."""
    import types

    from cann_ops_tilelang import _library

    calls = []
    stub = types.SimpleNamespace(cast=lambda **kw: calls.append(kw))
    monkeypatch.setattr(_library, "_backend_module", lambda *_: stub)
    for shape in ((0,), (3, 0), (0, 4, 5)):
        for sr_seed in (None, 1):
            out = ops.cast.backend_kernel("cuda")(torch.zeros(shape), E4M3, sr_seed, 0)
            assert out.shape == shape and out.dtype == E4M3
    assert calls == []
    ops.cast.backend_kernel("cuda")(torch.zeros(2, 3), E4M3, None, 0)  # the stub does record a launch
    assert len(calls) == 1 and calls[0]["x"].shape == (2, 3)


# --- stochastic rounding: unbiased, reproducible, composable (the reference through the op) ------------------------


def spacing(v, fmt):
    mantissa, emin, _ = GRIDS[fmt]
    _, e = torch.frexp(v.double().abs())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), torch.clamp(e.long() - 1, min=emin) - mantissa)


def check_unbiased(cast, source, target, offset):
    """N = 2**14 draws of each value (consecutive counters): every draw one of the two neighbours on the grid, the
    mean within 4 standard deviations plus the 2^-32 term of the contract, ``2 * 2^G / sqrt(N) + 2^-32 * 2^G``."""
    n = 2**14
    values = torch.tensor([0.1, -0.3, 1.03, 5.7, -77.7, 300.0, 445.3, 2.0**-8 * 1.37, -0.0123, 3.1e-3, 1e-5,
                           1.234e20, -7.7e-30], dtype=F32).to(source)
    if target == E4M3:
        values = values[values.float().abs() < 448]
    draws = values.repeat(n, 1)
    rounded = cast(draws.contiguous(), target, 77, offset).float().double()
    v = values.float().double()
    step = spacing(values.float(), FMT[target])
    assert ((rounded - v).abs() < step).all()
    bias = (rounded.mean(dim=0) - v).abs()
    assert (bias <= 2 * step / math.sqrt(n) + step * 2.0**-32).all(), (bias / step).max()
    # a value well off the grid is rounded both ways (not just unbiased on average), one on the grid never moves
    frac = (v / step - torch.floor(v / step)).abs()
    both = torch.minimum(frac, 1 - frac) > 64 / n
    assert both.sum() >= values.numel() - 3
    assert ((rounded.min(dim=0).values < v) & (rounded.max(dim=0).values > v))[both].all()
    assert (rounded == v)[:, frac == 0].all()


@pytest.mark.parametrize("source,target", CONVERSIONS, ids=["f32-bf16", "f32-e4m3", "bf16-e4m3"])
def test_stochastic_rounding_is_unbiased_on_the_reference(source, target):
    check_unbiased(ops.cast, source, target, 2**32 - 2**13)  # the counters cross the 32-bit carry midway


def test_stochastic_rounding_is_reproducible_and_composes_by_offset(seed):
    x = cast_call(6, 100, seed=seed)["x"]
    for target in (BF16, E4M3):
        one = ops.cast(x, target, 5, 2**32 - 250)
        assert torch.equal(bits_of(one), bits_of(ops.cast(x, target, 5, 2**32 - 250)))
        assert not torch.equal(bits_of(one), bits_of(ops.cast(x, target, 6, 2**32 - 250)))
        assert not torch.equal(bits_of(one), bits_of(ops.cast(x, target, 5, 2**32 - 249)))
        split = torch.cat([ops.cast(x[:2], target, 5, 2**32 - 250), ops.cast(x[2:], target, 5, 2**32 - 250 + 200)])
        assert torch.equal(bits_of(split), bits_of(one))  # across the carry of the counter's low word
        assert torch.equal(bits_of(ops.cast(x.view(-1), target, 5, 2**32 - 250)), bits_of(one).view(-1))


# --- the kernels' recipes, emulated on the CPU against the definition ----------------------------------------------


def kernel_words(scalars, count):
    """What both kernels compute from the launcher's ``(offset_lo, key0, key1)``: element ``i`` has ``n_lo =
    offset_lo + i mod 2^32`` and ``key1`` where that wrapped, ``r = fmix32((n_lo * 0x9E3779B1) ^ key)``."""
    lo, k0, k1 = (s & M32 for s in scalars)
    n = (lo + torch.arange(count, dtype=torch.int64)) & M32
    key = torch.where(n < lo, k1, k0)
    mul = ((n * (COUNTER_MUL & 0xFFFF)) + (((n * (COUNTER_MUL >> 16)) & 0xFFFF) << 16)) & M32
    return fmix32(mul ^ key)


@pytest.mark.parametrize("sr_seed,offset", [(0, 0), (42, 2**32 - 7), (-1, 2**63 - 20), (2**63 - 1, 3 * 2**32 + 5)])
def test_the_launch_scalars_give_the_contracts_words(sr_seed, offset):
    assert torch.equal(kernel_words(sr_scalars(sr_seed, offset), 40), random_bits(sr_seed, offset, 40))
    assert all(-2**31 <= s < 2**31 for s in sr_scalars(sr_seed, offset))  # int32 kernel parameters


def cuda_bf16_recipe(v, r):
    """The CUDA / Ascend bf16 recipe: ``(|bits| + (~r >> 16)) >> 16`` with v's sign; NaN -> 0x7FFF."""
    bits = v.view(torch.int32).long() & M32
    mag = bits & 0x7FFFFFFF
    out = ((mag + ((~r & M32) >> 16)) >> 16) | ((bits >> 16) & 0x8000)
    return torch.where(mag > 0x7F800000, 0x7FFF, out).to(torch.int32).to(torch.int16).view(BF16)


def cuda_e4m3_recipe(v, r):
    """The CUDA e4m3 recipe in fp32: ``P = |v| * 2^-G``, ``frac32 = u32((P - floor P) * 2^32)``, ``(floor P +
    [r < frac32]) * 2^G`` with v's sign, then the saturating RNE conversion (NaN through)."""
    bits = v.view(torch.int32).long() & M32
    ebh = ((bits >> 23) & 0xFF).clamp(min=121)
    p = v.abs() * ((257 - ebh) << 23).to(torch.int32).view(F32)
    q = torch.floor(p)
    frac32 = torch.nan_to_num((p - q) * 2.0**32, nan=0.0, posinf=0.0).double().floor().long()
    val = (q + (r < frac32).float()) * ((ebh - 3) << 23).to(torch.int32).view(F32)
    signed = ((val.view(torch.int32).long() & M32) | (bits & 0x80000000)).to(torch.uint32).view(F32)
    return torch.where(torch.isnan(v), v, signed).clamp(-448, 448).to(E4M3)


def ascend_e4m3_recipe(v, r):
    """The Ascend e4m3 recipe on integers: ``s = 20 + t``, ``t = max(eb, 121) - max(eb, 1)``, ``q = M >> min(s, 31)``,
    ``frac32 = M << (12 - t)`` (t <= 12) or ``M >> min(t - 12, 31)``, the value clamped to 448, v's sign."""
    bits = v.view(torch.int32).long() & M32
    mag = bits & 0x7FFFFFFF
    eb = mag >> 23
    m = (bits & 0x7FFFFF) | ((eb != 0).long() << 23)
    ebh = eb.clamp(min=121)
    t = ebh - eb.clamp(min=1)
    q = m >> (t + 20).clamp(max=31)
    frac = torch.where(t <= 12, (m << (12 - t.clamp(max=12))) & M32, m >> (t.clamp(min=12) - 12).clamp(max=31))
    q = q + (r < frac).long()
    val = (q.float() * ((ebh - 3) << 23).to(torch.int32).view(F32)).clamp(max=448.0)
    signed = ((val.view(torch.int32).long() & M32) | (bits & 0x80000000)).to(torch.uint32).view(F32)
    return torch.where(mag > 0x7F800000, v, signed).to(E4M3)


def recipe_inputs():
    gen = torch.Generator().manual_seed(5)
    return torch.cat([torch.randn(30000, generator=gen) * torch.exp(torch.randn(30000, generator=gen) * 8),
                      torch.randn(3000, generator=gen) * 2.0**-8, torch.randn(2000, generator=gen) * 1e-40,
                      edge_values(F32)])


@pytest.mark.parametrize("recipe", ["cuda_bf16", "cuda_e4m3", "ascend_e4m3"])
def test_the_kernels_recipes_equal_the_definition(recipe):
    v = recipe_inputs()
    for r in (random_bits(13, 0, v.numel()), torch.zeros(v.numel(), dtype=torch.int64),
              torch.full((v.numel(),), M32, dtype=torch.int64)):
        target = BF16 if recipe.endswith("bf16") else E4M3
        want = stochastic_round(v, FMT[target], r)
        want = want.to(BF16) if target == BF16 else want.clamp(-448, 448).to(E4M3)
        got = {"cuda_bf16": cuda_bf16_recipe, "cuda_e4m3": cuda_e4m3_recipe, "ascend_e4m3": ascend_e4m3_recipe}[
            recipe](v, r)
        assert_same_bits(got, want)


# --- the CUDA kernel: lowering, launch arguments, keys -------------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.quant import cast as cuda_cast  # noqa: E402

CUDA_CASES = sorted(cuda_cast.CAST.case_keys(limits.QUANT_HIDDEN_SIZES[0], 4))


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("name", CUDA_CASES)
def test_cuda_compiles_to_sm90a_cubin(name):
    built = cuda_build.compile_cubin(cuda_cast.lowering_cases(128)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == cuda_cast.CAST_PLAN.threads
    assert not undeclared(f"cast/{name}", built.source, declared_vector_args())
    key = cuda_cast.CAST.case_keys(128, 4)[name]
    src = built.source
    assert "*(float4*)(x + " in src or "*(uint4*)(x + " in src  # 16-byte loads of x
    if key.out_dtype == "float8_e4m3fn":  # the hardware's RNE saturating conversion, in vector stores
        assert "__NV_SATFINITE, __NV_E4M3" in src and "(fp8_e4_t)" not in src
    if key.stochastic:  # the 32-bit hash: the counter multiplier and both fmix32 multipliers
        assert all(f"(uint){c}" in src for c in (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35))
        assert "key1" in src and "offset_lo" in src
    else:
        assert "uint r[" not in src


def test_cuda_cases_cover_every_conversion_and_rounding():
    keys = set(cuda_cast.CAST.case_keys(7168, 4).values())
    assert keys == {cuda_cast.cast_key(str(s).removeprefix("torch."), str(t).removeprefix("torch."), sr)
                    for s, t in CONVERSIONS for sr in (False, True)}


def test_cuda_element_count_is_dynamic():
    from tvm import tirx

    prim_func = cuda_cast.lowering_cases(128)["cast_f32_e4m3_sr"]
    x = prim_func.buffer_map[prim_func.params[0]]
    assert isinstance(x.shape[0], tirx.Var) and len(x.shape) == 1


@pytest.mark.parametrize("shape", [(5, 7), (1024,), ()])
def test_cuda_launcher_passes_flat_views_and_the_counter_scalars(shape, monkeypatch):
    seen = []
    monkeypatch.setattr(cuda_cast.CAST, "compiled", lambda key: lambda *args: seen.append((key, args)))
    for source, target in CONVERSIONS:
        for sr_seed, offset in ((None, 0), (9, 2**32 + 17)):
            x = torch.zeros(shape, dtype=source)
            out = ops.cast.prepare(x, target, sr_seed, offset)
            cuda_cast.cast(x=x, dtype=target, seed=sr_seed, offset=offset, out=out)
            key, args = seen[-1]
            assert key.stochastic == (sr_seed is not None) and key.out_dtype == str(target).removeprefix("torch.")
            assert args[0].shape == (x.numel(),) and args[0].data_ptr() == x.data_ptr()
            assert args[1].shape == (x.numel(),) and args[1].data_ptr() == out.data_ptr()
            assert args[2:] == (sr_scalars(sr_seed, offset) if sr_seed is not None else ())
    assert len({k for k, _ in seen}) == 6  # neither the shape nor the offset is in the key


def test_cuda_builder_refuses_what_the_contract_refuses():
    for source, target in (("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float8_e4m3fn"),
                           ("bfloat16", "float8_e5m2")):
        with pytest.raises(limits.LimitError, match="not a narrowing cast"):
            cuda_cast.build_cast(source, target, False)


# --- the Ascend 950 kernel: lowered to AscendC within the UB budget ------------------------------------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import quant as ascend_quant  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import cast as ascend_cast  # noqa: E402

ASCEND_CASES = sorted(ascend_cast.CAST.case_keys(128, 4))


@pytest.mark.parametrize("name", ASCEND_CASES)
def test_ascend_cast_lowers_within_ub(name):
    key = ascend_cast.CAST.case_keys(128, 4)[name]
    lowered = ascend_build.lower_ascendc(ascend_cast.CAST.prim_func(key))
    source = lowered.source
    assert "__global__" in source and not lowered.has_simt
    assert 0 < lowered.ub_bytes <= ascend_cast.tile_ub_bytes(key.in_dtype, key.out_dtype) <= lowered.budget_bytes
    if key.stochastic:
        # the hash on uint32 vectors: 32-bit multiplies by the contract's constants, xors, logical shifts
        assert all("vmuls(" in source and f"(uint32_t){c}" in source for c in (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35))
        assert "simd_inst::vxor(" in source and "simd_inst::vshrs(" in source and "vci<int32_t>" in source
        if key.out_dtype == "float8_e4m3fn":  # per-lane shifts take int32 counts (asc_shiftleft / _shiftright)
            assert "simd_inst::vshr(m, (*(vector_s32 *)" in source and "simd_inst::vshl(m, (*(vector_s32 *)" in source
    if key.out_dtype == "bfloat16" and not key.stochastic:
        assert "vcvt<bfloat16_t>" in source and "RS_DISABLE" in source  # overflow to inf, as Tensor.to
    if key.out_dtype == "float8_e4m3fn":
        assert "vcvt<fp8_e4_t>" in source and "ROUND_R, RS_ENABLE" in source


def test_ascend_family_aggregates_the_cases():
    assert {f"cast/{name}" for name in ASCEND_CASES} <= set(ascend_quant.lowering_cases(128))
    assert len(ASCEND_CASES) == 6 and all(name.startswith("cast_") for name in ASCEND_CASES)


def test_ascend_key_checks():
    ascend_cast.check_key("t", "float32", "bfloat16", True, 64)
    for args, match in ((("float32", "float32", False, 64), "not a narrowing cast"),
                        (("bfloat16", "bfloat16", True, 64), "not a narrowing cast"),
                        (("float32", "bfloat16", False, 0), "num_cores")):
        with pytest.raises(limits.LimitError, match=match):
            ascend_cast.check_key("t", *args)
        with pytest.raises(limits.LimitError, match=match):
            ascend_cast.build_cast(*args)


def _emulated_ascend_kernel(key, calls):
    """A stand-in for the compiled Ascend kernel that does what it does on the CPU: rows of 256 from the launch's
    counter scalars (the recipes above), recording each launch."""
    def kernel(x2, o2, *scalars):
        calls.append((x2.shape, scalars))
        v = x2.float().reshape(-1)
        target = BF16 if key.out_dtype == "bfloat16" else E4M3
        if key.stochastic:
            r = kernel_words(scalars, v.numel())
            res = cuda_bf16_recipe(v, r) if target == BF16 else ascend_e4m3_recipe(v, r)
        else:
            res = cast_ref(v, target)
        o2.copy_(res.view(o2.shape))
    return kernel


@pytest.mark.parametrize("numel", [256 * 3, 300, 37, 256 * 40 + 255])
def test_ascend_launcher_rows_and_tail_equal_one_cast(numel, monkeypatch):
    """The whole rows in place and the last N % 256 through a staging row at the counter offset + N - N % 256:
    with the kernel emulated, the launcher's result is the contract's cast of the whole tensor."""
    calls = []
    monkeypatch.setattr(ascend_cast.CAST, "compiled", lambda key: _emulated_ascend_kernel(key, calls))
    monkeypatch.setattr(ascend_cast, "num_vector_cores", lambda: 64)
    x = cast_call(0, 0, shape=(numel,))["x"]
    for source, target in CONVERSIONS:
        for sr_seed, offset in ((None, 0), (4, 2**32 - 300)):
            calls.clear()
            xs = x.to(source)
            out = ops.cast.prepare(xs, target, sr_seed, offset)
            ascend_cast.cast(x=xs, dtype=target, seed=sr_seed, offset=offset, out=out)
            assert_same_bits(out, cast_ref(xs, target, sr_seed, offset))
            main = numel - numel % 256
            rows = ([(main // 256, 256)] if main else []) + ([(1, 256)] if main < numel else [])
            assert [c[0] for c in calls] == rows
            if sr_seed is not None:
                assert calls[-1][1] == sr_scalars(sr_seed, offset + (main if main < numel else 0))


# --- device: the CUDA kernel against the reference, unbiased, reproducible, and against the peer --------------------

DEVICE_NUMELS = level_choice([1, 7, 4096 + 3, 1 << 20],
                             [1, 2, 3, 5, 7, 9, 255, 4096 + 3, 65537, 1 << 20, (1 << 22) + 5])


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("source,target", CONVERSIONS, ids=["f32-bf16", "f32-e4m3", "bf16-e4m3"])
@pytest.mark.parametrize("sr_seed,offset", [(None, 0), (0, 0), (1234, 2**32 - 4000), (-7, 2**63 - 2**21)])
def test_device_kernel_bitwise(source, target, sr_seed, offset, seed):
    for numel in DEVICE_NUMELS:
        x = cast_call(0, 0, seed=seed + numel, dtype=source, shape=(numel,))["x"]
        for shape in ((numel,), (1, numel)):
            got = ops.cast(x.view(shape).cuda(), target, sr_seed, offset)
            assert_same_bits(got, cast_ref(x.view(shape), target, sr_seed, offset))


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("source,target", CONVERSIONS, ids=["f32-bf16", "f32-e4m3", "bf16-e4m3"])
def test_device_extremes_bitwise(source, target):
    """inf, NaN, signed zeros, the saturation edges, fp32 and e4m3 subnormals; every element position of a vector
    and the ragged tail."""
    v = edge_values(source)
    x = v.repeat(37)  # 28 * 37 elements: every value at every position modulo the vector width, and a tail
    for sr_seed in (None, 3, 2**63 - 1):
        assert_same_bits(ops.cast(x.cuda(), target, sr_seed, 11), cast_ref(x, target, sr_seed, 11))


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("source,target", CONVERSIONS, ids=["f32-bf16", "f32-e4m3", "bf16-e4m3"])
def test_device_stochastic_rounding_is_unbiased(source, target):
    check_unbiased(lambda x, *args: ops.cast(x.cuda(), *args).cpu(), source, target, 2**32 - 2**13)


@requires_cuda
@pytest.mark.device
def test_device_stochastic_rounding_reproducible_split_and_compiled(seed):
    x = cast_call(64, 1000, seed=seed)["x"].cuda()
    for target in (BF16, E4M3):
        one = ops.cast(x, target, 5, 2**32 - 25000)
        assert torch.equal(bits_of(one), bits_of(ops.cast(x, target, 5, 2**32 - 25000)))
        split = torch.cat([ops.cast(x[:25], target, 5, 2**32 - 25000), ops.cast(x[25:], target, 5, 2**32)])
        assert torch.equal(bits_of(split), bits_of(one))
        compiled = torch.compile(lambda t, s, o: ops.cast(t, target, s, o), fullgraph=True, dynamic=True)
        assert torch.equal(bits_of(compiled(x, 5, 2**32 - 25000)), bits_of(one))


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("source,target", CONVERSIONS, ids=["f32-bf16", "f32-e4m3", "bf16-e4m3"])
def test_device_equals_the_peer_round_to_nearest(source, target, seed):
    """DeepSeek's tile_kernels (when importable), round to nearest, bitwise (its stochastic rounding is not ours)."""
    peer = pytest.importorskip("tile_kernels.quant")
    for numel in (4096, 4096 * 4096 + 8, 1000003):
        x = cast_call(0, 0, seed=seed, dtype=source, shape=(numel,))["x"].cuda()
        x[:28] = edge_values(source).cuda()
        assert_same_bits(ops.cast(x, target), peer.cast(x, target).cpu())
