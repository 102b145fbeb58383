"""Ascend 950 kernels of ``mhc_pre_apply_mix_forward`` / ``_backward`` (docs/ops/mhc.md#pre_apply_mix), m = 4.

* ``mhc_pre_apply_mix_forward(x, mix, out)``: ``out = bf16(sum_i mix_i * f32(x_i))``, i ascending.
* ``mhc_pre_apply_mix_backward(grad_out, x, mix, grad_x, grad_mix)``: ``grad_x += mix_i * og`` (bf16
  read-modify-write), ``grad_mix[t, i] = sum_d og * x_i`` (new tensor).

Streaming scheme of :mod:`._streaming`; launchers take the op's arguments in schema order followed by
its new outputs (docs/ops/mhc.md#conventions).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ..._kernel import Kernel, kernel_module
from .. import num_vector_cores
from ._common import LANES
from ._streaming import (PAD, StreamingPlan, StreamKey, apply_mix_vf, bf16_to_f32, check, stream_cases, stream_key,
                         to_bf16)


# Forward three stages (the whole row up to H = 7936), backward two (the whole row up to H = 6656)
# (docs/perf/ascend950/mhc.md, 2026-11-30 — pre_apply_mix: UB tiles).
FORWARD_PLAN = StreamingPlan(stages=3)
BACKWARD_PLAN = StreamingPlan(stages=2)


def build_mhc_pre_apply_mix_forward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,m,H) bf16, mix (T,m) f32, out (T,H) bf16): ``out = bf16(sum_i mix_i * x_i)``."""
    H, m = check("mhc_pre_apply_mix_forward", hidden_size, hc_mult)
    stages = FORWARD_PLAN.stages
    h_blk = FORWARD_PLAN.hidden_tile(H, 2 * (m + 1))  # m bf16 inputs + 1 bf16 output per column
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    apply_mix = apply_mix_vf(m, n_chunks)
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_forward_asc(
        x: T.Tensor[(num_tokens, m, H), T.bfloat16],
        mix: T.Tensor[(num_tokens, m), T.float32],
        out: T.Tensor[(num_tokens, H), T.bfloat16],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            mix_ub = T.alloc_shared((PAD,), T.float32)
            o_ub = T.alloc_shared((h_blk,), T.bfloat16)
            T.annotate_buffer_versions({x_ub: stages, mix_ub: stages, o_ub: stages})
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * h_blk
                T.copy(mix[t, :], mix_ub[0:m])
                T.copy(x[t, :, h0 : h0 + h_blk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                apply_mix(x_ub, mix_ub, None, o_ub)
                T.copy(o_ub, out[t, h0 : h0 + h_blk])

    return mhc_pre_apply_mix_forward_asc


FORWARD = Kernel("mhc_pre_apply_mix_forward", StreamKey, build_mhc_pre_apply_mix_forward, cases=stream_cases,
                 derive=lambda x: stream_key(x.shape[-1], x.shape[-2], num_vector_cores()))


def mhc_pre_apply_mix_forward(x, mix, out) -> None:
    """x (T,m,H) bf16, mix (T,m) f32 -> out (T,H) bf16 (overwritten). Current stream, no sync."""
    kernel = FORWARD.compiled(FORWARD.key(x))
    kernel(x, mix.reshape(x.shape[0], x.shape[1]), out)


def build_mhc_pre_apply_mix_backward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(grad_out (T,H) bf16, x (T,m,H) bf16, mix (T,m) f32, grad_x (T,m,H) bf16 in/out,
    grad_mix (T,m) f32 out).

    One task per token (it owns the H reduction of ``grad_mix``), hidden tiles in ascending order.
    """
    H, m = check("mhc_pre_apply_mix_backward", hidden_size, hc_mult)
    stages = BACKWARD_PLAN.stages
    h_blk = BACKWARD_PLAN.hidden_tile(H, 2 + 4 * m)  # og (2) + x (2m) + grad_x (2m) bytes per column
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_backward_asc(
        grad_out: T.Tensor[(num_tokens, H), T.bfloat16],
        x: T.Tensor[(num_tokens, m, H), T.bfloat16],
        mix: T.Tensor[(num_tokens, m), T.float32],
        grad_x: T.Tensor[(num_tokens, m, H), T.bfloat16],
        grad_mix: T.Tensor[(num_tokens, m), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            og_ub = T.alloc_shared((h_blk,), T.bfloat16)
            x_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            xg_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            mix_ub = T.alloc_shared((PAD,), T.float32)
            acc_ub = T.alloc_shared((m, LANES), T.float32)  # 64-lane partial sums of grad_mix
            mg_ub = T.alloc_shared((PAD,), T.float32)
            T.annotate_buffer_versions({og_ub: stages, x_ub: stages, xg_ub: stages, mix_ub: stages, mg_ub: stages})
            for (t,) in T.Persistent([num_tokens], num_cores, core_id, group_size=1, num_stages=stages):
                T.copy(mix[t, :], mix_ub[0:m])
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for i in T.unroll(m, explicit=True):
                        S.vsts(acc_ub[i, 0], zero)
                for ht in T.serial(n_tiles):
                    h0 = ht * h_blk
                    T.copy(grad_out[t, h0 : h0 + h_blk], og_ub)
                    T.copy(x[t, :, h0 : h0 + h_blk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    T.copy(grad_x[t, :, h0 : h0 + h_blk], xg_ub)
                    with T.SimdVF():
                        w = S.alloc_local((m,), T.float32)
                        acc = S.alloc_local((m,), T.float32)
                        r = S.alloc_local((1,), T.float32)
                        for i in T.unroll(m, explicit=True):
                            w[i] = S.vld(mix_ub[i], dist="BRC_B32")
                            acc[i] = S.vld(acc_ub[i, 0])
                        for c in T.serial(n_chunks):
                            d = c * LANES
                            og = bf16_to_f32(og_ub[d])
                            for i in T.unroll(m, explicit=True):
                                S.vmula(acc[i], og, bf16_to_f32(x_ub[i, d]))
                                r[0] = bf16_to_f32(xg_ub[i, d])
                                S.vmula(r[0], og, w[i])
                                S.vsts(xg_ub[i, d], to_bf16(r[0]), dist="PK_B32")
                        for i in T.unroll(m, explicit=True):
                            S.vsts(acc_ub[i, 0], acc[i])
                    T.copy(xg_ub, grad_x[t, :, h0 : h0 + h_blk])
                with T.SimdVF():
                    for i in T.unroll(m, explicit=True):
                        S.vsts(mg_ub[i], S.vcadd(S.vld(acc_ub[i, 0])), dist="ONEPT_B32")
                T.copy(mg_ub[0:m], grad_mix[t, :])

    return mhc_pre_apply_mix_backward_asc


BACKWARD = Kernel("mhc_pre_apply_mix_backward", StreamKey, build_mhc_pre_apply_mix_backward, cases=stream_cases,
                  derive=lambda x: stream_key(x.shape[-1], x.shape[-2], num_vector_cores()))


def mhc_pre_apply_mix_backward(grad_out, x, mix, grad_x, grad_mix) -> None:
    """grad_out (T,H) bf16, x (T,m,H) bf16, mix (T,m) f32; grad_x (T,m,H) bf16 accumulated in place;
    grad_mix (T,m) f32 (new, overwritten). Current stream, no sync."""
    kernel = BACKWARD.compiled(BACKWARD.key(x))
    n, m = x.shape[0], x.shape[1]
    kernel(grad_out, x, mix.reshape(n, m), grad_x, grad_mix.reshape(n, m))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
