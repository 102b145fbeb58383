"""Ascend 950 kernels of the bandwidth-bound mHC streaming ops (OPS.md B.2.1, B.2.2, B.2.7, B.2.8), m = 4.

Ops (launchers named exactly as the ops, argument order of ``mhc_interface.md``):

* ``expand_to_mhc_forward(x, out)``: ``out[t, i, :] = x[t, :]`` (bit copy, DMA only).
* ``expand_to_mhc_backward(out_grad, x_grad)``: ``x_grad = bf16(sum_i f32(out_grad[t, i]))``, i ascending.
* ``mhc_fn_normw_merge_forward(fn, normw, out_fn)``: ``out_fn[r, k] = fn[r, k] * normw[k]``.
* ``mhc_fn_normw_merge_backward(fn, normw, out_fn_grad, fn_grad, normw_grad)``: ``fn_grad += og * normw``,
  ``normw_grad += sum_r og[r] * fn[r]`` (row sum in a register accumulator, rows ascending, added once).
* ``mhc_pre_apply_mix_forward(x, mix, out)``: ``out = bf16(sum_i mix_i * f32(x_i))``, i ascending.
* ``mhc_pre_apply_mix_backward(out_grad, x, mix, x_grad, mix_grad)``: ``x_grad += mix_i * og`` (bf16
  read-modify-write), ``mix_grad[t, i] = sum_d og * x_i`` (new tensor).
* ``mhc_post_forward(x, residual, post_layer_mix, comb_res_mix, out)``:
  ``out[o] = bf16(post_o * x + sum_i comb[i, o] * res_i)`` (post term first, then i ascending).
* ``mhc_post_backward(x, residual, post_layer_mix, comb_res_mix, d_o, d_x, d_residual, d_post, d_comb)``.

Common scheme: a persistent loop over (token, hidden tile) tasks (``T.Persistent`` with multi-buffered
UB tiles so the GM->UB loads of task n+1 and the UB->GM stores of task n-1 overlap the vector math of
task n); bf16 loads are widened to fp32 64 lanes at a time (``UNPK_B16`` + ``vcvt``), all arithmetic is
fp32, and each output is rounded to bf16 once at the store (``PK_B32``). Chains written "a + b*c" use the
fused multiply-add ``vmula`` (one rounding); a sum "sum_i a_i*b_i" starts with the product ``vmul`` of
term 0 (``0 + p`` is ``p``) and adds terms 1.. with ``vmula`` in ascending order. Reductions over the
hidden dimension (mix_grad, d_post, d_comb) are owned by one task per token (no atomics, deterministic):
64-lane partial sums accumulated across the hidden tiles of the token, then one lane reduction.

Constraints: ``m == 4``, ``H % 64 == 0`` (64 fp32 lanes per vector register), ``H <= 8192``; the
fn/normw merge needs ``K = m*H`` with ``K % 256 == 0`` (true for every H % 64 == 0 with m = 4).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import functools

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .. import num_vector_cores
from .._build import UB_BUDGET_BYTES

__all__ = [
    "build_expand_to_mhc_backward",
    "build_expand_to_mhc_forward",
    "build_mhc_fn_normw_merge_backward",
    "build_mhc_fn_normw_merge_forward",
    "build_mhc_post_backward",
    "build_mhc_post_forward",
    "build_mhc_pre_apply_mix_backward",
    "build_mhc_pre_apply_mix_forward",
    "expand_to_mhc_backward",
    "expand_to_mhc_backward_key",
    "expand_to_mhc_forward",
    "expand_to_mhc_forward_key",
    "get_expand_to_mhc_backward_kernel",
    "get_expand_to_mhc_forward_kernel",
    "get_mhc_fn_normw_merge_backward_kernel",
    "get_mhc_fn_normw_merge_forward_kernel",
    "get_mhc_post_backward_kernel",
    "get_mhc_post_forward_kernel",
    "get_mhc_pre_apply_mix_backward_kernel",
    "get_mhc_pre_apply_mix_forward_kernel",
    "mhc_fn_normw_merge_backward",
    "mhc_fn_normw_merge_backward_key",
    "mhc_fn_normw_merge_forward",
    "mhc_fn_normw_merge_forward_key",
    "mhc_post_backward",
    "mhc_post_backward_key",
    "mhc_post_forward",
    "mhc_post_forward_key",
    "mhc_pre_apply_mix_backward",
    "mhc_pre_apply_mix_backward_key",
    "mhc_pre_apply_mix_forward",
    "mhc_pre_apply_mix_forward_key",
    "mhc_streaming_hidden_tile",
    "lowering_cases",
]

_LANES = 64  # fp32 lanes of one 256-byte vector register (also 64 bf16 per UNPK_B16 load)
_PAD = 8  # small per-token vectors (mix, post) padded to one 32-byte DMA block of fp32
# NOTE: slack for the 32-byte alignment of every buffer version in the merged UB pool and the small
# per-token buffers (mix, accumulators) that the tile formulas below do not count.
_SLACK = 8 * 1024
_UB_LIMIT = UB_BUDGET_BYTES - _SLACK
_MAX_HIDDEN = 8192


def mhc_streaming_hidden_tile(hidden_size: int, bytes_per_column: int, stages: int) -> int:
    """Largest hidden tile ``h_blk`` (a divisor of H, multiple of 64) with
    ``stages * bytes_per_column * h_blk <= 248 KiB - 8 KiB``.

    ``bytes_per_column`` is the UB bytes one hidden column costs in one pipeline stage (sum over the
    multi-buffered tiles of the kernel). Tiles are divisors of H so that no task has a column tail.
    """
    H = hidden_size
    assert H % _LANES == 0 and 0 < H <= _MAX_HIDDEN, f"H={H}: need H % 64 == 0 and H <= {_MAX_HIDDEN}"
    for blk in range(H, 0, -_LANES):
        if H % blk == 0 and stages * bytes_per_column * blk <= _UB_LIMIT:
            return blk
    raise AssertionError(f"H={H}: no hidden tile fits the UB")


def _check(hidden_size: int, hc_mult: int):
    assert hc_mult == 4, "the Ascend mHC streaming kernels support hc_mult == 4 only"
    assert hidden_size % _LANES == 0 and 0 < hidden_size <= _MAX_HIDDEN, f"H={hidden_size}: need H % 64 == 0, H <= 8192"


def _bf16_to_f32(ref):
    return S.vcvt(S.vld(ref, dist="UNPK_B16"), T.float32, part=0)


def _to_bf16(value):
    return S.vcvt(value, T.bfloat16)


# ---------------------------------------------------------------------------------------------------
# 1. expand_to_mhc_forward
# ---------------------------------------------------------------------------------------------------
_EXPAND_FWD_STAGES = 3


def expand_to_mhc_forward_key(x, out, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(x.shape[-1]), int(out.shape[-2]), int(num_cores))


def build_expand_to_mhc_forward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,H) bf16, out (T,m,H) bf16): one GM->UB load of the row, m UB->GM stores.

    NOTE: pure DMA (no vector work: a bit copy). One x row per task: 2H bytes per stage, 3 stages
    = 48 KiB at H = 8192.
    """
    H, m = hidden_size, hc_mult
    _check(H, m)
    stages = _EXPAND_FWD_STAGES
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


# ---------------------------------------------------------------------------------------------------
# 2. expand_to_mhc_backward
# ---------------------------------------------------------------------------------------------------
_EXPAND_BWD_STAGES = 3


def expand_to_mhc_backward_key(out_grad, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(out_grad.shape[-1]), int(out_grad.shape[-2]), int(num_cores))


def build_expand_to_mhc_backward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(out_grad (T,m,H) bf16, x_grad (T,H) bf16): ``x_grad = bf16(sum_i f32(og_i))``.

    NOTE: per stage and hidden column: m bf16 inputs + 1 bf16 output = 10 bytes; 3 stages. The whole
    row fits up to H = 7936 (H = 7168: 210 KiB); H = 8192 uses two 4096-column tiles.
    """
    H, m = hidden_size, hc_mult
    _check(H, m)
    stages = _EXPAND_BWD_STAGES
    h_blk = mhc_streaming_hidden_tile(H, 2 * (m + 1), stages)
    n_tiles = H // h_blk
    n_chunks = h_blk // _LANES
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
                        d = c * _LANES
                        acc[0] = _bf16_to_f32(og_ub[0, d])
                        for i in T.unroll(1, m, explicit=True):
                            acc[0] = S.vadd(acc[0], _bf16_to_f32(og_ub[i, d]))
                        S.vsts(xg_ub[d], _to_bf16(acc[0]), dist="PK_B32")
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


# ---------------------------------------------------------------------------------------------------
# 3./4. mhc_fn_normw_merge_forward / _backward
# ---------------------------------------------------------------------------------------------------
_MERGE_STAGES = 2
# NOTE: column block widths (fp32). Forward per stage: fn + out tiles (2*M3*W*4) + normw (4W) = 196W
# bytes at M3 = 24 -> W = 512 costs 2 stages * 98 KiB = 196 KiB. Backward per stage: fn, og, fn_grad
# tiles (3*M3*W*4) + normw, normw_grad (8W) = 296W -> W = 256 costs 148 KiB.
_MERGE_FWD_WIDTHS = (512, 256)
_MERGE_BWD_WIDTHS = (256,)


def _merge_width(widths, numel: int, num_cores: int) -> int:
    fitting = [w for w in widths if numel % w == 0]
    assert fitting, f"K={numel}: the fn/normw merge needs K % 256 == 0"
    for w in fitting:
        if numel // w >= num_cores:
            return w
    return fitting[-1]


def mhc_fn_normw_merge_forward_key(fn, num_cores: int) -> tuple:
    """(M3, K, num_cores)."""
    return (int(fn.shape[0]), int(fn.shape[1]), int(num_cores))


def build_mhc_fn_normw_merge_forward(mhc_mult3: int, numel: int, num_cores: int):
    """prim_func(fn (M3,K) f32, normw (K,) f32, out_fn (M3,K) f32): ``out_fn = fn * normw`` (exact)."""
    M3, K = mhc_mult3, numel
    W = _merge_width(_MERGE_FWD_WIDTHS, K, num_cores)
    n_blocks = K // W
    n_chunks = W // _LANES
    stages = _MERGE_STAGES

    @T.prim_func
    def mhc_fn_normw_merge_forward_asc(
        fn: T.Tensor[(M3, K), T.float32],
        normw: T.Tensor[(K,), T.float32],
        out_fn: T.Tensor[(M3, K), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            fn_ub = T.alloc_shared((M3, W), T.float32)
            nw_ub = T.alloc_shared((W,), T.float32)
            out_ub = T.alloc_shared((M3, W), T.float32)
            T.annotate_buffer_versions({fn_ub: stages, nw_ub: stages, out_ub: stages})
            for (blk,) in T.Persistent([n_blocks], num_cores, core_id, group_size=1, num_stages=stages):
                base = blk * W
                T.copy(fn[:, base : base + W], fn_ub)
                T.copy(normw[base : base + W], nw_ub)
                with T.SimdVF():
                    for c in T.serial(n_chunks):
                        d = c * _LANES
                        nw = S.vld(nw_ub[d])
                        for r in T.serial(M3):
                            S.vsts(out_ub[r, d], S.vmul(S.vld(fn_ub[r, d]), nw))
                T.copy(out_ub, out_fn[:, base : base + W])

    return mhc_fn_normw_merge_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_fn_normw_merge_forward_kernel(mhc_mult3: int, numel: int, num_cores: int):
    from .._build import jit_compile

    key = (mhc_mult3, numel, num_cores)
    return jit_compile("mhc_fn_normw_merge_forward", key, build_mhc_fn_normw_merge_forward(*key))


def mhc_fn_normw_merge_forward(fn, normw, out_fn) -> None:
    """fn (M3,K) f32, normw (K,) f32 -> out_fn (M3,K) f32 (overwritten). Current stream, no sync."""
    kernel = get_mhc_fn_normw_merge_forward_kernel(*mhc_fn_normw_merge_forward_key(fn, num_vector_cores()))
    kernel(fn, normw, out_fn)


def mhc_fn_normw_merge_backward_key(fn, num_cores: int) -> tuple:
    """(M3, K, num_cores)."""
    return (int(fn.shape[0]), int(fn.shape[1]), int(num_cores))


def build_mhc_fn_normw_merge_backward(mhc_mult3: int, numel: int, num_cores: int):
    """prim_func(fn (M3,K) f32, normw (K,) f32, out_fn_grad (M3,K) f32, fn_grad (M3,K) f32 in/out,
    normw_grad (K,) f32 in/out).

    ``fn_grad[r] += og[r] * normw`` (fused multiply-add); ``s = og[0]*fn[0]``, ``s += og[r]*fn[r]`` for
    r = 1..M3-1 (fused), then ``normw_grad += s`` once. Each column block is owned by one task.
    """
    M3, K = mhc_mult3, numel
    W = _merge_width(_MERGE_BWD_WIDTHS, K, num_cores)
    n_blocks = K // W
    n_chunks = W // _LANES
    stages = _MERGE_STAGES

    @T.prim_func
    def mhc_fn_normw_merge_backward_asc(
        fn: T.Tensor[(M3, K), T.float32],
        normw: T.Tensor[(K,), T.float32],
        out_fn_grad: T.Tensor[(M3, K), T.float32],
        fn_grad: T.Tensor[(M3, K), T.float32],
        normw_grad: T.Tensor[(K,), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            fn_ub = T.alloc_shared((M3, W), T.float32)
            og_ub = T.alloc_shared((M3, W), T.float32)
            fg_ub = T.alloc_shared((M3, W), T.float32)
            nw_ub = T.alloc_shared((W,), T.float32)
            ng_ub = T.alloc_shared((W,), T.float32)
            T.annotate_buffer_versions({fn_ub: stages, og_ub: stages, fg_ub: stages, nw_ub: stages, ng_ub: stages})
            for (blk,) in T.Persistent([n_blocks], num_cores, core_id, group_size=1, num_stages=stages):
                base = blk * W
                T.copy(fn[:, base : base + W], fn_ub)
                T.copy(out_fn_grad[:, base : base + W], og_ub)
                T.copy(fn_grad[:, base : base + W], fg_ub)
                T.copy(normw[base : base + W], nw_ub)
                T.copy(normw_grad[base : base + W], ng_ub)
                with T.SimdVF():
                    acc = S.alloc_local((2,), T.float32)  # [row sum | fn_grad row]
                    for c in T.serial(n_chunks):
                        d = c * _LANES
                        nw = S.vld(nw_ub[d])
                        og0 = S.vld(og_ub[0, d])
                        acc[0] = S.vmul(og0, S.vld(fn_ub[0, d]))
                        acc[1] = S.vld(fg_ub[0, d])
                        S.vmula(acc[1], og0, nw)
                        S.vsts(fg_ub[0, d], acc[1])
                        for r in T.serial(1, M3):
                            og = S.vld(og_ub[r, d])
                            S.vmula(acc[0], og, S.vld(fn_ub[r, d]))
                            acc[1] = S.vld(fg_ub[r, d])
                            S.vmula(acc[1], og, nw)
                            S.vsts(fg_ub[r, d], acc[1])
                        S.vsts(ng_ub[d], S.vadd(S.vld(ng_ub[d]), acc[0]))
                T.copy(fg_ub, fn_grad[:, base : base + W])
                T.copy(ng_ub, normw_grad[base : base + W])

    return mhc_fn_normw_merge_backward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_fn_normw_merge_backward_kernel(mhc_mult3: int, numel: int, num_cores: int):
    from .._build import jit_compile

    key = (mhc_mult3, numel, num_cores)
    return jit_compile("mhc_fn_normw_merge_backward", key, build_mhc_fn_normw_merge_backward(*key))


def mhc_fn_normw_merge_backward(fn, normw, out_fn_grad, fn_grad, normw_grad) -> None:
    """fn, out_fn_grad (M3,K) f32, normw (K,) f32; fn_grad (M3,K) and normw_grad (K,) f32 updated in
    place (+=). Current stream, no sync."""
    kernel = get_mhc_fn_normw_merge_backward_kernel(*mhc_fn_normw_merge_backward_key(fn, num_vector_cores()))
    kernel(fn, normw, out_fn_grad, fn_grad, normw_grad)


# ---------------------------------------------------------------------------------------------------
# 13. mhc_pre_apply_mix_forward
# ---------------------------------------------------------------------------------------------------
_APPLY_FWD_STAGES = 3


def mhc_pre_apply_mix_forward_key(x, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(x.shape[-1]), int(x.shape[-2]), int(num_cores))


def build_mhc_pre_apply_mix_forward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,m,H) bf16, mix (T,m) f32, out (T,H) bf16): ``out = bf16(sum_i mix_i * x_i)``.

    NOTE: per stage and column: m bf16 inputs + 1 bf16 output = 10 bytes; 3 stages -> the whole row up
    to H = 7936 (H = 7168: 210 KiB), two tiles at H = 8192.
    """
    H, m = hidden_size, hc_mult
    _check(H, m)
    stages = _APPLY_FWD_STAGES
    h_blk = mhc_streaming_hidden_tile(H, 2 * (m + 1), stages)
    n_tiles = H // h_blk
    n_chunks = h_blk // _LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_forward_asc(
        x: T.Tensor[(num_tokens, m, H), T.bfloat16],
        mix: T.Tensor[(num_tokens, m), T.float32],
        out: T.Tensor[(num_tokens, H), T.bfloat16],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            mix_ub = T.alloc_shared((_PAD,), T.float32)
            o_ub = T.alloc_shared((h_blk,), T.bfloat16)
            T.annotate_buffer_versions({x_ub: stages, mix_ub: stages, o_ub: stages})
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * h_blk
                T.copy(mix[t, :], mix_ub[0:m])
                T.copy(x[t, :, h0 : h0 + h_blk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                with T.SimdVF():
                    w = S.alloc_local((m,), T.float32)
                    for i in T.unroll(m, explicit=True):
                        w[i] = S.vld(mix_ub[i], dist="BRC_B32")
                    acc = S.alloc_local((1,), T.float32)
                    for c in T.serial(n_chunks):
                        d = c * _LANES
                        acc[0] = S.vmul(_bf16_to_f32(x_ub[0, d]), w[0])
                        for i in T.unroll(1, m, explicit=True):
                            S.vmula(acc[0], _bf16_to_f32(x_ub[i, d]), w[i])
                        S.vsts(o_ub[d], _to_bf16(acc[0]), dist="PK_B32")
                T.copy(o_ub, out[t, h0 : h0 + h_blk])

    return mhc_pre_apply_mix_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_pre_apply_mix_forward_kernel(hidden_size: int, hc_mult: int, num_cores: int):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, num_cores)
    return jit_compile("mhc_pre_apply_mix_forward", key, build_mhc_pre_apply_mix_forward(*key))


def mhc_pre_apply_mix_forward(x, mix, out) -> None:
    """x (T,m,H) bf16, mix (T,m) f32 -> out (T,H) bf16 (overwritten). Current stream, no sync."""
    kernel = get_mhc_pre_apply_mix_forward_kernel(*mhc_pre_apply_mix_forward_key(x, num_vector_cores()))
    kernel(x, mix.reshape(x.shape[0], x.shape[1]), out)


# ---------------------------------------------------------------------------------------------------
# 14. mhc_pre_apply_mix_backward
# ---------------------------------------------------------------------------------------------------
_APPLY_BWD_STAGES = 2


def mhc_pre_apply_mix_backward_key(x, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(x.shape[-1]), int(x.shape[-2]), int(num_cores))


def build_mhc_pre_apply_mix_backward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(out_grad (T,H) bf16, x (T,m,H) bf16, mix (T,m) f32, x_grad (T,m,H) bf16 in/out,
    mix_grad (T,m) f32 out).

    One task per token (it owns the H reduction of ``mix_grad``), hidden tiles in ascending order.
    NOTE: per stage and column: og (2) + x (2m) + x_grad (2m) = 18 bytes; 2 stages -> the whole row up
    to H = 6656 (H = 5120: 180 KiB); H = 7168 and 8192 use two tiles (3584 / 4096 columns).
    """
    H, m = hidden_size, hc_mult
    _check(H, m)
    stages = _APPLY_BWD_STAGES
    h_blk = mhc_streaming_hidden_tile(H, 2 + 4 * m, stages)
    n_tiles = H // h_blk
    n_chunks = h_blk // _LANES
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_backward_asc(
        out_grad: T.Tensor[(num_tokens, H), T.bfloat16],
        x: T.Tensor[(num_tokens, m, H), T.bfloat16],
        mix: T.Tensor[(num_tokens, m), T.float32],
        x_grad: T.Tensor[(num_tokens, m, H), T.bfloat16],
        mix_grad: T.Tensor[(num_tokens, m), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            og_ub = T.alloc_shared((h_blk,), T.bfloat16)
            x_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            xg_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            mix_ub = T.alloc_shared((_PAD,), T.float32)
            acc_ub = T.alloc_shared((m, _LANES), T.float32)  # 64-lane partial sums of mix_grad
            mg_ub = T.alloc_shared((_PAD,), T.float32)
            T.annotate_buffer_versions({og_ub: stages, x_ub: stages, xg_ub: stages, mix_ub: stages, mg_ub: stages})
            for (t,) in T.Persistent([num_tokens], num_cores, core_id, group_size=1, num_stages=stages):
                T.copy(mix[t, :], mix_ub[0:m])
                with T.SimdVF():
                    zero = S.vdup(0.0, T.float32)
                    for i in T.unroll(m, explicit=True):
                        S.vsts(acc_ub[i, 0], zero)
                for ht in T.serial(n_tiles):
                    h0 = ht * h_blk
                    T.copy(out_grad[t, h0 : h0 + h_blk], og_ub)
                    T.copy(x[t, :, h0 : h0 + h_blk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                    T.copy(x_grad[t, :, h0 : h0 + h_blk], xg_ub)
                    with T.SimdVF():
                        w = S.alloc_local((m,), T.float32)
                        acc = S.alloc_local((m,), T.float32)
                        r = S.alloc_local((1,), T.float32)
                        for i in T.unroll(m, explicit=True):
                            w[i] = S.vld(mix_ub[i], dist="BRC_B32")
                            acc[i] = S.vld(acc_ub[i, 0])
                        for c in T.serial(n_chunks):
                            d = c * _LANES
                            og = _bf16_to_f32(og_ub[d])
                            for i in T.unroll(m, explicit=True):
                                S.vmula(acc[i], og, _bf16_to_f32(x_ub[i, d]))
                                r[0] = _bf16_to_f32(xg_ub[i, d])
                                S.vmula(r[0], og, w[i])
                                S.vsts(xg_ub[i, d], _to_bf16(r[0]), dist="PK_B32")
                        for i in T.unroll(m, explicit=True):
                            S.vsts(acc_ub[i, 0], acc[i])
                    T.copy(xg_ub, x_grad[t, :, h0 : h0 + h_blk])
                with T.SimdVF():
                    for i in T.unroll(m, explicit=True):
                        S.vsts(mg_ub[i], S.vcadd(S.vld(acc_ub[i, 0])), dist="ONEPT_B32")
                T.copy(mg_ub[0:m], mix_grad[t, :])

    return mhc_pre_apply_mix_backward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_pre_apply_mix_backward_kernel(hidden_size: int, hc_mult: int, num_cores: int):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, num_cores)
    return jit_compile("mhc_pre_apply_mix_backward", key, build_mhc_pre_apply_mix_backward(*key))


def mhc_pre_apply_mix_backward(out_grad, x, mix, x_grad, mix_grad) -> None:
    """out_grad (T,H) bf16, x (T,m,H) bf16, mix (T,m) f32; x_grad (T,m,H) bf16 accumulated in place;
    mix_grad (T,m) f32 (new, overwritten). Current stream, no sync."""
    kernel = get_mhc_pre_apply_mix_backward_kernel(*mhc_pre_apply_mix_backward_key(x, num_vector_cores()))
    n, m = x.shape[0], x.shape[1]
    kernel(out_grad, x, mix.reshape(n, m), x_grad, mix_grad.reshape(n, m))


# ---------------------------------------------------------------------------------------------------
# 15. mhc_post_forward
# ---------------------------------------------------------------------------------------------------
_POST_FWD_STAGES = 3


def mhc_post_forward_key(residual, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(residual.shape[-1]), int(residual.shape[-2]), int(num_cores))


def build_mhc_post_forward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,H) bf16, residual (T,m,H) bf16, post (T,m) f32, comb (T,m,m) f32, out (T,m,H) bf16).

    ``out[o] = bf16(post[o]*x + sum_{i=0..m-1} comb[i,o]*res[i])``: ``vmul`` of the post term, then
    ``vmula`` for i ascending (the instruction sequence other bit-exact Ascend paths must repeat).
    NOTE: per stage and column: x (2) + residual (2m) + out (2m) = 18 bytes; 3 stages -> the whole row
    up to H = 4416 (H = 4096: 216 KiB); H = 5120 -> 2560, H = 7168 -> 3584, H = 8192 -> 4096.
    """
    H, m = hidden_size, hc_mult
    _check(H, m)
    stages = _POST_FWD_STAGES
    h_blk = mhc_streaming_hidden_tile(H, 2 + 4 * m, stages)
    n_tiles = H // h_blk
    n_chunks = h_blk // _LANES
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
            post_ub = T.alloc_shared((_PAD,), T.float32)
            comb_ub = T.alloc_shared((m, m), T.float32)
            T.annotate_buffer_versions({x_ub: stages, res_ub: stages, out_ub: stages, post_ub: stages, comb_ub: stages})
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * h_blk
                with T.Task():
                    T.copy(post_layer_mix[t, :], post_ub[0:m])
                    T.copy(comb_res_mix[t, :, :], comb_ub)
                T.copy(x[t, h0 : h0 + h_blk], x_ub)
                T.copy(residual[t, :, h0 : h0 + h_blk], res_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                with T.SimdVF():
                    pw = S.alloc_local((m,), T.float32)
                    cw = S.alloc_local((m * m,), T.float32)
                    for o in T.unroll(m, explicit=True):
                        pw[o] = S.vld(post_ub[o], dist="BRC_B32")
                    for i in T.unroll(m, explicit=True):
                        for o in T.unroll(m, explicit=True):
                            cw[i * m + o] = S.vld(comb_ub[i, o], dist="BRC_B32")
                    rf = S.alloc_local((m,), T.float32)
                    acc = S.alloc_local((m,), T.float32)
                    for c in T.serial(n_chunks):
                        d = c * _LANES
                        xf = _bf16_to_f32(x_ub[d])
                        for i in T.unroll(m, explicit=True):
                            rf[i] = _bf16_to_f32(res_ub[i, d])
                        for o in T.unroll(m, explicit=True):
                            acc[o] = S.vmul(pw[o], xf)
                            for i in T.unroll(m, explicit=True):
                                S.vmula(acc[o], cw[i * m + o], rf[i])
                            S.vsts(out_ub[o, d], _to_bf16(acc[o]), dist="PK_B32")
                T.copy(out_ub, out[t, :, h0 : h0 + h_blk])

    return mhc_post_forward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_post_forward_kernel(hidden_size: int, hc_mult: int, num_cores: int):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, num_cores)
    return jit_compile("mhc_post_forward", key, build_mhc_post_forward(*key))


def mhc_post_forward(x, residual, post_layer_mix, comb_res_mix, out) -> None:
    """x (T,H) bf16, residual (T,m,H) bf16, post_layer_mix (T,m) f32 (or (T,m,1)), comb_res_mix (T,m,m)
    f32 -> out (T,m,H) bf16 (overwritten). Current stream, no sync."""
    kernel = get_mhc_post_forward_kernel(*mhc_post_forward_key(residual, num_vector_cores()))
    n, m = residual.shape[0], residual.shape[1]
    kernel(x, residual, post_layer_mix.reshape(n, m), comb_res_mix, out)


# ---------------------------------------------------------------------------------------------------
# 16. mhc_post_backward
# ---------------------------------------------------------------------------------------------------
_POST_BWD_STAGES = 2


def mhc_post_backward_key(residual, num_cores: int) -> tuple:
    """(H, m, num_cores); never T."""
    return (int(residual.shape[-1]), int(residual.shape[-2]), int(num_cores))


def build_mhc_post_backward(hidden_size: int, hc_mult: int, num_cores: int):
    """prim_func(x (T,H) bf16, residual (T,m,H) bf16, post (T,m) f32, comb (T,m,m) f32, d_o (T,m,H) bf16,
    d_x (T,H) bf16, d_residual (T,m,H) bf16, d_post (T,m) f32, d_comb (T,m,m) f32); all outputs written.

    ``d_x = bf16(sum_o post[o]*d_o[o])``, ``d_res[i] = bf16(sum_o comb[i,o]*d_o[o])`` (o ascending,
    ``vmul`` then ``vmula``); ``d_post[o] = sum_d d_o[o]*x``, ``d_comb[i,o] = sum_d res[i]*d_o[o]``:
    64-lane partial sums over the hidden tiles of the token (one task per token), one lane reduction.
    Pass A of a tile writes d_x and d_residual; pass B sweeps the tile once per source row (x, res_0..3)
    with the m partial sums of that row in registers.
    NOTE: per stage and column: d_o (2m) + x (2) + residual (2m) + d_x (2) + d_residual (2m) = 28 bytes;
    2 stages -> the whole row up to H = 4288 (H = 4096: 224 KiB); 5120 -> 2560, 7168 -> 3584.
    """
    H, m = hidden_size, hc_mult
    _check(H, m)
    stages = _POST_BWD_STAGES
    h_blk = mhc_streaming_hidden_tile(H, 4 + 6 * m, stages)
    n_tiles = H // h_blk
    n_chunks = h_blk // _LANES
    n_src = m + 1  # source rows of the reductions: x (row 0), then residual rows 0..m-1
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post_backward_asc(
        x: T.Tensor[(num_tokens, H), T.bfloat16],
        residual: T.Tensor[(num_tokens, m, H), T.bfloat16],
        post_layer_mix: T.Tensor[(num_tokens, m), T.float32],
        comb_res_mix: T.Tensor[(num_tokens, m, m), T.float32],
        d_o: T.Tensor[(num_tokens, m, H), T.bfloat16],
        d_x: T.Tensor[(num_tokens, H), T.bfloat16],
        d_residual: T.Tensor[(num_tokens, m, H), T.bfloat16],
        d_post: T.Tensor[(num_tokens, m), T.float32],
        d_comb: T.Tensor[(num_tokens, m, m), T.float32],
    ):
        with T.Kernel(num_cores) as core_id:
            do_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            src_ub = T.alloc_shared((n_src, h_blk), T.bfloat16)  # x row, then the m residual rows
            dx_ub = T.alloc_shared((h_blk,), T.bfloat16)
            dres_ub = T.alloc_shared((m, h_blk), T.bfloat16)
            post_ub = T.alloc_shared((_PAD,), T.float32)
            comb_ub = T.alloc_shared((m, m), T.float32)
            acc_ub = T.alloc_shared((n_src, m, _LANES), T.float32)  # partial sums: [x | res_i] x o
            dpost_ub = T.alloc_shared((_PAD,), T.float32)
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
                    T.copy(d_o[t, :, h0 : h0 + h_blk], do_ub)
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
                        # pass A: d_x and d_residual of the tile
                        for c in T.serial(n_chunks):
                            d = c * _LANES
                            for o in T.unroll(m, explicit=True):
                                g[o] = _bf16_to_f32(do_ub[o, d])
                            r[0] = S.vmul(pw[0], g[0])
                            for o in T.unroll(1, m, explicit=True):
                                S.vmula(r[0], pw[o], g[o])
                            S.vsts(dx_ub[d], _to_bf16(r[0]), dist="PK_B32")
                            for i in T.unroll(m, explicit=True):
                                r[0] = S.vmul(cw[i * m], g[0])
                                for o in T.unroll(1, m, explicit=True):
                                    S.vmula(r[0], cw[i * m + o], g[o])
                                S.vsts(dres_ub[i, d], _to_bf16(r[0]), dist="PK_B32")
                        # pass B: partial sums of d_post (src row 0) and d_comb (src rows 1..m)
                        acc = S.alloc_local((m,), T.float32)
                        for s in T.unroll(n_src, explicit=True):
                            for o in T.unroll(m, explicit=True):
                                acc[o] = S.vld(acc_ub[s, o, 0])
                            for c in T.serial(n_chunks):
                                d = c * _LANES
                                sf = _bf16_to_f32(src_ub[s, d])
                                for o in T.unroll(m, explicit=True):
                                    S.vmula(acc[o], sf, _bf16_to_f32(do_ub[o, d]))
                            for o in T.unroll(m, explicit=True):
                                S.vsts(acc_ub[s, o, 0], acc[o])
                    with T.Task():
                        T.copy(dx_ub, d_x[t, h0 : h0 + h_blk])
                        T.copy(dres_ub, d_residual[t, :, h0 : h0 + h_blk])
                with T.SimdVF():
                    for o in T.unroll(m, explicit=True):
                        S.vsts(dpost_ub[o], S.vcadd(S.vld(acc_ub[0, o, 0])), dist="ONEPT_B32")
                    for i in T.unroll(m, explicit=True):
                        for o in T.unroll(m, explicit=True):
                            S.vsts(dcomb_ub[i, o], S.vcadd(S.vld(acc_ub[1 + i, o, 0])), dist="ONEPT_B32")
                with T.Task():
                    T.copy(dpost_ub[0:m], d_post[t, :])
                    T.copy(dcomb_ub, d_comb[t, :, :])

    return mhc_post_backward_asc


@functools.lru_cache(maxsize=None)
def get_mhc_post_backward_kernel(hidden_size: int, hc_mult: int, num_cores: int):
    from .._build import jit_compile

    key = (hidden_size, hc_mult, num_cores)
    return jit_compile("mhc_post_backward", key, build_mhc_post_backward(*key))


def mhc_post_backward(x, residual, post_layer_mix, comb_res_mix, d_o, d_x, d_residual, d_post, d_comb) -> None:
    """x (T,H) bf16, residual/d_o (T,m,H) bf16, post (T,m) f32, comb (T,m,m) f32 -> d_x (T,H) bf16,
    d_residual (T,m,H) bf16, d_post (T,m) f32 (or (T,m,1)), d_comb (T,m,m) f32 (all overwritten).
    Current stream, no sync."""
    kernel = get_mhc_post_backward_kernel(*mhc_post_backward_key(residual, num_vector_cores()))
    n, m = residual.shape[0], residual.shape[1]
    kernel(x, residual, post_layer_mix.reshape(n, m), comb_res_mix, d_o, d_x, d_residual, d_post.reshape(n, m), d_comb)


# ---------------------------------------------------------------------------------------------------
# lowering cases
# ---------------------------------------------------------------------------------------------------
_CASE_NUM_CORES = 64  # only for CPU lowering checks (launchers read the real count)
_CASE_MHC_MULT3 = 24


def lowering_cases(hidden_size: int, hc_mult: int = 4, num_cores: int = _CASE_NUM_CORES) -> dict:
    """Every kernel variant of this module at ``hidden_size`` -> prim_func (for CPU lowering checks)."""
    H, m = hidden_size, hc_mult
    K = m * H
    return {
        "expand_to_mhc_forward": build_expand_to_mhc_forward(H, m, num_cores),
        "expand_to_mhc_backward": build_expand_to_mhc_backward(H, m, num_cores),
        "mhc_fn_normw_merge_forward": build_mhc_fn_normw_merge_forward(_CASE_MHC_MULT3, K, num_cores),
        "mhc_fn_normw_merge_backward": build_mhc_fn_normw_merge_backward(_CASE_MHC_MULT3, K, num_cores),
        "mhc_pre_apply_mix_forward": build_mhc_pre_apply_mix_forward(H, m, num_cores),
        "mhc_pre_apply_mix_backward": build_mhc_pre_apply_mix_backward(H, m, num_cores),
        "mhc_post_forward": build_mhc_post_forward(H, m, num_cores),
        "mhc_post_backward": build_mhc_post_backward(H, m, num_cores),
    }
