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
    return per_token_cast_call(tokens, hidden, seed=seed, device=device, layout=layout, dtype=dtype, pitch=pitch)
