"""CUDA (TileLang) kernels of the mHC pre-norm GEMM with sum of squares (OPS.md B.2.3 and §C).

Forward (``mhc_gemm_with_sqrsum_forward``): ``out_mul_part[s, t, j] = sum_{k in K_s} f32(x[t, k]) *
tf32(fn[j, k])`` and ``sqrsum_part[s, t] = sum_{k in K_s} f32(x[t, k])**2``, K cut into 64-column
blocks (``nb = K / 64``), split ``s`` owning ``nb // S`` blocks plus one for ``s < nb % S``, in order.

TF32 products on bf16 tensor cores: ``fn`` is rounded to TF32 (add half a TF32 ulp to the int32 bit
pattern, clear the low 13 bits: round-half-away, as the old TileKernels path) and the 11-bit TF32
significand is split exactly into two bf16 values ``hi`` (top 8 bits) and ``lo`` (the remaining <= 3
bits), weight rows ``j`` (hi) and ``M3 + j`` (lo) of the GEMM's B operand. ``x`` is bf16, so ``x * hi``
and ``x * lo`` are exact in the fp32 accumulator and ``acc_hi + acc_lo`` is the TF32 product sum,
fp32-accumulated (same precision class as a TF32 MMA). A CTA is one warpgroup on 64-token tiles: per
step of ``BK`` columns (128 where every split owns an even number of 64-column blocks, else 64) one
asynchronous ``64 x 2M3 x BK`` WGMMA over the hi/lo rows, the sum of squares on the CUDA cores from the
same shared tile while it runs, with the x tiles of the next steps in flight (cp.async). Two schedules,
the same arithmetic in the same order (bitwise equal results):

* resident (where a split's hi/lo weights fit in shared memory next to at least
  ``_RESIDENT_MIN_STAGES`` x stages, H <= 5632 at S = 16, and the splits fill at least
  ``_RESIDENT_MIN_FILL`` of the SMs with ``SMs // S`` CTAs each): ``S * C`` persistent CTAs, at most
  one per SM, ``C = min(SMs // S, tiles)`` (``config.num_sms``), CTA ``b`` owning split ``b % S`` and an
  even share of the token tiles; the split's f32 weights are loaded into shared memory once, with the
  first tile's steps (each step's into the next step's hi / lo slot), and converted there into the
  step's slot (no preparation kernel), and the x pipeline runs on across tiles (measured at H = 4096
  and the H200's 132 SMs); the x tiles are issued as raw-offset 16-byte cp.async checked against the
  token count only (the SMs' instruction issue, not DRAM, bounds this schedule);
* streaming (otherwise): a small preparation kernel converts ``fn`` once per call into a ``(2 M3, K)``
  bf16 workspace; one CTA per (split, 64-token tile), the weight tile of each step loaded with its x
  tile (``_FWD_STAGES`` deep, 2 CTAs per SM; the x tiles issued as in the resident schedule).

Backward (``mhc_gemm_with_sqrsum_backward``): ``x_grad[t, k] = bf16(f32(x_grad[t, k]) + sum_j g[t, j] *
fn[j, k] + 2 * f32(x[t, k]) * sg[t])`` (read-modify-write) and ``fn_grad[j, k] = sum_t g[t, j] *
f32(x[t, k])`` in fp32 FMA (more precise than the old kernel's TF32 rounding of ``g``). Grid
``(K / 64, P)``: CTA ``(cb, p)`` owns 64 columns and the fixed token range ``[p * ceil(T/P),
min((p+1) * ceil(T/P), T))``; per iteration warp ``w`` takes 8 consecutive tokens of the next 32 of the range, each lane
2 columns with the 24 ``fn`` values of its columns in registers; the 4 warp partials are summed in
ascending warp order, then (``P > 1``) a second kernel sums the ``P`` partial rows in ascending ``p``.
Deterministic, no atomics.

Supported sizes: ``K % 64 == 0``, ``M3 <= 32`` and ``M3 % 8 == 0`` (``M3 = 24`` for ``m = 4``), any
``T > 0``, any ``n_splits >= 1`` (splits with no block write zeros).
"""

import functools

import torch

from .... import config
from .._build import jit_compile, smem_budget_bytes

__all__ = [
    "build_mhc_gemm_fn_split",
    "build_mhc_gemm_with_sqrsum_backward",
    "build_mhc_gemm_with_sqrsum_backward_reduce",
    "build_mhc_gemm_with_sqrsum_forward",
    "build_mhc_gemm_with_sqrsum_forward_main",
    "build_mhc_gemm_with_sqrsum_forward_resident",
    "get_mhc_gemm_fn_split_kernel",
    "get_mhc_gemm_with_sqrsum_backward_kernel",
    "get_mhc_gemm_with_sqrsum_backward_reduce_kernel",
    "get_mhc_gemm_with_sqrsum_forward_kernel",
    "gemm_lowering_cases",
    "mhc_gemm_with_sqrsum_backward",
    "mhc_gemm_with_sqrsum_backward_key",
    "mhc_gemm_with_sqrsum_backward_partials",
    "mhc_gemm_with_sqrsum_forward",
    "mhc_gemm_with_sqrsum_forward_block_k",
    "mhc_gemm_with_sqrsum_forward_ctas_per_split",
    "mhc_gemm_with_sqrsum_forward_key",
    "mhc_gemm_with_sqrsum_forward_resident_stages",
]

_BLOCK_K = 64  # split granularity (the interface's 64-column blocks) and the K step of the forward
_FWD_BLOCK_T = 64  # tokens per forward CTA (one WGMMA M = 64 warpgroup)
# NOTE measured on the H200 (T = 8192, S = 16): 128-column steps, 3 stages (90 KiB of shared memory,
# 2 CTAs per SM) and the split-major grid give 79.9 / 131.1 us at H = 4096 / 7168 (3.54 / 3.70 TB/s,
# fn preparation included); 64-column steps with 4-6 stages and 256-column steps were 1-10 % slower.
# Running 2 or 4 consecutive splits through one CTA's pipeline (fewer prologues, one grid wave less)
# made no difference: main kernel 78.4-78.7 / 129.5-129.8 us at T = 8192 (13.7-13.8 us at T = 512, H = 7168).
# 128-token tiles (one warpgroup, 128-column steps, 2 stages): main kernel 78.3 / 127.2 us against
# 78.4 / 129.1 us at T = 8192 but 11.3 / 17.9 us against 8.8 / 13.6 us at T = 512; with two warpgroups
# (256 threads) 105-119 / 176-195 us. Splitting fn inside this kernel instead of the preparation kernel
# (f32 fn tiles through the pipeline, converted in shared memory: bitwise equal, three placements of the
# conversion) saved the preparation at T = 512 (9.8 / 15.2 us against 10.6 / 16.1 us in all) but cost
# more than it at T = 8192 (89.0 / 144.0 us against 79.9 / 131.3 us): every token tile converts again.
# TileLang's own warp-specialized TMA pipeline (T.Pipelined + T.copy, a producer warpgroup, 240-register
# consumers, hence one CTA per SM): bitwise equal, main kernel 92.1-101.2 / 137.7-152.3 us with 3-6
# stages at T = 8192 and 9.0-9.3 / 14.1-14.4 us at T = 512 against 78.4 / 127.9 and 8.7 / 13.7 us.
# Re-measured (main kernel, T = 8192 / 512, H = 4096 | 7168): 128-column steps with 2 stages (56 KiB, up
# to 4 CTAs per SM) 77.6 / 9.7 | 127.8 / 15.7 us against 78.7 / 8.9 | 129.6 / 13.7 us (3 stages), 4 stages
# 78.3 / 9.0 | 129.7 / 13.5 us, 64-column steps with 3-5 stages 79.4-82.7 / 9.3-10.6 | 132.5-137.6 /
# 14.3-17.6 us; the fn preparation takes 2.3 / 2.8 us (H = 4096 / 7168). None reaches 85 % of the copy
# ceiling at H = 4096 with the preparation included; the 2-stage gain at T = 8192 costs more at T = 512.
# Where the time goes (T = 8192, K = 16384, S = 16, same grid and 3-stage pipeline, cupti): loading the
# x tiles alone (plus the sum of squares) 70.1 us; with the weight tiles 73.0; with the partial writes
# 73.7; with both 78.2; the main kernel 78.7 (the WGMMA costs ~0.5 us); the preparation 2.5. Longer row
# segments (16-32 tokens x 256-512 columns per step) read x only 1-2 % faster. ncu: L2 77 % busy (the
# weight tiles are read once per token tile, 200 MB), DRAM 67 %, 8 warps per SM.
# Two schedules without the preparation kernel, both bitwise equal to this one and both slower (the
# resident schedule adopted later converts fn itself, differently; see the NOTEs below):
# (a) the split's hi / lo weights resident in shared memory (converted by each CTA during its first
# token tile; 96 KiB at K / S = 1024), each CTA running ceil(tiles / (SMs / S)) token tiles of one split
# through one pipeline (no per-tile weight reads): one CTA per SM, so only 2-3 x tiles in flight per SM:
# 91.4 / 86.5 us with 3 / 4 stages at T = 8192 (K = 16384), 14.3-14.8 us at T = 512 (current 80.2 / 10.6
# in the same run, preparation included); (b) the weight tile of each step loaded as f32 into registers
# one step ahead and TF32-split into the stage by the CTA itself: 92.2 / 101.4 / 107.7 us with 2 / 3 / 4
# stages at T = 8192 (current 79.4), 11.7-12.4 us at T = 512 (current 10.7).
_FWD_STAGES = {64: 6, 128: 3}
# NOTE measured on the H200 (T = 8192, K = 16384, S = 16, cupti, interleaved rounds, main kernel without
# the preparation): the sum of squares computed while the step's WGMMA runs (one wait before the stage
# is released) 77.8 against 78.5 us (H = 7168: 127.9 against 129.0; T = 512 level). A contiguous
# read-only kernel reaches 3.77-3.81 TB/s on this H200 (70.4-71.3 us for the 268 MB of x), so x alone
# bounds this forward at ~70.5 us. Resident weights (no per-tile weight reads from L2) with the WGMMA
# wait deferred one step (the wait that releases stage n - 1 comes after step n's sum of squares):
# 76.3 / 77.0 / 83.3 us with 7 / 5 / 4 x stages; with a synchronous WGMMA 79.9-80.9 us (4-7 stages),
# and x loaded by TMA (one mbarrier per stage) 82.8-86.9 us (3-7 stages). T = 512: 9.0 us (7 stages)
# against 8.8 us for the streaming schedule. Converting fn in the resident kernel instead of the
# preparation kernel (each CTA once, before its first tile): bitwise equal but 82.9-83.8 us at T = 8192
# and 15-16 us at T = 512 (preparation + resident 78.6 / 10.8 us). The whole op (benchmark harness):
# 77.95 / 78.89 us at T = 8192, H = 4096 in two runs (85.8 / 84.3 % of their 4233 / 4259 GB/s copy
# ceilings; 80.67 us before), 128.3 / 130.2 us at H = 7168.
# NOTE converting fn inside the resident kernel (H200, T = 8192 / 512, H = 4096, interleaved cupti rounds,
# each bitwise equal to preparation + resident at H in {2560, 4096, 5120}, T in {1, 63, 509, 512, 4097,
# 8192}, 1 / 3 / the launcher's CTAs per split): the f32 weights of each step cp.async'd into their own hi
# / lo slot (the same 12 KiB) and converted in place during the first tile, two extra barriers per
# first-tile step: 78.97 / 78.38 / 78.91 against 79.16 / 78.80 / 79.04 us in three runs (main kernel alone
# 77.5 / 76.9 / 77.3, preparation 2.4-2.5), 9.70 / 9.78 / 9.76 against 10.74 / 10.84 / 10.77 us at T =
# 512: adopted, then replaced by the staging one slot over below. Not adopted: register loads of the f32
# weights two steps ahead (78.99 / 11.68 us; preparation + resident 79.05 / 10.79), a separate f32 staging
# ring of 4 slots next to 5 x stages (80.06 / 9.35 against 78.96 / 10.81), each thread staging the f32
# bytes exactly where its own hi / lo go (no barrier between reads and writes): with 8-byte copies 78.63 /
# 11.78, 16-byte 81.21 / 13.64 us.
# The whole op after it (benchmark harness, two runs on one H200 whose copy ceiling was 4260 GB/s): 79.16
# / 78.70 us at T = 8192, H = 4096 (84.0 / 84.4 % of it), 9.80 / 9.83 us at T = 512 (10.66 before).
# Then each step's f32 weights staged one slot over (the last step's in the output tile), so that the
# conversion's reads and writes never touch the same bytes and need no barrier between them (one extra
# barrier per first-tile step instead of two; bitwise equal to the in-place kernel at H = 4096, S = 16 and
# H = 1280, S = 7, T in {1, 63, 509, 512, 4097, 8192}, 1 / 3 / the launcher's CTAs per split): 78.09
# against 78.55 us at T = 8192, 10.15 against 10.09 us at T = 512 (8 interleaved rounds); with each
# chunk's read, split and writes interleaved instead 78.18 / 10.48 (78.75 / 10.05 in place). Adopted.
# NOTE what bounds the resident schedule (H200, T = 8192, H = 4096, cupti): the SMs, not DRAM. With 4 / 6 / 7
# / 8 CTAs per split (64-128 SMs) it took 140.0 / 98.2 / 86.3 / 77.5 us, nearly proportional to 1 / CTAs,
# while a read-only cp.async (or TMA) ring over the same tiles reads x in 69 us from 64 SMs as from 128
# (60 GB/s per SM against the GEMM's 30). ncu: one warp per scheduler issuing every 2.3 cycles, ~390
# instructions per warp and step, of which ~115 issued the step's 8 x cp.async (TileLang's bounds predicate on
# both dimensions, per chunk) and ~170 the sum of squares. The x loads are now raw-offset cp.async with only
# the token bound (``ops_cp_async16``): 76.57 against 77.94 us (8 interleaved rounds), bitwise equal at
# H in {1280 (S = 7), 2560, 4096, 5120}, T in {1, 63, 509, 512, 4097, 8192}, 1 / 3 / the launcher's CTAs
# per split; T = 512 and H = 5120 unchanged. Whole op (harness, copy ceiling 4259 / 4260 GB/s): 77.60 /
# 77.21 us (85.7 / 86.1 %), 78.59 / 78.97 us (84.6 / 84.2 %) before on the same machine. Not adopted: two
# warpgroups (256 threads; TileLang splits the 64 x 48 WGMMA into 64 x 8 pieces per warpgroup): 125 us.
# The streaming schedule loads its x tiles the same way (one macro, ``_x_tile_macro``; the weight tiles need
# no bounds check): bitwise equal at H = 7168 (S = 16), 1280 (S = 80) and 4096 (S = 1), T in {1, 63, 509,
# 512, 4097, 8192}; main kernel at H = 7168 126.77 against 127.10 us (T = 8192), 13.66 / 13.65 (T = 512).
# Harness on another H200 (copy ceiling 4232 GB/s): 76.75 us at T = 8192, H = 4096 (87.2 %), 128.37 us at
# H = 7168 (89.4 %).
_H200_SMS = 132  # the lowering cases' SM count
# A 16-byte cp.async of the x tile: ``gmem + offset`` bytes into ``smem`` where ``pred`` holds (else
# nothing is copied: rows past the token count are never stored). Raw offsets keep TileLang's bounds
# predicate out of the load issue (in the resident schedule its async_copy checked both dimensions per
# chunk and zero-filled; the streaming schedule's checked the token bound only, so there it saves little).
_CP_ASYNC_PRELUDE = r"""
__device__ __forceinline__ void ops_cp_async16(void* smem, const void* gmem, long long offset, bool pred) {
  unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  const char* src = static_cast<const char*>(gmem) + offset;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n"
               :: "r"(dst), "l"(src), "r"(static_cast<int>(pred)) : "memory");
}
"""
_RESIDENT_MIN_FILL = 0.9  # resident schedule: S * (SMs // S) CTAs keep at least 90 % of the SMs busy
_RESIDENT_MAX_STAGES = 7  # of 128-column steps (16 KiB of x); twice as many 64-column steps
_RESIDENT_MIN_STAGES = 5  # likewise
_SMEM_BYTES = smem_budget_bytes("sm_90a")  # one CTA's shared memory on the H200 (227 KiB)
# fn preparation: 128 threads of 4 float4 each. NOTE measured on the H200 (cupti, interleaved rounds):
# 2.33 / 2.92 us against 2.47 / 3.10 us for 256 threads of one float4 at K = 16384 / 28672 (bitwise equal);
# the whole forward at T = 8192 80.67 / 131.20 us against 80.91 / 132.51 us.
_SPLIT_THREADS = 128
_SPLIT_VECS = 4
_FWD_THREADS = 128
_BWD_THREADS = 128  # 4 warps; a warp row covers the CTA's 64 columns (2 per lane, 4-byte accesses)
_BWD_TARGET_CTAS = 8 * 132  # backward grid target: ~8 CTAs per H200 SM over all waves
_BWD_MAX_PARTIALS = 64
# NOTE: 8 consecutive tokens per warp and iteration: 16 x 4-byte x / x_grad loads per lane in flight
# (16 registers), with the g rows of the 32 tokens staged in 3 KiB of shared memory.
_BWD_UNROLL = 8
_RED_THREADS = 128


def _check(op: str, rows: int, cols: int) -> None:
    if cols <= 0 or cols % _BLOCK_K != 0:
        raise ValueError(f"{op}: K must be a positive multiple of {_BLOCK_K}, got {cols}")
    if rows > 32 or rows % 8 != 0:
        raise ValueError(f"{op}: M3 must be a multiple of 8 and at most 32, got {rows}")


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------


def mhc_gemm_with_sqrsum_forward_block_k(cols: int, n_splits: int) -> int:
    """Columns per pipeline step of the forward at ``K = cols`` and ``S = n_splits``: 128 where every
    split owns the same even number of 64-column blocks (so a step never straddles a split boundary),
    else 64."""
    nb = cols // _BLOCK_K
    return 2 * _BLOCK_K if nb % n_splits == 0 and (nb // n_splits) % 2 == 0 else _BLOCK_K


def mhc_gemm_with_sqrsum_forward_resident_stages(cols: int, rows: int, n_splits: int, block_k: int, num_sms: int) -> int:
    """x stages of the resident forward schedule at ``(K, M3, S, BK)`` on a GPU of ``num_sms`` SMs (see
    the module docstring), or 0 where it does not apply: a split's hi/lo weights, the x stages and the
    output tile must fit in one CTA's shared memory with at least ``_RESIDENT_MIN_STAGES`` stages (twice
    as many of 64 columns), every split must own a block, and ``S * (num_sms // S)`` CTAs must keep at
    least ``_RESIDENT_MIN_FILL`` of the SMs busy (else the streaming schedule fills the GPU better)."""
    nb, g = cols // _BLOCK_K, block_k // _BLOCK_K
    q, r = divmod(nb, n_splits)
    if q == 0 or n_splits * (num_sms // n_splits) < _RESIDENT_MIN_FILL * num_sms:
        return 0
    slots = (q + (1 if r else 0)) // g  # steps of the largest split (g > 1 only where r == 0, q % g == 0)
    fixed = slots * 2 * rows * block_k * 2 + _FWD_BLOCK_T * 2 * rows * 4
    per_128 = 2 * _BLOCK_K // block_k
    stages = min(_RESIDENT_MAX_STAGES * per_128, (_SMEM_BYTES - fixed) // (_FWD_BLOCK_T * block_k * 2))
    return stages if stages >= _RESIDENT_MIN_STAGES * per_128 else 0


def _fwd_key(cols: int, rows: int, n_splits: int, num_sms: int) -> tuple:
    """:func:`mhc_gemm_with_sqrsum_forward_key` from the sizes and the SM count."""
    _check("mhc_gemm_with_sqrsum_forward", rows, cols)
    if n_splits < 1:
        raise ValueError(f"mhc_gemm_with_sqrsum_forward: n_splits must be >= 1, got {n_splits}")
    block_k = mhc_gemm_with_sqrsum_forward_block_k(cols, n_splits)
    stages = mhc_gemm_with_sqrsum_forward_resident_stages(cols, rows, n_splits, block_k, num_sms)
    return (cols, rows, n_splits, block_k, stages)


def mhc_gemm_with_sqrsum_forward_key(x: torch.Tensor, fn: torch.Tensor, n_splits: int) -> tuple:
    """Compile-time key ``(K, M3, S, block_k, resident_stages)`` on ``x``'s CUDA device (never the token
    count; ``resident_stages`` is 0 for the streaming schedule)."""
    rows, cols = (int(s) for s in fn.shape)
    return _fwd_key(cols, rows, int(n_splits), config.num_sms(x.device.index))


def _tf32_split_macro():
    """``T.macro(v, rb, hi, lo, k)``: rounds the f32 value ``v`` to TF32 and splits it exactly into
    ``hi[k] + lo[k]`` (bf16; ``rb``: a uint32 local scratch, element ``k``), the one conversion of both
    forward schedules (see the module docstring)."""
    from tilelang import language as T

    f32, bf16, u32 = T.float32, T.bfloat16, T.uint32

    @T.macro
    def tf32_split(v, rb, hi, lo, k):
        # TF32: add half a TF32 ulp to the bit pattern, clear the low 13 bits (round half away); hi keeps
        # the top 8 significand bits, lo the remaining <= 3 (both exact).
        rb[k] = T.reinterpret(v, u32) + T.cast(0x1000, u32)
        hi[k] = T.cast(T.reinterpret(rb[k] & T.cast(0xFFFF0000, u32), f32), bf16)
        lo[k] = T.cast(T.reinterpret(rb[k] & T.cast(0xFFFFE000, u32), f32) - T.reinterpret(rb[k] & T.cast(0xFFFF0000, u32), f32), bf16)

    return tf32_split


def _x_tile_macro(cols: int, block_k: int, num_tokens):
    """``T.macro(x, x_s, stage, tile, col, tid)``: one step's ``BT x block_k`` x tile (tokens from
    ``tile * BT``, columns from ``col``) into ``x_s[stage]``, the x loads of both forward schedules. Each
    thread issues its 16-byte chunks (rows ``TH / (block_k / 8)`` apart, one column chunk) by raw-offset
    cp.async (``ops_cp_async16``, the kernel needs ``_CP_ASYNC_PRELUDE``), checked against the token count
    only: rows past it are not loaded (their results are never stored). Commits no group."""
    from tilelang import language as T

    K, BT, BK, TH = cols, _FWD_BLOCK_T, block_k, _FWD_THREADS
    XC = BK // 8  # chunks per x row of a step
    XR = TH // XC  # rows covered by one chunk per thread
    XV = BT // XR  # chunks of a step per thread

    @T.macro
    def load_x(x, x_s, stage, tile, col, tid):
        for i in T.unroll(XV):
            T.call_extern(
                "void",
                "ops_cp_async16",
                T.address_of(x_s[stage, i * XR + tid // XC, tid % XC * 8]),
                T.address_of(x[0, 0]),
                (T.cast(tile * BT + i * XR + tid // XC, T.int64) * K + col + tid % XC * 8) * 2,
                tile * BT + i * XR + tid // XC < num_tokens,
            )

    return load_x


def build_mhc_gemm_fn_split(cols: int, rows: int):
    """Builds the ``fn`` preparation of the forward: ``fhl[j] = hi(tf32(fn[j]))`` and
    ``fhl[M3 + j] = lo(tf32(fn[j]))`` (see the module docstring), ``(2 * M3, K)`` bf16.

    One pass over the ``M3 x K`` weight (1.5 MiB at K = 16384) so that the streaming schedule's CTAs,
    which read each weight block once per token tile, load ready bf16 operands and need no conversion
    step (the resident schedule converts its split's weights itself, once per CTA).
    """
    from tilelang import language as T

    K, M3 = cols, rows
    f32, bf16, u32 = T.float32, T.bfloat16, T.uint32
    threads, nv = _SPLIT_THREADS, _SPLIT_VECS
    per_cta = threads * nv * 4
    tf32_split = _tf32_split_macro()

    @T.prim_func
    def mhc_gemm_fn_split_cuda(fn: T.Tensor((M3, K), f32), fhl: T.Tensor((2 * M3, K), bf16)):
        # CTA bx owns the nv consecutive 4-element groups (bx * nv + j) * threads + tid, j < nv, of the
        # flat (M3 * K) weight: every j is one coalesced float4 pass of the CTA, all nv loads in flight.
        with T.Kernel(T.ceildiv(M3 * K, per_cta), threads=threads) as bx:
            tid = T.get_thread_binding()
            v = T.alloc_local((nv, 4), f32)
            rb = T.alloc_local((4,), u32)
            hi = T.alloc_local((4,), bf16)
            lo = T.alloc_local((4,), bf16)
            for j in T.unroll(nv):
                base = ((bx * nv + j) * threads + tid) * 4
                if base < M3 * K:
                    for k in T.vectorized(4):
                        v[j, k] = fn[(base + k) // K, (base + k) % K]
            for j in T.unroll(nv):
                base = ((bx * nv + j) * threads + tid) * 4
                if base < M3 * K:
                    for k in T.unroll(4):
                        tf32_split(v[j, k], rb, hi, lo, k)
                    for k in T.vectorized(4):
                        fhl[(base + k) // K, (base + k) % K] = hi[k]
                    for k in T.vectorized(4):
                        fhl[M3 + (base + k) // K, (base + k) % K] = lo[k]

    return mhc_gemm_fn_split_cuda


def build_mhc_gemm_with_sqrsum_forward(cols: int, rows: int, n_splits: int, block_k: int = _BLOCK_K):
    """Builds the split-K forward main kernel, streaming schedule (one CTA per split and token tile).

    Args:
        cols: ``K`` (multiple of 64).
        rows: ``M3`` (multiple of 8, <= 32).
        n_splits: ``S``.
        block_k: columns per pipeline step (64, or 128 when every split owns an even number of
            64-column blocks, see :func:`mhc_gemm_with_sqrsum_forward_block_k`).

    Returns:
        ``T.prim_func(x (T, K) bf16, fhl (2 M3, K) bf16, out_mul_part (S, T, M3) f32, sqrsum_part (S, T) f32)``
        with ``fhl`` from :func:`build_mhc_gemm_fn_split`; ``T`` is dynamic.
    """
    from tilelang import language as T

    K, M3, S = cols, rows, n_splits
    BT, BK = _FWD_BLOCK_T, block_k
    NS = _FWD_STAGES[BK]
    g = BK // _BLOCK_K
    nb = K // _BLOCK_K
    q, r = nb // S, nb % S
    if g > 1 and (r != 0 or q % g != 0):
        raise ValueError(f"mhc_gemm_with_sqrsum_forward: block_k {BK} needs equal splits of a multiple of {g} blocks")
    HALF = 64  # the sum of squares is kept per (token, column mod 64)
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")
    load_x = _x_tile_macro(K, BK, num_tokens)

    @T.prim_func
    def mhc_gemm_with_sqrsum_forward_cuda(
        x: T.Tensor((num_tokens, K), bf16),
        fhl: T.Tensor((2 * M3, K), bf16),
        out_mul_part: T.Tensor((S, num_tokens, M3), f32),
        sqrsum_part: T.Tensor((S, num_tokens), f32),
    ):
        # split-major grid: the S CTAs of one token tile are launched together and read whole rows of x
        with T.Kernel(S, T.ceildiv(num_tokens, BT), threads=_FWD_THREADS, prelude=_CP_ASYNC_PRELUDE) as (s, bt):
            tid = T.get_thread_binding()
            x_s = T.alloc_shared((NS, BT, BK), bf16)
            f_s = T.alloc_shared((NS, 2 * M3, BK), bf16)
            acc = T.alloc_fragment((BT, 2 * M3), f32)
            sq = T.alloc_fragment((BT, HALF), f32)
            sq_row = T.alloc_fragment((BT,), f32)
            o_s = T.alloc_shared((BT, 2 * M3), f32)  # hi and lo products, summed on the way out
            T.clear(acc)
            T.clear(sq)
            cnt = T.if_then_else(s < r, q + 1, q) // g
            col0 = (s * q + T.min(s, r)) * _BLOCK_K
            # Prologue: steps 0 .. NS-2 in flight (an empty group where the split has fewer steps, so
            # that the group count below stays uniform).
            for st in T.unroll(NS - 1):
                if st < cnt:
                    load_x(x, x_s, st, bt, col0 + st * BK, tid)
                    T.ptx_commit_group()
                    T.async_copy(fhl[0 : 2 * M3, col0 + st * BK : col0 + st * BK + BK], f_s[st, :, :])
                else:
                    T.ptx_commit_group()
                    T.ptx_commit_group()
            for kb in T.serial(cnt):
                # Step kb + NS - 1 goes into the stage consumed at kb - 1 (released by the barrier that
                # closed iteration kb - 1).
                if kb + NS - 1 < cnt:
                    load_x(x, x_s, (kb + NS - 1) % NS, bt, col0 + (kb + NS - 1) * BK, tid)
                    T.ptx_commit_group()
                    T.async_copy(
                        fhl[0 : 2 * M3, col0 + (kb + NS - 1) * BK : col0 + (kb + NS - 1) * BK + BK],
                        f_s[(kb + NS - 1) % NS, :, :],
                    )
                else:
                    T.ptx_commit_group()
                    T.ptx_commit_group()
                T.ptx_wait_group(2 * (NS - 1))
                T.sync_threads()
                # one 64 x 2M3 x BK product (columns 0..M3-1 take hi, M3..2M3-1 lo), asynchronous: the sum
                # of squares of the same tile runs meanwhile; both done before the stage is released
                T.wgmma_gemm(x_s[kb % NS, :, :], f_s[kb % NS, :, :], acc, transpose_B=True)
                for h in T.unroll(g):
                    for i, k in T.Parallel(BT, HALF):
                        sq[i, k] += T.cast(x_s[kb % NS, i, h * HALF + k], f32) * T.cast(x_s[kb % NS, i, h * HALF + k], f32)
                T.wait_wgmma(0)
                T.sync_threads()
            T.reduce_sum(sq, sq_row, dim=1)
            T.copy(acc, o_s)
            T.sync_threads()
            for i, j in T.Parallel(BT, M3):
                if bt * BT + i < num_tokens:
                    out_mul_part[s, bt * BT + i, j] = o_s[i, j] + o_s[i, M3 + j]
            for i in T.Parallel(BT):
                if bt * BT + i < num_tokens:
                    sqrsum_part[s, bt * BT + i] = sq_row[i]

    return mhc_gemm_with_sqrsum_forward_cuda


def build_mhc_gemm_with_sqrsum_forward_resident(cols: int, rows: int, n_splits: int, block_k: int, stages: int):
    """Builds the split-K forward main kernel, resident schedule (see the module docstring): it takes
    ``fn`` itself and converts the split's weights once per CTA, with no preparation kernel.

    Args:
        cols: ``K`` (multiple of 64).
        rows: ``M3`` (multiple of 8, <= 32).
        n_splits: ``S`` (each split owns at least one 64-column block).
        block_k: columns per pipeline step (see :func:`mhc_gemm_with_sqrsum_forward_block_k`).
        stages: x stages (see :func:`mhc_gemm_with_sqrsum_forward_resident_stages`).

    Returns:
        ``T.prim_func(x, fn, out_mul_part, sqrsum_part, ctas_per_split: int32)``: ``fn`` ``(M3, K)`` f32,
        the other buffers as in :func:`build_mhc_gemm_with_sqrsum_forward`; ``ctas_per_split`` ``C >= 1``
        sets the grid ``S * C`` (``C <= tiles``; one wave where ``S * C`` is at most the SM count).
    """
    from tilelang import language as T

    K, M3, S = cols, rows, n_splits
    BT, BK, NS, TH = _FWD_BLOCK_T, block_k, stages, _FWD_THREADS
    g = BK // _BLOCK_K
    nb = K // _BLOCK_K
    q, r = nb // S, nb % S
    if q == 0 or (g > 1 and (r != 0 or q % g != 0)) or NS < 3:
        raise ValueError(f"mhc_gemm_with_sqrsum_forward: no resident schedule for K={K}, S={S}, block_k={BK}, stages={NS}")
    slots = (q + (1 if r else 0)) // g
    HALF = 64
    CH = BK // 4  # 16-byte (4 x f32) chunks per fn row of a step
    NV = M3 * BK // (4 * TH)  # chunks of a step per thread (M3 % 8 == 0: whole)
    f32, bf16, i32, u32 = T.float32, T.bfloat16, T.int32, T.uint32
    num_tokens = T.dynamic("num_tokens")
    tf32_split = _tf32_split_macro()
    load_x = _x_tile_macro(K, BK, num_tokens)

    @T.macro
    def issue_next(x, fn, x_s, w_f, o_f, ld, b0, b1, cnt, blk0, stage, tid):
        # The loads of step ld = (tile, step) into x stage ``stage`` as two cp.async groups (the x tile,
        # an empty group past the CTA's last tile; during the first tile the step's f32 weights into the
        # next slot's bytes, the last step's into o_s, else an empty group: the waits count uniformly),
        # then ld advances.
        if ld[0] < b1[0]:
            load_x(x, x_s, stage, ld[0], blk0[0] * 64 + ld[1] * BK, tid)
        T.ptx_commit_group()
        if ld[0] == b0[0]:
            for i in T.unroll(NV):
                if ld[1] + 1 < cnt[0]:
                    T.ptx_cp_async(
                        T.access_ptr(w_f[ld[1] + 1, (i * TH + tid) // CH, (i * TH + tid) % CH * 4], "w", 4),
                        T.access_ptr(fn[(i * TH + tid) // CH, blk0[0] * 64 + ld[1] * BK + (i * TH + tid) % CH * 4], "r", 4),
                        4,
                    )
                else:
                    T.ptx_cp_async(
                        T.access_ptr(o_f[(i * TH + tid) // CH, (i * TH + tid) % CH * 4], "w", 4),
                        T.access_ptr(fn[(i * TH + tid) // CH, blk0[0] * 64 + ld[1] * BK + (i * TH + tid) % CH * 4], "r", 4),
                        4,
                    )
        T.ptx_commit_group()
        ld[1] += 1
        if ld[1] == cnt[0]:
            ld[1] = 0
            ld[0] += 1

    @T.macro
    def convert(w_f, o_f, w_s, wr, rb, hi, lo, s, cnt, tid):
        # Slot s's f32 weights (landed and visible) sit one slot over (the last slot's in o_s): every
        # thread reads its chunks, then writes their hi / lo into slot s, whose bytes no thread reads here.
        for i in T.unroll(NV):
            if s + 1 < cnt[0]:
                for c in T.vectorized(4):
                    wr[i, c] = w_f[s + 1, (i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c]
            else:
                for c in T.vectorized(4):
                    wr[i, c] = o_f[(i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c]
        for i in T.unroll(NV):
            for c in T.unroll(4):
                tf32_split(wr[i, c], rb, hi, lo, c)
            for c in T.vectorized(4):
                w_s[s, (i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c] = hi[c]
            for c in T.vectorized(4):
                w_s[s, M3 + (i * TH + tid) // CH, (i * TH + tid) % CH * 4 + c] = lo[c]

    @T.prim_func
    def mhc_gemm_with_sqrsum_forward_resident_cuda(
        x: T.Tensor((num_tokens, K), bf16),
        fn: T.Tensor((M3, K), f32),
        out_mul_part: T.Tensor((S, num_tokens, M3), f32),
        sqrsum_part: T.Tensor((S, num_tokens), f32),
        ctas_per_split: i32,
    ):
        # CTA b: split b % S, token tiles [b0, b1) of that split's ctas_per_split CTAs
        with T.Kernel(S * ctas_per_split, threads=TH, prelude=_CP_ASYNC_PRELUDE) as b:
            x_s = T.alloc_shared((NS, BT, BK), bf16)
            w_s = T.alloc_shared((slots, 2 * M3, BK), bf16)  # the split's hi / lo weights, step by step
            acc = T.alloc_fragment((BT, 2 * M3), f32)
            sq = T.alloc_fragment((BT, HALF), f32)
            sq_row = T.alloc_fragment((BT,), f32)
            o_s = T.alloc_shared((BT, 2 * M3), f32)
            # The same bytes as f32 (a slot's 2 M3 x BK bf16 = M3 x BK f32): during the first tile, step s's
            # fn columns land in slot s + 1 (the last step's in the output tile, free until the first
            # tile's end) and are converted from there into slot s's hi / lo.
            w_f = T.view(w_s, shape=(slots, M3, BK), dtype=f32)
            o_f = T.view(o_s, shape=(M3, 2 * BT), dtype=f32)
            wr = T.alloc_local((NV, 4), f32)
            rb = T.alloc_local((4,), u32)
            hi = T.alloc_local((4,), bf16)
            lo = T.alloc_local((4,), bf16)
            # Per-CTA scalars, computed once (the index expressions below stay free of divisions):
            # first and end tile, steps per tile, first 64-column block of the split; the (tile, step)
            # of the next load to issue; the (tile, step) being consumed.
            b0 = T.alloc_local((1,), i32)
            b1 = T.alloc_local((1,), i32)
            cnt = T.alloc_local((1,), i32)
            blk0 = T.alloc_local((1,), i32)
            ld = T.alloc_local((2,), i32)
            cs = T.alloc_local((2,), i32)
            tid = T.get_thread_binding()
            tiles = T.ceildiv(num_tokens, BT)
            b0[0] = (b // S) * tiles // ctas_per_split
            b1[0] = (b // S + 1) * tiles // ctas_per_split
            cnt[0] = T.if_then_else(b % S < r, q + 1, q) // g
            blk0[0] = (b % S) * q + T.min(b % S, r)
            ld[0] = b0[0]
            ld[1] = 0
            cs[0] = b0[0]
            cs[1] = 0
            T.clear(acc)
            T.clear(sq)
            for st in T.unroll(NS - 1):
                issue_next(x, fn, x_s, w_f, o_f, ld, b0, b1, cnt, blk0, st, tid)
            for n in T.serial((b1[0] - b0[0]) * cnt[0]):
                T.ptx_wait_group(2 * (NS - 2))  # step n landed (steps n + 1 .. n + NS - 2 in flight)
                T.sync_threads()
                if cs[0] == b0[0]:
                    # first tile: convert the step's weight slot; the WGMMA reads it through the async proxy
                    convert(w_f, o_f, w_s, wr, rb, hi, lo, cs[1], cnt, tid)
                    T.fence_proxy_async()
                    T.sync_threads()
                T.wgmma_gemm(x_s[n % NS, :, :], w_s[cs[1], :, :], acc, transpose_B=True)
                for h in T.unroll(g):
                    for i, k in T.Parallel(BT, HALF):
                        sq[i, k] += T.cast(x_s[n % NS, i, h * HALF + k], f32) * T.cast(x_s[n % NS, i, h * HALF + k], f32)
                # Step n - 1's WGMMA is done in every warp after this wait and barrier: its stage
                # ((n - 1) % NS) takes step n + NS - 1.
                T.wait_wgmma(1)
                T.sync_threads()
                issue_next(x, fn, x_s, w_f, o_f, ld, b0, b1, cnt, blk0, (n + NS - 1) % NS, tid)
                cs[1] += 1
                if cs[1] == cnt[0]:
                    # last step of tile cs[0]: write its partials, restart the accumulators
                    T.wait_wgmma(0)
                    T.reduce_sum(sq, sq_row, dim=1)
                    T.copy(acc, o_s)
                    T.sync_threads()
                    for i, j in T.Parallel(BT, M3):
                        if cs[0] * BT + i < num_tokens:
                            out_mul_part[b % S, cs[0] * BT + i, j] = o_s[i, j] + o_s[i, M3 + j]
                    for i in T.Parallel(BT):
                        if cs[0] * BT + i < num_tokens:
                            sqrsum_part[b % S, cs[0] * BT + i] = sq_row[i]
                    T.clear(acc)
                    T.clear(sq)
                    cs[0] += 1
                    cs[1] = 0
                    T.sync_threads()

    return mhc_gemm_with_sqrsum_forward_resident_cuda


def build_mhc_gemm_with_sqrsum_forward_main(cols: int, rows: int, n_splits: int, block_k: int, resident_stages: int):
    """The forward main kernel of a key (see :func:`mhc_gemm_with_sqrsum_forward_key`): resident schedule
    where ``resident_stages > 0``, else streaming."""
    if resident_stages:
        return build_mhc_gemm_with_sqrsum_forward_resident(cols, rows, n_splits, block_k, resident_stages)
    return build_mhc_gemm_with_sqrsum_forward(cols, rows, n_splits, block_k)


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_fn_split_kernel(*key):
    """Compiled ``fn`` preparation for ``(K, M3)``, built once per key."""
    return jit_compile("mhc_gemm_fn_split", key, build_mhc_gemm_fn_split(*key))


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_with_sqrsum_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_gemm_with_sqrsum_forward_key`), built once per key."""
    return jit_compile("mhc_gemm_with_sqrsum_forward", key, build_mhc_gemm_with_sqrsum_forward_main(*key))


def mhc_gemm_with_sqrsum_forward_ctas_per_split(num_tokens: int, n_splits: int, num_sms: int) -> int:
    """CTAs per split ``C`` of the resident forward schedule: as many as one wave of ``num_sms`` CTAs
    allows, at most one per 64-token tile, at least one."""
    return max(1, min(num_sms // n_splits, -(-num_tokens // _FWD_BLOCK_T)))


def mhc_gemm_with_sqrsum_forward(
    x: torch.Tensor, fn: torch.Tensor, n_splits: int, out_mul_part: torch.Tensor, sqrsum_part: torch.Tensor
) -> None:
    """Launches the split-K pre-norm GEMM forward on the current stream (inputs validated upstream):
    the key's schedule, resident (one kernel on ``fn`` itself, ``S * C`` CTAs, ``C = min(SMs // S,
    tiles)``) or streaming (the ``fn`` preparation into a ``(2 M3, K)`` bf16 workspace, allocated with
    torch on the current stream, then the main kernel).

    Args:
        x: ``(T, K)`` bf16 (the residual ``(T, m, H)`` viewed flat), ``T > 0``, ``K % 64 == 0``.
        fn: ``(M3, K)`` f32 (rounded to TF32 here; idempotent on pre-rounded input).
        n_splits: ``S >= 1``.
        out_mul_part: ``(S, T, M3)`` f32, written.
        sqrsum_part: ``(S, T)`` f32, written.
    """
    key = mhc_gemm_with_sqrsum_forward_key(x, fn, n_splits)
    cols, rows = key[0], key[1]
    x2 = x.view(x.shape[0], -1)
    if key[4]:  # resident schedule: fn itself, the CTAs per split (one wave)
        ctas = mhc_gemm_with_sqrsum_forward_ctas_per_split(x.shape[0], key[2], config.num_sms(x.device.index))
        get_mhc_gemm_with_sqrsum_forward_kernel(*key)(x2, fn, out_mul_part, sqrsum_part, ctas)
        return
    fhl = torch.empty((2 * rows, cols), dtype=torch.bfloat16, device=fn.device)
    get_mhc_gemm_fn_split_kernel(cols, rows)(fn, fhl)
    get_mhc_gemm_with_sqrsum_forward_kernel(*key)(x2, fhl, out_mul_part, sqrsum_part)


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------


def mhc_gemm_with_sqrsum_backward_partials(cols: int) -> int:
    """Number ``P`` of token partitions of the backward at ``K = cols`` (1: no second pass).

    NOTE tuned for H200: ``K / 64`` column CTAs times ``P`` is at least ~8 CTAs per SM (3 resident),
    so the tail of the last wave is short: ``P = 3`` at K = 28672, 14 at K = 5120.
    """
    return max(1, min(_BWD_MAX_PARTIALS, -(-_BWD_TARGET_CTAS // (cols // _BLOCK_K))))


def mhc_gemm_with_sqrsum_backward_key(x: torch.Tensor, fn: torch.Tensor) -> tuple:
    """Compile-time key ``(K, M3, P)`` (never the token count)."""
    rows, cols = (int(s) for s in fn.shape)
    _check("mhc_gemm_with_sqrsum_backward", rows, cols)
    return (cols, rows, mhc_gemm_with_sqrsum_backward_partials(cols))


def build_mhc_gemm_with_sqrsum_backward(cols: int, rows: int, num_partials: int):
    """Builds the backward main kernel.

    Args:
        cols: ``K`` (multiple of 64).
        rows: ``M3``.
        num_partials: ``P``; with ``P == 1`` the kernel writes ``fn_grad`` directly.

    Returns:
        ``T.prim_func(out_mul_grad (T, M3) f32, sqrsum_grad (T,) f32, x (T, K) bf16, fn (M3, K) f32,
        x_grad (T, K) bf16, fn_grad_part (P, M3, K) f32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    K, M3, P = cols, rows, num_partials
    threads = _BWD_THREADS
    nwarps = threads // 32
    tt = nwarps * _BWD_UNROLL  # tokens per CTA iteration
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_cuda(
        out_mul_grad: T.Tensor((num_tokens, M3), f32),
        sqrsum_grad: T.Tensor((num_tokens,), f32),
        x: T.Tensor((num_tokens, K), bf16),
        fn: T.Tensor((M3, K), f32),
        x_grad: T.Tensor((num_tokens, K), bf16),
        fn_grad_part: T.Tensor((P, M3, K), f32),
    ):
        with T.Kernel(K // _BLOCK_K, P, threads=threads) as (cb, p):
            # NOTE: 48 fp32 registers of fn + 48 of fn_grad partials + 24 of g per lane (~150 in
            # all) -> 3 CTAs of 4 warps per SM; the warp-partial exchange uses 24 KiB of shared memory.
            T.annotate_min_blocks_per_sm(3)
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            fr = T.alloc_local((M3, 2), f32)
            acc = T.alloc_local((M3, 2), f32)
            g = T.alloc_local((M3,), f32)
            xr = T.alloc_local((_BWD_UNROLL, 2), bf16)
            xgr = T.alloc_local((_BWD_UNROLL, 2), bf16)
            dx = T.alloc_local((2,), f32)
            sg = T.alloc_local((1,), f32)
            g_s = T.alloc_shared((tt, M3), f32)
            sg_s = T.alloc_shared((tt,), f32)
            red = T.alloc_shared((nwarps, M3, _BLOCK_K), f32)
            for j in T.unroll(M3):
                for c in T.vectorized(2):
                    fr[j, c] = fn[j, cb * _BLOCK_K + lane * 2 + c]
                for c in T.unroll(2):
                    acc[j, c] = 0.0
            per = T.ceildiv(num_tokens, P)
            t_begin = T.min(per * p, num_tokens)
            t_end = T.min(per * p + per, num_tokens)
            for it in T.serial(T.ceildiv(t_end - t_begin, tt)):
                # Stage the g / sg rows of the tt tokens (cooperative, 16-byte loads) and issue every
                # x / x_grad load of the warp's _BWD_UNROLL tokens before the barrier, so that they
                # are all in flight together.
                for e in T.unroll(-(-(tt * M3 // 4) // threads)):
                    if (e * threads + tid < tt * M3 // 4) and (t_begin + it * tt + (e * threads + tid) // (M3 // 4) < t_end):
                        for c in T.vectorized(4):
                            g_s[(e * threads + tid) // (M3 // 4), ((e * threads + tid) % (M3 // 4)) * 4 + c] = out_mul_grad[
                                t_begin + it * tt + (e * threads + tid) // (M3 // 4), ((e * threads + tid) % (M3 // 4)) * 4 + c
                            ]
                if tid < tt:
                    if t_begin + it * tt + tid < t_end:
                        sg_s[tid] = sqrsum_grad[t_begin + it * tt + tid]
                for u in T.unroll(_BWD_UNROLL):
                    if t_begin + it * tt + wid * _BWD_UNROLL + u < t_end:
                        for c in T.vectorized(2):
                            xr[u, c] = x[t_begin + it * tt + wid * _BWD_UNROLL + u, cb * _BLOCK_K + lane * 2 + c]
                        for c in T.vectorized(2):
                            xgr[u, c] = x_grad[t_begin + it * tt + wid * _BWD_UNROLL + u, cb * _BLOCK_K + lane * 2 + c]
                T.sync_threads()
                for u in T.unroll(_BWD_UNROLL):
                    if t_begin + it * tt + wid * _BWD_UNROLL + u < t_end:
                        for j in T.vectorized(M3):
                            g[j] = g_s[wid * _BWD_UNROLL + u, j]
                        sg[0] = sg_s[wid * _BWD_UNROLL + u]
                        for c in T.unroll(2):
                            dx[c] = g[0] * fr[0, c]
                            for j in T.unroll(1, M3):
                                dx[c] += g[j] * fr[j, c]
                            dx[c] = T.cast(xgr[u, c], f32) + dx[c]
                            dx[c] = dx[c] + 2.0 * T.cast(xr[u, c], f32) * sg[0]
                        for c in T.vectorized(2):
                            x_grad[t_begin + it * tt + wid * _BWD_UNROLL + u, cb * _BLOCK_K + lane * 2 + c] = T.cast(dx[c], bf16)
                        for j in T.unroll(M3):
                            for c in T.unroll(2):
                                acc[j, c] += g[j] * T.cast(xr[u, c], f32)
                T.sync_threads()
            for j in T.unroll(M3):
                for c in T.vectorized(2):
                    red[wid, j, lane * 2 + c] = acc[j, c]
            T.sync_threads()
            # Warp partials summed in ascending warp order; thread tid owns elements tid, tid + 128, ...
            for e in T.unroll(M3 * _BLOCK_K // threads):
                sg[0] = red[0, (e * threads + tid) // _BLOCK_K, (e * threads + tid) % _BLOCK_K]
                for w in T.unroll(1, nwarps):
                    sg[0] += red[w, (e * threads + tid) // _BLOCK_K, (e * threads + tid) % _BLOCK_K]
                fn_grad_part[p, (e * threads + tid) // _BLOCK_K, cb * _BLOCK_K + (e * threads + tid) % _BLOCK_K] = sg[0]

    return mhc_gemm_with_sqrsum_backward_cuda


def build_mhc_gemm_with_sqrsum_backward_reduce(cols: int, rows: int, num_partials: int):
    """Builds the fixed-order partial reduction ``fn_grad[j, k] = sum_{p=0..P-1} part[p, j, k]``.

    Returns:
        ``T.prim_func(fn_grad_part (P, M3, K) f32, fn_grad (M3, K) f32)``.
    """
    from tilelang import language as T

    K, M3, P = cols, rows, num_partials
    threads = _RED_THREADS
    nq = M3 * K // 4
    f32 = T.float32

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_reduce_cuda(fn_grad_part: T.Tensor((P, M3 * K), f32), fn_grad: T.Tensor((M3 * K,), f32)):
        # NOTE: one float4 per thread, all P partial loads issued before the ascending-p sum.
        with T.Kernel(T.ceildiv(nq, threads), threads=threads) as bx:
            tid = T.get_thread_binding()
            v = T.alloc_local((P, 4), f32)
            a = T.alloc_local((4,), f32)
            if bx * threads + tid < nq:
                for pp in T.unroll(P):
                    for k in T.vectorized(4):
                        v[pp, k] = fn_grad_part[pp, (bx * threads + tid) * 4 + k]
                for k in T.unroll(4):
                    a[k] = v[0, k]
                    for pp in T.unroll(1, P):
                        a[k] += v[pp, k]
                for k in T.vectorized(4):
                    fn_grad[(bx * threads + tid) * 4 + k] = a[k]

    return mhc_gemm_with_sqrsum_backward_reduce_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_with_sqrsum_backward_kernel(*key):
    """Compiled main kernel for ``key`` (see :func:`mhc_gemm_with_sqrsum_backward_key`), built once per key."""
    return jit_compile("mhc_gemm_with_sqrsum_backward", key, build_mhc_gemm_with_sqrsum_backward(*key))


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_with_sqrsum_backward_reduce_kernel(*key):
    """Compiled partial reduction for ``key`` (see :func:`mhc_gemm_with_sqrsum_backward_key`)."""
    return jit_compile("mhc_gemm_with_sqrsum_backward_reduce", key, build_mhc_gemm_with_sqrsum_backward_reduce(*key))


def mhc_gemm_with_sqrsum_backward(
    out_mul_grad: torch.Tensor,
    sqrsum_grad: torch.Tensor,
    x: torch.Tensor,
    fn: torch.Tensor,
    x_grad: torch.Tensor,
    fn_grad: torch.Tensor,
) -> None:
    """Launches the pre-norm GEMM backward on the current stream (inputs validated upstream).

    Args:
        out_mul_grad: ``(T, M3)`` f32 (a ``(T, 1, M3)`` view is accepted), ``T > 0``.
        sqrsum_grad: ``(T,)`` f32 (``(T, 1)`` accepted).
        x: ``(T, K)`` bf16 (the saved residual viewed flat).
        fn: ``(M3, K)`` f32 (the saved, TF32-rounded projection).
        x_grad: ``(T, K)`` bf16, accumulated in place (bf16 read-modify-write).
        fn_grad: ``(M3, K)`` f32, overwritten (the op's new output). With ``P > 1`` partitions the
            launcher allocates the ``(P, M3, K)`` f32 partials with torch on the current stream.
    """
    key = mhc_gemm_with_sqrsum_backward_key(x, fn)
    cols, rows, num_partials = key
    n = x.shape[0]
    args = (out_mul_grad.reshape(n, rows), sqrsum_grad.reshape(n), x.view(n, cols), fn, x_grad.view(n, cols))
    if num_partials == 1:
        get_mhc_gemm_with_sqrsum_backward_kernel(*key)(*args, fn_grad.view(1, rows, cols))
        return
    part = torch.empty((num_partials, rows, cols), dtype=torch.float32, device=fn.device)
    get_mhc_gemm_with_sqrsum_backward_kernel(*key)(*args, part)
    get_mhc_gemm_with_sqrsum_backward_reduce_kernel(*key)(part.view(num_partials, rows * cols), fn_grad.view(-1))


# ----------------------------------------------------------------------------------------------------


def gemm_lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every GEMM kernel variant at ``hidden_size`` (``K = m * H``, ``M3 = m(m+2)``), un-compiled.

    Case names (forward schedules as on the H200's 132 SMs): ``gemm_fwd_s16`` (CUDA default split count;
    resident up to H = 5632, streaming at 7168), ``gemm_fwd_s1`` (streaming), ``gemm_fwd_s7`` (uneven
    splits: resident at H = 1280, else streaming), ``gemm_fwd_s80`` (many splits, streaming; one block per
    split at H = 1280), ``gemm_bwd`` (at this K's partition count ``P``) and, where ``P > 1``, ``gemm_bwd_reduce``.

    Returns:
        ``{case name: T.prim_func}``.
    """
    K, m3 = hc_mult * hidden_size, hc_mult * (hc_mult + 2)
    P = mhc_gemm_with_sqrsum_backward_partials(K)
    cases = {
        "gemm_fn_split": build_mhc_gemm_fn_split(K, m3),
        "gemm_fwd_s16": build_mhc_gemm_with_sqrsum_forward_main(*_fwd_key(K, m3, 16, _H200_SMS)),
        "gemm_fwd_s1": build_mhc_gemm_with_sqrsum_forward_main(*_fwd_key(K, m3, 1, _H200_SMS)),
        "gemm_fwd_s7": build_mhc_gemm_with_sqrsum_forward_main(*_fwd_key(K, m3, 7, _H200_SMS)),
        "gemm_fwd_s80": build_mhc_gemm_with_sqrsum_forward_main(*_fwd_key(K, m3, 80, _H200_SMS)),
        "gemm_bwd": build_mhc_gemm_with_sqrsum_backward(K, m3, P),
    }
    if P > 1:
        cases["gemm_bwd_reduce"] = build_mhc_gemm_with_sqrsum_backward_reduce(K, m3, P)
    return cases


lowering_cases = gemm_lowering_cases
