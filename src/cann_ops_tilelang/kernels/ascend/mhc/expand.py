"""Ascend 950 kernels of ``expand_to_mhc_forward`` / ``_backward`` (docs/ops/mhc.md#expand), m = 4.

* ``expand_to_mhc_forward(x, out)``: ``out[t, i, :] = x[t, :]`` (bit copy, DMA only).
* ``expand_to_mhc_backward(out_grad, x_grad)``: ``x_grad = bf16(sum_i f32(out_grad[t, i]))``, i ascending.

Streaming scheme of :mod:`._streaming`; launchers take the op's arguments in schema order followed by
its new outputs (docs/ops/mhc.md#conventions).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import functools

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .. import num_vector_cores
from ._common import CASE_NUM_CORES, LANES
from ._streaming import StreamingPlan, bf16_to_f32, check, to_bf16

__all__ = [
    "build_expand_to_mhc_backward",
    "build_expand_to_mhc_forward",
    "expand_to_mhc_backward",
    "expand_to_mhc_backward_key",
    "expand_to_mhc_forward",
    "expand_to_mhc_forward_key",
    "get_expand_to_mhc_backward_kernel",
    "get_expand_to_mhc_forward_kernel",
    "lowering_cases",
]

# Three stages each way: the whole row (forward) / the whole row up to H = 7936 (backward) per stage
# (docs/perf/ascend950/mhc.md, 2026-11-30 — expand: UB tiles).
FORWARD_PLAN = StreamingPlan(stages=3)
BACKWARD_PLAN = StreamingPlan(stages=3)


def expand_to_mhc_forward_key(x, out, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(x.shape[-1]), int(out.shape[-2]), int(num_cores))


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


@functools.lru_cache(maxsize=None)
def get_expand_to_mhc_forward_kernel(hidden_size: int, hc_mult: int, num_cores: int):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, num_cores)
    return jit_compile("expand_to_mhc_forward", key, build_expand_to_mhc_forward(*key))


def expand_to_mhc_forward(x, out) -> None:
    """x (T,H) bf16 -> out (T,m,H) bf16 (pre-allocated, overwritten). Current stream, no sync."""
    kernel = get_expand_to_mhc_forward_kernel(*expand_to_mhc_forward_key(x, out, num_vector_cores()))
    kernel(x, out)


def expand_to_mhc_backward_key(out_grad, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(out_grad.shape[-1]), int(out_grad.shape[-2]), int(num_cores))


def build_expand_to_mhc_backward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(out_grad (T,m,H) bf16, x_grad (T,H) bf16): ``x_grad = bf16(sum_i f32(og_i))``."""
    H, m = check("expand_to_mhc_backward", hidden_size, hc_mult)
    stages = BACKWARD_PLAN.stages
    h_blk = BACKWARD_PLAN.hidden_tile(H, 2 * (m + 1))  # m bf16 inputs + 1 bf16 output per column
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def expand_to_mhc_backward_asc(
        out_grad: T.Tensor[(num_tokens, m, H), T.bfloat16],
        x_grad: T.Tensor[(num_tokens, H), T.bfloat16],
    ):
        with T.Kernel(num_cores) as core_id:
            og_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            xg_ub = T.alloc_shared((h_blk,), T.bfloat16)
            T.annotate_buffer_versions({og_ub: stages, xg_ub: stages})
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * h_blk
                T.copy(out_grad[t, :, h0 : h0 + h_blk], og_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                with T.SimdVF():
                    acc = S.alloc_local((1,), T.float32)
                    for c in T.serial(n_chunks):
                        d = c * LANES
                        acc[0] = bf16_to_f32(og_ub[0, d])
                        for i in T.unroll(1, m, explicit=True):
                            acc[0] = S.vadd(acc[0], bf16_to_f32(og_ub[i, d]))
                        S.vsts(xg_ub[d], to_bf16(acc[0]), dist="PK_B32")
                T.copy(xg_ub, x_grad[t, h0 : h0 + h_blk])

    return expand_to_mhc_backward_asc


@functools.lru_cache(maxsize=None)
def get_expand_to_mhc_backward_kernel(hidden_size: int, hc_mult: int, num_cores: int):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, num_cores)
    return jit_compile("expand_to_mhc_backward", key, build_expand_to_mhc_backward(*key))


def expand_to_mhc_backward(out_grad, x_grad) -> None:
    """out_grad (T,m,H) bf16 -> x_grad (T,H) bf16 (overwritten). Current stream, no sync."""
    kernel = get_expand_to_mhc_backward_kernel(*expand_to_mhc_backward_key(out_grad, num_vector_cores()))
    kernel(out_grad, x_grad)


def lowering_cases(hidden_size: int, hc_mult: int = 4, num_cores: int = CASE_NUM_CORES) -> dict:
    """Every kernel variant at ``hidden_size`` -> prim_func (for CPU lowering checks)."""
    return {
        "expand_to_mhc_forward": build_expand_to_mhc_forward(hidden_size, hc_mult, num_cores),
        "expand_to_mhc_backward": build_expand_to_mhc_backward(hidden_size, hc_mult, num_cores),
    }
