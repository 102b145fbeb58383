"""Example calls of the quant ops, the family's cases registry (read through tests/_plugins/cases.py): for each op
``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema order.
The default layout of a cast is the hardest one of its kind to lay out (column-major UE8M0 words with TMA
padding: DeepGEMM's SM100 activations), so that every cross-op test (fakes, opcheck, DTensor) sees strided
scales; the op's own tests pass the others with ``layout=``.
"""

import torch

import cann_ops_tilelang as ops
from quant_ref import per_token_quantize_ref

BF16, F32 = torch.bfloat16, torch.float32

# the family's ops as registered, not listed here (each has an <op>_call below: tests/test_example_calls.py)
OPS = [name for name, public in ops.registered_ops().items() if public.declaration.family == "quant"]

PER_TOKEN_LAYOUT = "1x128/e4m3/ue8m0/col_tma/round"


def sample(tokens, hidden, *, seed=0, dtype=BF16, spread=3.0):
    """Rows of very different magnitudes (their groups' scales span many binades), some exact zeros and one all-zero
    group per row (the amax clamp), drawn on the CPU from one generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen) * spread)
    x[:, 3::17] = 0.0
    x[:, :16] = 0.0
    return x.to(dtype)


def to_device(t, device):
    """``t`` on ``device`` with its shape, strides and storage offset (a col_tma scale tensor keeps its padding)."""
    count = t.untyped_storage().nbytes() // t.element_size()
    flat = t.new_empty(0).set_(t.untyped_storage(), 0, (count,), (1,))
    return flat.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def float_rows(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, pitch=None):
    """:func:`sample` on ``device``, with ``pitch``: rows strided by that many elements (NaN past ``H``)."""
    x = sample(tokens, hidden, seed=seed, dtype=dtype)
    if pitch is not None:
        base = torch.full((tokens, pitch), float("nan"), dtype=dtype)
        base[:, :hidden] = x
        return base.to(device)[:, :hidden]
    return x.to(device)


def per_token_cast_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_TOKEN_LAYOUT, dtype=BF16, pitch=None,
                        x_layout=None):
    """``x (T, H)`` (``pitch``: rows strided by that many elements, the columns past ``H`` never read) and a
    per-token layout spec; with ``x_layout`` (re-quantization) ``x`` is that x quantized to ``x_layout`` (the
    reference's CUDA bytes) and ``x_sf`` its scales."""
    x = float_rows(tokens, hidden, seed=seed, device=device, dtype=dtype, pitch=pitch)
    if x_layout is None:
        return {"x": x, "layout": layout, "x_sf": None, "x_layout": None}
    q = per_token_quantize_ref(sample(tokens, hidden, seed=seed, dtype=dtype), x_layout)
    return {"x": to_device(q.data, device), "layout": layout, "x_sf": to_device(q.sf, device), "x_layout": x_layout}


def per_token_cast_sf_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_TOKEN_LAYOUT, dtype=BF16, pitch=None):
    """As :func:`per_token_cast_call`: ``x`` and a per-token layout spec."""
    return {"x": float_rows(tokens, hidden, seed=seed, device=device, dtype=dtype, pitch=pitch), "layout": layout}


def per_token_cast_with_sf_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_TOKEN_LAYOUT, dtype=BF16,
                                pitch=None, sf_seed=None):
    """``x``, scales ``sf`` in ``layout`` (the reference's CUDA bytes: those of ``x`` itself, or with ``sf_seed``
    those of another draw, so that values saturate or round off the grid) and the layout spec."""
    x = float_rows(tokens, hidden, seed=seed, device=device, dtype=dtype, pitch=pitch)
    sf = per_token_quantize_ref(sample(tokens, hidden, seed=seed if sf_seed is None else sf_seed, dtype=dtype), layout,
                                sf_only=True)
    return {"x": x, "sf": to_device(sf, device), "layout": layout}


PER_BLOCK_LAYOUT = "128x128/e4m3/ue8m0/col_tma/round"


def per_block_cast_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_BLOCK_LAYOUT, dtype=BF16, pitch=None):
    """A weight ``x (T, H)`` (``pitch``: rows strided by that many elements, never read past ``H``) and a per-block
    layout spec."""
    return {"x": float_rows(tokens, hidden, seed=seed, device=device, dtype=dtype, pitch=pitch), "layout": layout}


def per_block_cast_sf_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_BLOCK_LAYOUT, dtype=BF16, pitch=None):
    return per_block_cast_call(tokens, hidden, seed=seed, device=device, layout=layout, dtype=dtype, pitch=pitch)


# row-major by default: the cross-op tests copy each input's bytes with clone().view(uint8), which a column-major
# scale input cannot give (its own tests pass col_tma scales)
PER_BLOCK_SF_INPUT_LAYOUT = "128x128/e4m3/ue8m0/row/round"


def per_block_cast_with_sf_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_BLOCK_SF_INPUT_LAYOUT, dtype=BF16,
                                pitch=None, sf_seed=None):
    """``x``, its scales in ``layout`` for the backend of ``device`` (the reference's, of ``x`` itself, or of
    another draw with ``sf_seed``), allocated there with the layout's strides, and the layout."""
    from quant_ref import per_block_quantize_ref

    from cann_ops_tilelang import policy
    from cann_ops_tilelang.quant import ScaleLayout

    call = per_block_cast_call(tokens, hidden, seed=seed, device=device, layout=layout, dtype=dtype, pitch=pitch)
    backend = policy.kernel_backend(torch.device(device).type)
    source = sample(tokens, hidden, seed=seed if sf_seed is None else sf_seed, dtype=dtype)  # x's values on the CPU
    values = per_block_quantize_ref(source, layout, sf_only=True, backend=backend)
    sf = ScaleLayout.parse(layout).empty_sf(tokens, hidden, backend, device=device)
    sf.copy_(values)
    return {"x": call["x"], "sf": sf, "layout": layout}


def cast_back_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_TOKEN_LAYOUT, out_dtype=BF16, dtype=BF16):
    """``data`` and ``sf``: :func:`sample` quantized to ``layout`` by the reference (any layout kind), in the bytes of
    ``device``'s backend (CUDA's on CPU and meta), the scales re-laid on ``device`` with the layout's exact strides;
    ``out_dtype`` bf16 or fp32."""
    from quant_ref import quantize

    from cann_ops_tilelang import policy
    from cann_ops_tilelang.quant import ScaleLayout

    backend = policy.kernel_backend(torch.device(device).type)
    spec = ScaleLayout.parse(layout)
    q = quantize(sample(tokens, hidden, seed=seed, dtype=dtype), spec, backend=backend)
    sf = spec.empty_sf(tokens, hidden, backend, device=device)
    if sf.numel():
        sf.copy_(q.sf.to(device))
    return {"data": q.data.to(device), "sf": sf, "layout": spec.spec, "out_dtype": out_dtype}


def per_token_cast_and_cast_back_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_TOKEN_LAYOUT, dtype=BF16,
                                      pitch=None):
    """``x (T, H)`` (``pitch``: rows strided, the columns past ``H`` never read nor written) and a per-token layout."""
    return {"x": float_rows(tokens, hidden, seed=seed, device=device, dtype=dtype, pitch=pitch), "layout": layout}



PER_CHANNEL_LAYOUT = "128x1/e4m3/ue8m0/row/round"


def per_channel_cast_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_CHANNEL_LAYOUT, dtype=BF16, pitch=None,
                          x_layout=None):
    """``x (T, H)`` bf16 / fp32 (``pitch``: rows strided by that many elements, NaN past ``H``) and a per-channel
    layout spec; with ``x_layout`` (a per-token e4m3 spec of group 32 or 128) ``x`` is instead the data of that cast
    of the sample, with its scales ``x_sf`` in the bytes of ``device``'s backend (re-quantization)."""
    from cann_ops_tilelang import policy
    from quant_ref import per_token_quantize_ref

    x = sample(tokens, hidden, seed=seed, dtype=dtype)
    x_sf = None
    if x_layout is not None:
        q = per_token_quantize_ref(x, x_layout, backend=policy.kernel_backend(torch.device(device).type))
        x, x_sf = q.data, q.sf
    if pitch is not None:
        base = torch.full((tokens, pitch), float("nan"), dtype=torch.float32).to(x.dtype)
        base[:, :hidden] = x
        x = base[:, :hidden]
    return {"x": x.to(device), "layout": layout, "x_sf": None if x_sf is None else x_sf.to(device),
            "x_layout": x_layout}


def weight_scales(shape, *, seed=0):
    """fp32 power-of-two scales of a weight (exponent bytes 100..149), a few of them with a mantissa or a negative
    sign (the op drops both)."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(100, 150, shape, generator=gen, dtype=torch.int32) << 23
    if bits.numel() > 2:
        flat = bits.view(-1)
        flat[1] |= 0x12345
        flat[2] |= -2**31
    return bits.view(torch.float32)


def transpose_weight_sf_call(tokens, hidden, *, seed=0, device="cpu", block_size=32, transpose_sf1=False):
    """Two weights' scales: a 2-D ``(N / b, K / b)`` one (``N = H``, ``K = 3 H``, an odd word count at b = 128) and a
    grouped ``(G, 2 H / b, H / b)`` one with ``G = tokens`` groups (none at T = 0)."""
    nb = hidden // block_size
    sf = [weight_scales((nb, 3 * nb), seed=seed), weight_scales((tokens, 2 * nb, nb), seed=seed + 1)]
    return {"sf": [s.to(device) for s in sf], "block_size": block_size, "transpose_sf1": transpose_sf1}


def cast_call(tokens, hidden, *, seed=0, device="cpu", dtype=F32, to=BF16, sr_seed=None, offset=0, shape=None):
    """``x (T, H)`` (``shape``: any other; the op takes any shape) of ``dtype`` cast to ``to``, round to nearest even
    unless ``sr_seed`` is given (then stochastic rounding from the counter ``offset``). The data seed is ``seed``,
    the op's own seed ``sr_seed``."""
    shape = (tokens, hidden) if shape is None else shape
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 4.0)).to(dtype)
    return {"x": x.to(device), "dtype": to, "seed": sr_seed, "offset": offset}


# x takes any shape: a reshaped or resized x is a valid call, not a bad one (tests/test_bad_input.py)
cast_call.any_shape = ("x",)
