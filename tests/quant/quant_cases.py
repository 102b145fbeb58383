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
