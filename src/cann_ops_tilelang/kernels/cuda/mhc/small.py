"""CUDA kernels of the per-token mHC ops (OPS.md B.2.4, B.2.5, B.2.6, B.2.9).

Ops: ``mhc_reduce_partials_and_rmsnorm_forward/_backward``, ``mhc_pre_split_mixes_forward/_backward``,
``mhc_sinkhorn_forward/_backward`` and ``mhc_head_compute_mix_forward/_backward``.

These ops move a few dozen floats per token, so they are latency-bound: every kernel is one launch
over blocks of tokens (32 per CTA unless noted), with all loads of a thread issued before its math,
vector (``float4``) accesses wherever the row length allows, and fp32 math throughout. The two
parameter-gradient backwards (split mixes, head mix) use a fixed grid of ``P`` workers; worker ``p``
owns the contiguous token range ``[p*ceil(T/P), min((p+1)*ceil(T/P), T))`` and writes its partial row
(zeros when the range is empty); the partial rows are summed in a fixed order (split mixes: by a
second one-CTA kernel, 8 strided groups then their sums; head mix: by the caller). No atomics:
results are deterministic run to run.

Arithmetic contracts (the fused ``mhc_pre_big_fuse`` must reproduce these to stay bit-exact):

* reduce forward: ``om = ((p_0 + p_1) + ...) + p_{S-1}`` and ``sq`` likewise (sequential ``s``);
  ``r = rsqrtf(sq / Rg + eps)`` (IEEE division, CUDA ``rsqrtf``); ``out = om * r`` for ``G = 1``,
  ``((om_0 * r_0) + om_1 * r_1) + ...`` (fused multiply-adds) for ``G > 1``.
* split mixes / head mix forward: ``z = __fmul_rn(x, scale) + base`` (two roundings, as torch's
  ``x * scale + base``). Split mixes: ``sigmoid(z) = 1 / (1 + expf(-z))``; ``pre = sigmoid + pre_eps``,
  ``post = sigmoid * post_mult_value``, ``comb = z``. Head mix (not part of the fused kernel, held to
  OPS.md's ``rtol 1e-4, atol 1e-5``): ``sigmoid(z) = rcp.approx.ftz(1 + __expf(-z))`` (MUFU ex2 and rcp;
  at most 2.4e-7 relative error against float64 on randn inputs; flushed to 0 where sigmoid is subnormal,
  z < -87.3, an absolute error below 2^-126). The head-mix backward recomputes sigmoid the IEEE way.
* Sinkhorn: every sum along a row or a column of the ``m x m`` matrix is a pairwise tree,
  ``(y_0 + y_1) + (y_2 + y_3)`` at m = 4 (an xor-butterfly over the lanes that hold the elements; with
  ``k > 1`` elements per lane, the lane's own elements are added in order first); row softmax
  ``exp(x - rowmax) / rowsum`` (``expf``, IEEE division); every eps-normalization is the IEEE
  quotient ``y / (sum + eps)``. The backward's walk over the steps forms its quotients by a
  denominator ``d`` whose reciprocal is known ahead of the chain: ``rc = __frcp_rn(d)``,
  ``q = __fmul_rn(y, rc)``, ``y' = __fmaf_rn(__fmaf_rn(-d, q, y), rc, q)``, which is the same correctly
  rounded ``y / d`` for normal operands (Markstein: ``rc`` is the correctly rounded reciprocal and
  ``q`` within one ulp of the quotient, so one FMA correction rounds exactly); its products
  ``g * U`` are rounded before they are summed (``__fmul_rn``).

Launchers assume validated, contiguous inputs with 16-byte aligned data pointers (every fresh torch
allocation is), ``T > 0``, and launch on the current stream without synchronizing. Supported sizes:
any ``H`` (these kernels do not depend on it), ``m`` in 1..8 (m = 4 tuned; Sinkhorn: m in {1, 2, 4, 8}),
reduce ``G`` in 1..16 and ``M3 <= 32``, Sinkhorn ``R`` in 1..256 (the backward's token block shrinks for
large ``R``).

TileLang is imported lazily (inside the builders) so that importing this module never does.
"""

import functools

import torch

from .._build import jit_compile

__all__ = [
    "MHC_SPLIT_MIXES_PARTIALS",
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
    "mhc_sinkhorn_forward",
    "mhc_sinkhorn_forward_key",
    "mhc_sinkhorn_backward_token_block",
    "lowering_cases",
]

# NOTE tuned for H200 (132 SMs): 32 tokens per CTA gives 256 CTAs at T = 8192, i.e. every SM busy
# in a single wave while each CTA stays a handful of warps (the ops are latency-bound, not
# bandwidth-bound: 8192 tokens x 24 mixes are 0.8 MB).
_TOKENS_PER_CTA = 32
# Head-mix forward is a pure elementwise map over (T, m): 128 tokens (512 threads at m = 4) per CTA.
# NOTE measured on the H200 (cupti, 3 interleaved rounds, T = 512 / 8192): 128 tokens (512 threads) 1.346 /
# 1.567 us, 64 tokens 1.342 / 1.677, 32 tokens 1.379 / 1.708 (the peer, 32 tokens: 1.354 / 1.680).
# The kernel is one load latency plus its math chain: the MUFU sigmoid (ex2 + rcp.approx) against the
# IEEE one (expf + IEEE division) took 1.322 / 1.590 us against 1.356 / 1.622 at T = 512 / 8192 (9 rounds
# x 2 buffers; the peer 1.258-1.293 / 1.708; 32 tokens per CTA with the MUFU sigmoid 1.292-1.314 /
# 1.717-1.733, 64 tokens 1.331 / 1.689). At T = 512 the gap to the peer is not in the code: the peer's own
# kernel source compiled by jit_compile took 1.301 us against the peer's 1.251 in the same rounds, and one
# compiled kernel moved by 30 ns with its output buffer alone.
_HEAD_FWD_TOKENS = 128
# Head-mix backward: 64 tokens per worker iteration; at the largest test size (T = 24576, P = 132)
# each worker runs 3 iterations.
_HEAD_BWD_TOKENS = 64
# Number of per-worker partial rows of ``mhc_pre_split_mixes_backward`` (one worker per H200 SM).
# A fixed number, not the device's SM count, so a token count always maps to the same partition.
MHC_SPLIT_MIXES_PARTIALS = 132
# Split-mixes backward: tokens per pass of a worker CTA (two threads each).
_SPLIT_BWD_TOKENS = 32
# Warps of the split-mixes partial reduction: 132 rows become 8 chains of <= 17 loads and adds.
_SPLIT_REDUCE_WARPS = 8
# NOTE Sinkhorn backward keeps, per token and eps-normalization step, the step input of every
# matrix element and the step's m denominators in shared memory: 4*(2R-1)*(m*m + m) bytes per token
# (3120 B at m = 4, R = 20: 25 KB for an 8-token CTA, so the 1024 CTAs of T = 8192 are resident at
# once; storing a denominator per element instead, 40 KB per CTA, took 17.0 us there against 12.6). The
# budget below halves the token block for large R (down to one warp per CTA).
_SINKHORN_SMEM_BUDGET = 113 * 1024
_SINKHORN_MAX_REPEAT = 256
# Sinkhorn threads per CTA: 8 tokens of 16 lanes at m = 4 (64 and 256 measured the same on the H200).
_SINKHORN_THREADS = 128
# Sinkhorn matrix elements per lane (1: one lane per element; raised to m*m/32 when m*m > 32).
# NOTE measured on the H200 at T = 512, R = 10: forward 2.6 / 3.1 / 4.1 us and backward 4.7 / 5.4 /
# 7.2 us for 1 / 2 / 4 elements per lane (IEEE division on the forward chain; frcp_rn + Markstein
# correction there was 2.9 us).
_SINKHORN_LANE_ELEMS = 1
_MAX_MULT = 8
_MAX_MULT3 = 32
_MAX_GROUPS = 16


def _vec(n: int) -> int:
    """Widest vector (4, 2 or 1 fp32) that evenly divides a row of ``n`` floats."""
    return 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)


def _ceil32(n: int) -> int:
    return -(-n // 32) * 32


def _check_mult(op: str, hc_mult: int) -> None:
    if not 1 <= hc_mult <= _MAX_MULT:
        raise ValueError(f"{op}: hc_mult m must be in [1, {_MAX_MULT}] (m = 4 is the tuned case), got {hc_mult}")


def _check_partials(op: str, num_partials: int) -> None:
    if not 1 <= num_partials <= 4096:
        raise ValueError(f"{op}: number of partial rows P must be in [1, 4096], got {num_partials}")


# ---------------------------------------------------------------------------------------------------
# 7. mhc_reduce_partials_and_rmsnorm_forward
# ---------------------------------------------------------------------------------------------------


def mhc_reduce_partials_and_rmsnorm_forward_key(out_mul_splitted: torch.Tensor, n_splits: int) -> tuple:
    """Compile-time key ``(S, G, M3)``; validates ``S == n_splits``, ``1 <= G <= 16``, ``M3 <= 32``."""
    op = "mhc_reduce_partials_and_rmsnorm_forward"
    splits, _, groups, mult3 = out_mul_splitted.shape
    if int(splits) != int(n_splits) or n_splits < 1:
        raise ValueError(f"{op}: out_mul_splitted has {splits} splits but n_splits={n_splits}")
    if not 1 <= groups <= _MAX_GROUPS:
        raise ValueError(f"{op}: number of RMS groups G must be in [1, {_MAX_GROUPS}], got {groups}")
    if not 1 <= mult3 <= _MAX_MULT3:
        raise ValueError(f"{op}: M3 must be in [1, {_MAX_MULT3}], got {mult3}")
    return (int(splits), int(groups), int(mult3))


def build_mhc_reduce_partials_and_rmsnorm_forward(n_splits: int, n_groups: int, mult3: int):
    """Builds the split-K reduction + RMS normalization prim_func (OPS.md B.2.4, forward).

    One CTA per 32 tokens. Two thread groups run at once: the first (``TB*G*M3/4`` threads at
    ``G*M3 % 4 == 0``) owns one 4-float vector of ``out_mul`` each and sums its ``S`` split vectors in
    ascending ``s`` (all ``S`` loads in flight); the second (one thread per (token, group)) sums
    ``sqrsum`` the same way and computes ``r``. After one barrier every thread writes ``out`` vectors.

    Args:
        n_splits: ``S >= 1``.
        n_groups: ``G`` in ``[1, 16]``.
        mult3: ``M3`` in ``[1, 32]``.

    Returns:
        ``T.prim_func(out_mul_splitted (S, T, G*M3) f32, sqrsum_splitted (S, T, G) f32,
        out_mul (T, G*M3) f32, sqrsum (T, G) f32, out (T, M3) f32, rms_group_size: f32, rms_eps: f32)``
        (the launcher passes flattened views of the 4-D / 3-D tensors); ``T`` is dynamic.
    """
    from tilelang import language as T

    S, G, M3, TB = n_splits, n_groups, mult3, _TOKENS_PER_CTA
    GM = G * M3
    va, vb = _vec(GM), _vec(M3)
    items_a = TB * GM // va  # out_mul vectors per CTA
    # NOTE 192 threads at G = 1, M3 = 24 (each with S float4 loads in flight: 48 KB per CTA at S = 16).
    ta = min(_ceil32(items_a), 256)
    na = -(-items_a // ta)
    items_q = TB * G  # (token, group) pairs per CTA
    tq = min(_ceil32(items_q), 128)
    nq = -(-items_q // tq)
    threads = ta + tq
    items_b = TB * M3 // vb  # out vectors per CTA
    nb = -(-items_b // threads)
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_reduce_partials_and_rmsnorm_fwd_cuda(
        out_mul_splitted: T.Tensor((S, num_tokens, GM), f32),
        sqrsum_splitted: T.Tensor((S, num_tokens, G), f32),
        out_mul: T.Tensor((num_tokens, GM), f32),
        sqrsum: T.Tensor((num_tokens, G), f32),
        out: T.Tensor((num_tokens, M3), f32),
        rms_group_size: f32,
        rms_eps: f32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            tid = T.get_thread_binding()
            om_s = T.alloc_shared((TB, GM), f32)
            r_s = T.alloc_shared((TB, G), f32)
            buf = T.alloc_local((S, va), f32)
            acc = T.alloc_local((va,), f32)
            qb = T.alloc_local((S,), f32)
            sq = T.alloc_local((1,), f32)
            ob = T.alloc_local((vb,), f32)
            if tid < ta:
                for ia in T.unroll(na):
                    fa = (ia * ta + tid) * va  # first float of this thread's vector in the CTA's block
                    tl = fa // GM
                    e = fa % GM
                    if (ia * ta + tid < items_a) and (bx * TB + tl < num_tokens):
                        for s in T.unroll(S):
                            for k in T.vectorized(va):
                                buf[s, k] = out_mul_splitted[s, bx * TB + tl, e + k]
                        for k in T.unroll(va):
                            acc[k] = buf[0, k]
                        for s in T.unroll(1, S):
                            for k in T.unroll(va):
                                acc[k] = acc[k] + buf[s, k]
                        for k in T.vectorized(va):
                            out_mul[bx * TB + tl, e + k] = acc[k]
                        for k in T.vectorized(va):
                            om_s[tl, e + k] = acc[k]
            else:
                for iq in T.unroll(nq):
                    fq = iq * tq + tid - ta  # (token, group) pair
                    tl = fq // G
                    g = fq % G
                    if (fq < items_q) and (bx * TB + tl < num_tokens):
                        for s in T.unroll(S):
                            qb[s] = sqrsum_splitted[s, bx * TB + tl, g]
                        sq[0] = qb[0]
                        for s in T.unroll(1, S):
                            sq[0] = sq[0] + qb[s]
                        sqrsum[bx * TB + tl, g] = sq[0]
                        r_s[tl, g] = T.rsqrt(sq[0] / rms_group_size + rms_eps)
            T.sync_threads()
            for ib in T.unroll(nb):
                fb = (ib * threads + tid) * vb
                tl = fb // M3
                j = fb % M3
                if (ib * threads + tid < items_b) and (bx * TB + tl < num_tokens):
                    for k in T.unroll(vb):
                        ob[k] = om_s[tl, j + k] * r_s[tl, 0]
                    for g in T.unroll(1, G):
                        for k in T.unroll(vb):
                            ob[k] = ob[k] + om_s[tl, g * M3 + j + k] * r_s[tl, g]
                    for k in T.vectorized(vb):
                        out[bx * TB + tl, j + k] = ob[k]

    return mhc_reduce_partials_and_rmsnorm_fwd_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_reduce_partials_and_rmsnorm_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_reduce_partials_and_rmsnorm_forward_key`)."""
    prim_func = build_mhc_reduce_partials_and_rmsnorm_forward(*key)
    return jit_compile("mhc_reduce_partials_and_rmsnorm_forward", key, prim_func)


def mhc_reduce_partials_and_rmsnorm_forward(
    out_mul_splitted: torch.Tensor,
    sqrsum_splitted: torch.Tensor,
    out_mul: torch.Tensor,
    sqrsum: torch.Tensor,
    out: torch.Tensor,
    rms_group_size: int,
    rms_eps: float,
    n_splits: int,
) -> None:
    """Launches the split-K reduction and RMS normalization on the current stream.

    ``sq = sum_s sqrsum_splitted[s]``, ``om = sum_s out_mul_splitted[s]`` (ascending ``s``),
    ``r = rsqrt(sq / rms_group_size + rms_eps)``, ``out = sum_g om[g] * r[g]``.

    Args:
        out_mul_splitted: ``(S, T, G, M3)`` f32, ``T > 0``, ``M3 <= 32``, ``G <= 16``.
        sqrsum_splitted: ``(S, T, G)`` f32.
        out_mul: ``(T, G, M3)`` f32, written (``om``).
        sqrsum: ``(T, G)`` f32, written (``sq``).
        out: ``(T, M3)`` f32, written.
        rms_group_size: ``Rg`` (runtime fp32 scalar; exact below 2**24).
        rms_eps: RMSNorm epsilon (runtime fp32 scalar).
        n_splits: ``S`` (must equal ``out_mul_splitted.shape[0]``).
    """
    S, T_, G, M3 = out_mul_splitted.shape
    key = mhc_reduce_partials_and_rmsnorm_forward_key(out_mul_splitted, n_splits)
    kernel = get_mhc_reduce_partials_and_rmsnorm_forward_kernel(*key)
    kernel(
        out_mul_splitted.view(S, T_, G * M3),
        sqrsum_splitted,
        out_mul.view(T_, G * M3),
        sqrsum,
        out,
        float(rms_group_size),
        float(rms_eps),
    )


# ---------------------------------------------------------------------------------------------------
# 8. mhc_reduce_partials_and_rmsnorm_backward
# ---------------------------------------------------------------------------------------------------


def mhc_reduce_partials_and_rmsnorm_backward_key(out_mul: torch.Tensor) -> tuple:
    """Compile-time key ``(G, M3)``; validates ``1 <= G <= 16`` and ``M3 <= 32``."""
    op = "mhc_reduce_partials_and_rmsnorm_backward"
    _, groups, mult3 = out_mul.shape
    if not 1 <= groups <= _MAX_GROUPS:
        raise ValueError(f"{op}: number of RMS groups G must be in [1, {_MAX_GROUPS}], got {groups}")
    if not 1 <= mult3 <= _MAX_MULT3:
        raise ValueError(f"{op}: M3 must be in [1, {_MAX_MULT3}], got {mult3}")
    return (int(groups), int(mult3))


def build_mhc_reduce_partials_and_rmsnorm_backward(n_groups: int, mult3: int):
    """Builds the RMS-normalization backward prim_func (OPS.md B.2.4, backward).

    One thread per (token, group), 32 tokens per CTA; each thread loads its ``out_grad`` row and its
    ``out_mul`` row with vector loads, then ``r = rsqrt(sq/Rg + eps)``, ``out_mul_grad = out_grad * r``,
    ``rho = sum_j out_grad[j] * om[j]`` (ascending ``j``) and
    ``sqrsum_grad = -(rho * r) / (2 * (sq + eps * Rg))``.

    Args:
        n_groups: ``G`` in ``[1, 16]``.
        mult3: ``M3`` in ``[1, 32]``.

    Returns:
        ``T.prim_func(out_grad (T, M3), out_mul (T, G*M3), sqrsum (T, G), out_mul_grad (T, G*M3),
        sqrsum_grad (T, G), rms_group_size: f32, rms_eps: f32)``, all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    G, M3, TB = n_groups, mult3, _TOKENS_PER_CTA
    GM = G * M3
    v = _vec(M3)
    threads = TB * G  # NOTE <= 512 threads; each holds 2*M3 <= 64 floats of its rows
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_reduce_partials_and_rmsnorm_bwd_cuda(
        out_grad: T.Tensor((num_tokens, M3), f32),
        out_mul: T.Tensor((num_tokens, GM), f32),
        sqrsum: T.Tensor((num_tokens, G), f32),
        out_mul_grad: T.Tensor((num_tokens, GM), f32),
        sqrsum_grad: T.Tensor((num_tokens, G), f32),
        rms_group_size: f32,
        rms_eps: f32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            tid = T.get_thread_binding()
            og = T.alloc_local((M3,), f32)
            om = T.alloc_local((M3,), f32)
            sc = T.alloc_local((3,), f32)  # sq, r, rho
            t = bx * TB + tid // G
            g = tid % G
            if t < num_tokens:
                for c in T.unroll(M3 // v):
                    for k in T.vectorized(v):
                        og[c * v + k] = out_grad[t, c * v + k]
                for c in T.unroll(M3 // v):
                    for k in T.vectorized(v):
                        om[c * v + k] = out_mul[t, g * M3 + c * v + k]
                sc[0] = sqrsum[t, g]
                sc[1] = T.rsqrt(sc[0] / rms_group_size + rms_eps)
                sc[2] = og[0] * om[0]
                for j in T.unroll(1, M3):
                    sc[2] = sc[2] + og[j] * om[j]
                for j in T.unroll(M3):
                    om[j] = og[j] * sc[1]
                for c in T.unroll(M3 // v):
                    for k in T.vectorized(v):
                        out_mul_grad[t, g * M3 + c * v + k] = om[c * v + k]
                sqrsum_grad[t, g] = -(sc[2] * sc[1]) / (2.0 * (sc[0] + rms_eps * rms_group_size))

    return mhc_reduce_partials_and_rmsnorm_bwd_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_reduce_partials_and_rmsnorm_backward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_reduce_partials_and_rmsnorm_backward_key`)."""
    prim_func = build_mhc_reduce_partials_and_rmsnorm_backward(*key)
    return jit_compile("mhc_reduce_partials_and_rmsnorm_backward", key, prim_func)


def mhc_reduce_partials_and_rmsnorm_backward(
    out_grad: torch.Tensor,
    out_mul: torch.Tensor,
    sqrsum: torch.Tensor,
    out_mul_grad: torch.Tensor,
    sqrsum_grad: torch.Tensor,
    rms_group_size: int,
    rms_eps: float,
) -> None:
    """Launches the RMS-normalization backward on the current stream.

    Args:
        out_grad: ``(T, M3)`` f32, ``T > 0``.
        out_mul: ``(T, G, M3)`` f32 (saved ``om``).
        sqrsum: ``(T, G)`` f32 (saved ``sq``).
        out_mul_grad: ``(T, G, M3)`` f32, written (``out_grad * r``).
        sqrsum_grad: ``(T, G)`` f32, written (``-rho * r / (2 * (sq + eps * Rg))``).
        rms_group_size: ``Rg`` (runtime fp32 scalar).
        rms_eps: RMSNorm epsilon (runtime fp32 scalar).
    """
    T_, G, M3 = out_mul.shape
    kernel = get_mhc_reduce_partials_and_rmsnorm_backward_kernel(*mhc_reduce_partials_and_rmsnorm_backward_key(out_mul))
    kernel(
        out_grad,
        out_mul.view(T_, G * M3),
        sqrsum,
        out_mul_grad.view(T_, G * M3),
        sqrsum_grad,
        float(rms_group_size),
        float(rms_eps),
    )


# ---------------------------------------------------------------------------------------------------
# 9. mhc_pre_split_mixes_forward
# ---------------------------------------------------------------------------------------------------


def mhc_pre_split_mixes_forward_key(pre: torch.Tensor) -> tuple:
    """Compile-time key ``(m,)`` (``m = pre.shape[1]``, 1..8; m = 4 is the tuned case)."""
    hc_mult = int(pre.shape[1])
    _check_mult("mhc_pre_split_mixes_forward", hc_mult)
    return (hc_mult,)


def build_mhc_pre_split_mixes_forward(hc_mult: int):
    """Builds the mix-splitting forward prim_func (OPS.md B.2.5, forward).

    One CTA per 32 tokens; thread ``(c, token)`` owns the ``c``-th ``float4`` chunk of the token's
    ``M3`` mixes (6 chunks at m = 4: pre, post, then four comb chunks), chunk-major, so every warp
    works on one chunk: its branch (sigmoid + eps, sigmoid * post_mult, or copy) is warp-uniform, and
    each thread has one vector load, four mixes of math and one vector store.

    NOTE measured on the H200: 1.74-1.80 us at T = 512 and 2.3 us at T = 8192, against 2.1 / 2.6 us
    for one thread per token and 2.4 / 2.9 us for the token-major (token, chunk) layout, whose warps
    ran all three branches.

    Args:
        hc_mult: ``m`` (1..8).

    Returns:
        ``T.prim_func(input_mixes (T, M3), mhc_scale (3,), mhc_base (M3,), pre (T, m), post (T, m),
        comb (T, m*m), post_mult_value: f32, pre_eps: f32)``, all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    m, TB = hc_mult, _TOKENS_PER_CTA
    M3, M2 = m * (m + 2), m * m
    v = _vec(m)
    ch = M3 // v  # chunks per token
    cp = m // v  # chunks per pre / post segment
    threads = ch * TB  # NOTE 192 at m = 4
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_split_mixes_fwd_cuda(
        input_mixes: T.Tensor((num_tokens, M3), f32),
        mhc_scale: T.Tensor((3,), f32),
        mhc_base: T.Tensor((M3,), f32),
        pre: T.Tensor((num_tokens, m), f32),
        post: T.Tensor((num_tokens, m), f32),
        comb: T.Tensor((num_tokens, M2), f32),
        post_mult_value: f32,
        pre_eps: f32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            tid = T.get_thread_binding()
            c = tid // TB
            t = bx * TB + tid % TB
            x = T.alloc_local((v,), f32)
            b = T.alloc_local((v,), f32)
            sc = T.alloc_local((1,), f32)
            if t < num_tokens:
                for k in T.vectorized(v):
                    x[k] = input_mixes[t, c * v + k]
                sc[0] = mhc_scale[T.min(c // cp, 2)]
                for k in T.vectorized(v):
                    b[k] = mhc_base[c * v + k]
                for k in T.unroll(v):
                    x[k] = T.ieee_mul(x[k], sc[0]) + b[k]
                if c < cp:
                    for k in T.unroll(v):
                        x[k] = T.sigmoid(x[k]) + pre_eps
                    for k in T.vectorized(v):
                        pre[t, c * v + k] = x[k]
                elif c < 2 * cp:
                    for k in T.unroll(v):
                        x[k] = T.sigmoid(x[k]) * post_mult_value
                    for k in T.vectorized(v):
                        post[t, (c - cp) * v + k] = x[k]
                else:
                    for k in T.vectorized(v):
                        comb[t, (c - 2 * cp) * v + k] = x[k]

    return mhc_pre_split_mixes_fwd_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_pre_split_mixes_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_pre_split_mixes_forward_key`)."""
    return jit_compile("mhc_pre_split_mixes_forward", key, build_mhc_pre_split_mixes_forward(*key))


def mhc_pre_split_mixes_forward(
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    pre: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    post_mult_value: float,
    pre_eps: float,
) -> None:
    """Launches the mix splitting forward on the current stream.

    Args:
        input_mixes: ``(T, M3)`` f32, ``T > 0``, ``M3 = m*(m+2)``.
        mhc_scale: ``(3,)`` f32.
        mhc_base: ``(M3,)`` f32.
        pre: ``(T, m)`` f32, written (``sigmoid(z) + pre_eps``).
        post: ``(T, m)`` f32, written (``sigmoid(z) * post_mult_value``).
        comb: ``(T, m*m)`` f32, written (``z``).
        post_mult_value: runtime fp32 scalar.
        pre_eps: runtime fp32 scalar.
    """
    kernel = get_mhc_pre_split_mixes_forward_kernel(*mhc_pre_split_mixes_forward_key(pre))
    kernel(input_mixes, mhc_scale, mhc_base, pre, post, comb, float(post_mult_value), float(pre_eps))


# ---------------------------------------------------------------------------------------------------
# 10. mhc_pre_split_mixes_backward (+ its partial reduction)
# ---------------------------------------------------------------------------------------------------


def mhc_pre_split_mixes_backward_key(post: torch.Tensor) -> tuple:
    """Compile-time key ``(m, P)`` with ``P = MHC_SPLIT_MIXES_PARTIALS``."""
    hc_mult = int(post.shape[1])
    _check_mult("mhc_pre_split_mixes_backward", hc_mult)
    return (hc_mult, MHC_SPLIT_MIXES_PARTIALS)


def build_mhc_pre_split_mixes_backward(hc_mult: int, num_partials: int):
    """Builds the main mix-splitting backward prim_func (OPS.md B.2.5, backward).

    ``P`` persistent CTAs; CTA ``p`` owns tokens ``[p*ceil(T/P), min((p+1)*ceil(T/P), T))`` and walks
    them ``TB = _SPLIT_BWD_TOKENS`` at a time with two threads per token: thread ``tl < TB`` takes the
    token's pre and post mixes (the sigmoid and ``post`` math), thread ``TB + tl`` its ``m*m`` comb
    mixes, so each branch is warp-uniform and both chains are short. A thread loads its rows with
    vector loads, writes its part of ``input_mixes_grad`` and accumulates ``dz`` and ``dz * x`` per mix
    index in registers (ascending token); the CTA then sums the ``TB`` token rows in ascending order
    through shared memory and writes row ``p`` of the partials: ``[0, M3)`` = sum of ``dz`` per mix,
    ``M3 + c`` = sum of ``dz * x`` over segment ``c`` (ascending mix index).

    NOTE measured on the H200: 3.7-3.8 us at T = 512 and 5.4 us at T = 8192 (two kernels), against
    4.3 / 5.2 us with one thread per token and 3.9 / 5.85 us for the peer; ``TB = 64`` gives 3.9 / 4.8 us.

    Args:
        hc_mult: ``m`` (1..8).
        num_partials: ``P``.

    Returns:
        ``T.prim_func(pre_grad (T, m), post_grad (T, m), comb_grad (T, m*m), input_mixes (T, M3),
        post (T, m), mhc_scale (3,), mhc_base (M3,), input_mixes_grad (T, M3), partial (P, M3+3),
        post_mult_value: f32)``, all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    m, P, TB = hc_mult, num_partials, _SPLIT_BWD_TOKENS
    M3, M2 = m * (m + 2), m * m
    W = M3 + 3
    v = _vec(m)
    NX = max(2 * m, M2)
    RW = 2 * M3 + 1  # padded row of the reduction buffer (odd: conflict-free row writes)
    passes = (2 * M3 + 2 * TB - 1) // (2 * TB)
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def load_row(dst, src, t, off, n):
        # dst[0:n] = src[t, off:off + n]
        for cc in T.unroll(n // v):
            for k in T.vectorized(v):
                dst[cc * v + k] = src[t, off + cc * v + k]

    @T.macro
    def store_row(dst, src, t, off, n):
        for cc in T.unroll(n // v):
            for k in T.vectorized(v):
                dst[t, off + cc * v + k] = src[cc * v + k]

    @T.prim_func
    def mhc_pre_split_mixes_bwd_cuda(
        pre_grad: T.Tensor((num_tokens, m), f32),
        post_grad: T.Tensor((num_tokens, m), f32),
        comb_grad: T.Tensor((num_tokens, M2), f32),
        input_mixes: T.Tensor((num_tokens, M3), f32),
        post: T.Tensor((num_tokens, m), f32),
        mhc_scale: T.Tensor((3,), f32),
        mhc_base: T.Tensor((M3,), f32),
        input_mixes_grad: T.Tensor((num_tokens, M3), f32),
        partial: T.Tensor((P, W), f32),
        post_mult_value: f32,
    ):
        with T.Kernel(P, threads=2 * TB) as p:
            tid = T.get_thread_binding()
            tl = tid % TB
            red = T.alloc_shared((TB, RW), f32)
            seg = T.alloc_shared((M3,), f32)
            x = T.alloc_local((NX,), f32)  # the thread's mixes: 2m (pre/post) or m*m (comb)
            dz = T.alloc_local((NX,), f32)
            b = T.alloc_local((2 * m,), f32)
            gp = T.alloc_local((m,), f32)
            gq = T.alloc_local((m,), f32)
            pv = T.alloc_local((m,), f32)
            ab = T.alloc_local((NX,), f32)  # sum of dz per mix index (of this thread's mixes)
            ax = T.alloc_local((NX,), f32)  # sum of dz * x per mix index
            s3 = T.alloc_local((3,), f32)
            acc = T.alloc_local((1,), f32)
            for j in T.unroll(NX):
                ab[j] = 0.0
                ax[j] = 0.0
            per = T.ceildiv(num_tokens, P)
            t_begin = T.min(per * p, num_tokens)
            t_end = T.min(per * p + per, num_tokens)
            if tid < TB:
                # pre and post mixes [0, 2m)
                for i in T.unroll(2):
                    s3[i] = mhc_scale[i]
                for cc in T.unroll(2 * m // v):
                    for k in T.vectorized(v):
                        b[cc * v + k] = mhc_base[cc * v + k]
                for it in T.serial(T.ceildiv(t_end - t_begin, TB)):
                    t = t_begin + it * TB + tl
                    if t < t_end:
                        load_row(x, input_mixes, t, 0, 2 * m)
                        load_row(gp, pre_grad, t, 0, m)
                        load_row(gq, post_grad, t, 0, m)
                        load_row(pv, post, t, 0, m)
                        for j in T.unroll(m):
                            acc[0] = T.sigmoid(T.ieee_mul(x[j], s3[0]) + b[j])
                            dz[j] = gp[j] * acc[0] * (1.0 - acc[0])
                            dz[m + j] = gq[j] * pv[j] * (1.0 - pv[j] / post_mult_value)
                        for j in T.unroll(2 * m):
                            ab[j] = ab[j] + dz[j]
                            ax[j] = ax[j] + dz[j] * x[j]
                        for j in T.unroll(m):
                            dz[j] = dz[j] * s3[0]
                            dz[m + j] = dz[m + j] * s3[1]
                        store_row(input_mixes_grad, dz, t, 0, 2 * m)
                for j in T.unroll(2 * m):
                    red[tl, j] = ab[j]
                    red[tl, M3 + j] = ax[j]
            else:
                # comb mixes [2m, M3)
                s3[2] = mhc_scale[2]
                for it in T.serial(T.ceildiv(t_end - t_begin, TB)):
                    t = t_begin + it * TB + tl
                    if t < t_end:
                        load_row(x, input_mixes, t, 2 * m, M2)
                        load_row(dz, comb_grad, t, 0, M2)
                        for j in T.unroll(M2):
                            ab[j] = ab[j] + dz[j]
                            ax[j] = ax[j] + dz[j] * x[j]
                            dz[j] = dz[j] * s3[2]
                        store_row(input_mixes_grad, dz, t, 2 * m, M2)
                for j in T.unroll(M2):
                    red[tl, 2 * m + j] = ab[j]
                    red[tl, M3 + 2 * m + j] = ax[j]
            # Deterministic CTA reduction: token rows in ascending order, then each segment in mix order.
            T.sync_threads()
            for ps in T.unroll(passes):
                if tid + ps * 2 * TB < 2 * M3:
                    acc[0] = red[0, tid + ps * 2 * TB]
                    for i in T.unroll(1, TB):
                        acc[0] = acc[0] + red[i, tid + ps * 2 * TB]
                    if tid + ps * 2 * TB < M3:
                        partial[p, tid + ps * 2 * TB] = acc[0]
                    else:
                        seg[tid + ps * 2 * TB - M3] = acc[0]
            T.sync_threads()
            if tid < 2:
                acc[0] = seg[tid * m]
                for j in T.unroll(1, m):
                    acc[0] = acc[0] + seg[tid * m + j]
                partial[p, M3 + tid] = acc[0]
            elif tid == 2:
                acc[0] = seg[2 * m]
                for j in T.unroll(1, M2):
                    acc[0] = acc[0] + seg[2 * m + j]
                partial[p, M3 + 2] = acc[0]

    return mhc_pre_split_mixes_bwd_cuda


def build_mhc_pre_split_mixes_backward_reduce(hc_mult: int, num_partials: int):
    """Builds the second (partial-reduction) kernel of the mix-splitting backward.

    One CTA of ``G = _SPLIT_REDUCE_WARPS`` groups of ``ceil32(M3 + 3)`` threads (one warp at m = 4);
    thread ``j < M3 + 3`` of group ``w`` sums column ``j`` of the partial rows ``w, w + G, w + 2G, ...``
    in ascending order (all its loads in flight at once, then a short add chain), and thread ``j``
    adds the ``G`` group sums in ascending ``w`` and overwrites ``mhc_base_grad[j]`` (``j < M3``) or ``mhc_scale_grad[j - M3]``.

    Args:
        hc_mult: ``m`` (1..8).
        num_partials: ``P``.

    Returns:
        ``T.prim_func(partial (P, M3+3) f32, mhc_scale_grad (3,) f32, mhc_base_grad (M3,) f32)``.
    """
    from tilelang import language as T

    m, P = hc_mult, num_partials
    M3 = m * (m + 2)
    W = M3 + 3
    NW = _SPLIT_REDUCE_WARPS
    lanes = _ceil32(W)
    threads = NW * lanes
    per = (P + NW - 1) // NW
    f32 = T.float32

    @T.prim_func
    def mhc_pre_split_mixes_bwd_reduce_cuda(
        partial: T.Tensor((P, W), f32),
        mhc_scale_grad: T.Tensor((3,), f32),
        mhc_base_grad: T.Tensor((M3,), f32),
    ):
        with T.Kernel(1, threads=threads) as _:
            tid = T.get_thread_binding()
            w = tid // lanes
            j = tid % lanes
            red = T.alloc_shared((NW, lanes), f32)
            v = T.alloc_local((per,), f32)
            acc = T.alloc_local((1,), f32)
            if j < W:
                for i in T.unroll(per):
                    v[i] = 0.0
                    if w + i * NW < P:
                        v[i] = partial[w + i * NW, j]
                acc[0] = v[0]
                for i in T.unroll(1, per):
                    acc[0] = acc[0] + v[i]
                red[w, j] = acc[0]
            T.sync_threads()
            if tid < W:
                acc[0] = red[0, tid]
                for i in T.unroll(1, NW):
                    acc[0] = acc[0] + red[i, tid]
                if tid < M3:
                    mhc_base_grad[tid] = acc[0]
                else:
                    mhc_scale_grad[tid - M3] = acc[0]

    return mhc_pre_split_mixes_bwd_reduce_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_pre_split_mixes_backward_kernel(*key):
    """Compiled main kernel for ``key`` (see :func:`mhc_pre_split_mixes_backward_key`)."""
    return jit_compile("mhc_pre_split_mixes_backward", key, build_mhc_pre_split_mixes_backward(*key))


@functools.lru_cache(maxsize=None)
def get_mhc_pre_split_mixes_backward_reduce_kernel(*key):
    """Compiled partial-reduction kernel for ``key`` (see :func:`mhc_pre_split_mixes_backward_key`)."""
    return jit_compile("mhc_pre_split_mixes_backward_reduce", key, build_mhc_pre_split_mixes_backward_reduce(*key))


def mhc_pre_split_mixes_backward(
    pre_grad: torch.Tensor,
    post_grad: torch.Tensor,
    comb_grad: torch.Tensor,
    input_mixes: torch.Tensor,
    post: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    input_mixes_grad: torch.Tensor,
    mhc_scale_grad: torch.Tensor,
    mhc_base_grad: torch.Tensor,
    post_mult_value: float,
) -> None:
    """Launches the mix-splitting backward (two kernels) on the current stream.

    The first kernel writes ``input_mixes_grad`` and ``(P, M3 + 3)`` per-worker partials into a
    temporary ``torch.empty`` buffer (every row written); the second sums them in a fixed worker
    order and **overwrites** ``mhc_scale_grad`` and ``mhc_base_grad``.

    Args:
        pre_grad: ``(T, m)`` f32, ``T > 0``.
        post_grad: ``(T, m)`` f32.
        comb_grad: ``(T, m*m)`` f32.
        input_mixes: ``(T, M3)`` f32.
        post: ``(T, m)`` f32, the forward's ``post`` output.
        mhc_scale: ``(3,)`` f32.
        mhc_base: ``(M3,)`` f32.
        input_mixes_grad: ``(T, M3)`` f32, written.
        mhc_scale_grad: ``(3,)`` f32, overwritten.
        mhc_base_grad: ``(M3,)`` f32, overwritten.
        post_mult_value: runtime fp32 scalar.
    """
    key = mhc_pre_split_mixes_backward_key(post)
    m, P = key
    partial = torch.empty((P, m * (m + 2) + 3), dtype=torch.float32, device=input_mixes.device)
    get_mhc_pre_split_mixes_backward_kernel(*key)(
        pre_grad, post_grad, comb_grad, input_mixes, post, mhc_scale, mhc_base, input_mixes_grad, partial,
        float(post_mult_value),
    )
    get_mhc_pre_split_mixes_backward_reduce_kernel(*key)(partial, mhc_scale_grad, mhc_base_grad)


# ---------------------------------------------------------------------------------------------------
# 11/12. Sinkhorn
# ---------------------------------------------------------------------------------------------------


def _check_sinkhorn(op: str, hc_mult: int, repeat: int) -> None:
    _check_mult(op, hc_mult)
    if hc_mult & (hc_mult - 1):
        raise ValueError(f"{op}: the CUDA Sinkhorn kernels need a power-of-two hc_mult (1, 2, 4 or 8), got {hc_mult}")
    if not 1 <= repeat <= _SINKHORN_MAX_REPEAT:
        raise ValueError(f"{op}: repeat must be in [1, {_SINKHORN_MAX_REPEAT}], got {repeat}")


def mhc_sinkhorn_forward_key(comb: torch.Tensor, repeat: int) -> tuple:
    """Compile-time key ``(m, R)``."""
    hc_mult = int(comb.shape[-1])
    _check_sinkhorn("mhc_sinkhorn_forward", hc_mult, int(repeat))
    return (hc_mult, int(repeat))


def _sinkhorn_layout(hc_mult: int) -> tuple[int, int]:
    """``(k, N)``: matrix elements per lane and lanes per token of the Sinkhorn kernels.

    One lane per element (``N = m*m``) while a token fits a warp; at m = 8 two neighbouring
    elements of a row per lane (``k = 2``, ``N = 32``).
    """
    k = max(min(_SINKHORN_LANE_ELEMS, hc_mult), hc_mult * hc_mult // 32)
    return k, hc_mult * hc_mult // k


def _sinkhorn_tokens_per_cta(hc_mult: int) -> int:
    """Tokens per CTA of the Sinkhorn forward: ``_SINKHORN_THREADS`` threads (at least one token)."""
    return max(1, _SINKHORN_THREADS // _sinkhorn_layout(hc_mult)[1])


def mhc_sinkhorn_backward_token_block(hc_mult: int, repeat: int) -> int:
    """Tokens per CTA of the Sinkhorn backward.

    Per token the backward keeps, for each of its ``2R-1`` eps-normalization steps, the step input
    (``m*m`` floats) and the step's ``m`` denominators in shared memory: ``4*(2R-1)*(m*m + m)`` bytes
    (3120 B at m = 4, R = 20). Starts from the forward's token block and halves it while the CTA
    exceeds the budget and keeps more than one warp.
    """
    _, lanes = _sinkhorn_layout(hc_mult)
    per_token = 4 * (2 * repeat - 1) * (hc_mult * hc_mult + hc_mult)
    tb = _sinkhorn_tokens_per_cta(hc_mult)
    while tb * lanes > 32 and tb * per_token > _SINKHORN_SMEM_BUDGET:
        tb //= 2
    if tb * per_token > 227 * 1024:
        raise ValueError(
            f"mhc_sinkhorn_backward: m={hc_mult}, repeat={repeat} needs {tb * per_token} B of shared memory per CTA"
        )
    return tb


def mhc_sinkhorn_backward_key(x: torch.Tensor, repeat: int) -> tuple:
    """Compile-time key ``(m, R)``."""
    hc_mult = int(x.shape[-1])
    _check_sinkhorn("mhc_sinkhorn_backward", hc_mult, int(repeat))
    mhc_sinkhorn_backward_token_block(hc_mult, int(repeat))  # validates the shared-memory need
    return (hc_mult, int(repeat))


def _sinkhorn_macros(T, m: int):
    """Sinkhorn building blocks for the element-per-lane layout (see the module docstring for the arithmetic).

    A token's ``N`` lanes hold its ``m x m`` matrix row-major, ``k`` neighbouring elements of one row
    per lane (:func:`_sinkhorn_layout`): lane ``l`` holds elements ``l*k .. l*k+k-1``, so the lanes of a
    row differ in their low ``log2(m/k)`` bits and the lanes of a column in the next ``log2(m)`` bits.
    A row (column) sum is an xor-butterfly over those bits (after the lane's own ``k`` elements,
    added in order, for a row): every lane of the row (column) ends with the same bits, since each
    butterfly level adds the same two partial sums, only in swapped operand order.

    Returns ``(softmax_eps, row_sum, col_sum, quotient)`` macros.
    """
    k, _ = _sinkhorn_layout(m)
    row_bits = (m // k).bit_length() - 1  # butterfly levels of a row sum
    col_bits = m.bit_length() - 1  # butterfly levels of a column sum
    col_base = m // k  # lane distance between neighbouring rows

    @T.macro
    def row_max(src, s):
        s[0] = src[0]
        for c in T.unroll(1, k):
            s[0] = T.max(s[0], src[c])
        for b in T.unroll(row_bits):
            s[0] = T.max(s[0], T.shfl_xor(s[0], 1 << b))

    @T.macro
    def row_sum(src, s):
        # s[0] = the sum of this lane's row of src.
        s[0] = src[0]
        for c in T.unroll(1, k):
            s[0] = s[0] + src[c]
        for b in T.unroll(row_bits):
            s[0] = s[0] + T.shfl_xor(s[0], 1 << b)

    @T.macro
    def col_sum(src, s):
        # s[c] = the sum of the column of element c of this lane.
        for c in T.unroll(k):
            s[c] = src[c]
            for b in T.unroll(col_bits):
                s[c] = s[c] + T.shfl_xor(s[c], col_base << b)

    @T.macro
    def softmax_eps(y, s, pm, eps):
        # pm = row softmax of y (max-subtracted, IEEE division); y = pm + eps (pm may be y itself).
        row_max(y, s)
        for c in T.unroll(k):
            y[c] = T.exp(y[c] - s[0])
        row_sum(y, s)
        for c in T.unroll(k):
            pm[c] = y[c] / s[0]
            y[c] = pm[c] + eps

    @T.macro
    def quotient(buf, i, d, rc, q):
        # buf[i] <- buf[i] / d, correctly rounded (rc = __frcp_rn(d); one Markstein correction).
        q[0] = T.ieee_mul(buf[i], rc)
        buf[i] = T.ieee_fmaf(T.ieee_fmaf(-d, q[0], buf[i]), rc, q[0])

    return softmax_eps, row_sum, col_sum, quotient


def build_mhc_sinkhorn_forward(hc_mult: int, repeat: int):
    """Builds the Sinkhorn forward prim_func (OPS.md B.2.6).

    ``N`` lanes per token (:func:`_sinkhorn_layout`: 16 at m = 4, one matrix element each) and
    :func:`_sinkhorn_tokens_per_cta` tokens per CTA (8 at m = 4: 64 CTAs at T = 512, 1024 at T = 8192).
    A normalization step is two butterfly levels (shuffle + add), the ``+ eps`` and one IEEE
    division on every lane's dependent chain. Every lane runs every shuffle (lanes of tokens past
    ``T`` compute on zeros and store nothing).

    Args:
        hc_mult: ``m`` (1, 2, 4 or 8).
        repeat: ``R`` (1..256, compile-time).

    Returns:
        ``T.prim_func(comb (T, m*m) f32, comb_out (T, m*m) f32, eps: f32)``; ``T`` is dynamic.
    """
    from tilelang import language as T

    m, R = hc_mult, repeat
    k, N = _sinkhorn_layout(m)
    TB = _sinkhorn_tokens_per_cta(m)
    threads = _ceil32(TB * N)
    M2 = m * m
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")
    softmax_eps, row_sum, col_sum, _ = _sinkhorn_macros(T, m)

    @T.prim_func
    def mhc_sinkhorn_fwd_cuda(
        comb: T.Tensor((num_tokens, M2), f32),
        comb_out: T.Tensor((num_tokens, M2), f32),
        eps: f32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            tid = T.get_thread_binding()
            y = T.alloc_local((k,), f32)
            s = T.alloc_local((k,), f32)
            t = bx * TB + tid // N
            e = (tid % N) * k
            ok = (tid < TB * N) and (t < num_tokens)
            for c in T.unroll(k):
                y[c] = 0.0
            if ok:
                for c in T.unroll(k):
                    y[c] = comb[t, e + c]
            softmax_eps(y, s, y, eps)
            # Column step, then R - 1 (row step, column step) pairs.
            col_sum(y, s)
            for c in T.unroll(k):
                y[c] = T.ieee_fdiv(y[c], s[c] + eps)
            if R > 1:
                for _r in T.serial(R - 1):
                    row_sum(y, s)
                    for c in T.unroll(k):
                        y[c] = T.ieee_fdiv(y[c], s[0] + eps)
                    col_sum(y, s)
                    for c in T.unroll(k):
                        y[c] = T.ieee_fdiv(y[c], s[c] + eps)
            if ok:
                for c in T.unroll(k):
                    comb_out[t, e + c] = y[c]

    return mhc_sinkhorn_fwd_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_sinkhorn_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_sinkhorn_forward_key`)."""
    return jit_compile("mhc_sinkhorn_forward", key, build_mhc_sinkhorn_forward(*key))


def mhc_sinkhorn_forward(comb: torch.Tensor, comb_out: torch.Tensor, repeat: int, eps: float) -> None:
    """Launches the Sinkhorn forward on the current stream.

    Args:
        comb: ``(T, m, m)`` f32 logits, ``T > 0``.
        comb_out: ``(T, m, m)`` f32, written.
        repeat: ``R >= 1`` (compile-time).
        eps: runtime fp32 scalar.
    """
    T_, m, _ = comb.shape
    kernel = get_mhc_sinkhorn_forward_kernel(*mhc_sinkhorn_forward_key(comb, repeat))
    kernel(comb.view(T_, m * m), comb_out.view(T_, m * m), float(eps))


def build_mhc_sinkhorn_backward(hc_mult: int, repeat: int):
    """Builds the Sinkhorn backward prim_func (OPS.md B.2.6, recompute strategy).

    Lane layout of the forward (one matrix element per lane at m = 4). The lanes recompute the
    forward with its exact arithmetic, keeping the softmax ``P`` in registers and, per
    eps-normalization step ``n``, the step input ``U_n`` of every element and the step's ``m``
    denominators (``sum + eps`` of each row or column, stored by one lane each) in shared memory;
    one barrier, then the walk back over the steps has only the ``g`` chain (product, butterfly
    sum, two exact quotients) on the critical path: the shared-memory loads and reciprocals of a
    step do not depend on ``g``. Token block: :func:`mhc_sinkhorn_backward_token_block` (8 tokens,
    25 KB at m = 4, R = 20: the 1024 CTAs of T = 8192 fit the H200 at once).

    Args:
        hc_mult: ``m`` (1, 2, 4 or 8).
        repeat: ``R`` (compile-time; the backward step loop is fully unrolled for ``R <= 32``).

    Returns:
        ``T.prim_func(grad_output (T, m*m) f32, x (T, m*m) f32, grad_input (T, m*m) f32, eps: f32)``;
        ``T`` is dynamic.
    """
    from tilelang import language as T

    m, R = hc_mult, repeat
    k, N = _sinkhorn_layout(m)
    TB = mhc_sinkhorn_backward_token_block(m, R)
    NL = TB * N  # lanes with shared-memory slots
    threads = _ceil32(NL)
    M2 = m * m
    NS = 2 * R - 1  # eps-normalization steps
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")
    softmax_eps, row_sum, col_sum, quotient = _sinkhorn_macros(T, m)
    back_loop = T.unroll if R <= 32 else T.serial

    @T.macro
    def save_row(us, ds, y, s, n, tid, tok, i, j0):
        # The step input of every element; the row denominator from the first lane of each row.
        for c in T.unroll(k):
            us[n, c, tid] = y[c]
        if j0 == 0:
            ds[n, tok, i] = s[0]

    @T.macro
    def save_col(us, ds, y, s, n, tid, tok, i, j0):
        # The step input of every element; the column denominators from the lanes of row 0.
        for c in T.unroll(k):
            us[n, c, tid] = y[c]
        if i == 0:
            for c in T.unroll(k):
                ds[n, tok, j0 + c] = s[c]

    @T.macro
    def back_finish(g, p, s, rc, q):
        # p = the step's sum of g*U_n along its axis: g <- (g - p / d) / d.
        for c in T.unroll(k):
            quotient(p, c, s[c], rc[c], q)
            g[c] = g[c] - p[c]
            quotient(g, c, s[c], rc[c], q)

    @T.macro
    def back_col(us, ds, g, u, s, rc, p, q, n, tid, tok, j0):
        for c in T.unroll(k):
            u[c] = us[n, c, tid]
            s[c] = ds[n, tok, j0 + c]
            rc[c] = T.ieee_frcp(s[c])
            p[c] = T.ieee_mul(g[c], u[c])
        col_sum(p, p)
        back_finish(g, p, s, rc, q)

    @T.macro
    def back_row(us, ds, g, u, s, rc, p, q, n, tid, tok, i):
        for c in T.unroll(k):
            u[c] = us[n, c, tid]
            s[c] = ds[n, tok, i]
            rc[c] = T.ieee_frcp(s[c])
            p[c] = T.ieee_mul(g[c], u[c])
        row_sum(p, p)
        for c in T.unroll(1, k):
            p[c] = p[0]
        back_finish(g, p, s, rc, q)

    @T.prim_func
    def mhc_sinkhorn_bwd_cuda(
        grad_output: T.Tensor((num_tokens, M2), f32),
        x: T.Tensor((num_tokens, M2), f32),
        grad_input: T.Tensor((num_tokens, M2), f32),
        eps: f32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            tid = T.get_thread_binding()
            us = T.alloc_shared((NS, k, NL), f32)
            ds = T.alloc_shared((NS, TB, m), f32)
            y = T.alloc_local((k,), f32)
            g = T.alloc_local((k,), f32)
            pm = T.alloc_local((k,), f32)
            u = T.alloc_local((k,), f32)
            p = T.alloc_local((k,), f32)
            s = T.alloc_local((k,), f32)
            rc = T.alloc_local((k,), f32)
            q = T.alloc_local((1,), f32)
            tok = tid // N
            t = bx * TB + tok
            e = (tid % N) * k
            i = e // m  # row of the lane's elements
            j0 = e % m  # column of its first element
            slot = tid < NL
            ok = slot and (t < num_tokens)
            for c in T.unroll(k):
                y[c] = 0.0
                g[c] = 0.0
            if ok:
                for c in T.unroll(k):
                    y[c] = x[t, e + c]
                for c in T.unroll(k):
                    g[c] = grad_output[t, e + c]
            # Forward recompute (the arithmetic of mhc_sinkhorn_fwd_cuda), saving each step's input
            # and denominators.
            softmax_eps(y, s, pm, eps)
            col_sum(y, s)
            for c in T.unroll(k):
                s[c] = s[c] + eps
            if slot:
                save_col(us, ds, y, s, 0, tid, tok, i, j0)
            for c in T.unroll(k):
                y[c] = T.ieee_fdiv(y[c], s[c])
            if R > 1:
                for r in T.serial(R - 1):
                    row_sum(y, s)
                    s[0] = s[0] + eps
                    if slot:
                        save_row(us, ds, y, s, 2 * r + 1, tid, tok, i, j0)
                    for c in T.unroll(k):
                        y[c] = T.ieee_fdiv(y[c], s[0])
                    col_sum(y, s)
                    for c in T.unroll(k):
                        s[c] = s[c] + eps
                    if slot:
                        save_col(us, ds, y, s, 2 * r + 2, tid, tok, i, j0)
                    for c in T.unroll(k):
                        y[c] = T.ieee_fdiv(y[c], s[c])
            # The backward reads denominators other lanes of its token stored.
            T.sync_threads()
            # Backward through the eps-normalizations, last step first.
            if R > 1:
                for rr in back_loop(R - 1):
                    back_col(us, ds, g, u, s, rc, p, q, 2 * (R - 2 - rr) + 2, tid, tok, j0)
                    back_row(us, ds, g, u, s, rc, p, q, 2 * (R - 2 - rr) + 1, tid, tok, i)
            back_col(us, ds, g, u, s, rc, p, q, 0, tid, tok, j0)
            # Softmax backward (the + eps is an identity for the gradient).
            for c in T.unroll(k):
                p[c] = T.ieee_mul(g[c], pm[c])
            row_sum(p, s)
            for c in T.unroll(k):
                g[c] = (g[c] - s[0]) * pm[c]
            if ok:
                for c in T.unroll(k):
                    grad_input[t, e + c] = g[c]

    return mhc_sinkhorn_bwd_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_sinkhorn_backward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_sinkhorn_backward_key`)."""
    return jit_compile("mhc_sinkhorn_backward", key, build_mhc_sinkhorn_backward(*key))


def mhc_sinkhorn_backward(
    grad_output: torch.Tensor, x: torch.Tensor, grad_input: torch.Tensor, repeat: int, eps: float
) -> None:
    """Launches the Sinkhorn backward on the current stream.

    Args:
        grad_output: ``(T, m, m)`` f32, ``T > 0``.
        x: ``(T, m, m)`` f32, the forward's logits.
        grad_input: ``(T, m, m)`` f32, written.
        repeat: ``R >= 1`` (compile-time).
        eps: runtime fp32 scalar.
    """
    T_, m, _ = x.shape
    kernel = get_mhc_sinkhorn_backward_kernel(*mhc_sinkhorn_backward_key(x, repeat))
    kernel(grad_output.view(T_, m * m), x.view(T_, m * m), grad_input.view(T_, m * m), float(eps))


# ---------------------------------------------------------------------------------------------------
# 17/18. mhc_head_compute_mix
# ---------------------------------------------------------------------------------------------------


def mhc_head_compute_mix_forward_key(input_mix: torch.Tensor) -> tuple:
    """Compile-time key ``(m,)``."""
    hc_mult = int(input_mix.shape[1])
    _check_mult("mhc_head_compute_mix_forward", hc_mult)
    return (hc_mult,)


def build_mhc_head_compute_mix_forward(hc_mult: int):
    """Builds the head-mix forward prim_func (OPS.md B.2.9): ``sigmoid(x * scale + base) + pre_eps``,
    the sigmoid by the MUFU ex2 and reciprocal (see the module's arithmetic contracts).

    Elementwise; one thread per element, ``_HEAD_FWD_TOKENS`` tokens per CTA (512 threads at m = 4),
    so a warp's loads and stores are single 128-byte lines and every thread has one short chain.

    Args:
        hc_mult: ``m`` (1..8).

    Returns:
        ``T.prim_func(input_mix (T, m), mhc_scale (1,), mhc_base (m,), output_mix (T, m), pre_eps: f32)``,
        all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    m, TB = hc_mult, _HEAD_FWD_TOKENS
    threads = TB * m
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_head_compute_mix_fwd_cuda(
        input_mix: T.Tensor((num_tokens, m), f32),
        mhc_scale: T.Tensor((1,), f32),
        mhc_base: T.Tensor((m,), f32),
        output_mix: T.Tensor((num_tokens, m), f32),
        pre_eps: f32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            tid = T.get_thread_binding()
            t = bx * TB + tid // m
            j = tid % m
            if t < num_tokens:
                z = T.ieee_mul(input_mix[t, j], mhc_scale[0]) + mhc_base[j]
                output_mix[t, j] = T.fast_rcp(1.0 + T.__exp(-z)) + pre_eps

    return mhc_head_compute_mix_fwd_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_head_compute_mix_forward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_head_compute_mix_forward_key`)."""
    return jit_compile("mhc_head_compute_mix_forward", key, build_mhc_head_compute_mix_forward(*key))


def mhc_head_compute_mix_forward(
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    output_mix: torch.Tensor,
    pre_eps: float,
) -> None:
    """Launches the head-mix forward on the current stream.

    Args:
        input_mix: ``(T, m)`` f32, ``T > 0``.
        mhc_scale: ``(1,)`` f32.
        mhc_base: ``(m,)`` f32.
        output_mix: ``(T, m)`` f32, written.
        pre_eps: runtime fp32 scalar.
    """
    kernel = get_mhc_head_compute_mix_forward_kernel(*mhc_head_compute_mix_forward_key(input_mix))
    kernel(input_mix, mhc_scale, mhc_base, output_mix, float(pre_eps))


def mhc_head_compute_mix_backward_key(input_mix: torch.Tensor, mhc_base_grad_partial: torch.Tensor) -> tuple:
    """Compile-time key ``(m, P)`` with ``P = mhc_base_grad_partial.shape[0]``."""
    hc_mult = int(input_mix.shape[1])
    num_partials = int(mhc_base_grad_partial.shape[0])
    _check_mult("mhc_head_compute_mix_backward", hc_mult)
    _check_partials("mhc_head_compute_mix_backward", num_partials)
    return (hc_mult, num_partials)


def build_mhc_head_compute_mix_backward(hc_mult: int, num_partials: int):
    """Builds the head-mix backward prim_func (OPS.md B.2.9).

    ``P`` persistent CTAs; CTA ``p`` owns tokens ``[p*ceil(T/P), min((p+1)*ceil(T/P), T))``, walked 64
    at a time (thread = (token, 4-float chunk)). ``dz = g * s * (1 - s)`` with ``s`` recomputed,
    ``input_mix_grad = dz * scale``; ``dz`` and ``dz * x`` are accumulated per mix index in registers
    (ascending token), the 64 lanes summed in ascending order through shared memory, and row ``p`` of
    both partials written (zeros for an idle worker; scale partial = sum over the m indices in order).

    Args:
        hc_mult: ``m`` (1..8).
        num_partials: ``P`` (1..4096).

    Returns:
        ``T.prim_func(output_mix_grad (T, m), input_mix (T, m), mhc_scale (1,), mhc_base (m,),
        input_mix_grad (T, m), mhc_scale_grad_partial (P, 1), mhc_base_grad_partial (P, m))``, all f32;
        ``T`` is dynamic.
    """
    from tilelang import language as T

    m, P, TB = hc_mult, num_partials, _HEAD_BWD_TOKENS
    v = _vec(m)
    ch = m // v
    threads = TB * ch  # NOTE 64 at m = 4
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_head_compute_mix_bwd_cuda(
        output_mix_grad: T.Tensor((num_tokens, m), f32),
        input_mix: T.Tensor((num_tokens, m), f32),
        mhc_scale: T.Tensor((1,), f32),
        mhc_base: T.Tensor((m,), f32),
        input_mix_grad: T.Tensor((num_tokens, m), f32),
        mhc_scale_grad_partial: T.Tensor((P, 1), f32),
        mhc_base_grad_partial: T.Tensor((P, m), f32),
    ):
        with T.Kernel(P, threads=threads) as p:
            tid = T.get_thread_binding()
            tl = tid // ch
            c = tid % ch
            # red[1, TB, :] holds the per-index column sums of dz * x.
            red = T.alloc_shared((2, TB + 1, m), f32)
            x = T.alloc_local((v,), f32)
            gr = T.alloc_local((v,), f32)
            b = T.alloc_local((v,), f32)
            s = T.alloc_local((v,), f32)
            ab = T.alloc_local((v,), f32)
            ax = T.alloc_local((v,), f32)
            sc = T.alloc_local((2,), f32)
            for k in T.unroll(v):
                ab[k] = 0.0
                ax[k] = 0.0
            sc[0] = mhc_scale[0]
            for k in T.unroll(v):
                b[k] = mhc_base[c * v + k]
            per = T.ceildiv(num_tokens, P)
            t_begin = T.min(per * p, num_tokens)
            t_end = T.min(per * p + per, num_tokens)
            for it in T.serial(T.ceildiv(t_end - t_begin, TB)):
                t = t_begin + it * TB + tl
                if t < t_end:
                    for k in T.vectorized(v):
                        x[k] = input_mix[t, c * v + k]
                    for k in T.vectorized(v):
                        gr[k] = output_mix_grad[t, c * v + k]
                    for k in T.unroll(v):
                        s[k] = T.sigmoid(T.ieee_mul(x[k], sc[0]) + b[k])
                        gr[k] = gr[k] * s[k] * (1.0 - s[k])  # dz
                        ab[k] = ab[k] + gr[k]
                        ax[k] = ax[k] + gr[k] * x[k]
                        s[k] = gr[k] * sc[0]
                    for k in T.vectorized(v):
                        input_mix_grad[t, c * v + k] = s[k]
            for k in T.unroll(v):
                red[0, tl, c * v + k] = ab[k]
                red[1, tl, c * v + k] = ax[k]
            T.sync_threads()
            if tid < m:
                sc[0] = red[0, 0, tid]
                sc[1] = red[1, 0, tid]
                for i in T.unroll(1, TB):
                    sc[0] = sc[0] + red[0, i, tid]
                    sc[1] = sc[1] + red[1, i, tid]
                mhc_base_grad_partial[p, tid] = sc[0]
                red[1, TB, tid] = sc[1]
            T.sync_threads()
            if tid == 0:
                sc[1] = red[1, TB, 0]
                for j in T.unroll(1, m):
                    sc[1] = sc[1] + red[1, TB, j]
                mhc_scale_grad_partial[p, 0] = sc[1]

    return mhc_head_compute_mix_bwd_cuda


@functools.lru_cache(maxsize=None)
def get_mhc_head_compute_mix_backward_kernel(*key):
    """Compiled kernel for ``key`` (see :func:`mhc_head_compute_mix_backward_key`)."""
    return jit_compile("mhc_head_compute_mix_backward", key, build_mhc_head_compute_mix_backward(*key))


def mhc_head_compute_mix_backward(
    output_mix_grad: torch.Tensor,
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    input_mix_grad: torch.Tensor,
    mhc_scale_grad_partial: torch.Tensor,
    mhc_base_grad_partial: torch.Tensor,
) -> None:
    """Launches the head-mix backward on the current stream.

    Args:
        output_mix_grad: ``(T, m)`` f32, ``T > 0``.
        input_mix: ``(T, m)`` f32.
        mhc_scale: ``(1,)`` f32.
        mhc_base: ``(m,)`` f32.
        input_mix_grad: ``(T, m)`` f32, written.
        mhc_scale_grad_partial: ``(P, 1)`` f32, every row written (the caller sums over ``P``).
        mhc_base_grad_partial: ``(P, m)`` f32, every row written.
    """
    key = mhc_head_compute_mix_backward_key(input_mix, mhc_base_grad_partial)
    kernel = get_mhc_head_compute_mix_backward_kernel(*key)
    kernel(
        output_mix_grad, input_mix, mhc_scale, mhc_base, input_mix_grad, mhc_scale_grad_partial, mhc_base_grad_partial
    )


# ---------------------------------------------------------------------------------------------------
# Lowering cases
# ---------------------------------------------------------------------------------------------------


def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every kernel variant of this module, as un-compiled prim_funcs (for the CPU build tests).

    All kernels here are hidden-size independent (``rms_group_size`` is a runtime scalar), so
    ``hidden_size`` is unused. Cases: ``reduce_rmsnorm_fwd_s{16,1}``, ``reduce_rmsnorm_fwd_g2``
    (generic ``G``), ``reduce_rmsnorm_bwd``, ``split_mixes_fwd``, ``split_mixes_bwd``,
    ``split_mixes_bwd_reduce``, ``sinkhorn_{fwd,bwd}_r{1,10,20}``, ``head_mix_fwd``,
    ``head_mix_bwd`` (at ``P = 132``).

    Returns:
        ``{case name: T.prim_func}``.
    """
    del hidden_size
    m = hc_mult
    M3 = m * (m + 2)
    P = MHC_SPLIT_MIXES_PARTIALS
    cases = {
        "reduce_rmsnorm_fwd_s16": build_mhc_reduce_partials_and_rmsnorm_forward(16, 1, M3),
        "reduce_rmsnorm_fwd_s1": build_mhc_reduce_partials_and_rmsnorm_forward(1, 1, M3),
        "reduce_rmsnorm_fwd_g2": build_mhc_reduce_partials_and_rmsnorm_forward(16, 2, M3),
        "reduce_rmsnorm_bwd": build_mhc_reduce_partials_and_rmsnorm_backward(1, M3),
        "split_mixes_fwd": build_mhc_pre_split_mixes_forward(m),
        "split_mixes_bwd": build_mhc_pre_split_mixes_backward(m, P),
        "split_mixes_bwd_reduce": build_mhc_pre_split_mixes_backward_reduce(m, P),
        "head_mix_fwd": build_mhc_head_compute_mix_forward(m),
        "head_mix_bwd": build_mhc_head_compute_mix_backward(m, P),
    }
    for r in (1, 10, 20):
        cases[f"sinkhorn_fwd_r{r}"] = build_mhc_sinkhorn_forward(m, r)
        cases[f"sinkhorn_bwd_r{r}"] = build_mhc_sinkhorn_backward(m, r)
    return cases
