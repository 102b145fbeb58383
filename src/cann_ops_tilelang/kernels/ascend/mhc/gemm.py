"""Ascend 950 kernels of the mHC pre-norm GEMM with sum of squares (OPS.md B.2.3 and §C), M3 = 24.

Forward ``mhc_gemm_with_sqrsum_forward(x, fn, n_splits, out_mul_part, sqrsum_part)``::

    out_mul_part[s, t, j] = sum_{k in K_s} f32(x[t, k]) * hf32(fn[j, k])     sqrsum_part[s, t] = sum_{k in K_s} f32(x[t, k])^2

Ascend computes with ONE split internally (OPS.md decision 5, §C.3): split 0 receives the full sums over
``[0, K)`` and splits ``1..S-1`` are written with zeros, so the requested ``(S, T, M3)`` / ``(S, T)``
layout is returned and the split-ordered reduction of ``mhc_reduce_partials_and_rmsnorm_forward`` gives
the full sum exactly (``a + 0 + ... + 0 == a``). It is a mixed Cube/Vector kernel: per 64-token block,
each of the two vector cores of a Cube core widens its 32 x rows of a 256-column K block bf16 -> fp32
(exact), accumulates the sum of squares in fp32 and ships the fp32 tile to L1 (``dual_copy`` UB -> L1,
ND -> NZ); the Cube multiplies it with the fp32 ``fn`` block (GM -> L1, padded to 32 rows) in HF32 mode
(``nearest_even``: fn is rounded to the Cube's reduced-precision fp32, x is exact in it) and
accumulates all K blocks in L0C; the 24 valid columns go straight from L0C to GM.

Backward ``mhc_gemm_with_sqrsum_backward(out_mul_grad, sqrsum_grad, x, fn, x_grad, fn_grad)``::

    x_grad[t, k] = bf16(f32(x_grad[t, k]) + sum_j g[t, j]*fn[j, k] + (2*sg[t])*f32(x[t, k]))
    fn_grad[j, k] = sum_t g[t, j]*f32(x[t, k])

runs on the vector cores: one task per K column tile owns that tile of ``fn_grad`` and sweeps all tokens
in ascending order (fixed partition, fixed order, no atomics -> deterministic); the same sweep updates
``x_grad`` in place (bf16 read-modify-write). ``g`` is used in full fp32 (no TF32 rounding) and fn as
given (the caller saves the rounded fn).

Constraints: ``M3 <= 32`` (tests: 24), ``K % 256 == 0``, ``K <= 65536``.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import functools

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .. import num_vector_cores
from .._build import UB_BUDGET_BYTES

__all__ = [
    "build_mhc_gemm_with_sqrsum_backward",
    "build_mhc_gemm_with_sqrsum_forward",
    "get_mhc_gemm_with_sqrsum_backward_kernel",
    "get_mhc_gemm_with_sqrsum_forward_kernel",
    "mhc_gemm_with_sqrsum_backward",
    "mhc_gemm_with_sqrsum_backward_key",
    "mhc_gemm_with_sqrsum_forward",
    "mhc_gemm_with_sqrsum_forward_key",
    "lowering_cases",
]

_LANES = 64
_AIVS = 2  # vector cores per Cube core on Ascend 950
_N_PAD = 32  # M3 padded to the Cube N granularity (fp32: 16) with room for M3 <= 32
# NOTE forward tiles. Token block BM = 64 (32 rows per vector core), K block BK = 256. UB per vector core
# and stage: x bf16 (32 x 256 x 2 = 16 KiB) + x fp32 (32 KiB); 2 stages = 96 KiB, plus the sum-of-squares
# lanes (32 x 64 x 4 = 8 KiB) and the zero tile: ~108 KiB of 248 KiB. L1 per stage: x (64 x 256 x 4 =
# 64 KiB) + fn (32 x 256 x 4 = 32 KiB); 2 stages = 192 KiB. L0C: 64 x 32 fp32 = 8 KiB.
_BM = 64
_BK = 256
_FWD_STAGES = 2


def _check(mhc_mult3: int, numel: int):
    assert 0 < mhc_mult3 <= _N_PAD, f"M3={mhc_mult3}: the Ascend pre-norm GEMM needs M3 <= 32"
    assert numel % _BK == 0 and 0 < numel <= 65536, f"K={numel}: the Ascend pre-norm GEMM needs K % 256 == 0"


def mhc_gemm_with_sqrsum_forward_key(x, fn, n_splits: int, num_cores: int) -> tuple:
    """(M3, K, n_splits, num_cube_cores); never T. ``num_cores`` is the vector core count."""
    return (int(fn.shape[0]), int(fn.shape[1]), int(n_splits), max(1, int(num_cores) // _AIVS))


def build_mhc_gemm_with_sqrsum_forward(mhc_mult3: int, numel: int, n_splits: int, num_cube_cores: int):
    """prim_func(x (T,K) bf16, fn (M3,K) f32, out_mul_part (S,T,M3) f32, sqrsum_part (S,T) f32).

    Mixed kernel over ``num_cube_cores`` Cube cores (each with its two vector cores); a persistent loop
    over 64-token blocks; tails (T % 64) are guarded by runtime extents on every GM access.
    """
    M3, K, NS = mhc_mult3, numel, n_splits
    _check(M3, K)
    assert NS >= 1
    half = _BM // _AIVS
    k_tiles = K // _BK
    k_chunks = _BK // _LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_gemm_with_sqrsum_forward_asc(
        x: T.Tensor[(num_tokens, K), T.bfloat16],
        fn: T.Tensor[(M3, K), T.float32],
        out_mul_part: T.Tensor[(NS, num_tokens, M3), T.float32],
        sqrsum_part: T.Tensor[(NS, num_tokens), T.float32],
    ):
        with T.MixedKernel(num_cube_cores, sids=_AIVS) as (core_id, sid):
            T.set_hf32_mode("nearest_even")
            x_ub = T.alloc_shared((half, _BK), T.bfloat16)
            xf_ub = T.alloc_shared((half, _BK), T.float32)
            sq_ub = T.alloc_shared((half, _LANES), T.float32)  # 64-lane partial sums of squares per row
            sq_out = T.alloc_shared((half,), T.float32)
            zero_ub = T.alloc_shared((half, _N_PAD), T.float32)
            x_l1 = T.alloc_l1((_BM, _BK), T.float32)
            fn_l1 = T.alloc_l1((_N_PAD, _BK), T.float32)
            acc = T.alloc_l0c((_BM, _N_PAD), T.float32)

            if NS > 1:
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for r in T.serial(half):
                        S.vsts(zero_ub[r, 0], zero, dist="NORM_B32", extent=_N_PAD)

            for (blk,) in T.Persistent([T.ceildiv(num_tokens, _BM)], num_cube_cores, core_id, group_size=1):
                t0 = blk * _BM
                valid = T.min(num_tokens - t0, _BM)
                a0 = t0 + sid * half  # first token of this vector core's half block
                valid_h = T.max(T.min(num_tokens - a0, half), 0)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for r in T.serial(half):
                        S.vsts(sq_ub[r, 0], zero)
                for kt in T.Pipelined(k_tiles, num_stages=_FWD_STAGES):
                    k0 = kt * _BK
                    if valid_h > 0:
                        T.copy(x[a0 : a0 + valid_h, k0 : k0 + _BK], x_ub[0:valid_h, :], l2_cache_ctrl="NOTALLOC_KEEP", pad_value=0)
                    T.copy(fn[0:M3, k0 : k0 + _BK], fn_l1[0:M3, :])
                    with T.SimdVF():
                        sq = S.alloc_local((1,), T.float32)
                        for r in T.serial(half):
                            sq[0] = S.vld(sq_ub[r, 0])
                            for c in T.unroll(k_chunks, explicit=True):
                                xf = S.vcvt(S.vld(x_ub[r, c * _LANES], dist="UNPK_B16"), T.float32, part=0)
                                S.vsts(xf_ub[r, c * _LANES], xf)
                                S.vmula(sq[0], xf, xf)
                            S.vsts(sq_ub[r, 0], sq[0])
                    T.dual_copy(xf_ub, x_l1)
                    T.gemm(x_l1, fn_l1, acc, transpose_B=True, clear_accum=(kt == 0), unit_flag_ctrl=T.Select(kt == k_tiles - 1, 3, 2))
                T.copy(acc[0:valid, 0:M3], out_mul_part[0, t0 : t0 + valid, :], unit_flag_ctrl=3)
                with T.SimdVF():
                    for r in T.serial(half):
                        S.vsts(sq_out[r], S.vcadd(S.vld(sq_ub[r, 0])), dist="ONEPT_B32")
                if valid_h > 0:
                    T.copy(sq_out[0:valid_h], sqrsum_part[0, a0 : a0 + valid_h])
                    for s in T.serial(1, NS):
                        T.copy(zero_ub[0:valid_h, 0:M3], out_mul_part[s, a0 : a0 + valid_h, :])
                        T.copy(zero_ub[0, 0:valid_h], sqrsum_part[s, a0 : a0 + valid_h])

    return mhc_gemm_with_sqrsum_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_with_sqrsum_forward_kernel(mhc_mult3: int, numel: int, n_splits: int, num_cube_cores: int):
    from .._build import jit_compile

    key = (mhc_mult3, numel, n_splits, num_cube_cores)
    return jit_compile("mhc_gemm_with_sqrsum_forward", key, build_mhc_gemm_with_sqrsum_forward(*key))


def mhc_gemm_with_sqrsum_forward(x, fn, n_splits, out_mul_part, sqrsum_part) -> None:
    """x (T,K) bf16, fn (M3,K) f32, n_splits S -> out_mul_part (S,T,M3) f32, sqrsum_part (S,T) f32
    (both overwritten; full sums in split 0, zeros in splits 1..S-1). Current stream, no sync."""
    key = mhc_gemm_with_sqrsum_forward_key(x, fn, n_splits, num_vector_cores())
    kernel = get_mhc_gemm_with_sqrsum_forward_kernel(*key)
    kernel(x, fn, out_mul_part, sqrsum_part)


# ---------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------
# NOTE backward tiles. Column tile W (the largest of 256/128/64 that still gives every vector core a
# tile), token block BT = 32. Resident per task: fn tile + fn_grad accumulator (2 x M3 x W x 4 = 48 KiB
# at W = 256). Per stage: x and x_grad tiles (2 x 32 x W x 2 = 32 KiB) + g rows (32 x 32 x 4 = 4 KiB) +
# sg (128 B); 2 stages = 72 KiB. Total ~124 KiB of 248 KiB.
_BWD_WIDTHS = (256, 128, 64)
_BT = 32
_BWD_STAGES = 2


def _bwd_width(numel: int, num_cores: int) -> int:
    for w in _BWD_WIDTHS:
        if numel % w == 0 and numel // w >= num_cores:
            return w
    return _BWD_WIDTHS[-1]


def mhc_gemm_with_sqrsum_backward_key(fn, num_cores: int) -> tuple:
    """(M3, K, num_cores); never T."""
    return (int(fn.shape[0]), int(fn.shape[1]), int(num_cores))


def build_mhc_gemm_with_sqrsum_backward(mhc_mult3: int, numel: int, num_cores: int):
    """prim_func(out_mul_grad (T,M3) f32, sqrsum_grad (T,) f32, x (T,K) bf16, fn (M3,K) f32,
    x_grad (T,K) bf16 in/out, fn_grad (M3,K) f32 out).

    Per token and 64-column chunk: ``r = f32(x_grad)``, ``r += g_j*fn_j`` for j ascending, ``r += (2*sg)*x``
    (fused multiply-adds), one bf16 rounding; ``fn_grad_j += g_j*x`` with the chunk's M3 accumulators in
    registers across the 32 tokens of a block and in UB across blocks (tokens ascending).
    """
    M3, K = mhc_mult3, numel
    _check(M3, K)
    W = _bwd_width(K, num_cores)
    n_ct = K // W
    w_chunks = W // _LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_asc(
        out_mul_grad: T.Tensor[(num_tokens, M3), T.float32],
        sqrsum_grad: T.Tensor[(num_tokens,), T.float32],
        x: T.Tensor[(num_tokens, K), T.bfloat16],
        fn: T.Tensor[(M3, K), T.float32],
        x_grad: T.Tensor[(num_tokens, K), T.bfloat16],
        fn_grad: T.Tensor[(M3, K), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            fn_ub = T.alloc_shared((M3, W), T.float32)
            fg_ub = T.alloc_shared((M3, W), T.float32)
            x_ub = T.alloc_shared((_BT, W), T.bfloat16)
            xg_ub = T.alloc_shared((_BT, W), T.bfloat16)
            g_ub = T.alloc_shared((_BT, _N_PAD), T.float32)
            sg_ub = T.alloc_shared((_BT,), T.float32)
            T.annotate_buffer_versions({x_ub: _BWD_STAGES, xg_ub: _BWD_STAGES, g_ub: _BWD_STAGES, sg_ub: _BWD_STAGES})
            for (ct,) in T.Persistent([n_ct], num_cores, core_id, group_size=1):
                c0 = ct * W
                T.copy(fn[:, c0 : c0 + W], fn_ub)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for j in T.serial(M3):
                        for c in T.unroll(w_chunks, explicit=True):
                            S.vsts(fg_ub[j, c * _LANES], zero)
                for tb in T.Pipelined(T.ceildiv(num_tokens, _BT), num_stages=_BWD_STAGES):
                    t0 = tb * _BT
                    n_rows = T.min(num_tokens - t0, _BT)
                    T.copy(out_mul_grad[t0 : t0 + n_rows, :], g_ub[0:n_rows, 0:M3])
                    T.copy(sqrsum_grad[t0 : t0 + n_rows], sg_ub[0:n_rows])
                    T.copy(x[t0 : t0 + n_rows, c0 : c0 + W], x_ub[0:n_rows, :])
                    T.copy(x_grad[t0 : t0 + n_rows, c0 : c0 + W], xg_ub[0:n_rows, :])
                    with T.SimdVF():
                        fg = S.alloc_local((M3,), T.float32)
                        r = S.alloc_local((1,), T.float32)
                        for c in T.unroll(w_chunks, explicit=True):
                            d = c * _LANES
                            for j in T.unroll(M3, explicit=True):
                                fg[j] = S.vld(fg_ub[j, d])
                            for row in T.serial(n_rows):
                                xf = S.vcvt(S.vld(x_ub[row, d], dist="UNPK_B16"), T.float32, part=0)
                                r[0] = S.vcvt(S.vld(xg_ub[row, d], dist="UNPK_B16"), T.float32, part=0)
                                for j in T.unroll(M3, explicit=True):
                                    gj = S.vld(g_ub[row, j], dist="BRC_B32")
                                    S.vmula(r[0], gj, S.vld(fn_ub[j, d]))
                                    S.vmula(fg[j], gj, xf)
                                sg2 = S.vmuls(S.vld(sg_ub[row], dist="BRC_B32"), 2.0)
                                S.vmula(r[0], sg2, xf)
                                S.vsts(xg_ub[row, d], S.vcvt(r[0], T.bfloat16), dist="PK_B32")
                            for j in T.unroll(M3, explicit=True):
                                S.vsts(fg_ub[j, d], fg[j])
                    T.copy(xg_ub[0:n_rows, :], x_grad[t0 : t0 + n_rows, c0 : c0 + W])
                T.copy(fg_ub, fn_grad[:, c0 : c0 + W])

    return mhc_gemm_with_sqrsum_backward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_gemm_with_sqrsum_backward_kernel(mhc_mult3: int, numel: int, num_cores: int):
    from .._build import jit_compile

    key = (mhc_mult3, numel, num_cores)
    return jit_compile("mhc_gemm_with_sqrsum_backward", key, build_mhc_gemm_with_sqrsum_backward(*key))


def mhc_gemm_with_sqrsum_backward(out_mul_grad, sqrsum_grad, x, fn, x_grad, fn_grad) -> None:
    """out_mul_grad (T,M3) f32 (or (T,1,M3)), sqrsum_grad (T,) f32 (or (T,1)), x (T,K) bf16, fn (M3,K) f32;
    x_grad (T,K) bf16 accumulated in place; fn_grad (M3,K) f32 (new, overwritten). Current stream."""
    key = mhc_gemm_with_sqrsum_backward_key(fn, num_vector_cores())
    kernel = get_mhc_gemm_with_sqrsum_backward_kernel(*key)
    n = x.shape[0]
    kernel(out_mul_grad.reshape(n, -1), sqrsum_grad.reshape(n), x, fn, x_grad, fn_grad)


# ---------------------------------------------------------------------------------------------------
# lowering cases
# ---------------------------------------------------------------------------------------------------
_CASE_NUM_CORES = 64  # vector cores (32 Cube cores) for CPU lowering checks only
_CASE_MHC_MULT3 = 24


def lowering_cases(hidden_size: int, hc_mult: int = 4, num_cores: int = _CASE_NUM_CORES) -> dict:
    """Every kernel variant at ``hidden_size`` (K = m*H) -> prim_func. n_splits only changes the zero
    stores, so S = 1 and S = 16 cover the forward."""
    K = hc_mult * hidden_size
    ncube = max(1, num_cores // _AIVS)
    return {
        "mhc_gemm_with_sqrsum_forward_s1": build_mhc_gemm_with_sqrsum_forward(_CASE_MHC_MULT3, K, 1, ncube),
        "mhc_gemm_with_sqrsum_forward_s16": build_mhc_gemm_with_sqrsum_forward(_CASE_MHC_MULT3, K, 16, ncube),
        "mhc_gemm_with_sqrsum_backward": build_mhc_gemm_with_sqrsum_backward(_CASE_MHC_MULT3, K, num_cores),
    }
