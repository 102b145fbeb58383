"""Ascend 950 kernels of the Engram Sinkhorn optimizer ops (docs/ops/engram.md#sinkhorn).

* momentum update: the flat buffers as 256-element rows, 16-row tiles handed to the vector cores by a
  persistent loop (double-buffered); products and sums as separate vector instructions (no vmula), so the
  rounding is the reference's. Any element count: the launcher runs the whole rows in place and the last
  ``N % 256`` elements through one zero-padded staging row (copies only: the same arithmetic, bit for bit).
* step: worker (vector core) ``p`` owns the rows ``[p * ceil(R / P), (p + 1) * ceil(R / P))`` with
  ``P = 64`` (the op's partial rows); it streams them in tiles of :func:`tile_rows` rows, keeps its column
  sums of squares in UB and writes them to its partial row at the end.
* step reduce: one core sums the partial rows in ascending order from ``-0.0`` (the identity), a
  32 KiB tile of rows per DMA, then updates the column scales where the sum is positive
  (``c / (sqrt(s * (D / R)) + eps)``: vdiv, vmul, vsqrt, vadds, vdiv, one rounding each).
* finalize: row tiles over all cores, the row norm recomputed, the output scaled per row; the apply variant
  reads a tile of the table instead and writes back ``(p * decay) - (u * lr)`` (vmuls, vsub; no vmula).
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from ....chips import ASCEND_950
from ....limits import ENGRAM_SINKHORN_COLS, IntRange
from ....policy import ASCEND_CASE_CORES
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores


_LANES = 64  # fp32 lanes of one 256-byte vector register
_ROW = 256  # momentum elements per row (limits.ENGRAM_SINKHORN_ALIGN)


@dataclasses.dataclass(frozen=True)
class SinkhornPlan:
    """``momentum_rows`` rows of 256 elements per momentum tile; ``tile_bytes`` of the matrix per step / finalize
    tile (the finalize's output tile as well); ``stages`` UB versions of every tile."""

    momentum_rows: int
    tile_bytes: int
    stages: int


# 16 momentum rows: 3 x 16 KiB (fp32) per stage; 32 KiB matrix tiles (128 rows at D = 64, 8 at D = 1024); two stages
PLAN = SinkhornPlan(momentum_rows=16, tile_bytes=32 * 1024, stages=2)
_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}
_STEP_PARTIALS = IntRange("partial rows P", 1, ASCEND_950.vector_cores)


def tile_rows(cols: int) -> int:
    """Matrix rows per tile: 32 KiB of fp32 (128 rows at D = 64, 8 at D = 1024)."""
    return PLAN.tile_bytes // (4 * ENGRAM_SINKHORN_COLS.require("engram_sinkhorn", cols))


# ---- momentum update ---------------------------------------------------------------------------------------


@compile_key
class MomentumKey:
    """Compile-time key of the momentum update: the dtypes, Nesterov and the vector cores (the row count is
    dynamic)."""

    grad_dtype: str
    momentum_dtype: str
    nesterov: bool
    num_cores: int


@compile_key
class StepKey:
    """Compile-time key of the step: ``D = cols`` and ``P = num_partials`` (the row count is dynamic)."""

    cols: int
    num_partials: int


@compile_key
class ColsKey:
    """Compile-time key of the step's reduction: ``D = cols`` (the partial row count is dynamic)."""

    cols: int


@compile_key
class FinalizeKey:
    """Compile-time key of the finalize: ``D = cols`` and the vector cores (the row count is dynamic)."""

    cols: int
    num_cores: int


@compile_key
class ApplyKey:
    """Compile-time key of the finalize's apply variant: ``D = cols``, the vector cores and the table's dtype."""

    cols: int
    num_cores: int
    param_dtype: str


def _momentum_cases(hidden_size: int, hc_mult: int) -> dict:
    """Named as the CUDA module's cases (the Ascend 950's cores): bf16 with Nesterov, fp32 without."""
    cases = {}
    for g, m, nesterov in (("bfloat16", "bfloat16", True), ("float32", "float32", False)):
        dtype, variant = ("bf16" if m == "bfloat16" else "fp32"), ("nesterov" if nesterov else "plain")
        cases[f"engram_sinkhorn_momentum_update_{dtype}_{variant}"] = MomentumKey(g, m, nesterov, ASCEND_CASE_CORES)
    return cases


def build_engram_sinkhorn_momentum_update(grad_dtype: str, momentum_dtype: str, nesterov: bool, num_cores: int):
    """prim_func(grad (N/256, 256), momentum_buffer (N/256, 256) in/out, out (N/256, 256) f32, beta1 f32,
    one_minus_beta1 f32), ``N / 256`` dynamic."""
    momentum_rows, stages = PLAN.momentum_rows, PLAN.stages
    cores = IntRange("num_cores", 1).require("engram_sinkhorn_momentum_update", num_cores)
    rows = T.dynamic("num_rows")
    tr, chunks = momentum_rows, _ROW // _LANES
    g16, m16 = grad_dtype == "bfloat16", momentum_dtype == "bfloat16"

    @T.prim_func
    def engram_sinkhorn_momentum_update_asc(
        grad: T.Tensor[(rows, _ROW), grad_dtype],
        momentum_buffer: T.Tensor[(rows, _ROW), momentum_dtype],
        out: T.Tensor[(rows, _ROW), T.float32],
        beta1: T.float32,
        one_minus_beta1: T.float32,
    ):
        with T.Kernel(cores) as core_id:
            g_ub = T.alloc_shared((tr, _ROW), grad_dtype)
            m_ub = T.alloc_shared((tr, _ROW), momentum_dtype)
            o_ub = T.alloc_shared((tr, _ROW), T.float32)
            T.annotate_buffer_versions({g_ub: stages, m_ub: stages, o_ub: stages})
            for (tile,) in T.Persistent([T.ceildiv(rows, tr)], cores, core_id, group_size=1, num_stages=stages):
                r0 = tile * tr
                n = T.min(tr, rows - r0)
                T.copy(grad[r0 : r0 + n, :], g_ub[:n, :])
                T.copy(momentum_buffer[r0 : r0 + n, :], m_ub[:n, :])
                with T.SimdVF():
                    m = S.alloc_var(T.float32)
                    for r in T.serial(n):
                        for c in T.unroll(chunks, explicit=True):
                            d = c * _LANES
                            g = (S.vcvt(S.vld(g_ub[r, d], dist="UNPK_B16"), T.float32, part=0) if g16
                                 else S.vld(g_ub[r, d]))
                            m = (S.vcvt(S.vld(m_ub[r, d], dist="UNPK_B16"), T.float32, part=0) if m16
                                 else S.vld(m_ub[r, d]))
                            gb = S.vmuls(g, one_minus_beta1)
                            m = S.vadd(S.vmuls(m, beta1), gb)
                            if m16:
                                S.vsts(m_ub[r, d], S.vcvt(m, T.bfloat16), dist="PK_B32")
                            else:
                                S.vsts(m_ub[r, d], m)
                            if nesterov:
                                S.vsts(o_ub[r, d], S.vadd(S.vmuls(m, beta1), gb))
                            else:
                                S.vsts(o_ub[r, d], m)
                T.copy(m_ub[:n, :], momentum_buffer[r0 : r0 + n, :])
                T.copy(o_ub[:n, :], out[r0 : r0 + n, :])

    return engram_sinkhorn_momentum_update_asc


MOMENTUM_UPDATE = Kernel(
    "engram_sinkhorn_momentum_update", MomentumKey, build_engram_sinkhorn_momentum_update, cases=_momentum_cases,
    derive=lambda grad, momentum_buffer, nesterov: MomentumKey(
        _DTYPES[str(grad.dtype)], _DTYPES[str(momentum_buffer.dtype)], bool(nesterov), int(num_vector_cores())))


def engram_sinkhorn_momentum_update(grad, momentum_buffer, beta1, nesterov, out) -> None:
    """grad, momentum_buffer (any N elements) bf16/fp32; momentum in place; out (N) fp32. The whole 256-element
    rows in place; the last ``N % 256`` elements through a zero-padded staging row (exact copies)."""
    kernel = MOMENTUM_UPDATE.compiled(MOMENTUM_UPDATE.key(grad, momentum_buffer, nesterov))
    g, m, o = grad.view(-1), momentum_buffer.view(-1), out.view(-1)
    numel = g.numel()
    main = numel - numel % _ROW
    b, ob = float(beta1), 1.0 - float(beta1)
    if main:
        kernel(g[:main].view(-1, _ROW), m[:main].view(-1, _ROW), o[:main].view(-1, _ROW), b, ob)
    if main < numel:
        tail = numel - main
        g_row, m_row = g.new_zeros((1, _ROW)), m.new_zeros((1, _ROW))
        o_row = o.new_empty((1, _ROW))
        g_row[0, :tail].copy_(g[main:])
        m_row[0, :tail].copy_(m[main:])
        kernel(g_row, m_row, o_row, b, ob)
        m[main:].copy_(m_row[0, :tail])
        o[main:].copy_(o_row[0, :tail])


# ---- step -----------------------------------------------------------------------------------------------


def build_engram_sinkhorn_step(cols: int, num_partials: int = ASCEND_950.vector_cores):
    """prim_func(matrix (R, D) f32, row_scale (R,) f32 in/out, col_scale (D,) f32, row_norm (R,) f32,
    col_sumsq_partial (P, D) f32, eps f32), ``R`` dynamic; one core per partial row."""
    stages = PLAN.stages
    tr = tile_rows(cols)
    P = _STEP_PARTIALS.require("engram_sinkhorn_step", num_partials)
    chunks = cols // _LANES
    rows = T.dynamic("num_rows")

    @T.prim_func
    def engram_sinkhorn_step_asc(
        matrix: T.Tensor[(rows, cols), T.float32],
        row_scale: T.Tensor[(rows,), T.float32],
        col_scale: T.Tensor[(cols,), T.float32],
        row_norm: T.Tensor[(rows,), T.float32],
        col_sumsq_partial: T.Tensor[(P, cols), T.float32],
        eps: T.float32,
    ):
        with T.Kernel(P) as core_id:
            cs_ub = T.alloc_shared((cols,), T.float32)
            acc_ub = T.alloc_shared((cols,), T.float32)
            a_ub = T.alloc_shared((tr, cols), T.float32)
            rs_ub = T.alloc_shared((tr,), T.float32)
            nrm_ub = T.alloc_shared((tr,), T.float32)
            T.annotate_buffer_versions({a_ub: stages, rs_ub: stages, nrm_ub: stages})
            T.copy(col_scale, cs_ub)
            with T.SimdVF():
                zero = S.vdup(0.0, T.float32)
                for c in T.serial(chunks):
                    S.vsts(acc_ub[c * _LANES], zero)
            per = T.ceildiv(rows, P)
            lo = T.min(core_id * per, rows)
            hi = T.min(lo + per, rows)
            for tile in T.serial(T.ceildiv(hi - lo, tr)):  # this core's own contiguous rows
                r0 = lo + tile * tr
                n = T.min(tr, hi - r0)
                T.copy(matrix[r0 : r0 + n, :], a_ub[:n, :])
                T.copy(row_scale[r0 : r0 + n], rs_ub[:n])
                with T.SimdVF():
                    s = S.alloc_var(T.float32)
                    col = S.alloc_var(T.float32)
                    for r in T.serial(n):
                        rsb = S.vld(rs_ub[r], dist="BRC_B32")
                        s = S.vdup(0.0, T.float32)
                        for c in T.serial(chunks):
                            t = S.vmul(S.vmul(rsb, S.vld(a_ub[r, c * _LANES])), S.vld(cs_ub[c * _LANES]))
                            s = S.vadd(s, S.vmul(t, t))
                        nrm = S.vsqrt(S.vcadd(s))
                        scale = S.vdiv(rsb, S.vadds(nrm, eps))  # lane 0: r / (norm + eps)
                        S.vsts(nrm_ub[r], nrm, dist="ONEPT_B32")
                        S.vsts(rs_ub[r], scale, dist="ONEPT_B32")
                        sb = S.vdupv(scale)
                        for c in T.serial(chunks):
                            y = S.vmul(S.vmul(sb, S.vld(a_ub[r, c * _LANES])), S.vld(cs_ub[c * _LANES]))
                            col = S.vld(acc_ub[c * _LANES])
                            S.vsts(acc_ub[c * _LANES], S.vadd(col, S.vmul(y, y)))
                T.copy(nrm_ub[:n], row_norm[r0 : r0 + n])
                T.copy(rs_ub[:n], row_scale[r0 : r0 + n])
            T.ascend_pipe_barrier("PIPE_ALL")
            T.copy(acc_ub, col_sumsq_partial[core_id, :])

    return engram_sinkhorn_step_asc


# lowering cases at the optimizer's table widths D = 64 and 128, one partial row per Ascend 950 vector core
STEP = Kernel("engram_sinkhorn_step", StepKey, build_engram_sinkhorn_step,
              derive=lambda matrix, col_sumsq_partial: StepKey(int(matrix.shape[1]), int(col_sumsq_partial.shape[0])),
              cases=lambda hidden_size, hc_mult: {f"engram_sinkhorn_step_d{cols}": StepKey(cols, ASCEND_CASE_CORES)
                                                  for cols in (64, 128)})


def engram_sinkhorn_step(matrix, row_scale, col_scale, eps, row_norm, col_sumsq_partial) -> None:
    """matrix (R, D) f32, row_scale (R,) in/out, col_scale (D,), row_norm (R,) out, partials (P, D) out."""
    kernel = STEP.compiled(STEP.key(matrix, col_sumsq_partial))
    kernel(matrix, row_scale, col_scale, row_norm, col_sumsq_partial, float(eps))


# ---- step reduce ----------------------------------------------------------------------------------------


def build_engram_sinkhorn_step_reduce(cols: int):
    """prim_func(col_sumsq_partial (P, D) f32, col_sumsq (D,) f32, col_scale (D,) f32 in/out, rows i32,
    eps f32), ``P`` dynamic; one core."""
    stages = PLAN.stages
    cols = ENGRAM_SINKHORN_COLS.require("engram_sinkhorn_step_reduce", cols)
    chunks = cols // _LANES
    parts = T.dynamic("num_partials")
    br = tile_rows(cols)  # partial rows per DMA: the 32 KiB tile of the step

    @T.prim_func
    def engram_sinkhorn_step_reduce_asc(
        col_sumsq_partial: T.Tensor[(parts, cols), T.float32],
        col_sumsq: T.Tensor[(cols,), T.float32],
        col_scale: T.Tensor[(cols,), T.float32],
        rows: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(1) as core_id:
            p_ub = T.alloc_shared((br, cols), T.float32)
            acc_ub = T.alloc_shared((cols,), T.float32)
            cs_ub = T.alloc_shared((cols,), T.float32)
            T.annotate_buffer_versions({p_ub: stages})
            T.copy(col_scale, cs_ub)
            with T.SimdVF():
                nz = S.vdup(-0.0, T.float32)  # the identity of fp32 addition
                for c in T.serial(chunks):
                    S.vsts(acc_ub[c * _LANES], nz)
            for (blk,) in T.Persistent([T.ceildiv(parts, br)], 1, core_id, group_size=1, num_stages=stages):
                p0 = blk * br
                n = T.min(br, parts - p0)
                T.copy(col_sumsq_partial[p0 : p0 + n, :], p_ub[:n, :])
                with T.SimdVF():
                    acc = S.alloc_var(T.float32)
                    for c in T.serial(chunks):
                        acc = S.vld(acc_ub[c * _LANES])
                        for p in T.serial(n):  # p ascending
                            acc = S.vadd(acc, S.vld(p_ub[p, c * _LANES]))
                        S.vsts(acc_ub[c * _LANES], acc)
            with T.SimdVF():  # epilogue: c <- c / (sqrt(s * (D / R)) + eps) where s > 0
                sv = S.alloc_var(T.float32)
                cv = S.alloc_var(T.float32)
                bal = S.vdiv(S.vdup(float(cols), T.float32), S.vdup(T.cast(rows, T.float32), T.float32))
                for c in T.serial(chunks):
                    sv = S.vld(acc_ub[c * _LANES])
                    cv = S.vld(cs_ub[c * _LANES])
                    nv = S.vdiv(cv, S.vadds(S.vsqrt(S.vmul(sv, bal)), eps))
                    S.vsts(cs_ub[c * _LANES], S.vsel(nv, cv, S.vcmps(sv, 0.0, op="gt")))
            T.ascend_pipe_barrier("PIPE_ALL")
            T.copy(acc_ub, col_sumsq)
            T.copy(cs_ub, col_scale)

    return engram_sinkhorn_step_reduce_asc


STEP_REDUCE = Kernel("engram_sinkhorn_step_reduce", ColsKey, build_engram_sinkhorn_step_reduce,
                     derive=lambda col_sumsq_partial: ColsKey(int(col_sumsq_partial.shape[1])),
                     cases=lambda hidden_size, hc_mult: {f"engram_sinkhorn_step_reduce_d{cols}": ColsKey(cols)
                                                         for cols in (64, 128)})


def engram_sinkhorn_step_reduce(col_sumsq_partial, col_sumsq, col_scale, rows, eps) -> None:
    """partials (P >= 1, D) f32 -> col_sumsq (D,) f32 (written); col_scale (D,) f32 updated in place."""
    kernel = STEP_REDUCE.compiled(STEP_REDUCE.key(col_sumsq_partial))
    kernel(col_sumsq_partial, col_sumsq, col_scale, int(rows), float(eps))


# ---- finalize -------------------------------------------------------------------------------------------


def build_engram_sinkhorn_finalize(cols: int, num_cores: int):
    """prim_func(matrix (R, D) f32, row_scale (R,) f32, col_scale (D,) f32, out (R, D) f32, eps f32,
    alpha f32), ``R`` dynamic."""
    stages = PLAN.stages
    tr = tile_rows(cols)
    cores = IntRange("num_cores", 1).require("engram_sinkhorn_finalize", num_cores)
    chunks = cols // _LANES
    rows = T.dynamic("num_rows")

    @T.prim_func
    def engram_sinkhorn_finalize_asc(
        matrix: T.Tensor[(rows, cols), T.float32],
        row_scale: T.Tensor[(rows,), T.float32],
        col_scale: T.Tensor[(cols,), T.float32],
        out: T.Tensor[(rows, cols), T.float32],
        eps: T.float32,
        alpha: T.float32,
    ):
        with T.Kernel(cores) as core_id:
            cs_ub = T.alloc_shared((cols,), T.float32)
            a_ub = T.alloc_shared((tr, cols), T.float32)
            o_ub = T.alloc_shared((tr, cols), T.float32)
            rs_ub = T.alloc_shared((tr,), T.float32)
            T.annotate_buffer_versions({a_ub: stages, o_ub: stages, rs_ub: stages})
            T.copy(col_scale, cs_ub)
            for (tile,) in T.Persistent([T.ceildiv(rows, tr)], cores, core_id, group_size=1, num_stages=stages):
                r0 = tile * tr
                n = T.min(tr, rows - r0)
                T.copy(matrix[r0 : r0 + n, :], a_ub[:n, :])
                T.copy(row_scale[r0 : r0 + n], rs_ub[:n])
                with T.SimdVF():
                    av = S.vdup(alpha, T.float32)
                    s = S.alloc_var(T.float32)
                    for r in T.serial(n):
                        rsb = S.vld(rs_ub[r], dist="BRC_B32")
                        s = S.vdup(0.0, T.float32)
                        for c in T.serial(chunks):
                            t = S.vmul(S.vmul(rsb, S.vld(a_ub[r, c * _LANES])), S.vld(cs_ub[c * _LANES]))
                            s = S.vadd(s, S.vmul(t, t))
                        f = S.vdupv(S.vdiv(av, S.vadds(S.vsqrt(S.vcadd(s)), eps)))
                        for c in T.serial(chunks):
                            t = S.vmul(S.vmul(rsb, S.vld(a_ub[r, c * _LANES])), S.vld(cs_ub[c * _LANES]))
                            S.vsts(o_ub[r, c * _LANES], S.vmul(t, f))
                T.copy(o_ub[:n, :], out[r0 : r0 + n, :])

    return engram_sinkhorn_finalize_asc


def build_engram_sinkhorn_finalize_apply(cols: int, num_cores: int, param_dtype: str):
    """prim_func(matrix (R, D) f32, row_scale (R,) f32, col_scale (D,) f32, param (R, D) in/out, eps f32,
    alpha f32, lr f32, decay f32), ``R`` dynamic: the finalize's ``u`` (same instructions), then
    ``param <- (f32(param) * decay) - (u * lr)``, one rounding per instruction."""
    stages = PLAN.stages
    tr = tile_rows(cols)
    cores = IntRange("num_cores", 1).require("engram_sinkhorn_finalize", num_cores)
    chunks = cols // _LANES
    rows = T.dynamic("num_rows")
    p16 = param_dtype == "bfloat16"

    @T.prim_func
    def engram_sinkhorn_finalize_apply_asc(
        matrix: T.Tensor[(rows, cols), T.float32],
        row_scale: T.Tensor[(rows,), T.float32],
        col_scale: T.Tensor[(cols,), T.float32],
        param: T.Tensor[(rows, cols), param_dtype],
        eps: T.float32,
        alpha: T.float32,
        lr: T.float32,
        decay: T.float32,
    ):
        with T.Kernel(cores) as core_id:
            cs_ub = T.alloc_shared((cols,), T.float32)
            a_ub = T.alloc_shared((tr, cols), T.float32)
            p_ub = T.alloc_shared((tr, cols), param_dtype)
            rs_ub = T.alloc_shared((tr,), T.float32)
            T.annotate_buffer_versions({a_ub: stages, p_ub: stages, rs_ub: stages})
            T.copy(col_scale, cs_ub)
            for (tile,) in T.Persistent([T.ceildiv(rows, tr)], cores, core_id, group_size=1, num_stages=stages):
                r0 = tile * tr
                n = T.min(tr, rows - r0)
                T.copy(matrix[r0 : r0 + n, :], a_ub[:n, :])
                T.copy(row_scale[r0 : r0 + n], rs_ub[:n])
                T.copy(param[r0 : r0 + n, :], p_ub[:n, :])
                with T.SimdVF():
                    av = S.vdup(alpha, T.float32)
                    s = S.alloc_var(T.float32)
                    w = S.alloc_var(T.float32)
                    for r in T.serial(n):
                        rsb = S.vld(rs_ub[r], dist="BRC_B32")
                        s = S.vdup(0.0, T.float32)
                        for c in T.serial(chunks):
                            t = S.vmul(S.vmul(rsb, S.vld(a_ub[r, c * _LANES])), S.vld(cs_ub[c * _LANES]))
                            s = S.vadd(s, S.vmul(t, t))
                        f = S.vdupv(S.vdiv(av, S.vadds(S.vsqrt(S.vcadd(s)), eps)))
                        for c in T.serial(chunks):
                            t = S.vmul(S.vmul(rsb, S.vld(a_ub[r, c * _LANES])), S.vld(cs_ub[c * _LANES]))
                            w = (S.vcvt(S.vld(p_ub[r, c * _LANES], dist="UNPK_B16"), T.float32, part=0) if p16
                                 else S.vld(p_ub[r, c * _LANES]))
                            w = S.vsub(S.vmuls(w, decay), S.vmuls(S.vmul(t, f), lr))
                            if p16:
                                S.vsts(p_ub[r, c * _LANES], S.vcvt(w, T.bfloat16), dist="PK_B32")
                            else:
                                S.vsts(p_ub[r, c * _LANES], w)
                T.copy(p_ub[:n, :], param[r0 : r0 + n, :])

    return engram_sinkhorn_finalize_apply_asc


FINALIZE = Kernel("engram_sinkhorn_finalize", FinalizeKey, build_engram_sinkhorn_finalize,
                  derive=lambda matrix: FinalizeKey(int(matrix.shape[1]), int(num_vector_cores())),
                  cases=lambda hidden_size, hc_mult: {f"engram_sinkhorn_finalize_d{cols}": FinalizeKey(
                      cols, ASCEND_CASE_CORES) for cols in (64, 128)})
# with a table: bf16 at D = 64, fp32 at D = 128
FINALIZE_APPLY = Kernel(
    "engram_sinkhorn_finalize_apply", ApplyKey, build_engram_sinkhorn_finalize_apply,
    derive=lambda matrix, param: ApplyKey(int(matrix.shape[1]), int(num_vector_cores()), _DTYPES[str(param.dtype)]),
    cases=lambda hidden_size, hc_mult: {
        "engram_sinkhorn_finalize_apply_bf16_d64": ApplyKey(64, ASCEND_CASE_CORES, "bfloat16"),
        "engram_sinkhorn_finalize_apply_fp32_d128": ApplyKey(128, ASCEND_CASE_CORES, "float32")})


def engram_sinkhorn_finalize(matrix, row_scale, col_scale, eps, alpha, out=None, param=None, lr=0.0,
                             decay=1.0) -> None:
    """matrix (R, D) f32, row_scale (R,), col_scale (D,) -> out (R, D) f32 (pre-allocated), or with ``param``
    (R, D) bf16/fp32 instead: ``param <- param * decay - lr * U`` in place."""
    if param is None:
        FINALIZE.compiled(FINALIZE.key(matrix))(matrix, row_scale, col_scale, out, float(eps), float(alpha))
    else:
        FINALIZE_APPLY.compiled(FINALIZE_APPLY.key(matrix, param))(matrix, row_scale, col_scale, param, float(eps),
                                                                   float(alpha), float(lr), float(decay))


# The kernels at the optimizer's table widths, named as the CUDA module's cases (independent of hidden_size).
KERNELS, lowering_cases, __all__ = kernel_module(__name__, MOMENTUM_UPDATE, STEP, STEP_REDUCE, FINALIZE, FINALIZE_APPLY)
