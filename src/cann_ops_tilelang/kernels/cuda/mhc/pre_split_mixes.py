"""CUDA kernels of ``mhc_pre_split_mixes_forward`` / ``_backward`` (docs/ops/mhc.md#pre_split_mixes).

Forward: ``z = __fmul_rn(x, scale) + base`` (two roundings, as torch's ``x * scale + base``), ``sigmoid(z) = 1 /
(1 + expf(-z))``; ``pre = sigmoid + pre_eps``, ``post = sigmoid * post_mult_value``, ``comb = z`` (the fused
``mhc_pre_big_fuse`` must reproduce this arithmetic to stay bit-exact). Backward: a fixed grid of
``MHC_SPLIT_MIXES_PARTIALS`` workers; worker ``p`` owns the token range ``[p*ceil(T/P), min((p+1)*ceil(T/P),
T))`` and writes its partial row (zeros when the range is empty); a second one-CTA kernel sums the rows in a
fixed order (8 strided groups, then their sums). No atomics: deterministic run to run. Independent of ``H``;
launchers take contiguous inputs with 16-byte aligned data pointers and ``T > 0``.
"""

import dataclasses

import torch

from ....limits import MHC_HC_MULT
from ....policy import MHC_SPLIT_MIXES_PARTIALS
from ..._kernel import Kernel, kernel_module
from ._common import TOKENS_PER_CTA, MixKey, PartialsKey, ceil32, vec_width


# Per-worker partial rows of the backward, MHC_SPLIT_MIXES_PARTIALS (device policy): one worker per H200 SM, a
# fixed number (not the device's SM count), so that a token count always maps to the same partition.


@dataclasses.dataclass(frozen=True)
class SplitMixesPlan:
    """The backward's ``backward_tokens`` tokens per pass of a worker CTA (two threads each) and the
    ``reduce_warps`` groups of its partial reduction."""

    backward_tokens: int
    reduce_warps: int


# Forward: chunk-major (chunk, token) threads, so that every warp takes one branch. Backward: two threads per
# token (pre/post, comb: warp-uniform branches), 32 tokens per pass; the reduction's 8 groups turn the 132 rows
# into 8 chains of <= 17 loads and adds (docs/perf/h200/mhc.md, 2026-11-30).
PLAN = SplitMixesPlan(backward_tokens=32, reduce_warps=8)


def _key(op: str, hc_mult) -> int:
    return MHC_HC_MULT.require(op, int(hc_mult))


def _partials(hidden_size: int, hc_mult: int) -> PartialsKey:
    return PartialsKey(hc_mult, MHC_SPLIT_MIXES_PARTIALS)


def build_mhc_pre_split_mixes_forward(hc_mult: int):
    """Builds the mix-splitting forward prim_func (docs/ops/mhc.md#pre_split_mixes).

    One CTA per 32 tokens; thread ``(c, token)`` owns the ``c``-th ``float4`` chunk of the token's
    ``M3`` mixes (6 chunks at m = 4: pre, post, then four comb chunks), chunk-major, so every warp
    works on one chunk: its branch (sigmoid + eps, sigmoid * post_mult, or copy) is warp-uniform, and
    each thread has one vector load, four mixes of math and one vector store.

    Args:
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(input_mixes (T, M3), mhc_scale (3,), mhc_base (M3,), pre (T, m), post (T, m),
        comb (T, m*m), post_mult_value: f32, pre_eps: f32)``, all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    m, TB = hc_mult, TOKENS_PER_CTA
    M3, M2 = m * (m + 2), m * m
    v = vec_width(m)
    ch = M3 // v  # chunks per token
    cp = m // v  # chunks per pre / post segment
    threads = ch * TB  # 192 at m = 4
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


FORWARD = Kernel("mhc_pre_split_mixes_forward", MixKey, build_mhc_pre_split_mixes_forward,
                 derive=lambda pre: MixKey(_key("mhc_pre_split_mixes_forward", pre.shape[1])),
                 cases=lambda hidden_size, hc_mult: MixKey(hc_mult))


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
    kernel = FORWARD.compiled(FORWARD.key(pre))
    kernel(input_mixes, mhc_scale, mhc_base, pre, post, comb, float(post_mult_value), float(pre_eps))


def build_mhc_pre_split_mixes_backward(hc_mult: int, num_partials: int):
    """Builds the main mix-splitting backward prim_func (docs/ops/mhc.md#pre_split_mixes).

    ``P`` persistent CTAs; CTA ``p`` owns tokens ``[p*ceil(T/P), min((p+1)*ceil(T/P), T))`` and walks
    them ``TB = PLAN.backward_tokens`` at a time with two threads per token: thread ``tl < TB`` takes the
    token's pre and post mixes (the sigmoid and ``post`` math), thread ``TB + tl`` its ``m*m`` comb
    mixes, so each branch is warp-uniform and both chains are short. A thread loads its rows with
    vector loads, writes its part of ``grad_input_mixes`` and accumulates ``dz`` and ``dz * x`` per mix
    index in registers (ascending token); the CTA then sums the ``TB`` token rows in ascending order
    through shared memory and writes row ``p`` of the partials: ``[0, M3)`` = sum of ``dz`` per mix,
    ``M3 + c`` = sum of ``dz * x`` over segment ``c`` (ascending mix index).

    Args:
        hc_mult: ``m``.
        num_partials: ``P``.

    Returns:
        ``T.prim_func(grad_pre (T, m), grad_post (T, m), grad_comb (T, m*m), input_mixes (T, M3),
        post (T, m), mhc_scale (3,), mhc_base (M3,), grad_input_mixes (T, M3), partial (P, M3+3),
        post_mult_value: f32)``, all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    m, P, TB = hc_mult, num_partials, PLAN.backward_tokens
    M3, M2 = m * (m + 2), m * m
    W = M3 + 3
    v = vec_width(m)
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
        grad_pre: T.Tensor((num_tokens, m), f32),
        grad_post: T.Tensor((num_tokens, m), f32),
        grad_comb: T.Tensor((num_tokens, M2), f32),
        input_mixes: T.Tensor((num_tokens, M3), f32),
        post: T.Tensor((num_tokens, m), f32),
        mhc_scale: T.Tensor((3,), f32),
        mhc_base: T.Tensor((M3,), f32),
        grad_input_mixes: T.Tensor((num_tokens, M3), f32),
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
                        load_row(gp, grad_pre, t, 0, m)
                        load_row(gq, grad_post, t, 0, m)
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
                        store_row(grad_input_mixes, dz, t, 0, 2 * m)
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
                        load_row(dz, grad_comb, t, 0, M2)
                        for j in T.unroll(M2):
                            ab[j] = ab[j] + dz[j]
                            ax[j] = ax[j] + dz[j] * x[j]
                            dz[j] = dz[j] * s3[2]
                        store_row(grad_input_mixes, dz, t, 2 * m, M2)
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

    One CTA of ``G = PLAN.reduce_warps`` groups of ``ceil32(M3 + 3)`` threads (one warp at m = 4);
    thread ``j < M3 + 3`` of group ``w`` sums column ``j`` of the partial rows ``w, w + G, w + 2G, ...``
    in ascending order (all its loads in flight at once, then a short add chain), and thread ``j``
    adds the ``G`` group sums in ascending ``w`` and overwrites ``grad_mhc_base[j]`` (``j < M3``) or ``grad_mhc_scale[j - M3]``.

    Args:
        hc_mult: ``m``.
        num_partials: ``P``.

    Returns:
        ``T.prim_func(partial (P, M3+3) f32, grad_mhc_scale (3,) f32, grad_mhc_base (M3,) f32)``.
    """
    from tilelang import language as T

    m, P = hc_mult, num_partials
    M3 = m * (m + 2)
    W = M3 + 3
    NW = PLAN.reduce_warps
    lanes = ceil32(W)
    threads = NW * lanes
    per = (P + NW - 1) // NW
    f32 = T.float32

    @T.prim_func
    def mhc_pre_split_mixes_bwd_reduce_cuda(
        partial: T.Tensor((P, W), f32),
        grad_mhc_scale: T.Tensor((3,), f32),
        grad_mhc_base: T.Tensor((M3,), f32),
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
                    grad_mhc_base[tid] = acc[0]
                else:
                    grad_mhc_scale[tid - M3] = acc[0]

    return mhc_pre_split_mixes_bwd_reduce_cuda


# the backward's two kernels share the key (m, P = MHC_SPLIT_MIXES_PARTIALS)
BACKWARD = Kernel("mhc_pre_split_mixes_backward", PartialsKey, build_mhc_pre_split_mixes_backward, cases=_partials,
                  derive=lambda post: PartialsKey(_key("mhc_pre_split_mixes_backward", post.shape[1]),
                                                  MHC_SPLIT_MIXES_PARTIALS))
BACKWARD_REDUCE = Kernel("mhc_pre_split_mixes_backward_reduce", PartialsKey, build_mhc_pre_split_mixes_backward_reduce,
                         cases=_partials)


def mhc_pre_split_mixes_backward(
    grad_pre: torch.Tensor,
    grad_post: torch.Tensor,
    grad_comb: torch.Tensor,
    input_mixes: torch.Tensor,
    post: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    grad_input_mixes: torch.Tensor,
    grad_mhc_scale: torch.Tensor,
    grad_mhc_base: torch.Tensor,
    post_mult_value: float,
) -> None:
    """Launches the mix-splitting backward (two kernels) on the current stream.

    The first kernel writes ``grad_input_mixes`` and ``(P, M3 + 3)`` per-worker partials into a
    temporary ``torch.empty`` buffer (every row written); the second sums them in a fixed worker
    order and **overwrites** ``grad_mhc_scale`` and ``grad_mhc_base``.

    Args:
        grad_pre: ``(T, m)`` f32, ``T > 0``.
        grad_post: ``(T, m)`` f32.
        grad_comb: ``(T, m*m)`` f32.
        input_mixes: ``(T, M3)`` f32.
        post: ``(T, m)`` f32, the forward's ``post`` output.
        mhc_scale: ``(3,)`` f32.
        mhc_base: ``(M3,)`` f32.
        grad_input_mixes: ``(T, M3)`` f32, written.
        grad_mhc_scale: ``(3,)`` f32, overwritten.
        grad_mhc_base: ``(M3,)`` f32, overwritten.
        post_mult_value: runtime fp32 scalar.
    """
    key = BACKWARD.key(post)
    m, P = key.hc_mult, key.num_partials
    partial = torch.empty((P, m * (m + 2) + 3), dtype=torch.float32, device=input_mixes.device)
    BACKWARD.compiled(key)(
        grad_pre, grad_post, grad_comb, input_mixes, post, mhc_scale, mhc_base, grad_input_mixes, partial,
        float(post_mult_value),
    )
    BACKWARD_REDUCE.compiled(key)(partial, grad_mhc_scale, grad_mhc_base)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD, BACKWARD_REDUCE)
