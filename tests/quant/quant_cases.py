"""Example calls of the quant ops, the family's cases registry (read through tests/_plugins/cases.py): for each op
``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema order.
The default layout of a cast is the hardest one of its kind to lay out (column-major UE8M0 words with TMA
padding: DeepGEMM's SM100 activations), so that every cross-op test (fakes, opcheck, DTensor) sees strided
scales; the op's own tests pass the others with ``layout=``.
"""

import torch

import cann_ops_tilelang as ops

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


def per_token_cast_call(tokens, hidden, *, seed=0, device="cpu", layout=PER_TOKEN_LAYOUT, dtype=BF16, pitch=None):
    """``x (T, H)`` (``pitch``: rows strided by that many elements, the columns past ``H`` never read) and a
    per-token layout spec."""
    x = sample(tokens, hidden, seed=seed, dtype=dtype)
    if pitch is not None:
        base = torch.full((tokens, pitch), float("nan"), dtype=dtype)
        base[:, :hidden] = x
        x = base.to(device)[:, :hidden]
    return {"x": x.to(device), "layout": layout}


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
