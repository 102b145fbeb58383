"""Ascend 950 kernel of the fused ``mhc_pre_big_fuse`` (docs/ops/mhc.md#pre_big_fuse), m = 4.

One kernel runs, bitwise, what the unfused Ascend kernels compute one after another:
``mhc_reduce_partials_and_rmsnorm_forward`` (G = 1, ``Rg = m*H``) -> ``mhc_pre_split_mixes_forward`` ->
``mhc_sinkhorn_forward`` -> ``mhc_pre_apply_mix_forward``, with the same fp32 instruction sequence per
element (the intermediates the chain writes to GM and reads back are fp32, so keeping them in UB changes
no bit): ordered split sums (from +0.0 when S > 8, as the reduce kernel's chunked path),
``r = 1/sqrt(sq*fp32(1/Rg) + eps)``, ``z = x*scale + base`` (two roundings), ``sigma = 1/(1 + exp(0 - z))``,
the Sinkhorn macros of :mod:`.sinkhorn` themselves, and the apply-mix ``vmul`` + ``vmula`` chain rounded
to bf16 once.

Schedule: core c owns the contiguous token range ``[c*T//P, (c+1)*T//P)`` (balanced to one token, so all
cores stream even when T < 64 P) and walks it in chunks of up to 64 tokens. Per chunk it computes the
mixes of a 64-lane token block (lanes past the chunk hold the next core's rows or, past T, stale UB data:
computed, never stored),
writes ``post_mix`` / ``comb_mix`` of the chunk's rows, then streams ``layer_input`` token by token over
hidden tiles with multi-buffered residual / output tiles (streaming scheme of :mod:`._streaming`).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses
import functools

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T

from .... import limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores
from ._common import CASE_NUM_CORES, LANES, M, M2, M3, require_streams_and_hidden
from ._per_token import SPLIT_SUMS, TOK, rms_vf, split_mixes_vf, split_sums, token_table_vf
from ._sinkhorn import sinkhorn_forward_vf
from ._streaming import SLACK, apply_mix_vf


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """``tokens`` per mixes block (64 lanes, the per-token kernels' layouts), ``stages`` UB versions of
    the streaming tiles (the mixes buffers are single: one block per chunk)."""

    tokens: int = TOK
    stages: int = 3

    def mixes_ub_bytes(self, n_splits: int) -> int:
        """UB of the mixes stage: partials (SC splits per DMA, as the reduce kernel), sums, mixes, the
        lane -> token table, parameters, pre / post / comb logits / comb tiles."""
        B, SC = self.tokens, SPLIT_SUMS.split_chunk(n_splits)
        return 4 * (SC * B * M3 + SC * B + 2 * B * M3 + B + B * M3 + 8 + LANES + 2 * B * M + 2 * B * M2)

    def hidden_tile(self, hidden_size: int, hc_mult: int, n_splits: int) -> int:
        """Largest divisor of H (multiple of 64) whose ``stages`` residual (2m bytes per column) and
        output (2) tiles fit next to the mixes stage within the UB budget less the 8 KiB slack."""
        limit = _build.UB_BUDGET_BYTES - SLACK - self.mixes_ub_bytes(n_splits)
        per_column = self.stages * 2 * (hc_mult + 1)
        for blk in range(hidden_size, 0, -LANES):
            if hidden_size % blk == 0 and per_column * blk <= limit:
                return blk
        raise limits.LimitError(f"mhc_pre_big_fuse: no hidden tile of H={hidden_size} fits the UB next to S={n_splits}")


# 64-token mixes blocks, three streaming stages (as the apply-mix forward): the whole row up to H = 5504 next
# to the 78.5 KiB mixes stage of S = 16, 6976 at S = 1 (docs/perf/ascend950/mhc.md, 2026-12-02 —
# pre_big_fuse and multilayer_recompute: schedules, UB, lowering time).
PLAN = FusedPlan()


def core_token_range(core, num_cores, num_tokens):
    """Tokens [lo, hi) of ``core``: ``[core*T//P, (core+1)*T//P)``, contiguous and balanced to one token
    (ints, or the kernel's int32 PrimExprs: ``P*T`` must stay below 2**31, which the launcher checks)."""
    return (core * num_tokens) // num_cores, ((core + 1) * num_tokens) // num_cores


def _check(where: str, hidden_size, hc_mult, n_splits, repeat) -> tuple[int, int, int, int]:
    """(H, m, S, R) in the declared ranges (S: the pre-norm GEMM's splits of K = m*H), else LimitError."""
    H, m = require_streams_and_hidden(where, hidden_size, hc_mult)
    S_ = limits.mhc_gemm_splits(m * H).require(where, int(n_splits))
    return H, m, S_, limits.MHC_SINKHORN_REPEAT["ascend"].require(where, int(repeat))


def mhc_pre_big_fuse_ub_bytes(hidden_size: int, hc_mult: int, n_splits: int) -> int:
    """UB estimate: the mixes stage plus ``stages`` streaming tiles (the lowering adds alignment)."""
    h_blk = PLAN.hidden_tile(hidden_size, hc_mult, n_splits)
    return PLAN.mixes_ub_bytes(n_splits) + PLAN.stages * 2 * (hc_mult + 1) * h_blk


@compile_key
class BigFuseKey:
    """Compile-time key: ``H``, ``m``, ``S = n_splits``, the Sinkhorn repeat ``R`` and the vector cores (never T;
    the eps values and post_mult_value are runtime scalars)."""

    hidden_size: int
    hc_mult: int
    n_splits: int
    repeat: int
    num_cores: int


def _key(gemm_out_mul, residual, sinkhorn_repeat, n_splits) -> BigFuseKey:
    s = int(gemm_out_mul.shape[0])
    if s != int(n_splits):
        raise limits.LimitError(f"mhc_pre_big_fuse: gemm_out_mul holds {s} splits, n_splits is {n_splits}")
    H, m, S_, R = _check("mhc_pre_big_fuse", residual.shape[-1], residual.shape[-2], s, sinkhorn_repeat)
    return BigFuseKey(H, m, S_, R, int(num_vector_cores()))


def build_mhc_pre_big_fuse(hidden_size: int, hc_mult: int, n_splits: int, repeat: int, num_cores: int):
    """prim_func(gemm_out_mul (S,T,24) f32, gemm_out_sqrsum (S,T) f32, mhc_scale (3,) f32, mhc_base (24,)
    f32, residual (T,m,H) bf16, post_mix (T,4) f32, comb_mix (T,16) f32, layer_input (T,H) bf16,
    inv_group f32 = fp32(1/(m*H)), rms_eps, pre_eps, post_mult_value, sinkhorn_eps f32); T dynamic."""
    H, m, S_, R = _check("mhc_pre_big_fuse", hidden_size, hc_mult, n_splits, repeat)
    P = int(num_cores)
    B, stages = PLAN.tokens, PLAN.stages
    NV = B * M3 // LANES  # 24 vectors per block in the compact layout
    SC = SPLIT_SUMS.split_chunk(S_)
    h_blk = PLAN.hidden_tile(H, m, S_)
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    num_tokens = T.dynamic("num_tokens")
    # the unfused kernels' stages themselves (their bitwise contract): reduce + RMSNorm, split mixes, Sinkhorn,
    # apply mix
    sums, rms, token_table = split_sums(B, S_, SPLIT_SUMS), rms_vf(NV), token_table_vf(NV)
    split_mixes, sinkhorn, apply_mix = split_mixes_vf(B), sinkhorn_forward_vf(R), apply_mix_vf(m, n_chunks)

    @T.prim_func
    def mhc_pre_big_fuse_asc(
        gemm_out_mul: T.Tensor[(S_, num_tokens, M3), T.float32],
        gemm_out_sqrsum: T.Tensor[(S_, num_tokens), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(M3,), T.float32],
        residual: T.Tensor[(num_tokens, m, H), T.bfloat16],
        post_mix: T.Tensor[(num_tokens, M), T.float32],
        comb_mix: T.Tensor[(num_tokens, M2), T.float32],
        layer_input: T.Tensor[(num_tokens, H), T.bfloat16],
        inv_group: T.float32,
        rms_eps: T.float32,
        pre_eps: T.float32,
        post_mult_value: T.float32,
        sinkhorn_eps: T.float32,
    ):
        with T.Kernel(P) as core_id:
            part_ub = T.alloc_shared((SC, B, M3), T.float32)
            sqp_ub = T.alloc_shared((SC, B), T.float32)
            acc_ub = T.alloc_shared((B, M3), T.float32)
            sq_ub = T.alloc_shared((B,), T.float32)
            mix_ub = T.alloc_shared((B, M3), T.float32)
            tok_ub = T.alloc_shared((NV, LANES), T.int32)  # lane -> token of vector v
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((LANES,), T.float32)
            pre_ub = T.alloc_shared((B, M), T.float32)
            post_ub = T.alloc_shared((B, M), T.float32)
            logit_ub = T.alloc_shared((B, M2), T.float32)
            comb_ub = T.alloc_shared((B, M2), T.float32)
            x_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            o_ub = T.alloc_shared((h_blk,), T.bfloat16)
            T.annotate_buffer_versions({x_ub: stages, o_ub: stages})
            T.copy(mhc_scale[0:3], scale_ub[0:3])
            T.copy(mhc_base[0:M3], base_ub[0:M3])
            token_table(tok_ub)  # lane -> token of the compact (64, 24) block (as the reduce kernel)
            lo, hi = core_token_range(core_id, P, num_tokens)
            for ch in T.serial(T.ceildiv(hi - lo, B)):
                t0 = lo + ch * B
                n = T.min(B, hi - t0)
                # 1. ordered sums over the splits and 2. RMS normalization, mixes = om * r
                # (mhc_reduce_partials_and_rmsnorm_forward)
                sums(gemm_out_mul, gemm_out_sqrsum, t0, part_ub, sqp_ub, acc_ub, sq_ub)
                rms(acc_ub, sq_ub, tok_ub, mix_ub, inv_group, rms_eps)
                # 3. split mixes (mhc_pre_split_mixes_forward): pre, post, comb logits
                split_mixes(mix_ub, scale_ub, base_ub, pre_ub, post_ub, logit_ub, post_mult_value, pre_eps)
                # 4. Sinkhorn (mhc_sinkhorn_forward)
                sinkhorn(logit_ub, comb_ub, sinkhorn_eps)
                with T.Task():
                    T.copy(post_ub[0:n, :], post_mix[t0 : t0 + n, :])
                    T.copy(comb_ub[0:n, :], comb_mix[t0 : t0 + n, :])
                # 5. apply the pre mix (mhc_pre_apply_mix_forward), token by token over hidden tiles
                for j in T.serial(n * n_tiles):
                    tok = j // n_tiles
                    h0 = (j % n_tiles) * h_blk
                    T.copy(residual[t0 + tok, :, h0 : h0 + h_blk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    apply_mix(x_ub, pre_ub, tok, o_ub)
                    T.copy(o_ub, layer_input[t0 + tok, h0 : h0 + h_blk])

    return mhc_pre_big_fuse_asc


# S = 1 (one DMA of the splits) and 16 (two chunks of 8, the chunked sum), Sinkhorn R = 10 and 20
KERNEL = Kernel("mhc_pre_big_fuse", BigFuseKey, build_mhc_pre_big_fuse, derive=_key,
                cases=lambda hidden_size, hc_mult: {
                    f"mhc_pre_big_fuse_s{s}_r{r}": BigFuseKey(hidden_size, hc_mult, s, r, CASE_NUM_CORES)
                    for s in (1, 16) for r in (10, 20)})


def mhc_pre_big_fuse(
    gemm_out_mul, gemm_out_sqrsum, mhc_scale, mhc_base, residual, post_mix, comb_mix, layer_input,
    rms_eps, pre_eps, sinkhorn_eps, post_mult_value, sinkhorn_repeat, n_splits,
) -> None:
    """gemm_out_mul (S,T,24) f32 (or (S,T,1,24)), gemm_out_sqrsum (S,T) f32, mhc_scale (3,), mhc_base (24,),
    residual (T,m,H) bf16 -> post_mix (T,m) f32, comb_mix (T,m*m) f32 (or (T,m,m)), layer_input (T,H) bf16
    (all overwritten). RMS group size m*H. Current stream, no sync."""
    key = KERNEL.key(gemm_out_mul, residual, sinkhorn_repeat, n_splits)
    kernel = KERNEL.compiled(key)
    H, m, s, cores = key.hidden_size, key.hc_mult, key.n_splits, key.num_cores
    t = int(residual.shape[0])
    if cores * t >= 2**31:  # the kernel's int32 token ranges (core_token_range)
        raise limits.LimitError(f"mhc_pre_big_fuse: {t} tokens x {cores} cores overflow the int32 token ranges")
    kernel(
        gemm_out_mul.view(s, t, M3), gemm_out_sqrsum.view(s, t), mhc_scale, mhc_base, residual,
        post_mix.view(t, m), comb_mix.view(t, m * m), layer_input,
        # the reduce launcher's fp32(1/Rg) with Rg = m*H (a Python double rounded once to fp32)
        float(1.0 / (m * H)), float(rms_eps), float(pre_eps), float(post_mult_value), float(sinkhorn_eps),
    )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
