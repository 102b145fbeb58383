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
import dataclasses

from tilelang.ascend import language as T

from ....limits import ENGRAM_HASH_COLUMNS, ENGRAM_HASH_LAYERS, ENGRAM_HASH_NGRAM, IntRange
from ....policy import ASCEND_CASE_CORES
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores


@dataclasses.dataclass(frozen=True)
class HashPlan:
    """``tile_tokens`` tokens per tile (and SIMT threads), ``stages`` UB versions of the tiles."""

    tile_tokens: int
    stages: int


# 128 tokens: two tiles of the widest output (128 columns) fit the UB
PLAN = HashPlan(tile_tokens=128, stages=2)
TILE_TOKENS = PLAN.tile_tokens


def hash_ub_bytes(ngram: int, layers: int, tables: int, has_mask: bool = True) -> int:
    """UB the kernel's buffers take (before the pool's padding): per stage the ids, the mask and the output
    tile; once the multipliers, table sizes and offsets of every layer."""
    columns = (ngram - 1) * tables
    tile = TILE_TOKENS * (4 * ngram + int(has_mask) + 4 * columns)
    return PLAN.stages * tile + layers * (8 * ngram + 8 * columns)


@compile_key
class HashKey:
    """Compile-time key: ``N = ngram``, ``L = layers``, ``E = tables``, the mask and the vector cores (never T)."""

    ngram: int
    layers: int
    tables: int
    has_mask: bool
    num_cores: int


def _key(ngram_token_ids, vocab_sizes, image_token_mask) -> HashKey:
    layers, orders, tables = (int(n) for n in vocab_sizes.shape)
    return HashKey(orders + 1, layers, tables, image_token_mask is not None, int(num_vector_cores()))


def _cases(hidden_size: int, hc_mult: int) -> dict:
    """Independent of the hidden size, on the Ascend 950's cores: the cases of the CUDA module, same names."""
    cores = ASCEND_CASE_CORES
    return {"engram_hash_n3e8l2": HashKey(3, 2, 8, False, cores),
            "engram_hash_n3e8l2_mask": HashKey(3, 2, 8, True, cores),
            "engram_hash_n4e2l3_mask": HashKey(4, 3, 2, True, cores),
            "engram_hash_n2e1l1_mask": HashKey(2, 1, 1, True, cores)}


def build_engram_hash(ngram: int, layers: int, tables: int, has_mask: bool, num_cores: int):
    """prim_func ``(ngram_token_ids (T, N) i32, multipliers (L, N) i64, vocab_sizes (L, N-1, E) i32,
    offsets (L, (N-1) E) i32, [image_token_mask (T,) bool], output (L, T, (N-1) E) i32)``. ``N``, ``L`` and
    ``(N-1) E`` in the Ascend ranges of ``limits.ENGRAM_HASH_*``, ``E >= 1``, ``num_cores >= 1``; else
    ``limits.LimitError``."""
    stages = PLAN.stages
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
                T.annotate_buffer_versions({ids_ub: stages, out_ub: stages, mask_ub: stages})
            else:
                T.annotate_buffer_versions({ids_ub: stages, out_ub: stages})
            T.copy(mult, mult_ub)
            T.copy(vocab, vocab_ub)
            T.copy(offs, offs_ub)
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, tile)], cores, core_id, group_size=1,
                                       num_stages=stages):
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


KERNEL = Kernel("engram_hash", HashKey, build_engram_hash, derive=_key, cases=_cases)


def engram_hash(ngram_token_ids, multipliers, vocab_sizes, offsets, image_token_mask, output) -> None:
    """ids ``(T, N)`` i32, multipliers ``(L, N)`` i64, vocab_sizes ``(L, N-1, E)`` i32, offsets
    ``(L, (N-1) E)`` i32, mask ``(T,)`` bool or None -> output ``(L, T, (N-1) E)`` i32. Current stream."""
    kernel = KERNEL.compiled(KERNEL.key(ngram_token_ids, vocab_sizes, image_token_mask))
    args = [ngram_token_ids, multipliers, vocab_sizes, offsets]
    if image_token_mask is not None:
        args.append(image_token_mask)
    kernel(*args, output)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
