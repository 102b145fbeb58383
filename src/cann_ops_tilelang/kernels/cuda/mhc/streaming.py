"""CUDA (TileLang) kernels of the bandwidth-bound mHC streaming ops (OPS.md B.2.1, B.2.2, B.2.7, B.2.8).

Ops: ``expand_to_mhc_forward/_backward``, ``mhc_fn_normw_merge_forward/_backward``,
``mhc_pre_apply_mix_forward/_backward`` and ``mhc_post_forward/_backward``.

Every kernel is written at thread level: each thread owns 8-element column vectors (one 16-byte
access per bf16 row, two float4 per fp32 row), issues all loads of a vector before using them,
computes in fp32 and rounds to bf16 once at the store. Kernel parameters are ``__restrict__`` (the
TileLang codegen emits it), so ``nvcc`` may hoist the loads of later vectors above earlier stores.

Schedules:

* element-wise ops without per-token scalars (expand) run a flat grid over the ``T * H / 8`` vectors
  of the token-major tensors (2 vectors per thread, strided by the CTA size so that every
  warp access is coalesced);
* element-wise ops with per-token scalars (apply-mix forward, post forward) run a 1-D grid over
  ``(token, column chunk)`` pairs, chunks fastest, so that consecutive CTAs read consecutive chunks of
  the same rows; a thread loads its token's scalars once (uniform loads, broadcast);
* per-token reductions (apply-mix backward, post backward) run one CTA per token (up to 512 threads
  for the apply-mix backward; the post backward with 128 threads where ``H % 1024 == 0``, see
  ``_post_backward_layout``, its next vectors staged by a thread-private cp.async ring where the
  layout is unguarded with >= 2 vectors per thread, see ``_post_backward_schedule``): each thread keeps
  fp32 partial sums of its columns, the CTA reduces them with warp shuffles and one shared-memory
  step in a fixed order (deterministic, no atomics);
* the (M3, K) fp32 merge backward splits the rows over thread groups, parks the rounded products in
  shared memory and sums them per column in row order (the reference's rounding, step for step).

Supported sizes: ``H % 64 == 0`` (every thread access is a full 8-element vector; when ``H / 8`` has
no suitable multiple-of-32 divisor the last vector slots are guarded), any token count ``T > 0``,
``T * m * H < 2**31`` (32-bit element offsets). ``m = 4`` everywhere; the forward kernels and the
apply-mix backward are generic in ``m``; ``mhc_post_backward`` is validated for ``m = 4`` only.
"""

import functools

import torch

from .._build import jit_compile, smem_budget_bytes

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
    "streaming_lowering_cases",
]

_VEC = 8  # bf16 elements per 16-byte access
# Flat grid (expand): (threads per CTA, vectors per thread) of the forward and of the backward.
# NOTE measured on the H200 (cupti, cold L2, 3 interleaved rounds): expand forward at 128 x 2 against
# 256 x 2: 5.90 / 9.38 us vs 5.93 / 9.47 us at T = 512 and 85.4 / 148.2 us vs 87.0 / 149.4 us at
# T = 8192 (H = 4096 / 7168); 256 x 1 and 512 x 1 were faster at T = 8192 (84.0 / 145.9 us) but put
# T = 512, H = 7168 in two waves (10.2 us). The backward (4 loads per vector) stays at 256 x 2: 128 x 4,
# 256 x 1 and 512 x 1 were level or slower (12.9 / 12.0 / 11.9 us vs 12.0 us at T = 512, H = 7168).
# Forward with 4 or 8 vectors per thread (the peer's 32 x 128 tiles move 4 per thread), against 128 x 2:
# 128 x 4 / 64 x 4 / 256 x 4 / 64 x 8 at T = 512 6.05 / 5.81 / 6.19 / 5.91 vs 5.80 us (H = 4096) and
# 9.70 / 9.77 / 10.15 / 9.91 vs 9.39 us (H = 7168), 1-2 % slower at T = 8192; the peer 6.15 / 10.08 us
# in those interleaved rounds (the benchmark file has it at 5.64 / 9.23 us, timed once after eager and
# inductor).
_FLAT_FWD = (128, 2)
_FLAT_BWD = (256, 2)
# (token, column chunk) CTAs of the apply-mix and post forward: at most this many threads ...
_APPLY_MIX_FWD_MAX_THREADS = 128
_POST_FWD_MAX_THREADS = 256
_ROW_NVC = 2  # ... and the whole row in one CTA where that takes at most _ROW_NVC vectors per thread, else one
# NOTE measured on the H200 (cupti, cold L2, 3 interleaved rounds, T = 512 / 8192): the grid order matters
# most. With the chunks of one token in consecutive CTAs (1-D grid, chunks fastest) instead of the tokens
# of one chunk (2-D grid, tokens on x): apply-mix forward at H = 7168, 128 threads x 1 vector (7 chunks)
# 11.79 / 138.25 us against 12.04 / 142.96 us (the previous 224 x 2 layout 12.01 / 139.67, the peer
# 11.78 / 138.29); at H = 4096 (4 chunks) 7.43 / 81.59 against 7.85 / 83.59 (previous 7.54 / 81.57, peer
# 7.52 / 81.47). Post forward at H = 7168, 224 x 1 (4 chunks): 18.31 / 246.63 us against 18.79 / 258.21
# (previous 224 x 2: 18.61 / 256.50, peer 19.33 / 256.59); at H = 4096 the whole row per CTA (256 x 2)
# stays best: 11.36 / 144.69 against 11.68 / 144.68 for 256 x 1.
_RED_MAX_THREADS = 256  # upper bound of the post backward's one-token CTA where H % 1024 != 0
# Post backward (unguarded layouts, >= 2 vectors per thread): depth of the thread-private cp.async ring of
# the next vectors (0 = plain register loads). NOTE measured on the H200 (cupti, 5 interleaved rounds,
# bitwise equal to the plain loads at T in {1, 509, 8192}): T = 512 17.63 / 28.43 us (3 stages) against
# 18.05 / 28.92 (2) and 18.38 / 29.22 (plain loads) at H = 4096 / 7168, the peer 18.04 / 28.88; T = 8192
# 222.7 / 389.9 against 223.5 / 390.5 (plain), the peer 225.1 / 393.6 (before the barrier that keeps
# ``red`` off the ring was added); harness after it, T = 512: 16.65 / 27.08 us, the peer 17.35 / 27.93.
# With plain loads nvcc keeps about one vector's 9 loads in flight per thread (127 registers); the ring
# keeps three (54 KiB of shared memory per 128-thread CTA, 4 CTAs per SM, 113-121 registers).
_POST_BWD_STAGES = 3
# shared memory of one H200 SM (sm_90): one CTA's largest opt-in plus the 1 KiB every resident CTA reserves
_SM_SMEM_BYTES = smem_budget_bytes("sm_90a") + 1024
# NOTE measured on the H200 (cupti, cold L2, 3 interleaved rounds): the apply-mix backward with CTAs of up
# to 512 threads (1-2 vectors per thread) at 2 CTAs per SM, against up to 256 threads at the register
# budget of 3 CTAs (which spilled at H = 5120 / 7168): T = 512 15.80 / 18.84 / 25.33 us vs 15.85 /
# 21.32 / 27.42 us, T = 8192 202.5 / 252.1 / 352.8 us vs 203.1 / 277.0 / 363.7 us (H = 4096 / 5120 /
# 7168; the peer 16.06 / 19.05 / 25.80 and 205.0 / 255.2 / 357.7 us). The <= 256-thread layout at
# 2 CTAs per SM (no spill either) came second (25.90 / 353.0 us at H = 7168).
_APPLY_MIX_BWD_MAX_THREADS = 512
_NORMW_THREADS = 128  # fp32 (M3, K) merge forward: 128 threads of _NORMW_VECS float4 columns each, ...
_NORMW_VECS = 4
# NOTE ... the M3 rows of a column block in consecutive CTAs (they share the normw block). Measured on the
# H200 (K = 16384 / 28672): 2.29 / 2.99 us against 2.40 / 3.27 us for one float4 per thread, row by row
# (2 float4: 2.40 / 3.08; 256 threads: 2.34-2.42 / 3.06-3.20; the peer 2.44 / 3.08 in the same run).
# NOTE measured on the H200 (K = 16384 / 28672): 8 row groups x 16 float4 column groups (128 threads,
# 64 columns per CTA) put the whole merge backward in flight at once: 3.9 / 5.2 us, against 7.2 / 7.8 us
# for one thread walking all 24 rows of its column group (and 4.2 / 5.3 us for the peer).
_NORMW_BWD_ROW_GROUPS = 8
_NORMW_BWD_COL_GROUPS = 16


def _min_blocks(threads: int, regs: int) -> int:
    """Resident CTAs per SM for a register budget of ``regs`` per thread (65536 registers per SM)."""
    return max(1, min(16, 65536 // (regs * threads)))


def _check_hidden(op: str, hidden_size: int) -> None:
    if hidden_size <= 0 or hidden_size % 64 != 0:
        raise ValueError(f"{op}: hidden_size must be a positive multiple of 64, got {hidden_size}")


def _row_layout(hidden_size: int, max_threads: int) -> tuple[int, int, bool]:
    """Layout ``(threads, nv, guarded)`` covering one token row of ``H / 8`` vectors.

    ``threads`` is the largest multiple of 32 that divides ``H / 8`` and is at most ``max_threads``
    (then ``nv = H / 8 / threads`` vectors per thread, no guard); if ``H / 8`` has no such divisor
    (``H % 256 != 0``), ``threads = min(max_threads, align32(H / 8))`` and the last slots are guarded.

    NOTE tuned for H200: up to 256 threads (the post forward, and the post backward where ``H % 1024 != 0``),
    the model sizes give (threads, nv) = (160, 1) at H = 1280, (160, 2) at 2560, (256, 2) at 4096,
    (160, 4) at 5120 and (224, 4) at 7168, i.e. 5-7 warps per CTA; the apply-mix forward takes up to 128
    threads, its backward up to 512.
    """
    nvec = hidden_size // _VEC
    best = 0
    for threads in range(32, max_threads + 1, 32):
        if nvec % threads == 0:
            best = threads
    if best:
        return best, nvec // best, False
    threads = min(max_threads, -(-nvec // 32) * 32)
    nv = -(-nvec // threads)
    return threads, nv, nv * threads != nvec


def _apply_mix_forward_layout(hidden_size: int) -> tuple[int, int, bool]:
    """Layout of the apply-mix forward's (token, chunk) CTA: :func:`_row_layout` up to
    ``_APPLY_MIX_FWD_MAX_THREADS`` (128) threads, unless that gives fewer than 128 (``H / 8`` without a
    multiple-of-32 divisor in 128..: H = 1280 would get 32-thread CTAs, 2560 64-thread ones), then up to
    ``_POST_FWD_MAX_THREADS`` (160 threads at H = 1280 and 2560, the layout before the 1-D grid)."""
    layout = _row_layout(hidden_size, _APPLY_MIX_FWD_MAX_THREADS)
    return layout if layout[0] >= _APPLY_MIX_FWD_MAX_THREADS else _row_layout(hidden_size, _POST_FWD_MAX_THREADS)


def _row_chunk(nv: int) -> int:
    """Vectors per thread of a ``(token, column chunk)`` CTA whose layout puts ``nv`` vectors per thread on
    the row: all of them (one chunk per token) where ``nv <= _ROW_NVC``, else one (``nv`` chunks)."""
    return nv if nv <= _ROW_NVC else 1


# ----------------------------------------------------------------------------------------------------
# expand_to_mhc_forward / _backward (B.2.1)
# ----------------------------------------------------------------------------------------------------


def expand_to_mhc_forward_key(x: torch.Tensor, out: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m)`` (never the token count)."""
    hidden_size = int(x.shape[-1])
    _check_hidden("expand_to_mhc_forward", hidden_size)
    return (hidden_size, int(out.shape[1]))


def build_expand_to_mhc_forward(hidden_size: int, hc_mult: int):
    """Builds the expand forward: ``out[t, i, :] = x[t, :]`` (bit copy).

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(x (T, H) bf16, out (T, m, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    nvec = H // _VEC
    threads, nvt = _FLAT_FWD
    bf16 = T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def expand_to_mhc_forward_cuda(x: T.Tensor((num_tokens, H), bf16), out: T.Tensor((num_tokens, m, H), bf16)):
        with T.Kernel(T.ceildiv(num_tokens * nvec, threads * nvt), threads=threads) as bid:
            T.annotate_min_blocks_per_sm(_min_blocks(threads, 64))
            tid = T.get_thread_binding()
            xr = T.alloc_local((nvt, _VEC), bf16)
            total = num_tokens * nvec
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for k in T.vectorized(_VEC):
                        xr[j, k] = x[((bid * nvt + j) * threads + tid) // nvec, (((bid * nvt + j) * threads + tid) % nvec) * _VEC + k]
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for i in T.unroll(m):
                        for k in T.vectorized(_VEC):
                            out[((bid * nvt + j) * threads + tid) // nvec, i, (((bid * nvt + j) * threads + tid) % nvec) * _VEC + k] = xr[j, k]

    return expand_to_mhc_forward_cuda


@functools.lru_cache(maxsize=None)
def get_expand_to_mhc_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`expand_to_mhc_forward_key`), built once per key."""
    return jit_compile("expand_to_mhc_forward", key, build_expand_to_mhc_forward(*key))


def expand_to_mhc_forward(x: torch.Tensor, out: torch.Tensor) -> None:
    """Launches ``out[t, i, :] = x[t, :]`` on the current stream (inputs validated upstream).

    Args:
        x: ``(T, H)`` bf16, ``T > 0``, ``H % 64 == 0``.
        out: ``(T, m, H)`` bf16, written.
    """
    kernel = get_expand_to_mhc_forward_kernel(*expand_to_mhc_forward_key(x, out))
    kernel(x, out)


def expand_to_mhc_backward_key(out_grad: torch.Tensor, x_grad: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m)`` (never the token count)."""
    hidden_size = int(out_grad.shape[-1])
    _check_hidden("expand_to_mhc_backward", hidden_size)
    return (hidden_size, int(out_grad.shape[1]))


def build_expand_to_mhc_backward(hidden_size: int, hc_mult: int):
    """Builds the expand backward: ``x_grad = bf16(sum_i f32(out_grad[t, i]))`` (i ascending, overwrite).

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(out_grad (T, m, H) bf16, x_grad (T, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    nvec = H // _VEC
    threads, nvt = _FLAT_BWD
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def expand_to_mhc_backward_cuda(out_grad: T.Tensor((num_tokens, m, H), bf16), x_grad: T.Tensor((num_tokens, H), bf16)):
        with T.Kernel(T.ceildiv(num_tokens * nvec, threads * nvt), threads=threads) as bid:
            T.annotate_min_blocks_per_sm(_min_blocks(threads, 64))
            tid = T.get_thread_binding()
            gr = T.alloc_local((nvt, m, _VEC), bf16)
            acc = T.alloc_local((_VEC,), f32)
            total = num_tokens * nvec
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for i in T.unroll(m):
                        for k in T.vectorized(_VEC):
                            gr[j, i, k] = out_grad[((bid * nvt + j) * threads + tid) // nvec, i, (((bid * nvt + j) * threads + tid) % nvec) * _VEC + k]
            for j in T.unroll(nvt):
                if (bid * nvt + j) * threads + tid < total:
                    for k in T.unroll(_VEC):
                        acc[k] = T.cast(gr[j, 0, k], f32)
                        for i in T.unroll(1, m):
                            acc[k] += T.cast(gr[j, i, k], f32)
                    for k in T.vectorized(_VEC):
                        x_grad[((bid * nvt + j) * threads + tid) // nvec, (((bid * nvt + j) * threads + tid) % nvec) * _VEC + k] = T.cast(acc[k], bf16)

    return expand_to_mhc_backward_cuda


@functools.lru_cache(maxsize=None)
def get_expand_to_mhc_backward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`expand_to_mhc_backward_key`), built once per key."""
    return jit_compile("expand_to_mhc_backward", key, build_expand_to_mhc_backward(*key))


def expand_to_mhc_backward(out_grad: torch.Tensor, x_grad: torch.Tensor) -> None:
    """Launches ``x_grad = bf16(sum_i f32(out_grad[:, i]))`` on the current stream (overwrites ``x_grad``).

    Args:
        out_grad: ``(T, m, H)`` bf16, ``T > 0``, ``H % 64 == 0``.
        x_grad: ``(T, H)`` bf16, written.
    """
    kernel = get_expand_to_mhc_backward_kernel(*expand_to_mhc_backward_key(out_grad, x_grad))
    kernel(out_grad, x_grad)


# ----------------------------------------------------------------------------------------------------
# mhc_fn_normw_merge_forward / _backward (B.2.2)
# ----------------------------------------------------------------------------------------------------


def mhc_fn_normw_merge_forward_key(fn: torch.Tensor, normw: torch.Tensor, out_fn: torch.Tensor) -> tuple:
    """Compile-time key ``(M3, K)``."""
    rows, cols = (int(s) for s in fn.shape)
    if cols % 4 != 0:
        raise ValueError(f"mhc_fn_normw_merge_forward: K must be a multiple of 4, got {cols}")
    return (rows, cols)


def build_mhc_fn_normw_merge_forward(rows: int, cols: int):
    """Builds ``out_fn[r, k] = fn[r, k] * normw[k]``.

    Args:
        rows: ``M3``.
        cols: ``K`` (multiple of 4; the column tail is guarded).

    Returns:
        ``T.prim_func(fn (M3, K) f32, normw (K,) f32, out_fn (M3, K) f32)``.
    """
    from tilelang import language as T

    M3, K = rows, cols
    threads, nv = _NORMW_THREADS, _NORMW_VECS
    nq = K // 4
    f32 = T.float32

    @T.prim_func
    def mhc_fn_normw_merge_forward_cuda(fn: T.Tensor((M3, K), f32), normw: T.Tensor((K,), f32), out_fn: T.Tensor((M3, K), f32)):
        # (M3, K) is at most 24 x 32768 floats (3 MiB); CTA (bx, r) = bid (rows fastest) owns the
        # nv float4 column groups bx * nv * threads + j * threads + tid (j < nv) of row r.
        with T.Kernel(T.ceildiv(nq, threads * nv) * M3, threads=threads) as bid:
            T.annotate_min_blocks_per_sm(_min_blocks(threads, 64))
            r = bid % M3
            bx = bid // M3
            tid = T.get_thread_binding()
            a = T.alloc_local((nv, 4), f32)
            w = T.alloc_local((nv, 4), f32)
            for j in T.unroll(nv):
                q = (bx * nv + j) * threads + tid  # float4 column group
                if q < nq:
                    for k in T.vectorized(4):
                        a[j, k] = fn[r, q * 4 + k]
                    for k in T.vectorized(4):
                        w[j, k] = normw[q * 4 + k]
            for j in T.unroll(nv):
                q = (bx * nv + j) * threads + tid
                if q < nq:
                    for k in T.vectorized(4):
                        out_fn[r, q * 4 + k] = a[j, k] * w[j, k]

    return mhc_fn_normw_merge_forward_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_fn_normw_merge_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_fn_normw_merge_forward_key`), built once per key."""
    return jit_compile("mhc_fn_normw_merge_forward", key, build_mhc_fn_normw_merge_forward(*key))


def mhc_fn_normw_merge_forward(fn: torch.Tensor, normw: torch.Tensor, out_fn: torch.Tensor) -> None:
    """Launches ``out_fn = fn * normw`` (row broadcast) on the current stream.

    Args:
        fn: ``(M3, K)`` f32, ``K % 4 == 0``.
        normw: ``(K,)`` f32.
        out_fn: ``(M3, K)`` f32, written.
    """
    kernel = get_mhc_fn_normw_merge_forward_kernel(*mhc_fn_normw_merge_forward_key(fn, normw, out_fn))
    kernel(fn, normw, out_fn)


def mhc_fn_normw_merge_backward_key(fn: torch.Tensor, normw: torch.Tensor, out_fn_grad: torch.Tensor) -> tuple:
    """Compile-time key ``(M3, K)``."""
    rows, cols = (int(s) for s in fn.shape)
    if cols % 4 != 0:
        raise ValueError(f"mhc_fn_normw_merge_backward: K must be a multiple of 4, got {cols}")
    return (rows, cols)


def build_mhc_fn_normw_merge_backward(rows: int, cols: int):
    """Builds the merge backward (both outputs accumulate in place).

    ``fn_grad[r, k] += out_fn_grad[r, k] * normw[k]``;
    ``normw_grad[k] += sum_{r=0..M3-1} out_fn_grad[r, k] * fn[r, k]`` (rows in order, added once).
    Deterministic, no atomics.

    A CTA covers ``4 * _NORMW_BWD_COL_GROUPS`` columns and all ``M3`` rows, split over
    ``_NORMW_BWD_ROW_GROUPS`` thread groups so that every thread issues all its loads
    (``ceil(M3 / _NORMW_BWD_ROW_GROUPS)`` rows x 3 float4) at once; each thread updates ``fn_grad``
    (product rounded before the add, as the reference does) and parks the rounded products
    ``out_fn_grad * fn`` in shared memory; after one barrier, one thread per column
    sums the ``M3`` products in row order and adds the sum to ``normw_grad``.

    Args:
        rows: ``M3``.
        cols: ``K`` (multiple of 4; the column tail is guarded).

    Returns:
        ``T.prim_func(fn, normw, out_fn_grad, fn_grad, normw_grad)`` (shapes as the forward).
    """
    from tilelang import language as T

    M3, K = rows, cols
    nq = K // 4
    f32 = T.float32
    row_groups, col_groups = _NORMW_BWD_ROW_GROUPS, _NORMW_BWD_COL_GROUPS
    threads = row_groups * col_groups
    rpg = -(-M3 // row_groups)  # rows per thread group (contiguous block)
    ragged = rpg * row_groups != M3
    ncols = 4 * col_groups

    @T.prim_func
    def mhc_fn_normw_merge_backward_cuda(
        fn: T.Tensor((M3, K), f32),
        normw: T.Tensor((K,), f32),
        out_fn_grad: T.Tensor((M3, K), f32),
        fn_grad: T.Tensor((M3, K), f32),
        normw_grad: T.Tensor((K,), f32),
    ):
        # NOTE: (24, K) with K <= 32768 is at most 9 MiB in all: with every thread's loads issued up
        # front, the whole problem is in flight at once (K / ncols CTAs, ~1-2 per SM).
        with T.Kernel(T.ceildiv(nq, col_groups), threads=threads) as bx:
            tid = T.get_thread_binding()
            lane = tid % col_groups
            rg = tid // col_groups
            w = T.alloc_local((4,), f32)
            g = T.alloc_local((rpg, 4), f32)
            a = T.alloc_local((rpg, 4), f32)
            fg = T.alloc_local((rpg, 4), f32)
            acc = T.alloc_local((1,), f32)
            prod = T.alloc_shared((M3, ncols), f32)
            if bx * col_groups + lane < nq:
                for u in T.unroll(rpg):
                    if (not ragged) or (rg * rpg + u < M3):
                        for k in T.vectorized(4):
                            g[u, k] = out_fn_grad[rg * rpg + u, (bx * col_groups + lane) * 4 + k]
                        for k in T.vectorized(4):
                            a[u, k] = fn[rg * rpg + u, (bx * col_groups + lane) * 4 + k]
                        for k in T.vectorized(4):
                            fg[u, k] = fn_grad[rg * rpg + u, (bx * col_groups + lane) * 4 + k]
                for k in T.vectorized(4):
                    w[k] = normw[(bx * col_groups + lane) * 4 + k]
                for u in T.unroll(rpg):
                    if (not ragged) or (rg * rpg + u < M3):
                        # results formed in registers first so that both stores stay 16-byte vectors
                        for k in T.unroll(4):
                            fg[u, k] = fg[u, k] + T.ieee_mul(g[u, k], w[k])
                            a[u, k] = T.ieee_mul(g[u, k], a[u, k])
                        for k in T.vectorized(4):
                            fn_grad[rg * rpg + u, (bx * col_groups + lane) * 4 + k] = fg[u, k]
                        for k in T.vectorized(4):
                            prod[rg * rpg + u, lane * 4 + k] = a[u, k]
            T.sync_threads()
            if tid < ncols:
                if bx * ncols + tid < K:
                    acc[0] = prod[0, tid]
                    for r in T.unroll(1, M3):
                        acc[0] += prod[r, tid]
                    normw_grad[bx * ncols + tid] = normw_grad[bx * ncols + tid] + acc[0]

    return mhc_fn_normw_merge_backward_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_fn_normw_merge_backward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_fn_normw_merge_backward_key`), built once per key."""
    return jit_compile("mhc_fn_normw_merge_backward", key, build_mhc_fn_normw_merge_backward(*key))


def mhc_fn_normw_merge_backward(
    fn: torch.Tensor, normw: torch.Tensor, out_fn_grad: torch.Tensor, fn_grad: torch.Tensor, normw_grad: torch.Tensor
) -> None:
    """Launches the merge backward on the current stream; ``fn_grad`` and ``normw_grad`` accumulate (``+=``).

    Args:
        fn: ``(M3, K)`` f32.
        normw: ``(K,)`` f32.
        out_fn_grad: ``(M3, K)`` f32.
        fn_grad: ``(M3, K)`` f32, updated in place.
        normw_grad: ``(K,)`` f32, updated in place.
    """
    kernel = get_mhc_fn_normw_merge_backward_kernel(*mhc_fn_normw_merge_backward_key(fn, normw, out_fn_grad))
    kernel(fn, normw, out_fn_grad, fn_grad, normw_grad)


# ----------------------------------------------------------------------------------------------------
# mhc_pre_apply_mix_forward / _backward (B.2.7)
# ----------------------------------------------------------------------------------------------------


def mhc_pre_apply_mix_forward_key(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m)`` (never the token count)."""
    _, hc_mult, hidden_size = (int(s) for s in x.shape)
    _check_hidden("mhc_pre_apply_mix_forward", hidden_size)
    return (hidden_size, hc_mult)


def build_mhc_pre_apply_mix_forward(hidden_size: int, hc_mult: int):
    """Builds ``out[t, d] = bf16(sum_{i=0..m-1} mix[t, i] * f32(x[t, i, d]))`` (i ascending, starting
    from the product ``mix_0 * x_0``).

    1-D grid over ``(token, column chunk)``, chunks fastest; a thread loads its token's ``m`` mixes once
    and ``m`` 16-byte vectors per column vector.

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(x (T, m, H) bf16, mix (T, m) f32, out (T, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    threads, nv, guarded = _apply_mix_forward_layout(H)
    nvc = _row_chunk(nv)
    chunks = nv // nvc
    nvec = H // _VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_forward_cuda(
        x: T.Tensor((num_tokens, m, H), bf16), mix: T.Tensor((num_tokens, m), f32), out: T.Tensor((num_tokens, H), bf16)
    ):
        # One grid dimension (up to 2**31 - 1 CTAs; y is limited to 65535), the chunks of a token adjacent.
        with T.Kernel(num_tokens * chunks, threads=threads) as bid:
            t = bid // chunks
            cb = bid % chunks
            T.annotate_min_blocks_per_sm(_min_blocks(threads, 64))
            tid = T.get_thread_binding()
            mx = T.alloc_local((m,), f32)
            xr = T.alloc_local((nvc, m, _VEC), bf16)
            acc = T.alloc_local((_VEC,), f32)
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for i in T.unroll(m):
                        for k in T.vectorized(_VEC):
                            xr[j, i, k] = x[t, i, ((cb * nvc + j) * threads + tid) * _VEC + k]
            for i in T.unroll(m):
                mx[i] = mix[t, i]
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for k in T.unroll(_VEC):
                        acc[k] = mx[0] * T.cast(xr[j, 0, k], f32)
                        for i in T.unroll(1, m):
                            acc[k] += mx[i] * T.cast(xr[j, i, k], f32)
                    for k in T.vectorized(_VEC):
                        out[t, ((cb * nvc + j) * threads + tid) * _VEC + k] = T.cast(acc[k], bf16)

    return mhc_pre_apply_mix_forward_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_pre_apply_mix_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_pre_apply_mix_forward_key`), built once per key."""
    return jit_compile("mhc_pre_apply_mix_forward", key, build_mhc_pre_apply_mix_forward(*key))


def mhc_pre_apply_mix_forward(x: torch.Tensor, mix: torch.Tensor, out: torch.Tensor) -> None:
    """Launches the pre-apply-mix forward on the current stream (inputs validated upstream).

    Args:
        x: ``(T, m, H)`` bf16 residual, ``T > 0``, ``H % 64 == 0``.
        mix: ``(T, m)`` f32.
        out: ``(T, H)`` bf16, written.
    """
    kernel = get_mhc_pre_apply_mix_forward_kernel(*mhc_pre_apply_mix_forward_key(x, mix, out))
    kernel(x, mix, out)


def mhc_pre_apply_mix_backward_key(out_grad: torch.Tensor, x: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m)`` (never the token count)."""
    _, hc_mult, hidden_size = (int(s) for s in x.shape)
    _check_hidden("mhc_pre_apply_mix_backward", hidden_size)
    return (hidden_size, hc_mult)


def build_mhc_pre_apply_mix_backward(hidden_size: int, hc_mult: int):
    """Builds the pre-apply-mix backward (one CTA per token).

    ``x_grad[t, i, d] = bf16(f32(x_grad[t, i, d]) + mix[t, i] * f32(out_grad[t, d]))`` (in place; the
    product is rounded before the add, as the contract writes it: nvcc would otherwise contract the two
    into one FMA, whose single rounding moves the bf16 result by an ulp of the prior content) and
    ``mix_grad[t, i] = sum_d f32(out_grad[t, d]) * f32(x[t, i, d])``: per-thread fp32 partials over the
    thread's columns (vector slots ascending), a butterfly warp reduction, then one thread sums the warp
    results in ascending warp order (deterministic).

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(out_grad (T, H) bf16, x (T, m, H) bf16, mix (T, m) f32, x_grad (T, m, H) bf16,
        mix_grad (T, m) f32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    threads, nv, guarded = _row_layout(H, _APPLY_MIX_BWD_MAX_THREADS)
    nwarps = threads // 32
    nvec = H // _VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply_mix_backward_cuda(
        out_grad: T.Tensor((num_tokens, H), bf16),
        x: T.Tensor((num_tokens, m, H), bf16),
        mix: T.Tensor((num_tokens, m), f32),
        x_grad: T.Tensor((num_tokens, m, H), bf16),
        mix_grad: T.Tensor((num_tokens, m), f32),
    ):
        with T.Kernel(num_tokens, threads=threads) as t:
            # NOTE: two token CTAs per SM (one's reduction overlaps the other's loads), each with
            # enough registers for a whole vector's 9 loads in flight (no spill at H = 1024 .. 7168).
            T.annotate_min_blocks_per_sm(2)
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            mx = T.alloc_local((m,), f32)
            gr = T.alloc_local((_VEC,), bf16)
            xr = T.alloc_local((m, _VEC), bf16)
            xg = T.alloc_local((m, _VEC), bf16)
            gf = T.alloc_local((_VEC,), f32)
            part = T.alloc_local((m,), f32)
            red = T.alloc_shared((m, nwarps), f32)
            for i in T.unroll(m):
                mx[i] = mix[t, i]
                part[i] = 0.0
            for j in T.unroll(nv):
                if (not guarded) or (j * threads + tid < nvec):
                    for k in T.vectorized(_VEC):
                        gr[k] = out_grad[t, (j * threads + tid) * _VEC + k]
                    for i in T.unroll(m):
                        for k in T.vectorized(_VEC):
                            xr[i, k] = x[t, i, (j * threads + tid) * _VEC + k]
                        for k in T.vectorized(_VEC):
                            xg[i, k] = x_grad[t, i, (j * threads + tid) * _VEC + k]
                    for k in T.unroll(_VEC):
                        gf[k] = T.cast(gr[k], f32)
                    for i in T.unroll(m):
                        for k in T.unroll(_VEC):
                            part[i] += gf[k] * T.cast(xr[i, k], f32)
                        for k in T.vectorized(_VEC):
                            x_grad[t, i, (j * threads + tid) * _VEC + k] = T.cast(
                                T.cast(xg[i, k], f32) + T.ieee_mul(mx[i], gf[k]), bf16)
            for i in T.unroll(m):
                part[i] = T.warp_reduce_sum(part[i])
            if lane == 0:
                for i in T.unroll(m):
                    red[i, wid] = part[i]
            T.sync_threads()
            if tid < m:
                part[0] = red[tid, 0]
                for w in T.unroll(1, nwarps):
                    part[0] += red[tid, w]
                mix_grad[t, tid] = part[0]

    return mhc_pre_apply_mix_backward_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_pre_apply_mix_backward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_pre_apply_mix_backward_key`), built once per key."""
    return jit_compile("mhc_pre_apply_mix_backward", key, build_mhc_pre_apply_mix_backward(*key))


def mhc_pre_apply_mix_backward(
    out_grad: torch.Tensor, x: torch.Tensor, mix: torch.Tensor, x_grad: torch.Tensor, mix_grad: torch.Tensor
) -> None:
    """Launches the pre-apply-mix backward on the current stream.

    Args:
        out_grad: ``(T, H)`` bf16, ``T > 0``.
        x: ``(T, m, H)`` bf16 residual.
        mix: ``(T, m)`` f32.
        x_grad: ``(T, m, H)`` bf16, accumulated in place (bf16 read-modify-write).
        mix_grad: ``(T, m)`` f32, written (the op's new output).
    """
    kernel = get_mhc_pre_apply_mix_backward_kernel(*mhc_pre_apply_mix_backward_key(out_grad, x))
    kernel(out_grad, x, mix, x_grad, mix_grad)


# ----------------------------------------------------------------------------------------------------
# mhc_post_forward / _backward (B.2.8)
# ----------------------------------------------------------------------------------------------------


def mhc_post_forward_key(x: torch.Tensor, residual: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m)`` (never the token count)."""
    _, hc_mult, hidden_size = (int(s) for s in residual.shape)
    _check_hidden("mhc_post_forward", hidden_size)
    return (hidden_size, hc_mult)


def build_mhc_post_forward(hidden_size: int, hc_mult: int):
    """Builds ``out[t, o, d] = bf16(post[t, o] * f32(x[t, d]) + sum_{i=0..m-1} comb[t, i, o] * f32(res[t, i, d]))``,
    accumulated in exactly that order (post term first, then i ascending).

    1-D grid over ``(token, column chunk)``, chunks fastest; a thread loads its token's ``m + m*m``
    scalars once (uniform loads) and, per column vector, ``1 + m`` 16-byte loads and ``m`` 16-byte stores.

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(x (T, H) bf16, residual (T, m, H) bf16, post_layer_mix (T, m) f32,
        comb_res_mix (T, m, m) f32, out (T, m, H) bf16)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    threads, nv, guarded = _row_layout(H, _POST_FWD_MAX_THREADS)
    # NOTE: the whole row per CTA where that takes at most 2 vectors per thread (H = 4096: 256 x 2; 1280:
    # 160 x 1), else one vector per thread (see _ROW_NVC). At 2 vectors, 2 * (1 + m) 16-byte loads are in
    # flight per thread with the 20 scalars in 64 registers (no spill), so that 4 CTAs of 256 threads share
    # an SM and the 512 CTAs of T = 512, H = 4096 run in one wave. Measured on the H200 against the
    # 71-register build (3 CTAs per SM, then a 2-D grid): 11.44 vs 11.93 us at T = 512, H = 4096.
    nvc = _row_chunk(nv)
    chunks = nv // nvc
    nvec = H // _VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_post_forward_cuda(
        x: T.Tensor((num_tokens, H), bf16),
        residual: T.Tensor((num_tokens, m, H), bf16),
        post_layer_mix: T.Tensor((num_tokens, m), f32),
        comb_res_mix: T.Tensor((num_tokens, m, m), f32),
        out: T.Tensor((num_tokens, m, H), bf16),
    ):
        # One grid dimension (up to 2**31 - 1 CTAs; y is limited to 65535), the chunks of a token adjacent.
        with T.Kernel(num_tokens * chunks, threads=threads) as bid:
            t = bid // chunks
            cb = bid % chunks
            T.annotate_min_blocks_per_sm(_min_blocks(threads, 64))
            tid = T.get_thread_binding()
            pr = T.alloc_local((m,), f32)
            cr = T.alloc_local((m, m), f32)
            xr = T.alloc_local((nvc, _VEC), bf16)
            rr = T.alloc_local((nvc, m, _VEC), bf16)
            xf = T.alloc_local((_VEC,), f32)
            acc = T.alloc_local((_VEC,), f32)
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for k in T.vectorized(_VEC):
                        xr[j, k] = x[t, ((cb * nvc + j) * threads + tid) * _VEC + k]
                    for i in T.unroll(m):
                        for k in T.vectorized(_VEC):
                            rr[j, i, k] = residual[t, i, ((cb * nvc + j) * threads + tid) * _VEC + k]
            for o in T.unroll(m):
                pr[o] = post_layer_mix[t, o]
            for i in T.unroll(m):
                for o in T.unroll(m):
                    cr[i, o] = comb_res_mix[t, i, o]
            for j in T.unroll(nvc):
                if (not guarded) or ((cb * nvc + j) * threads + tid < nvec):
                    for k in T.unroll(_VEC):
                        xf[k] = T.cast(xr[j, k], f32)
                    for o in T.unroll(m):
                        for k in T.unroll(_VEC):
                            acc[k] = pr[o] * xf[k]
                            for i in T.unroll(m):
                                acc[k] += cr[i, o] * T.cast(rr[j, i, k], f32)
                        for k in T.vectorized(_VEC):
                            out[t, o, ((cb * nvc + j) * threads + tid) * _VEC + k] = T.cast(acc[k], bf16)

    return mhc_post_forward_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_post_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_post_forward_key`), built once per key."""
    return jit_compile("mhc_post_forward", key, build_mhc_post_forward(*key))


def mhc_post_forward(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor, out: torch.Tensor
) -> None:
    """Launches the mHC post forward on the current stream (flat 3-D shapes, inputs validated upstream).

    Args:
        x: ``(T, H)`` bf16 sublayer output, ``T > 0``, ``H % 64 == 0``.
        residual: ``(T, m, H)`` bf16.
        post_layer_mix: ``(T, m)`` f32 (a ``(T, m, 1)`` view is accepted).
        comb_res_mix: ``(T, m, m)`` f32, ``comb[t, i, o]`` from input stream ``i`` to output ``o``.
        out: ``(T, m, H)`` bf16, written (the op's new output).
    """
    kernel = get_mhc_post_forward_kernel(*mhc_post_forward_key(x, residual))
    kernel(x, residual, post_layer_mix.reshape(residual.shape[0], residual.shape[1]), comb_res_mix, out)


def mhc_post_backward_key(x: torch.Tensor, residual: torch.Tensor) -> tuple:
    """Compile-time key ``(H, m)`` (never the token count); only ``m = 4`` is supported."""
    _, hc_mult, hidden_size = (int(s) for s in residual.shape)
    _check_hidden("mhc_post_backward", hidden_size)
    if hc_mult != 4:
        raise ValueError(f"mhc_post_backward: only hc_mult = 4 is supported on CUDA, got {hc_mult}")
    return (hidden_size, hc_mult)


def _post_backward_layout(hidden_size: int) -> tuple[int, int, bool]:
    """Layout ``(threads, nv, guarded)`` of the post backward's one-token CTA: 128 threads where ``H / 8``
    is a multiple of 128 (``H % 1024 == 0``), else :func:`_row_layout` up to ``_RED_MAX_THREADS``.

    NOTE measured on the H200: at ~128 registers per thread (20 partials and 20 scalars), 4 CTAs of
    128 threads share an SM against 2 of 256, so the 512 tokens of T = 512 run in one wave: 18.25 vs
    18.65 us (H = 4096) and 29.35 vs 29.54 us (H = 7168) at T = 512; 223.9 vs 223.6 us and 390.9 vs
    386.3 us at T = 8192 (the peer: 18.2 / 28.9 / 225.0 / 393.6 us in the same run).
    """
    if (hidden_size // _VEC) % 128 == 0:
        return 128, hidden_size // _VEC // 128, False
    return _row_layout(hidden_size, _RED_MAX_THREADS)


def _post_backward_schedule(hidden_size: int, hc_mult: int = 4) -> tuple[int, int, bool, int, int, int]:
    """Schedule ``(threads, nv, guarded, stages, slots, blocks)`` of the post backward at ``H``.

    ``stages``: depth of the thread-private cp.async ring (``stages - 1`` vectors staged ahead), at most
    ``nv + 1`` (0: plain loads, for guarded layouts and one vector per thread); ``slots``: ring slots
    allocated (``min(stages, nv)``: with ``stages = nv + 1`` the whole row is staged up front and slot
    ``nv`` is never used); ``blocks``: resident CTAs per SM annotated on the kernel, the register budget
    (128 per thread) or what the ring's shared memory leaves, whichever is smaller.
    """
    threads, nv, guarded = _post_backward_layout(hidden_size)
    stages = min(_POST_BWD_STAGES, nv + 1) if not guarded and nv > 1 else 0
    slots = min(stages, nv)
    blocks = _min_blocks(threads, 128)
    if slots:
        ring_bytes = slots * (2 * hc_mult + 1) * threads * _VEC * 2  # bf16; the reduction buffer shares it
        blocks = min(blocks, _SM_SMEM_BYTES // (ring_bytes + 1024))
    return threads, nv, guarded, stages, slots, blocks


def build_mhc_post_backward(hidden_size: int, hc_mult: int):
    """Builds the mHC post backward (one CTA per token).

    ``d_x[t, d] = bf16(sum_o f32(d_o[t, o, d]) * post[t, o])``,
    ``d_res[t, i, d] = bf16(sum_o comb[t, i, o] * f32(d_o[t, o, d]))`` (o ascending),
    ``d_post[t, o] = sum_d f32(d_o[t, o, d]) * f32(x[t, d])`` and
    ``d_comb[t, i, o] = sum_d f32(res[t, i, d]) * f32(d_o[t, o, d])``: ``m + m*m`` per-thread fp32
    partials, a butterfly warp reduction and an ascending-warp-order sum (deterministic).

    Args:
        hidden_size: ``H`` (multiple of 64).
        hc_mult: ``m`` (4).

    Returns:
        ``T.prim_func(x (T, H) bf16, residual (T, m, H) bf16, post_layer_mix (T, m) f32,
        comb_res_mix (T, m, m) f32, d_o (T, m, H) bf16, d_x (T, H) bf16, d_residual (T, m, H) bf16,
        d_post (T, m) f32, d_comb (T, m, m) f32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    H, m = hidden_size, hc_mult
    threads, nv, guarded, stages, slots, blocks = _post_backward_schedule(H, m)
    nwarps = threads // 32
    nred = m + m * m  # d_post (m) then d_comb (m*m, row-major [i, o])
    nrows = 2 * m + 1  # one vector's rows in the ring: d_o (m), x, residual (m)
    nvec = H // _VEC
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def stage_vector(d_o, x, residual, ring, j, slot, t, tid):
        # cp.async of this thread's vector j (d_o, x, residual rows) into ring slot ``slot``; one group.
        for o in T.unroll(m):
            T.ptx_cp_async(T.access_ptr(ring[slot, o, tid * _VEC], "w", _VEC),
                           T.access_ptr(d_o[t, o, (j * threads + tid) * _VEC], "r", _VEC), _VEC)
        T.ptx_cp_async(T.access_ptr(ring[slot, m, tid * _VEC], "w", _VEC),
                       T.access_ptr(x[t, (j * threads + tid) * _VEC], "r", _VEC), _VEC)
        for i in T.unroll(m):
            T.ptx_cp_async(T.access_ptr(ring[slot, m + 1 + i, tid * _VEC], "w", _VEC),
                           T.access_ptr(residual[t, i, (j * threads + tid) * _VEC], "r", _VEC), _VEC)
        T.ptx_commit_group()

    @T.prim_func
    def mhc_post_backward_cuda(
        x: T.Tensor((num_tokens, H), bf16),
        residual: T.Tensor((num_tokens, m, H), bf16),
        post_layer_mix: T.Tensor((num_tokens, m), f32),
        comb_res_mix: T.Tensor((num_tokens, m, m), f32),
        d_o: T.Tensor((num_tokens, m, H), bf16),
        d_x: T.Tensor((num_tokens, H), bf16),
        d_residual: T.Tensor((num_tokens, m, H), bf16),
        d_post: T.Tensor((num_tokens, m), f32),
        d_comb: T.Tensor((num_tokens, m, m), f32),
    ):
        with T.Kernel(num_tokens, threads=threads) as t:
            # NOTE: vectors processed one at a time (9 x 16-byte loads each: staged ``stages - 1``
            # vectors ahead by cp.async where the layout is unguarded with >= 2 vectors per thread, else
            # loaded directly with the next vector's loads hoisted by nvcc under __restrict__), 20 fp32
            # partials + 20 scalars per thread: <= 128 registers, 4 token CTAs of 128 threads (2-3 of
            # 160-256) per SM overlap reductions with loads.
            T.annotate_min_blocks_per_sm(blocks)
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            pr = T.alloc_local((m,), f32)
            cr = T.alloc_local((m, m), f32)
            xr = T.alloc_local((_VEC,), bf16)
            rr = T.alloc_local((m, _VEC), bf16)
            gr = T.alloc_local((m, _VEC), bf16)
            xf = T.alloc_local((_VEC,), f32)
            rf = T.alloc_local((m, _VEC), f32)
            gf = T.alloc_local((m, _VEC), f32)
            acc = T.alloc_local((_VEC,), f32)
            part = T.alloc_local((nred,), f32)
            red = T.alloc_shared((nred, nwarps), f32)
            # thread-private cp.async ring of the next vectors (each thread reads only its own 16-byte slots)
            ring = T.alloc_shared((slots, nrows, threads * _VEC), bf16) if stages else None
            for o in T.unroll(m):
                pr[o] = post_layer_mix[t, o]
            for i in T.unroll(m):
                for o in T.unroll(m):
                    cr[i, o] = comb_res_mix[t, i, o]
            for r in T.unroll(nred):
                part[r] = 0.0
            if stages:
                for j in range(stages - 1):
                    stage_vector(d_o, x, residual, ring, j, j % stages, t, tid)
            for j in T.unroll(nv):
                if (not guarded) or (j * threads + tid < nvec):
                    if stages:
                        # vector j + stages - 1 into the slot vector j - 1 left; wait for vector j's group.
                        # __syncwarp: a compiler memory barrier (TileLang's cp.async and wait asm carry no
                        # "memory" clobber), so that no slot read moves across the issue or the wait.
                        T.call_extern("void", "__syncwarp")
                        if j + stages - 1 < nv:
                            stage_vector(d_o, x, residual, ring, j + stages - 1, (j + stages - 1) % stages, t, tid)
                        else:
                            T.ptx_commit_group()
                        T.ptx_wait_group(stages - 1)
                        T.call_extern("void", "__syncwarp")
                        for o in T.unroll(m):
                            for k in T.vectorized(_VEC):
                                gr[o, k] = ring[j % stages, o, tid * _VEC + k]
                        for k in T.vectorized(_VEC):
                            xr[k] = ring[j % stages, m, tid * _VEC + k]
                        for i in T.unroll(m):
                            for k in T.vectorized(_VEC):
                                rr[i, k] = ring[j % stages, m + 1 + i, tid * _VEC + k]
                    else:
                        for o in T.unroll(m):
                            for k in T.vectorized(_VEC):
                                gr[o, k] = d_o[t, o, (j * threads + tid) * _VEC + k]
                        for k in T.vectorized(_VEC):
                            xr[k] = x[t, (j * threads + tid) * _VEC + k]
                        for i in T.unroll(m):
                            for k in T.vectorized(_VEC):
                                rr[i, k] = residual[t, i, (j * threads + tid) * _VEC + k]
                    for o in T.unroll(m):
                        for k in T.unroll(_VEC):
                            gf[o, k] = T.cast(gr[o, k], f32)
                    for k in T.unroll(_VEC):
                        xf[k] = T.cast(xr[k], f32)
                    for i in T.unroll(m):
                        for k in T.unroll(_VEC):
                            rf[i, k] = T.cast(rr[i, k], f32)
                    # d_x = sum_o d_o[o] * post[o]
                    for k in T.unroll(_VEC):
                        acc[k] = gf[0, k] * pr[0]
                        for o in T.unroll(1, m):
                            acc[k] += gf[o, k] * pr[o]
                    for k in T.vectorized(_VEC):
                        d_x[t, (j * threads + tid) * _VEC + k] = T.cast(acc[k], bf16)
                    # d_residual[i] = sum_o comb[i, o] * d_o[o]
                    for i in T.unroll(m):
                        for k in T.unroll(_VEC):
                            acc[k] = cr[i, 0] * gf[0, k]
                            for o in T.unroll(1, m):
                                acc[k] += cr[i, o] * gf[o, k]
                        for k in T.vectorized(_VEC):
                            d_residual[t, i, (j * threads + tid) * _VEC + k] = T.cast(acc[k], bf16)
                    # partials of d_post[o] and d_comb[i, o]
                    for o in T.unroll(m):
                        for k in T.unroll(_VEC):
                            part[o] += gf[o, k] * xf[k]
                    for i in T.unroll(m):
                        for o in T.unroll(m):
                            for k in T.unroll(_VEC):
                                part[m + i * m + o] += rf[i, k] * gf[o, k]
            for r in T.unroll(nred):
                part[r] = T.warp_reduce_sum(part[r])
            if stages:
                # TileLang places ``red`` over the ring (their lifetimes do not overlap within a thread):
                # every warp must be done with its ring slots before any warp writes ``red``
                T.sync_threads()
            if lane == 0:
                for r in T.unroll(nred):
                    red[r, wid] = part[r]
            T.sync_threads()
            if tid < nred:
                part[0] = red[tid, 0]
                for w in T.unroll(1, nwarps):
                    part[0] += red[tid, w]
                if tid < m:
                    d_post[t, tid] = part[0]
                else:
                    d_comb[t, (tid - m) // m, (tid - m) % m] = part[0]

    return mhc_post_backward_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_post_backward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_post_backward_key`), built once per key."""
    return jit_compile("mhc_post_backward", key, build_mhc_post_backward(*key))


def mhc_post_backward(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
    d_o: torch.Tensor,
    d_x: torch.Tensor,
    d_residual: torch.Tensor,
    d_post: torch.Tensor,
    d_comb: torch.Tensor,
) -> None:
    """Launches the mHC post backward on the current stream (flat 3-D shapes, ``m = 4``).

    Args:
        x: ``(T, H)`` bf16, ``T > 0``.
        residual: ``(T, m, H)`` bf16.
        post_layer_mix: ``(T, m)`` f32 (``(T, m, 1)`` accepted).
        comb_res_mix: ``(T, m, m)`` f32.
        d_o: ``(T, m, H)`` bf16.
        d_x: ``(T, H)`` bf16, written.
        d_residual: ``(T, m, H)`` bf16, written.
        d_post: ``(T, m)`` f32 (``(T, m, 1)`` accepted), written.
        d_comb: ``(T, m, m)`` f32, written.
    """
    kernel = get_mhc_post_backward_kernel(*mhc_post_backward_key(x, residual))
    n, m = residual.shape[0], residual.shape[1]
    kernel(x, residual, post_layer_mix.reshape(n, m), comb_res_mix, d_o, d_x, d_residual, d_post.view(n, m), d_comb)


# ----------------------------------------------------------------------------------------------------


def streaming_lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every streaming kernel variant at ``hidden_size``, as un-compiled prim_funcs (CPU build tests).

    Case names: ``expand_fwd``, ``expand_bwd``, ``normw_merge_fwd``, ``normw_merge_bwd`` (``M3 = m(m+2)``,
    ``K = m * H``), ``pre_apply_mix_fwd``, ``pre_apply_mix_bwd``, ``post_fwd``, ``post_bwd``.

    Returns:
        ``{case name: T.prim_func}``.
    """
    H, m = hidden_size, hc_mult
    m3 = m * (m + 2)
    return {
        "expand_fwd": build_expand_to_mhc_forward(H, m),
        "expand_bwd": build_expand_to_mhc_backward(H, m),
        "normw_merge_fwd": build_mhc_fn_normw_merge_forward(m3, m * H),
        "normw_merge_bwd": build_mhc_fn_normw_merge_backward(m3, m * H),
        "pre_apply_mix_fwd": build_mhc_pre_apply_mix_forward(H, m),
        "pre_apply_mix_bwd": build_mhc_pre_apply_mix_backward(H, m),
        "post_fwd": build_mhc_post_forward(H, m),
        "post_bwd": build_mhc_post_backward(H, m),
    }


lowering_cases = streaming_lowering_cases
