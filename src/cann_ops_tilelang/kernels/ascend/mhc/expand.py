"""Ascend 950 kernels of ``expand_to_mhc_forward`` / ``_backward`` (docs/ops/mhc.md#expand), m = 4.

* ``expand_to_mhc_forward(x, out)``: ``out[t, i, :] = x[t, :]`` (bit copy, DMA only).
* ``expand_to_mhc_backward(grad_out, grad_x)``: ``grad_x = bf16(sum_i f32(grad_out[t, i]))``, i ascending.

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
from ._streaming import StreamKey, StreamingPlan, bf16_to_f32, check, stream_cases, stream_key, to_bf16


# Three stages each way: the whole row (forward) / the whole row up to H = 7936 (backward) per stage
# (docs/perf/ascend950/mhc.md, 2026-11-30 — expand: UB tiles).
FORWARD_PLAN = StreamingPlan(stages=3)
BACKWARD_PLAN = StreamingPlan(stages=3)


def build_expand_to_mhc_forward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,H) bf16, out (T,m,H) bf16): one GM->UB load of the row, m UB->GM stores (pure
    DMA, no vector work: a bit copy)."""
    H, m = check("expand_to_mhc_forward", hidden_size, hc_mult)
    stages = FORWARD_PLAN.stages
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def expand_to_mhc_forward_asc(
        x: T.Tensor[(num_tokens, H), T.bfloat16],
        out: T.Tensor[(num_tokens, m, H), T.bfloat16],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((H,), T.bfloat16)
            T.annotate_buffer_versions({x_ub: stages})
            for (t,) in T.Persistent([num_tokens], num_cores, core_id, group_size=1, num_stages=stages):
                T.copy(x[t, :], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                with T.Task():
                    for i in T.unroll(m, explicit=True):
                        T.copy(x_ub, out[t, i, :])

    return expand_to_mhc_forward_asc


FORWARD = Kernel("expand_to_mhc_forward", StreamKey, build_expand_to_mhc_forward, cases=stream_cases,
                 derive=lambda x, out: stream_key(x.shape[-1], out.shape[-2], num_vector_cores()))


def expand_to_mhc_forward(x, out) -> None:
    """x (T,H) bf16 -> out (T,m,H) bf16 (pre-allocated, overwritten). Current stream, no sync."""
    FORWARD.compiled(FORWARD.key(x, out))(x, out)


def build_expand_to_mhc_backward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(grad_out (T,m,H) bf16, grad_x (T,H) bf16): ``grad_x = bf16(sum_i f32(og_i))``."""
    H, m = check("expand_to_mhc_backward", hidden_size, hc_mult)
    stages = BACKWARD_PLAN.stages
    h_blk = BACKWARD_PLAN.hidden_tile(H, 2 * (m + 1))  # m bf16 inputs + 1 bf16 output per column
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def expand_to_mhc_backward_asc(
        grad_out: T.Tensor[(num_tokens, m, H), T.bfloat16],
        grad_x: T.Tensor[(num_tokens, H), T.bfloat16],
    ):
        with T.Kernel(num_cores) as core_id:
            og_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            xg_ub = T.alloc_shared((h_blk,), T.bfloat16)
            T.annotate_buffer_versions({og_ub: stages, xg_ub: stages})
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * h_blk
                T.copy(grad_out[t, :, h0 : h0 + h_blk], og_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                with T.SimdVF():
                    acc = S.alloc_local((1,), T.float32)
                    for c in T.serial(n_chunks):
                        d = c * LANES
                        acc[0] = bf16_to_f32(og_ub[0, d])
                        for i in T.unroll(1, m, explicit=True):
                            acc[0] = S.vadd(acc[0], bf16_to_f32(og_ub[i, d]))
                        S.vsts(xg_ub[d], to_bf16(acc[0]), dist="PK_B32")
                T.copy(xg_ub, grad_x[t, h0 : h0 + h_blk])

    return expand_to_mhc_backward_asc


BACKWARD = Kernel("expand_to_mhc_backward", StreamKey, build_expand_to_mhc_backward, cases=stream_cases,
                  derive=lambda grad_out: stream_key(grad_out.shape[-1], grad_out.shape[-2], num_vector_cores()))


def expand_to_mhc_backward(grad_out, grad_x) -> None:
    """grad_out (T,m,H) bf16 -> grad_x (T,H) bf16 (overwritten). Current stream, no sync."""
    BACKWARD.compiled(BACKWARD.key(grad_out))(grad_out, grad_x)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
