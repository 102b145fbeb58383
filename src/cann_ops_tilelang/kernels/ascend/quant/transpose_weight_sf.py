"""Ascend 950 kernel of ``transpose_weight_sf`` (docs/ops/quant.md#transpose_weight_sf): a weight's fp32 scales to
the int16 UE8M0 words of ``sf0`` ``(G, W0, N)`` and ``sf1`` ``(G, W1, K)`` (row-major buffers; the op returns their
transposes, or ``sf1``'s buffer itself with ``transpose_sf1``).

One launch per weight, every shape dynamic. A persistent loop over tasks of ``t x t`` scales (``t`` = 32 for
``b`` = 32, 16 for ``b`` = 128; ragged edges clamped), multi-buffered. Per task, in one vector function: each row's
exponent bytes ``(bits >> 23) & 0xFF`` (64 lanes, 0 past the valid rows and columns); sf0's words of a row are its
even and odd lanes (``vdintlv``) joined ``even | odd << 8``, sf1's words of a row pair ``row_even | row_odd << 8``;
each word is then broadcast (``BRC_B16``) over its ``b`` consecutive positions of the output tile, which two DMAs
store: ``(ceil(cols / 2), rows b)`` words of sf0 and ``(ceil(rows / 2), cols b)`` of sf1.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores

LANES = 64  # fp32 lanes of a vector register
PACK = 2  # exponent bytes per int16 word on Ascend
WEIGHT_BLOCKS = (32, 128)


@dataclasses.dataclass(frozen=True)
class TransposeTilePlan:
    """``tile`` x ``tile`` scales per task and ``stages`` UB versions of the input and output tiles."""

    tile: int
    stages: int


# 32 x 32 scales at b = 32 (the peer's), 16 x 16 at b = 128: 32 KiB per output tile either way; two stages.
# Not measured yet: no Ascend 950 here.
PLANS = {32: TransposeTilePlan(tile=32, stages=2), 128: TransposeTilePlan(tile=16, stages=2)}


@compile_key
class TransposeKey:
    """Compile-time key: the weight's scale block and the vector cores of the persistent grid."""

    block_size: int
    num_cores: int


def check_key(where: str, block_size, num_cores) -> None:
    if block_size not in WEIGHT_BLOCKS:
        raise limits.LimitError(f"{where}: block_size must be one of {WEIGHT_BLOCKS}; got {block_size}")
    limits.IntRange("num_cores", 1).require(where, int(num_cores))


def ub_bytes(block_size: int) -> int:
    """UB bytes the tiles take: the multi-buffered input and output tiles and the two word tiles."""
    plan = PLANS[block_size]
    t = plan.tile
    return plan.stages * (t * LANES * 4 + 2 * (t // 2) * t * block_size * 2) + t * LANES * 2 + (t // 2) * LANES * 2


def build_transpose_weight_sf(block_size: int, num_cores: int):
    """prim_func(sf (G, nn, nk) fp32, sf0 (G, W0, nn b) int16, sf1 (G, W1, nk b) int16), every size dynamic."""
    check_key("transpose_weight_sf", block_size, num_cores)
    b = int(block_size)
    plan = PLANS[b]
    t, stages = plan.tile, plan.stages
    half = t // 2
    groups = T.dynamic("groups")
    nn = T.dynamic("nn")
    nk = T.dynamic("nk")
    w0 = T.dynamic("w0")
    w1 = T.dynamic("w1")

    @T.macro
    def row_exponents(sf_ub, w0_ub, row, rows, in_cols, zero, ones):
        """The exponent bytes of a tile row (uint32 lanes, 0 past the valid rows and columns); stores the row's sf0
        words, scales 2w and 2w + 1 along K (its even and odd lanes)."""
        bits = T.reinterpret(S.vld(sf_ub[row, 0]), "uint32x64")
        keep = S.vdup(T.if_then_else(row < rows, T.uint32(0xFFFFFFFF), T.uint32(0)), T.uint32)
        e = S.vand(S.vsel(S.vand(S.vshrs(bits, 23), ones), zero, in_cols), keep)
        even, odd = S.vdintlv(e, zero)
        S.vsts(w0_ub[row, 0], T.reinterpret(S.vor(even, S.vshls(odd, 8)), "uint16x128"), dist="PK_B32")
        return e

    @T.macro
    def pack_vf(sf_ub, w0_ub, w1_ub, o0_ub, o1_ub, rows, cols):
        with T.SimdVF():
            lane = S.vci(0, T.int32)
            in_cols = S.vcmps(lane, cols, op="lt")
            zero = S.vdup(0, T.uint32)
            ones = S.vdup(0xFF, T.uint32)
            spread = S.pset(16, "PAT_VL32") if b == 32 else S.pset(16, "PAT_ALL")
            for p in T.serial(half):
                e0 = row_exponents(sf_ub, w0_ub, 2 * p, rows, in_cols, zero, ones)
                e1 = row_exponents(sf_ub, w0_ub, 2 * p + 1, rows, in_cols, zero, ones)
                # sf1: the words of this row pair, scales 2p and 2p + 1 along N
                S.vsts(w1_ub[p, 0], T.reinterpret(S.vor(e0, S.vshls(e1, 8)), "uint16x128"), dist="PK_B32")
            S.mem_bar("VST_VLD")
            for w, i in T.grid(half, t):  # sf0 tile row w (words of the columns), row block i: b copies
                S.vsts(o0_ub[w, i * b], S.vld(w0_ub[i, w], dist="BRC_B16"), spread, dist="NORM_B16", extent=b)
            for w, j in T.grid(half, t):  # sf1 tile row w (words of the rows), column block j: b copies
                S.vsts(o1_ub[w, j * b], S.vld(w1_ub[w, j], dist="BRC_B16"), spread, dist="NORM_B16", extent=b)

    @T.prim_func
    def transpose_weight_sf_asc(
        sf: T.Tensor[(groups, nn, nk), T.float32],
        sf0: T.Tensor[(groups, w0, nn * b), T.int16],
        sf1: T.Tensor[(groups, w1, nk * b), T.int16],
    ):
        with T.Kernel(num_cores) as core_id:
            sf_ub = T.alloc_shared((t, LANES), T.float32)
            w0_ub = T.alloc_shared((t, LANES), T.int16)
            w1_ub = T.alloc_shared((half, LANES), T.int16)
            o0_ub = T.alloc_shared((half, t * b), T.int16)
            o1_ub = T.alloc_shared((half, t * b), T.int16)
            T.annotate_buffer_versions({sf_ub: stages, o0_ub: stages, o1_ub: stages})
            for task in T.Persistent([groups * T.ceildiv(nn, t) * T.ceildiv(nk, t)], num_cores, core_id,
                                     group_size=1, num_stages=stages):
                tj = task % T.ceildiv(nk, t)
                ti = (task // T.ceildiv(nk, t)) % T.ceildiv(nn, t)
                g = task // (T.ceildiv(nk, t) * T.ceildiv(nn, t))
                i0 = ti * t
                j0 = tj * t
                rows = T.min(t, nn - i0)
                cols = T.min(t, nk - j0)
                T.copy(sf[g, i0 : i0 + rows, j0 : j0 + cols], sf_ub[:rows, :cols])
                pack_vf(sf_ub, w0_ub, w1_ub, o0_ub, o1_ub, rows, cols)
                T.copy(o0_ub[: (cols + 1) // 2, : rows * b],
                       sf0[g, j0 // 2 : j0 // 2 + (cols + 1) // 2, i0 * b : i0 * b + rows * b])
                T.copy(o1_ub[: (rows + 1) // 2, : cols * b],
                       sf1[g, i0 // 2 : i0 // 2 + (rows + 1) // 2, j0 * b : j0 * b + cols * b])

    return transpose_weight_sf_asc


def transpose_cases(hidden_size: int, hc_mult: int) -> dict:
    """Both block sizes (every shape is dynamic: the hidden size does not change the kernel)."""
    del hidden_size, hc_mult
    return {f"transpose_weight_sf_b{b}": TransposeKey(b, ASCEND_CASE_CORES) for b in WEIGHT_BLOCKS}


def transpose_key(block_size, num_cores: int) -> TransposeKey:
    check_key("transpose_weight_sf", block_size, num_cores)
    return TransposeKey(int(block_size), int(num_cores))


TRANSPOSE_WEIGHT_SF = Kernel("transpose_weight_sf", TransposeKey, build_transpose_weight_sf, cases=transpose_cases,
                             derive=lambda sf, block_size, transpose_sf1, outs: transpose_key(block_size,
                                                                                              num_vector_cores()))


def buffers(weight_sf, sf0, sf1, transpose_sf1: bool):
    """The 3-D row-major views the kernel takes: ``sf (G, nn, nk)`` and the buffers behind ``sf0``, ``sf1``."""
    if weight_sf.dim() == 2:
        weight_sf, sf0, sf1 = weight_sf.unsqueeze(0), sf0.unsqueeze(0), sf1.unsqueeze(0)
    return weight_sf, sf0.transpose(1, 2), sf1 if transpose_sf1 else sf1.transpose(1, 2)


def transpose_weight_sf(sf, block_size, transpose_sf1, outs) -> None:
    """One launch per weight with scales (none for zero groups), current stream; ``outs`` ``[sf0_0, sf1_0, ...]``."""
    key = TRANSPOSE_WEIGHT_SF.key(sf, block_size, transpose_sf1, outs)
    kernel = None
    for i, weight_sf in enumerate(sf):
        if weight_sf.numel() == 0:
            continue
        kernel = kernel or TRANSPOSE_WEIGHT_SF.compiled(key)
        kernel(*buffers(weight_sf, outs[2 * i], outs[2 * i + 1], transpose_sf1))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, TRANSPOSE_WEIGHT_SF)
