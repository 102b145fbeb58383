"""Benchmarks of the Engram Sinkhorn optimizer ops and ``EngramSinkhorn`` (run only when asked: ``-m benchmark``),
side by side in one run: ours, the peer (tile_kernels, when importable; its step and finalize take widths that
are multiples of 256 only), the eager PyTorch reference and the inductor-compiled reference, with the
device-to-device copy ceiling measured in the same run.

Shapes: the peer's benchmark cases (momentum numel 1001*256 .. 1000001*512; step and finalize 1001 .. 100001
rows x 256 columns; reduce over 528 partial rows) and the model's embedding tables (10^6 and 10^7 rows x 64 and
128 columns). Bytes: every tensor read or written once, in-place buffers twice; ``gbs = bytes / time_us / 1e3``.
The streaming kernels (momentum, step, finalize) must reach 85 % of the copy ceiling at the model shapes.
"""

import importlib.util
import math

import pytest
import torch
from _plugins.device import requires_cuda
from engram_ref import (
    engram_sinkhorn_finalize_ref,
    engram_sinkhorn_momentum_update_ref,
    engram_sinkhorn_step_reduce_ref,
)

import cann_ops_tilelang as ops
from cann_ops_tilelang.engram.sinkhorn import sinkhorn_partials
from cann_ops_tilelang.optim import EngramSinkhorn

pytestmark = [pytest.mark.benchmark, requires_cuda]

HAVE_PEER = importlib.util.find_spec("tile_kernels") is not None
EPS = 1e-20  # the peer's test value
MODEL_TABLES = [(10**6, 64), (10**6, 128), (10**7, 64), (10**7, 128)]
PEER_MATRICES = [(1001, 256), (10001, 256), (100001, 256)]
PEER_MOMENTUM = [1001 * 256, 10001 * 256, 100001 * 512, 1000001 * 512]
CEILING_SHARE = 0.85
_CEILING: dict[str, float] = {}


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False)


def copy_ceiling_gbs(bench, device) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write), measured once per run."""
    if "gbs" not in _CEILING:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        t = bench.time_us(lambda: dst.copy_(src))
        _CEILING["gbs"] = 2 * src.numel() / t / 1e3
        _CEILING["us"] = t
        del src, dst
    return _CEILING["gbs"]


def check_ceiling(bench, device, case, times, io, model):
    ceiling = copy_ceiling_gbs(bench, device)
    gbs = io / times["ours"] / 1e3
    bench.record(f"{case}-ceiling", impl="copy_share", share=gbs / ceiling, gbs=gbs, ceiling_gbs=ceiling)
    if model:
        assert gbs >= CEILING_SHARE * ceiling, f"{case}: {gbs:.0f} GB/s < {CEILING_SHARE:.0%} of {ceiling:.0f} GB/s"


def peer_module():
    if not HAVE_PEER:
        return None
    import tile_kernels

    return tile_kernels.engram


def test_copy_ceiling(bench, device):
    gbs = copy_ceiling_gbs(bench, device)
    bench.record("copy_1GiB", impl="copy", time_us=_CEILING["us"], bytes=2 << 30, gbs=gbs)


MOMENTUM_CASES = [(n, False) for n in PEER_MOMENTUM] + [(r * d, True) for r, d in MODEL_TABLES]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("numel,model", MOMENTUM_CASES)
def test_bench_momentum_update(bench, device, numel, model, nesterov, dtype):
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    grad = torch.randn(numel, device=device).to(dt)
    buf = torch.randn(numel, device=device).to(dt)
    peer = peer_module()
    ref_c = compiled(engram_sinkhorn_momentum_update_ref)
    io = nbytes(grad, buf, buf) + 4 * numel
    case = f"momentum-n{numel}-{dtype}-nesterov{int(nesterov)}"
    times = bench.side_by_side(case, {
        "ours": lambda: ops.engram_sinkhorn_momentum_update(grad, buf, 0.95, nesterov),
        "peer": (lambda: peer.engram_sinkhorn_momentum_update(grad, buf, 0.95, nesterov)) if peer else None,
        "eager": lambda: engram_sinkhorn_momentum_update_ref(grad, buf, 0.95, nesterov),
        "inductor": lambda: ref_c(grad, buf, 0.95, nesterov),
    }, bytes=io)
    check_ceiling(bench, device, case, times, io, model)


STEP_CASES = [(r, d, False) for r, d in PEER_MATRICES] + [(r, d, True) for r, d in MODEL_TABLES]


def matrix_inputs(rows, cols, device):
    a = torch.randn(rows, cols, device=device)
    r = torch.rand(rows, device=device) + 0.5
    c = torch.rand(cols, device=device) + 0.5
    return a, r, c


def step_vectorized(matrix, row_scale, col_scale, eps, partials):
    """``engram_sinkhorn_step_ref`` without its loop over the workers (the rows padded to ``P`` equal ranges,
    summed per range): what eager PyTorch and inductor are timed on (inductor unrolls the reference's loop
    over 528 workers into a graph that takes minutes to compile)."""
    rows, cols = matrix.shape
    x = (row_scale.unsqueeze(1) * matrix) * col_scale
    row_norm = x.square().sum(1).sqrt()
    row_scale.copy_(row_scale / (row_norm + eps))
    y2 = ((row_scale.unsqueeze(1) * matrix) * col_scale).square()
    per = -(-rows // partials)
    y2 = torch.nn.functional.pad(y2, (0, 0, 0, per * partials - rows))
    return row_norm, y2.view(partials, per, cols).sum(1)


@pytest.mark.parametrize("rows,cols,model", STEP_CASES)
def test_bench_step(bench, device, rows, cols, model):
    a, r, c = matrix_inputs(rows, cols, device)
    peer = peer_module()
    partials = sinkhorn_partials("cuda")
    ref_c = compiled(step_vectorized)
    io = nbytes(a, r, r, c, r) + partials * cols * 4
    case = f"step-R{rows}-D{cols}"
    times = bench.side_by_side(case, {
        # the row scales drift by 1 / (norm + eps) per call: the time does not depend on their values
        "ours": lambda: ops.engram_sinkhorn_step(a, r, c, EPS),
        "peer": (lambda: peer.engram_sinkhorn_step(a, r, c, EPS)) if peer and cols % 256 == 0 else None,
        "eager": lambda: step_vectorized(a, r, c, EPS, partials),
        "inductor": lambda: ref_c(a, r, c, EPS, partials),
    }, bytes=io)
    check_ceiling(bench, device, case, times, io, model)


@pytest.mark.parametrize("cols", [64, 128, 256])
def test_bench_step_reduce(bench, device, cols):
    partials = sinkhorn_partials("cuda")
    part = torch.rand(partials, cols, device=device)
    out = torch.empty(cols, device=device)
    # ours also updates the column scales (D more floats read and written); the scales drift towards 1 per call,
    # which does not change the time
    col_scale = torch.rand(cols, device=device) + 0.5
    rows = 10**6
    peer = peer_module()
    bench.side_by_side(f"step_reduce-P{partials}-D{cols}", {
        "ours": lambda: ops.engram_sinkhorn_step_reduce(part, out, col_scale, rows, EPS),
        "peer": (lambda: peer.engram_sinkhorn_step_reduce(part, out)) if peer and cols % 256 == 0 else None,
        "eager": lambda: engram_sinkhorn_step_reduce_ref(part, out, col_scale, rows, EPS),
        "torch_sum": lambda: torch.sum(part, 0, out=out),
    }, bytes=nbytes(part, out, col_scale, col_scale))


@pytest.mark.parametrize("rows,cols,model", STEP_CASES)
def test_bench_finalize(bench, device, rows, cols, model):
    a, r, c = matrix_inputs(rows, cols, device)
    out = torch.empty_like(a)
    alpha = math.sqrt(cols)
    peer = peer_module()
    ref_c = compiled(engram_sinkhorn_finalize_ref)
    io = nbytes(a, r, c, out)
    case = f"finalize-R{rows}-D{cols}"
    times = bench.side_by_side(case, {
        "ours": lambda: ops.engram_sinkhorn_finalize(a, r, c, EPS, alpha, out=out),
        "peer": (lambda: peer.engram_sinkhorn_finalize(a, r, c, EPS, alpha, out)) if peer and cols % 256 == 0
        else None,
        "eager": lambda: engram_sinkhorn_finalize_ref(a, r, c, EPS, alpha),
        "inductor": lambda: ref_c(a, r, c, EPS, alpha),
    }, bytes=io)
    check_ceiling(bench, device, case, times, io, model)


@pytest.mark.parametrize("rows,cols", MODEL_TABLES)
@pytest.mark.parametrize("iters", [5])
def test_bench_optimizer_step(bench, device, rows, cols, iters):
    """One EngramSinkhorn update of a bf16 table (momentum, ``iters`` rounds, finalize fused with the parameter
    update), stream time between events (launch gaps included). Bytes: the minimum traffic of the op chain
    (momentum 2 + 2 + 2 + 4, per round 4 + the scales, finalize-apply 4 + 2 + 2 bytes per element)."""
    w = torch.nn.Parameter(torch.randn(rows, cols, device=device).bfloat16())
    w.grad = torch.randn(rows, cols, device=device).bfloat16()
    opt = EngramSinkhorn([w], lr=1e-4, sinkhorn_iters=iters)
    opt.step()
    n = rows * cols
    io = n * (10 + 4 * iters + 8) + rows * 16 * iters
    t = bench.stream_time_us(opt.step)
    bench.record(f"optimizer-R{rows}-D{cols}-it{iters}", impl="ours", time_us=t, bytes=io)
