"""CUDA kernel of ``mhc_multilayer_recompute`` (docs/ops/mhc.md#multilayer_recompute): a chunk's sublayer inputs
and residuals regenerated in one pass, bit-identical to the chain of the ``pre_apply_mix`` and ``post`` forwards
(the same fp32 expressions, written as those kernels write them so that nvcc contracts them into the same fused
multiply-adds; the running residual carried as the bf16 values the chain stores).

Lists of tensors: the kernel is specialized on ``(H, m, L, Lp)`` and takes every list element as its own buffer
parameter (generated for the given ``L`` / ``Lp`` by a comprehension over the IR builder's ``arg``); the launcher
passes the lists unpacked. No pointer table, so nothing is allocated per call and CUDA graphs capture the
pointers; at most ``limits.MHC_RECOMPUTE_LAYERS`` layers (``6 L + 1`` pointers within the 4 KiB of parameters).

Schedule: a 1-D grid over ``(token, column chunk)``, each thread owning one 8-column vector of its token for the
whole pass, the ``m`` residual streams kept in registers as bf16; per layer the sublayer input and ``m`` residual
vectors stored (layers unrolled), and the thread's ``layer_output`` vector read from its own shared-memory slot,
copied there by ``cp.async`` up to :attr:`RecomputePlan.y_stages` layers ahead. Each layer's ``m + m + m*m``
scalars of the CTA's token are staged once in shared memory before one barrier. 16-byte vectors for the
``(T, ., H)`` tensors, scalar loads for the mixes (docs/perf/h200/mhc.md, 2026-12-02).
"""

import dataclasses

import torch

from ....limits import MHC_HC_MULT, MHC_HIDDEN, MHC_RECOMPUTE_LAYERS, LimitError
from ..._kernel import Kernel, compile_key, kernel_module
from ._common import VEC, RowLayout, min_blocks, row_layout


OP = "mhc_multilayer_recompute"

# the op's list arguments, in kernel parameter order (after ``initial_residual``), and which count each has:
# "L" (one tensor per layer) or "Lp" (one per layer followed by the post stage)
LISTS = (
    ("pre_mix_list", "L"),
    ("layer_output_list", "Lp"),
    ("post_mix_list", "Lp"),
    ("comb_mix_list", "Lp"),
    ("layer_input_list", "L"),
    ("residual_list", "Lp"),
)

# kernel parameter -> op argument: element l of a list argument ``name`` is the parameter ``name_l``
ARGUMENTS = {f"{name}_{index}": name for name, _ in LISTS for index in range(MHC_RECOMPUTE_LAYERS.high)}


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """Row layout of the ``(token, chunk)`` CTA: ``threads`` threads, one vector each per chunk, where ``H / 8``
    has such a layout (:func:`row_layout`), else up to ``fallback_threads``; ``regs``: the register budget per
    thread behind the annotated CTAs per SM; ``y_stages``: sublayer outputs in flight ahead of their layer, each
    thread copying its own vectors by ``cp.async`` into private shared-memory slots (0: loaded into registers
    where used)."""

    threads: int
    fallback_threads: int
    regs: int
    y_stages: int = 0


# One vector per thread in CTAs of 128 threads, as the apply-mix forward, at 96 registers (5 CTAs per SM; the
# layer's working set, 16 bf16-pair + 32 fp32 residual registers, spills below 80). Up to 10 layers of y in flight
# from the start (20 KiB of shared memory per CTA at Lp >= 10): the loads no longer wait behind each layer's stores.
# Measurements and the variants not adopted: docs/perf/h200/mhc.md (2026-12-02), docs/perf/h100/mhc.md (2026-12-07).
PLAN = RecomputePlan(threads=128, fallback_threads=256, regs=96, y_stages=10)


def recompute_layout(hidden_size: int, plan: RecomputePlan = PLAN) -> RowLayout:
    """The row layout of the kernel's CTAs (see :class:`RecomputePlan`): ``nv`` column chunks per token, each of
    ``threads`` vectors."""
    layout = row_layout(hidden_size, plan.threads)
    return layout if layout.threads >= plan.threads else row_layout(hidden_size, plan.fallback_threads)


def _check(hidden_size: int, hc_mult: int, layers: int, post_layers: int) -> None:
    MHC_HIDDEN.require(OP, hidden_size)
    MHC_HC_MULT.require(OP, hc_mult)
    MHC_RECOMPUTE_LAYERS.require(OP, layers)
    if 2 * hc_mult + hc_mult * hc_mult > 32:
        raise LimitError(f"{OP}: the per-layer scalars (2 m + m * m) are loaded by one warp's lanes, m = {hc_mult}")
    if post_layers not in (layers - 1, layers):
        raise LimitError(f"{OP}: post layers Lp must be L - 1 or L = {layers}, got {post_layers}")


def kernel_arguments(layers: int, post_layers: int) -> list[str]:
    """The kernel's parameter names in order (the dynamic token count aside)."""
    counts = {"L": layers, "Lp": post_layers}
    return ["initial_residual"] + [f"{name}_{index}" for name, count in LISTS for index in range(counts[count])]


@compile_key
class RecomputeKey:
    """Compile-time key: ``H``, ``m``, ``L = layers`` and ``Lp = post_layers`` (never the token count)."""

    hidden_size: int
    hc_mult: int
    layers: int
    post_layers: int


def _key(initial_residual: torch.Tensor, pre_mix_list: list, layer_output_list: list) -> RecomputeKey:
    _, hc_mult, hidden_size = (int(s) for s in initial_residual.shape)
    key = RecomputeKey(hidden_size, hc_mult, len(pre_mix_list), len(layer_output_list))
    _check(key.hidden_size, key.hc_mult, key.layers, key.post_layers)
    return key


def build_mhc_multilayer_recompute(
    hidden_size: int, hc_mult: int, layers: int, post_layers: int, plan: RecomputePlan = PLAN
):
    """Builds the multilayer recompute for ``L = layers`` sublayers, the first ``Lp = post_layers`` of which
    (``L - 1`` or ``L``) are followed by the post stage.

    Per layer ``l`` and column ``d`` (``R`` the running residual, ``f32`` of its bf16 values)::

        layer_input[l][t, d] = bf16(sum_i pre[l][t, i] * R[i, d])           (i ascending, from the product i = 0)
        R'[o, d] = bf16(post[l][t, o] * f32(y[l][t, d]) + sum_i comb[l][t, i, o] * R[i, d])   (post term first)

    written as the two forwards write them (nvcc fuses each ``+=`` and the first product into an FMA; the
    second product is rounded, in both this kernel and the chain), then ``R = f32(R')``. Checked bitwise equal
    to the chain on an H200 at H in {320, 1280, 4096, 7168}, (L, Lp) in {(1, 0), (1, 1), (3, 2), (10, 9),
    (10, 10)}, T in {1, 509, 4096}.

    Args:
        hidden_size: ``H`` (``limits.MHC_HIDDEN``).
        hc_mult: ``m`` (``limits.MHC_HC_MULT``).
        layers: ``L`` (``limits.MHC_RECOMPUTE_LAYERS``).
        post_layers: ``Lp`` in ``{L - 1, L}``.
        plan: the CTA layout and register budget (:class:`RecomputePlan`).

    Returns:
        ``T.prim_func(initial_residual (T, m, H) bf16, pre_mix_list_l (T, m) f32 for l < L,
        layer_output_list_l (T, H) bf16, post_mix_list_l (T, m) f32, comb_mix_list_l (T, m, m) f32 for
        l < Lp, layer_input_list_l (T, H) bf16 for l < L, residual_list_l (T, m, H) bf16 for l < Lp)``
        (:func:`kernel_arguments`); ``T`` is dynamic.
    """
    from tilelang import language as T
    from tvm.script.ir_builder import tirx as ir_builder

    _check(hidden_size, hc_mult, layers, post_layers)
    H, m, L, Lp = hidden_size, hc_mult, layers, post_layers
    threads, chunks, guarded = dataclasses.astuple(recompute_layout(H, plan))
    nvec = H // VEC
    nwarps = threads // 32
    row = 2 * hc_mult + hc_mult * hc_mult  # scalars per layer and token
    depth = min(plan.y_stages, Lp)
    f32, bf16 = T.float32, T.bfloat16
    num_tokens = T.dynamic("num_tokens")
    # Python lists: the builder unrolls a loop over a list (a loop over range() would be a TIR loop)
    all_layers = list(range(L))
    post = list(range(Lp))
    shapes = {
        "pre_mix_list": ((num_tokens, m), f32),
        "layer_output_list": ((num_tokens, H), bf16),
        "post_mix_list": ((num_tokens, m), f32),
        "comb_mix_list": ((num_tokens, m, m), f32),
        "layer_input_list": ((num_tokens, H), bf16),
        "residual_list": ((num_tokens, m, H), bf16),
    }

    def list_params(name: str, count: list) -> list:
        shape, dtype = shapes[name]
        return [ir_builder.arg(f"{name}_{index}", T.Tensor(shape, dtype)) for index in count]

    @T.prim_func
    def mhc_multilayer_recompute_cuda(initial_residual: T.Tensor((num_tokens, m, H), bf16)):
        pre_mix_list = list_params("pre_mix_list", all_layers)
        layer_output_list = list_params("layer_output_list", post)
        post_mix_list = list_params("post_mix_list", post)
        comb_mix_list = list_params("comb_mix_list", post)
        layer_input_list = list_params("layer_input_list", all_layers)
        residual_list = list_params("residual_list", post)
        # One grid dimension (up to 2**31 - 1 CTAs; y is limited to 65535), the chunks of a token adjacent.
        with T.Kernel(num_tokens * chunks, threads=threads) as bid:
            t = bid // chunks
            cb = bid % chunks
            T.annotate_min_blocks_per_sm(min_blocks(threads, plan.regs))
            tid = T.get_thread_binding()
            lane = tid % 32
            wid = tid // 32
            col = (cb * threads + tid) * VEC
            # the token's scalars of every layer, row l = [pre (m), post (m), comb (m * m, row-major [i, o])]
            mixes = T.alloc_shared((L, row), f32)
            rr = T.alloc_local((m, VEC), bf16)  # the running residual: the bf16 values the chain stores
            rf = T.alloc_local((m, VEC), f32)
            mx = T.alloc_local((m,), f32)
            pr = T.alloc_local((m,), f32)
            cr = T.alloc_local((m, m), f32)
            yr = T.alloc_local((VEC,), bf16)
            yf = T.alloc_local((VEC,), f32)
            acc = T.alloc_local((VEC,), f32)
            if depth:
                ys = T.alloc_shared((depth, threads * VEC), bf16)  # this thread's columns of y in flight
            # layer l's scalars by the first m + m + m * m lanes of warp l % nwarps, all issued at once
            for l in all_layers:
                if wid == l % nwarps:
                    if lane < m:
                        mixes[l, lane] = pre_mix_list[l][t, lane]
                    if l < Lp:
                        if lane >= m and lane < 2 * m:
                            mixes[l, lane] = post_mix_list[l][t, lane - m]
                        if lane >= 2 * m and lane < row:
                            mixes[l, lane] = comb_mix_list[l][t, (lane - 2 * m) // m, (lane - 2 * m) % m]
            if (not guarded) or (cb * threads + tid < nvec):
                # one commit group per layer of y, empty past Lp, so that layer l always waits for depth - 1
                for l in list(range(depth)):
                    T.ptx_cp_async(T.access_ptr(ys[l, tid * VEC], "w", VEC),
                                   T.access_ptr(layer_output_list[l][t, col], "r", VEC), VEC)
                    T.ptx_commit_group()
                for i in T.unroll(m):
                    for k in T.vectorized(VEC):
                        rr[i, k] = initial_residual[t, i, col + k]
            T.sync_threads()
            if (not guarded) or (cb * threads + tid < nvec):
                for l in all_layers:
                    for i in T.vectorized(m):
                        mx[i] = mixes[l, i]
                    for i in T.unroll(m):
                        for k in T.unroll(VEC):
                            rf[i, k] = T.cast(rr[i, k], f32)
                    # the sublayer input, as the apply-mix forward: from the product i = 0, then i ascending
                    for k in T.unroll(VEC):
                        acc[k] = mx[0] * rf[0, k]
                        for i in T.unroll(1, m):
                            acc[k] += mx[i] * rf[i, k]
                    for k in T.vectorized(VEC):
                        layer_input_list[l][t, col + k] = T.cast(acc[k], bf16)
                    if l < Lp:
                        if depth:
                            T.ptx_wait_group(depth - 1)
                            for k in T.vectorized(VEC):
                                yr[k] = ys[l % depth, tid * VEC + k]
                            if l + depth < Lp:  # into the slot just read (the thread's own)
                                T.ptx_cp_async(T.access_ptr(ys[l % depth, tid * VEC], "w", VEC),
                                               T.access_ptr(layer_output_list[l + depth][t, col], "r", VEC), VEC)
                            T.ptx_commit_group()
                        else:
                            for k in T.vectorized(VEC):
                                yr[k] = layer_output_list[l][t, col + k]
                        for o in T.vectorized(m):
                            pr[o] = mixes[l, m + o]
                        for i in T.unroll(m):
                            for o in T.vectorized(m):
                                cr[i, o] = mixes[l, 2 * m + i * m + o]
                        # the next residual, as the post forward: the post term first, then i ascending
                        for k in T.unroll(VEC):
                            yf[k] = T.cast(yr[k], f32)
                        for o in T.unroll(m):
                            for k in T.unroll(VEC):
                                acc[k] = pr[o] * yf[k]
                                for i in T.unroll(m):
                                    acc[k] += cr[i, o] * rf[i, k]
                            # rf keeps the old residual for the remaining outputs
                            for k in T.vectorized(VEC):
                                rr[o, k] = T.cast(acc[k], bf16)
                            for k in T.vectorized(VEC):
                                residual_list[l][t, o, col + k] = rr[o, k]

    return mhc_multilayer_recompute_cuda


# lowering cases: every (L, Lp) of LOWERING_LAYERS, named mhc_multilayer_recompute_l<L>_p<Lp>
LOWERING_LAYERS = ((1, 1), (3, 2), (3, 3), (10, 9), (10, 10))
KERNEL = Kernel(OP, RecomputeKey, build_mhc_multilayer_recompute, derive=_key,
                cases=lambda hidden_size, hc_mult: {
                    f"{OP}_l{layers}_p{post}": RecomputeKey(hidden_size, hc_mult, layers, post)
                    for layers, post in LOWERING_LAYERS})


def mhc_multilayer_recompute(
    initial_residual: torch.Tensor,
    pre_mix_list: list,
    layer_output_list: list,
    post_mix_list: list,
    comb_mix_list: list,
    layer_input_list: list,
    residual_list: list,
) -> None:
    """Launches the multilayer recompute on the current stream (inputs validated upstream: contiguous, one
    device, the same ``T > 0``).

    Args:
        initial_residual: ``(T, m, H)`` bf16, the chunk's first residual.
        pre_mix_list: ``L`` tensors ``(T, m)`` f32, the layers' pre gates.
        layer_output_list: ``Lp`` (``L - 1`` or ``L``) tensors ``(T, H)`` bf16, the sublayer outputs.
        post_mix_list: ``Lp`` tensors ``(T, m)`` f32.
        comb_mix_list: ``Lp`` tensors ``(T, m, m)`` f32.
        layer_input_list: ``L`` tensors ``(T, H)`` bf16, written.
        residual_list: ``Lp`` tensors ``(T, m, H)`` bf16, written: the residual after each post stage.
    """
    kernel = KERNEL.compiled(KERNEL.key(initial_residual, pre_mix_list, layer_output_list))
    kernel(initial_residual, *pre_mix_list, *layer_output_list, *post_mix_list, *comb_mix_list,
           *layer_input_list, *residual_list)


# (L, Lp) of the lowering cases: one layer, both post counts at a short and at the target chain length
KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
