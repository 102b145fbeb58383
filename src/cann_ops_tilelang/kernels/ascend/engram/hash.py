"""Ascend kernel of ``engram_hash`` (docs/ops/engram.md#hash).

The int64 hash runs in a SimtVF region (scalar int64 multiply, XOR and remainder per thread; the SIMD vector
unit has no 64-bit multiply or remainder). Every layer's multipliers, table sizes and offsets are staged in
the UB once per core. A persistent loop hands tiles of 128 tokens to the vector cores; per tile the ids
(and the mask) arrive by one DMA each, then per layer the 128 threads fill the ``(128, (N-1) E)`` output
tile, thread ``x`` writing flat elements ``x, x + 128, ...`` (each its own column's ``h_n`` and remainder),
and one DMA stores the tile's rows of that layer. Ids, mask and output tiles have two buffers each, so the
next tile's loads and the last layer's store overlap the computation. Ragged tails are clamped DMAs.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import functools

from tilelang.ascend import language as T

from ....chips import ASCEND_950
from ....limits import ENGRAM_HASH_COLUMNS, ENGRAM_HASH_LAYERS, ENGRAM_HASH_NGRAM, IntRange
from .. import num_vector_cores

__all__ = [
    "TILE_TOKENS",
    "build_engram_hash",
    "engram_hash",
    "engram_hash_key",
    "get_engram_hash_kernel",
    "hash_ub_bytes",
    "lowering_cases",
]

TILE_TOKENS = 128  # tokens per tile and SIMT threads: two tiles of the widest output (128 columns) fit the UB
_STAGES = 2


def hash_ub_bytes(ngram: int, layers: int, tables: int, has_mask: bool = True) -> int:
    """UB the kernel's buffers take (before the pool's padding): per stage the ids, the mask and the output
    tile; once the multipliers, table sizes and offsets of every layer."""
    columns = (ngram - 1) * tables
    tile = TILE_TOKENS * (4 * ngram + int(has_mask) + 4 * columns)
    return _STAGES * tile + layers * (8 * ngram + 8 * columns)


def engram_hash_key(ngram_token_ids, vocab_sizes, image_token_mask, num_cores: int) -> tuple:
    """``(N, L, E, has_mask, num_cores)``; never T."""
    layers, orders, tables = (int(n) for n in vocab_sizes.shape)
    return (orders + 1, layers, tables, image_token_mask is not None, int(num_cores))


def build_engram_hash(ngram: int, layers: int, tables: int, has_mask: bool, num_cores: int):
    """prim_func ``(ngram_token_ids (T, N) i32, multipliers (L, N) i64, vocab_sizes (L, N-1, E) i32,
    offsets (L, (N-1) E) i32, [image_token_mask (T,) bool], output (L, T, (N-1) E) i32)``. ``N``, ``L`` and
    ``(N-1) E`` in the Ascend ranges of ``limits.ENGRAM_HASH_*``, ``E >= 1``, ``num_cores >= 1``; else
    ``limits.LimitError``."""
    where = "engram_hash"
    N = ENGRAM_HASH_NGRAM["ascend"].require(where, ngram)
    L = ENGRAM_HASH_LAYERS["ascend"].require(where, layers)
    E = IntRange("tables E", 1).require(where, tables)
    C = ENGRAM_HASH_COLUMNS["ascend"].require(where, (N - 1) * E)
    cores = IntRange("num_cores", 1).require(where, num_cores)
    tile = TILE_TOKENS
    i32, i64 = T.int32, T.int64
    num_tokens = T.dynamic("num_tokens")

    def floor_fix(r, d):
        # C's truncated remainder r of h by d -> the floor modulo (sign of d), as Python's and torch's %
        return T.if_then_else(T.And(r != 0, (r < 0) != (d < 0)), r + d, r)

    @T.macro
    def body(ids, mult, vocab, offs, mask, output):
        with T.Kernel(cores) as core_id:
            mult_ub = T.alloc_shared((L, N), i64)
            vocab_ub = T.alloc_shared((L, N - 1, E), i32)
            offs_ub = T.alloc_shared((L, C), i32)
            ids_ub = T.alloc_shared((tile, N), i32)
            out_ub = T.alloc_shared((tile, C), i32)
            if has_mask:
                mask_ub = T.alloc_shared((tile,), T.bool)
                T.annotate_buffer_versions({ids_ub: _STAGES, out_ub: _STAGES, mask_ub: _STAGES})
            else:
                T.annotate_buffer_versions({ids_ub: _STAGES, out_ub: _STAGES})
            T.copy(mult, mult_ub)
            T.copy(vocab, vocab_ub)
            T.copy(offs, offs_ub)
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, tile)], cores, core_id, group_size=1,
                                       num_stages=_STAGES):
                row = blk * tile
                valid = T.min(tile, num_tokens - row)
                T.copy(ids[row : row + valid, :], ids_ub[:valid, :])
                if has_mask:
                    T.copy(mask[row : row + valid], mask_ub[:valid])
                for lay in T.serial(L):
                    with T.SimtVF(threads=tile):
                        tx = T.get_thread_binding()
                        h = T.alloc_var(i64)
                        for s in T.serial(C):
                            t = (s * tile + tx) // C  # rows past `valid` compute on stale ids, never stored
                            c = (s * tile + tx) % C
                            j = c // E  # n-gram order n = j + 2
                            h = T.cast(ids_ub[t, 0], i64) * mult_ub[lay, 0]
                            for k in T.unroll(1, N):
                                if k <= j + 1:
                                    h = h ^ (T.cast(ids_ub[t, k], i64) * mult_ub[lay, k])
                            size = T.cast(vocab_ub[lay, j, c % E], i64)
                            r = T.truncmod(h, size)
                            # int64 sum, then the low 32 bits: the int32 wrap-around of torch's addition
                            value = T.cast(floor_fix(r, size) + T.cast(offs_ub[lay, c], i64), i32)
                            if has_mask:
                                out_ub[t, c] = T.if_then_else(mask_ub[t], -1, value)
                            else:
                                out_ub[t, c] = value
                    T.copy(out_ub[:valid, :], output[lay, row : row + valid, :])

    ids_s, mult_s, vocab_s, offs_s = (num_tokens, N), (L, N), (L, N - 1, E), (L, C)
    out_s, mask_s = (L, num_tokens, C), (num_tokens,)

    if has_mask:

        @T.prim_func
        def engram_hash_asc(ngram_token_ids: T.Tensor[ids_s, i32], multipliers: T.Tensor[mult_s, i64],
                            vocab_sizes: T.Tensor[vocab_s, i32], offsets: T.Tensor[offs_s, i32],
                            image_token_mask: T.Tensor[mask_s, T.bool], output: T.Tensor[out_s, i32]):
            body(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask, output)

    else:

        @T.prim_func
        def engram_hash_asc(ngram_token_ids: T.Tensor[ids_s, i32], multipliers: T.Tensor[mult_s, i64],
                            vocab_sizes: T.Tensor[vocab_s, i32], offsets: T.Tensor[offs_s, i32],
                            output: T.Tensor[out_s, i32]):
            body(ngram_token_ids, multipliers, vocab_sizes, offsets, None, output)

    return engram_hash_asc


@functools.lru_cache(maxsize=None)
def get_engram_hash_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`engram_hash_key`), built once per key."""
    from .._build import jit_compile

    return jit_compile("engram_hash", key, build_engram_hash(*key))


def engram_hash(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask, output) -> None:
    """ids ``(T, N)`` i32, multipliers ``(L, N)`` i64, vocab_sizes ``(L, N-1, E)`` i32, offsets
    ``(L, (N-1) E)`` i32, mask ``(T,)`` bool or None -> output ``(L, T, (N-1) E)`` i32. Current stream."""
    key = engram_hash_key(ngram_token_ids, vocab_sizes, image_token_mask, num_vector_cores())
    kernel = get_engram_hash_kernel(*key)
    args = [ngram_token_ids, multipliers, vocab_sizes, offsets]
    if image_token_mask is not None:
        args.append(image_token_mask)
    kernel(*args, output)


def lowering_cases(hidden_size: int, hc_mult: int = 4, num_cores: int = ASCEND_950.vector_cores) -> dict:
    """The hash kernels (independent of the hidden size; the Ascend 950's core count, no NPU needed): the
    cases of the CUDA module, same names."""
    del hidden_size, hc_mult
    return {
        "engram_hash_n3e8l2": build_engram_hash(3, 2, 8, False, num_cores),
        "engram_hash_n3e8l2_mask": build_engram_hash(3, 2, 8, True, num_cores),
        "engram_hash_n4e2l3_mask": build_engram_hash(4, 3, 2, True, num_cores),
        "engram_hash_n2e1l1_mask": build_engram_hash(2, 1, 1, True, num_cores),
    }
