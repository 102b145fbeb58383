"""Ascend 950 kernels of the per-token mHC ops (OPS.md B.2.4, B.2.5, B.2.6, B.2.9), m = 4.

Ops (launchers named exactly as the ops, argument order of ``mhc_interface.md``):

* ``mhc_reduce_partials_and_rmsnorm_forward`` / ``_backward`` (G = 1; forward M3 = 24, backward M3 <= 32,
  any number of splits S). ``r = 1/sqrt(sq*(1/Rg) + eps)`` is the Ascend form of ``rsqrt(sq/Rg + eps)``:
  ``vmuls(sq, fp32(1/Rg))``, ``vadds(eps)``, ``vsqrt``, correctly rounded ``vdiv(1, .)``.
* ``mhc_pre_split_mixes_forward`` / ``_backward`` (m = 4; the backward writes deterministic per-core
  partials of the scale/base gradients, then a one-core kernel sums them in core order and overwrites
  ``mhc_scale_grad`` / ``mhc_base_grad``).
* ``mhc_sinkhorn_forward`` / ``_backward`` (m = 4, repeat R compile-time, 1 <= R <= 22; the backward
  recomputes the forward from the logits and keeps every normalization's input and denominator in UB).
* ``mhc_head_compute_mix_forward`` / ``_backward`` (m = 4; the backward writes the caller's P partial rows).

Numerics shared with the fused paths (``mhc_pre_big_fuse`` must use the same sequences to be bitwise
equal): every op is fp32; ``sigma(z) = 1/(1 + exp(0 - z))`` as ``vdiv(1, vadds(vexpdif(0, z), 1))``
(correctly rounded division); the affine map is ``z = x*scale + base`` with two roundings (``vmul`` then
``vadd``, no fused multiply-add); Sinkhorn sums run in index order ``((a0 + a1) + a2) + a3`` and every
normalization is a correctly rounded division by ``sum + eps`` (the first row normalization by the plain
softmax sum).

Layouts. The per-token ops move whole token blocks with one contiguous DMA each way and compute on
64-lane fp32 vectors:

* Reduce forward: the (64, 24) block is 24 vectors in the compact token-major layout; the per-token
  ``r`` (one 64-lane vector for the block) is spread over the mixes with ``vselr`` and a constant lane ->
  token table built once per core.
* Reduce backward: rows padded to 32 floats in UB (two tokens per vector); the row sums ``rho`` come from
  ``vcgadd`` (8-lane group sums) and a two-round ``vdintlv`` transpose of the group sums.
* Split mixes / head mix: the (64, 24) input block is read with ``vgather2`` straight into the layouts of
  the pre/post (16 tokens x 4) and comb (4 tokens x 16) outputs; the backward scatters ``dz*scale``
  back with ``vscatter``. Parameter-gradient partials accumulate per lane and are reduced across lanes
  once per partial row.
* Sinkhorn: the (64, 16) block is transposed to "one register per matrix entry, one token per lane"
  with a four-round ``vdintlv`` network (and back with ``vintlv``), so every row/column sum is three
  plain vector adds over 64 tokens and no cross-lane operation is needed.

Ragged token tails: the DMA of the last block is clamped to the valid rows by TileLang (lanes of absent
tokens hold stale UB data, are computed but never stored) and parameter-gradient accumulations mask
them with a per-lane token predicate.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import functools

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .. import num_vector_cores
from .._build import UB_BUDGET_BYTES

__all__ = [
    "build_mhc_head_compute_mix_backward",
    "build_mhc_head_compute_mix_forward",
    "build_mhc_pre_split_mixes_backward",
    "build_mhc_pre_split_mixes_backward_reduce",
    "build_mhc_pre_split_mixes_forward",
    "build_mhc_reduce_partials_and_rmsnorm_backward",
    "build_mhc_reduce_partials_and_rmsnorm_forward",
    "build_mhc_sinkhorn_backward",
    "build_mhc_sinkhorn_forward",
    "get_mhc_head_compute_mix_backward_kernel",
    "get_mhc_head_compute_mix_forward_kernel",
    "get_mhc_pre_split_mixes_backward_kernel",
    "get_mhc_pre_split_mixes_backward_reduce_kernel",
    "get_mhc_pre_split_mixes_forward_kernel",
    "get_mhc_reduce_partials_and_rmsnorm_backward_kernel",
    "get_mhc_reduce_partials_and_rmsnorm_forward_kernel",
    "get_mhc_sinkhorn_backward_kernel",
    "get_mhc_sinkhorn_forward_kernel",
    "mhc_head_compute_mix_backward",
    "mhc_head_compute_mix_backward_key",
    "mhc_head_compute_mix_forward",
    "mhc_head_compute_mix_forward_key",
    "mhc_pre_split_mixes_backward",
    "mhc_pre_split_mixes_backward_key",
    "mhc_pre_split_mixes_forward",
    "mhc_pre_split_mixes_forward_key",
    "mhc_reduce_partials_and_rmsnorm_backward",
    "mhc_reduce_partials_and_rmsnorm_backward_key",
    "mhc_reduce_partials_and_rmsnorm_forward",
    "mhc_reduce_partials_and_rmsnorm_forward_key",
    "mhc_sinkhorn_backward",
    "mhc_sinkhorn_backward_key",
    "mhc_sinkhorn_backward_ub_bytes",
    "mhc_sinkhorn_forward",
    "mhc_sinkhorn_forward_key",
    "mhc_sinkhorn_max_repeat",
]

_LANES = 64  # fp32 lanes of one 256-byte vector register
_M = 4  # hc_mult supported by every kernel of this module
_M2 = _M * _M
_M3 = _M * (_M + 2)
_TOK = 64  # tokens per block of the per-token kernels: one lane per token in the SoA layouts
_STAGES = 2
# NOTE: alignment slack of the merged UB pool (every buffer version is 32-byte aligned) and the small
# parameter/staging buffers that the formulas below do not count.
_SLACK = 4 * 1024
# Partial-row layout of the split-mixes backward (one 256-byte row per vector core):
# columns [0, M3) = base gradient, [32, 35) = scale gradient, the rest zero.
_SPLIT_ROW = 64
_SPLIT_SCALE_COL = 32


def _u32(v):
    """Reinterpret an int32 index vector as the uint32 offsets that gather/scatter take."""
    return T.reinterpret(v, "uint32x64")


def _sigmoid(z, zero, one):
    """sigma(z) = 1/(1 + exp(0 - z)) (the formulation of every Ascend mHC kernel; the CUDA head-mix
    forward alone uses the MUFU exp and reciprocal)."""
    return S.vdiv(one, S.vadds(S.vexpdif(zero, z), 1.0))


# ----------------------------------------------------------------------------------------------------
# mhc_reduce_partials_and_rmsnorm_forward (B.2.4), G = 1, M3 = 24
# ----------------------------------------------------------------------------------------------------

_RED_CHUNK_MAX = 8  # splits per DMA (UB: 2 stages x 8 x 6 KiB)


def _reduce_split_chunk(n_splits: int) -> int:
    """Largest divisor of S that is <= 8: the splits of one block arrive in S/chunk equal DMAs."""
    for c in range(min(n_splits, _RED_CHUNK_MAX), 0, -1):
        if n_splits % c == 0:
            return c
    return 1


def mhc_reduce_partials_and_rmsnorm_forward_key(out_mul_splitted, num_cores: int) -> tuple:
    """(S, num_cores); never T. ``rms_group_size`` and ``rms_eps`` are runtime scalars."""
    return (int(out_mul_splitted.shape[0]), int(num_cores))


def build_mhc_reduce_partials_and_rmsnorm_forward(n_splits: int, num_cores: int):
    """prim_func(out_mul_splitted (S,T,24) f32, sqrsum_splitted (S,T) f32, out_mul (T,24) f32,
    sqrsum (T,) f32, out (T,24) f32, inv_group f32 = fp32(1/Rg), rms_eps f32); T is a dynamic dim.

    ``sq = sum_s sq_s`` and ``om = sum_s om_s`` in split order (from 0: ``0 + v`` is ``v``),
    ``r = 1/sqrt(sq*inv_group + eps)``, ``out = om*r``.
    """
    S_ = int(n_splits)
    assert S_ >= 1
    B, M3 = _TOK, _M3
    NV = B * M3 // _LANES  # 24 vectors per block in the compact layout
    SC = _reduce_split_chunk(S_)
    n_chunks = S_ // SC
    # NOTE: UB: 2 stages x SC x (6 KiB mixes + 256 B sqrsum) + acc/out (2 x 6 KiB, 2 stages) + index
    # table 6 KiB: S = 16 (SC = 8) -> ~134 KiB.
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_reduce_partials_and_rmsnorm_forward_asc(
        out_mul_splitted: T.Tensor[(S_, num_tokens, M3), T.float32],
        sqrsum_splitted: T.Tensor[(S_, num_tokens), T.float32],
        out_mul: T.Tensor[(num_tokens, M3), T.float32],
        sqrsum: T.Tensor[(num_tokens,), T.float32],
        out: T.Tensor[(num_tokens, M3), T.float32],
        inv_group: T.float32,
        rms_eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            part_ub = T.alloc_shared((SC, B, M3), T.float32)
            sqp_ub = T.alloc_shared((SC, B), T.float32)
            acc_ub = T.alloc_shared((B, M3), T.float32)
            sq_ub = T.alloc_shared((B,), T.float32)
            out_ub = T.alloc_shared((B, M3), T.float32)
            tok_ub = T.alloc_shared((NV, _LANES), T.int32)  # lane -> token of vector v
            T.annotate_buffer_versions(
                {part_ub: _STAGES, sqp_ub: _STAGES, acc_ub: _STAGES, sq_ub: _STAGES, out_ub: _STAGES}
            )
            # token of element e = 64v + lane in the compact (64, 24) block: floor(e/24) =
            # ((e >> 3) * 171) >> 9 (exact for e < 1536), with the multiply as shifts and adds.
            with T.SimdVF():
                lane = S.vci(0, T.int32)
                for v in T.unroll(NV, explicit=True):
                    e8 = S.vshrs(S.vadds(lane, v * _LANES), 3)
                    p = S.vadd(S.vadd(S.vshls(e8, 7), S.vshls(e8, 5)), S.vadd(S.vshls(e8, 3), S.vadd(S.vshls(e8, 1), e8)))
                    S.vsts(tok_ub[v, 0], S.vshrs(p, 9))

            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=_STAGES):
                t0 = blk * B
                if n_chunks == 1:
                    T.copy(out_mul_splitted[:, t0 : t0 + B, :], part_ub)
                    T.copy(sqrsum_splitted[:, t0 : t0 + B], sqp_ub)
                    with T.SimdVF():
                        a = S.alloc_local((1,), T.float32)
                        for v in T.unroll(NV, explicit=True):
                            a[0] = S.vld(part_ub[0, (v * _LANES) // M3, (v * _LANES) % M3])
                            for s in T.serial(1, SC):  # fixed order: s ascending
                                a[0] = S.vadd(a[0], S.vld(part_ub[s, (v * _LANES) // M3, (v * _LANES) % M3]))
                            S.vsts(acc_ub[(v * _LANES) // M3, (v * _LANES) % M3], a[0])
                        a[0] = S.vld(sqp_ub[0, 0])
                        for s in T.serial(1, SC):
                            a[0] = S.vadd(a[0], S.vld(sqp_ub[s, 0]))
                        S.vsts(sq_ub[0], a[0])
                else:
                    with T.SimdVF():
                        zero = S.vdup(0.0, T.float32)
                        for v in T.unroll(NV, explicit=True):
                            S.vsts(acc_ub[(v * _LANES) // M3, (v * _LANES) % M3], zero)
                        S.vsts(sq_ub[0], zero)
                    for c in T.serial(n_chunks):
                        T.copy(out_mul_splitted[c * SC : c * SC + SC, t0 : t0 + B, :], part_ub)
                        T.copy(sqrsum_splitted[c * SC : c * SC + SC, t0 : t0 + B], sqp_ub)
                        with T.SimdVF():
                            a = S.alloc_local((1,), T.float32)
                            for v in T.unroll(NV, explicit=True):
                                a[0] = S.vld(acc_ub[(v * _LANES) // M3, (v * _LANES) % M3])
                                for s in T.serial(SC):  # fixed order: s ascending
                                    a[0] = S.vadd(a[0], S.vld(part_ub[s, (v * _LANES) // M3, (v * _LANES) % M3]))
                                S.vsts(acc_ub[(v * _LANES) // M3, (v * _LANES) % M3], a[0])
                            a[0] = S.vld(sq_ub[0])
                            for s in T.serial(SC):
                                a[0] = S.vadd(a[0], S.vld(sqp_ub[s, 0]))
                            S.vsts(sq_ub[0], a[0])
                with T.SimdVF():
                    one = S.vdup(1.0, T.float32)
                    r = S.vdiv(one, S.vsqrt(S.vadds(S.vmuls(S.vld(sq_ub[0]), inv_group), rms_eps)))
                    for v in T.unroll(NV, explicit=True):
                        om = S.vld(acc_ub[(v * _LANES) // M3, (v * _LANES) % M3])
                        rv = S.vselr(r, S.vld(tok_ub[v, 0]))
                        S.vsts(out_ub[(v * _LANES) // M3, (v * _LANES) % M3], S.vmul(om, rv))
                with T.Task():
                    T.copy(acc_ub, out_mul[t0 : t0 + B, :])
                    T.copy(sq_ub, sqrsum[t0 : t0 + B])
                    T.copy(out_ub, out[t0 : t0 + B, :])

    return mhc_reduce_partials_and_rmsnorm_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_reduce_partials_and_rmsnorm_forward_kernel(n_splits, num_cores):
    from .._build import jit_compile

    key = (n_splits, num_cores)
    return jit_compile("mhc_reduce_partials_and_rmsnorm_forward", key, build_mhc_reduce_partials_and_rmsnorm_forward(*key))


def mhc_reduce_partials_and_rmsnorm_forward(
    out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out, rms_group_size, rms_eps, n_splits
) -> None:
    """out_mul_splitted (S,T,1,24) f32, sqrsum_splitted (S,T,1) f32 -> out_mul (T,1,24), sqrsum (T,1),
    out (T,24) (all f32, written). G must be 1 and M3 24 (validated by the op layer). Current stream."""
    s, t = int(out_mul_splitted.shape[0]), int(out_mul_splitted.shape[1])
    m3 = int(out_mul_splitted.shape[-1])
    assert s == int(n_splits) and m3 == _M3
    key = mhc_reduce_partials_and_rmsnorm_forward_key(out_mul_splitted, num_vector_cores())
    kernel = get_mhc_reduce_partials_and_rmsnorm_forward_kernel(*key)
    kernel(
        out_mul_splitted.view(s, t, m3), sqrsum_splitted.view(s, t), out_mul.view(t, m3), sqrsum.view(t),
        out.view(t, m3), float(1.0 / int(rms_group_size)), float(rms_eps),
    )


# ----------------------------------------------------------------------------------------------------
# mhc_reduce_partials_and_rmsnorm_backward (B.2.4), G = 1, M3 <= 32
# ----------------------------------------------------------------------------------------------------

_ROW_PAD = 32  # UB row of one token: M3 <= 32 floats, so two tokens per vector register


def mhc_reduce_partials_and_rmsnorm_backward_key(out_grad, num_cores: int) -> tuple:
    """(M3, num_cores); never T. ``rms_group_size`` and ``rms_eps`` are runtime scalars."""
    return (int(out_grad.shape[-1]), int(num_cores))


def build_mhc_reduce_partials_and_rmsnorm_backward(mhc_mult3: int, num_cores: int):
    """prim_func(out_grad (T,M3) f32, out_mul (T,M3) f32, sqrsum (T,) f32, out_mul_grad (T,M3) f32,
    sqrsum_grad (T,) f32, inv_group f32 = fp32(1/Rg), rms_eps f32, eps_group f32 = fp32(eps*Rg)).

    ``r = 1/sqrt(sq*inv_group + eps)``, ``out_mul_grad = og*r``, ``rho = sum_j og*om``,
    ``sqrsum_grad = ((rho*r) / (sq + eps*Rg)) * -0.5`` (= -rho*r/(2(sq + eps*Rg)), the halving is exact).
    """
    M3 = int(mhc_mult3)
    assert 1 <= M3 <= _ROW_PAD, "the Ascend reduce/rmsnorm backward maps M3 <= 32 mixes to half a vector"
    B = _TOK
    n_pairs = B // 2
    # NOTE: UB per stage: og, om, out_mul_grad tiles (3 x 8 KiB padded) + sqrsum in/out (2 x 256 B);
    # 2 stages ~ 50 KiB, plus the 1 KiB group-sum staging row.
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_reduce_partials_and_rmsnorm_backward_asc(
        out_grad: T.Tensor[(num_tokens, M3), T.float32],
        out_mul: T.Tensor[(num_tokens, M3), T.float32],
        sqrsum: T.Tensor[(num_tokens,), T.float32],
        out_mul_grad: T.Tensor[(num_tokens, M3), T.float32],
        sqrsum_grad: T.Tensor[(num_tokens,), T.float32],
        inv_group: T.float32,
        rms_eps: T.float32,
        eps_group: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            og_ub = T.alloc_shared((B, _ROW_PAD), T.float32)
            om_ub = T.alloc_shared((B, _ROW_PAD), T.float32)
            omg_ub = T.alloc_shared((B, _ROW_PAD), T.float32)
            sq_ub = T.alloc_shared((B,), T.float32)
            sqg_ub = T.alloc_shared((B,), T.float32)
            gs_ub = T.alloc_shared((4 * B,), T.float32)  # (token, 8-lane group) sums of og*om
            T.annotate_buffer_versions({og_ub: _STAGES, om_ub: _STAGES, omg_ub: _STAGES, sq_ub: _STAGES, sqg_ub: _STAGES})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=_STAGES):
                t0 = blk * B
                T.copy(out_grad[t0 : t0 + B, :], og_ub[:, 0:M3])
                T.copy(out_mul[t0 : t0 + B, :], om_ub[:, 0:M3])
                T.copy(sqrsum[t0 : t0 + B], sq_ub)
                with T.SimdVF():
                    one = S.vdup(1.0, T.float32)
                    vl8 = S.pset(32, "PAT_VL8")
                    lane = S.vci(0, T.int32)
                    half = S.vshrs(lane, 5)  # 0: token 2p, 1: token 2p + 1
                    col_ok = S.vcmps(S.vand(lane, S.vdup(_ROW_PAD - 1, T.int32)), M3, op="lt")
                    sq = S.vld(sq_ub[0])
                    r = S.vdiv(one, S.vsqrt(S.vadds(S.vmuls(sq, inv_group), rms_eps)))
                    for pr in T.unroll(n_pairs, explicit=True):
                        g = S.vld(og_ub[2 * pr, 0])
                        rp = S.vselr(r, S.vadds(half, 2 * pr))
                        S.vsts(omg_ub[2 * pr, 0], S.vmul(g, rp))
                        # padding lanes (column >= M3) are zeroed by the predicated multiply
                        prod = S.vmul(g, S.vld(om_ub[2 * pr, 0]), col_ok)
                        S.vsts(gs_ub[8 * pr], S.vcgadd(prod), vl8, extent=8)
                    S.mem_bar("VST_VLD")
                    # gs_ub[4t + k] = group k of token t; two deinterleave rounds give one register
                    # per group k with the 64 tokens in lane order.
                    e01, o01 = S.vdintlv(S.vld(gs_ub[0]), S.vld(gs_ub[_LANES]))
                    e23, o23 = S.vdintlv(S.vld(gs_ub[2 * _LANES]), S.vld(gs_ub[3 * _LANES]))
                    g0, g2 = S.vdintlv(e01, e23)
                    g1, g3 = S.vdintlv(o01, o23)
                    rho = S.vadd(S.vadd(S.vadd(g0, g1), g2), g3)
                    den = S.vadds(sq, eps_group)
                    S.vsts(sqg_ub[0], S.vmuls(S.vdiv(S.vmul(rho, r), den), -0.5))
                with T.Task():
                    T.copy(omg_ub[:, 0:M3], out_mul_grad[t0 : t0 + B, :])
                    T.copy(sqg_ub, sqrsum_grad[t0 : t0 + B])

    return mhc_reduce_partials_and_rmsnorm_backward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_reduce_partials_and_rmsnorm_backward_kernel(mhc_mult3, num_cores):
    from .._build import jit_compile

    key = (mhc_mult3, num_cores)
    return jit_compile("mhc_reduce_partials_and_rmsnorm_backward", key, build_mhc_reduce_partials_and_rmsnorm_backward(*key))


def mhc_reduce_partials_and_rmsnorm_backward(
    out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad, rms_group_size, rms_eps
) -> None:
    """out_grad (T,M3), out_mul (T,1,M3), sqrsum (T,1) -> out_mul_grad (T,1,M3), sqrsum_grad (T,1)
    (all f32, written). G must be 1 and M3 <= 32. Current stream."""
    t, m3 = int(out_grad.shape[0]), int(out_grad.shape[-1])
    key = mhc_reduce_partials_and_rmsnorm_backward_key(out_grad, num_vector_cores())
    kernel = get_mhc_reduce_partials_and_rmsnorm_backward_kernel(*key)
    group = int(rms_group_size)
    kernel(
        out_grad, out_mul.view(t, m3), sqrsum.view(t), out_mul_grad.view(t, m3), sqrsum_grad.view(t),
        float(1.0 / group), float(rms_eps), float(rms_eps) * group,
    )


# ----------------------------------------------------------------------------------------------------
# mhc_pre_split_mixes_forward / _backward (B.2.5), m = 4
# ----------------------------------------------------------------------------------------------------
# Gather layouts of a 64-token block: the pre/post outputs are 4 vectors of 16 tokens x 4 (lane l ->
# token 16k + l//4, column l%4), the comb output 16 vectors of 4 tokens x 16 (lane l -> token 4k + l//16,
# column l%16); the source offset in the (64, 24) input block is 24*token + column (+4 post, +8 comb).


def mhc_pre_split_mixes_forward_key(input_mixes, num_cores: int) -> tuple:
    """(m, num_cores); never T. post_mult_value and pre_eps are runtime scalars."""
    m3 = int(input_mixes.shape[-1])
    assert m3 == _M3, "the Ascend split-mixes kernels support hc_mult == 4 only"
    return (_M, int(num_cores))


def build_mhc_pre_split_mixes_forward(hc_mult: int, num_cores: int):
    """prim_func(input_mixes (T,24) f32, mhc_scale (3,) f32, mhc_base (24,) f32, pre (T,4) f32,
    post (T,4) f32, comb (T,16) f32, post_mult_value f32, pre_eps f32).

    ``z = x*scale[seg] + base``; pre = sigma(z) + pre_eps, post = sigma(z)*post_mult_value, comb = z.
    """
    assert hc_mult == _M, "the Ascend split-mixes kernels support hc_mult == 4 only"
    B, M, M2, M3 = _TOK, _M, _M2, _M3
    # NOTE: UB per stage: input 6 KiB + outputs 1 + 1 + 4 KiB = 12 KiB; 2 stages + params < 26 KiB.
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_split_mixes_forward_asc(
        input_mixes: T.Tensor[(num_tokens, M3), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(M3,), T.float32],
        pre: T.Tensor[(num_tokens, M), T.float32],
        post: T.Tensor[(num_tokens, M), T.float32],
        comb: T.Tensor[(num_tokens, M2), T.float32],
        post_mult_value: T.float32,
        pre_eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((_LANES,), T.float32)
            x_ub = T.alloc_shared((B, M3), T.float32)
            pre_ub = T.alloc_shared((B, M), T.float32)
            post_ub = T.alloc_shared((B, M), T.float32)
            comb_ub = T.alloc_shared((B, M2), T.float32)
            T.annotate_buffer_versions({x_ub: _STAGES, pre_ub: _STAGES, post_ub: _STAGES, comb_ub: _STAGES})
            T.copy(mhc_scale[0:3], scale_ub[0:3])
            T.copy(mhc_base[0:M3], base_ub[0:M3])
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=_STAGES):
                t0 = blk * B
                T.copy(input_mixes[t0 : t0 + B, :], x_ub)
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
                    base_pre = S.vgather2(base_ub[0], _u32(c4))
                    base_post = S.vgather2(base_ub[0], _u32(S.vadds(c4, M)))
                    base_comb = S.vgather2(base_ub[0], _u32(S.vadds(c16, 2 * M)))
                    s_pre = S.vld(scale_ub[0], dist="BRC_B32")
                    s_post = S.vld(scale_ub[1], dist="BRC_B32")
                    s_comb = S.vld(scale_ub[2], dist="BRC_B32")
                    for k in T.unroll(B // 16, explicit=True):
                        xp = S.vgather2(x_ub[0, 0], _u32(S.vadds(src4, 16 * M3 * k)))
                        zp = S.vadd(S.vmul(xp, s_pre), base_pre)
                        S.vsts(pre_ub[16 * k, 0], S.vadds(_sigmoid(zp, zero, one), pre_eps))
                        xq = S.vgather2(x_ub[0, 0], _u32(S.vadds(src4, 16 * M3 * k + M)))
                        zq = S.vadd(S.vmul(xq, s_post), base_post)
                        S.vsts(post_ub[16 * k, 0], S.vmuls(_sigmoid(zq, zero, one), post_mult_value))
                    for k in T.unroll(B // 4, explicit=True):
                        xc = S.vgather2(x_ub[0, 0], _u32(S.vadds(src16, 4 * M3 * k)))
                        S.vsts(comb_ub[4 * k, 0], S.vadd(S.vmul(xc, s_comb), base_comb))
                with T.Task():
                    T.copy(pre_ub, pre[t0 : t0 + B, :])
                    T.copy(post_ub, post[t0 : t0 + B, :])
                    T.copy(comb_ub, comb[t0 : t0 + B, :])

    return mhc_pre_split_mixes_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_pre_split_mixes_forward_kernel(hc_mult, num_cores):
    from .._build import jit_compile

    key = (hc_mult, num_cores)
    return jit_compile("mhc_pre_split_mixes_forward", key, build_mhc_pre_split_mixes_forward(*key))


def mhc_pre_split_mixes_forward(input_mixes, mhc_scale, mhc_base, pre, post, comb, post_mult_value, pre_eps) -> None:
    """input_mixes (T,24) f32, mhc_scale (3,), mhc_base (24,) -> pre (T,4), post (T,4), comb (T,16) f32
    (written). Current stream."""
    key = mhc_pre_split_mixes_forward_key(input_mixes, num_vector_cores())
    kernel = get_mhc_pre_split_mixes_forward_kernel(*key)
    t = int(input_mixes.shape[0])
    kernel(input_mixes, mhc_scale, mhc_base, pre, post, comb.view(t, _M2), float(post_mult_value), float(pre_eps))


def mhc_pre_split_mixes_backward_key(input_mixes, num_cores: int) -> tuple:
    """(m, num_cores); never T. The partial count is the core count (one row per core)."""
    m3 = int(input_mixes.shape[-1])
    assert m3 == _M3, "the Ascend split-mixes kernels support hc_mult == 4 only"
    return (_M, int(num_cores))


def _token_block_range(p, num_parts, num_tokens, block):
    """Token blocks [lo, hi) of partial row p: the ceil(T/block) blocks split into num_parts contiguous,
    balanced ranges (fixed for a given T and P, so the partials are deterministic)."""
    n_blk = T.ceildiv(num_tokens, block)
    return (p * n_blk) // num_parts, ((p + 1) * n_blk) // num_parts


def build_mhc_pre_split_mixes_backward(hc_mult: int, num_cores: int):
    """prim_func(pre_grad (T,4), post_grad (T,4), comb_grad (T,16), input_mixes (T,24), post (T,4),
    mhc_scale (3,), mhc_base (24,), input_mixes_grad (T,24), partial (P,64), post_mult_value f32); all
    f32, P = num_cores.

    Core p owns the p-th contiguous range of 64-token blocks and writes partial row p:
    ``[0, 24)`` = sum_t dz, ``[32, 35)`` = sum_t sum_{j in seg} dz*x, other columns 0.
    """
    assert hc_mult == _M, "the Ascend split-mixes kernels support hc_mult == 4 only"
    B, M, M2, M3 = _TOK, _M, _M2, _M3
    P = int(num_cores)
    # NOTE: UB per stage: 4 input tiles (1 + 1 + 4 + 1 KiB) + input_mixes and its gradient (2 x 6 KiB)
    # = 19 KiB; 2 stages + accumulators/params ~ 41 KiB.
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_split_mixes_backward_asc(
        pre_grad: T.Tensor[(num_tokens, M), T.float32],
        post_grad: T.Tensor[(num_tokens, M), T.float32],
        comb_grad: T.Tensor[(num_tokens, M2), T.float32],
        input_mixes: T.Tensor[(num_tokens, M3), T.float32],
        post: T.Tensor[(num_tokens, M), T.float32],
        mhc_scale: T.Tensor[(3,), T.float32],
        mhc_base: T.Tensor[(M3,), T.float32],
        input_mixes_grad: T.Tensor[(num_tokens, M3), T.float32],
        partial: T.Tensor[(P, _SPLIT_ROW), T.float32],
        post_mult_value: T.float32,
    ):
        with T.Kernel(P) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((_LANES,), T.float32)
            acc_ub = T.alloc_shared((6, _LANES), T.float32)  # per-lane sums: dz (pre, post, comb), dz*x (same)
            row_ub = T.alloc_shared((_SPLIT_ROW,), T.float32)
            pg_ub = T.alloc_shared((B, M), T.float32)
            qg_ub = T.alloc_shared((B, M), T.float32)
            cg_ub = T.alloc_shared((B, M2), T.float32)
            x_ub = T.alloc_shared((B, M3), T.float32)
            po_ub = T.alloc_shared((B, M), T.float32)
            xg_ub = T.alloc_shared((B, M3), T.float32)
            T.annotate_buffer_versions(
                {pg_ub: _STAGES, qg_ub: _STAGES, cg_ub: _STAGES, x_ub: _STAGES, po_ub: _STAGES, xg_ub: _STAGES}
            )
            T.copy(mhc_scale[0:3], scale_ub[0:3])
            T.copy(mhc_base[0:M3], base_ub[0:M3])
            with T.SimdVF():
                zero = S.vdup(0.0, T.float32)
                for a in T.unroll(6, explicit=True):
                    S.vsts(acc_ub[a, 0], zero)
            lo, hi = _token_block_range(core_id, P, num_tokens, B)
            for blk in T.Pipelined(lo, hi, num_stages=_STAGES):
                t0 = blk * B
                T.copy(pre_grad[t0 : t0 + B, :], pg_ub)
                T.copy(post_grad[t0 : t0 + B, :], qg_ub)
                T.copy(comb_grad[t0 : t0 + B, :], cg_ub)
                T.copy(input_mixes[t0 : t0 + B, :], x_ub)
                T.copy(post[t0 : t0 + B, :], po_ub)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    one = S.vdup(1.0, T.float32)
                    pmv = S.vdup(post_mult_value, T.float32)
                    lane = S.vci(0, T.int32)
                    q4 = S.vshrs(lane, 2)
                    c4 = S.vand(lane, S.vdup(3, T.int32))
                    q16 = S.vshrs(lane, 4)
                    c16 = S.vand(lane, S.vdup(15, T.int32))
                    src4 = S.vadd(S.vadd(S.vshls(q4, 4), S.vshls(q4, 3)), c4)
                    src16 = S.vadd(S.vadd(S.vshls(q16, 4), S.vshls(q16, 3)), S.vadds(c16, 2 * M))
                    base_pre = S.vgather2(base_ub[0], _u32(c4))
                    s_pre = S.vld(scale_ub[0], dist="BRC_B32")
                    s_post = S.vld(scale_ub[1], dist="BRC_B32")
                    s_comb = S.vld(scale_ub[2], dist="BRC_B32")
                    valid = T.min(B, num_tokens - t0)
                    acc = S.alloc_local((6,), T.float32)
                    for a in T.unroll(6, explicit=True):
                        acc[a] = S.vld(acc_ub[a, 0])
                    for k in T.unroll(B // 16, explicit=True):
                        live = S.vcmps(q4, valid - 16 * k, op="lt")  # lanes of tokens < T
                        off_pre = S.vadds(src4, 16 * M3 * k)
                        off_post = S.vadds(src4, 16 * M3 * k + M)
                        xp = S.vgather2(x_ub[0, 0], _u32(off_pre))
                        sg = _sigmoid(S.vadd(S.vmul(xp, s_pre), base_pre), zero, one)
                        dzp = S.vmul(S.vld(pg_ub[16 * k, 0]), S.vmul(sg, S.vsub(one, sg)))
                        S.vscatter(S.vmul(dzp, s_pre), xg_ub[0, 0], _u32(off_pre))
                        acc[0] = S.vadd(acc[0], S.vsel(dzp, zero, live))
                        acc[3] = S.vadd(acc[3], S.vsel(S.vmul(dzp, xp), zero, live))
                        xq = S.vgather2(x_ub[0, 0], _u32(off_post))
                        pv = S.vld(po_ub[16 * k, 0])
                        dzq = S.vmul(S.vmul(S.vld(qg_ub[16 * k, 0]), pv), S.vsub(one, S.vdiv(pv, pmv)))
                        S.vscatter(S.vmul(dzq, s_post), xg_ub[0, 0], _u32(off_post))
                        acc[1] = S.vadd(acc[1], S.vsel(dzq, zero, live))
                        acc[4] = S.vadd(acc[4], S.vsel(S.vmul(dzq, xq), zero, live))
                    for k in T.unroll(B // 4, explicit=True):
                        live = S.vcmps(q16, valid - 4 * k, op="lt")
                        off_comb = S.vadds(src16, 4 * M3 * k)
                        xc = S.vgather2(x_ub[0, 0], _u32(off_comb))
                        dzc = S.vld(cg_ub[4 * k, 0])
                        S.vscatter(S.vmul(dzc, s_comb), xg_ub[0, 0], _u32(off_comb))
                        acc[2] = S.vadd(acc[2], S.vsel(dzc, zero, live))
                        acc[5] = S.vadd(acc[5], S.vsel(S.vmul(dzc, xc), zero, live))
                    for a in T.unroll(6, explicit=True):
                        S.vsts(acc_ub[a, 0], acc[a])
                T.copy(xg_ub, input_mixes_grad[t0 : t0 + B, :])
            # lane reduction of the six accumulators into the partial row
            with T.SimdVF():
                zero = S.vdup(0.0, T.float32)
                lane = S.vci(0, T.int32)
                c4 = S.vand(lane, S.vdup(3, T.int32))
                c16 = S.vand(lane, S.vdup(15, T.int32))
                row = S.alloc_local((1,), T.float32)
                row[0] = zero
                a_pre = S.vld(acc_ub[0, 0])
                a_post = S.vld(acc_ub[1, 0])
                a_comb = S.vld(acc_ub[2, 0])
                for j in T.unroll(M, explicit=True):
                    sel = S.vcmps(c4, j, op="eq")
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vsel(a_pre, zero, sel))), row[0], S.vcmps(lane, j, op="eq"))
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vsel(a_post, zero, sel))), row[0], S.vcmps(lane, M + j, op="eq"))
                for j in T.unroll(M2, explicit=True):
                    sel = S.vcmps(c16, j, op="eq")
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vsel(a_comb, zero, sel))), row[0], S.vcmps(lane, 2 * M + j, op="eq"))
                for c in T.unroll(3, explicit=True):
                    row[0] = S.vsel(S.vdupv(S.vcadd(S.vld(acc_ub[3 + c, 0]))), row[0], S.vcmps(lane, _SPLIT_SCALE_COL + c, op="eq"))
                S.vsts(row_ub[0], row[0])
            T.copy(row_ub, partial[core_id, :])

    return mhc_pre_split_mixes_backward_asc


def build_mhc_pre_split_mixes_backward_reduce(num_partials: int, mhc_mult3: int = _M3):
    """prim_func(partial (P,64) f32, mhc_scale_grad (3,) f32, mhc_base_grad (M3,) f32): one core sums
    the P rows in row order (p = 0, 1, ...) and overwrites both gradients."""
    P, M3 = int(num_partials), int(mhc_mult3)
    assert P >= 1 and M3 <= _SPLIT_SCALE_COL
    # NOTE: UB: the P partial rows (P x 256 B, 16 KiB at P = 64) and one output row.

    @T.prim_func
    def mhc_pre_split_mixes_backward_reduce_asc(
        partial: T.Tensor[(P, _SPLIT_ROW), T.float32],
        mhc_scale_grad: T.Tensor[(3,), T.float32],
        mhc_base_grad: T.Tensor[(M3,), T.float32],
    ):
        with T.Kernel(1) as _core:
            part_ub = T.alloc_shared((P, _SPLIT_ROW), T.float32)
            sum_ub = T.alloc_shared((_SPLIT_ROW,), T.float32)
            T.copy(partial, part_ub)
            with T.SimdVF():
                s = S.alloc_local((1,), T.float32)
                s[0] = S.vld(part_ub[0, 0])
                for p in T.serial(1, P):  # fixed order: p ascending
                    s[0] = S.vadd(s[0], S.vld(part_ub[p, 0]))
                S.vsts(sum_ub[0], s[0])
            with T.Task():
                T.copy(sum_ub[0:M3], mhc_base_grad[0:M3])
                T.copy(sum_ub[_SPLIT_SCALE_COL : _SPLIT_SCALE_COL + 3], mhc_scale_grad[0:3])

    return mhc_pre_split_mixes_backward_reduce_asc


@functools.lru_cache(maxsize=None)
def get_mhc_pre_split_mixes_backward_kernel(hc_mult, num_cores):
    from .._build import jit_compile

    key = (hc_mult, num_cores)
    return jit_compile("mhc_pre_split_mixes_backward", key, build_mhc_pre_split_mixes_backward(*key))


@functools.lru_cache(maxsize=None)
def get_mhc_pre_split_mixes_backward_reduce_kernel(num_partials, mhc_mult3):
    from .._build import jit_compile

    key = (num_partials, mhc_mult3)
    return jit_compile("mhc_pre_split_mixes_backward_reduce", key, build_mhc_pre_split_mixes_backward_reduce(*key))


def mhc_pre_split_mixes_backward(
    pre_grad, post_grad, comb_grad, input_mixes, post, mhc_scale, mhc_base,
    input_mixes_grad, mhc_scale_grad, mhc_base_grad, post_mult_value,
) -> None:
    """Grads (T,4), (T,4), (T,16), input_mixes (T,24), post (T,4), scale (3,), base (24,) -> input_mixes_grad
    (T,24) written; mhc_scale_grad (3,) and mhc_base_grad (24,) overwritten (deterministic: per-core
    partials over fixed token ranges, then a fixed-order sum). Two launches on the current stream."""
    import torch

    key = mhc_pre_split_mixes_backward_key(input_mixes, num_vector_cores())
    kernel = get_mhc_pre_split_mixes_backward_kernel(*key)
    P = key[1]
    partial = torch.empty((P, _SPLIT_ROW), dtype=torch.float32, device=input_mixes.device)
    t = int(input_mixes.shape[0])
    kernel(
        pre_grad.view(t, _M), post_grad.view(t, _M), comb_grad.view(t, _M2), input_mixes, post.view(t, _M),
        mhc_scale, mhc_base, input_mixes_grad, partial, float(post_mult_value),
    )
    get_mhc_pre_split_mixes_backward_reduce_kernel(P, _M3)(partial, mhc_scale_grad, mhc_base_grad)


# ----------------------------------------------------------------------------------------------------
# mhc_sinkhorn_forward / _backward (B.2.6), m = 4
# ----------------------------------------------------------------------------------------------------


@T.macro
def _soa_load(y, tmp, src):
    """(64 tokens, 16) AoS tile -> y[e] = entry e of the 64 tokens (lane = token).

    Each round deinterleaves consecutive register pairs (a stable split of the 1024-element sequence
    by its lowest index bit); four rounds rotate the index bits by four, n = 16t + e -> 64e + t.
    """
    for k in T.unroll(_M2, explicit=True):
        y[k] = S.vld(src[4 * k, 0])
    for _rnd in T.unroll(2, explicit=True):
        for j in T.unroll(8, explicit=True):
            ev, od = S.vdintlv(y[2 * j], y[2 * j + 1])
            tmp[j] = ev
            tmp[j + 8] = od
        for j in T.unroll(8, explicit=True):
            ev2, od2 = S.vdintlv(tmp[2 * j], tmp[2 * j + 1])
            y[j] = ev2
            y[j + 8] = od2


@T.macro
def _soa_store(y, tmp, dst):
    """Inverse of :func:`_soa_load` (four ``vintlv`` rounds), then 16 stores into the AoS tile."""
    for _rnd in T.unroll(2, explicit=True):
        for j in T.unroll(8, explicit=True):
            lo, hi = S.vintlv(y[j], y[j + 8])
            tmp[2 * j] = lo
            tmp[2 * j + 1] = hi
        for j in T.unroll(8, explicit=True):
            lo2, hi2 = S.vintlv(tmp[j], tmp[j + 8])
            y[2 * j] = lo2
            y[2 * j + 1] = hi2
    for k in T.unroll(_M2, explicit=True):
        S.vsts(dst[4 * k, 0], y[k])


@T.macro
def _softmax_rows(y):
    """y <- softmax over o of y[4i + o] (max-subtracted, exact division by the sum), in place."""
    for i in T.unroll(_M, explicit=True):
        mx = S.vmax(S.vmax(S.vmax(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3])
        for o in T.unroll(_M, explicit=True):
            y[4 * i + o] = S.vexpdif(y[4 * i + o], mx)
        ssum = S.vadd(S.vadd(S.vadd(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3])
        for o in T.unroll(_M, explicit=True):
            y[4 * i + o] = S.vdiv(y[4 * i + o], ssum)


@T.macro
def _norm_rows(y, eps):
    """y[4i + o] <- y[4i + o] / (sum_o y[4i + o] + eps)."""
    for i in T.unroll(_M, explicit=True):
        d = S.vadds(S.vadd(S.vadd(S.vadd(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3]), eps)
        for o in T.unroll(_M, explicit=True):
            y[4 * i + o] = S.vdiv(y[4 * i + o], d)


@T.macro
def _norm_cols(y, eps):
    """y[4i + o] <- y[4i + o] / (sum_i y[4i + o] + eps)."""
    for o in T.unroll(_M, explicit=True):
        d = S.vadds(S.vadd(S.vadd(S.vadd(y[o], y[4 + o]), y[8 + o]), y[12 + o]), eps)
        for i in T.unroll(_M, explicit=True):
            y[4 * i + o] = S.vdiv(y[4 * i + o], d)


def mhc_sinkhorn_forward_key(comb, repeat: int, num_cores: int) -> tuple:
    """(repeat, num_cores); never T. eps is a runtime scalar."""
    assert int(comb.shape[-1]) == _M and int(comb.shape[-2]) == _M, "the Ascend Sinkhorn supports m == 4 only"
    return (int(repeat), int(num_cores))


def build_mhc_sinkhorn_forward(repeat: int, num_cores: int):
    """prim_func(comb (T,16) f32 logits, comb_out (T,16) f32, eps f32); comb[t, 4i + o] = x[t, i, o].

    softmax over o (max-subtracted), +eps, column normalization, then R-1 times (row, column)
    normalizations with ``+eps`` denominators (OPS.md B.2.6).
    """
    R = int(repeat)
    assert R >= 1
    B, E = _TOK, _M2
    # NOTE: UB: in/out tiles of 64 tokens (2 x 4 KiB) x 2 stages = 16 KiB; the matrices live in 16 + 16
    # vector registers (entries, transpose scratch).
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_sinkhorn_forward_asc(
        comb: T.Tensor[(num_tokens, E), T.float32],
        comb_out: T.Tensor[(num_tokens, E), T.float32],
        eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            in_ub = T.alloc_shared((B, E), T.float32)
            out_ub = T.alloc_shared((B, E), T.float32)
            T.annotate_buffer_versions({in_ub: _STAGES, out_ub: _STAGES})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=_STAGES):
                t0 = blk * B
                T.copy(comb[t0 : t0 + B, :], in_ub)
                with T.SimdVF():
                    y = S.alloc_local((E,), T.float32)
                    tmp = S.alloc_local((E,), T.float32)
                    _soa_load(y, tmp, in_ub)
                    _softmax_rows(y)
                    for e in T.unroll(E, explicit=True):
                        y[e] = S.vadds(y[e], eps)
                    _norm_cols(y, eps)
                    for _r in T.serial(R - 1):
                        _norm_rows(y, eps)
                        _norm_cols(y, eps)
                    _soa_store(y, tmp, out_ub)
                T.copy(out_ub, comb_out[t0 : t0 + B, :])

    return mhc_sinkhorn_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_sinkhorn_forward_kernel(repeat, num_cores):
    from .._build import jit_compile

    key = (repeat, num_cores)
    return jit_compile("mhc_sinkhorn_forward", key, build_mhc_sinkhorn_forward(*key))


def mhc_sinkhorn_forward(comb, comb_out, repeat, eps) -> None:
    """comb (T,4,4) f32 logits -> comb_out (T,4,4) f32 (written). Current stream."""
    key = mhc_sinkhorn_forward_key(comb, repeat, num_vector_cores())
    kernel = get_mhc_sinkhorn_forward_kernel(*key)
    t = int(comb.shape[0])
    kernel(comb.view(t, _M2), comb_out.view(t, _M2), float(eps))


def mhc_sinkhorn_backward_ub_bytes(repeat: int) -> int:
    """UB of the backward kernel.

    NOTE: per eps-normalization step (2R - 1 of them) the 16 input vectors U_n and the 4 denominator
    vectors Sigma_n + eps of the 64-token block (20 x 256 B = 5 KiB), the softmax P (4 KiB), and the
    x / grad_output / grad_input tiles (3 x 4 KiB x 2 stages) + slack: R = 20 -> 227 KiB estimated
    (223 KiB lowered), R = 22 -> 247 KiB estimated (243 KiB lowered), R = 23 does not fit.
    """
    steps = 2 * int(repeat) - 1
    return steps * 20 * 256 + 16 * 256 + 3 * 4096 * _STAGES + _SLACK


def mhc_sinkhorn_max_repeat() -> int:
    """Largest repeat count whose backward fits the UB (22)."""
    r = 1
    while mhc_sinkhorn_backward_ub_bytes(r + 1) <= UB_BUDGET_BYTES:
        r += 1
    return r


def mhc_sinkhorn_backward_key(x, repeat: int, num_cores: int) -> tuple:
    """(repeat, num_cores); never T. eps is a runtime scalar."""
    assert int(x.shape[-1]) == _M and int(x.shape[-2]) == _M, "the Ascend Sinkhorn supports m == 4 only"
    return (int(repeat), int(num_cores))


def build_mhc_sinkhorn_backward(repeat: int, num_cores: int):
    """prim_func(grad_output (T,16) f32, x (T,16) f32 logits, grad_input (T,16) f32, eps f32).

    Recompute: P = softmax_row(x), U_1 = P + eps (column step), then R-1 x (row, column) steps; step
    n keeps its input U_n and its denominator Sigma_n + eps in UB (index s = n - 1: s = 0 column,
    odd s row, even s > 0 column). Backward, s = 2R-2 .. 0:
    ``g <- (g - sum_a(g*U_s) / d_s) / d_s``; then ``grad_input = (g - sum_o g*P) * P``.
    """
    R = int(repeat)
    assert R >= 1
    assert mhc_sinkhorn_backward_ub_bytes(R) <= UB_BUDGET_BYTES, (
        f"Sinkhorn backward: repeat={R} does not fit the UB (max {mhc_sinkhorn_max_repeat()})"
    )
    B, E = _TOK, _M2
    n_steps = 2 * R - 1
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_sinkhorn_backward_asc(
        grad_output: T.Tensor[(num_tokens, E), T.float32],
        x: T.Tensor[(num_tokens, E), T.float32],
        grad_input: T.Tensor[(num_tokens, E), T.float32],
        eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((B, E), T.float32)
            g_ub = T.alloc_shared((B, E), T.float32)
            gi_ub = T.alloc_shared((B, E), T.float32)
            u_ub = T.alloc_shared((n_steps, E, _LANES), T.float32)  # U_n, SoA
            d_ub = T.alloc_shared((n_steps, _M, _LANES), T.float32)  # Sigma_n + eps per row/column
            p_ub = T.alloc_shared((E, _LANES), T.float32)  # softmax P, SoA
            T.annotate_buffer_versions({x_ub: _STAGES, g_ub: _STAGES, gi_ub: _STAGES})
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=_STAGES):
                t0 = blk * B
                T.copy(x[t0 : t0 + B, :], x_ub)
                T.copy(grad_output[t0 : t0 + B, :], g_ub)
                with T.SimdVF():
                    y = S.alloc_local((E,), T.float32)
                    tmp = S.alloc_local((E,), T.float32)
                    # ---- recompute the forward, keeping every step's input and denominator ----
                    _soa_load(y, tmp, x_ub)
                    _softmax_rows(y)
                    for e in T.unroll(E, explicit=True):
                        S.vsts(p_ub[e, 0], y[e])
                        y[e] = S.vadds(y[e], eps)
                    for o in T.unroll(_M, explicit=True):  # step s = 0: columns of U_1 = P + eps
                        dc = S.vadds(S.vadd(S.vadd(S.vadd(y[o], y[4 + o]), y[8 + o]), y[12 + o]), eps)
                        S.vsts(d_ub[0, o, 0], dc)
                        for i in T.unroll(_M, explicit=True):
                            S.vsts(u_ub[0, 4 * i + o, 0], y[4 * i + o])
                            y[4 * i + o] = S.vdiv(y[4 * i + o], dc)
                    for r in T.serial(R - 1):
                        for i in T.unroll(_M, explicit=True):  # step s = 2r + 1: rows
                            dr = S.vadds(S.vadd(S.vadd(S.vadd(y[4 * i], y[4 * i + 1]), y[4 * i + 2]), y[4 * i + 3]), eps)
                            S.vsts(d_ub[2 * r + 1, i, 0], dr)
                            for o in T.unroll(_M, explicit=True):
                                S.vsts(u_ub[2 * r + 1, 4 * i + o, 0], y[4 * i + o])
                                y[4 * i + o] = S.vdiv(y[4 * i + o], dr)
                        for o in T.unroll(_M, explicit=True):  # step s = 2r + 2: columns
                            dc2 = S.vadds(S.vadd(S.vadd(S.vadd(y[o], y[4 + o]), y[8 + o]), y[12 + o]), eps)
                            S.vsts(d_ub[2 * r + 2, o, 0], dc2)
                            for i in T.unroll(_M, explicit=True):
                                S.vsts(u_ub[2 * r + 2, 4 * i + o, 0], y[4 * i + o])
                                y[4 * i + o] = S.vdiv(y[4 * i + o], dc2)
                    S.mem_bar("VST_VLD")
                    # ---- backward through the normalizations, last step first ----
                    _soa_load(y, tmp, g_ub)
                    u = S.alloc_local((_M,), T.float32)
                    for k in T.serial(R - 1):
                        sc = 2 * (R - 1 - k)  # column step s = 2r + 2 with r = R - 2 - k
                        for o in T.unroll(_M, explicit=True):
                            for i in T.unroll(_M, explicit=True):
                                u[i] = S.vld(u_ub[sc, 4 * i + o, 0])
                            tc = S.vadd(S.vadd(S.vadd(S.vmul(y[o], u[0]), S.vmul(y[4 + o], u[1])), S.vmul(y[8 + o], u[2])), S.vmul(y[12 + o], u[3]))
                            dc3 = S.vld(d_ub[sc, o, 0])
                            qc = S.vdiv(tc, dc3)
                            for i in T.unroll(_M, explicit=True):
                                y[4 * i + o] = S.vdiv(S.vsub(y[4 * i + o], qc), dc3)
                        sr = sc - 1  # row step
                        for i in T.unroll(_M, explicit=True):
                            for o in T.unroll(_M, explicit=True):
                                u[o] = S.vld(u_ub[sr, 4 * i + o, 0])
                            tr = S.vadd(S.vadd(S.vadd(S.vmul(y[4 * i], u[0]), S.vmul(y[4 * i + 1], u[1])), S.vmul(y[4 * i + 2], u[2])), S.vmul(y[4 * i + 3], u[3]))
                            dr2 = S.vld(d_ub[sr, i, 0])
                            qr = S.vdiv(tr, dr2)
                            for o in T.unroll(_M, explicit=True):
                                y[4 * i + o] = S.vdiv(S.vsub(y[4 * i + o], qr), dr2)
                    for o in T.unroll(_M, explicit=True):  # step s = 0 (columns)
                        for i in T.unroll(_M, explicit=True):
                            u[i] = S.vld(u_ub[0, 4 * i + o, 0])
                        t1 = S.vadd(S.vadd(S.vadd(S.vmul(y[o], u[0]), S.vmul(y[4 + o], u[1])), S.vmul(y[8 + o], u[2])), S.vmul(y[12 + o], u[3]))
                        d1 = S.vld(d_ub[0, o, 0])
                        q1 = S.vdiv(t1, d1)
                        for i in T.unroll(_M, explicit=True):
                            y[4 * i + o] = S.vdiv(S.vsub(y[4 * i + o], q1), d1)
                    # softmax backward per row: (g - sum_o g*P) * P
                    for i in T.unroll(_M, explicit=True):
                        for o in T.unroll(_M, explicit=True):
                            u[o] = S.vld(p_ub[4 * i + o, 0])
                        ts = S.vadd(S.vadd(S.vadd(S.vmul(y[4 * i], u[0]), S.vmul(y[4 * i + 1], u[1])), S.vmul(y[4 * i + 2], u[2])), S.vmul(y[4 * i + 3], u[3]))
                        for o in T.unroll(_M, explicit=True):
                            y[4 * i + o] = S.vmul(S.vsub(y[4 * i + o], ts), u[o])
                    _soa_store(y, tmp, gi_ub)
                T.copy(gi_ub, grad_input[t0 : t0 + B, :])

    return mhc_sinkhorn_backward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_sinkhorn_backward_kernel(repeat, num_cores):
    from .._build import jit_compile

    key = (repeat, num_cores)
    return jit_compile("mhc_sinkhorn_backward", key, build_mhc_sinkhorn_backward(*key))


def mhc_sinkhorn_backward(grad_output, x, grad_input, repeat, eps) -> None:
    """grad_output (T,4,4) f32, x (T,4,4) f32 logits -> grad_input (T,4,4) f32 (written). Current stream."""
    key = mhc_sinkhorn_backward_key(x, repeat, num_vector_cores())
    kernel = get_mhc_sinkhorn_backward_kernel(*key)
    t = int(x.shape[0])
    kernel(grad_output.view(t, _M2), x.view(t, _M2), grad_input.view(t, _M2), float(eps))


# ----------------------------------------------------------------------------------------------------
# mhc_head_compute_mix_forward / _backward (B.2.9), m = 4
# ----------------------------------------------------------------------------------------------------

_HEAD_FWD_TOK = 128  # tokens per forward block: (128, 4) f32 = 2 KiB, 8 vectors of 16 tokens


def mhc_head_compute_mix_forward_key(input_mix, num_cores: int) -> tuple:
    """(m, num_cores); never T. pre_eps is a runtime scalar."""
    assert int(input_mix.shape[-1]) == _M, "the Ascend head mix supports hc_mult == 4 only"
    return (_M, int(num_cores))


def build_mhc_head_compute_mix_forward(hc_mult: int, num_cores: int):
    """prim_func(input_mix (T,4) f32, mhc_scale (1,) f32, mhc_base (4,) f32, output_mix (T,4) f32,
    pre_eps f32): ``output_mix = sigma(x*scale + base[i]) + pre_eps``."""
    assert hc_mult == _M, "the Ascend head mix supports hc_mult == 4 only"
    B, M = _HEAD_FWD_TOK, _M
    # NOTE: UB: in/out tiles 2 x 2 KiB x 2 stages = 8 KiB.
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_head_compute_mix_forward_asc(
        input_mix: T.Tensor[(num_tokens, M), T.float32],
        mhc_scale: T.Tensor[(1,), T.float32],
        mhc_base: T.Tensor[(M,), T.float32],
        output_mix: T.Tensor[(num_tokens, M), T.float32],
        pre_eps: T.float32,
    ):
        with T.Kernel(num_cores) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((_LANES,), T.float32)
            x_ub = T.alloc_shared((B, M), T.float32)
            o_ub = T.alloc_shared((B, M), T.float32)
            T.annotate_buffer_versions({x_ub: _STAGES, o_ub: _STAGES})
            T.copy(mhc_scale[0:1], scale_ub[0:1])
            T.copy(mhc_base[0:M], base_ub[0:M])
            for (blk,) in T.Persistent([T.ceildiv(num_tokens, B)], num_cores, core_id, group_size=1, num_stages=_STAGES):
                t0 = blk * B
                T.copy(input_mix[t0 : t0 + B, :], x_ub)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    one = S.vdup(1.0, T.float32)
                    c4 = S.vand(S.vci(0, T.int32), S.vdup(3, T.int32))
                    bv = S.vgather2(base_ub[0], _u32(c4))
                    sv = S.vld(scale_ub[0], dist="BRC_B32")
                    for k in T.unroll(B * M // _LANES, explicit=True):
                        z = S.vadd(S.vmul(S.vld(x_ub[16 * k, 0]), sv), bv)
                        S.vsts(o_ub[16 * k, 0], S.vadds(_sigmoid(z, zero, one), pre_eps))
                T.copy(o_ub, output_mix[t0 : t0 + B, :])

    return mhc_head_compute_mix_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_head_compute_mix_forward_kernel(hc_mult, num_cores):
    from .._build import jit_compile

    key = (hc_mult, num_cores)
    return jit_compile("mhc_head_compute_mix_forward", key, build_mhc_head_compute_mix_forward(*key))


def mhc_head_compute_mix_forward(input_mix, mhc_scale, mhc_base, output_mix, pre_eps) -> None:
    """input_mix (T,4) f32, mhc_scale (1,), mhc_base (4,) -> output_mix (T,4) f32 (written). Current stream."""
    key = mhc_head_compute_mix_forward_key(input_mix, num_vector_cores())
    kernel = get_mhc_head_compute_mix_forward_kernel(*key)
    kernel(input_mix, mhc_scale, mhc_base, output_mix, float(pre_eps))


def mhc_head_compute_mix_backward_key(input_mix, mhc_scale_grad_partial, num_cores: int) -> tuple:
    """(m, P, num_cores); never T. P = rows of the caller's partial buffers."""
    assert int(input_mix.shape[-1]) == _M, "the Ascend head mix supports hc_mult == 4 only"
    return (_M, int(mhc_scale_grad_partial.shape[0]), int(num_cores))


def build_mhc_head_compute_mix_backward(hc_mult: int, num_partials: int, num_cores: int):
    """prim_func(output_mix_grad (T,4), input_mix (T,4), mhc_scale (1,), mhc_base (4,),
    input_mix_grad (T,4), scale_partial (P,1), base_partial (P,4)); all f32.

    ``dz = g*(sigma*(1 - sigma))``, ``input_mix_grad = dz*scale``. Partial row p sums ``dz*x`` (scale)
    and ``dz`` per column (base) over the p-th contiguous range of 64-token blocks; the grid has
    ``G = min(P, cores)`` cores, core q owning rows q, q + G, ...; every row is written (zeros for an
    empty range).
    """
    assert hc_mult == _M, "the Ascend head mix supports hc_mult == 4 only"
    B, M = _TOK, _M
    P = int(num_partials)
    assert P >= 1
    G = max(1, min(P, int(num_cores)))
    rows_max = (P + G - 1) // G
    # NOTE: UB per stage: three (64, 4) tiles (3 KiB); 2 stages + accumulators ~ 7 KiB.
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_head_compute_mix_backward_asc(
        output_mix_grad: T.Tensor[(num_tokens, M), T.float32],
        input_mix: T.Tensor[(num_tokens, M), T.float32],
        mhc_scale: T.Tensor[(1,), T.float32],
        mhc_base: T.Tensor[(M,), T.float32],
        input_mix_grad: T.Tensor[(num_tokens, M), T.float32],
        mhc_scale_grad_partial: T.Tensor[(P, 1), T.float32],
        mhc_base_grad_partial: T.Tensor[(P, M), T.float32],
    ):
        with T.Kernel(G) as core_id:
            scale_ub = T.alloc_shared((8,), T.float32)
            base_ub = T.alloc_shared((_LANES,), T.float32)
            acc_ub = T.alloc_shared((2, _LANES), T.float32)  # per-lane sums of dz*x, dz
            srow_ub = T.alloc_shared((8,), T.float32)
            brow_ub = T.alloc_shared((8,), T.float32)
            g_ub = T.alloc_shared((B, M), T.float32)
            x_ub = T.alloc_shared((B, M), T.float32)
            xg_ub = T.alloc_shared((B, M), T.float32)
            T.annotate_buffer_versions({g_ub: _STAGES, x_ub: _STAGES, xg_ub: _STAGES})
            T.copy(mhc_scale[0:1], scale_ub[0:1])
            T.copy(mhc_base[0:M], base_ub[0:M])
            for i in T.serial(rows_max):
                p = core_id + i * G
                lo_p, hi_p = _token_block_range(T.min(p, P - 1), P, num_tokens, B)
                lo = T.if_then_else(p < P, lo_p, 0)  # a core without a row p < P runs an empty range
                hi = T.if_then_else(p < P, hi_p, 0)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    S.vsts(acc_ub[0, 0], zero)
                    S.vsts(acc_ub[1, 0], zero)
                for blk in T.Pipelined(lo, hi, num_stages=_STAGES):
                    t0 = blk * B
                    T.copy(output_mix_grad[t0 : t0 + B, :], g_ub)
                    T.copy(input_mix[t0 : t0 + B, :], x_ub)
                    with T.SimdVF():
                        zero = S.vdup(0.0, T.float32)
                        one = S.vdup(1.0, T.float32)
                        lane = S.vci(0, T.int32)
                        q4 = S.vshrs(lane, 2)
                        c4 = S.vand(lane, S.vdup(3, T.int32))
                        bv = S.vgather2(base_ub[0], _u32(c4))
                        sv = S.vld(scale_ub[0], dist="BRC_B32")
                        valid = T.min(B, num_tokens - t0)
                        acc = S.alloc_local((2,), T.float32)
                        acc[0] = S.vld(acc_ub[0, 0])
                        acc[1] = S.vld(acc_ub[1, 0])
                        for k in T.unroll(B * M // _LANES, explicit=True):
                            live = S.vcmps(q4, valid - 16 * k, op="lt")
                            xv = S.vld(x_ub[16 * k, 0])
                            sg = _sigmoid(S.vadd(S.vmul(xv, sv), bv), zero, one)
                            dz = S.vmul(S.vld(g_ub[16 * k, 0]), S.vmul(sg, S.vsub(one, sg)))
                            S.vsts(xg_ub[16 * k, 0], S.vmul(dz, sv))
                            acc[0] = S.vadd(acc[0], S.vsel(S.vmul(dz, xv), zero, live))
                            acc[1] = S.vadd(acc[1], S.vsel(dz, zero, live))
                        S.vsts(acc_ub[0, 0], acc[0])
                        S.vsts(acc_ub[1, 0], acc[1])
                    T.copy(xg_ub, input_mix_grad[t0 : t0 + B, :])
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    lane = S.vci(0, T.int32)
                    c4 = S.vand(lane, S.vdup(3, T.int32))
                    ab = S.vld(acc_ub[1, 0])
                    brow = S.alloc_local((1,), T.float32)
                    brow[0] = zero
                    for j in T.unroll(M, explicit=True):
                        brow[0] = S.vsel(
                            S.vdupv(S.vcadd(S.vsel(ab, zero, S.vcmps(c4, j, op="eq")))), brow[0], S.vcmps(lane, j, op="eq")
                        )
                    S.vsts(brow_ub[0], brow[0], extent=8)
                    S.vsts(srow_ub[0], S.vcadd(S.vld(acc_ub[0, 0])), dist="ONEPT_B32")
                if rows_max * G == P or p < P:
                    with T.Task():
                        T.copy(srow_ub[0:1], mhc_scale_grad_partial[p, :])
                        T.copy(brow_ub[0:M], mhc_base_grad_partial[p, :])

    return mhc_head_compute_mix_backward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_head_compute_mix_backward_kernel(hc_mult, num_partials, num_cores):
    from .._build import jit_compile

    key = (hc_mult, num_partials, num_cores)
    return jit_compile("mhc_head_compute_mix_backward", key, build_mhc_head_compute_mix_backward(*key))


def mhc_head_compute_mix_backward(
    output_mix_grad, input_mix, mhc_scale, mhc_base, input_mix_grad, mhc_scale_grad_partial, mhc_base_grad_partial
) -> None:
    """output_mix_grad (T,4), input_mix (T,4), scale (1,), base (4,) -> input_mix_grad (T,4) written and
    every row of mhc_scale_grad_partial (P,1) / mhc_base_grad_partial (P,4) written (the caller sums
    them). Current stream."""
    key = mhc_head_compute_mix_backward_key(input_mix, mhc_scale_grad_partial, num_vector_cores())
    kernel = get_mhc_head_compute_mix_backward_kernel(*key)
    kernel(output_mix_grad, input_mix, mhc_scale, mhc_base, input_mix_grad, mhc_scale_grad_partial, mhc_base_grad_partial)


# ----------------------------------------------------------------------------------------------------
# lowering cases
# ----------------------------------------------------------------------------------------------------

_CASE_NUM_CORES = 64  # NOTE: only for building lowering cases on a machine without an NPU


def lowering_cases(hidden_size: int, num_cores: int = _CASE_NUM_CORES) -> dict:
    """Every kernel variant of this module -> prim_func (for CPU lowering checks).

    All kernels here are per-token and independent of the hidden size (``hidden_size`` is ignored).
    """
    del hidden_size
    cases = {}
    for s in (1, 3, 16):
        cases[f"reduce_rmsnorm_fwd_s{s}"] = build_mhc_reduce_partials_and_rmsnorm_forward(s, num_cores)
    for m3 in (24, 32):
        cases[f"reduce_rmsnorm_bwd_m3_{m3}"] = build_mhc_reduce_partials_and_rmsnorm_backward(m3, num_cores)
    cases["pre_split_mixes_fwd"] = build_mhc_pre_split_mixes_forward(_M, num_cores)
    cases["pre_split_mixes_bwd"] = build_mhc_pre_split_mixes_backward(_M, num_cores)
    cases["pre_split_mixes_bwd_reduce"] = build_mhc_pre_split_mixes_backward_reduce(num_cores, _M3)
    for r in (1, 10, 20):
        cases[f"sinkhorn_fwd_r{r}"] = build_mhc_sinkhorn_forward(r, num_cores)
        cases[f"sinkhorn_bwd_r{r}"] = build_mhc_sinkhorn_backward(r, num_cores)
    cases["head_compute_mix_fwd"] = build_mhc_head_compute_mix_forward(_M, num_cores)
    for p in (num_cores, 2 * num_cores + 3):
        cases[f"head_compute_mix_bwd_p{p}"] = build_mhc_head_compute_mix_backward(_M, p, num_cores)
    return cases
