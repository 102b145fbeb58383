"""Ascend 950 kernels of ``layer_norm_forward`` / ``layer_norm_backward`` (docs/ops/norm.md#layer_norm).

Rows are cut into hidden tiles of ``hb`` channels, the widest divisor of ``H`` (a multiple of 64) whose tiles fit
the UB (:func:`tile_of`); a row that fits is one tile, loaded once. All arithmetic is fp32 on 64-lane vectors
(bf16 widened exactly by ``UNPK_B16`` + ``vcvt``, rounded once at the store by ``vcvt`` + ``PK_B32``).

* Forward, a persistent loop over tokens: pass 1 ``r = x + residual`` (rounded, written to ``residual_out``) and
  the 64-lane sums of ``r``; ``mean = vcadd(sums) / H``; pass 2 the sums of ``(r - mean)^2`` (two-pass: robust
  for rows with a large mean), ``rstd = 1 / sqrt(var + eps)`` (correctly rounded ``vdiv``); pass 3 ``y``. With
  several tiles each pass reloads its tiles (``r`` recomputed, bitwise the same). The statistics go through a
  ``(T, 8)`` fp32 row per token (one 32-byte DMA) that the launcher copies to ``mean`` / ``rstd``.
* Backward, three kernels: (1) per token the two row means ``c1 = mean(w g)``, ``c2 = mean(xhat w g)`` into the
  token's statistics row; (2) ``NORM_GRAD_WEIGHT_PARTITIONS["ascend"]`` partitions, partition ``p`` owning the
  tokens ``[p * ceil(T / P), ...)``, hidden tile by hidden tile: ``grad_x`` and the tile's column sums of
  ``xhat g`` and ``g`` over the partition's tokens in ascending order, written as partial row ``p``; (3) each
  column tile adds the partial rows in ascending ``p`` and that sum to the fp32 buffer. No atomics.

Not fused on this backend yet: with a ``layout`` the launcher writes ``y`` (to a temporary without ``with_y``) and
casts it with the ``per_token_cast`` op (``H`` a multiple of 128 there, ``limits.QUANT_HIDDEN``): the same bytes,
one more pass over ``y``. The kernels take dense rows: the launchers copy strided rows to contiguous ones first.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
import torch
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES, NORM_GRAD_WEIGHT_PARTITIONS
from ....quant import per_token_cast
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores

LANES = 64  # fp32 lanes of one 256-byte vector register
STATS = 8  # fp32 per token of the statistics rows: mean, rstd, c1, c2, padding to one 32-byte DMA block
SLACK = 8 * 1024  # UB the tile formula leaves for alignment and the small buffers
_BYTES = {"bfloat16": 2, "float32": 4}
_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
_PARTS = limits.IntRange("partitions", 1)


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """One UB version of each tile (the passes reuse the tiles within a token); ``budget`` the UB bytes the
    tiles may take."""

    budget: int


# single-buffered tiles (the passes of a token reuse them): a forward row of up to H = 24576 bf16 with weight, bias
# and residual is one tile; not measured (no Ascend 950 here)
PLAN = TilePlan(budget=_build.UB_BUDGET_BYTES - SLACK)


def tile_of(hidden: int, bytes_per_column: int) -> int:
    """The widest divisor of ``H`` that is a multiple of 64 and whose tiles (``bytes_per_column`` per column) fit
    :data:`PLAN`'s budget."""
    for hb in range(hidden, 0, -LANES):
        if hidden % hb == 0 and hb * bytes_per_column <= PLAN.budget:
            return hb
    raise limits.LimitError(f"layer_norm: no hidden tile of {bytes_per_column} bytes per column fits the UB")


@compile_key
class ForwardKey:
    """Compile-time key of the forward: the row, the dtype, the optional inputs and the vector cores."""

    hidden: int
    in_dtype: str
    has_weight: bool
    has_bias: bool
    has_residual: bool
    num_cores: int


@compile_key
class BackwardKey:
    """Compile-time key of the backward's kernels: the row, the dtype, the optional inputs, the column sums it
    writes and the partitions (the reduction's key too)."""

    hidden: int
    in_dtype: str
    has_weight: bool
    has_grad_residual: bool
    partitions: int
    num_cores: int


def _check(op: str, hidden, in_dtype) -> int:
    if in_dtype not in _BYTES:
        raise limits.LimitError(f"{op}: the input dtype must be bfloat16 or float32, got {in_dtype}")
    return limits.NORM_HIDDEN.require(op, int(hidden))


def _param(rows, cols: int, dt):
    """A new buffer parameter ``(rows, cols)`` (``(cols,)`` for ``rows`` None: a placeholder); never one object
    for two parameters, which would alias them."""
    return T.Tensor[(cols,), dt] if rows is None else T.Tensor[(rows, cols), dt]


def _load(ref, dt):
    """64 fp32 lanes of a UB row of ``dt`` at ``ref``."""
    return S.vcvt(S.vld(ref, dist="UNPK_B16"), T.float32, part=0) if dt == "bfloat16" else S.vld(ref)


def _store(ref, value, dt):
    """64 fp32 lanes rounded once to ``dt`` into a UB row at ``ref``."""
    if dt == "bfloat16":
        S.vsts(ref, S.vcvt(value, T.bfloat16), dist="PK_B32")
    else:
        S.vsts(ref, value)


def build_layer_norm_forward(hidden: int, in_dtype: str, has_weight: bool, has_bias: bool, has_residual: bool,
                             num_cores: int):
    """prim_func(x (T, H), weight (H,), bias (H,), residual (T, H), y (T, H), stats (T, 8) f32, residual_out
    (T, H), eps f32): an absent weight, bias or residual is a ``(64,)`` placeholder (never read)."""
    H = _check("layer_norm_forward", hidden, in_dtype)
    dt, b = in_dtype, _BYTES[in_dtype]
    hb = tile_of(H, b * (2 + has_residual + has_weight + has_bias))
    n_tiles, nc = H // hb, hb // LANES
    once = n_tiles == 1  # the row is one tile: loaded once, r kept in the x tile
    inv_h = 1.0 / H
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def load_r(x, residual, t, h0, x_ub, r_ub):
        """The tile of ``r = x + residual`` (rounded to the dtype) at column ``h0`` of token ``t`` into ``x_ub``."""
        T.copy(x[t, h0: h0 + hb], x_ub)
        if has_residual:
            T.copy(residual[t, h0: h0 + hb], r_ub)
            with T.SimdVF():
                for c in T.serial(nc):
                    _store(x_ub[c * LANES], S.vadd(_load(x_ub[c * LANES], dt), _load(r_ub[c * LANES], dt)), dt)

    @T.prim_func
    def layer_norm_forward_asc(
        x: _param(num_tokens, H, dt),
        weight: T.Tensor[(H,), dt] if has_weight else _param(None, LANES, dt),
        bias: T.Tensor[(H,), dt] if has_bias else _param(None, LANES, dt),
        residual: _param(num_tokens if has_residual else None, H if has_residual else LANES, dt),
        y: _param(num_tokens, H, dt),
        stats: T.Tensor[(num_tokens, STATS), f32],
        residual_out: _param(num_tokens if has_residual else None, H if has_residual else LANES, dt),
        eps: f32,
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((hb,), dt)
            r_ub = T.alloc_shared((hb,), dt)
            y_ub = T.alloc_shared((hb,), dt)
            w_ub = T.alloc_shared((hb,), dt)
            b_ub = T.alloc_shared((hb,), dt)
            acc_ub = T.alloc_shared((LANES,), f32)
            mean_ub = T.alloc_shared((LANES,), f32)
            rstd_ub = T.alloc_shared((LANES,), f32)
            st_ub = T.alloc_shared((STATS,), f32)
            if once:
                if has_weight:
                    T.copy(weight[0:hb], w_ub)
                if has_bias:
                    T.copy(bias[0:hb], b_ub)
            for (t,) in T.Persistent([num_tokens], num_cores, core_id, group_size=1, num_stages=1):
                # pass 1: r (rounded) and the sums of r
                with T.SimdVF():
                    S.vsts(acc_ub[0], S.vdup(0.0, f32))
                for ht in T.serial(n_tiles):
                    load_r(x, residual, t, ht * hb, x_ub, r_ub)
                    if has_residual:
                        T.copy(x_ub, residual_out[t, ht * hb: ht * hb + hb])
                    with T.SimdVF():
                        acc = S.alloc_local((1,), f32)
                        acc[0] = S.vld(acc_ub[0])
                        for c in T.serial(nc):
                            acc[0] = S.vadd(acc[0], _load(x_ub[c * LANES], dt))
                        S.vsts(acc_ub[0], acc[0])
                # pass 2: the variance around the mean
                with T.SimdVF():
                    mean = S.vmuls(S.vdupv(S.vcadd(S.vld(acc_ub[0]))), inv_h)
                    S.vsts(mean_ub[0], mean)
                    S.vsts(acc_ub[0], S.vdup(0.0, f32))
                for ht in T.serial(n_tiles):
                    if not once:
                        load_r(x, residual, t, ht * hb, x_ub, r_ub)
                    with T.SimdVF():
                        acc = S.alloc_local((1,), f32)
                        acc[0] = S.vld(acc_ub[0])
                        mean = S.vld(mean_ub[0])
                        for c in T.serial(nc):
                            d = S.vsub(_load(x_ub[c * LANES], dt), mean)
                            S.vmula(acc[0], d, d)
                        S.vsts(acc_ub[0], acc[0])
                with T.SimdVF():
                    one = S.vdup(1.0, f32)
                    var = S.vmuls(S.vdupv(S.vcadd(S.vld(acc_ub[0]))), inv_h)
                    rstd = S.vdiv(one, S.vsqrt(S.vadds(var, eps)))
                    S.vsts(rstd_ub[0], rstd)
                    S.vsts(st_ub[0], S.vld(mean_ub[0]), dist="ONEPT_B32")
                    S.vsts(st_ub[1], rstd, dist="ONEPT_B32")
                T.copy(st_ub, stats[t, :])
                # pass 3: y
                for ht in T.serial(n_tiles):
                    if not once:
                        load_r(x, residual, t, ht * hb, x_ub, r_ub)
                        if has_weight:
                            T.copy(weight[ht * hb: ht * hb + hb], w_ub)
                        if has_bias:
                            T.copy(bias[ht * hb: ht * hb + hb], b_ub)
                    with T.SimdVF():
                        mean = S.vld(mean_ub[0])
                        rstd = S.vld(rstd_ub[0])
                        for c in T.serial(nc):
                            v = S.vmul(S.vsub(_load(x_ub[c * LANES], dt), mean), rstd)
                            if has_weight:
                                v = S.vmul(v, _load(w_ub[c * LANES], dt))
                            if has_bias:
                                v = S.vadd(v, _load(b_ub[c * LANES], dt))
                            _store(y_ub[c * LANES], v, dt)
                    T.copy(y_ub, y[t, ht * hb: ht * hb + hb])

    return layer_norm_forward_asc


def build_layer_norm_backward_sums(hidden: int, in_dtype: str, has_weight: bool, has_grad_residual: bool,
                                   partitions: int, num_cores: int):
    """prim_func(grad_y (T, H), x (T, H), weight (H,), stats (T, 8) f32): per token ``stats[t, 2] = mean(w g)``
    and ``stats[t, 3] = mean(xhat w g)`` (``stats[t, 0:2]`` the forward's mean and rstd, read)."""
    H = _check("layer_norm_backward", hidden, in_dtype)
    del has_grad_residual, partitions
    dt, b = in_dtype, _BYTES[in_dtype]
    hb = tile_of(H, b * (2 + has_weight))
    n_tiles, nc = H // hb, hb // LANES
    inv_h = 1.0 / H
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def layer_norm_backward_sums_asc(
        grad_y: _param(num_tokens, H, dt),
        x: _param(num_tokens, H, dt),
        weight: T.Tensor[(H,), dt] if has_weight else _param(None, LANES, dt),
        stats: T.Tensor[(num_tokens, STATS), f32],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((hb,), dt)
            g_ub = T.alloc_shared((hb,), dt)
            w_ub = T.alloc_shared((hb,), dt)
            acc_ub = T.alloc_shared((2, LANES), f32)
            st_ub = T.alloc_shared((STATS,), f32)
            if n_tiles == 1 and has_weight:
                T.copy(weight[0:hb], w_ub)
            for (t,) in T.Persistent([num_tokens], num_cores, core_id, group_size=1, num_stages=1):
                T.copy(stats[t, :], st_ub)
                with T.SimdVF():
                    S.vsts(acc_ub[0, 0], S.vdup(0.0, f32))
                    S.vsts(acc_ub[1, 0], S.vdup(0.0, f32))
                for ht in T.serial(n_tiles):
                    T.copy(x[t, ht * hb: ht * hb + hb], x_ub)
                    T.copy(grad_y[t, ht * hb: ht * hb + hb], g_ub)
                    if n_tiles > 1 and has_weight:
                        T.copy(weight[ht * hb: ht * hb + hb], w_ub)
                    with T.SimdVF():
                        acc = S.alloc_local((2,), f32)
                        acc[0] = S.vld(acc_ub[0, 0])
                        acc[1] = S.vld(acc_ub[1, 0])
                        mean = S.vld(st_ub[0], dist="BRC_B32")
                        rstd = S.vld(st_ub[1], dist="BRC_B32")
                        for c in T.serial(nc):
                            wg = _load(g_ub[c * LANES], dt)
                            if has_weight:
                                wg = S.vmul(wg, _load(w_ub[c * LANES], dt))
                            acc[0] = S.vadd(acc[0], wg)
                            S.vmula(acc[1], S.vmul(S.vsub(_load(x_ub[c * LANES], dt), mean), rstd), wg)
                        S.vsts(acc_ub[0, 0], acc[0])
                        S.vsts(acc_ub[1, 0], acc[1])
                with T.SimdVF():
                    S.vsts(st_ub[2], S.vmuls(S.vcadd(S.vld(acc_ub[0, 0])), inv_h), dist="ONEPT_B32")
                    S.vsts(st_ub[3], S.vmuls(S.vcadd(S.vld(acc_ub[1, 0])), inv_h), dist="ONEPT_B32")
                T.copy(st_ub, stats[t, :])

    return layer_norm_backward_sums_asc


def build_layer_norm_backward(hidden: int, in_dtype: str, has_weight: bool, has_grad_residual: bool,
                              partitions: int, num_cores: int):
    """prim_func(grad_y (T, H), x (T, H), weight (H,), stats (T, 8) f32, grad_residual_out (T, H), grad_x (T, H),
    partial_weight (P, H) f32, partial_bias (P, H) f32): ``grad_x = rstd (w g - c1 - xhat c2) + grad_residual_out``
    and partition ``p``'s column sums of ``xhat g`` and ``g`` (zeros for an empty range), tile by tile."""
    H = _check("layer_norm_backward", hidden, in_dtype)
    P = _PARTS.require("layer_norm_backward", int(partitions))
    dt, b = in_dtype, _BYTES[in_dtype]
    hb = tile_of(H, b * (4 + has_grad_residual) + 8)
    n_tiles, nc = H // hb, hb // LANES
    f32 = T.float32
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def layer_norm_backward_asc(
        grad_y: _param(num_tokens, H, dt),
        x: _param(num_tokens, H, dt),
        weight: T.Tensor[(H,), dt] if has_weight else _param(None, LANES, dt),
        stats: T.Tensor[(num_tokens, STATS), f32],
        grad_residual_out: _param(num_tokens if has_grad_residual else None, H if has_grad_residual else LANES, dt),
        grad_x: _param(num_tokens, H, dt),
        partial_weight: T.Tensor[(P, H), f32],
        partial_bias: T.Tensor[(P, H), f32],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((hb,), dt)
            g_ub = T.alloc_shared((hb,), dt)
            w_ub = T.alloc_shared((hb,), dt)
            r_ub = T.alloc_shared((hb,), dt)
            o_ub = T.alloc_shared((hb,), dt)
            dw_ub = T.alloc_shared((hb,), f32)
            db_ub = T.alloc_shared((hb,), f32)
            st_ub = T.alloc_shared((STATS,), f32)
            for (p, ht) in T.Persistent([P, n_tiles], num_cores, core_id, group_size=1, num_stages=1):
                per = T.ceildiv(num_tokens, P)
                if has_weight:
                    T.copy(weight[ht * hb: ht * hb + hb], w_ub)
                with T.SimdVF():
                    for c in T.serial(nc):
                        S.vsts(dw_ub[c * LANES], S.vdup(0.0, f32))
                        S.vsts(db_ub[c * LANES], S.vdup(0.0, f32))
                for t in T.serial(T.min(p * per, num_tokens), T.min(p * per + per, num_tokens)):
                    T.copy(stats[t, :], st_ub)
                    T.copy(x[t, ht * hb: ht * hb + hb], x_ub)
                    T.copy(grad_y[t, ht * hb: ht * hb + hb], g_ub)
                    if has_grad_residual:
                        T.copy(grad_residual_out[t, ht * hb: ht * hb + hb], r_ub)
                    with T.SimdVF():
                        mean = S.vld(st_ub[0], dist="BRC_B32")
                        rstd = S.vld(st_ub[1], dist="BRC_B32")
                        c1 = S.vld(st_ub[2], dist="BRC_B32")
                        c2 = S.vld(st_ub[3], dist="BRC_B32")
                        for c in T.serial(nc):
                            g = _load(g_ub[c * LANES], dt)
                            xhat = S.vmul(S.vsub(_load(x_ub[c * LANES], dt), mean), rstd)
                            wg = S.vmul(g, _load(w_ub[c * LANES], dt)) if has_weight else g
                            out = S.vmul(S.vsub(S.vsub(wg, c1), S.vmul(xhat, c2)), rstd)
                            if has_grad_residual:
                                out = S.vadd(out, _load(r_ub[c * LANES], dt))
                            _store(o_ub[c * LANES], out, dt)
                            S.vsts(dw_ub[c * LANES], S.vadd(S.vld(dw_ub[c * LANES]), S.vmul(xhat, g)))
                            S.vsts(db_ub[c * LANES], S.vadd(S.vld(db_ub[c * LANES]), g))
                    T.copy(o_ub, grad_x[t, ht * hb: ht * hb + hb])
                T.copy(dw_ub, partial_weight[p, ht * hb: ht * hb + hb])
                T.copy(db_ub, partial_bias[p, ht * hb: ht * hb + hb])

    return layer_norm_backward_asc


def build_layer_norm_backward_reduce(hidden: int, in_dtype: str, has_weight: bool, has_grad_residual: bool,
                                     partitions: int, num_cores: int):
    """prim_func(partial (P, H) f32, grad (H,) f32): ``grad += ((partial[0] + partial[1]) + ...) + partial[P-1]``
    per column tile."""
    H = _check("layer_norm_backward", hidden, in_dtype)
    del has_weight, has_grad_residual
    P = _PARTS.require("layer_norm_backward", int(partitions))
    hb = LANES * 16  # 1024 columns a task: each column's chain of P loads stays in the lanes
    hb = hb if H % hb == 0 else LANES
    n_tiles, nc = H // hb, hb // LANES
    f32 = T.float32

    @T.prim_func
    def layer_norm_backward_reduce_asc(partial: T.Tensor[(P, H), f32], grad: T.Tensor[(H,), f32]):
        with T.Kernel(num_cores) as core_id:
            p_ub = T.alloc_shared((hb,), f32)
            a_ub = T.alloc_shared((hb,), f32)
            for (ht,) in T.Persistent([n_tiles], num_cores, core_id, group_size=1, num_stages=1):
                T.copy(partial[0, ht * hb: ht * hb + hb], a_ub)
                for i in T.serial(1, P):
                    T.copy(partial[i, ht * hb: ht * hb + hb], p_ub)
                    with T.SimdVF():
                        for c in T.serial(nc):
                            S.vsts(a_ub[c * LANES], S.vadd(S.vld(a_ub[c * LANES]), S.vld(p_ub[c * LANES])))
                T.copy(grad[ht * hb: ht * hb + hb], p_ub)
                with T.SimdVF():
                    for c in T.serial(nc):
                        S.vsts(a_ub[c * LANES], S.vadd(S.vld(p_ub[c * LANES]), S.vld(a_ub[c * LANES])))
                T.copy(a_ub, grad[ht * hb: ht * hb + hb])

    return layer_norm_backward_reduce_asc


def _dtype(t) -> str:
    return _DTYPES.get(t.dtype, str(t.dtype))


def _forward_cases(hidden_size: int, hc_mult: int) -> dict:
    del hc_mult
    return {"layer_norm_forward_bf16_residual": ForwardKey(hidden_size, "bfloat16", True, True, True,
                                                           ASCEND_CASE_CORES),
            "layer_norm_forward_f32_plain": ForwardKey(hidden_size, "float32", False, False, False,
                                                       ASCEND_CASE_CORES)}


def _backward_cases(hidden_size: int, hc_mult: int) -> dict:
    del hc_mult
    P = NORM_GRAD_WEIGHT_PARTITIONS["ascend"]
    return {"bf16_all": BackwardKey(hidden_size, "bfloat16", True, True, P, ASCEND_CASE_CORES),
            "f32_plain": BackwardKey(hidden_size, "float32", False, False, P, ASCEND_CASE_CORES)}


def _named(prefix: str, names=("bf16_all", "f32_plain")):
    """The backward's cases under a kernel's name (the reduction, fp32 whatever the dtype: one case)."""
    def cases(hidden_size: int, hc_mult: int) -> dict:
        return {f"{prefix}_{name}": key for name, key in _backward_cases(hidden_size, hc_mult).items()
                if name in names}
    return cases


def _forward_derive(x, weight, bias, residual):
    return ForwardKey(_check("layer_norm_forward", x.shape[1], _dtype(x)), _dtype(x), weight is not None,
                      bias is not None, residual is not None, int(num_vector_cores()))


def _backward_derive(x, weight, grad_residual_out):
    return BackwardKey(_check("layer_norm_backward", x.shape[1], _dtype(x)), _dtype(x), weight is not None,
                       grad_residual_out is not None, NORM_GRAD_WEIGHT_PARTITIONS["ascend"], int(num_vector_cores()))


FORWARD = Kernel("layer_norm_forward", ForwardKey, build_layer_norm_forward, cases=_forward_cases,
                 derive=_forward_derive)
BACKWARD_SUMS = Kernel("layer_norm_backward_sums", BackwardKey, build_layer_norm_backward_sums,
                       cases=_named("layer_norm_backward_sums"), derive=_backward_derive)
BACKWARD = Kernel("layer_norm_backward", BackwardKey, build_layer_norm_backward, cases=_named("layer_norm_backward"),
                  derive=_backward_derive)
BACKWARD_REDUCE = Kernel("layer_norm_backward_reduce", BackwardKey, build_layer_norm_backward_reduce,
                         cases=_named("layer_norm_backward_reduce", ("bf16_all",)), derive=_backward_derive)


def _rows(t):
    """``t (..., H)`` as its ``(T, H)`` rows, contiguous (the DMAs of these kernels take dense rows)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _holder(like):
    return like.new_empty((LANES,))


def layer_norm_forward(x, weight, bias, eps, residual, layout, with_y, y, mean, rstd, residual_out, data,
                       sf) -> None:
    """Launches the forward on the current stream; with a layout, ``y`` (a temporary without ``with_y``) is then cast
    by the ``per_token_cast`` op into ``data`` / ``sf`` (unfused on this backend)."""
    xr = _rows(x)
    if xr.shape[0] == 0:
        return
    if layout is not None and not with_y:
        y = x.new_empty(x.shape)
    rr = None if residual is None else _rows(residual)
    key = FORWARD.key(xr, weight, bias, rr)
    stats = xr.new_empty((xr.shape[0], STATS), dtype=torch.float32)
    FORWARD.compiled(key)(xr, _holder(x) if weight is None else weight, _holder(x) if bias is None else bias,
                          _holder(x) if rr is None else rr, y.view(-1, key.hidden), stats,
                          _holder(x) if rr is None else residual_out.view(-1, key.hidden), float(eps))
    mean.view(-1).copy_(stats[:, 0])
    rstd.view(-1).copy_(stats[:, 1])
    if layout is not None:
        cast_data, cast_sf = per_token_cast(y.view(-1, key.hidden), layout)
        data.copy_(cast_data)
        sf.copy_(cast_sf)


def layer_norm_backward(grad_y, x, weight, mean, rstd, grad_weight, grad_bias, grad_residual_out, grad_x) -> None:
    """Launches the backward (three kernels) on the current stream: writes ``grad_x`` and adds the weight and
    bias sums to the given buffers."""
    xr = _rows(x)
    if xr.shape[0] == 0:
        return
    gr = None if grad_residual_out is None else _rows(grad_residual_out)
    key = BACKWARD.key(xr, weight, gr)
    gy = _rows(grad_y)
    w = _holder(x) if weight is None else weight
    stats = torch.zeros((xr.shape[0], STATS), dtype=torch.float32, device=x.device)
    stats[:, 0] = mean.reshape(-1)
    stats[:, 1] = rstd.reshape(-1)
    BACKWARD_SUMS.compiled(key)(gy, xr, w, stats)
    part_w = xr.new_empty((key.partitions, key.hidden), dtype=torch.float32)
    part_b = xr.new_empty((key.partitions, key.hidden), dtype=torch.float32)
    BACKWARD.compiled(key)(gy, xr, w, stats, _holder(x) if gr is None else gr, grad_x.view(-1, key.hidden),
                           part_w, part_b)
    reduce = BACKWARD_REDUCE.compiled(key)
    if grad_weight is not None:
        reduce(part_w, grad_weight)
    if grad_bias is not None:
        reduce(part_b, grad_bias)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD_SUMS, BACKWARD, BACKWARD_REDUCE)
