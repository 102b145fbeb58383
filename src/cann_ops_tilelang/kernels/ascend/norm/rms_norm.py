"""Ascend 950 kernels of ``rms_norm_forward`` / ``rms_norm_backward`` (docs/ops/norm.md#rms_norm).

A persistent loop over tokens; a row is ``n_tiles`` hidden tiles of ``hk`` channels (the whole row where it fits
the UB, else the widest divisor of ``H`` that does), bf16 widened exactly to fp32 64 lanes at a time (``UNPK_B16``),
each result rounded once at its store (``PK_B32``). Row sums: a 64-lane ``vmula`` chain over the row's vectors,
``vcadd`` to one value, broadcast (``vdupv``); ``rstd = 1 / sqrt(ss * fl(1 / H) + eps)`` (correctly rounded
``vdiv``), the Ascend form of the contract's ``rsqrt(ss / H + eps)``.

Forward: pass 1 adds ``r = dtype(x + residual)`` (stored as ``residual_out``, read back widened) and sums ``r^2``;
pass 2 writes ``y = dtype(fl(fl(r * rstd) * fl(w * out_scale)))``. A one-tile row stays in the UB between the
passes; a longer row is read again in pass 2 (``r`` recomputed by the same instructions, the same bits). The fused
cast is not fused here: the launcher casts ``y`` with ``per_token_cast`` (Ascend bytes, bitwise that op).

Backward: ``P`` token partitions (``policy.NORM_GRAD_WEIGHT_PARTITIONS``), core ``c`` taking partitions ``c, c +
cores, ...``; partition ``p`` owns the tokens ``[p ceil(T / P), ...)`` in order, its weight gradient accumulated in
a UB row and written as the partial row ``p``; a second kernel adds the partial rows in ascending order into
``grad_weight`` (columns split over the cores).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
import torch
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....norm._common import present, rows, rows_of
from ....policy import ASCEND_CASE_CORES, NORM_GRAD_WEIGHT_PARTITIONS
from ..._kernel import Kernel, compile_key, kernel_module, variant_prim_func
from .. import _build, num_vector_cores

LANES = 64  # fp32 lanes of one 256-byte vector register
SLACK = 8 * 1024  # UB for the small buffers and the 32-byte alignment of the buffer versions
IN_DTYPES = {"bfloat16": 2, "float32": 4}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclasses.dataclass(frozen=True)
class NormPlan:
    """``stages`` UB versions of a one-tile row's buffers (loads of the next token and stores of the previous one
    overlap this one's vector work); a multi-tile row runs one version."""

    stages: int


# Two versions (the whole row to H = 8192 in bf16 forward); not measured yet: no Ascend 950 here
# (docs/perf/ascend950/norm.md will hold the measurement).
PLAN = NormPlan(stages=2)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """``hk`` channels a tile, ``n_tiles`` tiles a row, ``stages`` versions of the tiles."""

    hk: int
    n_tiles: int
    stages: int


def tiling(hidden: int, bytes_per_column: int, fixed: int = 0) -> Tiling:
    """The whole row in ``PLAN.stages`` versions where it fits the UB with ``fixed`` bytes more, else the widest
    divisor of ``H`` (a multiple of 64) that fits in one version."""
    budget = _build.UB_BUDGET_BYTES - SLACK - fixed
    if PLAN.stages * bytes_per_column * hidden <= budget:
        return Tiling(hidden, 1, PLAN.stages)
    for hk in range(hidden - LANES, 0, -LANES):
        if hidden % hk == 0 and bytes_per_column * hk <= budget:
            return Tiling(hk, hidden // hk, 1)
    raise limits.LimitError(f"rms_norm: no hidden tile of {bytes_per_column} bytes a column fits the UB at H={hidden}")


def forward_tiling(hidden: int, in_dtype: str, weight: bool, residual: bool) -> Tiling:
    """x, y, the weight and with a residual the residual and residual_out tiles, in x's dtype."""
    return tiling(hidden, IN_DTYPES[in_dtype] * (2 + int(weight) + 2 * int(residual)))


def backward_tiling(hidden: int, in_dtype: str, weight: bool, grad_weight: bool, grad_residual_out: bool) -> Tiling:
    """grad_y, x, grad_x, the weight and grad_residual_out tiles; the fp32 weight-gradient row (whole) besides."""
    per_column = IN_DTYPES[in_dtype] * (3 + int(weight) + int(grad_residual_out))
    return tiling(hidden, per_column, 4 * hidden if grad_weight else 0)


@compile_key
class ForwardKey:
    """Compile-time key of the forward: ``H``, the dtype, the optional tensors and the vector cores."""

    hidden: int
    in_dtype: str
    weight: bool
    residual: bool
    num_cores: int


@compile_key
class BackwardKey:
    """Compile-time key of the backward: ``H``, the dtype, the optional tensors, the partitions and the cores."""

    hidden: int
    in_dtype: str
    weight: bool
    grad_weight: bool
    grad_residual_out: bool
    partitions: int
    num_cores: int


@compile_key
class ReduceKey:
    """Compile-time key of the partial rows' sum."""

    hidden: int
    partitions: int
    num_cores: int


def _check(op: str, hidden: int, in_dtype: str, num_cores: int) -> int:
    limits.IntRange("num_cores", 1).require(op, int(num_cores))
    if in_dtype not in IN_DTYPES:
        raise limits.LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    return limits.NORM_HIDDEN.require(op, int(hidden))


def _widen(ref, in_dtype):
    """64 values of ``ref`` as fp32 (bf16 widened exactly)."""
    if in_dtype == "bfloat16":
        return S.vcvt(S.vld(ref, dist="UNPK_B16"), T.float32, part=0)
    return S.vld(ref)


def _store(ref, value, in_dtype):
    """64 fp32 values rounded once to ``in_dtype`` into ``ref`` (the store is returned: the macro's parser emits a
    statement for the call's value)."""
    if in_dtype == "bfloat16":
        return S.vsts(ref, S.vcvt(value, T.bfloat16), dist="PK_B32")
    return S.vsts(ref, value)


def _param(shape, dtype, stride=None):
    return T.Tensor[shape, dtype] if stride is None else T.StridedTensor[shape, (stride, 1), dtype]


def build_rms_norm_forward(hidden: int, in_dtype: str, weight: bool, residual: bool, num_cores: int):
    """prim_func ``(x, [weight], [residual], y, rstd, [residual_out], eps, out_scale)``: ``x`` / ``residual`` ``(T,
    H)`` with dynamic row strides, ``y`` / ``residual_out`` ``(T, H)``, ``rstd (T,)`` fp32. ``T`` is dynamic."""
    H = _check("rms_norm_forward", hidden, in_dtype, num_cores)
    til = forward_tiling(H, in_dtype, weight, residual)
    hk, n_tiles, stages = til.hk, til.n_tiles, til.stages
    n_chunks = hk // LANES
    dt = T.bfloat16 if in_dtype == "bfloat16" else T.float32
    inv_h = 1.0 / H
    num_tokens = T.dynamic("num_tokens")
    x_stride, r_stride = T.dynamic("x_stride"), T.dynamic("residual_stride")

    @T.macro
    def load_r(x, res, x_ub, res_ub, ro_ub, t, h0):
        """The tile's ``x`` (and residual: ``r = dtype(x + residual)`` into ``ro_ub``)."""
        T.copy(x[t, h0 : h0 + hk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
        if residual:
            T.copy(res[t, h0 : h0 + hk], res_ub, l2_cache_ctrl="NOTALLOC_KEEP")
            with T.SimdVF():
                for c in T.serial(n_chunks):
                    _store(ro_ub[c * LANES], S.vadd(_widen(x_ub[c * LANES], in_dtype),
                                                    _widen(res_ub[c * LANES], in_dtype)), in_dtype)

    @T.macro
    def sum_squares(r_ub, acc_ub):
        """``acc_ub += f32(r)^2`` over the tile, 64 lanes (the buffer of r passed: the residual sum, or x)."""
        with T.SimdVF():
            acc = S.alloc_local((1,), T.float32)
            acc[0] = S.vld(acc_ub[0])
            for c in T.serial(n_chunks):
                v = _widen(r_ub[c * LANES], in_dtype)
                S.vmula(acc[0], v, v)
            S.vsts(acc_ub[0], acc[0])

    @T.macro
    def scale_rows(r_ub, w_ub, rs_ub, y_ub, out_scale):
        """``y = dtype(fl(fl(r * rstd) * fl(w * out_scale)))`` over the tile."""
        with T.SimdVF():
            rv = S.vld(rs_ub[0], dist="BRC_B32")
            for c in T.serial(n_chunks):
                if weight:
                    ws = S.vmuls(_widen(w_ub[c * LANES], in_dtype), out_scale)
                else:
                    ws = S.vdup(out_scale, T.float32)
                _store(y_ub[c * LANES], S.vmul(S.vmul(_widen(r_ub[c * LANES], in_dtype), rv), ws), in_dtype)

    @T.macro
    def body(x, w, res, y, rstd, res_out, eps, out_scale):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((hk,), dt)
            res_ub = T.alloc_shared((hk,), dt)
            ro_ub = T.alloc_shared((hk,), dt)  # r (the residual sum), or unused
            y_ub = T.alloc_shared((hk,), dt)
            w_ub = T.alloc_shared((hk,), dt)
            acc_ub = T.alloc_shared((LANES,), T.float32)  # the 64-lane sum of squares across tiles
            rs_ub = T.alloc_shared((8,), T.float32)  # rstd, padded to a 32-byte block
            if n_tiles == 1:
                T.annotate_buffer_versions({x_ub: stages, res_ub: stages, ro_ub: stages, y_ub: stages,
                                            rs_ub: stages})
                if weight:
                    T.copy(w[0:hk], w_ub)
            for (t,) in T.Persistent([num_tokens], num_cores, core_id, group_size=1, num_stages=stages):
                with T.SimdVF():
                    S.vsts(acc_ub[0], S.vdup(0.0, T.float32))
                for i in T.serial(n_tiles):
                    load_r(x, res, x_ub, res_ub, ro_ub, t, i * hk)
                    if residual:
                        T.copy(ro_ub, res_out[t, i * hk : i * hk + hk])
                    if residual:
                        sum_squares(ro_ub, acc_ub)
                    else:
                        sum_squares(x_ub, acc_ub)
                with T.SimdVF():
                    ss = S.vdupv(S.vcadd(S.vld(acc_ub[0])))
                    r = S.vdiv(S.vdup(1.0, T.float32), S.vsqrt(S.vadds(S.vmuls(ss, inv_h), eps)))
                    S.vsts(rs_ub[0], r)
                T.copy(rs_ub[0:1], rstd[t : t + 1])
                for i in T.serial(n_tiles):
                    if n_tiles > 1:
                        load_r(x, res, x_ub, res_ub, ro_ub, t, i * hk)
                        if weight:
                            T.copy(w[i * hk : i * hk + hk], w_ub)
                    if residual:
                        scale_rows(ro_ub, w_ub, rs_ub, y_ub, out_scale)
                    else:
                        scale_rows(x_ub, w_ub, rs_ub, y_ub, out_scale)
                    T.copy(y_ub, y[t, i * hk : i * hk + hk])

    params = [("x", _param((num_tokens, H), dt, x_stride))]
    if weight:
        params.append(("weight", _param((H,), dt)))
    if residual:
        params.append(("residual", _param((num_tokens, H), dt, r_stride)))
    params += [("y", _param((num_tokens, H), dt)), ("rstd", _param((num_tokens,), T.float32))]
    if residual:
        params.append(("residual_out", _param((num_tokens, H), dt)))
    return variant_prim_func(T.prim_func, T.float32, "rms_norm_forward_asc", params, ("eps", "out_scale"), body,
                             ("x", "weight", "residual", "y", "rstd", "residual_out"))


def build_rms_norm_backward(hidden: int, in_dtype: str, weight: bool, grad_weight: bool, grad_residual_out: bool,
                            partitions: int, num_cores: int):
    """prim_func ``(grad_y, x, [weight], rstd, [grad_residual_out], grad_x, [grad_weight_partial], out_scale)``:
    row tensors ``(T, H)`` (the inputs with dynamic row strides), ``rstd (T,)`` fp32, ``grad_weight_partial (P, H)``
    fp32 (every row written). ``T`` is dynamic."""
    H = _check("rms_norm_backward", hidden, in_dtype, num_cores)
    P = limits.IntRange("partitions", 1).require("rms_norm_backward", int(partitions))
    til = backward_tiling(H, in_dtype, weight, grad_weight, grad_residual_out)
    hk, n_tiles, stages = til.hk, til.n_tiles, til.stages
    n_chunks = hk // LANES
    rounds = -(-P // num_cores)  # partitions a core takes
    dt = T.bfloat16 if in_dtype == "bfloat16" else T.float32
    inv_h = 1.0 / H
    num_tokens = T.dynamic("num_tokens")
    strides = {n: T.dynamic(f"{n}_stride") for n in ("grad_y", "x", "grad_residual_out")}

    @T.macro
    def body(grad_y, x, w, rstd, gro, grad_x, partial, out_scale):
        with T.Kernel(num_cores) as core_id:
            g_ub = T.alloc_shared((hk,), dt)
            x_ub = T.alloc_shared((hk,), dt)
            gro_ub = T.alloc_shared((hk,), dt)
            gx_ub = T.alloc_shared((hk,), dt)
            w_ub = T.alloc_shared((hk,), dt)
            dw_ub = T.alloc_shared((H if grad_weight else LANES,), T.float32)
            acc_ub = T.alloc_shared((LANES,), T.float32)  # the 64-lane sum of xhat * w * g across tiles
            rs_ub = T.alloc_shared((8,), T.float32)
            if n_tiles == 1:
                T.annotate_buffer_versions({g_ub: stages, x_ub: stages, gro_ub: stages, gx_ub: stages,
                                            rs_ub: stages})
                if weight:
                    T.copy(w[0:hk], w_ub)
            for j in T.serial(rounds):
                if core_id + j * num_cores < P:
                    chunk = T.ceildiv(num_tokens, P)
                    lo = T.min((core_id + j * num_cores) * chunk, num_tokens)
                    hi = T.min(lo + chunk, num_tokens)
                    if grad_weight:
                        with T.SimdVF():
                            for c in T.serial(H // LANES):
                                S.vsts(dw_ub[c * LANES], S.vdup(0.0, T.float32))
                    for t in T.Pipelined(lo, hi, num_stages=stages):
                        T.copy(rstd[t : t + 1], rs_ub[0:1])
                        with T.SimdVF():
                            S.vsts(acc_ub[0], S.vdup(0.0, T.float32))
                        for i in T.serial(n_tiles):
                            T.copy(grad_y[t, i * hk : i * hk + hk], g_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                            T.copy(x[t, i * hk : i * hk + hk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                            if weight and n_tiles > 1:
                                T.copy(w[i * hk : i * hk + hk], w_ub)
                            with T.SimdVF():
                                rv = S.vld(rs_ub[0], dist="BRC_B32")
                                acc = S.alloc_local((2,), T.float32)
                                acc[0] = S.vld(acc_ub[0])
                                for c in T.serial(n_chunks):
                                    xh = S.vmul(_widen(x_ub[c * LANES], in_dtype), rv)
                                    g = S.vmuls(_widen(g_ub[c * LANES], in_dtype), out_scale)
                                    if weight:
                                        S.vmula(acc[0], xh, S.vmul(_widen(w_ub[c * LANES], in_dtype), g))
                                    else:
                                        S.vmula(acc[0], xh, g)
                                    if grad_weight:
                                        acc[1] = S.vld(dw_ub[i * hk + c * LANES])
                                        S.vmula(acc[1], xh, g)
                                        S.vsts(dw_ub[i * hk + c * LANES], acc[1])
                                S.vsts(acc_ub[0], acc[0])
                        with T.SimdVF():
                            S.vsts(acc_ub[0], S.vmuls(S.vdupv(S.vcadd(S.vld(acc_ub[0]))), inv_h))  # the mean
                        for i in T.serial(n_tiles):
                            if n_tiles > 1:
                                T.copy(grad_y[t, i * hk : i * hk + hk], g_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                                T.copy(x[t, i * hk : i * hk + hk], x_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                                if weight:
                                    T.copy(w[i * hk : i * hk + hk], w_ub)
                            if grad_residual_out:
                                T.copy(gro[t, i * hk : i * hk + hk], gro_ub, l2_cache_ctrl="NOTALLOC_KEEP")
                            with T.SimdVF():
                                rv = S.vld(rs_ub[0], dist="BRC_B32")
                                mv = S.vld(acc_ub[0])
                                for c in T.serial(n_chunks):
                                    xh = S.vmul(_widen(x_ub[c * LANES], in_dtype), rv)
                                    wg = S.vmuls(_widen(g_ub[c * LANES], in_dtype), out_scale)
                                    if weight:
                                        wg = S.vmul(_widen(w_ub[c * LANES], in_dtype), wg)
                                    gx = S.vmul(S.vsub(wg, S.vmul(xh, mv)), rv)
                                    if grad_residual_out:
                                        gx = S.vadd(gx, _widen(gro_ub[c * LANES], in_dtype))
                                    _store(gx_ub[c * LANES], gx, in_dtype)
                            T.copy(gx_ub, grad_x[t, i * hk : i * hk + hk])
                    if grad_weight:
                        T.copy(dw_ub, partial[core_id + j * num_cores, :])

    params = [("grad_y", _param((num_tokens, H), dt, strides["grad_y"])),
              ("x", _param((num_tokens, H), dt, strides["x"]))]
    if weight:
        params.append(("weight", _param((H,), dt)))
    params.append(("rstd", _param((num_tokens,), T.float32)))
    if grad_residual_out:
        params.append(("grad_residual_out", _param((num_tokens, H), dt, strides["grad_residual_out"])))
    params.append(("grad_x", _param((num_tokens, H), dt)))
    if grad_weight:
        params.append(("grad_weight_partial", _param((P, H), T.float32)))
    return variant_prim_func(T.prim_func, T.float32, "rms_norm_backward_asc", params, ("out_scale",), body,
                             ("grad_y", "x", "weight", "rstd", "grad_residual_out", "grad_x", "grad_weight_partial"))


def build_rms_norm_grad_weight_reduce(hidden: int, partitions: int, num_cores: int):
    """prim_func ``(grad_weight_partial (P, H) fp32, grad_weight (H,) fp32)``: ``grad_weight += s``, ``s`` the sum of
    the partial rows in ascending order (from row 0), 64-column tiles over the cores."""
    H = _check("rms_norm_backward", hidden, "float32", num_cores)
    P = limits.IntRange("partitions", 1).require("rms_norm_backward", int(partitions))
    tiles = H // LANES

    @T.prim_func
    def rms_norm_grad_weight_reduce_asc(grad_weight_partial: T.Tensor[(P, H), T.float32],
                                        grad_weight: T.Tensor[(H,), T.float32]):
        with T.Kernel(num_cores) as core_id:
            part_ub = T.alloc_shared((P, LANES), T.float32)
            gw_ub = T.alloc_shared((LANES,), T.float32)
            for (c,) in T.Persistent([tiles], num_cores, core_id, group_size=1, num_stages=1):
                T.copy(grad_weight_partial[:, c * LANES : c * LANES + LANES], part_ub)
                T.copy(grad_weight[c * LANES : c * LANES + LANES], gw_ub)
                with T.SimdVF():
                    acc = S.alloc_local((1,), T.float32)
                    acc[0] = S.vld(part_ub[0, 0])
                    for q in T.serial(1, P):
                        acc[0] = S.vadd(acc[0], S.vld(part_ub[q, 0]))
                    S.vsts(gw_ub[0], S.vadd(S.vld(gw_ub[0]), acc[0]))
                T.copy(gw_ub, grad_weight[c * LANES : c * LANES + LANES])

    return rms_norm_grad_weight_reduce_asc


def _dtype_name(op: str, x) -> str:
    name = _DTYPE_NAMES.get(x.dtype)
    if name is None:
        raise limits.LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {x.dtype}")
    return name


def forward_key(x, weight, residual, layout=None) -> ForwardKey:
    """The key of a forward launch; a fused cast goes through ``per_token_cast``, whose ``H`` is a multiple of 128
    (``limits.QUANT_HIDDEN``: ``LimitError`` otherwise)."""
    if layout is not None:
        limits.QUANT_HIDDEN.require("rms_norm_forward (the cast of y on Ascend)", int(x.shape[-1]))
    return ForwardKey(int(x.shape[-1]), _dtype_name("rms_norm_forward", x), weight is not None, residual is not None,
                      int(num_vector_cores()))


def backward_key(grad_y, weight, grad_weight, grad_residual_out) -> BackwardKey:
    return BackwardKey(int(grad_y.shape[-1]), _dtype_name("rms_norm_backward", grad_y), weight is not None,
                       grad_weight is not None, grad_residual_out is not None, NORM_GRAD_WEIGHT_PARTITIONS["ascend"],
                       int(num_vector_cores()))


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with weight and residual; fp32 without either."""
    del hc_mult
    return {"rms_norm_forward_bf16_residual": ForwardKey(hidden_size, "bfloat16", True, True, ASCEND_CASE_CORES),
            "rms_norm_forward_f32_plain": ForwardKey(hidden_size, "float32", False, False, ASCEND_CASE_CORES)}


def _backward_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with every optional tensor; fp32 without."""
    del hc_mult
    P = NORM_GRAD_WEIGHT_PARTITIONS["ascend"]
    return {"rms_norm_backward_bf16_full": BackwardKey(hidden_size, "bfloat16", True, True, True, P,
                                                       ASCEND_CASE_CORES),
            "rms_norm_backward_f32_plain": BackwardKey(hidden_size, "float32", False, False, False, P,
                                                       ASCEND_CASE_CORES)}


FORWARD = Kernel("rms_norm_forward", ForwardKey, build_rms_norm_forward, cases=_forward_cases, derive=forward_key)
BACKWARD = Kernel("rms_norm_backward", BackwardKey, build_rms_norm_backward, cases=_backward_cases,
                  derive=backward_key)
GRAD_WEIGHT_REDUCE = Kernel(
    "rms_norm_grad_weight_reduce", ReduceKey, build_rms_norm_grad_weight_reduce,
    cases=lambda hidden_size, hc_mult: {"rms_norm_backward_grad_weight_reduce": ReduceKey(
        hidden_size, NORM_GRAD_WEIGHT_PARTITIONS["ascend"], ASCEND_CASE_CORES)})


def rms_norm_forward(x, weight, eps, residual, out_scale, layout, with_y, y, rstd, residual_out, data, sf) -> None:
    """Launches the forward on the current stream: y (a scratch row buffer where only the cast is asked), rstd,
    residual_out; with a layout, ``per_token_cast`` of y's rows (its Ascend kernel) gives data and sf."""
    x2 = rows(x)
    if x2.shape[0] == 0:
        return
    key = FORWARD.key(x, weight, residual, layout)
    y2 = y.view(x2.shape) if layout is None or with_y else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    FORWARD.compiled(key)(*present(x2, weight, rows_of(residual), y2, rstd.view(x2.shape[0]),
                                   rows_of(residual_out if residual is not None else None)),
                          float(eps), float(out_scale))
    if layout is not None:
        cast = torch.ops.cann_ops_tilelang.per_token_cast(y2, layout)
        data.copy_(cast[0])
        sf.copy_(cast[1])


def rms_norm_backward(grad_y, x, weight, rstd, grad_weight, grad_residual_out, out_scale, grad_x) -> None:
    """Launches the backward on the current stream: grad_x; with grad_weight, P partial rows into a scratch
    buffer, then their sum in ascending order added into grad_weight."""
    g2 = rows(grad_y)
    if g2.shape[0] == 0:
        return
    key = BACKWARD.key(grad_y, weight, grad_weight, grad_residual_out)
    partial = None if grad_weight is None else grad_weight.new_empty((key.partitions, key.hidden))
    BACKWARD.compiled(key)(*present(g2, rows(x), weight, rstd.reshape(g2.shape[0]), rows_of(grad_residual_out),
                                    rows(grad_x), partial), float(out_scale))
    if partial is not None:
        GRAD_WEIGHT_REDUCE.compiled(ReduceKey(key.hidden, key.partitions, key.num_cores))(partial, grad_weight)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD, GRAD_WEIGHT_REDUCE)
