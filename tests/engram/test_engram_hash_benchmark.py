"""Benchmark of ``engram_hash`` (run only when asked: ``-m benchmark``), side by side in one run: ours, the
peer (DeepSeek tile_kernels 2.1.0 ``engram.engram_hash``, when importable), the eager PyTorch reference and
the inductor-compiled reference, with the device-to-device copy ceiling measured in the same run.

Cases: the peer's benchmark shape (N = 3, E = 8, L = 2) at its token counts 512 and 8001 and at 8192, three
layers at 8192, the mask at 8192, and 65536 tokens (the output large enough to stream). Bytes: every tensor
read or written once (ids, multipliers, table sizes, offsets, mask, output); ``gbs = bytes / time_us / 1e3``.
Results are compared with the committed baseline of the chip
(tests/engram/benchmark/<chip>/test_engram_hash_benchmark.jsonl).
"""

import importlib.util

import pytest
import torch
from _plugins.device import requires_cuda
from engram_ref import engram_hash_ref, make_hash_inputs

import cann_ops_tilelang as ops

pytestmark = [pytest.mark.benchmark, requires_cuda]

HAVE_PEER = importlib.util.find_spec("tile_kernels") is not None
# (T, L, masked), all with N = 3 and E = 8
CASES = [(512, 2, False), (8001, 2, False), (8192, 2, False), (8192, 3, False), (8192, 2, True), (65536, 2, False)]


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def test_copy_ceiling(bench, device):
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = bench.time_us(lambda: dst.copy_(src))
    bench.record("copy_1GiB", impl="copy", time_us=t, bytes=2 * src.numel())


@pytest.mark.parametrize("tokens,layers,masked", CASES)
def test_bench_hash(bench, device, tokens, layers, masked):
    gen = torch.Generator().manual_seed(tokens + layers)
    ids, mult, sizes, offs, mask = make_hash_inputs(tokens, 3, layers, 8, device=device, masked=masked,
                                                    generator=gen)
    out = ops.engram_hash(ids, mult, sizes, offs, mask)
    assert torch.equal(out, engram_hash_ref(ids, mult, sizes, offs, mask))  # what is timed is right
    peer = None
    if HAVE_PEER:
        import tile_kernels

        peer = lambda: tile_kernels.engram.engram_hash(ids, mult, sizes, offs, mask)  # noqa: E731
        assert torch.equal(peer(), out)
    torch._dynamo.reset()
    ref_c = torch.compile(engram_hash_ref, fullgraph=True, dynamic=False)
    assert torch.equal(ref_c(ids, mult, sizes, offs, mask), out)
    bench.side_by_side(f"hash-T{tokens}-L{layers}-N3-E8{'-mask' if masked else ''}", {
        "ours": lambda: ops.engram_hash(ids, mult, sizes, offs, mask),
        "peer": peer,
        "eager": lambda: engram_hash_ref(ids, mult, sizes, offs, mask),
        "inductor": lambda: ref_c(ids, mult, sizes, offs, mask),
    }, bytes=nbytes(ids, mult, sizes, offs, mask, out))
