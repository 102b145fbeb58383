"""CUDA kernels of ``layer_norm_forward`` / ``layer_norm_backward`` (docs/ops/norm.md#layer_norm).

Rows: one CTA per row (forward) whose threads hold the whole row in registers, ``vectors`` 16-byte vectors each
(:func:`row_plan`: up to 1024 threads, so ``H = 32768`` fp32 is 8 vectors a thread), vector ``j`` of thread
``tid`` at vector index ``j * threads + tid`` (every warp access coalesced). x (and the residual) are read once;
the statistics are fp32 and two-pass over the registers (the mean, then the mean of the squared deviations:
robust for rows with a large mean); each CTA sum is a warp xor-butterfly (every lane gets the same bits) and the
warps' sums added in ascending warp order through shared memory.

Fused cast: a group of ``g`` channels is ``g / V`` consecutive lanes (``H`` a multiple of ``g`` keeps groups whole);
the group's amax by xor-butterfly over those lanes, its scale by the quant family's ``group_scale`` (the same IEEE
operations as ``per_token_cast``), on the values of ``y`` rounded to its dtype: bitwise ``per_token_cast`` of
``y``.

Backward: ``NORM_GRAD_WEIGHT_PARTITIONS["cuda"]`` worker CTAs; worker ``p`` owns the tokens ``[p * ceil(T / P),
min((p + 1) * ceil(T / P), T))`` one row at a time, writes ``grad_x`` and keeps its columns' ``sum xhat g`` and
``sum g`` in registers, then writes them as partial row ``p`` (zeros for an empty range). A second kernel adds the
partial rows of each column in ascending ``p`` and adds that sum to the fp32 buffer. No atomics: the bytes are
the same run to run.

``T`` is dynamic, as are the row strides of the row inputs (multiples of 16 bytes); absent optional tensors are
compile-time variants, their parameters 16-byte placeholders that are never read.
"""

import dataclasses

import torch

from ....limits import NORM_HIDDEN, IntRange, LimitError
from ....policy import NORM_GRAD_WEIGHT_PARTITIONS
from ....quant import ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from ..quant._common import e2m1_encode, group_scale, sf_index, sf_param, sf_view, stored_scale

VEC_BYTES = 16  # one vector access of a row
WARP = 32
_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_BYTES = {"bfloat16": 2, "float32": 4}
_GROUPS = IntRange("a per-token group size", 16, 128)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Threads of a row: enough for at most ``vectors`` 16-byte vectors a thread, at most ``max_threads``."""

    vectors: int
    max_threads: int
    reduce_threads: int  # columns (one a thread) per CTA of the partials' reduction

    def of(self, nvec: int) -> tuple[int, int]:
        """``(threads, vectors a thread)`` of a row of ``nvec`` vectors."""
        threads = min(self.max_threads, -(-(-(-nvec // self.vectors)) // WARP) * WARP)
        return threads, -(-nvec // threads)


# Forward: 4 vectors a thread (a row of 4096 bf16 on 128 threads, 7168 on 224) keeps several loads in flight per
# thread and the row in registers up to H = 32768. Backward: 2 vectors a thread, as it holds x, grad_y, xhat, w g
# and two column sums per element. Not yet measured on a GPU.
ROW_PLAN = RowPlan(vectors=4, max_threads=1024, reduce_threads=128)
BACKWARD_PLAN = RowPlan(vectors=2, max_threads=1024, reduce_threads=128)


@compile_key
class ForwardKey:
    """Compile-time key of the forward: the row, the dtype, which optional inputs and outputs exist and the fused
    cast's layout fields (``group`` 0: no cast); never the token count nor a row stride."""

    hidden: int
    in_dtype: str  # "bfloat16" | "float32"
    has_weight: bool
    has_bias: bool
    has_residual: bool
    write_y: bool
    group: int = 0
    fmt: str = ""
    sf: str = ""
    storage: str = ""
    round_sf: bool = False


@compile_key
class BackwardKey:
    """Compile-time key of the backward: the row, the dtype, the optional inputs, the gradient buffers written and
    the partition count."""

    hidden: int
    in_dtype: str
    has_weight: bool
    has_grad_residual: bool
    sums_weight: bool
    sums_bias: bool
    partitions: int


@compile_key
class ReduceKey:
    """Compile-time key of the partials' reduction: the row and the partition count."""

    hidden: int
    partitions: int


def _dtype(op: str, t: torch.Tensor) -> str:
    if t.dtype not in _DTYPES:
        raise LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {t.dtype}")
    return _DTYPES[t.dtype]


def forward_key(op: str, hidden: int, in_dtype: str, weight: bool, bias: bool, residual: bool, write_y: bool,
                layout: ScaleLayout | None) -> ForwardKey:
    """The :class:`ForwardKey` of a launch (``LimitError`` outside ``limits.NORM_HIDDEN`` or for a layout whose
    group is not a per-token group dividing ``H``)."""
    hidden = NORM_HIDDEN.require(op, int(hidden))
    if in_dtype not in _BYTES:
        raise LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    if layout is None:
        return ForwardKey(hidden, in_dtype, weight, bias, residual, True)
    if layout.kind != "per_token" or hidden % layout.block[1]:
        raise LimitError(f"{op}: the layout must be per-token with a group dividing H = {hidden}, got {layout.spec}")
    return ForwardKey(hidden, in_dtype, weight, bias, residual, write_y, _GROUPS.require(op, layout.block[1]),
                      layout.fmt, layout.sf, layout.storage, layout.round_sf)


def row_layout(op: str, hidden: int, in_dtype: str, plan: RowPlan) -> tuple[int, int, int, int, int, bool]:
    """``(H, V, nvec, threads, vectors a thread, guarded)`` of a row of ``in_dtype``: ``V`` elements per 16-byte
    vector, ``guarded`` where the last vectors of some threads fall past the row (``LimitError`` outside the
    ranges)."""
    H = NORM_HIDDEN.require(op, hidden)
    if in_dtype not in _BYTES:
        raise LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    V = VEC_BYTES // _BYTES[in_dtype]
    threads, nv = plan.of(H // V)
    return H, V, H // V, threads, nv, nv * threads != H // V


def _block_sum(T, warps: int):
    """A ``T.macro(acc, n, red, slot, tid)``: the CTA sums of ``acc[0..n)`` into every thread's ``acc``: a warp
    xor-butterfly, then the warps' sums (rows ``slot..slot + n`` of ``red (slots, warps)``, shared) added in
    ascending warp order."""

    @T.macro
    def block_sum(acc, n, red, slot, tid):
        for i in T.unroll(n):
            for b in T.unroll(5):
                acc[i] = acc[i] + T.shfl_xor(acc[i], 16 >> b)
        if warps > 1:
            if tid % WARP == 0:
                for i in T.unroll(n):
                    red[slot + i, tid // WARP] = acc[i]
            T.sync_threads()
            for i in T.unroll(n):
                acc[i] = red[slot + i, 0]
                for w in T.unroll(1, warps):
                    acc[i] = acc[i] + red[slot + i, w]

    return block_sum


def build_layer_norm_forward(hidden: int, in_dtype: str, has_weight: bool, has_bias: bool, has_residual: bool,
                             write_y: bool,
                             group: int = 0, fmt: str = "", sf: str = "", storage: str = "", round_sf: bool = False):
    """Builds the forward of one variant (the key's fields; see the module docstring).

    Returns:
        ``T.prim_func(x, weight, bias, residual, y, mean, rstd, residual_out, data, sf, eps)``: ``x``, ``residual``
        ``(T, H)`` with dynamic row strides; ``y``, ``residual_out`` ``(T, H)``; ``mean``, ``rstd`` ``(T,)`` fp32;
        ``data`` / ``sf`` in the layout (as :func:`~..quant._common.sf_param`); an absent tensor is a 16-byte
        placeholder; ``eps`` fp32.
    """
    from tilelang import language as T

    H, V, nvec, threads, nv, guarded = row_layout("layer_norm_forward", hidden, in_dtype, ROW_PLAN)
    cast = group > 0
    if cast and H % group:
        raise LimitError(f"layer_norm_forward: H = {H} is not a multiple of the group {group}")
    warps = threads // WARP
    f32, dt = T.float32, in_dtype
    inv_h = 1.0 / H
    block_sum = _block_sum(T, warps)

    num_tokens = T.dynamic("num_tokens")
    x_stride, r_stride = T.dynamic("x_stride"), T.dynamic("residual_stride")
    def holder():  # an absent tensor's placeholder: a new buffer per parameter (one object would alias them)
        return T.Tensor((V,), dt)

    e2m1 = fmt == "e2m1"
    if cast:
        lanes = group // V
        nk = H // group
        scale_of = group_scale(T, fmt, sf, round_sf)
        pad = (4 - nk % 4) % 4 if sf == "ue8m0" else 0  # zero bytes after a token's last UE8M0 scale
        data_param = T.Tensor((num_tokens, H // 2 if e2m1 else H), T.uint8 if e2m1 else T.float8_e4m3fn)
        sf_arg = sf_param(T, storage, sf, nk, num_tokens, "sf_stride")
    else:
        lanes, nk, pad = 1, 0, 0
        data_param, sf_arg = T.Tensor((VEC_BYTES,), T.uint8), T.Tensor((VEC_BYTES,), T.uint8)

    def rows_param():
        return T.Tensor((num_tokens, H), dt)

    @T.prim_func
    def layer_norm_forward_cuda(
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), dt),
        weight: T.Tensor((H,), dt) if has_weight else holder(),
        bias: T.Tensor((H,), dt) if has_bias else holder(),
        residual: T.StridedTensor((num_tokens, H), (r_stride, 1), dt) if has_residual else holder(),
        y: rows_param() if write_y else holder(),
        mean: T.Tensor((num_tokens,), f32),
        rstd: T.Tensor((num_tokens,), f32),
        residual_out: rows_param() if has_residual else holder(),
        data: data_param,
        sf_out: sf_arg,
        eps: f32,
    ):
        T.assume(x_stride % V == 0)  # rows start on 16 bytes (the op checks it): vector loads
        if has_residual:
            T.assume(r_stride % V == 0)
        with T.Kernel(num_tokens, threads=threads) as row:
            tid = T.get_thread_binding()
            xr = T.alloc_local((nv, V), dt)
            rr = T.alloc_local((nv, V), dt)
            v = T.alloc_local((nv, V), f32)  # f32(r)
            pw = T.alloc_local((V,), dt)
            pb = T.alloc_local((V,), dt)
            yo = T.alloc_local((V,), dt)
            yv = T.alloc_local((nv, V), f32)  # f32 of the rounded y (the cast's input)
            q = T.alloc_local((V,), f32)
            acc = T.alloc_local((1,), f32)
            st = T.alloc_local((2,), f32)  # mean, rstd
            amax = T.alloc_local((nv,), f32)
            scale = T.alloc_local((4,), f32)
            red = T.alloc_shared((2, warps), f32)
            for j in T.unroll(nv):
                if (not guarded) or j * threads + tid < nvec:
                    for k in T.vectorized(V):
                        xr[j, k] = x[row, (j * threads + tid) * V + k]
                    if has_residual:
                        for k in T.vectorized(V):
                            rr[j, k] = residual[row, (j * threads + tid) * V + k]
                else:
                    for k in T.vectorized(V):
                        xr[j, k] = T.cast(0, dt)
                        rr[j, k] = T.cast(0, dt)
            for j in T.unroll(nv):
                for k in T.unroll(V):
                    if has_residual:  # r = x + residual rounded to the dtype
                        v[j, k] = T.cast(T.cast(T.cast(xr[j, k], f32) + T.cast(rr[j, k], f32), dt), f32)
                    else:
                        v[j, k] = T.cast(xr[j, k], f32)
            if has_residual:
                for j in T.unroll(nv):
                    if (not guarded) or j * threads + tid < nvec:
                        for k in T.vectorized(V):
                            residual_out[row, (j * threads + tid) * V + k] = T.cast(v[j, k], dt)
            # pass 1: the mean (padding lanes hold zeros)
            acc[0] = T.float32(0)
            for j in T.unroll(nv):
                for k in T.unroll(V):
                    acc[0] = acc[0] + v[j, k]
            block_sum(acc, 1, red, 0, tid)
            st[0] = acc[0] * T.float32(inv_h)
            # pass 2: the variance, the mean of the squared deviations (padding lanes left out)
            acc[0] = T.float32(0)
            for j in T.unroll(nv):
                if (not guarded) or j * threads + tid < nvec:
                    for k in T.unroll(V):
                        acc[0] = acc[0] + (v[j, k] - st[0]) * (v[j, k] - st[0])
            block_sum(acc, 1, red, 1, tid)
            st[1] = T.rsqrt(acc[0] * T.float32(inv_h) + eps)
            if tid == 0:
                mean[row] = st[0]
                rstd[row] = st[1]
            for j in T.unroll(nv):
                if (not guarded) or j * threads + tid < nvec:
                    if has_weight:
                        for k in T.vectorized(V):
                            pw[k] = weight[(j * threads + tid) * V + k]
                    if has_bias:
                        for k in T.vectorized(V):
                            pb[k] = bias[(j * threads + tid) * V + k]
                    for k in T.unroll(V):
                        q[k] = (v[j, k] - st[0]) * st[1]
                        if has_weight:
                            q[k] = q[k] * T.cast(pw[k], f32)
                        if has_bias:
                            q[k] = q[k] + T.cast(pb[k], f32)
                        yo[k] = T.cast(q[k], dt)
                        yv[j, k] = T.cast(yo[k], f32)
                    if write_y:
                        for k in T.vectorized(V):
                            y[row, (j * threads + tid) * V + k] = yo[k]
                else:
                    for k in T.unroll(V):
                        yv[j, k] = T.float32(0)
            if cast:
                # every lane takes part in the butterflies (a group's lanes are all valid or all padding)
                for j in T.unroll(nv):
                    amax[j] = T.float32(0)
                    for k in T.unroll(V):
                        amax[j] = T.max(amax[j], T.abs(yv[j, k]))
                    for b in T.unroll(lanes.bit_length() - 1):
                        amax[j] = T.max(amax[j], T.shfl_xor(amax[j], 1 << b))
                for j in T.unroll(nv):
                    if (not guarded) or j * threads + tid < nvec:
                        scale_of(scale, amax[j])
                        for k in T.unroll(V):
                            q[k] = T.ieee_mul(yv[j, k], scale[3])
                        if e2m1:
                            for k in T.vectorized(V // 2):
                                data[row, (j * threads + tid) * (V // 2) + k] = (
                                    e2m1_encode(T, q[2 * k]) | (e2m1_encode(T, q[2 * k + 1]) << T.uint8(4)))
                        else:
                            for k in T.vectorized(V):
                                data[row, (j * threads + tid) * V + k] = T.cast(q[k], T.float8_e4m3fn)
                        if (j * threads + tid) % lanes == 0:
                            sf_out[sf_index(storage, sf, row, (j * threads + tid) // lanes)] = stored_scale(
                                T, scale[2], sf)
                            if pad:  # the zero bytes of the token's last UE8M0 word
                                if (j * threads + tid) // lanes == nk - 1:
                                    for b in T.unroll(pad):
                                        sf_out[sf_index(storage, sf, row, nk + b)] = T.uint8(0)

    return layer_norm_forward_cuda


def build_layer_norm_backward(hidden: int, in_dtype: str, has_weight: bool, has_grad_residual: bool,
                              sums_weight: bool, sums_bias: bool, partitions: int):
    """Builds the backward's worker kernel of one variant (see the module docstring).

    Returns:
        ``T.prim_func(grad_y, x, weight, mean, rstd, grad_residual_out, grad_x, partial_weight, partial_bias)``:
        ``grad_y``, ``x``, ``grad_residual_out`` ``(T, H)`` with dynamic row strides; ``mean``, ``rstd`` ``(T,)``
        fp32; ``grad_x`` ``(T, H)``; the partials ``(P, H)`` fp32, every row written; an absent tensor a 16-byte
        placeholder.
    """
    from tilelang import language as T

    H, V, nvec, threads, nv, guarded = row_layout("layer_norm_backward", hidden, in_dtype, BACKWARD_PLAN)
    P = IntRange("partitions", 1).require("layer_norm_backward", partitions)
    warps = threads // WARP
    f32, dt = T.float32, in_dtype
    inv_h = 1.0 / H
    block_sum = _block_sum(T, warps)
    sums = sums_weight or sums_bias

    num_tokens = T.dynamic("num_tokens")
    g_stride, x_stride, gr_stride = T.dynamic("grad_y_stride"), T.dynamic("x_stride"), T.dynamic("grad_res_stride")
    def holder():  # a new buffer per parameter (one object would alias them)
        return T.Tensor((V,), dt)

    def partial(used: bool):
        return T.Tensor((P, H), f32) if used else T.Tensor((VEC_BYTES // 4,), f32)

    @T.macro
    def load_row(x_in, grad_in, res_in, mean_in, rstd_in, xn, gn, rn, sn, t, end, tid):
        """Row ``t`` into the registers when ``t < end`` (the padding lanes keep their zeros)."""
        if t < end:
            for j in T.unroll(nv):
                if (not guarded) or j * threads + tid < nvec:
                    for k in T.vectorized(V):
                        xn[j, k] = x_in[t, (j * threads + tid) * V + k]
                    for k in T.vectorized(V):
                        gn[j, k] = grad_in[t, (j * threads + tid) * V + k]
                    if has_grad_residual:
                        for k in T.vectorized(V):
                            rn[j, k] = res_in[t, (j * threads + tid) * V + k]
            sn[0] = mean_in[t]
            sn[1] = rstd_in[t]

    @T.prim_func
    def layer_norm_backward_cuda(
        grad_y: T.StridedTensor((num_tokens, H), (g_stride, 1), dt),
        x: T.StridedTensor((num_tokens, H), (x_stride, 1), dt),
        weight: T.Tensor((H,), dt) if has_weight else holder(),
        mean: T.Tensor((num_tokens,), f32),
        rstd: T.Tensor((num_tokens,), f32),
        grad_residual_out: T.StridedTensor((num_tokens, H), (gr_stride, 1), dt) if has_grad_residual else holder(),
        grad_x: T.Tensor((num_tokens, H), dt),
        partial_weight: partial(sums_weight),
        partial_bias: partial(sums_bias),
    ):
        T.assume(g_stride % V == 0)
        T.assume(x_stride % V == 0)
        if has_grad_residual:
            T.assume(gr_stride % V == 0)
        with T.Kernel(P, threads=threads) as p:
            tid = T.get_thread_binding()
            xr = T.alloc_local((nv, V), dt)
            gr = T.alloc_local((nv, V), dt)
            rr = T.alloc_local((nv, V), dt)
            pw = T.alloc_local((nv, V), dt)
            xh = T.alloc_local((nv, V), f32)  # xhat
            wg = T.alloc_local((nv, V), f32)  # w * g
            dw = T.alloc_local((nv, V), f32)  # this worker's sum of xhat * g per column
            db = T.alloc_local((nv, V), f32)  # ... of g
            go = T.alloc_local((V,), dt)
            xn = T.alloc_local((nv, V), dt)  # the next row's x, grad_y, grad_residual_out, mean and rstd
            gn = T.alloc_local((nv, V), dt)
            rn = T.alloc_local((nv, V), dt)
            sn = T.alloc_local((2,), f32)
            acc = T.alloc_local((2,), f32)
            st = T.alloc_local((2,), f32)
            red = T.alloc_shared((2, warps), f32)
            per = T.ceildiv(num_tokens, P)
            for j in T.unroll(nv):
                for k in T.unroll(V):
                    dw[j, k] = T.float32(0)
                    db[j, k] = T.float32(0)
                    pw[j, k] = T.cast(1, dt)
                    xn[j, k] = T.cast(0, dt)
                    gn[j, k] = T.cast(0, dt)
                    rn[j, k] = T.cast(0, dt)
            if has_weight:
                for j in T.unroll(nv):
                    if (not guarded) or j * threads + tid < nvec:
                        for k in T.vectorized(V):
                            pw[j, k] = weight[(j * threads + tid) * V + k]
            # the next row's loads are issued before this row's sums (their latency hides behind the CTA syncs)
            rows = (x, grad_y, grad_residual_out, mean, rstd)
            load_row(*rows, xn, gn, rn, sn, T.min(p * per, num_tokens), T.min(p * per + per, num_tokens), tid)
            for t in T.serial(T.min(p * per, num_tokens), T.min(p * per + per, num_tokens)):
                for j in T.unroll(nv):
                    for k in T.unroll(V):
                        xr[j, k] = xn[j, k]
                        gr[j, k] = gn[j, k]
                        rr[j, k] = rn[j, k]
                st[0] = sn[0]
                st[1] = sn[1]
                load_row(*rows, xn, gn, rn, sn, t + 1, T.min(p * per + per, num_tokens), tid)
                acc[0] = T.float32(0)
                acc[1] = T.float32(0)
                for j in T.unroll(nv):
                    for k in T.unroll(V):
                        xh[j, k] = (T.cast(xr[j, k], f32) - st[0]) * st[1]
                        wg[j, k] = T.cast(gr[j, k], f32) * T.cast(pw[j, k], f32)  # padding lanes: g = 0
                        acc[0] = acc[0] + wg[j, k]
                        acc[1] = acc[1] + xh[j, k] * wg[j, k]
                block_sum(acc, 2, red, 0, tid)
                acc[0] = acc[0] * T.float32(inv_h)
                acc[1] = acc[1] * T.float32(inv_h)
                for j in T.unroll(nv):
                    if (not guarded) or j * threads + tid < nvec:
                        for k in T.unroll(V):
                            if has_grad_residual:
                                go[k] = T.cast(st[1] * (wg[j, k] - acc[0] - xh[j, k] * acc[1])
                                               + T.cast(rr[j, k], f32), dt)
                            else:
                                go[k] = T.cast(st[1] * (wg[j, k] - acc[0] - xh[j, k] * acc[1]), dt)
                        for k in T.vectorized(V):
                            grad_x[t, (j * threads + tid) * V + k] = go[k]
                        if sums:
                            for k in T.unroll(V):
                                if sums_weight:
                                    dw[j, k] = dw[j, k] + xh[j, k] * T.cast(gr[j, k], f32)
                                if sums_bias:
                                    db[j, k] = db[j, k] + T.cast(gr[j, k], f32)
                if warps > 1:
                    T.sync_threads()  # every warp has read red before the next row's sums are written
            for j in T.unroll(nv):
                if (not guarded) or j * threads + tid < nvec:
                    if sums_weight:
                        for k in T.vectorized(V):
                            partial_weight[p, (j * threads + tid) * V + k] = dw[j, k]
                    if sums_bias:
                        for k in T.vectorized(V):
                            partial_bias[p, (j * threads + tid) * V + k] = db[j, k]

    return layer_norm_backward_cuda


def build_layer_norm_backward_reduce(hidden: int, partitions: int):
    """Builds the partials' reduction: ``grad[h] += (((partial[0, h] + partial[1, h]) + ...) + partial[P - 1, h])``.

    Returns:
        ``T.prim_func(partial (P, H) f32, grad (H,) f32)``.
    """
    from tilelang import language as T

    H = NORM_HIDDEN.require("layer_norm_backward", hidden)
    P = IntRange("partitions", 1).require("layer_norm_backward", partitions)
    threads = BACKWARD_PLAN.reduce_threads
    f32 = T.float32

    @T.prim_func
    def layer_norm_backward_reduce_cuda(partial: T.Tensor((P, H), f32), grad: T.Tensor((H,), f32)):
        with T.Kernel(T.ceildiv(H, threads), threads=threads) as b:
            tid = T.get_thread_binding()
            acc = T.alloc_local((1,), f32)
            if b * threads + tid < H:
                acc[0] = partial[0, b * threads + tid]
                for i in T.serial(1, P):
                    acc[0] = acc[0] + partial[i, b * threads + tid]
                grad[b * threads + tid] = grad[b * threads + tid] + acc[0]

    return layer_norm_backward_reduce_cuda


# lowering cases per H: the plain norm (bf16, weight and bias), the fused residual with the default cast of the
# example calls (UE8M0 col_tma words) and y, fp32 without weight or bias with an fp4 cast (e2m1, e4m3 scales)
_FORWARD_CASES = {
    "bf16": ("bfloat16", True, True, False, True, None),
    "bf16_residual_e4m3_ue8m0_col": ("bfloat16", True, True, True, True, "1x64/e4m3/ue8m0/col_tma/round"),
    "f32_plain_e2m1_e4m3_row": ("float32", False, False, False, False, "1x16/e2m1/e4m3/row/exact"),
}


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    del hc_mult
    return {f"layer_norm_forward_{name}": forward_key("layer_norm_forward", hidden_size, dt, w, b, r, y,
                                                      None if spec is None else ScaleLayout.parse(spec))
            for name, (dt, w, b, r, y, spec) in _FORWARD_CASES.items()}


def _backward_cases(hidden_size: int, hc_mult: int) -> dict:
    del hc_mult
    P = NORM_GRAD_WEIGHT_PARTITIONS["cuda"]
    return {"layer_norm_backward_bf16_all": BackwardKey(hidden_size, "bfloat16", True, True, True, True, P),
            "layer_norm_backward_f32_plain": BackwardKey(hidden_size, "float32", False, False, False, False, P)}


def _reduce_cases(hidden_size: int, hc_mult: int) -> ReduceKey:
    del hc_mult
    return ReduceKey(hidden_size, NORM_GRAD_WEIGHT_PARTITIONS["cuda"])


def _forward_derive(x, weight, bias, residual, layout, with_y):
    return forward_key("layer_norm_forward", x.shape[1], _dtype("layer_norm_forward", x), weight is not None,
                       bias is not None, residual is not None, layout is None or with_y,
                       None if layout is None else ScaleLayout.parse(layout))


def _backward_derive(x, weight, grad_residual_out, grad_weight, grad_bias):
    return BackwardKey(NORM_HIDDEN.require("layer_norm_backward", int(x.shape[1])),
                       _dtype("layer_norm_backward", x), weight is not None, grad_residual_out is not None,
                       grad_weight is not None, grad_bias is not None, NORM_GRAD_WEIGHT_PARTITIONS["cuda"])


FORWARD = Kernel("layer_norm_forward", ForwardKey, build_layer_norm_forward, cases=_forward_cases,
                 derive=_forward_derive)
BACKWARD = Kernel("layer_norm_backward", BackwardKey, build_layer_norm_backward, cases=_backward_cases,
                  derive=_backward_derive)
BACKWARD_REDUCE = Kernel("layer_norm_backward_reduce", ReduceKey, build_layer_norm_backward_reduce,
                         cases=_reduce_cases)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t (..., H)`` as its ``(T, H)`` rows, a view (the leading dims flatten into one row stride: the op
    checks it)."""
    return t.view(-1, t.shape[-1])


def _holder(like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A 16-byte placeholder for an absent tensor (never read nor written)."""
    dtype = like.dtype if dtype is None else dtype
    return torch.empty(VEC_BYTES // dtype.itemsize, dtype=dtype, device=like.device)


def layer_norm_forward(x, weight, bias, eps, residual, layout, with_y, y, mean, rstd, residual_out, data,
                       sf) -> None:
    """Launches the forward on the current stream (arguments validated and outputs allocated upstream): writes
    ``y`` (unless a layout without ``with_y``), ``mean``, ``rstd``, ``residual_out`` (with a residual) and the
    cast's ``data`` / ``sf`` (with a layout)."""
    xr = _rows(x)
    if xr.shape[0] == 0:
        return
    rr = None if residual is None else _rows(residual)
    key = FORWARD.key(xr, weight, bias, rr, layout, with_y)
    scales = sf_view(sf, key.storage, key.sf) if key.group else _holder(x, torch.uint8)
    FORWARD.compiled(key)(
        xr, _holder(x) if weight is None else weight, _holder(x) if bias is None else bias,
        _holder(x) if rr is None else rr, _rows(y) if key.write_y else _holder(x), mean.view(-1), rstd.view(-1),
        _holder(x) if rr is None else _rows(residual_out), data if key.group else _holder(x, torch.uint8), scales,
        float(eps))


def layer_norm_backward(grad_y, x, weight, mean, rstd, grad_weight, grad_bias, grad_residual_out, grad_x) -> None:
    """Launches the backward on the current stream: writes ``grad_x``; with ``grad_weight`` / ``grad_bias`` the
    workers' partial rows go to a temporary ``torch.empty`` buffer (every row written) and the reduction adds
    their sums to the buffers."""
    xr = _rows(x)
    if xr.shape[0] == 0:
        return
    gr = None if grad_residual_out is None else _rows(grad_residual_out)
    key = BACKWARD.key(xr, weight, gr, grad_weight, grad_bias)
    hidden, P = key.hidden, key.partitions
    part_w = xr.new_empty((P, hidden), dtype=torch.float32) if key.sums_weight else _holder(x, torch.float32)
    part_b = xr.new_empty((P, hidden), dtype=torch.float32) if key.sums_bias else _holder(x, torch.float32)
    BACKWARD.compiled(key)(_rows(grad_y), xr, _holder(x) if weight is None else weight, mean.view(-1),
                           rstd.view(-1), _holder(x) if gr is None else gr, _rows(grad_x), part_w, part_b)
    reduce = BACKWARD_REDUCE.compiled(ReduceKey(hidden, P))
    if key.sums_weight:
        reduce(part_w, grad_weight)
    if key.sums_bias:
        reduce(part_b, grad_bias)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD, BACKWARD_REDUCE)
