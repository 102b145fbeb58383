"""CUDA kernels of ``mhc_head_compute_mix_forward`` / ``_backward`` (docs/ops/mhc.md#head_compute_mix).

Forward: ``z = __fmul_rn(x, scale) + base`` (two roundings, as torch's ``x * scale + base``), ``out = sigmoid(z)
+ pre_eps`` with ``sigmoid(z) = rcp.approx.ftz(1 + __expf(-z))`` (MUFU ex2 and rcp; at most 2.4e-7 relative
error against float64 on randn inputs, flushed to 0 where sigmoid is subnormal, z < -87.3, an absolute error
below 2^-126), within the op's ``rtol 1e-4, atol 1e-5``; not part of the fused kernel. The backward recomputes
sigmoid the IEEE way on a fixed grid of ``P`` workers: worker ``p`` owns the token range ``[p*ceil(T/P),
min((p+1)*ceil(T/P), T))`` and writes its partial rows (zeros when the range is empty), which the caller sums.
No atomics: deterministic run to run. Independent of ``H``; launchers take contiguous inputs with 16-byte
aligned data pointers and ``T > 0``.
"""

import dataclasses

import torch

from ....chips import H200
from ....limits import MHC_HC_MULT, MHC_HEAD_MIX_PARTIALS
from ..._kernel import Kernel, kernel_module
from ._common import MixKey, PartialsKey, vec_width


# the backward's partial rows (the caller's buffers) that the kernel takes
PARTIALS = MHC_HEAD_MIX_PARTIALS["cuda"]


@dataclasses.dataclass(frozen=True)
class HeadMixPlan:
    """``forward_tokens`` per CTA of the elementwise forward (one thread per element) and ``backward_tokens``
    per worker iteration of the backward (one thread per (token, 4-float chunk))."""

    forward_tokens: int
    backward_tokens: int


# Forward: 128 tokens (512 threads at m = 4), each warp's loads and stores single 128-byte lines, one load
# latency plus a short math chain per thread. Backward: 64 tokens per iteration (3 per worker at T = 24576 with
# one worker per H200 SM) (docs/perf/h200/mhc.md, 2026-12-01).
PLAN = HeadMixPlan(forward_tokens=128, backward_tokens=64)


def build_mhc_head_compute_mix_forward(hc_mult: int):
    """Builds the head-mix forward prim_func (docs/ops/mhc.md#head_compute_mix): ``sigmoid(x * scale + base) +
    pre_eps``, the sigmoid by the MUFU ex2 and reciprocal (see the module docstring).

    Elementwise; one thread per element, ``PLAN.forward_tokens`` tokens per CTA (512 threads at m = 4),
    so a warp's loads and stores are single 128-byte lines and every thread has one short chain.

    Args:
        hc_mult: ``m``.

    Returns:
        ``T.prim_func(input_mix (T, m), mhc_scale (1,), mhc_base (m,), output_mix (T, m), pre_eps: f32)``,
        all f32; ``T`` is dynamic.
    """
    from tilelang import language as T

    m, TB = hc_mult, PLAN.forward_tokens
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


FORWARD = Kernel("mhc_head_compute_mix_forward", MixKey, build_mhc_head_compute_mix_forward,
                 derive=lambda input_mix: MixKey(MHC_HC_MULT.require("mhc_head_compute_mix_forward",
                                                                     int(input_mix.shape[1]))),
                 cases=lambda hidden_size, hc_mult: MixKey(hc_mult))


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
    FORWARD.compiled(FORWARD.key(input_mix))(input_mix, mhc_scale, mhc_base, output_mix, float(pre_eps))


def _backward_key(input_mix: torch.Tensor, grad_mhc_base_partial: torch.Tensor) -> PartialsKey:
    """``m`` and ``P = grad_mhc_base_partial.shape[0]``, in their ranges."""
    op = "mhc_head_compute_mix_backward"
    return PartialsKey(MHC_HC_MULT.require(op, int(input_mix.shape[1])),
                       PARTIALS.require(op, int(grad_mhc_base_partial.shape[0])))


def build_mhc_head_compute_mix_backward(hc_mult: int, num_partials: int):
    """Builds the head-mix backward prim_func (docs/ops/mhc.md#head_compute_mix).

    ``P`` persistent CTAs; CTA ``p`` owns tokens ``[p*ceil(T/P), min((p+1)*ceil(T/P), T))``, walked
    ``PLAN.backward_tokens`` (64) at a time (thread = (token, 4-float chunk)). ``dz = g * s * (1 - s)`` with
    ``s`` recomputed, ``grad_input_mix = dz * scale``; ``dz`` and ``dz * x`` are accumulated per mix index in
    registers (ascending token), the 64 lanes summed in ascending order through shared memory, and row ``p`` of
    both partials written (zeros for an idle worker; scale partial = sum over the m indices in order).

    Args:
        hc_mult: ``m``.
        num_partials: ``P`` (:data:`PARTIALS`).

    Returns:
        ``T.prim_func(grad_output_mix (T, m), input_mix (T, m), mhc_scale (1,), mhc_base (m,),
        grad_input_mix (T, m), grad_mhc_scale_partial (P, 1), grad_mhc_base_partial (P, m))``, all f32;
        ``T`` is dynamic.
    """
    MHC_HC_MULT.require("mhc_head_compute_mix_backward", hc_mult)
    PARTIALS.require("mhc_head_compute_mix_backward", num_partials)
    from tilelang import language as T

    m, P, TB = hc_mult, num_partials, PLAN.backward_tokens
    v = vec_width(m)
    ch = m // v
    threads = TB * ch  # 64 at m = 4
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_head_compute_mix_bwd_cuda(
        grad_output_mix: T.Tensor((num_tokens, m), f32),
        input_mix: T.Tensor((num_tokens, m), f32),
        mhc_scale: T.Tensor((1,), f32),
        mhc_base: T.Tensor((m,), f32),
        grad_input_mix: T.Tensor((num_tokens, m), f32),
        grad_mhc_scale_partial: T.Tensor((P, 1), f32),
        grad_mhc_base_partial: T.Tensor((P, m), f32),
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
                        gr[k] = grad_output_mix[t, c * v + k]
                    for k in T.unroll(v):
                        s[k] = T.sigmoid(T.ieee_mul(x[k], sc[0]) + b[k])
                        gr[k] = gr[k] * s[k] * (1.0 - s[k])  # dz
                        ab[k] = ab[k] + gr[k]
                        ax[k] = ax[k] + gr[k] * x[k]
                        s[k] = gr[k] * sc[0]
                    for k in T.vectorized(v):
                        grad_input_mix[t, c * v + k] = s[k]
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
                grad_mhc_base_partial[p, tid] = sc[0]
                red[1, TB, tid] = sc[1]
            T.sync_threads()
            if tid == 0:
                sc[1] = red[1, TB, 0]
                for j in T.unroll(1, m):
                    sc[1] = sc[1] + red[1, TB, j]
                grad_mhc_scale_partial[p, 0] = sc[1]

    return mhc_head_compute_mix_bwd_cuda


# lowering cases at one worker per H200 SM (the op takes the caller's partial rows)
BACKWARD = Kernel("mhc_head_compute_mix_backward", PartialsKey, build_mhc_head_compute_mix_backward,
                  derive=_backward_key, cases=lambda hidden_size, hc_mult: PartialsKey(hc_mult, H200.sms))


def mhc_head_compute_mix_backward(
    grad_output_mix: torch.Tensor,
    input_mix: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    grad_input_mix: torch.Tensor,
    grad_mhc_scale_partial: torch.Tensor,
    grad_mhc_base_partial: torch.Tensor,
) -> None:
    """Launches the head-mix backward on the current stream.

    Args:
        grad_output_mix: ``(T, m)`` f32, ``T > 0``.
        input_mix: ``(T, m)`` f32.
        mhc_scale: ``(1,)`` f32.
        mhc_base: ``(m,)`` f32.
        grad_input_mix: ``(T, m)`` f32, written.
        grad_mhc_scale_partial: ``(P, 1)`` f32, every row written (the caller sums over ``P``).
        grad_mhc_base_partial: ``(P, m)`` f32, every row written.
    """
    BACKWARD.compiled(BACKWARD.key(input_mix, grad_mhc_base_partial))(
        grad_output_mix, input_mix, mhc_scale, mhc_base, grad_input_mix, grad_mhc_scale_partial, grad_mhc_base_partial
    )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
