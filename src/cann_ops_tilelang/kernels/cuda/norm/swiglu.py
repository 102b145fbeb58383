"""CUDA kernels of ``swiglu_forward`` / ``swiglu_backward`` (docs/ops/norm.md#swiglu).

One warp per row: each lane takes 16-byte vectors of the gate and up halves (and of ``grad_y``) at columns
``(i * 32 + lane) * V``, ``unroll`` vectors per lane per step with every load issued before the math, so the row
streams through registers once whatever ``H`` (up to 32768). All arithmetic is fp32 (bf16 widened exactly), each
result rounded once to its dtype at the store. The per-row sums (the routing weight's gradient, the clamp
counters) are lane sums in column order, then a xor butterfly over the warp: a fixed order, no atomics.

Math (the peer's order): ``silu = g / (1 + exp(-g))`` (``expf``, IEEE division), ``y = (silu * u) * w`` with
``w = routing_weight * routed_scaling_factor`` (one fp32 product); backward ``s = 1 / (1 + exp(-g))``,
``d = (dy * w) * s``, ``grad_g = (d * u) * fma(g, 1 - s, 1)``, ``grad_u = d * g``, zero where the clamp clamped.
Padding rows (a 0 in ``valid``, the expert segments' row flags that the launcher derives) are not read: their
zero loads with ``w = 1`` give +0 everywhere (the clamp is positive), the routing weight's gradient is selected 0.

The forward's cast (``layout``) is fused: each lane casts its rounded ``y`` vector in the registers, as the quant
family's ``per_token_cast`` kernel casts a row (its scale arithmetic, ``group_scale``); ``y`` is written only with
``with_y``. The backward casts its rounded ``grad_g`` and ``grad_u`` vectors likewise (groups of the ``2 H`` row,
each within a half). A quantized ``x`` (e4m3 data with per-token scales) is dequantized in the kernel, each vector
``fl(f32(data) * sx)`` with its group's scale, as ``cast_back`` does. ``T`` and the row strides are dynamic.
"""

import dataclasses

import torch

from ....limits import NORM_HIDDEN, LimitError
from ....norm import swiglu as swiglu_op
from ....norm._common import rows
from ....quant import ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from ..quant._common import e2m1_encode, group_scale, sf_index, sf_param, sf_view, stored_scale, ue8m0_decode

# bytes of one vector access of a row
VEC_BYTES = 16
DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "e4m3"}
ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
QUANTIZED_BYTES = 1  # an e4m3 x
WARP = 32
# the clamp counters the kernel writes per row: gate > c, up > c, up < -c, the row's counted elements
COUNTERS = swiglu_op.COUNTERS


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Warp-per-row kernels: CTAs of ``warps`` warps (one row each), ``unroll`` vectors per lane per step."""

    warps: int
    unroll: int


# 4 vectors per lane per step: 4 KiB of gate and up (6 KiB with grad_y) in flight per warp; 4 warps per CTA keep
# many CTAs resident for every H. Not measured yet (docs/perf/h200/norm.md will hold the measurement).
ROW_PLAN = RowPlan(warps=4, unroll=4)


@compile_key
class ForwardKey:
    """Compile-time key of the forward: ``H``, ``x``'s dtype and the options that change code (never ``T``)."""

    hidden: int
    in_dtype: str  # "bfloat16" | "float32"
    weighted: bool  # a routing weight
    clamped: bool  # the clamp
    counted: bool  # the clamp counters
    masked: bool  # expert segments (row flags)
    group: int = 0  # the fused cast's layout (group 0: no cast)
    fmt: str = ""
    sf: str = ""
    storage: str = ""
    round_sf: bool = False
    writes_y: bool = True  # False: the cast alone (no with_y)


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``H``, the dtypes of ``x`` (fp32 for a dequantized one) and of the
    gradients, and the options that change code."""

    hidden: int
    in_dtype: str
    out_dtype: str
    weighted: bool
    clamped: bool
    masked: bool
    recompute: bool
    group: int = 0  # the fused cast's layout (group 0: no cast)
    fmt: str = ""
    sf: str = ""
    storage: str = ""
    round_sf: bool = False
    x_group: int = 0  # a quantized x (in_dtype "e4m3"): its layout's group, scale kind and storage
    x_sf: str = ""
    x_storage: str = ""


def _dtype(where: str, name: str) -> str:
    if name not in ELEMENT_BYTES:
        raise LimitError(f"{where}: the dtype must be bfloat16 or float32, got {name}")
    return name


def forward_key(x, routing_weight, clamp, clamped_count, expert_offsets, layout=None, with_y=False) -> ForwardKey:
    cast = layout_fields("swiglu_forward", layout, writes_y=bool(with_y))
    return ForwardKey(hidden=NORM_HIDDEN.require("swiglu_forward", x.shape[-1] // 2),
                      in_dtype=_dtype("swiglu_forward", DTYPES.get(x.dtype, str(x.dtype))),
                      weighted=routing_weight is not None, clamped=clamp is not None,
                      counted=clamped_count is not None, masked=expert_offsets is not None, **cast)


def backward_key(x2, grad_y, routing_weight, clamp, expert_offsets, recompute, layout=None,
                 x_layout=None) -> BackwardKey:
    quantized = {}
    if x_layout is not None:
        spec = layout_fields("swiglu_backward", x_layout)
        quantized = dict(x_group=spec["group"], x_sf=spec["sf"], x_storage=spec["storage"])
    return BackwardKey(hidden=NORM_HIDDEN.require("swiglu_backward", x2.shape[-1] // 2),
                       in_dtype="e4m3" if x_layout is not None else
                       _dtype("swiglu_backward", DTYPES.get(x2.dtype, str(x2.dtype))),
                       out_dtype=_dtype("swiglu_backward", DTYPES.get(grad_y.dtype, str(grad_y.dtype))),
                       weighted=routing_weight is not None, clamped=clamp is not None,
                       masked=expert_offsets is not None, recompute=bool(recompute),
                       **layout_fields("swiglu_backward", layout), **quantized)


def _row_params(T, hidden: int, in_dtype: str, vec: int):
    """The dynamic sizes and the geometry shared by both kernels: ``(num_tokens, steps)``."""
    nvec = hidden // vec
    steps = -(-nvec // (WARP * ROW_PLAN.unroll))
    return T.dynamic("num_tokens"), nvec, steps


def cast_geometry(where: str, hidden: int, width: int, vec: int, group: int, fmt: str, sf: str, storage: str,
                  round_sf: bool) -> tuple[int, int]:
    """``(lanes, levels)`` of a fused per-token cast of rows of ``width`` channels read in vectors of ``vec``: a group
    is ``lanes = group / vec`` consecutive lanes of a warp (1 to 32), ``levels`` its butterfly's steps; the group
    divides ``H`` (no group straddles the gate and up halves). ``LimitError`` otherwise."""
    ScaleLayout((1, group), fmt, sf, storage, round_sf)  # the layout's own checks
    lanes = group // vec
    if lanes < 1 or lanes > WARP or hidden % group or width % group:
        raise LimitError(f"{where}: a cast group of {group} must be 1 to {WARP} vectors of {vec} and divide H = "
                         f"{hidden}")
    return lanes, lanes.bit_length() - 1


def cast_macro(T, vec: int, lanes: int, levels: int, nk: int, fmt: str, sf: str, storage: str, round_sf: bool):
    """A ``T.macro`` ``(vals, k, data, sf_out, t, vi, base, live, yv, amax, scale)`` casting the rounded vector
    ``vals[k, :]`` (the ``vi``-th vector of a ``(T, W)`` row, ``W = nk * group``, its first channel ``base + vi *
    vec``) as ``per_token_cast`` casts it: the vector's amax, a xor butterfly over the group's lanes (every lane takes
    part; ``live`` lanes store), ``group_scale``'s scale and inverse, the data ``Q(fl(v * inv))`` and, from the
    group's first lane, the scale (UE8M0 words' bytes past the last group zeroed). ``yv``, ``amax``, ``scale`` are
    the caller's local scratch."""
    scale_of = group_scale(T, fmt, sf, round_sf)
    e2m1 = fmt == "e2m1"
    words, pad = -(-nk // 4), (4 - nk % 4) % 4
    f32 = T.float32

    @T.macro
    def cast_vector(vals, k, data, sf_out, t, vi, base, live, yv, amax, scale):
        amax[0] = T.float32(0)
        for j in T.unroll(vec):
            yv[j] = T.cast(vals[k, j], f32)
            amax[0] = T.max(amax[0], T.abs(yv[j]))
        for b in T.unroll(levels):
            amax[0] = T.max(amax[0], T.shfl_xor(amax[0], 1 << b))
        if live:
            scale_of(scale, amax[0])
            for j in T.unroll(vec):
                yv[j] = T.ieee_mul(yv[j], scale[3])
            if e2m1:
                for j in T.vectorized(vec // 2):
                    data[t, (base + vi * vec) // 2 + j] = (e2m1_encode(T, yv[2 * j])
                                                           | (e2m1_encode(T, yv[2 * j + 1]) << T.uint8(4)))
            else:
                for j in T.vectorized(vec):
                    data[t, base + vi * vec + j] = T.cast(yv[j], T.float8_e4m3fn)
            if vi % lanes == 0:
                sf_out[sf_index(storage, sf, t, (base + vi * vec) // (lanes * vec))] = stored_scale(T, scale[2], sf)
                if sf == "ue8m0" and pad:
                    if (base + vi * vec) // (lanes * vec) == nk - 1:
                        for b in T.unroll(pad):
                            if storage == "row":
                                sf_out[t, nk + b] = T.uint8(0)
                            else:
                                sf_out[words - 1, t * 4 + 4 - pad + b] = T.uint8(0)

    return cast_vector


def gate_up_loader(T, hidden: int, vec: int, dtype):
    """A ``T.macro`` ``(x, gr, ur, t, k, col, live)`` loading the gate and up vectors of row ``t`` at column ``col``
    into ``gr[k, :]`` / ``ur[k, :]`` (zeros where not ``live``: past the row's end, or a padding row)."""

    @T.macro
    def load(x, gr, ur, t, k, col, live):
        if live:
            for j in T.vectorized(vec):
                gr[k, j] = x[t, col + j]
            for j in T.vectorized(vec):
                ur[k, j] = x[t, hidden + col + j]
        else:
            for j in T.vectorized(vec):
                gr[k, j] = T.cast(0, dtype)
                ur[k, j] = T.cast(0, dtype)

    return load


def layout_fields(where: str, layout, **extra) -> dict:
    """The key fields of a fused cast's layout (none without one)."""
    if layout is None:
        return {}
    spec = ScaleLayout.parse(layout)
    if spec.kind != "per_token":
        raise LimitError(f"{where}: the cast's layout must be per-token, got {spec.spec}")
    return dict(group=spec.block[1], fmt=spec.fmt, sf=spec.sf, storage=spec.storage, round_sf=spec.round_sf, **extra)


def build_swiglu_forward(hidden: int, in_dtype: str, weighted: bool, clamped: bool, counted: bool, masked: bool,
                         group: int = 0, fmt: str = "", sf: str = "", storage: str = "", round_sf: bool = False,
                         writes_y: bool = True):
    """prim_func ``(x (T, 2H) strided, y (n_y, H), routing_weight (n_w,), valid (n_v,) int32, counts (n_c, 4) int32,
    [data, sf_out,] routed_scaling_factor, clamp)``: the optional tensors are read or written only where the key says
    so (the launcher passes empty ones otherwise). With a cast (``group > 0``) each lane's rounded ``y`` vector is
    cast in the registers: a group of ``g`` channels is ``g / V`` consecutive lanes, its amax a xor butterfly, its
    scale and data the quant family's arithmetic (``group_scale``), the scale stored by the group's first lane."""
    from tilelang import language as T

    H = NORM_HIDDEN.require("swiglu_forward", hidden)
    _dtype("swiglu_forward", in_dtype)
    V = VEC_BYTES // ELEMENT_BYTES[in_dtype]
    U, warps = ROW_PLAN.unroll, ROW_PLAN.warps
    num_tokens, nvec, steps = _row_params(T, H, in_dtype, V)
    x_stride = T.dynamic("x_stride")
    n_y, n_w, n_v, n_c = T.dynamic("n_y"), T.dynamic("n_w"), T.dynamic("n_v"), T.dynamic("n_c")
    load = gate_up_loader(T, H, V, in_dtype)
    f32, i32 = T.float32, T.int32
    cast = group > 0
    if cast:
        lanes, levels = cast_geometry("swiglu_forward", H, H, V, group, fmt, sf, storage, round_sf)
        cast_vector = cast_macro(T, V, lanes, levels, H // group, fmt, sf, storage, round_sf)
        data_param = T.Tensor((num_tokens, H // 2 if fmt == "e2m1" else H), T.uint8 if fmt == "e2m1" else
                              T.float8_e4m3fn)
        sf_arg = sf_param(T, storage, sf, H // group, num_tokens, "sf_stride")

    @T.macro
    def body(x, y, routing_weight, valid, counts, data, sf_out, routed_scaling_factor, clamp):
        T.assume(x_stride % V == 0)  # rows start on 16 bytes (the op checks it): the loads are vectors
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=warps * WARP) as bid:
            tid = T.get_thread_binding()
            lane = tid % WARP
            t = bid * warps + tid // WARP
            gr = T.alloc_local((U, V), in_dtype)
            ur = T.alloc_local((U, V), in_dtype)
            yr = T.alloc_local((U, V), in_dtype)
            g = T.alloc_local((1,), f32)
            u = T.alloc_local((1,), f32)
            w = T.alloc_local((1,), f32)
            ok = T.alloc_local((1,), i32)
            cnt = T.alloc_local((3,), i32)
            yv = T.alloc_local((V,), f32)  # the cast: the rounded y widened, then scaled
            amax = T.alloc_local((1,), f32)
            scale = T.alloc_local((4,), f32)  # a, a / max, s, inv
            if t < num_tokens:
                ok[0] = valid[t] if masked else 1
                w[0] = T.float32(1)  # padding rows keep 1: their zero loads give +0 results
                if weighted and ok[0] != 0:
                    w[0] = routing_weight[t] * routed_scaling_factor
                for c in T.unroll(3):
                    cnt[c] = 0
                for s in T.serial(steps):
                    for k in T.unroll(U):
                        load(x, gr, ur, t, k, ((s * U + k) * WARP + lane) * V,
                             (s * U + k) * WARP + lane < nvec and ok[0] != 0)
                    for k in T.unroll(U):
                        for j in T.unroll(V):
                            g[0] = T.cast(gr[k, j], f32)
                            u[0] = T.cast(ur[k, j], f32)
                            if counted:
                                cnt[0] += T.cast(g[0] > clamp, i32)
                                cnt[1] += T.cast(u[0] > clamp, i32)
                                cnt[2] += T.cast(u[0] < -clamp, i32)
                            if clamped:
                                g[0] = T.min(g[0], clamp)
                                u[0] = T.max(T.min(u[0], clamp), -clamp)
                            u[0] = T.ieee_mul(T.ieee_fdiv(g[0], T.ieee_add(T.float32(1), T.exp(-g[0]))), u[0])
                            if weighted:
                                u[0] = T.ieee_mul(u[0], w[0])
                            yr[k, j] = T.cast(u[0], in_dtype)
                        if writes_y:
                            if (s * U + k) * WARP + lane < nvec:
                                for j in T.vectorized(V):
                                    y[t, ((s * U + k) * WARP + lane) * V + j] = yr[k, j]
                        if cast:
                            cast_vector(yr, k, data, sf_out, t, (s * U + k) * WARP + lane, 0,
                                        (s * U + k) * WARP + lane < nvec, yv, amax, scale)
                if counted:
                    for c in T.unroll(3):
                        for b in T.unroll(5):
                            cnt[c] = cnt[c] + T.shfl_xor(cnt[c], 1 << b)
                    if lane == 0:
                        for c in T.unroll(3):
                            counts[t, c] = cnt[c]
                        counts[t, 3] = T.if_then_else(ok[0] != 0, T.int32(H), T.int32(0))

    x_param = T.StridedTensor((num_tokens, 2 * H), (x_stride, 1), in_dtype)
    if cast:
        @T.prim_func
        def swiglu_forward_cast_cuda(x: x_param, y: T.Tensor((n_y, H), in_dtype), routing_weight: T.Tensor((n_w,), f32),
                                     valid: T.Tensor((n_v,), i32), counts: T.Tensor((n_c, COUNTERS), i32),
                                     data: data_param, sf_out: sf_arg, routed_scaling_factor: f32, clamp: f32):
            body(x, y, routing_weight, valid, counts, data, sf_out, routed_scaling_factor, clamp)
        return swiglu_forward_cast_cuda

    @T.prim_func
    def swiglu_forward_cuda(x: x_param, y: T.Tensor((n_y, H), in_dtype), routing_weight: T.Tensor((n_w,), f32),
                            valid: T.Tensor((n_v,), i32), counts: T.Tensor((n_c, COUNTERS), i32),
                            routed_scaling_factor: f32, clamp: f32):
        body(x, y, routing_weight, valid, counts, None, None, routed_scaling_factor, clamp)
    return swiglu_forward_cuda


def build_swiglu_backward(hidden: int, in_dtype: str, out_dtype: str, weighted: bool, clamped: bool, masked: bool,
                          recompute: bool, group: int = 0, fmt: str = "", sf: str = "", storage: str = "",
                          round_sf: bool = False, x_group: int = 0, x_sf: str = "", x_storage: str = ""):
    """prim_func ``(x (T, 2H) strided, grad_y (T, H) strided, grad_x (T, 2H), y (n_y, H), routing_weight (n_w,),
    valid (n_v,) int32, grad_routing_weight (n_w,), [data, sf_out,] routed_scaling_factor, clamp)``, with
    ``x_sf`` after ``x`` for a quantized x (``in_dtype`` "e4m3": each vector's values ``fl(f32(data) * sx)``, ``sx``
    its group's scale decoded, as ``cast_back`` dequantizes); with a cast (``group > 0``) each lane casts its rounded
    grad_g and grad_u vectors (the groups of the ``2 H`` row)."""
    from tilelang import language as T

    H = NORM_HIDDEN.require("swiglu_backward", hidden)
    quantized = in_dtype == "e4m3"
    if quantized:
        ScaleLayout((1, x_group), "e4m3", x_sf, x_storage, x_sf == "ue8m0")  # the input layout's own checks
    else:
        _dtype("swiglu_backward", in_dtype)
    _dtype("swiglu_backward", out_dtype)
    in_bytes = QUANTIZED_BYTES if quantized else ELEMENT_BYTES[in_dtype]
    V = VEC_BYTES // max(in_bytes, ELEMENT_BYTES[out_dtype])
    if quantized and (x_group % V or (2 * H) % x_group):
        raise LimitError(f"swiglu_backward: the input group {x_group} must be whole vectors of {V} and divide 2 H")
    x_dtype = T.float8_e4m3fn if quantized else in_dtype
    load = gate_up_loader(T, H, V, x_dtype)
    U, warps = ROW_PLAN.unroll, ROW_PLAN.warps
    num_tokens, nvec, steps = _row_params(T, H, in_dtype, V)
    x_stride, gy_stride = T.dynamic("x_stride"), T.dynamic("grad_y_stride")
    n_y, n_w, n_v = T.dynamic("n_y"), T.dynamic("n_w"), T.dynamic("n_v")
    f32, i32 = T.float32, T.int32
    x_align = VEC_BYTES // in_bytes
    gy_align = VEC_BYTES // ELEMENT_BYTES[out_dtype]

    cast = group > 0
    if cast:
        lanes, levels = cast_geometry("swiglu_backward", H, 2 * H, V, group, fmt, sf, storage, round_sf)
        cast_vector = cast_macro(T, V, lanes, levels, 2 * H // group, fmt, sf, storage, round_sf)
        data_param = T.Tensor((num_tokens, H if fmt == "e2m1" else 2 * H), T.uint8 if fmt == "e2m1" else
                              T.float8_e4m3fn)
        sf_arg = sf_param(T, storage, sf, 2 * H // group, num_tokens, "sf_stride")

    def decode(value):
        """The fp32 scale of a stored input scale: fp32 as is, e4m3 widened, a UE8M0 byte as its power of two."""
        if x_sf == "ue8m0":
            return ue8m0_decode(T, value)
        return T.cast(value, f32) if x_sf == "e4m3" else value

    @T.macro
    def body(x, x_scales, grad_y, grad_x, y, routing_weight, valid, grad_routing_weight, data, sf_out,
             routed_scaling_factor, clamp):
        T.assume(x_stride % x_align == 0)
        T.assume(gy_stride % gy_align == 0)
        with T.Kernel(T.ceildiv(num_tokens, warps), threads=warps * WARP) as bid:
            tid = T.get_thread_binding()
            lane = tid % WARP
            t = bid * warps + tid // WARP
            gr = T.alloc_local((U, V), x_dtype)
            ur = T.alloc_local((U, V), x_dtype)
            sx = T.alloc_local((U, 2), f32)  # a quantized x: the scales of the gate and up vectors
            dr = T.alloc_local((U, V), out_dtype)
            ggr = T.alloc_local((U, V), out_dtype)
            gur = T.alloc_local((U, V), out_dtype)
            yr = T.alloc_local((U, V), out_dtype)
            v = T.alloc_local((8,), f32)  # g, u, dy, e = 1 + exp(-g), s, d, act, scratch
            w = T.alloc_local((1,), f32)
            acc = T.alloc_local((1,), f32)
            ok = T.alloc_local((1,), i32)
            yv = T.alloc_local((V,), f32)  # the cast's scratch
            amax = T.alloc_local((1,), f32)
            scale = T.alloc_local((4,), f32)
            if t < num_tokens:
                ok[0] = valid[t] if masked else 1
                w[0] = T.float32(1)  # padding rows keep 1: their zero loads give +0 results
                if weighted and ok[0] != 0:
                    w[0] = routing_weight[t] * routed_scaling_factor
                acc[0] = T.float32(0)
                for s in T.serial(steps):
                    for k in T.unroll(U):
                        load(x, gr, ur, t, k, ((s * U + k) * WARP + lane) * V,
                             (s * U + k) * WARP + lane < nvec and ok[0] != 0)
                        if (s * U + k) * WARP + lane < nvec and ok[0] != 0:
                            for j in T.vectorized(V):
                                dr[k, j] = grad_y[t, ((s * U + k) * WARP + lane) * V + j]
                            if quantized:
                                sx[k, 0] = decode(x_scales[sf_index(x_storage, x_sf, t, (((s * U + k) * WARP + lane)
                                                                                         * V) // x_group)])
                                sx[k, 1] = decode(x_scales[sf_index(x_storage, x_sf, t, (H + ((s * U + k) * WARP
                                                                                              + lane) * V) // x_group)])
                        else:
                            for j in T.vectorized(V):
                                dr[k, j] = T.cast(0, out_dtype)
                            if quantized:
                                sx[k, 0] = T.float32(0)
                                sx[k, 1] = T.float32(0)
                    for k in T.unroll(U):
                        for j in T.unroll(V):
                            v[0] = T.cast(gr[k, j], f32)
                            v[1] = T.cast(ur[k, j], f32)
                            if quantized:  # cast_back's value, one IEEE product
                                v[0] = T.ieee_mul(v[0], sx[k, 0])
                                v[1] = T.ieee_mul(v[1], sx[k, 1])
                            v[2] = T.cast(dr[k, j], f32)
                            v[7] = T.float32(1)  # 1 where the gate is not clamped
                            v[6] = T.float32(1)  # 1 where up is not clamped
                            if clamped:
                                v[7] = T.if_then_else(v[0] > clamp, T.float32(0), T.float32(1))
                                v[6] = T.if_then_else(v[1] > clamp, T.float32(0),
                                                      T.if_then_else(v[1] < -clamp, T.float32(0), T.float32(1)))
                                v[0] = T.min(v[0], clamp)
                                v[1] = T.max(T.min(v[1], clamp), -clamp)
                            v[3] = T.ieee_add(T.float32(1), T.exp(-v[0]))
                            v[4] = T.ieee_fdiv(T.float32(1), v[3])
                            v[5] = T.ieee_mul(T.ieee_mul(v[2], w[0]) if weighted else v[2], v[4])
                            ggr[k, j] = T.cast(T.if_then_else(
                                v[7] != T.float32(0),
                                T.ieee_mul(T.ieee_mul(v[5], v[1]),
                                           T.ieee_fmaf(v[0], T.ieee_sub(T.float32(1), v[4]), T.float32(1))),
                                T.float32(0)), out_dtype)
                            gur[k, j] = T.cast(T.if_then_else(v[6] != T.float32(0), T.ieee_mul(v[5], v[0]),
                                                              T.float32(0)), out_dtype)
                            if weighted or recompute:
                                v[6] = T.ieee_mul(T.ieee_fdiv(v[0], v[3]), v[1])  # act = silu(g) * u
                                if weighted:
                                    acc[0] = acc[0] + T.ieee_mul(v[2], v[6])
                                if recompute:
                                    if weighted:
                                        v[6] = T.ieee_mul(v[6], w[0])
                                    yr[k, j] = T.cast(v[6], out_dtype)
                        if (s * U + k) * WARP + lane < nvec:
                            for j in T.vectorized(V):
                                grad_x[t, ((s * U + k) * WARP + lane) * V + j] = ggr[k, j]
                            for j in T.vectorized(V):
                                grad_x[t, H + ((s * U + k) * WARP + lane) * V + j] = gur[k, j]
                            if recompute:
                                for j in T.vectorized(V):
                                    y[t, ((s * U + k) * WARP + lane) * V + j] = yr[k, j]
                        if cast:
                            cast_vector(ggr, k, data, sf_out, t, (s * U + k) * WARP + lane, 0,
                                        (s * U + k) * WARP + lane < nvec, yv, amax, scale)
                            cast_vector(gur, k, data, sf_out, t, (s * U + k) * WARP + lane, H,
                                        (s * U + k) * WARP + lane < nvec, yv, amax, scale)
                if weighted:
                    for b in T.unroll(5):
                        acc[0] = acc[0] + T.shfl_xor(acc[0], 1 << b)
                    if lane == 0:
                        grad_routing_weight[t] = T.if_then_else(ok[0] != 0, acc[0] * routed_scaling_factor,
                                                                T.float32(0))

    x_param = T.StridedTensor((num_tokens, 2 * H), (x_stride, 1), x_dtype)
    gy_param = T.StridedTensor((num_tokens, H), (gy_stride, 1), out_dtype)
    gx_param, y_param = T.Tensor((num_tokens, 2 * H), out_dtype), T.Tensor((n_y, H), out_dtype)
    # one buffer object per parameter: a shared one makes TileLang take two parameters for one buffer
    w_param, v_param, gw_param = T.Tensor((n_w,), f32), T.Tensor((n_v,), i32), T.Tensor((n_w,), f32)
    if quantized:
        xs_param = sf_param(T, x_storage, x_sf, 2 * H // x_group, num_tokens, "x_sf_stride")
        if cast:
            @T.prim_func
            def swiglu_backward_quantized_cast_cuda(x: x_param, x_sf: xs_param, grad_y: gy_param, grad_x: gx_param,
                                                    y: y_param, routing_weight: w_param, valid: v_param,
                                                    grad_routing_weight: gw_param, data: data_param, sf_out: sf_arg,
                                                    routed_scaling_factor: f32, clamp: f32):
                body(x, x_sf, grad_y, grad_x, y, routing_weight, valid, grad_routing_weight, data, sf_out,
                     routed_scaling_factor, clamp)
            return swiglu_backward_quantized_cast_cuda

        @T.prim_func
        def swiglu_backward_quantized_cuda(x: x_param, x_sf: xs_param, grad_y: gy_param, grad_x: gx_param,
                                           y: y_param, routing_weight: w_param, valid: v_param,
                                           grad_routing_weight: gw_param, routed_scaling_factor: f32, clamp: f32):
            body(x, x_sf, grad_y, grad_x, y, routing_weight, valid, grad_routing_weight, None, None,
                 routed_scaling_factor, clamp)
        return swiglu_backward_quantized_cuda
    if cast:
        @T.prim_func
        def swiglu_backward_cast_cuda(x: x_param, grad_y: gy_param, grad_x: gx_param, y: y_param,
                                      routing_weight: w_param, valid: v_param, grad_routing_weight: gw_param,
                                      data: data_param, sf_out: sf_arg, routed_scaling_factor: f32, clamp: f32):
            body(x, None, grad_y, grad_x, y, routing_weight, valid, grad_routing_weight, data, sf_out,
                 routed_scaling_factor, clamp)
        return swiglu_backward_cast_cuda

    @T.prim_func
    def swiglu_backward_cuda(x: x_param, grad_y: gy_param, grad_x: gx_param, y: y_param, routing_weight: w_param,
                             valid: v_param, grad_routing_weight: gw_param, routed_scaling_factor: f32, clamp: f32):
        body(x, None, grad_y, grad_x, y, routing_weight, valid, grad_routing_weight, None, None,
             routed_scaling_factor, clamp)
    return swiglu_backward_cuda


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with every option (weight, clamp and counters, expert rows) and plain fp32."""
    del hc_mult
    cases = {"swiglu_forward_bf16_all": ForwardKey(hidden_size, "bfloat16", True, True, True, True),
             "swiglu_forward_f32": ForwardKey(hidden_size, "float32", False, False, False, False)}
    # the fused cast: SM90 DeepGEMM's e4m3 1x128 fp32 scales (with y), SM100's UE8M0 col_tma and MXFP4 (the cast
    # alone), at the sizes whose groups divide H
    for name, spec, dtype, with_y in (("e4m3_fp32_row", "1x128/e4m3/fp32/row/exact", "bfloat16", True),
                                      ("e4m3_ue8m0_col", "1x128/e4m3/ue8m0/col_tma/round", "float32", False),
                                      ("e2m1_ue8m0_g32", "1x32/e2m1/ue8m0/row/round", "bfloat16", False)):
        layout = ScaleLayout.parse(spec)
        if hidden_size % layout.block[1] == 0:
            cases[f"swiglu_forward_cast_{name}"] = ForwardKey(hidden_size, dtype, True, True, False, False,
                                                              layout.block[1], layout.fmt, layout.sf,
                                                              layout.storage, layout.round_sf, with_y)
    return cases


def _backward_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with every option, a quantized x (UE8M0 col_tma scales) with bf16 gradients, plain fp32."""
    del hc_mult
    return {"swiglu_backward_bf16_all": BackwardKey(hidden_size, "bfloat16", "bfloat16", True, True, True, True),
            "swiglu_backward_quantized": BackwardKey(hidden_size, "e4m3", "bfloat16", True, False, False, False,
                                                     x_group=64, x_sf="ue8m0", x_storage="col_tma"),
            "swiglu_backward_f32": BackwardKey(hidden_size, "float32", "float32", False, False, False, False),
            # the fused cast of grad_x: UE8M0 1x64 (groups dividing every H), and the peer's FP8 path (a dequantized
            # x, e4m3 1x128 fp32 scales) where 128 divides H
            "swiglu_backward_cast_ue8m0_g64": BackwardKey(hidden_size, "bfloat16", "bfloat16", True, True, True, False,
                                                          64, "e4m3", "ue8m0", "row", True),
            **({"swiglu_backward_cast_quantized": BackwardKey(hidden_size, "e4m3", "bfloat16", True, True, False,
                                                              False, 128, "e4m3", "fp32", "row", False, 128, "fp32",
                                                              "row")}
               if hidden_size % 128 == 0 else {})}


FORWARD = Kernel("swiglu_forward", ForwardKey, build_swiglu_forward, cases=_forward_cases, derive=forward_key)
BACKWARD = Kernel("swiglu_backward", BackwardKey, build_swiglu_backward, cases=_backward_cases, derive=backward_key)


def _optional(t, like: torch.Tensor, dtype) -> torch.Tensor:
    return t if t is not None else like.new_empty((0,), dtype=dtype)


def row_flags(expert_offsets, tokens: int, alignment: int, like: torch.Tensor) -> torch.Tensor:
    """The kernels' ``valid`` argument: the expert rows' flags, or an empty tensor without segments."""
    if expert_offsets is None:
        return like.new_empty((0,), dtype=torch.int32)
    return swiglu_op.expert_rows(expert_offsets, tokens, alignment)


def swiglu_forward(x, routing_weight, routed_scaling_factor, clamp, clamped_count, expert_offsets, alignment, layout,
                   with_y, y, data, sf) -> None:
    """Launches the forward (``T > 0``): writes ``y`` (unless the cast alone is asked for), the fused cast into
    ``data`` / ``sf``, and adds the row counters to ``clamped_count``."""
    hidden = x.shape[-1] // 2
    x2 = rows(x)
    tokens = x2.shape[0]
    if tokens == 0:  # leading dims with a zero (the op layer skips only a zero first dim)
        return
    y2 = y.view(tokens, hidden) if y.numel() else x.new_empty((0, hidden))
    counts = x.new_empty((tokens if clamped_count is not None else 0, COUNTERS), dtype=torch.int32)
    key = FORWARD.key(x, routing_weight, clamp, clamped_count, expert_offsets, layout, with_y)
    args = [x2, y2, _optional(routing_weight, x, torch.float32), row_flags(expert_offsets, tokens, alignment, x),
            counts]
    if layout is not None:  # the cast fused
        args += [data, sf_view(sf, key.storage, key.sf)]
    FORWARD.compiled(key)(*args, float(routed_scaling_factor), float(clamp or 0.0))
    if clamped_count is not None:
        clamped_count += counts.sum(0, dtype=torch.int64)


def swiglu_backward(grad_y, x, routing_weight, routed_scaling_factor, clamp, expert_offsets, alignment, recompute,
                    x_sf, x_layout, layout, grad_x, grad_routing_weight, y, data, sf) -> None:
    """Launches the backward (``T > 0``): ``grad_x``, ``grad_routing_weight``, ``y`` and the fused cast of
    ``grad_x``'s rows into ``data`` / ``sf``; a quantized ``x`` is dequantized in the kernel."""
    hidden = grad_y.shape[-1]
    if grad_y.numel() == 0:  # leading dims with a zero (the op layer skips only a zero first dim)
        return
    x2 = x if x_sf is not None else rows(x)  # a quantized x: its data, dequantized in the kernel
    tokens = x2.shape[0]
    gy2 = rows(grad_y)
    gx2 = grad_x.view(tokens, 2 * hidden)
    y2 = y.view(tokens, hidden) if recompute else grad_y.new_empty((0, hidden))
    key = BACKWARD.key(x2, grad_y, routing_weight, clamp, expert_offsets, recompute, layout, x_layout)
    args = [x2] + ([sf_view(x_sf, key.x_storage, key.x_sf)] if x_sf is not None else [])
    args += [gy2, gx2, y2, _optional(routing_weight, x2, torch.float32),
             row_flags(expert_offsets, tokens, alignment, x2), grad_routing_weight]
    if layout is not None:  # the cast fused
        args += [data, sf_view(sf, key.storage, key.sf)]
    BACKWARD.compiled(key)(*args, float(routed_scaling_factor), float(clamp or 0.0))


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
