"""The quant references (tests/quant/quant_ref.py) against the contract (docs/ops/quant.md): an independent
float64 oracle of the formulas (grids enumerated from the formats' bit fields, fp32 operations as float64
ones rounded once), the packings, the round-trip error bounds, the stochastic rounding spec (pure-Python
random words, unbiasedness, reproducibility, the kernels' integer recipe) and, where DeepSeek's tile_kernels
is importable, bitwise equality with its PyTorch references on both backends' packings."""

import itertools
import math

import pytest
import torch
from _plugins.levels import level_choice

import quant_ref as ref
from cann_ops_tilelang.quant import BLOCKS, ScaleLayout

ALL_BLOCKS = [b for blocks in BLOCKS.values() for b in blocks]
BACKENDS = ("cuda", "ascend")
TOKENS = level_choice([0, 1, 130], [0, 1, 31, 130, 257])


def layouts(blocks=ALL_BLOCKS, storages=("row", "col_tma")):
    out = []
    for block, fmt, sf, storage, round_sf in itertools.product(blocks, ("e4m3", "e2m1"), ("fp32", "e4m3", "ue8m0"),
                                                               storages, (False, True)):
        try:
            out.append(ScaleLayout(block, fmt, sf, storage, round_sf))
        except ValueError:
            pass
    return out


ROW_LAYOUTS = layouts(storages=("row",))


def sample(tokens, hidden, dtype=torch.float32, spread=3.0):
    """Rows of very different magnitudes (the scales span many binades), some exact zeros."""
    x = torch.randn(tokens, hidden) * torch.exp(torch.randn(tokens, 1) * spread)
    x[:, 3::17] = 0.0
    return x.to(dtype)


# --- the float64 oracle ------------------------------------------------------------------------------------


def grid(fmt):
    """(non-negative finite values ascending, their codes) from the format's bit fields."""
    if fmt == "e4m3":  # s eeee mmm, bias 7; 0x7F is NaN
        codes = torch.arange(127)
        e, m = codes >> 3, (codes & 7).double()
        values = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    else:  # s ee m, bias 1
        codes = torch.arange(8)
        e, m = codes >> 1, (codes & 1).double()
        values = torch.where(e == 0, m / 2, (1 + m / 2) * torch.pow(2.0, (e - 1).double()))
    return values, codes


def oracle_codes(w, fmt):
    """Round-to-nearest-even codes (sign bit included) of float64 ``w``, saturating at the largest value."""
    values, codes = grid(fmt)
    mag = w.abs().clamp(max=values[-1].item())
    hi = torch.searchsorted(values, mag).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    code = torch.where(pick_hi, codes[hi], codes[lo])
    sign_bit = 7 if fmt == "e4m3" else 3
    return (code | (torch.signbit(w).long() << sign_bit)).to(torch.uint8)


def f32(t):
    """float64 -> the nearest fp32 (as float64): one fp32 operation computed in float64 and rounded once
    (exact for products and, 53 >= 2 * 24 + 2, for quotients)."""
    return t.float().double()


def pow2_ceil64(s):
    mantissa, e = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), torch.where(mantissa == 0.5, e - 1, e))


def oracle_scales(amax64, layout):
    """(s, inv) in float64 holding fp32 values."""
    fmax = layout.fmax
    a = torch.clamp(amax64, min=f32(torch.tensor(layout.amax_clamp, dtype=torch.float64)).item())
    s = f32(a / fmax)
    if layout.round_sf:
        s = pow2_ceil64(s)
        return s, 1 / s
    if layout.sf == "e4m3":
        values, _ = grid("e4m3")
        s = values[oracle_codes(s, "e4m3").long() & 0x7F]
        return s, f32(1 / s)
    return s, f32(fmax / a)


def oracle_amax(v64, block):
    rows, cols = block
    tokens, hidden = v64.shape
    out = torch.zeros(math.ceil(tokens / rows), hidden // cols, dtype=torch.float64)
    for i, j in itertools.product(range(out.shape[0]), range(out.shape[1])):
        out[i, j] = v64[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max()
    return out


def data_codes(q):
    return ref.unpack_fp4(q.data) if q.layout.fmt == "e2m1" else q.data.view(torch.uint8)


@pytest.mark.parametrize("layout", ROW_LAYOUTS, ids=lambda x: x.spec)
def test_casts_equal_the_float64_oracle(layout):
    rows, cols = layout.block
    for tokens, dtype in ((0, torch.float32), (rows + 3, torch.bfloat16), (2 * rows, torch.float32)):
        x = sample(tokens, cols * 4 if cols > 1 else 64, dtype)
        q = ref.quantize(x, layout)
        v = x.double()
        s, inv = oracle_scales(oracle_amax(v, layout.block), layout) if tokens else (None, None)
        if tokens == 0:
            assert q.data.shape == layout.data_shape(0, x.shape[1]) and q.sf.shape[0] == 0
            continue
        got_s = ref.decode_sf(q.sf, layout, *x.shape, "cuda").double()
        assert torch.equal(got_s, s), layout.spec
        w = f32(v * ref.expand(inv, layout.block, *x.shape))
        assert torch.equal(data_codes(q), oracle_codes(w, layout.fmt)), layout.spec


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("into", [ScaleLayout((1, 32), "e4m3", "fp32"), ScaleLayout((1, 128), "e2m1", "ue8m0",
                                  round_sf=True), ScaleLayout((128, 1), "e4m3", "fp32")], ids=lambda x: x.spec)
def test_requantization_equals_the_oracle_in_each_backends_order(into, backend):
    source = ScaleLayout((1, 128), "e4m3", "ue8m0", "col_tma", True)
    x = sample(256, 512, spread=1.0)
    q = ref.quantize(x, source, backend=backend)
    cast = ref.per_token_quantize_ref if into.kind == "per_token" else ref.per_channel_quantize_ref
    got = cast(q.data, into, x_sf=q.sf, x_layout=source, backend=backend)
    xq = q.data.double()
    sx = ref.expand(ref.decode_sf(q.sf, source, 256, 512, backend), source.block, 256, 512).double()
    v = f32(xq * sx)
    s, inv = oracle_scales(oracle_amax(v, into.block), into)
    inv = ref.expand(inv, into.block, 256, 512)
    fused = backend == "cuda" and into.kind == "per_token"
    w = f32(xq * f32(sx * inv)) if fused else f32(v * inv)
    assert torch.equal(data_codes(got), oracle_codes(w, into.fmt))
    assert torch.equal(ref.decode_sf(got.sf, into, 256, 512, backend).double(), s)


def test_requantizing_power_of_two_scales_into_their_own_layout_keeps_every_value():
    layout = ScaleLayout((1, 32), "e4m3", "ue8m0", round_sf=True)
    q = ref.quantize(sample(64, 256), layout)
    again = ref.per_token_quantize_ref(q.data, layout, x_sf=q.sf, x_layout=layout)
    assert torch.equal(ref.cast_back_ref(*again, torch.float32), ref.cast_back_ref(*q, torch.float32))


def test_precomputed_scales_use_their_reciprocal_and_sf_only_gives_the_scales():
    layout = ScaleLayout((1, 64), "e4m3", "fp32")
    x = sample(9, 256)
    sf = ref.per_token_quantize_ref(x, layout, sf_only=True)
    assert torch.equal(sf, ref.quantize(x, layout).sf)
    data = ref.per_token_quantize_ref(x, layout, sf=sf * 3)
    w = f32(x.double() * ref.expand(f32(1 / (sf * 3).double()), layout.block, 9, 256))
    assert torch.equal(data.view(torch.uint8), oracle_codes(w, "e4m3"))


def test_the_kernels_reciprocal_product_lands_in_the_same_power_of_two():
    """A kernel may compute ``a * f32(1 / max)`` instead of ``a / max`` before rounding up to a power of two
    (the peer's CUDA kernels do): every fp32 mantissa of one binade (the bins repeat per binade)."""
    a = (torch.arange(2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)  # [1, 2)
    for fmax in (448.0, 6.0):
        divided = ref.pow2_ceil(a / torch.full_like(a, fmax))
        multiplied = ref.pow2_ceil(a * (torch.ones(()) / fmax))
        assert torch.equal(divided, multiplied), fmax


# --- cast back, fake quantization, plain casts -----------------------------------------------------------

@pytest.mark.parametrize("layout", layouts(), ids=lambda x: x.spec)
def test_cast_back_is_one_fp32_product_rounded_once(layout):
    x = sample(70, layout.block[1] * 4 if layout.block[1] > 1 else 64)
    for backend in BACKENDS:
        q = ref.quantize(x, layout, backend=backend)
        s = ref.expand(ref.decode_sf(q.sf, layout, *x.shape, backend), layout.block, *x.shape).double()
        values = ref.data_values(q.data, layout.fmt).double()
        for out_dtype in (torch.float32, torch.bfloat16):
            got = ref.cast_back_ref(q.data, q.sf, layout, out_dtype, backend)
            assert got.dtype == out_dtype and torch.equal(got, (values * s).to(out_dtype)), (backend, out_dtype)


@pytest.mark.parametrize("layout", layouts(BLOCKS["per_token"], ("row",)), ids=lambda x: x.spec)
def test_fake_quantization_in_place_equals_cast_then_cast_back(layout):
    for dtype in (torch.bfloat16, torch.float32):
        base = torch.zeros(40, 512, dtype=dtype)
        x = base[:, :256]  # strided rows (stride 512), as the op allows
        x.copy_(sample(40, 256, dtype))
        expected = ref.cast_back_ref(*ref.quantize(x, layout), dtype)
        ref.per_token_cast_and_cast_back_ref(x, layout)
        assert torch.equal(x, expected) and torch.equal(base[:, 256:], torch.zeros(40, 256, dtype=dtype))


def test_round_to_nearest_casts_equal_the_oracle():
    v = torch.cat([torch.randn(4096) * 100, torch.randn(4096) * 2.0**-8, torch.tensor([448.0, 464.0, 465.0, 1e9, -1e9,
                   2.0**-10, 3 * 2.0**-11, -0.0, 0.0, float("inf"), -float("inf")])])
    for source in (torch.float32, torch.bfloat16):
        x = v.to(source)
        got = ref.cast_ref(x, torch.float8_e4m3fn)
        assert torch.equal(got.view(torch.uint8), oracle_codes(x.double(), "e4m3"))
    assert torch.equal(ref.cast_ref(v, torch.bfloat16), v.to(torch.bfloat16))
    for source, target in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                           (torch.int32, torch.bfloat16)):
        with pytest.raises(ValueError, match="not a narrowing cast"):
            ref.cast_ref(torch.zeros(2, dtype=source), target)


# --- packings ------------------------------------------------------------------------------------------

def test_fp4_packing_round_trips_and_puts_the_first_value_in_the_low_nibble():
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 64)
    assert torch.equal(ref.pack_fp4(ref.unpack_fp4(every_byte)), every_byte)
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    assert torch.equal(ref.unpack_fp4(ref.pack_fp4(codes)), codes)
    assert ref.pack_fp4(torch.tensor([[1, 2]], dtype=torch.uint8)).item() == 0x21
    assert torch.equal(ref.unpack_fp4(every_byte.view(torch.int8)), ref.unpack_fp4(every_byte))  # the peer's int8


def test_e2m1_codes_decode_to_the_grid_and_ties_go_to_even():
    codes = torch.arange(16, dtype=torch.uint8)
    values = ref.e2m1_decode(codes)
    assert values.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.equal(ref.e2m1_encode(values), codes)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert ref.e2m1_decode(ref.e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    sweep = torch.linspace(-8, 8, 20001)
    assert torch.equal(ref.e2m1_encode(sweep), oracle_codes(sweep.double(), "e2m1"))
    assert ref.e2m1_encode(torch.tensor([float("nan"), -float("nan"), float("inf")])).tolist() == [7, 15, 7]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [x for x in layouts() if x.sf == "ue8m0"], ids=lambda x: x.spec)
def test_ue8m0_words_hold_the_exponent_bytes_in_order_and_round_trip(layout, backend):
    pack = {"cuda": 4, "ascend": 2}[backend]
    for tokens in TOKENS:
        hidden = layout.block[1] * 6 if layout.block[1] > 1 else 40
        nm, nk = layout.sf_grid(tokens, hidden)
        exponents = torch.randint(1, 255, (nm, nk), dtype=torch.int32).to(torch.uint8)
        sf = ref.encode_sf(exponents, layout, tokens, hidden, backend)
        assert sf.dtype == layout.sf_dtype(backend) and tuple(sf.shape) == layout.sf_shape(tokens, hidden, backend)
        if sf.numel() and min(sf.shape) > 1:
            assert sf.stride() == layout.sf_strides(tokens, hidden, backend)
        decoded = ref.decode_sf(sf, layout, tokens, hidden, backend)
        assert torch.equal(decoded, (exponents.to(torch.int32) << 23).view(torch.float32))
        words = sf.to(torch.int64) & (2 ** (8 * pack) - 1)  # the unsigned word
        along = exponents.t() if layout.kind == "per_channel" else exponents  # packed along its last dim
        words = words.t() if layout.kind == "per_channel" else words
        for j, b in itertools.product(range(words.shape[1]), range(pack)):
            byte = (words[:, j] >> (8 * b)) & 0xFF
            k = pack * j + b
            assert torch.equal(byte, along[:, k].long() if k < along.shape[1] else torch.zeros_like(byte)), (j, b)


def test_col_tma_storage_is_the_transposed_view_of_a_padded_buffer():
    layout = ScaleLayout((1, 128), "e4m3", "fp32", "col_tma")
    q = ref.quantize(sample(13, 512), layout)
    assert q.sf.shape == (13, 4) and q.sf.stride() == (1, 16)
    buffer = q.sf.as_strided((4, 16), (16, 1))
    assert torch.equal(buffer[:, :13].t(), q.sf) and torch.equal(buffer[:, 13:], torch.zeros(4, 3))


# --- transpose_weight_sf -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_transpose_weight_sf_packs_rows_and_columns(backend):
    pack = {"cuda": 4, "ascend": 2}[backend]
    weights = [torch.randint(100, 150, (5, 7)), torch.randint(1, 254, (3, 6, 9)), torch.randint(120, 130, (1, 1))]
    sfs = [(e.to(torch.int32) << 23).view(torch.float32) for e in weights]
    for block in (32, 128):
        outs = ref.transpose_weight_sf_pairs_ref(sfs, block, [False, True, False], backend)
        for e, transpose, (sf0, sf1) in zip(weights, [False, True, False], outs):
            e3 = e if e.dim() == 3 else e.unsqueeze(0)
            groups, nn, nk = e3.shape
            n, k = nn * block, nk * block
            w0, w1 = math.ceil(nk / pack), math.ceil(nn / pack)
            s0 = sf0 if e.dim() == 3 else sf0.unsqueeze(0)
            s1 = sf1 if e.dim() == 3 else sf1.unsqueeze(0)
            if transpose:
                assert s1.shape == (groups, w1, k) and s1.is_contiguous()
                s1 = s1.transpose(1, 2)
            assert s0.shape == (groups, n, w0) and sf0.stride()[-2:] == (1, n)
            assert s1.shape == (groups, k, w1) and s1.stride()[-2:] == (1, k)
            if e.dim() == 3:
                assert (sf0.stride(0), sf1.stride(0)) == (w0 * n, w1 * k)
            mask = 2 ** (8 * pack) - 1
            for g, b in itertools.product(range(groups), range(pack)):
                byte0 = (s0[g].long() & mask) >> (8 * b) & 0xFF  # (n, w0): row r, scales along K
                byte1 = (s1[g].long() & mask) >> (8 * b) & 0xFF  # (k, w1): column c, scales along N
                for j in range(w0):
                    col = pack * j + b
                    want = e3[g, torch.arange(n) // block, col] if col < nk else torch.zeros(n, dtype=torch.long)
                    assert torch.equal(byte0[:, j], want)
                for i in range(w1):
                    row = pack * i + b
                    want = e3[g, row, torch.arange(k) // block] if row < nn else torch.zeros(k, dtype=torch.long)
                    assert torch.equal(byte1[:, i], want)


# --- round trips -----------------------------------------------------------------------------------------

# per-element bound of |cast_back(cast(x)) - x| in units of (|x|, the block's scale s): half a spacing of the
# format, relative in its normal range, absolute (half the subnormal spacing times s) below it
ROUND_TRIP = {"e4m3": (2.0**-4, 2.0**-10), "e2m1": (2.0**-2, 2.0**-2)}


@pytest.mark.parametrize("layout", ROW_LAYOUTS, ids=lambda x: x.spec)
def test_round_trips_stay_within_the_formats_error(layout):
    x = sample(256, 512 if layout.block[1] > 1 else 64)
    if layout.sf == "e4m3":  # the bound needs each scale a normal e4m3: 2^-6 <= block amax / max <= 448
        amax = ref.expand(ref.block_amax(x, layout.block), layout.block, *x.shape).clamp(min=1e-30)
        x = x * amax.clamp(layout.fmax * 2.0**-6, layout.fmax * 448) / amax
    q = ref.quantize(x, layout)
    back = ref.cast_back_ref(q.data, q.sf, layout, torch.float32).double()
    s = ref.expand(ref.decode_sf(q.sf, layout, *x.shape, "cuda"), layout.block, *x.shape).double()
    relative, absolute = ROUND_TRIP[layout.fmt]
    v = x.double()
    bound = (relative * v.abs() + absolute * s) * (1 + 2.0**-20)
    assert ((back - v).abs() <= bound).all(), ((back - v).abs() - bound).max()
    amax = ref.expand(ref.block_amax(x, layout.block), layout.block, *x.shape).double()
    assert ((back - v).abs() <= relative * amax.clamp(min=layout.amax_clamp) * (1 + 2.0**-20)).all()  # of the amax


# --- stochastic rounding -----------------------------------------------------------------------------------

def python_random_word(seed, n):
    """The spec of docs/ops/quant.md#stochastic_rounding with Python ints (independent of the tensor code)."""
    def fmix(h):
        h ^= h >> 16
        h = h * 0x85EBCA6B & 0xFFFFFFFF
        h ^= h >> 13
        h = h * 0xC2B2AE35 & 0xFFFFFFFF
        return h ^ (h >> 16)

    seed, n = seed % 2**64, n % 2**64
    key = fmix(fmix(fmix((n >> 32) ^ 0x243F6A88) ^ (seed >> 32)) ^ (seed & 0xFFFFFFFF))
    return fmix(((n & 0xFFFFFFFF) * 0x9E3779B1 & 0xFFFFFFFF) ^ key)


@pytest.mark.parametrize("seed, offset", [(0, 0), (1234, 5), (-1, 2**32 - 3), (2**62 + 7, 2**40), (7, 2**63 - 9)])
def test_random_words_follow_the_spec_across_the_32_bit_carry(seed, offset):
    got = ref.random_bits(seed, offset, 8).tolist()
    assert got == [python_random_word(seed, offset + i) for i in range(8)]
    assert ref.random_bits(seed, offset + 5, 3).tolist() == got[5:]


def test_random_words_pinned_values():
    """Fixed words a kernel test can check first (seed 0 and 42, counters 0..3)."""
    assert ref.random_bits(0, 0, 4).tolist() == [python_random_word(0, n) for n in range(4)]
    assert [hex(w) for w in ref.random_bits(42, 0, 2).tolist()] == [hex(python_random_word(42, n)) for n in range(2)]
    with pytest.raises(ValueError, match="offset"):
        ref.random_bits(0, -1, 1)


def test_random_words_are_distinct_and_balanced():
    words = ref.random_bits(99, 0, 2**16)
    assert words.unique().numel() == 2**16  # a bijection of the counter's low word
    ones = torch.stack([(words >> b) & 1 for b in range(32)]).double().mean(dim=1)
    assert ((ones - 0.5).abs() < 4 * 0.5 / 2**8).all(), ones  # 4 sigma of 2^16 fair bits


SR_FORMATS = ("bf16", "e4m3", "e2m1")


def spacing(v, fmt):
    mantissa, emin, _ = ref.GRIDS[fmt]
    _, e = torch.frexp(v.double().abs())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), torch.clamp(e.long() - 1, min=emin) - mantissa)


@pytest.mark.parametrize("fmt", SR_FORMATS)
def test_stochastic_rounding_is_unbiased(fmt):
    """The mean of N draws is within 4 standard deviations (a spacing / (2 sqrt N) each) of the value."""
    n = 2**14
    vmax = {"bf16": 1e30, "e4m3": 400.0, "e2m1": 5.5}[fmt]
    values = torch.cat([torch.rand(24) * vmax, torch.rand(8) * 2.0**-8, torch.tensor([0.3, 5.25])]).clamp(max=vmax)
    draws = values.repeat(n, 1)  # counters differ per draw
    rounded = ref.stochastic_round(draws, fmt, ref.random_bits(3, 0, draws.numel()).view(draws.shape)).double()
    step = spacing(values, fmt)
    assert ((rounded - values.double()).abs() < step).all()  # one of the two neighbours
    bias = (rounded.mean(dim=0) - values.double()).abs()
    assert (bias <= 4 * step / (2 * math.sqrt(n)) + step * 2.0**-32).all(), (bias / step).max()


@pytest.mark.parametrize("fmt", SR_FORMATS)
def test_stochastic_rounding_keeps_exact_values_and_saturates(fmt):
    _, _, vmax = ref.GRIDS[fmt]
    exact = {"bf16": torch.tensor([1.0, -3.0, 2.0**-130, 0.0]), "e4m3": torch.tensor([448.0, -2.0**-9, 0.0, 1.125]),
             "e2m1": torch.tensor([6.0, -0.5, 0.0, 3.0])}[fmt]
    bits = torch.full(exact.shape, 2**32 - 1, dtype=torch.int64)
    assert torch.equal(ref.stochastic_round(exact, fmt, bits), exact)
    edge = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e38 if fmt != "bf16" else 3.3961e38])
    got = ref.stochastic_round(edge, fmt, torch.zeros(4, dtype=torch.int64))
    if vmax is None:
        assert torch.isinf(got[:2]).all() and torch.isnan(got[2]) and torch.isinf(got[3])  # rounded past the max
    else:
        assert got[0] == vmax and got[1] == -vmax and got[3] == vmax
        assert (got[2] == vmax) if fmt == "e2m1" else torch.isnan(got[2])


def sr_integer_recipe(v, fmt, bits):
    """The kernels' recipe on the fp32 bits (finite v): ``eb`` the biased exponent, ``M`` the significand with
    its hidden bit, ``E = max(eb, 1) - 127``, ``G = max(E, emin) - m``, ``s = 23 + G - E``; ``q = M >> s``,
    ``frac32 = M << (32 - s) mod 2^32`` (s <= 32) or ``M >> (s - 32)``; carry ``bits < frac32``."""
    mantissa, emin, vmax = ref.GRIDS[fmt]
    u = v.view(torch.int32).long() & 0x7FFFFFFF
    eb = u >> 23
    m = (u & 0x7FFFFF) | ((eb > 0).long() << 23)
    e = torch.clamp(eb, min=1) - 127
    g = torch.clamp(e, min=emin) - mantissa
    s = 23 + g - e
    q = m >> s.clamp(max=63)
    frac32 = torch.where(s <= 32, (m << (32 - s).clamp(min=0)) & 0xFFFFFFFF, m >> (s - 32).clamp(0, 63))
    mag = torch.ldexp((q + (bits < frac32).long()).double(), g)
    mag = mag if vmax is None else mag.clamp(max=vmax)
    return torch.copysign(mag, v.double()).float()


@pytest.mark.parametrize("fmt", SR_FORMATS)
def test_the_integer_recipe_equals_the_definition(fmt):
    v = torch.cat([torch.randn(20000) * torch.exp(torch.randn(20000) * 6), torch.randn(2000) * 1e-40,
                   torch.tensor([0.0, -0.0, 2.0**-149, 3.0e38])])
    bits = ref.random_bits(11, 0, v.numel())
    assert torch.equal(sr_integer_recipe(v, fmt, bits), ref.stochastic_round(v, fmt, bits))


def test_stochastic_casts_are_reproducible_and_compose_by_offset():
    x = torch.randn(6, 256) * 10
    def fp8(seed, offset):
        return ref.cast_ref(x, torch.float8_e4m3fn, seed=seed, offset=offset).view(torch.uint8)

    assert torch.equal(fp8(5, 100), fp8(5, 100)) and not torch.equal(fp8(5, 100), fp8(6, 100))
    assert not torch.equal(fp8(5, 100), fp8(5, 101))
    split = torch.cat([ref.cast_ref(x[:2], torch.bfloat16, seed=5, offset=100),
                       ref.cast_ref(x[2:], torch.bfloat16, seed=5, offset=100 + 2 * 256)])
    assert torch.equal(split, ref.cast_ref(x, torch.bfloat16, seed=5, offset=100))
    layout = ScaleLayout((1, 32), "e2m1", "ue8m0", round_sf=True)
    q = ref.per_token_quantize_ref(x, layout, seed=9, offset=0)
    _, _, inv = ref.block_scales(ref.block_amax(x, layout.block), layout)
    v = x * ref.expand(inv, layout.block, *x.shape)
    expected = ref.e2m1_encode(ref.stochastic_round(v, "e2m1", ref.random_bits(9, 0, v.numel()).view(v.shape)))
    assert torch.equal(ref.unpack_fp4(q.data), expected)


# --- the peer's PyTorch references (when importable) ------------------------------------------------------

@pytest.fixture(params=BACKENDS)
def peer(request, monkeypatch):
    """tile_kernels.torch.cast with the packing of one backend (its is_ascend() patched)."""
    cast = pytest.importorskip("tile_kernels.torch.cast")
    common = pytest.importorskip("tile_kernels.quant.common")
    for module in (cast, common):
        monkeypatch.setattr(module, "is_ascend", lambda: request.param == "ascend")
    return request.param, cast


def dense_bytes(t):
    return t.new_empty(t.shape).copy_(t).view(torch.uint8)


def same_tensor(a, b):
    assert a.shape == b.shape and torch.equal(dense_bytes(a), dense_bytes(b))
    if a.numel() and min(a.shape) > 1:
        assert a.stride() == b.stride()


@pytest.mark.parametrize("layout", layouts(), ids=lambda x: x.spec)
def test_casts_equal_the_peer_bitwise(peer, layout):
    backend, cast = peer
    for tokens, dtype in ((1, torch.float32), (layout.block[0] + 5, torch.bfloat16)):
        x = sample(tokens, 256, dtype)
        mine = ref.quantize(x, layout, backend=backend)
        theirs = cast.cast(x, layout.fmt, layout.block, round_sf=layout.round_sf, use_packed_ue8m0=layout.sf == "ue8m0",
                           use_tma_aligned_col_major_sf=layout.storage == "col_tma", use_e4m3_sf=layout.sf == "e4m3")
        same_tensor(mine.data, theirs[0].view(torch.uint8) if layout.fmt == "e2m1" else theirs[0])
        same_tensor(mine.sf, theirs[1])
        out_fmt = "bf16" if dtype == torch.bfloat16 else "fp32"
        pdata = mine.data.view(torch.int8) if layout.fmt == "e2m1" else mine.data
        same_tensor(ref.cast_back_ref(mine.data, mine.sf, layout, dtype, backend),
                    cast.cast_back((pdata, mine.sf), out_fmt, layout.block))


def test_requantization_equals_the_peer_bitwise(peer):
    backend, cast = peer
    source = ScaleLayout((1, 128), "e4m3", "ue8m0", "col_tma", True)
    x = sample(256, 512, spread=1.0)
    q = ref.quantize(x, source, backend=backend)
    for into in (ScaleLayout((1, 32), "e2m1", "e4m3"), ScaleLayout((1, 128), "e4m3", "fp32"),
                 ScaleLayout((32, 1), "e4m3", "ue8m0", round_sf=True)):
        op = ref.per_token_quantize_ref if into.kind == "per_token" else ref.per_channel_quantize_ref
        mine = op(q.data, into, x_sf=q.sf, x_layout=source, backend=backend)
        theirs = cast.cast((q.data, q.sf), into.fmt, into.block, x_block_size=source.block, round_sf=into.round_sf,
                           use_packed_ue8m0=into.sf == "ue8m0", use_e4m3_sf=into.sf == "e4m3")
        same_tensor(mine.data, theirs[0].view(torch.uint8) if into.fmt == "e2m1" else theirs[0])
        same_tensor(mine.sf, theirs[1])


def test_transpose_weight_sf_and_fp4_codes_equal_the_peer(peer):
    backend, cast = peer
    for shape, block, transpose in itertools.product(((4, 7), (3, 5, 9), (1, 1)), (32, 128), (False, True)):
        sf = (torch.randint(1, 254, shape, dtype=torch.int32) << 23).view(torch.float32)
        (sf0, sf1), = ref.transpose_weight_sf_pairs_ref([sf], block, [transpose], backend)
        peer0, peer1 = cast.transpose_weight_sf(sf, block, transpose)
        for a, b in ((sf0, peer0), (sf1, peer1)):
            assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    sweep = torch.cat([torch.linspace(-7, 7, 70001), torch.tensor([0.25, -2.5, 5.0, -0.0, float("inf"), float("nan")])])
    assert torch.equal(ref.e2m1_encode(sweep), cast.convert_to_e2m1_bits(sweep))
