"""CUDA kernel of ``transpose_weight_sf`` (docs/ops/quant.md#transpose_weight_sf).

One launch per weight (the shapes ``G``, ``N / b``, ``K / b`` are dynamic: one compile per block size serves every
weight). Both outputs are row-major buffers of int32 words, ``sf0`` ``(G, W0, N)`` and ``sf1`` ``(G, W1, K)`` (the
views the op returns are their transposes, or ``sf1``'s buffer itself with ``transpose_sf1``): word ``[g, w, j]``
packs the exponent bytes of scales ``4w .. 4w+3`` along K of row block ``j / b`` (sf0), or along N of column block
``j / b`` (sf1). A word is constant over ``b`` consecutive ``j``, so a thread computes one word from its four scales
(``(bits >> 23) & 0xFF`` each, 0 past the last scale) and stores it ``VECTOR`` times along ``j`` in one 16-byte
store; a flat grid covers sf0's vectors, then sf1's, and consecutive threads write consecutive 16 bytes. Each
4-byte input scale becomes ``b`` bytes of each output, so the kernel is bound by its stores; the input scales (a
few KiB per weight) are read through the cache.
"""

import dataclasses

import torch

from ....limits import LimitError
from ..._kernel import Kernel, compile_key, kernel_module

PACK = 4  # exponent bytes per int32 word on CUDA
VECTOR = 4  # int32 words per 16-byte store
WEIGHT_BLOCKS = (32, 128)


@dataclasses.dataclass(frozen=True)
class TransposePlan:
    """A flat grid of CTAs of ``threads`` threads, one 16-byte store each."""

    threads: int


# 256 threads of 16-byte stores (4 KiB per CTA); not yet measured on a GPU (docs/perf/h200/quant.md to come)
TRANSPOSE_PLAN = TransposePlan(threads=256)


@compile_key
class TransposeKey:
    """Compile-time key: the weight's scale block (every shape is dynamic)."""

    block_size: int


def transpose_key(op: str, block_size: int) -> TransposeKey:
    if block_size not in WEIGHT_BLOCKS:
        raise LimitError(f"{op}: block_size must be one of {WEIGHT_BLOCKS}, got {block_size}")
    return TransposeKey(block_size=int(block_size))


def build_transpose_weight_sf(block_size: int):
    """Builds the transpose of one block size.

    Returns:
        ``T.prim_func(sf, sf0, sf1)``: ``sf (G, nn, nk)`` fp32, ``sf0 (G, W0, N)`` and ``sf1 (G, W1, K)`` int32
        row-major (``N = nn b``, ``K = nk b``, ``W0 = ceil(nk / 4)``, ``W1 = ceil(nn / 4)``), all dynamic.
    """
    from tilelang import language as T

    b = transpose_key("transpose_weight_sf", block_size).block_size
    threads = TRANSPOSE_PLAN.threads
    i32, u32 = T.int32, T.uint32
    groups = T.dynamic("groups")
    nn = T.dynamic("nn")
    nk = T.dynamic("nk")
    w0 = T.dynamic("w0")
    w1 = T.dynamic("w1")

    @T.macro
    def word_of(sf, g, row, col0, along_rows):
        """The word of the 4 scales ``sf[g, row, col0 + i]`` (``along_rows``: ``sf[g, col0 + i, row]``), 0 past the
        last one."""
        word = T.alloc_var(u32)
        word = T.uint32(0)
        for i in T.unroll(PACK):
            if along_rows:
                if col0 + i < nn:
                    word = word | (((T.reinterpret(sf[g, col0 + i, row], u32) >> T.uint32(23)) & T.uint32(0xFF))
                                   << T.uint32(8 * i))
            elif col0 + i < nk:
                word = word | (((T.reinterpret(sf[g, row, col0 + i], u32) >> T.uint32(23)) & T.uint32(0xFF))
                               << T.uint32(8 * i))
        return word

    @T.prim_func
    def transpose_weight_sf_cuda(
        sf: T.Tensor((groups, nn, nk), T.float32),
        sf0: T.Tensor((groups, w0, nn * b), i32),
        sf1: T.Tensor((groups, w1, nk * b), i32),
    ):
        # positive sizes (the op checks them; a weight of no groups is not launched): plain index arithmetic
        T.assume(nn > 0 and nk > 0 and w0 > 0 and w1 > 0 and groups > 0)
        with T.Kernel(T.ceildiv(groups * (w0 * nn + w1 * nk) * (b // VECTOR), threads), threads=threads) as bid:
            tid = T.get_thread_binding()
            out = T.alloc_local((VECTOR,), i32)
            # vector index: first sf0's (g, w, j / VECTOR), then sf1's
            v = bid * threads + tid
            n0 = groups * w0 * nn * (b // VECTOR)
            if v < n0:
                # sf0 row (g, w), words j .. j + 3, row block j / b: scales 4w .. 4w+3 along K
                word = word_of(sf, v // (w0 * nn * (b // VECTOR)), (v % (nn * (b // VECTOR))) // (b // VECTOR),
                               ((v // (nn * (b // VECTOR))) % w0) * PACK, False)
                for k in T.unroll(VECTOR):
                    out[k] = T.reinterpret(word, i32)
                for k in T.vectorized(VECTOR):
                    sf0[v // (w0 * nn * (b // VECTOR)), (v // (nn * (b // VECTOR))) % w0,
                        (v % (nn * (b // VECTOR))) * VECTOR + k] = out[k]
            elif v < n0 + groups * w1 * nk * (b // VECTOR):
                word = word_of(sf, (v - n0) // (w1 * nk * (b // VECTOR)), ((v - n0) % (nk * (b // VECTOR)))
                               // (b // VECTOR), (((v - n0) // (nk * (b // VECTOR))) % w1) * PACK, True)
                for k in T.unroll(VECTOR):
                    out[k] = T.reinterpret(word, i32)
                for k in T.vectorized(VECTOR):
                    sf1[(v - n0) // (w1 * nk * (b // VECTOR)), ((v - n0) // (nk * (b // VECTOR))) % w1,
                        ((v - n0) % (nk * (b // VECTOR))) * VECTOR + k] = out[k]

    return transpose_weight_sf_cuda


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Both block sizes (every shape is dynamic: the hidden size does not change the kernel)."""
    del hidden_size, hc_mult
    return {f"transpose_weight_sf_b{b}": TransposeKey(block_size=b) for b in WEIGHT_BLOCKS}


TRANSPOSE_WEIGHT_SF = Kernel("transpose_weight_sf", TransposeKey, build_transpose_weight_sf, cases=_cases,
                             derive=lambda sf, block_size, transpose_sf1, outs: transpose_key("transpose_weight_sf",
                                                                                               block_size))


def buffers(weight_sf: torch.Tensor, sf0: torch.Tensor, sf1: torch.Tensor, transpose_sf1: bool):
    """The 3-D row-major views the kernels take: ``sf (G, nn, nk)`` and the buffers behind ``sf0``, ``sf1``."""
    if weight_sf.dim() == 2:
        weight_sf, sf0, sf1 = weight_sf.unsqueeze(0), sf0.unsqueeze(0), sf1.unsqueeze(0)
    return weight_sf, sf0.transpose(1, 2), sf1 if transpose_sf1 else sf1.transpose(1, 2)


def transpose_weight_sf(sf, block_size: int, transpose_sf1: bool, outs) -> None:
    """Launches one kernel per weight with scales (a weight of zero groups launches nothing), on the current
    stream; ``outs`` are the op's new outputs ``[sf0_0, sf1_0, ...]``."""
    key = TRANSPOSE_WEIGHT_SF.key(sf, block_size, transpose_sf1, outs)
    kernel = None
    for i, weight_sf in enumerate(sf):
        if weight_sf.numel() == 0:
            continue
        kernel = kernel or TRANSPOSE_WEIGHT_SF.compiled(key)
        kernel(*buffers(weight_sf, outs[2 * i], outs[2 * i + 1], transpose_sf1))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, TRANSPOSE_WEIGHT_SF)
