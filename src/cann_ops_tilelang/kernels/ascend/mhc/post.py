"""Ascend 950 kernels of ``mhc_post_forward`` / ``_backward`` (docs/ops/mhc.md#post), m = 4.

* ``mhc_post_forward(x, residual, post_layer_mix, comb_res_mix, out)`` (also the kernel of the op's
  ``out=`` variant): ``out[o] = bf16(post_o * x + sum_i comb[i, o] * res_i)`` (post term first, then i
  ascending).
* ``mhc_post_backward(x, residual, post_layer_mix, comb_res_mix, grad_out, grad_x, grad_residual, grad_post,
  grad_comb)``.

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
from ._streaming import PAD, StreamKey, StreamingPlan, bf16_to_f32, check, post_vf, stream_cases, stream_key, to_bf16


# Forward three stages (the whole row up to H = 4416), backward two (the whole row up to H = 4288)
# (docs/perf/ascend950/mhc.md, 2026-11-30 — post: UB tiles).
FORWARD_PLAN = StreamingPlan(stages=3)
BACKWARD_PLAN = StreamingPlan(stages=2)


def build_mhc_post_forward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,H) bf16, residual (T,m,H) bf16, post (T,m) f32, comb (T,m,m) f32, out (T,m,H) bf16).

    ``out[o] = bf16(post[o]*x + sum_{i=0..m-1} comb[i,o]*res[i])``: ``vmul`` of the post term, then
    ``vmula`` for i ascending (the instruction sequence other bit-exact Ascend paths must repeat).
    """
    H, m = check("mhc_post_forward", hidden_size, hc_mult)
    stages = FORWARD_PLAN.stages
    h_blk = FORWARD_PLAN.hidden_tile(H, 2 + 4 * m)  # x (2) + residual (2m) + out (2m) bytes per column
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    post_stage = post_vf(m, n_chunks)
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post_forward_asc(
        x: T.Tensor[(num_tokens, H), T.bfloat16],
        residual: T.Tensor[(num_tokens, m, H), T.bfloat16],
        post_layer_mix: T.Tensor[(num_tokens, m), T.float32],
        comb_res_mix: T.Tensor[(num_tokens, m, m), T.float32],
        out: T.Tensor[(num_tokens, m, H), T.bfloat16],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((h_blk,), T.bfloat16)
            res_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            out_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            post_ub = T.alloc_shared((PAD,), T.float32)
            comb_ub = T.alloc_shared((m, m), T.float32)
            T.annotate_buffer_versions({x_ub: stages, res_ub: stages, out_ub: stages, post_ub: stages, comb_ub: stages})
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * h_blk
                with T.Task():
                    T.copy(post_layer_mix[t, :], post_ub[0:m])
                    T.copy(comb_res_mix[t, :, :], comb_ub)
                T.copy(x[t, h0 : h0 + h_blk], x_ub)
                T.copy(residual[t, :, h0 : h0 + h_blk], res_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                post_stage(x_ub, res_ub, post_ub, comb_ub, out_ub)
                T.copy(out_ub, out[t, :, h0 : h0 + h_blk])

    return mhc_post_forward_asc


FORWARD = Kernel("mhc_post_forward", StreamKey, build_mhc_post_forward, cases=stream_cases,
                 derive=lambda residual: stream_key(residual.shape[-1], residual.shape[-2], num_vector_cores()))


def mhc_post_forward(x, residual, post_layer_mix, comb_res_mix, out) -> None:
    """x (T,H) bf16, residual (T,m,H) bf16, post_layer_mix (T,m) f32 (or (T,m,1)), comb_res_mix (T,m,m)
    f32 -> out (T,m,H) bf16 (overwritten). Current stream, no sync."""
    kernel = FORWARD.compiled(FORWARD.key(residual))
    n, m = residual.shape[0], residual.shape[1]
    kernel(x, residual, post_layer_mix.reshape(n, m), comb_res_mix, out)


def build_mhc_post_backward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,H) bf16, residual (T,m,H) bf16, post (T,m) f32, comb (T,m,m) f32, grad_out (T,m,H) bf16,
    grad_x (T,H) bf16, grad_residual (T,m,H) bf16, grad_post (T,m) f32, grad_comb (T,m,m) f32); all outputs written.

    ``grad_x = bf16(sum_o post[o]*grad_out[o])``, ``grad_res[i] = bf16(sum_o comb[i,o]*grad_out[o])`` (o ascending,
    ``vmul`` then ``vmula``); ``grad_post[o] = sum_d grad_out[o]*x``, ``grad_comb[i,o] = sum_d res[i]*grad_out[o]``:
    64-lane partial sums over the hidden tiles of the token (one task per token), one lane reduction.
    Pass A of a tile writes grad_x and grad_residual; pass B sweeps the tile once per source row (x, res_0..3)
    with the m partial sums of that row in registers.
    """
    H, m = check("mhc_post_backward", hidden_size, hc_mult)
    stages = BACKWARD_PLAN.stages
    # grad_out (2m) + x (2) + residual (2m) + grad_x (2) + grad_residual (2m) bytes per column
    h_blk = BACKWARD_PLAN.hidden_tile(H, 4 + 6 * m)
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    n_src = m + 1  # source rows of the reductions: x (row 0), then residual rows 0..m-1
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post_backward_asc(
        x: T.Tensor[(num_tokens, H), T.bfloat16],
        residual: T.Tensor[(num_tokens, m, H), T.bfloat16],
        post_layer_mix: T.Tensor[(num_tokens, m), T.float32],
        comb_res_mix: T.Tensor[(num_tokens, m, m), T.float32],
        grad_out: T.Tensor[(num_tokens, m, H), T.bfloat16],
        grad_x: T.Tensor[(num_tokens, H), T.bfloat16],
        grad_residual: T.Tensor[(num_tokens, m, H), T.bfloat16],
        grad_post: T.Tensor[(num_tokens, m), T.float32],
        grad_comb: T.Tensor[(num_tokens, m, m), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            do_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            src_ub = T.alloc_shared((n_src, h_blk), T.bfloat16)  # x row, then the m residual rows
            dx_ub = T.alloc_shared((h_blk,), T.bfloat16)
            dres_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            post_ub = T.alloc_shared((PAD,), T.float32)
            comb_ub = T.alloc_shared((m, m), T.float32)
            acc_ub = T.alloc_shared((n_src, m, LANES), T.float32)  # partial sums: [x | res_i] x o
            dpost_ub = T.alloc_shared((PAD,), T.float32)
            dcomb_ub = T.alloc_shared((m, m), T.float32)
            T.annotate_buffer_versions(
                {do_ub: stages, src_ub: stages, dx_ub: stages, dres_ub: stages, post_ub: stages, comb_ub: stages}
            )
            for (t,) in T.Persistent([num_tokens], num_cores, core_id, group_size=1, num_stages=stages):
                with T.Task():
                    T.copy(post_layer_mix[t, :], post_ub[0:m])
                    T.copy(comb_res_mix[t, :, :], comb_ub)
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for s in T.unroll(n_src, explicit=True):
                        for o in T.unroll(m, explicit=True):
                            S.vsts(acc_ub[s, o, 0], zero)
                for ht in T.serial(n_tiles):
                    h0 = ht * h_blk
                    T.copy(grad_out[t, :, h0 : h0 + h_blk], do_ub)
                    T.copy(x[t, h0 : h0 + h_blk], src_ub[0, :])
                    T.copy(residual[t, :, h0 : h0 + h_blk], src_ub[1 : 1 + m, :], l2_cache_ctrl="NOTALLOC_KEEP")
                    with T.SimdVF():
                        pw = S.alloc_local((m,), T.float32)
                        cw = S.alloc_local((m * m,), T.float32)
                        for o in T.unroll(m, explicit=True):
                            pw[o] = S.vld(post_ub[o], dist="BRC_B32")
                        for i in T.unroll(m, explicit=True):
                            for o in T.unroll(m, explicit=True):
                                cw[i * m + o] = S.vld(comb_ub[i, o], dist="BRC_B32")
                        g = S.alloc_local((m,), T.float32)
                        r = S.alloc_local((1,), T.float32)
                        # pass A: grad_x and grad_residual of the tile
                        for c in T.serial(n_chunks):
                            d = c * LANES
                            for o in T.unroll(m, explicit=True):
                                g[o] = bf16_to_f32(do_ub[o, d])
                            r[0] = S.vmul(pw[0], g[0])
                            for o in T.unroll(1, m, explicit=True):
                                S.vmula(r[0], pw[o], g[o])
                            S.vsts(dx_ub[d], to_bf16(r[0]), dist="PK_B32")
                            for i in T.unroll(m, explicit=True):
                                r[0] = S.vmul(cw[i * m], g[0])
                                for o in T.unroll(1, m, explicit=True):
                                    S.vmula(r[0], cw[i * m + o], g[o])
                                S.vsts(dres_ub[i, d], to_bf16(r[0]), dist="PK_B32")
                        # pass B: partial sums of grad_post (src row 0) and grad_comb (src rows 1..m)
                        acc = S.alloc_local((m,), T.float32)
                        for s in T.unroll(n_src, explicit=True):
                            for o in T.unroll(m, explicit=True):
                                acc[o] = S.vld(acc_ub[s, o, 0])
                            for c in T.serial(n_chunks):
                                d = c * LANES
                                sf = bf16_to_f32(src_ub[s, d])
                                for o in T.unroll(m, explicit=True):
                                    S.vmula(acc[o], sf, bf16_to_f32(do_ub[o, d]))
                            for o in T.unroll(m, explicit=True):
                                S.vsts(acc_ub[s, o, 0], acc[o])
                    with T.Task():
                        T.copy(dx_ub, grad_x[t, h0 : h0 + h_blk])
                        T.copy(dres_ub, grad_residual[t, :, h0 : h0 + h_blk])
                with T.SimdVF():
                    for o in T.unroll(m, explicit=True):
                        S.vsts(dpost_ub[o], S.vcadd(S.vld(acc_ub[0, o, 0])), dist="ONEPT_B32")
                    for i in T.unroll(m, explicit=True):
                        for o in T.unroll(m, explicit=True):
                            S.vsts(dcomb_ub[i, o], S.vcadd(S.vld(acc_ub[1 + i, o, 0])), dist="ONEPT_B32")
                with T.Task():
                    T.copy(dpost_ub[0:m], grad_post[t, :])
                    T.copy(dcomb_ub, grad_comb[t, :, :])

    return mhc_post_backward_asc


BACKWARD = Kernel("mhc_post_backward", StreamKey, build_mhc_post_backward, cases=stream_cases,
                  derive=lambda residual: stream_key(residual.shape[-1], residual.shape[-2], num_vector_cores()))


def mhc_post_backward(x, residual, post_layer_mix, comb_res_mix, grad_out, grad_x, grad_residual, grad_post,
                      grad_comb) -> None:
    """x (T,H) bf16, residual/grad_out (T,m,H) bf16, post (T,m) f32, comb (T,m,m) f32 -> grad_x (T,H) bf16,
    grad_residual (T,m,H) bf16, grad_post (T,m) f32 (or (T,m,1)), grad_comb (T,m,m) f32 (all overwritten).
    Current stream, no sync."""
    kernel = BACKWARD.compiled(BACKWARD.key(residual))
    n, m = residual.shape[0], residual.shape[1]
    kernel(x, residual, post_layer_mix.reshape(n, m), comb_res_mix, grad_out, grad_x, grad_residual,
           grad_post.reshape(n, m), grad_comb)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
