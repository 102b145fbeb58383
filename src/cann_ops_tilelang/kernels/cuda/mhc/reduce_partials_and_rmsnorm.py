"""CUDA kernels of ``mhc_reduce_partials_and_rmsnorm_forward`` / ``_backward``
(docs/ops/mhc.md#reduce_partials_and_rmsnorm).

Forward: ``om = ((p_0 + p_1) + ...) + p_{S-1}`` and ``sq`` likewise (sequential ``s``), ``r = rsqrtf(sq / Rg +
eps)`` (IEEE division, CUDA ``rsqrtf``), ``out = om * r`` for ``G = 1`` and ``((om_0 * r_0) + om_1 * r_1) + ...``
(fused multiply-adds) for ``G > 1``: the fused ``mhc_pre_big_fuse`` must reproduce this arithmetic to stay
bit-exact. Backward: ``grad_out_mul = grad_out * r``, ``grad_sqrsum = -(rho * r) / (2 * (sq + eps * Rg))`` with
``rho = sum_j grad_out[j] * om[j]`` (ascending ``j``). One launch over blocks of 32 tokens, every thread's loads
issued before its math, ``float4`` accesses where the row allows; independent of ``H`` (``Rg`` is a runtime
scalar). Launchers take contiguous inputs with 16-byte aligned data pointers and ``T > 0``.
"""


import torch

from ....limits import IntRange, LimitError
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import TOKENS_PER_CTA, ceil32, vec_width


# what the kernels take (wider than the ops' limits.MHC_RMS_GROUPS and limits.MHC_MIX)
GROUPS = IntRange("RMS groups G", 1, 16)
MIX = IntRange("M3", 1, 32)


@compile_key
class ForwardKey:
    """Compile-time key of the forward: ``S`` splits, ``G`` RMS groups, ``M3`` mixes (never the token count)."""

    n_splits: int
    n_groups: int
    mult3: int


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``G`` RMS groups, ``M3`` mixes."""

    n_groups: int
    mult3: int


def _forward_key(out_mul_splitted: torch.Tensor, n_splits: int) -> ForwardKey:
    """``LimitError`` unless ``S == n_splits >= 1``, ``G`` in :data:`GROUPS` and ``M3`` in :data:`MIX`."""
    op = "mhc_reduce_partials_and_rmsnorm_forward"
    splits, _, groups, mult3 = (int(s) for s in out_mul_splitted.shape)
    if splits != int(n_splits) or n_splits < 1:
        raise LimitError(f"{op}: out_mul_splitted has {splits} splits but n_splits={n_splits}")
    return ForwardKey(splits, GROUPS.require(op, groups), MIX.require(op, mult3))


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    """At 16 and 1 splits and with 2 RMS groups (the generic ``G`` path); independent of ``hidden_size``."""
    m3, forward = hc_mult * (hc_mult + 2), "mhc_reduce_partials_and_rmsnorm_forward"
    return {f"{forward}_s16": ForwardKey(16, 1, m3), f"{forward}_s1": ForwardKey(1, 1, m3),
            f"{forward}_g2": ForwardKey(16, 2, m3)}


def build_mhc_reduce_partials_and_rmsnorm_forward(n_splits: int, n_groups: int, mult3: int):
    """Builds the split-K reduction + RMS normalization prim_func (docs/ops/mhc.md#reduce_partials_and_rmsnorm).

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

    S, G, M3, TB = n_splits, n_groups, mult3, TOKENS_PER_CTA
    GM = G * M3
    va, vb = vec_width(GM), vec_width(M3)
    items_a = TB * GM // va  # out_mul vectors per CTA
    # 192 threads at G = 1, M3 = 24 (each with S float4 loads in flight: 48 KB per CTA at S = 16).
    ta = min(ceil32(items_a), 256)
    na = -(-items_a // ta)
    items_q = TB * G  # (token, group) pairs per CTA
    tq = min(ceil32(items_q), 128)
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


FORWARD = Kernel("mhc_reduce_partials_and_rmsnorm_forward", ForwardKey, build_mhc_reduce_partials_and_rmsnorm_forward,
                 derive=_forward_key, cases=_forward_cases)


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
    FORWARD.compiled(FORWARD.key(out_mul_splitted, n_splits))(
        out_mul_splitted.view(S, T_, G * M3),
        sqrsum_splitted,
        out_mul.view(T_, G * M3),
        sqrsum,
        out,
        float(rms_group_size),
        float(rms_eps),
    )


def _backward_key(out_mul: torch.Tensor) -> BackwardKey:
    """``LimitError`` unless ``G`` is in :data:`GROUPS` and ``M3`` in :data:`MIX`."""
    op = "mhc_reduce_partials_and_rmsnorm_backward"
    _, groups, mult3 = (int(s) for s in out_mul.shape)
    return BackwardKey(GROUPS.require(op, groups), MIX.require(op, mult3))


def build_mhc_reduce_partials_and_rmsnorm_backward(n_groups: int, mult3: int):
    """Builds the RMS-normalization backward prim_func (docs/ops/mhc.md#reduce_partials_and_rmsnorm).

    One thread per (token, group), 32 tokens per CTA; each thread loads its ``grad_out`` row and its
    ``out_mul`` row with vector loads, then ``r = rsqrt(sq/Rg + eps)``, ``grad_out_mul = grad_out * r``,
    ``rho = sum_j grad_out[j] * om[j]`` (ascending ``j``) and
    ``grad_sqrsum = -(rho * r) / (2 * (sq + eps * Rg))``.

    Args:
        n_groups: ``G`` in ``[1, 16]``.
        mult3: ``M3`` in ``[1, 32]``.

    Returns:
        ``T.prim_func(grad_out (T, M3), out_mul (T, G*M3), sqrsum (T, G), grad_out_mul (T, G*M3),
        grad_sqrsum (T, G), rms_group_size: f32, rms_eps: f32)``, all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    G, M3, TB = n_groups, mult3, TOKENS_PER_CTA
    GM = G * M3
    v = vec_width(M3)
    threads = TB * G  # <= 512 threads; each holds 2*M3 <= 64 floats of its rows
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_reduce_partials_and_rmsnorm_bwd_cuda(
        grad_out: T.Tensor((num_tokens, M3), f32),
        out_mul: T.Tensor((num_tokens, GM), f32),
        sqrsum: T.Tensor((num_tokens, G), f32),
        grad_out_mul: T.Tensor((num_tokens, GM), f32),
        grad_sqrsum: T.Tensor((num_tokens, G), f32),
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
                        og[c * v + k] = grad_out[t, c * v + k]
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
                        grad_out_mul[t, g * M3 + c * v + k] = om[c * v + k]
                grad_sqrsum[t, g] = -(sc[2] * sc[1]) / (2.0 * (sc[0] + rms_eps * rms_group_size))

    return mhc_reduce_partials_and_rmsnorm_bwd_cuda


BACKWARD = Kernel("mhc_reduce_partials_and_rmsnorm_backward", BackwardKey,
                  build_mhc_reduce_partials_and_rmsnorm_backward,
                  derive=_backward_key, cases=lambda hidden_size, hc_mult: BackwardKey(1, hc_mult * (hc_mult + 2)))


def mhc_reduce_partials_and_rmsnorm_backward(
    grad_out: torch.Tensor,
    out_mul: torch.Tensor,
    sqrsum: torch.Tensor,
    grad_out_mul: torch.Tensor,
    grad_sqrsum: torch.Tensor,
    rms_group_size: int,
    rms_eps: float,
) -> None:
    """Launches the RMS-normalization backward on the current stream.

    Args:
        grad_out: ``(T, M3)`` f32, ``T > 0``.
        out_mul: ``(T, G, M3)`` f32 (saved ``om``).
        sqrsum: ``(T, G)`` f32 (saved ``sq``).
        grad_out_mul: ``(T, G, M3)`` f32, written (``grad_out * r``).
        grad_sqrsum: ``(T, G)`` f32, written (``-rho * r / (2 * (sq + eps * Rg))``).
        rms_group_size: ``Rg`` (runtime fp32 scalar).
        rms_eps: RMSNorm epsilon (runtime fp32 scalar).
    """
    T_, G, M3 = out_mul.shape
    BACKWARD.compiled(BACKWARD.key(out_mul))(
        grad_out,
        out_mul.view(T_, G * M3),
        sqrsum,
        grad_out_mul.view(T_, G * M3),
        grad_sqrsum,
        float(rms_group_size),
        float(rms_eps),
    )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
