"""CUDA kernel of ``engram_hash`` (docs/ops/engram.md#hash).

One thread per ``V`` adjacent output columns of one token and layer (``V`` = 4, 2 or 1, the largest that
divides ``E``, so the ``V`` columns share one n-gram order ``n``): it forms ``h_n`` from the token's first
``n`` ids (int64 products, XOR), reduces it modulo each of its ``V`` table sizes (the floor modulo, from two
quotients of an fp64 reciprocal and a select: no int64 division), adds the offsets, and stores the ``V``
int32 results as one vector. A warp's stores cover consecutive columns of consecutive tokens: the output, the
only sizeable traffic, is written coalesced in ``4 V``-byte vectors. The ids, multipliers, table sizes and
offsets are read element by element (tiny; the same row serves ``(N-1) E / V`` threads from L1). Blocks of
256 threads cover the flat (token, column group) range of one layer (``grid.y`` = layer); the token count is
dynamic.
"""


import dataclasses

import torch

from ....limits import ENGRAM_HASH_COLUMNS, ENGRAM_HASH_LAYERS, ENGRAM_HASH_NGRAM, IntRange
from ..._kernel import Kernel, compile_key, kernel_module


@dataclasses.dataclass(frozen=True)
class HashPlan:
    """``threads`` per CTA of the flat, memory-bound grid (any multiple of 32 serves as well)."""

    threads: int


PLAN = HashPlan(threads=256)


def column_vector(tables: int) -> int:
    """``V``: the columns one thread writes, the largest of 4, 2, 1 dividing ``E`` (its columns share ``j``)."""
    return next(v for v in (4, 2, 1) if tables % v == 0)


@compile_key
class HashKey:
    """Compile-time key: the largest n-gram ``N = ngram``, ``L = layers``, ``E = tables`` and the mask (never the
    token count)."""

    ngram: int
    layers: int
    tables: int
    has_mask: bool


def _key(ngram_token_ids: torch.Tensor, vocab_sizes: torch.Tensor, image_token_mask: torch.Tensor | None) -> HashKey:
    layers, orders, tables = (int(n) for n in vocab_sizes.shape)
    return HashKey(orders + 1, layers, tables, image_token_mask is not None)


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Independent of the hidden size: the Engram layer's ``N = 3, E = 8, L = 2`` with and without a mask, and
    ``N = 4, E = 2, L = 3`` (``V = 2``) and ``N = 2, E = 1, L = 1`` (``V = 1``) with one."""
    return {"engram_hash_n3e8l2": HashKey(3, 2, 8, False), "engram_hash_n3e8l2_mask": HashKey(3, 2, 8, True),
            "engram_hash_n4e2l3_mask": HashKey(4, 3, 2, True), "engram_hash_n2e1l1_mask": HashKey(2, 1, 1, True)}


def build_engram_hash(ngram: int, layers: int, tables: int, has_mask: bool):
    """Builds the hash prim_func.

    Args:
        ngram: ``N`` (``limits.ENGRAM_HASH_NGRAM``).
        layers: ``L`` (``limits.ENGRAM_HASH_LAYERS``).
        tables: ``E >= 1``, with ``(N-1) * E`` in ``limits.ENGRAM_HASH_COLUMNS``.
        has_mask: take an ``image_token_mask`` ``(T,)`` bool (masked tokens get ``-1``).

    Values outside these ranges raise ``limits.LimitError``.

    Returns:
        ``T.prim_func(ngram_token_ids (T, N) i32, multipliers (L, N) i64, vocab_sizes (L, N-1, E) i32,
        offsets (L, (N-1) E) i32, [image_token_mask (T,) bool], output (L, T, (N-1) E) i32)``.
    """
    from tilelang import language as T

    N = ENGRAM_HASH_NGRAM["cuda"].require("engram_hash", ngram)
    L = ENGRAM_HASH_LAYERS["cuda"].require("engram_hash", layers)
    E = IntRange("tables E", 1).require("engram_hash", tables)
    C = ENGRAM_HASH_COLUMNS["cuda"].require("engram_hash", (N - 1) * E)
    V = column_vector(E)
    G = C // V  # column groups of a token row
    threads = PLAN.threads
    i32, i64 = T.int32, T.int64
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def body(ids, mult, vocab, offs, mask, output):
        with T.Kernel(T.ceildiv(num_tokens * G, threads), L, threads=threads) as (bx, lay):
            tid = T.get_thread_binding()
            res = T.alloc_local((V,), i32)
            h = T.alloc_var(i64)
            r1 = T.alloc_var(i64)
            r2 = T.alloc_var(i64)
            inv = T.alloc_var(T.float64)
            i = bx * threads + tid
            if i < num_tokens * G:
                t = i // G
                g = i % G
                j = g // (E // V)  # n-gram order n = j + 2 of this group's columns
                h = T.cast(ids[t, 0], i64) * mult[lay, 0]
                for k in T.unroll(1, N):
                    # XOR only the first j + 2 products (a select: no divergent branch)
                    h = h ^ T.if_then_else(k <= j + 1, T.cast(ids[t, k], i64) * mult[lay, k], T.int64(0))
                for v in T.unroll(V):
                    col = g * V + v
                    size = T.cast(vocab[lay, j, col % E], i64)
                    # h mod size without an int64 division (nvcc expands int64 % into a long subroutine, most of
                    # the kernel's time): two quotients from the fp64 reciprocal. fp64 keeps 53 of h's 64 bits,
                    # so |r1| <= 3075 size (exact in fp64: size < 2**31); the second quotient is then off by at
                    # most one, which the selects fix. Products wrap in int64, r1 and r2 are still exact.
                    inv = T.float64(1.0) / T.cast(size, T.float64)
                    r1 = h - T.cast(T.cast(h, T.float64) * inv, i64) * size
                    r2 = r1 - T.cast(T.cast(r1, T.float64) * inv, i64) * size
                    r = T.if_then_else(r2 < 0, r2 + size, T.if_then_else(r2 >= size, r2 - size, r2))
                    # int64 sum, then the low 32 bits: the int32 wrap-around of torch's addition
                    res[v] = T.cast(r + T.cast(offs[lay, col], i64), i32)
                # the store is a select (without a mask on a condition that holds here): nvcc split the plain
                # copy of the local array into four 4-byte stores, a computed vector stays one 16-byte store
                if has_mask:
                    for v in T.vectorized(V):
                        output[lay, t, g * V + v] = T.if_then_else(mask[t], -1, res[v])
                else:
                    for v in T.vectorized(V):
                        output[lay, t, g * V + v] = T.if_then_else(t < num_tokens, res[v], -1)

    ids_s, mult_s, vocab_s, offs_s = (num_tokens, N), (L, N), (L, N - 1, E), (L, C)
    out_s, mask_s = (L, num_tokens, C), (num_tokens,)

    if has_mask:

        @T.prim_func
        def engram_hash_cuda(ngram_token_ids: T.Tensor(ids_s, i32), multipliers: T.Tensor(mult_s, i64),
                             vocab_sizes: T.Tensor(vocab_s, i32), offsets: T.Tensor(offs_s, i32),
                             image_token_mask: T.Tensor(mask_s, T.bool), output: T.Tensor(out_s, i32)):
            body(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask, output)

    else:

        @T.prim_func
        def engram_hash_cuda(ngram_token_ids: T.Tensor(ids_s, i32), multipliers: T.Tensor(mult_s, i64),
                             vocab_sizes: T.Tensor(vocab_s, i32), offsets: T.Tensor(offs_s, i32),
                             output: T.Tensor(out_s, i32)):
            body(ngram_token_ids, multipliers, vocab_sizes, offsets, None, output)

    return engram_hash_cuda


KERNEL = Kernel("engram_hash", HashKey, build_engram_hash, derive=_key, cases=_cases)


def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
    image_token_mask: torch.Tensor | None,
    output: torch.Tensor,
) -> None:
    """Launches the hash on the current stream (inputs validated upstream, ``T > 0``).

    Args:
        ngram_token_ids: ``(T, N)`` int32.
        multipliers: ``(L, N)`` int64.
        vocab_sizes: ``(L, N-1, E)`` int32.
        offsets: ``(L, (N-1) E)`` int32.
        image_token_mask: ``(T,)`` bool or None.
        output: ``(L, T, (N-1) E)`` int32, fresh from the op (its rows start ``4 V``-byte aligned).
    """
    kernel = KERNEL.compiled(KERNEL.key(ngram_token_ids, vocab_sizes, image_token_mask))
    args = [ngram_token_ids, multipliers, vocab_sizes, offsets]
    if image_token_mask is not None:
        args.append(image_token_mask)
    kernel(*args, output)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
