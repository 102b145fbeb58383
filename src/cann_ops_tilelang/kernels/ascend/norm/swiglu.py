"""Ascend 950 kernels of ``swiglu_forward`` / ``swiglu_backward`` (docs/ops/norm.md#swiglu).

Scheme: a persistent loop over (token, hidden tile) tasks, multi-buffered UB tiles (the loads of the next task and
the stores of the previous one overlap this one's vector work), the hidden tile the widest divisor of ``H`` (a
multiple of 64) whose tiles fit the UB: the whole row up to H = 16384 (bf16 forward). Per task the gate, up (and
``grad_y``) tiles are loaded, widened to fp32 64 lanes at a time, and each result is rounded once at the store.

Math, the CUDA kernels' order: ``e = 1 + exp(0 - g)`` (``vexpdif``), ``y = ((g / e) * u) * w``,
``w = fl(routing_weight * routed_scaling_factor)`` (broadcast), backward ``s = 1 / e``, ``d = (dy * w) * s``,
``grad_g = (d * u) * fma(g, 1 - s, 1)`` (``vmula``), ``grad_u = d * g``, selected to zero where the clamp clamped
(``g > c``, ``|u| > c``). Padding rows (a 0 in ``valid``, fp32 row flags) are loaded, but their inputs are
selected to zero and their weight to 1: +0 results and no counts, whatever the rows hold.

Per-row sums: each task writes one 8-fp32 partial row ``[sum dy * act, #g > c, #u > c, #u < -c, ...]`` (64-lane
partials reduced with ``vcadd``; the counts are exact in fp32); the launcher adds a row's partials over its hidden
tiles in ascending order (one tile up to H = 16384) and the counts over the rows as int64. No atomics.

The cast (``layout``) is the quant family's ``per_token_cast`` op on the rounded result, not yet fused, and a
quantized ``x`` is dequantized by the ``cast_back`` op to fp32 first, as on CUDA.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
import torch
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....norm import swiglu as swiglu_op
from ....norm._common import rows
from ....policy import ASCEND_CASE_CORES
from ....quant import cast_back
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores

LANES = 64  # fp32 lanes of one 256-byte vector register
# UB kept free of the tile formula's count (buffer alignment in the merged UB pool, the small per-row buffers)
SLACK = 8 * 1024
PARTIAL = 8  # fp32 slots of a task's partial row (one 32-byte DMA block)
DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """``stages`` UB versions of every row tile (load / compute / store overlap)."""

    stages: int


# two stages: the widest hidden tile (the whole row at the model sizes) with load and store overlapped.
# Not measured yet: no Ascend 950 here (docs/perf/ascend950/norm.md to come).
STREAM_PLAN = StreamPlan(stages=2)


@compile_key
class ForwardKey:
    """Compile-time key of the forward: ``H``, ``x``'s dtype, the options that change code and the vector cores of
    the persistent grid (never ``T``)."""

    hidden: int
    in_dtype: str
    weighted: bool
    clamped: bool
    counted: bool
    masked: bool
    num_cores: int


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``H``, the dtypes of ``x`` (fp32 when dequantized) and of the gradients,
    the options that change code and the vector cores."""

    hidden: int
    in_dtype: str
    out_dtype: str
    weighted: bool
    clamped: bool
    masked: bool
    recompute: bool
    num_cores: int


def _dtype(where: str, name: str) -> str:
    if name not in ELEMENT_BYTES:
        raise limits.LimitError(f"{where}: the dtype must be bfloat16 or float32, got {name}")
    return name


def hidden_tile(where: str, hidden: int, bytes_per_column: int) -> int:
    """The widest divisor of ``H`` (a multiple of 64) whose multi-buffered tiles fit the UB budget."""
    H = limits.NORM_HIDDEN.require(where, int(hidden))
    budget = _build.UB_BUDGET_BYTES - SLACK
    for hk in range(H, 0, -LANES):
        if H % hk == 0 and STREAM_PLAN.stages * bytes_per_column * hk <= budget:
            return hk
    raise limits.LimitError(f"{where}: no hidden tile fits the UB at H = {H}")


def forward_tile(hidden: int, in_dtype: str) -> int:
    """Gate, up and y tiles of ``x``'s dtype."""
    return hidden_tile("swiglu_forward", hidden, 3 * ELEMENT_BYTES[_dtype("swiglu_forward", in_dtype)])


def backward_tile(hidden: int, in_dtype: str, out_dtype: str, recompute: bool) -> int:
    """Gate and up tiles of ``x``'s dtype; grad_y, grad_g, grad_u (and y) tiles of the gradients' dtype."""
    ein = ELEMENT_BYTES[_dtype("swiglu_backward", in_dtype)]
    eout = ELEMENT_BYTES[_dtype("swiglu_backward", out_dtype)]
    return hidden_tile("swiglu_backward", hidden, 2 * ein + (4 if recompute else 3) * eout)


def _widen(ref, dtype: str):
    """64 fp32 lanes of a bf16 / fp32 UB tile at ``ref``."""
    if dtype == "bfloat16":
        return S.vcvt(S.vld(ref, dist="UNPK_B16"), T.float32, part=0)
    return S.vld(ref)


def _narrow(value, dtype: str):
    """64 fp32 lanes rounded to a tile's dtype (bf16 stored with ``dist=PK_B32``: :func:`_dist`)."""
    return S.vcvt(value, T.bfloat16) if dtype == "bfloat16" else value


def _dist(dtype: str) -> str:
    return "PK_B32" if dtype == "bfloat16" else "NORM_B32"


def row_loaders(weighted: bool, masked: bool):
    """``(row_inputs, row_factors)``: a ``T.macro`` ``(routing_weight, valid, w_ub, v_ub, t)`` copying row ``t``'s
    weight and flag into the UB (where the key has them), and ``row_factors(w_ub, v_ub, one, f)`` returning the
    broadcast ``fl(weight * f)`` (None without a weight) and the row's live-lane mask (None without segments): a
    padding row computes on zeros with ``w = 1``, giving +0 results and no counts."""

    @T.macro
    def row_inputs(routing_weight, valid, w_ub, v_ub, t):
        if weighted:
            T.copy(routing_weight[t : t + 1], w_ub[:1])
        if masked:
            T.copy(valid[t : t + 1], v_ub[:1])

    def row_factors(w_ub, v_ub, one, factor):
        w = S.vmuls(S.vld(w_ub[0], dist="BRC_B32"), factor) if weighted else None
        live = S.vcmps(S.vld(v_ub[0], dist="BRC_B32"), 0.0, op="gt") if masked else None
        if weighted and masked:
            w = S.vsel(w, one, live)
        return w, live

    return row_inputs, row_factors


def build_swiglu_forward(hidden: int, in_dtype: str, weighted: bool, clamped: bool, counted: bool, masked: bool,
                         num_cores: int):
    """prim_func ``(x (T, 2H) strided, y (T, H), routing_weight (n_w,), valid (n_v,) int32, partials (n_p, tiles,
    8) fp32, routed_scaling_factor, clamp)``; the optional tensors are touched only where the key says so."""
    H = limits.NORM_HIDDEN.require("swiglu_forward", int(hidden))
    limits.IntRange("num_cores", 1).require("swiglu_forward", int(num_cores))
    hk = forward_tile(H, in_dtype)
    n_tiles, n_chunks, stages = H // hk, hk // LANES, STREAM_PLAN.stages
    num_tokens, x_stride = T.dynamic("num_tokens"), T.dynamic("x_stride")
    n_w, n_v, n_p = T.dynamic("n_w"), T.dynamic("n_v"), T.dynamic("n_p")
    f32 = T.float32
    row_inputs, row_factors = row_loaders(weighted, masked)

    @T.prim_func
    def swiglu_forward_asc(x: T.StridedTensor[(num_tokens, 2 * H), (x_stride, 1), in_dtype],
                           y: T.Tensor[(num_tokens, H), in_dtype], routing_weight: T.Tensor[(n_w,), f32],
                           valid: T.Tensor[(n_v,), f32], partials: T.Tensor[(n_p, n_tiles, PARTIAL), f32],
                           routed_scaling_factor: f32, clamp: f32):
        with T.Kernel(num_cores) as core_id:
            g_ub = T.alloc_shared((hk,), in_dtype)
            u_ub = T.alloc_shared((hk,), in_dtype)
            y_ub = T.alloc_shared((hk,), in_dtype)
            w_ub = T.alloc_shared((PARTIAL,), f32)
            v_ub = T.alloc_shared((PARTIAL,), f32)
            p_ub = T.alloc_shared((PARTIAL,), f32)
            versions = {g_ub: stages, u_ub: stages, y_ub: stages}
            # the row's weight and flag too: the next task's copies must not overwrite what this one reads
            for buffer, used in ((p_ub, counted), (w_ub, weighted), (v_ub, masked)):
                if used:
                    versions[buffer] = stages
            T.annotate_buffer_versions(versions)
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * hk
                T.copy(x[t, h0 : h0 + hk], g_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                T.copy(x[t, H + h0 : H + h0 + hk], u_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                row_inputs(routing_weight, valid, w_ub, v_ub, t)
                with T.SimdVF():
                    zero = S.vdup(0.0, f32)
                    one = S.vdup(1.0, f32)
                    w = S.alloc_local((1,), f32)
                    wv, live = row_factors(w_ub, v_ub, one, routed_scaling_factor)
                    if weighted:
                        w[0] = wv
                    cnt = S.alloc_local((3,), f32)
                    for i in T.unroll(3, explicit=True):
                        cnt[i] = zero
                    for c in T.serial(n_chunks):
                        d = c * LANES
                        g = _widen(g_ub[d], in_dtype)
                        u = _widen(u_ub[d], in_dtype)
                        if masked:
                            g = S.vsel(g, zero, live)
                            u = S.vsel(u, zero, live)
                        if counted:
                            cnt[0] = S.vadd(cnt[0], S.vsel(one, zero, S.vcmps(g, clamp, op="gt")))
                            cnt[1] = S.vadd(cnt[1], S.vsel(one, zero, S.vcmps(u, clamp, op="gt")))
                            cnt[2] = S.vadd(cnt[2], S.vsel(one, zero, S.vcmps(u, -clamp, op="lt")))
                        if clamped:
                            g = S.vmins(g, clamp)
                            u = S.vmaxs(S.vmins(u, clamp), -clamp)
                        act = S.vmul(S.vdiv(g, S.vadds(S.vexpdif(zero, g), 1.0)), u)
                        if weighted:
                            act = S.vmul(act, w[0])
                        S.vsts(y_ub[d], _narrow(act, in_dtype), dist=_dist(in_dtype))
                    if counted:
                        for i in T.unroll(3, explicit=True):
                            S.vsts(p_ub[1 + i], S.vcadd(cnt[i]), dist="ONEPT_B32")
                T.copy(y_ub, y[t, h0 : h0 + hk])
                if counted:
                    T.copy(p_ub, partials[t, ht, :])

    return swiglu_forward_asc


def build_swiglu_backward(hidden: int, in_dtype: str, out_dtype: str, weighted: bool, clamped: bool, masked: bool,
                          recompute: bool, num_cores: int):
    """prim_func ``(x (T, 2H) strided, grad_y (T, H) strided, grad_x (T, 2H), y (n_y, H), routing_weight (n_w,),
    valid (n_v,) int32, partials (n_p, tiles, 8) fp32, routed_scaling_factor, clamp)``."""
    H = limits.NORM_HIDDEN.require("swiglu_backward", int(hidden))
    limits.IntRange("num_cores", 1).require("swiglu_backward", int(num_cores))
    hk = backward_tile(H, in_dtype, out_dtype, recompute)
    n_tiles, n_chunks, stages = H // hk, hk // LANES, STREAM_PLAN.stages
    num_tokens, x_stride, gy_stride = T.dynamic("num_tokens"), T.dynamic("x_stride"), T.dynamic("grad_y_stride")
    n_y, n_w, n_v, n_p = T.dynamic("n_y"), T.dynamic("n_w"), T.dynamic("n_v"), T.dynamic("n_p")
    f32 = T.float32
    row_inputs, row_factors = row_loaders(weighted, masked)

    @T.prim_func
    def swiglu_backward_asc(x: T.StridedTensor[(num_tokens, 2 * H), (x_stride, 1), in_dtype],
                            grad_y: T.StridedTensor[(num_tokens, H), (gy_stride, 1), out_dtype],
                            grad_x: T.Tensor[(num_tokens, 2 * H), out_dtype], y: T.Tensor[(n_y, H), out_dtype],
                            routing_weight: T.Tensor[(n_w,), f32], valid: T.Tensor[(n_v,), f32],
                            partials: T.Tensor[(n_p, n_tiles, PARTIAL), f32], routed_scaling_factor: f32,
                            clamp: f32):
        with T.Kernel(num_cores) as core_id:
            g_ub = T.alloc_shared((hk,), in_dtype)
            u_ub = T.alloc_shared((hk,), in_dtype)
            dy_ub = T.alloc_shared((hk,), out_dtype)
            gg_ub = T.alloc_shared((hk,), out_dtype)
            gu_ub = T.alloc_shared((hk,), out_dtype)
            y_ub = T.alloc_shared((hk if recompute else LANES,), out_dtype)
            w_ub = T.alloc_shared((PARTIAL,), f32)
            v_ub = T.alloc_shared((PARTIAL,), f32)
            p_ub = T.alloc_shared((PARTIAL,), f32)
            versions = {g_ub: stages, u_ub: stages, dy_ub: stages, gg_ub: stages, gu_ub: stages}
            for buffer, used in ((y_ub, recompute), (p_ub, weighted), (w_ub, weighted), (v_ub, masked)):
                if used:
                    versions[buffer] = stages
            T.annotate_buffer_versions(versions)
            for t, ht in T.Persistent([num_tokens, n_tiles], num_cores, core_id, group_size=1, num_stages=stages):
                h0 = ht * hk
                T.copy(x[t, h0 : h0 + hk], g_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                T.copy(x[t, H + h0 : H + h0 + hk], u_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                T.copy(grad_y[t, h0 : h0 + hk], dy_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                row_inputs(routing_weight, valid, w_ub, v_ub, t)
                with T.SimdVF():
                    zero = S.vdup(0.0, f32)
                    one = S.vdup(1.0, f32)
                    w = S.alloc_local((1,), f32)
                    wv, live = row_factors(w_ub, v_ub, one, routed_scaling_factor)
                    if weighted:
                        w[0] = wv
                    acc = S.alloc_local((1,), f32)
                    acc[0] = zero
                    f = S.alloc_local((1,), f32)
                    for c in T.serial(n_chunks):
                        d = c * LANES
                        g0 = _widen(g_ub[d], in_dtype)
                        u0 = _widen(u_ub[d], in_dtype)
                        dy = _widen(dy_ub[d], out_dtype)
                        if masked:
                            g0 = S.vsel(g0, zero, live)
                            u0 = S.vsel(u0, zero, live)
                            dy = S.vsel(dy, zero, live)
                        g = g0
                        u = u0
                        if clamped:
                            g = S.vmins(g0, clamp)
                            u = S.vmaxs(S.vmins(u0, clamp), -clamp)
                        e = S.vadds(S.vexpdif(zero, g), 1.0)
                        s = S.vdiv(one, e)
                        dd = S.vmul(S.vmul(dy, w[0]) if weighted else dy, s)
                        f[0] = one
                        S.vmula(f[0], g, S.vsub(one, s))  # fma(g, 1 - s, 1)
                        gg = S.vmul(S.vmul(dd, u), f[0])
                        gu = S.vmul(dd, g)
                        if clamped:
                            gg = S.vsel(zero, gg, S.vcmps(g0, clamp, op="gt"))
                            gu = S.vsel(zero, gu, S.vcmps(S.vabs(u0), clamp, op="gt"))
                        S.vsts(gg_ub[d], _narrow(gg, out_dtype), dist=_dist(out_dtype))
                        S.vsts(gu_ub[d], _narrow(gu, out_dtype), dist=_dist(out_dtype))
                        if weighted or recompute:
                            act = S.vmul(S.vdiv(g, e), u)
                            if weighted:
                                S.vmula(acc[0], dy, act)
                            if recompute:
                                yv = S.vmul(act, w[0]) if weighted else act
                                S.vsts(y_ub[d], _narrow(yv, out_dtype), dist=_dist(out_dtype))
                    if weighted:
                        S.vsts(p_ub[0], S.vcadd(acc[0]), dist="ONEPT_B32")
                T.copy(gg_ub, grad_x[t, h0 : h0 + hk])
                T.copy(gu_ub, grad_x[t, H + h0 : H + h0 + hk])
                if recompute:
                    T.copy(y_ub, y[t, h0 : h0 + hk])
                if weighted:
                    T.copy(p_ub, partials[t, ht, :])

    return swiglu_backward_asc


def forward_key(x, routing_weight, clamp, clamped_count, expert_offsets, num_cores) -> ForwardKey:
    return ForwardKey(hidden=limits.NORM_HIDDEN.require("swiglu_forward", x.shape[-1] // 2),
                      in_dtype=_dtype("swiglu_forward", DTYPES.get(x.dtype, str(x.dtype))),
                      weighted=routing_weight is not None, clamped=clamp is not None,
                      counted=clamped_count is not None, masked=expert_offsets is not None, num_cores=num_cores)


def backward_key(x2, grad_y, routing_weight, clamp, expert_offsets, recompute, num_cores) -> BackwardKey:
    return BackwardKey(hidden=limits.NORM_HIDDEN.require("swiglu_backward", x2.shape[-1] // 2),
                       in_dtype=_dtype("swiglu_backward", DTYPES.get(x2.dtype, str(x2.dtype))),
                       out_dtype=_dtype("swiglu_backward", DTYPES.get(grad_y.dtype, str(grad_y.dtype))),
                       weighted=routing_weight is not None, clamped=clamp is not None,
                       masked=expert_offsets is not None, recompute=bool(recompute), num_cores=num_cores)


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with every option (weight, clamp and counters, expert rows) and plain fp32."""
    del hc_mult
    return {"swiglu_forward_bf16_all": ForwardKey(hidden_size, "bfloat16", True, True, True, True, ASCEND_CASE_CORES),
            "swiglu_forward_f32": ForwardKey(hidden_size, "float32", False, False, False, False, ASCEND_CASE_CORES)}


def _backward_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with every option, a dequantized (fp32) x with bf16 gradients, plain fp32."""
    del hc_mult
    cores = ASCEND_CASE_CORES
    return {"swiglu_backward_bf16_all": BackwardKey(hidden_size, "bfloat16", "bfloat16", True, True, True, True,
                                                    cores),
            "swiglu_backward_quantized": BackwardKey(hidden_size, "float32", "bfloat16", True, False, False, False,
                                                     cores),
            "swiglu_backward_f32": BackwardKey(hidden_size, "float32", "float32", False, False, False, False, cores)}


FORWARD = Kernel("swiglu_forward", ForwardKey, build_swiglu_forward, cases=_forward_cases,
                 derive=lambda *args: forward_key(*args, num_vector_cores()))
BACKWARD = Kernel("swiglu_backward", BackwardKey, build_swiglu_backward, cases=_backward_cases,
                  derive=lambda *args: backward_key(*args, num_vector_cores()))


def _row_flags(expert_offsets, tokens: int, alignment: int, like: torch.Tensor) -> torch.Tensor:
    """The kernels' ``valid`` argument (fp32 flags, compared as the vectors' lanes), or an empty tensor."""
    if expert_offsets is None:
        return like.new_empty((0,), dtype=torch.float32)
    return swiglu_op.expert_rows(expert_offsets, tokens, alignment).float()


def swiglu_forward(x, routing_weight, routed_scaling_factor, clamp, clamped_count, expert_offsets, alignment, layout,
                   with_y, y, data, sf) -> None:
    """Launches the forward (``T > 0``): writes ``y`` (a scratch row buffer when the cast alone is asked for), adds
    the counters to ``clamped_count`` (int64 sums of the tasks' exact counts), then casts ``y``'s rows."""
    hidden = x.shape[-1] // 2
    x2 = rows(x)
    tokens = x2.shape[0]
    if tokens == 0:  # leading dims with a zero (the op layer skips only a zero first dim)
        return
    y2 = y.view(tokens, hidden) if y.numel() else x.new_empty((tokens, hidden))
    key = FORWARD.key(x, routing_weight, clamp, clamped_count, expert_offsets)
    n_tiles = hidden // forward_tile(hidden, key.in_dtype)
    partials = x.new_empty((tokens if clamped_count is not None else 0, n_tiles, PARTIAL), dtype=torch.float32)
    valid = _row_flags(expert_offsets, tokens, alignment, x)
    weight = routing_weight if routing_weight is not None else x.new_empty((0,), dtype=torch.float32)
    FORWARD.compiled(key)(x2, y2, weight, valid, partials, float(routed_scaling_factor), float(clamp or 0.0))
    if clamped_count is not None:
        counted = valid.to(torch.int64).sum() if expert_offsets is not None else x.new_tensor(tokens, dtype=torch.int64)
        clamped_count += torch.cat([partials[:, :, 1:4].to(torch.int64).sum((0, 1)), (counted * hidden).reshape(1)])
    if layout is not None:
        swiglu_op.cast_into(y2, layout, data, sf)


def swiglu_backward(grad_y, x, routing_weight, routed_scaling_factor, clamp, expert_offsets, alignment, recompute,
                    x_sf, x_layout, layout, grad_x, grad_routing_weight, y, data, sf) -> None:
    """Launches the backward (``T > 0``): a quantized ``x`` dequantized to fp32 rows first, then ``grad_x``, ``y``
    and the partials of ``grad_routing_weight`` (summed over the hidden tiles ascending, times the factor), then
    the cast of ``grad_x``'s rows."""
    hidden = grad_y.shape[-1]
    if grad_y.numel() == 0:  # leading dims with a zero (the op layer skips only a zero first dim)
        return
    if x_sf is not None:
        x2 = cast_back(x, x_sf, x_layout, torch.float32)
    else:
        x2 = rows(x)
    tokens = x2.shape[0]
    gx2 = grad_x.view(tokens, 2 * hidden)
    y2 = y.view(tokens, hidden) if recompute else grad_y.new_empty((0, hidden))
    key = BACKWARD.key(x2, grad_y, routing_weight, clamp, expert_offsets, recompute)
    n_tiles = hidden // backward_tile(hidden, key.in_dtype, key.out_dtype, key.recompute)
    partials = x2.new_empty((tokens if routing_weight is not None else 0, n_tiles, PARTIAL), dtype=torch.float32)
    weight = routing_weight if routing_weight is not None else x2.new_empty((0,), dtype=torch.float32)
    BACKWARD.compiled(key)(x2, rows(grad_y), gx2, y2, weight, _row_flags(expert_offsets, tokens, alignment, x2),
                           partials, float(routed_scaling_factor), float(clamp or 0.0))
    if routing_weight is not None:
        total = partials[:, 0, 0]
        for tile in range(1, n_tiles):
            total = total + partials[:, tile, 0]
        torch.mul(total, float(routed_scaling_factor), out=grad_routing_weight)
    if layout is not None:
        swiglu_op.cast_into(gx2, layout, data, sf)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD)
