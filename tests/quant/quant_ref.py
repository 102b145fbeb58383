"""Device-free PyTorch references of the quant family (docs/ops/quant.md).

fp32 arithmetic in the contract's order (each fp32 operation correctly rounded, as the kernels do), so that
the kernels can be compared bitwise; float64 only where the contract defines a value exactly (stochastic
rounding's grid position). The ``<op>_ref`` of a declared op takes the op's arguments (the layout as its spec
string) and returns its outputs: the test plugin registers it as the op's CPU kernel. The others
(``per_token_quantize_ref`` with every variant of the per-token cast, the casts that have no op yet) take the
layout as a :class:`ScaleLayout` or its spec string, and ``backend`` (``"cuda"`` / ``"ascend"``) for the bytes
that depend on it (UE8M0 words, TMA padding, the order of one multiplication when re-quantizing); the casts
return a :class:`QuantTensor`.
"""

import torch

from cann_ops_tilelang import policy
from cann_ops_tilelang.quant import FORMATS, UE8M0_WORDS, QuantTensor, ScaleLayout

F32 = torch.float32

# --- FP4 e2m1: codes, packing ----------------------------------------------------------------------------

# the magnitude of each code 0..7 (code = sign << 3 | exponent << 1 | mantissa)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring magnitudes: a tie goes to the even code (mantissa bit 0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8 0..15, same shape): round to nearest even on the grid, saturating at 6; the
    sign bit (8) is the sign bit of ``v`` (-0.0 -> 8); NaN -> 7 with its sign bit (the peer's choice)."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.int64)
    for lower, mid in enumerate(_E2M1_MIDPOINTS):  # lower: the code just below the midpoint
        code += ((mag > mid) | ((mag == mid) & (lower % 2 == 1))).long()
    code = torch.where(torch.isnan(v), 7, code)
    return (code | (torch.signbit(v).long() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> fp32 values (code 8 is -0.0)."""
    codes = codes.long()
    mag = torch.tensor(E2M1_VALUES, dtype=F32)[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``(..., H)`` codes -> ``(..., H / 2)`` uint8: value ``2j`` in bits 0-3 of byte ``j``, ``2j + 1`` in 4-7."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``(..., n)`` uint8 (or the peer's int8) -> ``(..., 2n)`` codes (low nibble first)."""
    packed = packed.view(torch.uint8)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def data_values(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of a data tensor: e4m3 widened, e2m1 unpacked and decoded (``(T, 2 * bytes)``)."""
    return e2m1_decode(unpack_fp4(data)) if fmt == "e2m1" else data.float()


# --- round to nearest and stochastic rounding -------------------------------------------------------------

# (mantissa bits, smallest normal exponent, largest finite value or None where the format keeps inf)
GRIDS = {"bf16": (7, -126, None), **{k: (f.mantissa_bits, f.min_normal_exp, f.max) for k, f in FORMATS.items()}}


def narrow(v: torch.Tensor, fmt: str, seed: int | None = None, offset: int = 0) -> torch.Tensor:
    """fp32 -> e4m3 (torch.float8_e4m3fn) or e2m1 codes (uint8, unpacked): round to nearest even and
    saturate at +-max (NaN stays NaN for e4m3), or stochastic rounding (:func:`stochastic_round`) with
    counters ``offset + i``, ``i`` the row-major index of ``v``'s elements, when ``seed`` is given."""
    if seed is not None:
        v = stochastic_round(v, fmt, random_bits(seed, offset, v.numel()).view(v.shape))
    if fmt == "e2m1":
        return e2m1_encode(v)
    vmax = FORMATS[fmt].max
    return v.clamp(-vmax, vmax).to(FORMATS[fmt].dtype)


_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2^32`` for int64 tensors holding uint32 values (split so that nothing overflows int64)."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _M32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of uint32), on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def random_bits(seed: int, offset: int, count: int) -> torch.Tensor:
    """The 32 random bits of counters ``n = offset + i``, ``i < count`` (int64 tensor of uint32 values):
    ``r(n) = fmix32((n_lo * 0x9E3779B1 mod 2^32) ^ key)``, ``key = fmix32(fmix32(fmix32(n_hi ^ 0x243F6A88)
    ^ seed_hi) ^ seed_lo)``; ``n_lo`` / ``n_hi`` the low / high 32 bits of ``n mod 2^64``, ``seed_lo`` /
    ``seed_hi`` those of ``seed mod 2^64``. For one key, ``n_lo -> r`` is a bijection (no repeats)."""
    if not 0 <= offset < 2**63:
        raise ValueError(f"offset must be in [0, 2^63); got {offset}")
    seed %= 2**64
    lo = (offset & _M32) + torch.arange(count, dtype=torch.int64)
    n_lo, n_hi = lo & _M32, ((offset >> 32) + (lo >> 32)) & _M32
    key = fmix32(fmix32(fmix32(n_hi ^ 0x243F6A88) ^ (seed >> 32)) ^ (seed & _M32))
    return fmix32(_mul32(n_lo, 0x9E3779B1) ^ key)


def stochastic_round(v: torch.Tensor, fmt: str, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``v`` -> fp32 values of the ``fmt`` grid (``"bf16"``, ``"e4m3"``, ``"e2m1"``), rounded by the
    32-bit ``bits`` (same shape): with ``G = max(floor(log2|v|), emin) - mantissa_bits`` (the grid spacing
    ``2^G`` at ``|v|``), ``P = |v| / 2^G``, ``q = floor(P)``, ``frac32 = floor((P - q) * 2^32)``: the result
    is ``sign(v) * (q + (bits < frac32)) * 2^G``, saturated at the format's max (bf16: inf stays, rounding
    past the max gives inf). Exact values never move; ``E[result] - v`` is below ``2^-32`` of a spacing.
    NaN stays NaN (e2m1, which has none: +-6 by its sign bit); +-inf saturates (bf16: stays)."""
    mantissa, emin, vmax = GRIDS[fmt]
    a = v.double().abs()
    _, e = torch.frexp(a)  # a = f * 2^e, f in [0.5, 1): floor(log2 a) = e - 1
    g = torch.clamp(e.long() - 1, min=emin) - mantissa
    position = torch.ldexp(a, -g)  # exact: a power-of-two scaling in float64
    q = position.floor()
    frac32 = ((position - q) * 2.0**32).floor()
    mag = torch.ldexp(q + (bits.double() < frac32).double(), g)
    if vmax is not None:
        mag = mag.clamp(max=vmax)
        mag = torch.where(torch.isinf(a), vmax, mag)
    else:
        mag = torch.where(torch.isinf(a), a, mag)
    out = torch.copysign(mag, v.double())
    if fmt == "e2m1":
        out = torch.where(torch.isnan(v), torch.copysign(torch.full_like(out, vmax), v.double()), out)
    else:
        out = torch.where(torch.isnan(v), v.double(), out)
    return out.float()


# --- scales ------------------------------------------------------------------------------------------------


def layout_of(layout) -> ScaleLayout:
    return ScaleLayout.parse(layout)


def expand(grid: torch.Tensor, block: tuple, tokens: int, hidden: int) -> torch.Tensor:
    """``(ceil(T/rows), H/cols)`` per-block values -> ``(T, H)``, each element its block's value."""
    return grid.repeat_interleave(block[0], 0)[:tokens].repeat_interleave(block[1], 1)[:, :hidden]


def block_amax(v: torch.Tensor, block: tuple) -> torch.Tensor:
    """``max |v|`` over each block of ``v (T, H)`` fp32 (a ragged last block row: its valid rows only)."""
    tokens, hidden = v.shape
    rows, cols = block
    nm = -(-tokens // rows)
    padded = torch.zeros(nm * rows, hidden, dtype=F32)  # zeros never exceed a valid |v|
    padded[:tokens] = v.abs()
    return padded.view(nm, rows, hidden // cols, cols).amax(dim=(1, 3))


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``s`` (positive normal fp32): ``2^ceil(log2 s)`` by the exponent bits."""
    return ((s.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(F32)


def block_scales(amax: torch.Tensor, layout: ScaleLayout):
    """``(stored, s, inv)`` of the blocks from their amax (fp32): ``a = max(amax, clamp)``; fp32 scales
    ``s = a / max``, ``inv = max / a``; rounded ``s = 2^ceil(log2(a / max))``, ``inv = 1 / s`` (exact); e4m3
    scales ``s = e4m3(a / max)``, ``inv = 1 / f32(s)``. ``stored`` is what the scale tensor holds: fp32
    ``s``, the e4m3 ``s``, or the UE8M0 byte ``log2(s) + 127`` (uint8)."""
    a = torch.clamp(amax, min=layout.amax_clamp)
    fmax = torch.full_like(a, layout.fmax)  # tensor / tensor: torch divides by a scalar as a product
    s = a / fmax
    if layout.round_sf:
        s = pow2_ceil(s)
        inv = torch.ones_like(s) / s
    elif layout.sf == "e4m3":
        stored = s.clamp(max=448.0).to(torch.float8_e4m3fn)
        s = stored.float()
        return stored, s, torch.ones_like(s) / s
    else:
        inv = fmax / a
    stored = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8) if layout.sf == "ue8m0" else s
    return stored, s, inv


def _pack_words(exponents: torch.Tensor, pack: int, word: torch.dtype) -> torch.Tensor:
    """``(..., n)`` exponent bytes -> ``(..., ceil(n / pack))`` words: byte ``b`` (memory order, little
    endian: ``word = sum byte_b << 8b``) of word ``j`` is exponent ``pack * j + b``; missing bytes are 0."""
    n = exponents.shape[-1]
    padded = torch.zeros(*exponents.shape[:-1], -(-n // pack) * pack, dtype=torch.uint8)
    padded[..., :n] = exponents
    if padded.numel() == 0:  # torch views no empty tensor as a wider dtype
        return torch.zeros(padded.shape[:-1] + (padded.shape[-1] // pack,), dtype=word)
    return padded.view(word)


def encode_sf(stored: torch.Tensor, layout: ScaleLayout, tokens: int, hidden: int, backend: str) -> torch.Tensor:
    """The scale tensor of a layout from the stored scales ``(ceil(T/rows), H/cols)`` (:func:`block_scales`):
    UE8M0 bytes packed into words (along H; along T for per-channel blocks), and for ``"col_tma"`` the
    transposed view of a ``(cols, tma_rows)`` row-major buffer whose padding rows are 0."""
    if layout.sf == "ue8m0":
        pack, word = UE8M0_WORDS[backend]
        if layout.kind == "per_channel":
            stored = _pack_words(stored.t(), pack, word).t()
        else:
            stored = _pack_words(stored, pack, word)
    if layout.storage == "row":
        return stored.contiguous()
    rows, cols = stored.shape
    padded = layout.tma_rows(tokens, hidden, backend)
    buffer = torch.zeros(cols, padded, dtype=stored.dtype)
    buffer[:, :rows] = stored.t()
    return buffer.as_strided((rows, cols), (1, padded))


def decode_sf(sf: torch.Tensor, layout: ScaleLayout, tokens: int, hidden: int, backend: str) -> torch.Tensor:
    """fp32 scales ``(ceil(T/rows), H/cols)`` of a scale tensor: UE8M0 byte ``e`` -> ``2^(e - 127)`` (fp32 bits
    ``e << 23``: 0 -> 0.0, 255 -> inf), e4m3 widened, fp32 as is; any storage (read through its strides)."""
    nm, nk = layout.sf_grid(tokens, hidden)
    if layout.sf != "ue8m0":
        return sf.float().contiguous()
    pack = layout.ue8m0_pack(backend)
    raw = sf.new_empty(sf.shape).copy_(sf).view(torch.uint8)  # row-major (contiguous() may keep a size-1 dim's stride)
    if layout.kind == "per_channel":  # words (ceil(nm / pack), nk): byte b of word [i, c] is row pack * i + b
        raw = raw.view(raw.shape[0], nk, pack).permute(0, 2, 1).reshape(-1, nk)[:nm]
    else:
        raw = raw[:, :nk]
    return (raw.to(torch.int32) << 23).view(F32)


# --- the casts ---------------------------------------------------------------------------------------------


def _dequantized(x, x_sf, x_layout, backend):
    """``(values, data values, expanded scales)`` of an input: a float tensor, or quantized data with scales."""
    if x_sf is None:
        return x.float(), None, None
    xl = layout_of(x_layout)
    tokens, hidden = x.shape[0], xl.hidden_of(x)
    xq = data_values(x, xl.fmt)
    sx = expand(decode_sf(x_sf, xl, tokens, hidden, backend), xl.block, tokens, hidden)
    return xq * sx, xq, sx


def quantize(x, layout, *, x_sf=None, x_layout=None, sf=None, seed=None, offset=0, backend="cuda",
             fused_requant=False) -> QuantTensor:
    """The cast every ``*_cast_ref`` is: ``x (T, H)`` bf16 / fp32, or quantized data ``x`` with scales ``x_sf``
    in ``x_layout`` (re-quantization: values ``f32(x) * sx``), to ``layout``. Scales from each block's amax
    (:func:`block_scales`), or the given ``sf`` (in ``layout``): then ``inv = 1 / s``. Data
    ``narrow(v * inv)``; re-quantizing with ``fused_requant``: ``narrow(f32(x) * (sx * inv))``."""
    layout = layout_of(layout)
    v, xq, sx = _dequantized(x, x_sf, x_layout, backend)
    tokens, hidden = v.shape
    if sf is not None:
        s = decode_sf(sf, layout, tokens, hidden, backend)
        inv, stored = torch.ones_like(s) / s, None
    else:
        stored, s, inv = block_scales(block_amax(v, layout.block), layout)
    inv = expand(inv, layout.block, tokens, hidden)
    scaled = xq * (sx * inv) if xq is not None and fused_requant else v * inv
    data = narrow(scaled, layout.fmt, seed, offset)
    if layout.fmt == "e2m1":
        data = pack_fp4(data)
    out_sf = sf if stored is None else encode_sf(stored, layout, tokens, hidden, backend)
    return QuantTensor(data, out_sf, layout)


def _kind(layout, kinds, op):
    layout = layout_of(layout)
    if layout.kind not in kinds:
        raise ValueError(f"{op}: layout {layout.spec} is {layout.kind}; expected {' or '.join(kinds)}")
    return layout


def per_token_cast_ref(x, layout, x_sf=None, x_layout=None):
    """The op ``per_token_cast(x, layout, x_sf, x_layout) -> (data, sf)``: ``x`` bf16 / fp32 (or, with ``x_sf`` and
    ``x_layout``, per-token quantized data re-quantized) cast to the per-token ``layout`` (a spec string), the
    scales in the bytes of the backend of ``x``'s device (``policy.kernel_backend``: CUDA's on CPU and meta
    tensors, hence CUDA's re-quantization order). The test plugin registers it as the op's CPU kernel."""
    q = per_token_quantize_ref(x, layout, x_sf=x_sf, x_layout=x_layout, backend=policy.kernel_backend(x.device.type))
    return q.data, q.sf


def per_token_cast_sf_ref(x, layout):
    """The op ``per_token_cast_sf(x, layout) -> sf``: the scales of :func:`per_token_cast_ref` alone."""
    return per_token_quantize_ref(x, layout, sf_only=True, backend=policy.kernel_backend(x.device.type))


def per_token_cast_with_sf_ref(x, sf, layout):
    """The op ``per_token_cast_with_sf(x, sf, layout) -> data``: the data of ``x`` with the given scales,
    ``inv = fl(1 / s)``."""
    return per_token_quantize_ref(x, layout, sf=sf, backend=policy.kernel_backend(x.device.type))


def per_token_quantize_ref(x, layout, x_sf=None, x_layout=None, sf=None, sf_only=False, seed=None, offset=0,
                           backend="cuda"):
    """Per-token-group cast (blocks ``(1, g)``) with every variant of the contract. Re-quantization multiplies
    ``f32(x) * (sx * inv)`` on CUDA, ``(f32(x) * sx) * inv`` on Ascend (the peer's orders). ``sf`` given: data
    only; ``sf_only``: scales only; ``seed``: stochastic rounding, counter ``offset + t * H + h``."""
    layout = _kind(layout, ("per_token",), "per_token_quantize_ref")
    q = quantize(x, layout, x_sf=x_sf, x_layout=x_layout, sf=sf, seed=seed, offset=offset, backend=backend,
                 fused_requant=backend == "cuda")
    return q.sf if sf_only else q.data if sf is not None else q


def per_block_quantize_ref(x, layout, sf=None, sf_only=False, backend="cuda"):
    """Per-block cast (blocks ``(128, 128)``, ``(32, 32)``) of a bf16 / fp32 ``x``, every variant of the contract:
    a :class:`QuantTensor`; ``sf`` given (in ``layout``): the data only, ``inv = 1 / s``; ``sf_only``: the scales
    only. A ragged last block row takes its amax over its valid rows."""
    layout = _kind(layout, ("per_block",), "per_block_quantize_ref")
    q = quantize(x, layout, sf=sf, backend=backend)
    return q.sf if sf_only else q.data if sf is not None else q


def per_block_cast_ref(x, layout):
    """The op ``per_block_cast(x, layout) -> (data, sf)``, the scales in the bytes of the backend of ``x``'s device
    (``policy.kernel_backend``: CUDA's on CPU and meta tensors)."""
    q = per_block_quantize_ref(x, layout, backend=policy.kernel_backend(x.device.type))
    return q.data, q.sf


def per_block_cast_sf_ref(x, layout):
    """The op ``per_block_cast_sf(x, layout) -> sf``: the scales of :func:`per_block_cast_ref`, bitwise."""
    return per_block_quantize_ref(x, layout, sf_only=True, backend=policy.kernel_backend(x.device.type))


def per_block_cast_with_sf_ref(x, sf, layout):
    """The op ``per_block_cast_with_sf(x, sf, layout) -> data``: ``x`` cast with the given scales ``sf`` (in
    ``layout`` for the backend of ``x``'s device), ``inv = fl(1 / s)``."""
    return per_block_quantize_ref(x, layout, sf=sf, backend=policy.kernel_backend(x.device.type))


def per_channel_cast_ref(x, layout, x_sf=None, x_layout=None):
    """The op ``per_channel_cast(x, layout, x_sf=None, x_layout=None) -> (data, sf)``: :func:`per_channel_quantize_ref`
    in the bytes of the backend of ``x``'s device (CUDA's on CPU and meta tensors). The test plugin registers it as
    the op's CPU kernel."""
    q = per_channel_quantize_ref(x, layout, x_sf, x_layout, backend=policy.kernel_backend(x.device.type))
    return q.data, q.sf


def per_channel_quantize_ref(x, layout, x_sf=None, x_layout=None, backend="cuda"):
    """Per-channel cast (blocks ``(32|128, 1)``, e4m3); re-quantizes ``(f32(x) * sx) * inv`` on both backends."""
    layout = _kind(layout, ("per_channel",), "per_channel_quantize_ref")
    return quantize(x, layout, x_sf=x_sf, x_layout=x_layout, backend=backend)


def cast_back_ref(data, sf, layout, out_dtype=torch.bfloat16, backend=None):
    """The op ``cast_back(data, sf, layout, out_dtype) -> out``: ``out = out_dtype(f32(data) * s)`` (one fp32
    product, one rounding), ``(T, H)``; the scales in the bytes of ``backend`` (default: that of ``data``'s device,
    ``policy.kernel_backend``: CUDA's on CPU and meta tensors)."""
    layout = layout_of(layout)
    backend = backend or policy.kernel_backend(data.device.type)
    tokens, hidden = data.shape[0], layout.hidden_of(data)
    s = expand(decode_sf(sf, layout, tokens, hidden, backend), layout.block, tokens, hidden)
    return (data_values(data, layout.fmt) * s).to(out_dtype)


def per_token_cast_and_cast_back_ref(x, layout) -> None:
    """In place: ``x = x.dtype(f32(narrow(f32(x) * inv)) * s)`` with the scales of ``layout`` (per-token);
    storage and packing do not matter (no scale is stored)."""
    layout = _kind(layout, ("per_token",), "per_token_cast_and_cast_back_ref")
    v = x.float()
    _, s, inv = block_scales(block_amax(v, layout.block), layout)
    tokens, hidden = v.shape
    q = narrow(v * expand(inv, layout.block, tokens, hidden), layout.fmt)
    values = e2m1_decode(q) if layout.fmt == "e2m1" else q.float()
    x.copy_((values * expand(s, layout.block, tokens, hidden)).to(x.dtype))


_CAST_TARGETS = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}


def cast_ref(x, dtype, seed=None, offset=0):
    """Element-wise narrowing cast, fp32 -> bf16 / e4m3 or bf16 -> e4m3: round to nearest even (e4m3
    saturating), or stochastic rounding with counter ``offset + i`` (``i`` row-major) when ``seed`` is given."""
    if x.dtype not in (F32, torch.bfloat16) or dtype not in _CAST_TARGETS or x.dtype == dtype:
        raise ValueError(f"cast_ref: {x.dtype} -> {dtype} is not a narrowing cast of the contract")
    fmt = _CAST_TARGETS[dtype]
    v = x.float()
    if seed is not None:
        v = stochastic_round(v, fmt, random_bits(seed, offset, v.numel()).view(v.shape))
    return v.to(dtype) if fmt == "bf16" else narrow(v, fmt)


def transpose_weight_sf_ref(sf, block_size, transpose_sf1):
    """The op ``transpose_weight_sf(sf, block_size, transpose_sf1) -> [sf0_0, sf1_0, sf0_1, ...]``: the pairs of
    :func:`transpose_weight_sf_pairs_ref` flattened, in the words of the backend of the scales' device (CUDA's on
    CPU and meta tensors). The test plugin registers it as the op's CPU kernel."""
    backend = policy.kernel_backend(sf[0].device.type)
    return [out for pair in transpose_weight_sf_pairs_ref(sf, block_size, transpose_sf1, backend) for out in pair]


def transpose_weight_sf_pairs_ref(sf, block_size, transpose_sf1, backend="cuda"):
    """Weight scales -> DeepGEMM's packed UE8M0 pairs, per weight. Each ``sf`` is fp32 powers of two,
    ``(N/b, K/b)`` or grouped ``(G, N/b, K/b)`` (``b = block_size``); the exponent byte of each is ``(bits >>
    23) & 0xFF`` (a mantissa is dropped). Returns ``(sf0, sf1)``: ``sf0 (G, N, ceil(K/b/p))``, strides ``(.,
    1, N)``, row ``n``'s scales along K packed ``p`` per word (``p = 4`` int32 CUDA, ``2`` int16 Ascend);
    ``sf1 (G, K, ceil(N/b/p))``, strides ``(., 1, K)``, column ``k``'s scales along N packed, or with
    ``transpose_sf1`` (a bool for every weight, or one per weight) its transpose ``(G, ceil(N/b/p), K)``
    contiguous. 2-D ``sf`` gives 2-D outputs."""
    pack, word = UE8M0_WORDS[backend]
    outs = []
    if isinstance(transpose_sf1, bool):  # one flag for every weight (the op's), or one per weight (the peer's)
        transpose_sf1 = [transpose_sf1] * len(sf)
    for weight_sf, transpose in zip(sf, transpose_sf1, strict=True):
        grouped = weight_sf.dim() == 3
        w = weight_sf if grouped else weight_sf.unsqueeze(0)
        exponents = ((w.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        by_row = _pack_words(exponents.repeat_interleave(block_size, 1), pack, word)  # (G, N, W0)
        by_col = _pack_words(exponents.transpose(1, 2).repeat_interleave(block_size, 1), pack, word)  # (G, K, W1)
        # buffers (G, W0, N) and (G, W1, K) row-major, returned transposed (explicit: a size-1 W keeps strides)
        sf0 = by_row.new_empty(by_row.transpose(1, 2).shape).copy_(by_row.transpose(1, 2)).transpose(1, 2)
        sf1 = by_col.new_empty(by_col.transpose(1, 2).shape).copy_(by_col.transpose(1, 2))
        sf1 = sf1 if transpose else sf1.transpose(1, 2)
        outs.append((sf0, sf1) if grouped else (sf0[0], sf1[0]))
    return outs
