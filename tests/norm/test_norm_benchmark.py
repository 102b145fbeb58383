"""Benchmarks of the norm family (run only when asked: ``-m benchmark``), side by side in one run: ours, the peer
(DeepSeek tile_kernels 2.1.0, when importable: RMSNorm and SwiGLU, with and without its fused cast), quack's RMSNorm
(when importable), the reference under inductor (``torch.compile(fullgraph=True, dynamic=True)``, one compile per
reference and non-tensor arguments), the unfused pair (norm then ``per_token_cast``) for the fused casts, and the
device-to-device copy ceiling of the same run (``test_copy_ceiling``).

Bytes: what the op must read and write once. ``gbs = bytes / time_us / 1e3``. Results are compared with the
committed baseline of the chip (tests/norm/benchmark/<chip>/test_norm_benchmark.jsonl).
"""

import importlib.util

import pytest
import torch
from _plugins.device import requires_cuda
from norm_ref import (layer_norm_backward_ref, layer_norm_forward_ref, rms_norm_backward_ref, rms_norm_forward_ref,
                      swiglu_backward_ref, swiglu_forward_ref)

import cann_ops_tilelang as ops

pytestmark = [pytest.mark.benchmark, requires_cuda]

HAVE_PEER = importlib.util.find_spec("tile_kernels") is not None
HAVE_QUACK = importlib.util.find_spec("quack") is not None
# the sizes of a training step, then the peer's own shapes
SHAPES = [(t, h) for t in (4096, 8192, 16384) for h in (4096, 7168)] + [(t, h) for t in (4001, 8001)
                                                                       for h in (2048, 4096, 7168)]
EPS = 1e-6
# the peer's fused cast (e4m3, groups of 32, UE8M0 scales as DeepGEMM's SM100 activations), and DeepSeek-V3's 1x128
CAST_LAYOUTS = ["1x32/e4m3/ue8m0/row/round", "1x128/e4m3/fp32/col_tma/exact"]
_INDUCTOR = {}


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.numel())


def inductor(fn, **static):
    """The reference ``fn`` compiled with its non-tensor arguments ``static`` bound, once per (fn, static) for the whole
    run, shapes dynamic."""
    key = (fn, tuple(sorted((k, str(v)) for k, v in static.items())))
    if key not in _INDUCTOR:
        _INDUCTOR[key] = torch.compile(lambda *tensors: fn(*tensors, **static), fullgraph=True, dynamic=True)
    return _INDUCTOR[key]


def rows(tokens, hidden, device, *, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)


def peer_layout(layout: str) -> dict:
    block, fmt, sf, storage, rounding = layout.split("/")
    return dict(fmt=fmt, num_per_channels=int(block.split("x")[1]), use_tma_aligned_col_major_sf=storage == "col_tma",
                round_sf=rounding == "round", use_packed_ue8m0=sf == "ue8m0")


def rms_forward(x, weight, residual, *, layout=None):
    """``rms_norm_forward_ref`` with the benchmark's ``eps`` (the compiled callable takes tensors only)."""
    return rms_norm_forward_ref(x, weight, EPS, residual, 1.0, layout)


def test_copy_ceiling(bench, device):
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = bench.time_us(lambda: dst.copy_(src))
    bench.record("copy_1GiB", impl="copy", time_us=t, bytes=2 * src.numel())


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_rms_norm_forward(bench, device, tokens, hidden, residual):
    x, w = rows(tokens, hidden, device), rows(1, hidden, device, seed=1)[0]
    res = rows(tokens, hidden, device, seed=2) if residual else None
    y, rstd, res_out, _, _ = ops.rms_norm_forward(x, w, EPS, res)
    peer = quack = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        peer = lambda: tq.norm_forward(x, w, EPS, residual=res, with_rstd=True)  # noqa: E731
    if HAVE_QUACK and not residual:
        from quack import rmsnorm as qr

        quack = lambda: qr.rmsnorm(x, w, eps=EPS)  # noqa: E731
    ref = inductor(rms_forward)
    bench.side_by_side(f"rms_norm_forward-T{tokens}-H{hidden}-{'residual' if residual else 'plain'}", {
        "ours": lambda: ops.rms_norm_forward(x, w, EPS, res),
        "peer": peer,
        "quack": quack,
        "inductor": lambda: ref(x, w, res),
    }, bytes=nbytes(x, res, y, rstd, res_out, w))


@pytest.mark.parametrize("layout", CAST_LAYOUTS)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_rms_norm_forward_cast(bench, device, tokens, hidden, layout):
    x, w = rows(tokens, hidden, device), rows(1, hidden, device, seed=1)[0]
    _, rstd, _, data, sf = ops.rms_norm_forward(x, w, EPS, layout=layout)
    peer = None
    if HAVE_PEER and layout.startswith("1x32/"):
        import tile_kernels.quant as tq

        peer = lambda: tq.norm_forward_and_per_token_cast(x, w, EPS, **peer_layout(layout))  # noqa: E731

    def unfused():
        y = ops.rms_norm_forward(x, w, EPS)[0]
        return ops.per_token_cast(y, layout)

    ref = inductor(rms_forward, layout=layout)
    bench.side_by_side(f"rms_norm_forward_cast-T{tokens}-H{hidden}-{layout.replace('/', '_')}", {
        "ours": lambda: ops.rms_norm_forward(x, w, EPS, layout=layout),
        "peer": peer,
        "unfused": unfused,
        "inductor": lambda: ref(x, w, None),
    }, bytes=nbytes(x, w, rstd, data, sf))


@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_rms_norm_backward(bench, device, tokens, hidden):
    x, w, g = rows(tokens, hidden, device), rows(1, hidden, device, seed=1)[0], rows(tokens, hidden, device, seed=2)
    rstd = ops.rms_norm_forward(x, w, EPS)[1]
    gw = torch.zeros(hidden, dtype=torch.float32, device=device)
    gx = ops.rms_norm_backward(g, x, w, rstd, gw)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        peer = lambda: tq.norm_backward(g, x, w, rstd, weight_grad=gw)  # noqa: E731
    ref = inductor(rms_norm_backward_ref)
    bench.side_by_side(f"rms_norm_backward-T{tokens}-H{hidden}", {
        "ours": lambda: ops.rms_norm_backward(g, x, w, rstd, gw),
        "peer": peer,
        "inductor": lambda: ref(g, x, w, rstd, gw),
    }, bytes=nbytes(g, x, w, rstd, gx) + 2 * gw.numel() * 4)


@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_layer_norm(bench, device, tokens, hidden):
    x, w, b = rows(tokens, hidden, device), rows(1, hidden, device, seed=1)[0], rows(1, hidden, device, seed=3)[0]
    g = rows(tokens, hidden, device, seed=2)
    y, mean, rstd, _, _, _ = ops.layer_norm_forward(x, w, b, EPS)
    gw, gb = (torch.zeros(hidden, dtype=torch.float32, device=device) for _ in range(2))
    fwd, bwd = inductor(layer_norm_forward_ref, eps=EPS), inductor(layer_norm_backward_ref)
    bench.side_by_side(f"layer_norm_forward-T{tokens}-H{hidden}", {
        "ours": lambda: ops.layer_norm_forward(x, w, b, EPS),
        "inductor": lambda: fwd(x, w, b),
    }, bytes=nbytes(x, w, b, y, mean, rstd))
    bench.side_by_side(f"layer_norm_backward-T{tokens}-H{hidden}", {
        "ours": lambda: ops.layer_norm_backward(g, x, w, mean, rstd, gw, gb),
        "inductor": lambda: bwd(g, x, w, mean, rstd, gw, gb),
    }, bytes=nbytes(g, x, w, mean, rstd, y) + 4 * hidden * 4)


# SwiGLU rows: T expanded tokens of 2 H (a routed expert's intermediate, DeepSeek-V3's 2048, and the dense 18432)
SWIGLU_SHAPES = [(t, h) for t in (4096, 8192, 16384) for h in (2048, 4096)] + [(t, h) for t in (4001, 8001)
                                                                              for h in (2048, 7168)]


@pytest.mark.parametrize("layout", [None, "1x128/e4m3/fp32/col_tma/exact"], ids=["bf16", "cast"])
@pytest.mark.parametrize("tokens,hidden", SWIGLU_SHAPES)
def test_bench_swiglu_forward(bench, device, tokens, hidden, layout):
    x = rows(tokens, 2 * hidden, device)
    y, data, sf = ops.swiglu_forward(x, layout=layout)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        if layout is None:
            peer = lambda: tq.swiglu_forward(x, "bf16")  # noqa: E731
        else:
            p = peer_layout(layout)
            peer = lambda: tq.swiglu_forward_and_per_token_cast(  # noqa: E731
                x, p["fmt"], p["num_per_channels"], use_tma_aligned_col_major_sf=p["use_tma_aligned_col_major_sf"],
                round_sf=p["round_sf"], use_packed_ue8m0=p["use_packed_ue8m0"])
    unfused = None
    if layout is not None:
        unfused = lambda: ops.per_token_cast(ops.swiglu_forward(x)[0], layout)  # noqa: E731
    ref = inductor(swiglu_forward_ref, layout=layout)
    bench.side_by_side(f"swiglu_forward-T{tokens}-H{hidden}-{'cast' if layout else 'bf16'}", {
        "ours": lambda: ops.swiglu_forward(x, layout=layout),
        "peer": peer,
        "unfused": unfused,
        "inductor": lambda: ref(x),
    }, bytes=nbytes(x, y, data, sf))


@pytest.mark.parametrize("tokens,hidden", SWIGLU_SHAPES)
def test_bench_swiglu_backward(bench, device, tokens, hidden):
    x, g = rows(tokens, 2 * hidden, device), rows(tokens, hidden, device, seed=2)
    gx = ops.swiglu_backward(g, x)[0]
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        peer = lambda: tq.swiglu_backward(x, g, "bf16")  # noqa: E731
    ref = inductor(swiglu_backward_ref)
    bench.side_by_side(f"swiglu_backward-T{tokens}-H{hidden}", {
        "ours": lambda: ops.swiglu_backward(g, x),
        "peer": peer,
        "inductor": lambda: ref(g, x),
    }, bytes=nbytes(x, g, gx))
