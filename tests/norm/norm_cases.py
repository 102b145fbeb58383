"""Example calls of the norm ops, the family's cases registry (read through tests/_plugins/cases.py): for each op
``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema order.
"""

import torch

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

BF16, F32 = torch.bfloat16, torch.float32

# the family's ops as registered, not listed here (each has an <op>_call below: tests/test_example_calls.py)
OPS = [name for name, public in ops.registered_ops().items() if public.declaration.family == "norm"]


# --- rms_norm ----------------------------------------------------------------------------------------------------

# the default fused cast: groups of 32 (any H of the range), UE8M0 scales in SM100's column-major storage
RMS_NORM_LAYOUT = "1x32/e4m3/ue8m0/col_tma/round"


def norm_rows(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, pitch=None, lead=None, scale=1.0):
    """Normal rows ``(T, H)`` times ``scale`` (``lead``: the leading dims instead of ``(T,)``; ``pitch``: rows strided
    by that many elements, NaN past ``H``), drawn on the CPU from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (tokens,) if lead is None else tuple(lead)
    x = (torch.randn(*shape, hidden, generator=gen) * scale).to(dtype)
    if pitch is not None:
        base = torch.full((*shape, pitch), float("nan"), dtype=dtype)
        base[..., :hidden] = x
        return base.to(device)[..., :hidden]
    return x.to(device)


def rms_norm_forward_call(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, weight=True, residual=True,
                          layout=RMS_NORM_LAYOUT, with_y=True, out_scale=0.75, eps=1e-6, pitch=None, lead=None):
    """``x`` and ``residual`` rows, a weight around 1 (or None), a fused cast ``layout`` (or None) with ``y`` too."""
    rows = dict(device=device, dtype=dtype, pitch=pitch, lead=lead)
    w = (1.0 + 0.1 * norm_rows(1, hidden, seed=seed + 2, dtype=F32)[0]).to(dtype).to(device) if weight else None
    return {"x": norm_rows(tokens, hidden, seed=seed, **rows),
            "weight": w, "eps": eps,
            "residual": norm_rows(tokens, hidden, seed=seed + 1, **rows) if residual else None,
            "out_scale": out_scale, "layout": layout, "with_y": with_y}


def rms_norm_backward_call(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, weight=True, grad_weight=True,
                           grad_residual_out=True, out_scale=0.75, eps=1e-6, pitch=None, lead=None):
    """``grad_y``, the norm input ``x`` and its ``rstd`` (from the forward's reference on the CPU), a weight (or
    None), a zero fp32 ``grad_weight`` buffer (or None) and ``grad_residual_out`` (or None)."""
    from norm_ref import rms_norm_forward_ref

    rows = dict(dtype=dtype, pitch=pitch, lead=lead)
    x = norm_rows(tokens, hidden, seed=seed, **rows)
    w = (1.0 + 0.1 * norm_rows(1, hidden, seed=seed + 2, dtype=F32)[0]).to(dtype) if weight else None
    rstd = rms_norm_forward_ref(x, w, eps)[1].contiguous()
    return {"grad_y": norm_rows(tokens, hidden, seed=seed + 3, **rows).to(device), "x": x.to(device),
            "weight": None if w is None else w.to(device), "rstd": rstd.to(device),
            "grad_weight": torch.zeros(hidden, dtype=F32, device=device) if weight and grad_weight else None,
            "grad_residual_out": norm_rows(tokens, hidden, seed=seed + 4, device=device, **rows)
            if grad_residual_out else None,
            "out_scale": out_scale}
# --- layer_norm -----------------------------------------------------------------------------------------------------

# the default fused cast of the example calls: column-major UE8M0 words (the hardest storage) of 64-channel groups
# (64 divides every H of limits.NORM_HIDDEN)
LAYER_NORM_LAYOUT = "1x64/e4m3/ue8m0/col_tma/round"
LAYER_NORM_EPS = 1e-5


def layer_norm_rows(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, pitch=None, offset=0.0, lead=None):
    """``(T, H)`` normal rows with per-row magnitudes and an ``offset`` added (a large mean), drawn on the CPU from
    one generator; ``pitch``: rows strided by that many elements (NaN past ``H``); ``lead``: leading dims
    ``lead`` instead of ``T`` (their product is ``T``)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen)) + offset
    x = x.to(dtype)
    if pitch is not None:
        base = torch.full((tokens, pitch), float("nan"), dtype=dtype)
        base[:, :hidden] = x
        x = base.to(device)[:, :hidden]
    x = x.to(device)
    return x if lead is None else x.reshape(*lead, hidden)


def layer_norm_param(hidden, *, seed=0, device="cpu", dtype=BF16, center=1.0):
    """An ``(H,)`` weight (``center`` 1) or bias (``center`` 0) with spread."""
    gen = torch.Generator().manual_seed(seed)
    return (center + 0.5 * torch.randn(hidden, generator=gen)).to(dtype).to(device)


def layer_norm_forward_call(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, weight=True, bias=True,
                            residual=True, layout=LAYER_NORM_LAYOUT, with_y=True, pitch=None, offset=0.0, lead=None):
    """``x``, weight, bias, eps, a residual, the fused cast's layout and ``with_y`` (the defaults exercise every
    output); ``pitch`` strides the rows of x and the residual, ``offset`` adds a large mean, ``lead`` reshapes
    the rows to leading dims."""
    rows = dict(device=device, dtype=dtype, pitch=pitch, offset=offset, lead=lead)
    return {"x": layer_norm_rows(tokens, hidden, seed=seed, **rows),
            "weight": layer_norm_param(hidden, seed=seed + 1, device=device, dtype=dtype) if weight else None,
            "bias": layer_norm_param(hidden, seed=seed + 2, device=device, dtype=dtype, center=0.0) if bias else None,
            "eps": LAYER_NORM_EPS,
            "residual": layer_norm_rows(tokens, hidden, seed=seed + 3, **{**rows, "offset": 0.0}) if residual else None,
            "layout": layout, "with_y": with_y}


def layer_norm_backward_call(tokens, hidden, *, seed=0, device="cpu", dtype=BF16, weight=True, bias=True,
                             residual=True, pitch=None, offset=0.0, lead=None):
    """``grad_y``, the forward's input ``x``, weight, its statistics (the reference's), fp32 weight and bias
    gradient buffers holding earlier sums, and ``grad_residual_out``."""
    from norm_ref import layer_norm_forward_ref

    rows = dict(dtype=dtype, pitch=pitch, offset=offset, lead=lead)
    x = layer_norm_rows(tokens, hidden, seed=seed, device=device, **rows)
    w = layer_norm_param(hidden, seed=seed + 1, dtype=dtype) if weight else None
    # the statistics of the same draw on the CPU (device may be meta)
    cpu_x = layer_norm_rows(tokens, hidden, seed=seed, **rows)
    _, mean, rstd, *_ = layer_norm_forward_ref(cpu_x, w, None, LAYER_NORM_EPS)
    gen = torch.Generator().manual_seed(seed + 4)

    def buffer():
        return torch.randn(hidden, generator=gen).to(device)

    grads = {**rows, "device": device, "offset": 0.0}
    return {"grad_y": layer_norm_rows(tokens, hidden, seed=seed + 5, **grads),
            "x": x, "weight": None if w is None else w.to(device),
            "mean": mean.contiguous().to(device), "rstd": rstd.contiguous().to(device),
            "grad_weight": buffer() if weight else None, "grad_bias": buffer() if bias else None,
            "grad_residual_out": layer_norm_rows(tokens, hidden, seed=seed + 6, **grads) if residual else None}


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
    per-token cast's widths) the fused cast of ``grad_x``; ``quantized``: a per-token e4m3 layout spec, ``x``
    quantized to it (the reference's CUDA bytes) with its scales."""
    gen = torch.Generator().manual_seed(seed + 2)
    if layout == "auto":
        layout = "1x64/e4m3/ue8m0/row/round" if 2 * hidden <= limits.QUANT_HIDDEN.high else None
    x = swiglu_x(tokens, hidden, seed=seed, device="cpu", dtype=dtype if quantized is None else F32, lead=lead,
                 pitch=pitch)
    x_sf = None
    if quantized is not None:
        from norm_ref import quant_reference

        q = quant_reference().per_token_quantize_ref(x.reshape(tokens, 2 * hidden), quantized)
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
