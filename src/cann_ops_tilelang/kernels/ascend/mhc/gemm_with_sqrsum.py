"""Ascend 950 kernels of the mHC pre-norm GEMM with sum of squares (docs/ops/mhc.md#gemm_with_sqrsum).

Forward ``mhc_gemm_with_sqrsum_forward(x, fn, n_splits, out_mul_part, sqrsum_part)``::

    out_mul_part[s, t, j] = sum_{k in K_s} f32(x[t, k]) * hf32(fn[j, k])     sqrsum_part[s, t] = sum_{k in K_s} f32(x[t, k])^2

Backward ``mhc_gemm_with_sqrsum_backward(grad_out_mul, grad_sqrsum, x, fn, grad_x, grad_fn)``::

    grad_x[t, k] = bf16(f32(grad_x[t, k]) + sum_j g[t, j]*fn[j, k] + (2*sg[t])*f32(x[t, k]))
    grad_fn[j, k] = sum_t g[t, j]*f32(x[t, k])

Both products of the backward run on the Cube unit in plain fp32 (see ``build_mhc_gemm_with_sqrsum_backward``).

Constraints: ``M3 <= 32`` (the ops: 24), ``K = m*H`` a multiple of 256 in the declared range.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import chips, limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._common import CASE_MHC_MULT3, CASE_NUM_CORES, LANES, require_mixes, require_width


_AIVS = 2  # vector cores per Cube core on Ascend 950
_N_PAD = 32  # M3 padded to the Cube N granularity (fp32: 16) with room for M3 <= 32


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """Token block ``block_m`` (half per vector core), K block ``block_k``, ``stages`` of the K pipeline."""

    block_m: int = 64
    block_k: int = 256
    stages: int = 2


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """Cube backward: column tile W from ``widths`` (see :meth:`width`), token block ``block_t`` (half per
    vector core), ``stages`` versions of every per-block UB / L1 / L0A / L0C tile (and of the x tile in L0B
    where two fit beside the resident fn tile)."""

    widths: tuple[int, ...] = (256, 128, 64)
    block_t: int = 32
    stages: int = 2

    def width(self, numel: int, num_cube_cores: int) -> int:
        """The W of ``widths`` dividing K with the shortest critical path (``ceil(K/W / cores) * W``
        columns on the busiest Cube core), the widest on a tie (longer DMA bursts, fewer tiles)."""
        fits = [w for w in self.widths if numel % w == 0]
        return min(fits, key=lambda w: (-(-(numel // w) // num_cube_cores) * w, -w))

    def x_l0b_versions(self, width: int, l0b_bytes: int) -> int:
        """Versions of the (block_t, W) fp32 x tile in L0B beside the resident (32, W) fp32 fn tile."""
        x_tile, fn_tile = self.block_t * width * 4, _N_PAD * width * 4
        return self.stages if self.stages * x_tile + fn_tile <= l0b_bytes else 1

    def budget(self, width: int, l0b_bytes: int) -> dict[str, int]:
        """Bytes per buffer scope at column tile ``width`` as the kernel allocates them (UB: per vector
        core); the lowering's merged pools equal these (tests/mhc/test_mhc_gemm_with_sqrsum.py)."""
        W, BT, st = width, self.block_t, self.stages
        half = BT // _AIVS
        return {
            # per block: x fp32 + the Cube's g @ fn rows fp32 (stages); x bf16, grad_x bf16, sg (one version:
            # loaded under the tail guard); the UB -> L1 ND -> NZ staging rows (half + 1); the T = 0 zero row
            "ub": st * half * W * (4 + 4) + half * W * (2 + 2) + half * 4 + (half + 1) * W * 4 + W * 4,
            # per block: x fp32 and g (padded to 32 columns); the fn tile resident
            "l1": st * (BT * W * 4 + BT * _N_PAD * 4) + _N_PAD * W * 4,
            # per block: g and g^T
            "l0a": st * 2 * BT * _N_PAD * 4,
            # per block: x; the fn tile resident
            "l0b": self.x_l0b_versions(W, l0b_bytes) * BT * W * 4 + _N_PAD * W * 4,
            # the grad_fn accumulator resident; per block: g @ fn
            "l0c": _N_PAD * W * 4 + st * BT * W * 4,
        }


# Forward ~108 KiB of UB and 192 KiB of L1 (docs/perf/ascend950/mhc.md, 2026-11-30 — gemm_with_sqrsum: tiles).
FORWARD_PLAN = ForwardPlan()
# NOTE: BT = 32 keeps a (32, W) fp32 x tile at 32 KiB of L0B beside the resident fn tile at W = 256, and two
# stages overlap the AIVs' x loads / grad_x stores with the Cube; W by the critical path, since every Cube
# core sweeps all T tokens of its tiles (2026-12-03 — gemm_with_sqrsum: backward on the Cube (issue 27)).
BACKWARD_PLAN = BackwardPlan()


def _check(where: str, mhc_mult3: int, numel: int) -> tuple[int, int]:
    return require_mixes(where, mhc_mult3, _N_PAD), require_width(where, numel, FORWARD_PLAN.block_k)


@compile_key
class ForwardKey:
    """Compile-time key of the forward: ``(M3, K)``, ``S = n_splits`` and the Cube cores (never T)."""

    mhc_mult3: int
    numel: int
    n_splits: int
    num_cube_cores: int


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``(M3, K)`` and the vector cores (never T)."""

    mhc_mult3: int
    numel: int
    num_cores: int


def _forward_key(x, fn, n_splits: int) -> ForwardKey:
    """The launch's Cube cores: its vector cores over the two of a Cube core's group."""
    return ForwardKey(int(fn.shape[0]), int(fn.shape[1]), int(n_splits), max(1, int(num_vector_cores()) // _AIVS))


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    """n_splits only changes the zero stores, so S = 1 and S = 16 cover the forward (K = m*H)."""
    ncube = max(1, CASE_NUM_CORES // _AIVS)
    return {f"mhc_gemm_with_sqrsum_forward_s{s}": ForwardKey(CASE_MHC_MULT3, hc_mult * hidden_size, s, ncube)
            for s in (1, 16)}


def build_mhc_gemm_with_sqrsum_forward(mhc_mult3: int, numel: int, n_splits: int, num_cube_cores: int):
    """prim_func(x (T,K) bf16, fn (M3,K) f32, out_mul_part (S,T,M3) f32, sqrsum_part (S,T) f32).

    Computed with ONE split (docs/ops/mhc.md#gemm_with_sqrsum): split 0 receives the full sums over
    ``[0, K)`` and splits ``1..S-1`` are written with zeros, so the split-ordered reduction of
    ``mhc_reduce_partials_and_rmsnorm_forward`` gives the full sum exactly (``a + 0 + ... + 0 == a``).
    Mixed Cube/Vector kernel over ``num_cube_cores`` Cube cores, a persistent loop over 64-token blocks
    (tails guarded by runtime extents on every GM access): each of the two vector cores of a Cube core
    widens its 32 x rows of a 256-column K block bf16 -> fp32 (exact), accumulates the sum of squares in
    fp32 and ships the fp32 tile to L1 (``dual_copy`` UB -> L1, ND -> NZ); the Cube multiplies it with the
    fp32 ``fn`` block (GM -> L1, padded to 32 rows) in HF32 mode (``nearest_even``: fn is rounded to the
    Cube's reduced-precision fp32, x is exact in it) and accumulates all K blocks in L0C; the 24 valid
    columns go straight from L0C to GM.
    """
    where = "mhc_gemm_with_sqrsum_forward"
    M3, K = _check(where, mhc_mult3, numel)
    NS = limits.mhc_gemm_splits(K).require(where, int(n_splits))
    BM, BK, stages = FORWARD_PLAN.block_m, FORWARD_PLAN.block_k, FORWARD_PLAN.stages
    half = BM // _AIVS
    k_tiles = K // BK
    k_chunks = BK // LANES
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
            x_ub = T.alloc_shared((half, BK), T.bfloat16)
            xf_ub = T.alloc_shared((half, BK), T.float32)
            sq_ub = T.alloc_shared((half, LANES), T.float32)  # 64-lane partial sums of squares per row
            sq_out = T.alloc_shared((half,), T.float32)
            zero_ub = T.alloc_shared((half, _N_PAD), T.float32)
            x_l1 = T.alloc_l1((BM, BK), T.float32)
            fn_l1 = T.alloc_l1((_N_PAD, BK), T.float32)
            acc = T.alloc_l0c((BM, _N_PAD), T.float32)

            if NS > 1:
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for r in T.serial(half):
                        S.vsts(zero_ub[r, 0], zero, dist="NORM_B32", extent=_N_PAD)

            for (blk,) in T.Persistent([T.ceildiv(num_tokens, BM)], num_cube_cores, core_id, group_size=1):
                t0 = blk * BM
                valid = T.min(num_tokens - t0, BM)
                a0 = t0 + sid * half  # first token of this vector core's half block
                valid_h = T.max(T.min(num_tokens - a0, half), 0)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for r in T.serial(half):
                        S.vsts(sq_ub[r, 0], zero)
                for kt in T.Pipelined(k_tiles, num_stages=stages):
                    k0 = kt * BK
                    if valid_h > 0:
                        T.copy(x[a0 : a0 + valid_h, k0 : k0 + BK], x_ub[0:valid_h, :], l2_cache_ctrl="NOTALLOC_KEEP", pad_value=0)
                    T.copy(fn[0:M3, k0 : k0 + BK], fn_l1[0:M3, :])
                    with T.SimdVF():
                        sq = S.alloc_local((1,), T.float32)
                        for r in T.serial(half):
                            sq[0] = S.vld(sq_ub[r, 0])
                            for c in T.unroll(k_chunks, explicit=True):
                                xf = S.vcvt(S.vld(x_ub[r, c * LANES], dist="UNPK_B16"), T.float32, part=0)
                                S.vsts(xf_ub[r, c * LANES], xf)
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


FORWARD = Kernel("mhc_gemm_with_sqrsum_forward", ForwardKey, build_mhc_gemm_with_sqrsum_forward, derive=_forward_key,
                 cases=_forward_cases)


def mhc_gemm_with_sqrsum_forward(x, fn, n_splits, out_mul_part, sqrsum_part) -> None:
    """x (T,K) bf16, fn (M3,K) f32, n_splits S -> out_mul_part (S,T,M3) f32, sqrsum_part (S,T) f32
    (both overwritten; full sums in split 0, zeros in splits 1..S-1). Current stream, no sync."""
    kernel = FORWARD.compiled(FORWARD.key(x, fn, n_splits))
    kernel(x, fn, out_mul_part, sqrsum_part)


def build_mhc_gemm_with_sqrsum_backward(mhc_mult3: int, numel: int, num_cores: int):
    """prim_func(grad_out_mul (T,M3) f32, grad_sqrsum (T,) f32, x (T,K) bf16, fn (M3,K) f32,
    grad_x (T,K) bf16 in/out, grad_fn (M3,K) f32 out).

    Mixed Cube/Vector kernel over ``num_cores // 2`` Cube cores; both products on the Cube in plain fp32
    (HF32 off: ``g`` and ``fn`` enter unrounded, so there is no TF32 error on g near zero and no hi/lo split;
    x is exact in fp32). Each Cube core owns W-column tiles (``T.Persistent``) and sweeps all token blocks
    of BT rows in ascending order (tails guarded by runtime extents). Per block the two vector cores widen
    their BT/2 x rows to fp32 (tail rows zero) and ship them to L1 (``dual_copy`` UB -> L1); the Cube loads
    the g block (zero-padded to 32 columns and BT rows by the GM -> L1 copy) and runs
    ``acc_fg (32, W) += g^T @ x`` (K = BT, transposed L1 -> L0 loads; L0C-resident across blocks: fixed
    partition, fixed order, no atomics: deterministic) and ``acc_xg (BT, W) = g @ fn`` (K = 32, fn tile
    resident in L0B, pad rows zero); ``acc_xg`` goes to UB (``dual_copy`` L0C -> UB, M-split) where each
    vector core computes ``bf16((f32(grad_x) + acc_xg) + (2*sg)*x)`` (one rounding) and stores its rows.
    ``grad_fn`` leaves L0C once per tile; with T = 0 the vector cores store zeros instead.
    """
    where = "mhc_gemm_with_sqrsum_backward"
    M3, K = _check(where, mhc_mult3, numel)
    ncube = max(1, int(num_cores) // _AIVS)
    plan = BACKWARD_PLAN
    W = plan.width(K, ncube)
    BT, stages = plan.block_t, plan.stages
    half = BT // _AIVS
    x_l0b_versions = plan.x_l0b_versions(W, chips.ASCEND_950.l0b_bytes)
    n_ct = K // W
    w_chunks = W // LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_gemm_with_sqrsum_backward_asc(
        grad_out_mul: T.Tensor[(num_tokens, M3), T.float32],
        grad_sqrsum: T.Tensor[(num_tokens,), T.float32],
        x: T.Tensor[(num_tokens, K), T.bfloat16],
        fn: T.Tensor[(M3, K), T.float32],
        grad_x: T.Tensor[(num_tokens, K), T.bfloat16],
        grad_fn: T.Tensor[(M3, K), T.float32],
    ):
        with T.MixedKernel(ncube, sids=_AIVS) as (core_id, sid):
            T.set_hf32_mode(None)  # full fp32 products (the forward leaves HF32 on)
            x_ub = T.alloc_shared((half, W), T.bfloat16)
            xf_ub = T.alloc_shared((half, W), T.float32)
            xg_ub = T.alloc_shared((half, W), T.bfloat16)
            p_ub = T.alloc_shared((half, W), T.float32)  # this core's rows of g @ fn
            sg_ub = T.alloc_shared((half,), T.float32)
            zero_ub = T.alloc_shared((1, W), T.float32)  # grad_fn rows for T = 0
            x_l1 = T.alloc_l1((BT, W), T.float32)
            g_l1 = T.alloc_l1((BT, _N_PAD), T.float32)
            fn_l1 = T.alloc_l1((_N_PAD, W), T.float32)
            gt_l0a = T.alloc_l0a((BT, _N_PAD), T.float32)  # g as the transposed A of g^T @ x
            g_l0a = T.alloc_l0a((BT, _N_PAD), T.float32)
            x_l0b = T.alloc_l0b((BT, W), T.float32)
            fn_l0b = T.alloc_l0b((_N_PAD, W), T.float32)
            acc_fg = T.alloc_l0c((_N_PAD, W), T.float32)
            acc_xg = T.alloc_l0c((BT, W), T.float32)
            # x_ub, xg_ub and sg_ub are loaded under the tail guard: one version (the scheduler's rule)
            T.annotate_buffer_versions({
                xf_ub: stages, p_ub: stages, x_l1: stages, g_l1: stages, gt_l0a: stages, g_l0a: stages,
                acc_xg: stages, x_l0b: x_l0b_versions,
            })
            for (ct,) in T.Persistent([n_ct], ncube, core_id, group_size=1):
                c0 = ct * W
                # rows M3..31 of the tile are out of bounds: the copy fills them with zeros
                T.copy(fn[0:_N_PAD, c0 : c0 + W], fn_l1)
                T.copy(fn_l1, fn_l0b)
                for tb in T.Pipelined(T.ceildiv(num_tokens, BT), num_stages=stages):
                    t0 = tb * BT
                    a0 = t0 + sid * half  # first token of this vector core's half block
                    valid_h = T.max(T.min(num_tokens - a0, half), 0)
                    if valid_h > 0:
                        T.copy(x[a0 : a0 + valid_h, c0 : c0 + W], x_ub[0:valid_h, :])
                        T.copy(grad_x[a0 : a0 + valid_h, c0 : c0 + W], xg_ub[0:valid_h, :])
                        T.copy(grad_sqrsum[a0 : a0 + valid_h], sg_ub[0:valid_h])
                    with T.SimdVF():
                        zero = S.vdup(0.0, T.float32)
                        for r in T.serial(valid_h):
                            for c in T.unroll(w_chunks, explicit=True):
                                xf = S.vcvt(S.vld(x_ub[r, c * LANES], dist="UNPK_B16"), T.float32, part=0)
                                S.vsts(xf_ub[r, c * LANES], xf)
                        for r in T.serial(valid_h, half):  # tail rows: zero x (g^T @ x sums all BT rows)
                            for c in T.unroll(w_chunks, explicit=True):
                                S.vsts(xf_ub[r, c * LANES], zero)
                    T.dual_copy(xf_ub, x_l1)
                    # token tail rows and columns M3..31 out of bounds: filled with zeros
                    T.copy(grad_out_mul[t0 : t0 + BT, 0:_N_PAD], g_l1)
                    T.copy(g_l1, gt_l0a)
                    T.copy(x_l1, x_l0b)
                    T.gemm(gt_l0a, x_l0b, acc_fg, transpose_A=True, clear_accum=(tb == 0))
                    T.copy(g_l1, g_l0a)
                    T.gemm(g_l0a, fn_l0b, acc_xg, clear_accum=True)
                    T.dual_copy(acc_xg, p_ub)
                    with T.SimdVF():
                        r_acc = S.alloc_local((1,), T.float32)
                        for r in T.serial(valid_h):
                            sg2 = S.vmuls(S.vld(sg_ub[r], dist="BRC_B32"), 2.0)
                            for c in T.unroll(w_chunks, explicit=True):
                                d = c * LANES
                                xg = S.vcvt(S.vld(xg_ub[r, d], dist="UNPK_B16"), T.float32, part=0)
                                r_acc[0] = S.vadd(xg, S.vld(p_ub[r, d]))
                                S.vmula(r_acc[0], sg2, S.vld(xf_ub[r, d]))
                                S.vsts(xg_ub[r, d], S.vcvt(r_acc[0], T.bfloat16), dist="PK_B32")
                    if valid_h > 0:
                        T.copy(xg_ub[0:valid_h, :], grad_x[a0 : a0 + valid_h, c0 : c0 + W])
                if num_tokens > 0:
                    T.copy(acc_fg[0:M3, :], grad_fn[:, c0 : c0 + W])
                else:
                    # no token block ran, acc_fg was never cleared: the vector cores store zero rows
                    f0 = sid * half
                    valid_f = T.max(T.min(M3 - f0, half), 0)
                    with T.SimdVF():
                        zero = S.vdup(0.0, T.float32)
                        for c in T.unroll(w_chunks, explicit=True):
                            S.vsts(zero_ub[0, c * LANES], zero)
                    for r in T.serial(valid_f):
                        T.copy(zero_ub[0:1, :], grad_fn[f0 + r : f0 + r + 1, c0 : c0 + W])

    return mhc_gemm_with_sqrsum_backward_asc


BACKWARD = Kernel("mhc_gemm_with_sqrsum_backward", BackwardKey, build_mhc_gemm_with_sqrsum_backward,
                  derive=lambda fn: BackwardKey(int(fn.shape[0]), int(fn.shape[1]), int(num_vector_cores())),
                  cases=lambda hidden_size, hc_mult: BackwardKey(CASE_MHC_MULT3, hc_mult * hidden_size, CASE_NUM_CORES))


def mhc_gemm_with_sqrsum_backward(grad_out_mul, grad_sqrsum, x, fn, grad_x, grad_fn) -> None:
    """grad_out_mul (T,M3) f32 (or (T,1,M3)), grad_sqrsum (T,) f32 (or (T,1)), x (T,K) bf16, fn (M3,K) f32;
    grad_x (T,K) bf16 accumulated in place; grad_fn (M3,K) f32 (new, overwritten). Current stream."""
    kernel = BACKWARD.compiled(BACKWARD.key(fn))
    n = x.shape[0]
    kernel(grad_out_mul.reshape(n, -1), grad_sqrsum.reshape(n), x, fn, grad_x, grad_fn)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
