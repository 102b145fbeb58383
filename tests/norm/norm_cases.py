"""Example calls of the norm ops, the family's cases registry (read through tests/_plugins/cases.py): for each op
``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema order.
"""

import torch

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

BF16, F32 = torch.bfloat16, torch.float32

# the family's ops as registered, not listed here (each has an <op>_call below: tests/test_example_calls.py)
OPS = [name for name, public in ops.registered_ops().items() if public.declaration.family == "norm"]


# --- swiglu ---------------------------------------------------------------------------------------------------

# the DeepSeek-V4 clamp of the example calls (a few of the draws' elements exceed it), the fused cast where H allows
SWIGLU_CLAMP = 2.5
SWIGLU_LAYOUT = "1x128/e4m3/fp32/row/exact"


def swiglu_x(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, lead=None, pitch=None):
    """``x (..., 2 H)`` ``[gate | up]`` drawn on the CPU (``lead``: the leading dims, their product ``tokens``;
    ``pitch``: rows strided by that many elements, NaN past ``2 H``)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 2 * hidden, generator=gen) * 1.5
    if pitch is not None:
        wide = torch.full((tokens, pitch), float("nan"))
        wide[:, : 2 * hidden] = x
        x = wide[:, : 2 * hidden]
    x = x.to(dtype).to(device)
    return x if lead is None else x.reshape(*lead, 2 * hidden)


def swiglu_expert_offsets(tokens, *, experts=3, alignment=4, device="cpu"):
    """int32 prefix sums of ``experts`` segments over ``tokens`` padded rows: each segment starts aligned, the last
    ends a row before ``tokens`` (trailing padding), one segment is empty."""
    ends, row = [], 0
    for e in range(experts):
        start = -(-row // alignment) * alignment
        end = row if e == 1 else max(row, min(tokens - 1, start + max(1, tokens // experts - 1)))
        ends.append(end)
        row = end
    return torch.tensor(ends, dtype=torch.int32, device=device)


def swiglu_forward_call(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, layout="auto", with_y=True,
                        weighted=True, clamp=SWIGLU_CLAMP, count=True, experts=False, alignment=4, lead=None,
                        pitch=None):
    """``x`` with a routing weight, the clamp and its counters and (``H`` a multiple of 128) the fused cast with
    ``y``; ``experts``: expert segments (not token-shardable, hence not the default)."""
    gen = torch.Generator().manual_seed(seed + 1)
    if layout == "auto":
        layout = SWIGLU_LAYOUT if hidden % 128 == 0 else None
    return {"x": swiglu_x(tokens, hidden, seed=seed, device=device, dtype=dtype, lead=lead, pitch=pitch),
            "routing_weight": (torch.rand(tokens, generator=gen) + 0.1).to(device) if weighted else None,
            "routed_scaling_factor": 2.5 if weighted else 1.0,
            "clamp": clamp,
            "clamped_count": (torch.arange(4, dtype=torch.int64) * 5).to(device) if count and clamp else None,
            "expert_offsets": swiglu_expert_offsets(tokens, alignment=alignment, device=device) if experts else None,
            "alignment": alignment,
            "layout": layout,
            "with_y": with_y}


def swiglu_backward_call(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, layout="auto", recompute=True,
                         weighted=True, clamp=SWIGLU_CLAMP, experts=False, alignment=4, quantized=None, lead=None,
                         pitch=None):
    """``grad_y`` and ``x`` with a routing weight, the clamp, the recomputed ``y`` and (rows of ``2 H`` within the
    per-token cast's widths) the fused cast of ``grad_x``; ``quantized``: a per-token e4m3 layout spec, ``x`` quantized to it (the reference's
    CUDA bytes) with its scales."""
    gen = torch.Generator().manual_seed(seed + 2)
    if layout == "auto":
        layout = "1x64/e4m3/ue8m0/row/round" if 2 * hidden <= limits.QUANT_HIDDEN.high else None
    x = swiglu_x(tokens, hidden, seed=seed, device="cpu", dtype=dtype if quantized is None else F32, lead=lead,
                 pitch=pitch)
    x_sf = None
    if quantized is not None:
        from norm_ref import quant_ref_module

        q = quant_ref_module().per_token_quantize_ref(x.reshape(tokens, 2 * hidden), quantized)
        x, x_sf, dtype = q.data.to(device), q.sf.to(device), BF16
    else:
        x = x.to(device)
    grad_y = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    if lead is not None:
        grad_y = grad_y.reshape(*lead, hidden)
    return {"grad_y": grad_y, "x": x,
            "routing_weight": (torch.rand(tokens, generator=gen) + 0.1).to(device) if weighted else None,
            "routed_scaling_factor": 2.5 if weighted else 1.0,
            "clamp": clamp,
            "expert_offsets": swiglu_expert_offsets(tokens, alignment=alignment, device=device) if experts else None,
            "alignment": alignment,
            "recompute": recompute,
            "x_sf": x_sf,
            "x_layout": quantized,
            "layout": layout}
