"""CUDA kernels of ``mhc_sinkhorn_forward`` / ``_backward`` (docs/ops/mhc.md#sinkhorn).

One lane per element of a token's ``m x m`` matrix (``m * m / 32`` neighbouring elements of a row per lane when
``m * m > 32``); every sum along a row or a column is a pairwise tree, ``(y_0 + y_1) + (y_2 + y_3)`` at m = 4
(an xor-butterfly over the lanes that hold the elements; a lane's own elements are added in order first). Row
softmax ``exp(x - rowmax) / rowsum`` (``expf``, IEEE division); every eps-normalization is the IEEE quotient
``y / (sum + eps)``. The backward recomputes the forward, keeping each step's inputs and denominators in shared
memory, and walks back over the steps forming its quotients by a denominator ``d`` whose reciprocal is known
ahead of the chain: ``rc = __frcp_rn(d)``, ``q = __fmul_rn(y, rc)``, ``y' = __fmaf_rn(__fmaf_rn(-d, q, y), rc,
q)``, the same correctly rounded ``y / d`` for normal operands (Markstein: ``rc`` is correctly rounded and ``q``
within one ulp of the quotient, so one FMA correction rounds exactly); its products ``g * U`` are rounded before
they are summed (``__fmul_rn``). ``m`` a power of two in ``limits.MHC_HC_MULT``, ``R`` in
``limits.MHC_SINKHORN_REPEAT["cuda"]``; independent of ``H``; launchers take contiguous inputs and ``T > 0``.
"""

import dataclasses

import torch

from ....chips import H200
from ....limits import MHC_HC_MULT, MHC_SINKHORN_REPEAT, LimitError
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import ceil32
from ._sinkhorn import sinkhorn_layout, sinkhorn_macros


@dataclasses.dataclass(frozen=True)
class SinkhornPlan:
    """``threads`` per CTA of the forward (``threads / (m * m)`` tokens); ``backward_smem_budget``: shared
    memory per CTA above which the backward halves its token block (down to one warp per CTA)."""

    threads: int
    backward_smem_budget: int


# 128 threads (8 tokens of 16 lanes at m = 4), one matrix element per lane (the fastest of 1, 2, 4); the
# backward keeps per step one input per element and m denominators per token, 25 KB for 8 tokens at R = 20, so
# the 1024 CTAs of T = 8192 are resident at once (docs/perf/h200/mhc.md, 2026-11-30).
PLAN = SinkhornPlan(threads=128, backward_smem_budget=113 * 1024)


def _check(op: str, hc_mult: int, repeat: int) -> None:
    MHC_HC_MULT.require(op, hc_mult)
    if hc_mult & (hc_mult - 1):
        raise LimitError(f"{op}: the CUDA Sinkhorn kernels need a power-of-two hc_mult, got {hc_mult}")
    MHC_SINKHORN_REPEAT["cuda"].require(op, repeat)


@compile_key
class SinkhornKey:
    """Compile-time key of both kernels: ``m`` and the repeat count ``R`` (never the token count)."""

    hc_mult: int
    repeat: int


def _forward_key(comb: torch.Tensor, repeat: int) -> SinkhornKey:
    hc_mult = int(comb.shape[-1])
    _check("mhc_sinkhorn_forward", hc_mult, int(repeat))
    return SinkhornKey(hc_mult, int(repeat))


def _cases(op: str):
    """``<op>_r{R}`` at ``R`` in {1, 10, 20} (independent of ``hidden_size``)."""
    return lambda hidden_size, hc_mult: {f"{op}_r{r}": SinkhornKey(hc_mult, r) for r in (1, 10, 20)}


def _sinkhorn_tokens_per_cta(hc_mult: int) -> int:
    """Tokens per CTA of the Sinkhorn forward: ``PLAN.threads`` threads (at least one token)."""
    return max(1, PLAN.threads // sinkhorn_layout(hc_mult)[1])


def mhc_sinkhorn_backward_token_block(hc_mult: int, repeat: int) -> int:
    """Tokens per CTA of the Sinkhorn backward.

    Per token the backward keeps, for each of its ``2R-1`` eps-normalization steps, the step input
    (``m*m`` floats) and the step's ``m`` denominators in shared memory: ``4*(2R-1)*(m*m + m)`` bytes
    (3120 B at m = 4, R = 20). Starts from the forward's token block and halves it while the CTA
    exceeds ``PLAN.backward_smem_budget`` and keeps more than one warp; ``LimitError`` where one CTA's
    shared memory cannot hold the block.
    """
    _, lanes = sinkhorn_layout(hc_mult)
    per_token = 4 * (2 * repeat - 1) * (hc_mult * hc_mult + hc_mult)
    tb = _sinkhorn_tokens_per_cta(hc_mult)
    while tb * lanes > 32 and tb * per_token > PLAN.backward_smem_budget:
        tb //= 2
    if tb * per_token > H200.arch.smem_per_cta:
        raise LimitError(
            f"mhc_sinkhorn_backward: m={hc_mult}, repeat={repeat} needs {tb * per_token} B of shared memory per CTA,"
            f" more than the {H200.arch.smem_per_cta} B of one CTA"
        )
    return tb


def _backward_key(x: torch.Tensor, repeat: int) -> SinkhornKey:
    hc_mult = int(x.shape[-1])
    _check("mhc_sinkhorn_backward", hc_mult, int(repeat))
    mhc_sinkhorn_backward_token_block(hc_mult, int(repeat))  # validates the shared-memory need
    return SinkhornKey(hc_mult, int(repeat))


def build_mhc_sinkhorn_forward(hc_mult: int, repeat: int):
    """Builds the Sinkhorn forward prim_func (docs/ops/mhc.md#sinkhorn).

    ``N`` lanes per token (:func:`sinkhorn_layout`: 16 at m = 4, one matrix element each) and
    :func:`_sinkhorn_tokens_per_cta` tokens per CTA (8 at m = 4: 64 CTAs at T = 512, 1024 at T = 8192).
    A normalization step is two butterfly levels (shuffle + add), the ``+ eps`` and one IEEE
    division on every lane's dependent chain. Every lane runs every shuffle (lanes of tokens past
    ``T`` compute on zeros and store nothing).

    Args:
        hc_mult: ``m`` (a power of two).
        repeat: ``R`` (compile-time).

    Returns:
        ``T.prim_func(comb (T, m*m) f32, comb_out (T, m*m) f32, eps: f32)``; ``T`` is dynamic.
    """
    _check("mhc_sinkhorn_forward", hc_mult, repeat)
    from tilelang import language as T

    m, R = hc_mult, repeat
    k, N = sinkhorn_layout(m)
    TB = _sinkhorn_tokens_per_cta(m)
    threads = ceil32(TB * N)
    M2 = m * m
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")
    softmax_eps, row_sum, col_sum, _ = sinkhorn_macros(T, m)

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


FORWARD = Kernel("mhc_sinkhorn_forward", SinkhornKey, build_mhc_sinkhorn_forward, derive=_forward_key,
                 cases=_cases("mhc_sinkhorn_forward"))


def mhc_sinkhorn_forward(comb: torch.Tensor, comb_out: torch.Tensor, repeat: int, eps: float) -> None:
    """Launches the Sinkhorn forward on the current stream.

    Args:
        comb: ``(T, m, m)`` f32 logits, ``T > 0``.
        comb_out: ``(T, m, m)`` f32, written.
        repeat: ``R >= 1`` (compile-time).
        eps: runtime fp32 scalar.
    """
    T_, m, _ = comb.shape
    FORWARD.compiled(FORWARD.key(comb, repeat))(comb.view(T_, m * m), comb_out.view(T_, m * m), float(eps))


def build_mhc_sinkhorn_backward(hc_mult: int, repeat: int):
    """Builds the Sinkhorn backward prim_func (docs/ops/mhc.md#sinkhorn, recompute strategy).

    Lane layout of the forward (one matrix element per lane at m = 4). The lanes recompute the
    forward with its exact arithmetic, keeping the softmax ``P`` in registers and, per
    eps-normalization step ``n``, the step input ``U_n`` of every element and the step's ``m``
    denominators (``sum + eps`` of each row or column, stored by one lane each) in shared memory;
    one barrier, then the walk back over the steps has only the ``g`` chain (product, butterfly
    sum, two exact quotients) on the critical path: the shared-memory loads and reciprocals of a
    step do not depend on ``g``. Token block: :func:`mhc_sinkhorn_backward_token_block` (8 tokens,
    25 KB at m = 4, R = 20: the 1024 CTAs of T = 8192 fit the H200 at once).

    Args:
        hc_mult: ``m`` (a power of two).
        repeat: ``R`` (compile-time; the backward step loop is fully unrolled for ``R <= 32``).

    Returns:
        ``T.prim_func(grad_comb_out (T, m*m) f32, x (T, m*m) f32, grad_comb (T, m*m) f32, eps: f32)``;
        ``T`` is dynamic.
    """
    _check("mhc_sinkhorn_backward", hc_mult, repeat)
    from tilelang import language as T

    m, R = hc_mult, repeat
    k, N = sinkhorn_layout(m)
    TB = mhc_sinkhorn_backward_token_block(m, R)
    NL = TB * N  # lanes with shared-memory slots
    threads = ceil32(NL)
    M2 = m * m
    NS = 2 * R - 1  # eps-normalization steps
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")
    softmax_eps, row_sum, col_sum, quotient = sinkhorn_macros(T, m)
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
        grad_comb_out: T.Tensor((num_tokens, M2), f32),
        x: T.Tensor((num_tokens, M2), f32),
        grad_comb: T.Tensor((num_tokens, M2), f32),
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
                    g[c] = grad_comb_out[t, e + c]
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
                    grad_comb[t, e + c] = g[c]

    return mhc_sinkhorn_bwd_cuda


BACKWARD = Kernel("mhc_sinkhorn_backward", SinkhornKey, build_mhc_sinkhorn_backward, derive=_backward_key,
                  cases=_cases("mhc_sinkhorn_backward"))


def mhc_sinkhorn_backward(
    grad_comb_out: torch.Tensor, comb: torch.Tensor, grad_comb: torch.Tensor, repeat: int, eps: float
) -> None:
    """Launches the Sinkhorn backward on the current stream.

    Args:
        grad_comb_out: ``(T, m, m)`` f32, ``T > 0``.
        comb: ``(T, m, m)`` f32, the forward's logits.
        grad_comb: ``(T, m, m)`` f32, written.
        repeat: ``R >= 1`` (compile-time).
        eps: runtime fp32 scalar.
    """
    T_, m, _ = comb.shape
    kernel = BACKWARD.compiled(BACKWARD.key(comb, repeat))
    kernel(grad_comb_out.view(T_, m * m), comb.view(T_, m * m), grad_comb.view(T_, m * m), float(eps))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
