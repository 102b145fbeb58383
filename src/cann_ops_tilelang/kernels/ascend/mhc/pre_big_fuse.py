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
from tilelang.ascend.language import simd as S

from .... import limits
from .. import _build, num_vector_cores
from ._common import CASE_NUM_CORES, LANES, M, M2, M3, require_streams_and_hidden
from ._per_token import TOK, sigmoid, u32
from ._streaming import SLACK, bf16_to_f32, to_bf16
from .reduce_partials_and_rmsnorm import FORWARD_PLAN as REDUCE_PLAN
from .sinkhorn import REPEAT, _norm_cols, _norm_rows, _soa_load, _soa_store, _softmax_rows

__all__ = [
    "PLAN",
    "build_mhc_pre_big_fuse",
    "core_token_range",
    "get_mhc_pre_big_fuse_kernel",
    "lowering_cases",
    "mhc_pre_big_fuse",
    "mhc_pre_big_fuse_key",
    "mhc_pre_big_fuse_ub_bytes",
]


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """``tokens`` per mixes block (64 lanes, the per-token kernels' layouts), ``stages`` UB versions of
    the streaming tiles (the mixes buffers are single: one block per chunk)."""

    tokens: int = TOK
    stages: int = 3

    def mixes_ub_bytes(self, n_splits: int) -> int:
        """UB of the mixes stage: partials (SC splits per DMA, as the reduce kernel), sums, mixes, the
        lane -> token table, parameters, pre / post / comb logits / comb tiles."""
        B, SC = self.tokens, REDUCE_PLAN.split_chunk(n_splits)
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
    return H, m, S_, REPEAT.require(where, int(repeat))


def mhc_pre_big_fuse_ub_bytes(hidden_size: int, hc_mult: int, n_splits: int) -> int:
    """UB estimate: the mixes stage plus ``stages`` streaming tiles (the lowering adds alignment)."""
    h_blk = PLAN.hidden_tile(hidden_size, hc_mult, n_splits)
    return PLAN.mixes_ub_bytes(n_splits) + PLAN.stages * 2 * (hc_mult + 1) * h_blk


def mhc_pre_big_fuse_key(gemm_out_mul, residual, sinkhorn_repeat, n_splits, num_cores: int) -> tuple:
    """(H, m, S, R, num_cores); never T. The eps values and post_mult_value are runtime scalars."""
    s = int(gemm_out_mul.shape[0])
    if s != int(n_splits):
        raise limits.LimitError(f"mhc_pre_big_fuse: gemm_out_mul holds {s} splits, n_splits is {n_splits}")
    H, m, S_, R = _check("mhc_pre_big_fuse", residual.shape[-1], residual.shape[-2], s, sinkhorn_repeat)
    return (H, m, S_, R, int(num_cores))


def build_mhc_pre_big_fuse(hidden_size: int, hc_mult: int, n_splits: int, repeat: int, num_cores: int):
    """prim_func(gemm_out_mul (S,T,24) f32, gemm_out_sqrsum (S,T) f32, mhc_scale (3,) f32, mhc_base (24,)
    f32, residual (T,m,H) bf16, post_mix (T,4) f32, comb_mix (T,16) f32, layer_input (T,H) bf16,
    inv_group f32 = fp32(1/(m*H)), rms_eps, pre_eps, post_mult_value, sinkhorn_eps f32); T dynamic."""
    H, m, S_, R = _check("mhc_pre_big_fuse", hidden_size, hc_mult, n_splits, repeat)
    P = int(num_cores)
    B, stages = PLAN.tokens, PLAN.stages
    NV = B * M3 // LANES  # 24 vectors per block in the compact layout
    SC = REDUCE_PLAN.split_chunk(S_)
    n_split_chunks = S_ // SC
    h_blk = PLAN.hidden_tile(H, m, S_)
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    num_tokens = T.dynamic("num_tokens")

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
            # token of element e = 64v + lane of the compact (64, 24) block (as the reduce kernel)
            with T.SimdVF():
                lane = S.vci(0, T.int32)
                for v in T.unroll(NV, explicit=True):
                    e8 = S.vshrs(S.vadds(lane, v * LANES), 3)
                    p = S.vadd(S.vadd(S.vshls(e8, 7), S.vshls(e8, 5)),
                               S.vadd(S.vshls(e8, 3), S.vadd(S.vshls(e8, 1), e8)))
                    S.vsts(tok_ub[v, 0], S.vshrs(p, 9))

            lo, hi = core_token_range(core_id, P, num_tokens)
            for ch in T.serial(T.ceildiv(hi - lo, B)):
                t0 = lo + ch * B
                n = T.min(B, hi - t0)
                # 1. ordered sums over the splits (mhc_reduce_partials_and_rmsnorm_forward)
                if n_split_chunks == 1:
                    T.copy(gemm_out_mul[:, t0 : t0 + B, :], part_ub)
                    T.copy(gemm_out_sqrsum[:, t0 : t0 + B], sqp_ub)
                    with T.SimdVF():
                        a = S.alloc_local((1,), T.float32)
                        for v in T.unroll(NV, explicit=True):
                            a[0] = S.vld(part_ub[0, (v * LANES) // M3, (v * LANES) % M3])
                            for s in T.serial(1, SC):
                                a[0] = S.vadd(a[0], S.vld(part_ub[s, (v * LANES) // M3, (v * LANES) % M3]))
                            S.vsts(acc_ub[(v * LANES) // M3, (v * LANES) % M3], a[0])
                        a[0] = S.vld(sqp_ub[0, 0])
                        for s in T.serial(1, SC):
                            a[0] = S.vadd(a[0], S.vld(sqp_ub[s, 0]))
                        S.vsts(sq_ub[0], a[0])
                else:
                    with T.SimdVF():
                        zero = S.vdup(0.0, T.float32)
                        for v in T.unroll(NV, explicit=True):
                            S.vsts(acc_ub[(v * LANES) // M3, (v * LANES) % M3], zero)
                        S.vsts(sq_ub[0], zero)
                    for c in T.serial(n_split_chunks):
                        T.copy(gemm_out_mul[c * SC : c * SC + SC, t0 : t0 + B, :], part_ub)
                        T.copy(gemm_out_sqrsum[c * SC : c * SC + SC, t0 : t0 + B], sqp_ub)
                        with T.SimdVF():
                            a = S.alloc_local((1,), T.float32)
                            for v in T.unroll(NV, explicit=True):
                                a[0] = S.vld(acc_ub[(v * LANES) // M3, (v * LANES) % M3])
                                for s in T.serial(SC):
                                    a[0] = S.vadd(a[0], S.vld(part_ub[s, (v * LANES) // M3, (v * LANES) % M3]))
                                S.vsts(acc_ub[(v * LANES) // M3, (v * LANES) % M3], a[0])
                            a[0] = S.vld(sq_ub[0])
                            for s in T.serial(SC):
                                a[0] = S.vadd(a[0], S.vld(sqp_ub[s, 0]))
                            S.vsts(sq_ub[0], a[0])
                # 2. RMS normalization (mixes = om * r)
                with T.SimdVF():
                    one = S.vdup(1.0, T.float32)
                    r = S.vdiv(one, S.vsqrt(S.vadds(S.vmuls(S.vld(sq_ub[0]), inv_group), rms_eps)))
                    for v in T.unroll(NV, explicit=True):
                        om = S.vld(acc_ub[(v * LANES) // M3, (v * LANES) % M3])
                        rv = S.vselr(r, S.vld(tok_ub[v, 0]))
                        S.vsts(mix_ub[(v * LANES) // M3, (v * LANES) % M3], S.vmul(om, rv))
                # 3. split mixes (mhc_pre_split_mixes_forward): pre, post, comb logits
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    one = S.vdup(1.0, T.float32)
                    lane = S.vci(0, T.int32)
                    q4 = S.vshrs(lane, 2)
                    c4 = S.vand(lane, S.vdup(3, T.int32))
                    q16 = S.vshrs(lane, 4)
                    c16 = S.vand(lane, S.vdup(15, T.int32))
                    src4 = S.vadd(S.vadd(S.vshls(q4, 4), S.vshls(q4, 3)), c4)  # 24*(l//4) + l%4
                    src16 = S.vadd(S.vadd(S.vshls(q16, 4), S.vshls(q16, 3)), S.vadds(c16, 2 * M))
                    base_pre = S.vgather2(base_ub[0], u32(c4))
                    base_post = S.vgather2(base_ub[0], u32(S.vadds(c4, M)))
                    base_comb = S.vgather2(base_ub[0], u32(S.vadds(c16, 2 * M)))
                    s_pre = S.vld(scale_ub[0], dist="BRC_B32")
                    s_post = S.vld(scale_ub[1], dist="BRC_B32")
                    s_comb = S.vld(scale_ub[2], dist="BRC_B32")
                    for k in T.unroll(B // 16, explicit=True):
                        xp = S.vgather2(mix_ub[0, 0], u32(S.vadds(src4, 16 * M3 * k)))
                        zp = S.vadd(S.vmul(xp, s_pre), base_pre)
                        S.vsts(pre_ub[16 * k, 0], S.vadds(sigmoid(zp, zero, one), pre_eps))
                        xq = S.vgather2(mix_ub[0, 0], u32(S.vadds(src4, 16 * M3 * k + M)))
                        zq = S.vadd(S.vmul(xq, s_post), base_post)
                        S.vsts(post_ub[16 * k, 0], S.vmuls(sigmoid(zq, zero, one), post_mult_value))
                    for k in T.unroll(B // 4, explicit=True):
                        xc = S.vgather2(mix_ub[0, 0], u32(S.vadds(src16, 4 * M3 * k)))
                        S.vsts(logit_ub[4 * k, 0], S.vadd(S.vmul(xc, s_comb), base_comb))
                # 4. Sinkhorn (mhc_sinkhorn_forward's macros)
                with T.SimdVF():
                    y = S.alloc_local((M2,), T.float32)
                    tmp = S.alloc_local((M2,), T.float32)
                    _soa_load(y, tmp, logit_ub)
                    _softmax_rows(y)
                    for e in T.unroll(M2, explicit=True):
                        y[e] = S.vadds(y[e], sinkhorn_eps)
                    _norm_cols(y, sinkhorn_eps)
                    for _r in T.serial(R - 1):
                        _norm_rows(y, sinkhorn_eps)
                        _norm_cols(y, sinkhorn_eps)
                    _soa_store(y, tmp, comb_ub)
                with T.Task():
                    T.copy(post_ub[0:n, :], post_mix[t0 : t0 + n, :])
                    T.copy(comb_ub[0:n, :], comb_mix[t0 : t0 + n, :])
                # 5. apply the pre mix (mhc_pre_apply_mix_forward), token by token over hidden tiles
                for j in T.serial(n * n_tiles):
                    tok = j // n_tiles
                    h0 = (j % n_tiles) * h_blk
                    T.copy(residual[t0 + tok, :, h0 : h0 + h_blk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    with T.SimdVF():
                        w = S.alloc_local((m,), T.float32)
                        for i in T.unroll(m, explicit=True):
                            w[i] = S.vld(pre_ub[tok, i], dist="BRC_B32")
                        acc = S.alloc_local((1,), T.float32)
                        for c in T.serial(n_chunks):
                            d = c * LANES
                            acc[0] = S.vmul(bf16_to_f32(x_ub[0, d]), w[0])
                            for i in T.unroll(1, m, explicit=True):
                                S.vmula(acc[0], bf16_to_f32(x_ub[i, d]), w[i])
                            S.vsts(o_ub[d], to_bf16(acc[0]), dist="PK_B32")
                    T.copy(o_ub, layer_input[t0 + tok, h0 : h0 + h_blk])

    return mhc_pre_big_fuse_asc


@functools.lru_cache(maxsize=None)
def get_mhc_pre_big_fuse_kernel(hidden_size: int, hc_mult: int, n_splits: int, repeat: int, num_cores: int):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, n_splits, repeat, num_cores)
    return jit_compile("mhc_pre_big_fuse", key, build_mhc_pre_big_fuse(*key))


def mhc_pre_big_fuse(
    gemm_out_mul, gemm_out_sqrsum, mhc_scale, mhc_base, residual, post_mix, comb_mix, layer_input,
    rms_eps, pre_eps, sinkhorn_eps, post_mult_value, sinkhorn_repeat, n_splits,
) -> None:
    """gemm_out_mul (S,T,24) f32 (or (S,T,1,24)), gemm_out_sqrsum (S,T) f32, mhc_scale (3,), mhc_base (24,),
    residual (T,m,H) bf16 -> post_mix (T,m) f32, comb_mix (T,m*m) f32 (or (T,m,m)), layer_input (T,H) bf16
    (all overwritten). RMS group size m*H. Current stream, no sync."""
    key = mhc_pre_big_fuse_key(gemm_out_mul, residual, sinkhorn_repeat, n_splits, num_vector_cores())
    kernel = get_mhc_pre_big_fuse_kernel(*key)
    H, m, s, cores = key[0], key[1], key[2], key[4]
    t = int(residual.shape[0])
    if cores * t >= 2**31:  # the kernel's int32 token ranges (core_token_range)
        raise limits.LimitError(f"mhc_pre_big_fuse: {t} tokens x {cores} cores overflow the int32 token ranges")
    kernel(
        gemm_out_mul.view(s, t, M3), gemm_out_sqrsum.view(s, t), mhc_scale, mhc_base, residual,
        post_mix.view(t, m), comb_mix.view(t, m * m), layer_input,
        # the reduce launcher's fp32(1/Rg) with Rg = m*H (a Python double rounded once to fp32)
        float(1.0 / (m * H)), float(rms_eps), float(pre_eps), float(post_mult_value), float(sinkhorn_eps),
    )


def lowering_cases(hidden_size: int, hc_mult: int = 4, num_cores: int = CASE_NUM_CORES) -> dict:
    """Every kernel variant at ``hidden_size`` -> prim_func (for CPU lowering checks): S = 1 (one DMA of
    the splits) and 16 (two chunks of 8, the chunked sum), Sinkhorn R = 10 and 20."""
    return {
        f"mhc_pre_big_fuse_s{s}_r{r}": build_mhc_pre_big_fuse(hidden_size, hc_mult, s, r, num_cores)
        for s in (1, 16)
        for r in (10, 20)
    }
