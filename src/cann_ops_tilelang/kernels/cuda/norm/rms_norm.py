"""CUDA kernels of ``rms_norm_forward`` / ``rms_norm_backward`` (docs/ops/norm.md#rms_norm).

Row layout (both kernels): a row of ``H`` channels is ``H / V`` 16-byte vectors (``V`` = 8 bf16 or 4 fp32); ``tpr``
threads own a row, thread ``l`` the vectors ``l + k tpr`` (``k < per``), so every warp access is coalesced and the
row stays in registers (at most 32 values a thread at ``H = 32768``); lanes past the row's last vector are
predicated off. ``tpr`` is a power of two up to 32 (several rows per warp: the row sum by an xor butterfly over the
row's lanes) or a multiple of 32 (the warp sums, then the row's warps through shared memory, added in warp order).

Forward: one pass; each thread loads its vectors of ``x`` (and ``residual``: ``r = dtype(x + residual)`` written
as ``residual_out``), sums ``f32(r)^2``, and after the row reduction writes ``y = dtype(fl(fl(r * rstd) * fl(w *
out_scale)))``. The fused cast takes the rounded ``y`` widened back to fp32: a group of ``g`` channels is ``g / V``
consecutive lanes (``tpr`` and ``H / V`` are multiples of it), amax by xor shuffles, scale, inverse and stored bytes
by the quant family's macros (kernels/cuda/quant/_common.py), as ``per_token_cast`` computes them.

Backward: ``P`` CTAs (``policy.NORM_GRAD_WEIGHT_PARTITIONS``), CTA ``p`` owning the tokens ``[p c, (p + 1) c)``,
``c = ceil(T / P)``, in row slots (slot ``s`` its tokens ``s, s + slots, ...`` in order); the weight gradient's
terms are accumulated per slot in shared memory (each thread its own columns), the slots added in order into
the partial row ``p``; a second kernel adds the ``P`` partial rows in ascending order into ``grad_weight``.
"""

import dataclasses

import torch

from ....limits import NORM_HIDDEN, IntRange, LimitError
from ....norm._common import present, rows, rows_of
from ....policy import NORM_GRAD_WEIGHT_PARTITIONS
from ....quant import ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module, variant_prim_func
from ..quant._common import e2m1_encode, group_scale, sf_index, sf_param, sf_view, stored_scale

VEC_BYTES = 16  # one vector access of a row
_IN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
_GROUPS = IntRange("a per-token group size", 16, 128)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """``vectors`` 16-byte vectors a thread owns (more where a row needs over ``max_threads`` threads, fewer where
    that leaves under a warp per row); CTAs of at least ``min_threads`` threads (several rows per CTA)."""

    vectors: int
    min_threads: int
    max_threads: int


# Two vectors a thread (16 bf16 values in flight per load of x, a row of H = 7168 on 14 warps); forward CTAs of 128
# threads at least (one row each from H = 1024: several CTAs an SM). The backward has one CTA per partition (an SM):
# row slots up to 1024 threads keep more loads in flight. Not yet measured on a GPU (docs/perf/h200/norm.md will
# hold the measurement).
FORWARD_PLAN = RowPlan(vectors=2, min_threads=128, max_threads=1024)
BACKWARD_PLAN = RowPlan(vectors=2, min_threads=1024, max_threads=1024)
# the partial rows' sum: 4 fp32 columns a thread, 128 threads a CTA
REDUCE_THREADS, REDUCE_VEC = 128, 4


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """``per`` vectors of ``tpr`` threads a row, ``slots`` rows a CTA, ``guarded``: lanes past the row exist."""

    nvec: int
    per: int
    tpr: int
    slots: int

    @property
    def threads(self) -> int:
        return self.tpr * self.slots

    @property
    def guarded(self) -> bool:
        return self.per * self.tpr != self.nvec

    @property
    def warps(self) -> int:
        """Warps of a row (1 where several rows share a warp)."""
        return max(1, self.tpr // 32)


def row_layout(hidden: int, in_dtype: str, plan: RowPlan) -> RowLayout:
    """The row layout of ``H`` channels of ``in_dtype`` under ``plan`` (module docstring)."""
    nvec = hidden // (VEC_BYTES // _ELEMENT_BYTES[in_dtype])
    per = max(plan.vectors, -(-nvec // plan.max_threads))
    while per > 1 and -(-nvec // per) < 32 and -(-nvec // (per // 2)) <= plan.max_threads:
        per //= 2
    need = -(-nvec // per)
    tpr = 1 << (need - 1).bit_length() if need <= 32 else -(-need // 32) * 32
    return RowLayout(nvec, per, tpr, max(1, plan.min_threads // tpr))


def row_sum_macro(T, lay: RowLayout):
    """A ``T.macro`` ``(acc, red, tid)``: ``acc[0]`` becomes its row's sum over the row's threads in every one of
    them, by an xor butterfly over the row's lanes (at most a warp), then the row's warps' sums through the shared
    ``red`` added in warp order."""
    tpr, wpr = lay.tpr, lay.warps

    @T.macro
    def row_sum(acc, red, tid):
        for b in T.unroll((min(tpr, 32)).bit_length() - 1):
            acc[0] += T.shfl_xor(acc[0], 1 << b)
        if wpr > 1:
            if tid % 32 == 0:
                red[tid // 32] = acc[0]
            T.sync_threads()
            acc[0] = red[(tid // tpr) * wpr]
            for j in T.unroll(1, wpr):
                acc[0] += red[(tid // tpr) * wpr + j]

    return row_sum


@compile_key
class ForwardKey:
    """Compile-time key of the forward: ``H``, the dtype, which optional tensors exist, whether ``y`` is written
    and the fused cast's layout fields (``group`` 0: no cast); never the token count nor a row stride."""

    hidden: int
    in_dtype: str  # "bfloat16" | "float32"
    weight: bool
    residual: bool
    writes_y: bool
    group: int = 0
    fmt: str = ""
    sf: str = ""
    storage: str = ""
    round_sf: bool = False


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``H``, the dtype, the optional tensors and the partition count."""

    hidden: int
    in_dtype: str
    weight: bool
    grad_weight: bool
    grad_residual_out: bool
    partitions: int


@compile_key
class ReduceKey:
    """Compile-time key of the partial rows' sum: ``H`` and the partition count."""

    hidden: int
    partitions: int


def _dtype_name(op: str, x) -> str:
    name = _IN_DTYPES.get(x.dtype)
    if name is None:
        raise LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {x.dtype}")
    return name


def forward_key(x, weight, residual, layout, with_y) -> ForwardKey:
    """The key of a forward launch (``LimitError`` outside the ranges)."""
    hidden = NORM_HIDDEN.require("rms_norm_forward", int(x.shape[-1]))
    fields = {}
    if layout is not None:
        spec = ScaleLayout.parse(layout)
        if spec.kind != "per_token" or hidden % spec.block[1]:
            raise LimitError(f"rms_norm_forward: the cast needs a per-token layout whose group divides H = {hidden}, "
                             f"got {spec.spec}")
        fields = dict(group=_GROUPS.require("rms_norm_forward", spec.block[1]), fmt=spec.fmt, sf=spec.sf,
                      storage=spec.storage, round_sf=spec.round_sf)
    return ForwardKey(hidden, _dtype_name("rms_norm_forward", x), weight is not None, residual is not None,
                      layout is None or bool(with_y), **fields)


def build_rms_norm_forward(hidden: int, in_dtype: str, weight: bool, residual: bool, writes_y: bool, group: int = 0,
                           fmt: str = "", sf: str = "", storage: str = "", round_sf: bool = False):
    """prim_func ``(x, [weight], [residual], [y], rstd, [residual_out], [data, sf_out], eps, out_scale)``: ``x``,
    ``residual`` ``(T, H)`` with dynamic row strides, ``y`` / ``residual_out`` ``(T, H)``, ``rstd (T,)`` fp32,
    ``data`` / ``sf_out`` in the forms of ``per_token_cast``'s kernel (``sf_param``). ``T`` is dynamic."""
    from tilelang import language as T

    H = NORM_HIDDEN.require("rms_norm_forward", hidden)
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"rms_norm_forward: the input dtype must be bfloat16 or float32, got {in_dtype}")
    cast = group > 0
    if cast:
        ScaleLayout((1, group), fmt, sf, storage, round_sf)  # the layout's own checks
        if H % group:
            raise LimitError(f"rms_norm_forward: the group {group} does not divide H = {H}")
    elif not writes_y:
        raise LimitError("rms_norm_forward: a launch writes y, the cast or both")
    V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]
    lay = row_layout(H, in_dtype, FORWARD_PLAN)
    per, tpr, slots, nvec, wpr = lay.per, lay.tpr, lay.slots, lay.nvec, lay.warps
    f32 = T.float32
    lanes = group // V if cast else 1  # lanes of a group
    nk = H // group if cast else 1
    e2m1 = fmt == "e2m1"
    scale_of = group_scale(T, fmt, sf, round_sf) if cast else None
    words = -(-nk // 4)
    pad = (4 - nk % 4) % 4 if sf == "ue8m0" else 0
    num_tokens = T.dynamic("num_tokens")
    x_stride, r_stride = T.dynamic("x_stride"), T.dynamic("residual_stride")

    def live(k, lt):
        return (lt + k * tpr < nvec) if lay.guarded else True

    row_sum = row_sum_macro(T, lay)

    @T.macro
    def body(x, w, res, y, rstd, res_out, data, sf_out, eps, out_scale):
        T.assume(x_stride % V == 0)  # rows start on 16 bytes (the op checks it): the loads are vectors
        if residual:
            T.assume(r_stride % V == 0)
        with T.Kernel(T.ceildiv(num_tokens, slots), threads=lay.threads) as bid:
            tid = T.get_thread_binding()
            lt = tid % tpr
            t = bid * slots + tid // tpr
            raw = T.alloc_local((V,), in_dtype)
            rr = T.alloc_local((V,), in_dtype)
            v = T.alloc_local((per, V), f32)  # f32(r)
            ws = T.alloc_local((V,), f32)  # fl(w * out_scale)
            yv = T.alloc_local((V,), in_dtype)
            yf = T.alloc_local((V,), f32)
            acc = T.alloc_local((2,), f32)  # the row's sum of squares, then rstd
            amax = T.alloc_local((1,), f32)
            scale = T.alloc_local((4,), f32)
            red = T.alloc_shared((slots * wpr,), f32) if wpr > 1 else None
            acc[0] = T.float32(0)
            for k in T.unroll(per):
                for e in T.unroll(V):
                    v[k, e] = T.float32(0)
                if t < num_tokens and live(k, lt):
                    for e in T.vectorized(V):
                        raw[e] = x[t, (lt + k * tpr) * V + e]
                    if residual:
                        for e in T.vectorized(V):
                            rr[e] = res[t, (lt + k * tpr) * V + e]
                        for e in T.unroll(V):  # one rounding of the fp32 sum to the dtype
                            raw[e] = T.cast(T.cast(raw[e], f32) + T.cast(rr[e], f32), in_dtype)
                        for e in T.vectorized(V):
                            res_out[t, (lt + k * tpr) * V + e] = raw[e]
                    for e in T.unroll(V):
                        v[k, e] = T.cast(raw[e], f32)
                        acc[0] += v[k, e] * v[k, e]
            row_sum(acc, red, tid)
            acc[1] = T.rsqrt(acc[0] / T.float32(H) + eps)
            if t < num_tokens and lt == 0:
                rstd[t] = acc[1]
            for k in T.unroll(per):
                amax[0] = T.float32(0)
                if t < num_tokens and live(k, lt):
                    for e in T.unroll(V):
                        ws[e] = out_scale
                    if weight:
                        for e in T.vectorized(V):
                            yv[e] = w[(lt + k * tpr) * V + e]
                        for e in T.unroll(V):
                            ws[e] = T.cast(yv[e], f32) * out_scale
                    for e in T.unroll(V):
                        yv[e] = T.cast((v[k, e] * acc[1]) * ws[e], in_dtype)
                    if writes_y:
                        for e in T.vectorized(V):
                            y[t, (lt + k * tpr) * V + e] = yv[e]
                    for e in T.unroll(V):
                        yf[e] = T.cast(yv[e], f32)
                        amax[0] = T.max(amax[0], T.abs(yf[e]))
                if cast:
                    for b in T.unroll(lanes.bit_length() - 1):
                        amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << b))
                    if t < num_tokens and live(k, lt):
                        scale_of(scale, amax[0])
                        for e in T.unroll(V):
                            yf[e] = T.ieee_mul(yf[e], scale[3])
                        if e2m1:
                            for e in T.vectorized(V // 2):
                                data[t, (lt + k * tpr) * (V // 2) + e] = (
                                    e2m1_encode(T, yf[2 * e]) | (e2m1_encode(T, yf[2 * e + 1]) << T.uint8(4)))
                        else:
                            for e in T.vectorized(V):
                                data[t, (lt + k * tpr) * V + e] = T.cast(yf[e], T.float8_e4m3fn)
                        if lt % lanes == 0:
                            sf_out[sf_index(storage, sf, t, (lt + k * tpr) // lanes)] = stored_scale(T, scale[2], sf)
                            if pad and (lt + k * tpr) // lanes == nk - 1:  # the zero bytes past the last scale
                                for b in T.unroll(pad):
                                    if storage == "row":
                                        sf_out[t, nk + b] = T.uint8(0)
                                    else:
                                        sf_out[words - 1, t * 4 + 4 - pad + b] = T.uint8(0)

    x_param = T.StridedTensor((num_tokens, H), (x_stride, 1), in_dtype)
    params = [("x", x_param)]
    if weight:
        params.append(("weight", T.Tensor((H,), in_dtype)))
    if residual:
        params.append(("residual", T.StridedTensor((num_tokens, H), (r_stride, 1), in_dtype)))
    if writes_y:
        params.append(("y", T.Tensor((num_tokens, H), in_dtype)))
    params.append(("rstd", T.Tensor((num_tokens,), f32)))
    if residual:
        params.append(("residual_out", T.Tensor((num_tokens, H), in_dtype)))
    if cast:
        params.append(("data", T.Tensor((num_tokens, H // 2 if e2m1 else H), T.uint8 if e2m1 else T.float8_e4m3fn)))
        params.append(("sf_out", sf_param(T, storage, sf, nk, num_tokens, "sf_stride")))
    return variant_prim_func(T.prim_func, T.float32, "rms_norm_forward_cuda", params, ("eps", "out_scale"), body,
                      ("x", "weight", "residual", "y", "rstd", "residual_out", "data", "sf_out"))


def backward_key(grad_y, weight, grad_weight, grad_residual_out) -> BackwardKey:
    """The key of a backward launch (``LimitError`` outside the ranges)."""
    return BackwardKey(NORM_HIDDEN.require("rms_norm_backward", int(grad_y.shape[-1])),
                       _dtype_name("rms_norm_backward", grad_y), weight is not None, grad_weight is not None,
                       grad_residual_out is not None, NORM_GRAD_WEIGHT_PARTITIONS["cuda"])


def build_rms_norm_backward(hidden: int, in_dtype: str, weight: bool, grad_weight: bool, grad_residual_out: bool,
                            partitions: int):
    """prim_func ``(grad_y, x, [weight], rstd, [grad_residual_out], grad_x, [grad_weight_partial], out_scale)``:
    ``grad_y``, ``x``, ``grad_residual_out`` ``(T, H)`` with dynamic row strides, ``rstd (T,)`` fp32, ``grad_x
    (T, H)``, ``grad_weight_partial (P, H)`` fp32 (every row written). ``T`` is dynamic."""
    from tilelang import language as T

    H = NORM_HIDDEN.require("rms_norm_backward", hidden)
    P = IntRange("partitions", 1).require("rms_norm_backward", partitions)
    if in_dtype not in _ELEMENT_BYTES:
        raise LimitError(f"rms_norm_backward: the input dtype must be bfloat16 or float32, got {in_dtype}")
    V = VEC_BYTES // _ELEMENT_BYTES[in_dtype]
    lay = row_layout(H, in_dtype, BACKWARD_PLAN)
    per, tpr, slots, nvec, wpr, threads = lay.per, lay.tpr, lay.slots, lay.nvec, lay.warps, lay.threads
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")
    strides = {n: T.dynamic(f"{n}_stride") for n in ("grad_y", "x", "grad_residual_out")}

    def live(k, lt):
        return (lt + k * tpr < nvec) if lay.guarded else True

    row_sum = row_sum_macro(T, lay)

    @T.macro
    def terms(w, xr, gr, wr, xh, gx, gw, k, lt, rs, out_scale):
        """Of the thread's vector ``k``: ``xhat = fl(x * rstd)``, ``g = fl(grad_y * out_scale)``, ``fl(w * g)``."""
        if weight:
            for e in T.vectorized(V):
                wr[e] = w[(lt + k * tpr) * V + e]
        for e in T.unroll(V):
            xh[e] = T.cast(xr[k, e], f32) * rs
            gx[e] = T.cast(gr[k, e], f32) * out_scale
            gw[e] = T.cast(wr[e], f32) * gx[e] if weight else gx[e]

    @T.macro
    def body(grad_y, x, w, rstd, gro, grad_x, partial, out_scale):
        for name in strides if grad_residual_out else ("grad_y", "x"):
            T.assume(strides[name] % V == 0)  # rows start on 16 bytes (the op checks it)
        with T.Kernel(P, threads=threads) as p:
            tid = T.get_thread_binding()
            lt = tid % tpr
            slot = tid // tpr
            xr = T.alloc_local((per, V), in_dtype)  # the row's x and grad_y, kept raw for the second pass
            gr = T.alloc_local((per, V), in_dtype)
            wr = T.alloc_local((V,), in_dtype)
            xh = T.alloc_local((V,), f32)
            gw = T.alloc_local((V,), f32)  # fl(w * g)
            gx = T.alloc_local((V,), f32)
            acc = T.alloc_local((2,), f32)  # the row's sum of xhat * w * g, then rstd
            red = T.alloc_shared((slots * wpr,), f32) if wpr > 1 else None
            dw = T.alloc_shared((slots, H), f32) if grad_weight else None  # a slot's weight gradient
            chunk = T.ceildiv(num_tokens, P)
            lo = T.min(p * chunk, num_tokens)
            hi = T.min(lo + chunk, num_tokens)
            if grad_weight:
                for k in T.unroll(per):
                    if live(k, lt):
                        for e in T.vectorized(V):
                            dw[slot, (lt + k * tpr) * V + e] = T.float32(0)
            for i in T.serial(T.ceildiv(chunk, slots)):
                acc[0] = T.float32(0)
                acc[1] = T.float32(0)
                if lo + i * slots + slot < hi:
                    acc[1] = rstd[lo + i * slots + slot]
                    for k in T.unroll(per):
                        if live(k, lt):
                            for e in T.vectorized(V):
                                xr[k, e] = x[lo + i * slots + slot, (lt + k * tpr) * V + e]
                            for e in T.vectorized(V):
                                gr[k, e] = grad_y[lo + i * slots + slot, (lt + k * tpr) * V + e]
                    for k in T.unroll(per):
                        if live(k, lt):
                            terms(w, xr, gr, wr, xh, gx, gw, k, lt, acc[1], out_scale)
                            for e in T.unroll(V):
                                acc[0] += xh[e] * gw[e]
                            if grad_weight:
                                for e in T.unroll(V):
                                    dw[slot, (lt + k * tpr) * V + e] += xh[e] * gx[e]
                row_sum(acc, red, tid)
                if wpr > 1:
                    T.sync_threads()  # every slot has read red before the next row writes it
                acc[0] = acc[0] / T.float32(H)  # mean(xhat * w * g)
                if lo + i * slots + slot < hi:
                    for k in T.unroll(per):
                        if live(k, lt):
                            terms(w, xr, gr, wr, xh, gx, gw, k, lt, acc[1], out_scale)
                            for e in T.unroll(V):
                                gx[e] = (gw[e] - xh[e] * acc[0]) * acc[1]
                            if grad_residual_out:
                                for e in T.vectorized(V):
                                    gr[k, e] = gro[lo + i * slots + slot, (lt + k * tpr) * V + e]
                                for e in T.unroll(V):
                                    gx[e] = gx[e] + T.cast(gr[k, e], f32)
                            for e in T.vectorized(V):
                                grad_x[lo + i * slots + slot, (lt + k * tpr) * V + e] = T.cast(gx[e], in_dtype)
            if grad_weight:
                T.sync_threads()
                for c in T.serial(T.ceildiv(H, threads)):
                    if c * threads + tid < H:
                        acc[0] = dw[0, c * threads + tid]
                        for j in T.unroll(1, slots):
                            acc[0] += dw[j, c * threads + tid]
                        partial[p, c * threads + tid] = acc[0]

    params = [("grad_y", T.StridedTensor((num_tokens, H), (strides["grad_y"], 1), in_dtype)),
              ("x", T.StridedTensor((num_tokens, H), (strides["x"], 1), in_dtype))]
    if weight:
        params.append(("weight", T.Tensor((H,), in_dtype)))
    params.append(("rstd", T.Tensor((num_tokens,), f32)))
    if grad_residual_out:
        params.append(("grad_residual_out", T.StridedTensor((num_tokens, H), (strides["grad_residual_out"], 1),
                                                            in_dtype)))
    params.append(("grad_x", T.Tensor((num_tokens, H), in_dtype)))
    if grad_weight:
        params.append(("grad_weight_partial", T.Tensor((P, H), f32)))
    return variant_prim_func(T.prim_func, T.float32, "rms_norm_backward_cuda", params, ("out_scale",), body,
                      ("grad_y", "x", "weight", "rstd", "grad_residual_out", "grad_x", "grad_weight_partial"))


def build_rms_norm_grad_weight_reduce(hidden: int, partitions: int):
    """prim_func ``(grad_weight_partial (P, H) fp32, grad_weight (H,) fp32)``: ``grad_weight += s``, ``s`` the sum of
    the partial rows in ascending order (from row 0)."""
    from tilelang import language as T

    H = NORM_HIDDEN.require("rms_norm_backward", hidden)
    P = IntRange("partitions", 1).require("rms_norm_backward", partitions)
    f32, C = T.float32, REDUCE_VEC

    @T.prim_func
    def rms_norm_grad_weight_reduce_cuda(grad_weight_partial: T.Tensor((P, H), f32), grad_weight: T.Tensor((H,), f32)):
        with T.Kernel(T.ceildiv(H, REDUCE_THREADS * C), threads=REDUCE_THREADS) as b:
            tid = T.get_thread_binding()
            acc = T.alloc_local((C,), f32)
            row = T.alloc_local((C,), f32)
            if (b * REDUCE_THREADS + tid) * C < H:
                for e in T.vectorized(C):
                    acc[e] = grad_weight_partial[0, (b * REDUCE_THREADS + tid) * C + e]
                for q in T.serial(1, P):
                    for e in T.vectorized(C):
                        row[e] = grad_weight_partial[q, (b * REDUCE_THREADS + tid) * C + e]
                    for e in T.unroll(C):
                        acc[e] += row[e]
                for e in T.vectorized(C):
                    row[e] = grad_weight[(b * REDUCE_THREADS + tid) * C + e]
                for e in T.vectorized(C):
                    grad_weight[(b * REDUCE_THREADS + tid) * C + e] = row[e] + acc[e]

    return rms_norm_grad_weight_reduce_cuda


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    """The forward variants that change code: bf16 with the residual and the UE8M0 col_tma cast of groups 32 with
    y, fp32 without weight nor residual (y alone), bf16 to MXFP4 without y, and bf16 with fp32 scales of 128."""
    del hc_mult
    cases = {"rms_norm_forward_bf16_residual_e4m3_ue8m0_col_g32": ("bfloat16", True, True, True,
                                                                   "1x32/e4m3/ue8m0/col_tma/round"),
             "rms_norm_forward_f32_plain": ("float32", False, False, True, None),
             "rms_norm_forward_bf16_e2m1_ue8m0_g32_no_y": ("bfloat16", True, False, False, "1x32/e2m1/ue8m0/row/round")}
    if hidden_size % 128 == 0:
        cases["rms_norm_forward_bf16_e4m3_fp32_g128"] = ("bfloat16", True, True, False, "1x128/e4m3/fp32/row/exact")
    return {name: _case_key(hidden_size, *fields) for name, fields in cases.items()}


def _case_key(hidden, in_dtype, weight, residual, writes_y, layout):
    fields = {}
    if layout is not None:
        spec = ScaleLayout.parse(layout)
        fields = dict(group=spec.block[1], fmt=spec.fmt, sf=spec.sf, storage=spec.storage, round_sf=spec.round_sf)
    return ForwardKey(hidden, in_dtype, weight, residual, writes_y or layout is None, **fields)


def _backward_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with every optional tensor, fp32 without weight nor grad_residual_out."""
    del hc_mult
    P = NORM_GRAD_WEIGHT_PARTITIONS["cuda"]
    return {"rms_norm_backward_bf16_full": BackwardKey(hidden_size, "bfloat16", True, True, True, P),
            "rms_norm_backward_f32_plain": BackwardKey(hidden_size, "float32", False, False, False, P)}


FORWARD = Kernel("rms_norm_forward", ForwardKey, build_rms_norm_forward, cases=_forward_cases, derive=forward_key)
BACKWARD = Kernel("rms_norm_backward", BackwardKey, build_rms_norm_backward, cases=_backward_cases,
                  derive=backward_key)
GRAD_WEIGHT_REDUCE = Kernel(
    "rms_norm_grad_weight_reduce", ReduceKey, build_rms_norm_grad_weight_reduce,
    cases=lambda hidden_size, hc_mult: {"rms_norm_backward_grad_weight_reduce": ReduceKey(
        hidden_size, NORM_GRAD_WEIGHT_PARTITIONS["cuda"])})


def rms_norm_forward(x, weight, eps, residual, out_scale, layout, with_y, y, rstd, residual_out, data, sf) -> None:
    """Launches the forward on the current stream (arguments validated and outputs allocated upstream): the rows
    of x (and residual) in, y / rstd / residual_out / data / sf written as the key asks."""
    x2 = rows(x)
    if x2.shape[0] == 0:
        return
    key = FORWARD.key(x, weight, residual, layout, with_y)
    args = present(x2, weight, rows_of(residual), y.view(x2.shape) if key.writes_y else None,
                   rstd.view(x2.shape[0]), rows_of(residual_out if residual is not None else None))
    if key.group:
        args += [data, sf_view(sf, key.storage, key.sf)]
    FORWARD.compiled(key)(*args, float(eps), float(out_scale))


def rms_norm_backward(grad_y, x, weight, rstd, grad_weight, grad_residual_out, out_scale, grad_x) -> None:
    """Launches the backward on the current stream: grad_x written; with grad_weight, P partial rows into a
    scratch buffer, then their sum in ascending order added into grad_weight."""
    g2 = rows(grad_y)
    if g2.shape[0] == 0:
        return
    key = BACKWARD.key(grad_y, weight, grad_weight, grad_residual_out)
    partial = None if grad_weight is None else grad_weight.new_empty((key.partitions, key.hidden))
    BACKWARD.compiled(key)(*present(g2, rows(x), weight, rstd.reshape(g2.shape[0]), rows_of(grad_residual_out),
                                    rows(grad_x), partial), float(out_scale))
    if partial is not None:
        GRAD_WEIGHT_REDUCE.compiled(ReduceKey(key.hidden, key.partitions))(partial, grad_weight)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD, GRAD_WEIGHT_REDUCE)
