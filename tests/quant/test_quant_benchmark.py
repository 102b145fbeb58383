"""Benchmarks of the quant casts and of fp8_linear (run only when asked: ``-m benchmark``), side by side in one run:
ours, the peer (DeepSeek tile_kernels 2.1.0, when importable), the reference under inductor
(``torch.compile(fullgraph=True, dynamic=True)``, one compile per reference and non-tensor arguments) and the
device-to-device copy ceiling of the same run (``test_copy_ceiling``).

Bytes: what the op must read and write once (``x``, the data, the scales). ``gbs = bytes / time_us / 1e3``.
Results are compared with the committed baseline of the chip (tests/quant/benchmark/<chip>/test_quant_benchmark.jsonl).
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from _plugins.device import requires_cuda
from quant_cases import sample
from quant_ref import (cast_back_ref, cast_ref, per_block_cast_ref, per_channel_cast_ref,
                       per_token_cast_and_cast_back_ref, per_token_cast_ref, transpose_weight_sf_ref)

import cann_ops_tilelang as ops
from cann_ops_tilelang.modeling import fp8_linear, fp8_linear_gemm
from cann_ops_tilelang.quant import ScaleLayout

pytestmark = [pytest.mark.benchmark, requires_cuda]

HAVE_PEER = importlib.util.find_spec("tile_kernels") is not None
# the peer's shapes, then the sizes of a training step
SHAPES = [(t, h) for t in (512, 4001) for h in (2048, 4096, 7168)] + [(t, h) for t in (4096, 8192, 16384)
                                                                       for h in (4096, 7168)]
# SM90 DeepGEMM activations, SM100 DeepGEMM activations, MXFP4
PER_TOKEN_LAYOUTS = ["1x128/e4m3/fp32/col_tma/exact", "1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/ue8m0/row/round"]
_INDUCTOR = {}


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def inductor(fn, **static):
    """The reference ``fn`` compiled with its non-tensor arguments ``static`` bound, once per (fn, static) for the whole
    run, shapes dynamic (one compile covers every shape: no recompile limit is reached)."""
    key = (fn, tuple(sorted((k, str(v)) for k, v in static.items())))
    if key not in _INDUCTOR:
        _INDUCTOR[key] = torch.compile(lambda *tensors: fn(*tensors, **static), fullgraph=True, dynamic=True)
    return _INDUCTOR[key]


def test_copy_ceiling(bench, device):
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = bench.time_us(lambda: dst.copy_(src))
    bench.record("copy_1GiB", impl="copy", time_us=t, bytes=2 * src.numel())


@pytest.mark.parametrize("layout", PER_TOKEN_LAYOUTS)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_per_token_cast(bench, device, tokens, hidden, layout):
    x = sample(tokens, hidden).to(device)
    s = ScaleLayout.parse(layout)
    data, sf = ops.per_token_cast(x, layout)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        def peer():
            return tq.per_token_cast(x, s.fmt, s.block[1], use_tma_aligned_col_major_sf=s.storage == "col_tma",
                                     round_sf=s.round_sf, use_packed_ue8m0=s.sf == "ue8m0", use_e4m3_sf=s.sf == "e4m3")
    ref = inductor(per_token_cast_ref, layout=layout)
    bench.side_by_side(f"per_token_cast-T{tokens}-H{hidden}-{layout.replace('/', '_')}", {
        "ours": lambda: ops.per_token_cast(x, layout),
        "peer": peer,
        "inductor": lambda: ref(x),
    }, bytes=nbytes(x, data) + sf.numel() * sf.element_size())


# weights: the peer needs T and H multiples of 128
BLOCK_SHAPES = [(t, h) for t in (512, 4096, 8192, 16384) for h in (2048, 4096, 7168)]
PER_BLOCK_LAYOUTS = ["128x128/e4m3/fp32/row/exact", "128x128/e4m3/ue8m0/col_tma/round"]


@pytest.mark.parametrize("layout", PER_BLOCK_LAYOUTS)
@pytest.mark.parametrize("tokens,hidden", BLOCK_SHAPES)
def test_bench_per_block_cast(bench, device, tokens, hidden, layout):
    x = sample(tokens, hidden).to(device)
    s = ScaleLayout.parse(layout)
    data, sf = ops.per_block_cast(x, layout)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        def peer():
            return tq.per_block_cast(x, s.fmt, s.block, use_tma_aligned_col_major_sf=s.storage == "col_tma",
                                     round_sf=s.round_sf, use_packed_ue8m0=s.sf == "ue8m0")
    ref = inductor(per_block_cast_ref, layout=layout)
    bench.side_by_side(f"per_block_cast-T{tokens}-H{hidden}-{layout.replace('/', '_')}", {
        "ours": lambda: ops.per_block_cast(x, layout),
        "peer": peer,
        "inductor": lambda: ref(x),
    }, bytes=nbytes(x, data) + sf.numel() * sf.element_size())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_cast_back(bench, device, tokens, hidden, out_dtype):
    layout = "1x128/e4m3/fp32/row/exact"
    data, sf = ops.per_token_cast(sample(tokens, hidden).to(device), layout)
    out = ops.cast_back(data, sf, layout, out_dtype)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        fmt = "bf16" if out_dtype == torch.bfloat16 else "fp32"
        peer = lambda: tq.per_token_cast_back((data, sf), fmt, 128)  # noqa: E731
    ref = inductor(cast_back_ref, layout=layout, out_dtype=out_dtype)
    bench.side_by_side(f"cast_back-T{tokens}-H{hidden}-{str(out_dtype)[6:]}", {
        "ours": lambda: ops.cast_back(data, sf, layout, out_dtype),
        "peer": peer,
        "inductor": lambda: ref(data, sf),
    }, bytes=nbytes(data, sf, out))


@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_per_token_cast_and_cast_back(bench, device, tokens, hidden):
    """In place: x is read and written once (the values stay on the e4m3 grid after the first call)."""
    layout = "1x128/e4m3/fp32/row/exact"
    x = sample(tokens, hidden).to(device)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        peer = lambda: tq.per_token_cast_and_cast_back(x, "e4m3", 128)  # noqa: E731
    ref = inductor(per_token_cast_and_cast_back_ref, layout=layout)
    bench.side_by_side(f"per_token_cast_and_cast_back-T{tokens}-H{hidden}", {
        "ours": lambda: ops.per_token_cast_and_cast_back(x, layout),
        "peer": peer,
        "inductor": lambda: ref(x),
    }, bytes=2 * nbytes(x))


@pytest.mark.parametrize("layout", ["128x1/e4m3/fp32/row/exact", "128x1/e4m3/ue8m0/row/round"])
@pytest.mark.parametrize("tokens,hidden", BLOCK_SHAPES)
def test_bench_per_channel_cast(bench, device, tokens, hidden, layout):
    x = sample(tokens, hidden).to(device)
    s = ScaleLayout.parse(layout)
    data, sf = ops.per_channel_cast(x, layout)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        peer = lambda: tq.per_channel_cast(x, "e4m3", s.block[0], round_sf=s.round_sf,  # noqa: E731
                                           use_packed_ue8m0=s.sf == "ue8m0")
    ref = inductor(per_channel_cast_ref, layout=layout)
    bench.side_by_side(f"per_channel_cast-T{tokens}-H{hidden}-{layout.replace('/', '_')}", {
        "ours": lambda: ops.per_channel_cast(x, layout),
        "peer": peer,
        "inductor": lambda: ref(x),
    }, bytes=nbytes(x, data, sf))


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
                                     (torch.float32, torch.float8_e4m3fn)])
@pytest.mark.parametrize("tokens,hidden", [(4096, 7168), (16384, 7168)])
@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_bench_cast(bench, device, tokens, hidden, src, dst, rounding):
    x = sample(tokens, hidden, dtype=src).to(device)
    seed = 1234 if rounding == "sr" else None
    out = ops.cast(x, dst, seed)
    peer = None
    if HAVE_PEER and rounding == "rne":  # the peer's stochastic rounding is not ours (SM100 cvt.rs)
        import tile_kernels.quant as tq

        peer = lambda: tq.cast(x, dst)  # noqa: E731
    # the stochastic-rounding reference (its hash on int64 tensors) did not compile within 10 minutes on the CPU
    ref = inductor(cast_ref, dtype=dst, seed=seed) if rounding == "rne" else None
    bench.side_by_side(f"cast-{rounding}-T{tokens}-H{hidden}-{str(src)[6:]}-{str(dst)[6:]}", {
        "ours": lambda: ops.cast(x, dst, seed),
        "peer": peer,
        "inductor": None if ref is None else lambda: ref(x),
    }, bytes=nbytes(x, out))


@pytest.mark.parametrize("block_size", [32, 128])
def test_bench_transpose_weight_sf(bench, device, block_size):
    """The scales of a DeepSeek-V3 layer's weights (7168 x 18432 and its transposes, 256 grouped 2048 x 7168
    experts): a launch-bound op."""
    def scales(*shape):
        return (torch.randint(100, 150, shape, dtype=torch.int32, device=device) << 23).view(torch.float32)

    b = block_size
    sf = [scales(18432 // b, 7168 // b), scales(7168 // b, 18432 // b), scales(256, 2048 // b, 7168 // b)]
    outs = ops.transpose_weight_sf(sf, b, False)
    peer = None
    if HAVE_PEER:
        import tile_kernels.quant as tq

        peer = lambda: tq.batched_transpose_weight_sf(sf, b, [False] * len(sf), [None] * len(sf))  # noqa: E731
    ref = inductor(transpose_weight_sf_ref, block_size=b, transpose_sf1=False)
    bench.side_by_side(f"transpose_weight_sf-b{b}", {
        "ours": lambda: ops.transpose_weight_sf(sf, b, False),
        "peer": peer,
        "inductor": lambda: ref(sf),
    }, bytes=nbytes(*sf, *outs))


@pytest.mark.parametrize("tokens,k,n", [(8192, 7168, 7168), (8192, 7168, 18432)])
def test_bench_fp8_linear_forward_backward(bench, device, tokens, k, n):
    """fp8_linear forward + backward (grad_x, grad_weight) against bf16 F.linear's at a DeepSeek-V3 projection."""
    x = (torch.randn(tokens, k, device=device) / 4).bfloat16().requires_grad_(True)
    w = (torch.randn(n, k, device=device) / k**0.5).bfloat16().requires_grad_(True)
    grad_out = torch.randn(tokens, n, device=device).bfloat16()

    def step(linear):
        def run():
            x.grad = w.grad = None
            linear(x, w).backward(grad_out)
        return run

    bench.side_by_side(f"fp8_linear_fwd_bwd-T{tokens}-K{k}-N{n}", {
        "ours": step(fp8_linear),
        "bf16": step(F.linear),
    }, flops=3 * 2 * tokens * k * n, gemm=fp8_linear_gemm(device))
