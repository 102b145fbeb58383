"""CUDA kernels of the Engram Sinkhorn optimizer ops (docs/ops/engram.md#sinkhorn).

All four stream their data once in vectors (16 bytes; 8 for the momentum update's bf16 buffers) and are
memory-bound at the optimizer's table sizes:

* momentum update: vectors of 4 consecutive elements of the flat buffers (one 16-byte fp32 vector, an
  8-byte bf16 one); a thread takes :func:`momentum_plan`'s vectors, ``threads`` apart (every load instruction
  of a warp coalesced); the thread holding the last ``N % 4`` elements takes them one by one (a masked tail:
  any element count). The products and sums are rounded one by one
  (``__fmul_rn``/``__fadd_rn``) so that the result is the reference's, bit for bit, whatever nvcc would
  contract.
* step: :data:`PLAN.ctas` CTAs (four per H200 SM), each owning a contiguous row range and writing one row of
  column partials (no atomics); for long ranges :func:`step_split` CTAs share one in equal pieces, their rows
  added in order by a second kernel. A row is read by ``G`` lanes of 4 columns (``G = 16`` or ``32``, the largest
  power of two dividing ``D / 4`` up to a warp); the ``256 / G`` row groups of a CTA take every ``256 / G``-th row
  of its range, and their column sums are added in group order through shared memory at the end. A thread stages
  :func:`rows_in_flight` rows (up to 4 vectors) per iteration by ``cp.async`` (L2 evict-first) in
  :func:`step_slots` private shared-memory slots, the next iterations' rows in flight while it reduces the current
  ones; one lane per row copies the row's scale, which reaches the row's other lanes by a shuffle. The rows' sums
  of squares are completed by xor shuffles that leave each lane one row's sum (:func:`_scatter_macro`), so that
  one square root and division per lane serve all its rows.
* step reduce: a CTA per :data:`PLAN.reduce_cols` columns; its threads stage chunks of
  :data:`PLAN.reduce_chunk` partial rows of those columns in shared memory (the loads of the whole CTA in
  flight at once), then a thread per column adds them in ascending order, one rounding per addition, and
  updates its column scale (``__fmul_rn``, ``__fsqrt_rn``, ``__fadd_rn``, ``__fdiv_rn``).
* finalize: the step's row layout without partials, one CTA per ``rows_in_flight * 256 / G`` rows; the apply
  variant reads the table instead of writing an output and stores ``(p * decay) - (u * lr)``
  (``__fmul_rn``/``__fsub_rn``) into it.
"""

import dataclasses
from dataclasses import astuple

import torch

from ....chips import H200
from ....limits import ENGRAM_SINKHORN_COLS
from ....policy import SINKHORN_STEP_PARTIALS
from ..._kernel import Kernel, compile_key, kernel_module
from .._cp_async import PRELUDE as CP_ASYNC_PRELUDE


@dataclasses.dataclass(frozen=True)
class MomentumLayout:
    """The momentum update's ``vectors`` 4-element vectors per thread of ``threads``-thread CTAs."""

    vectors: int
    threads: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """Schedule of the Sinkhorn kernels. 256-thread CTAs; four step CTAs per SM (the most that 64 registers
    allow) keep 1024 threads with two iterations of four 16-byte row copies each in flight while they reduce
    a third (three 16 KiB slots per CTA where D <= 512 is a power of two or 192 / 384; two slots otherwise). The
    momentum update takes one 4-element vector per thread from :data:`momentum_small_numel` elements on (the
    fastest count at fp32 and bf16, docs/perf/h200/engram.md, 2026-12-02 (night)), four per 128-thread CTA
    below it (docs/perf/h100/engram.md, 2026-12-05 (night))."""

    threads: int = 256
    ctas: int = SINKHORN_STEP_PARTIALS["cuda"]  # step CTAs = rows of the column partials (device policy)
    step_resident: int = 4  # step CTAs per SM the register budget is set for (64 registers)
    row_vectors: int = 4  # 16-byte row vectors per thread in flight (step, finalize): 4 rows at D <= 128
    # NOTE 3 slots over 2: 9 % faster at R = 10^6, D = 128 (docs/perf/h200/engram.md)
    step_slots: int = 3  # step staging slots per thread: the rows of slots - 1 iterations ahead in flight
    step_staging: int = 48 << 10  # bytes of step staging per CTA at most (fewer slots, not fewer than 2, above)
    # NOTE SMs stream at unequal rates: the scheduler hands fast ones more pieces (docs/perf/h100/engram.md)
    step_split: int = 4  # step CTAs per partial row where split (their rows added in order by a second kernel)
    step_split_rows: int = 448  # rows of a piece at least (one CTA per partial row below)
    # NOTE tuned at N = 256256 and 2560256 (4 x 128: 1.5-7 % faster) and 51.2e6 / 64e6 (1 x 256: up to 0.8 % faster)
    momentum_small: MomentumLayout = MomentumLayout(vectors=4, threads=128)  # below momentum_small_numel
    momentum_large: MomentumLayout = MomentumLayout(vectors=1, threads=256)  # from momentum_small_numel on
    momentum_small_numel: int = 1 << 22
    reduce_cols: int = 8  # step-reduce columns per CTA (32 CTAs at D = 256): 32-byte row pieces
    reduce_chunk: int = 512  # partial rows staged at once (16 KiB): one chunk for the 528 partials and a tail
    reduce_unroll: int = 8  # staged rows read ahead of the sequential additions (step reduce)


PLAN = Plan()
_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """A table row over ``lanes`` lanes (G) of ``chunks`` 4-column vectors each (C); ``groups`` rows per CTA (NG)."""

    lanes: int
    chunks: int
    groups: int


def row_layout(cols: int) -> RowLayout:
    """Lanes per row: the largest power of two up to 32 dividing ``D / 4``."""
    cols = ENGRAM_SINKHORN_COLS.require("engram_sinkhorn", cols)
    lanes = 32
    while (cols // 4) % lanes:
        lanes //= 2
    return RowLayout(lanes, cols // (4 * lanes), PLAN.threads // lanes)


def rows_in_flight(cols: int) -> int:
    """Rows a thread loads before reducing any (``PLAN.row_vectors`` vectors, at least one row): 4 at D = 64
    and 128 (one vector per lane and row), 2 at D = 256, 1 from three vectors per lane (at most 32 row
    registers per thread)."""
    return max(1, min(4, PLAN.row_vectors // row_layout(cols).chunks))


def step_split(rows: int) -> int:
    """Step CTAs per partial row at ``R = rows``: :data:`PLAN.step_split` where each piece of a partial's rows
    gets at least :data:`PLAN.step_split_rows` rows, else 1 (the CTA writes its partial row itself)."""
    return PLAN.step_split if -(-rows // PLAN.ctas) >= PLAN.step_split * PLAN.step_split_rows else 1


def step_slots(cols: int) -> int:
    """Staging slots of the step at ``D = cols``: :data:`PLAN.step_slots` where they fit :data:`PLAN.step_staging`
    (16 KiB slots: D in {64, 128, 192, 256, 384, 512}), else as many as fit and at least 2."""
    slot = rows_in_flight(cols) * row_layout(cols).chunks * PLAN.threads * 16
    return max(2, min(PLAN.step_slots, PLAN.step_staging // slot))


# ---- momentum update ---------------------------------------------------------------------------------------


def momentum_plan(numel: int) -> MomentumLayout:
    """The momentum update's layout at ``numel`` elements."""
    return PLAN.momentum_small if numel < PLAN.momentum_small_numel else PLAN.momentum_large


@compile_key
class MomentumKey:
    """Compile-time key of the momentum update: dtypes, Nesterov, the size class's layout (element count dynamic)."""

    grad_dtype: str
    momentum_dtype: str
    nesterov: bool
    vectors: int
    threads: int


@compile_key
class ColsKey:
    """Compile-time key of a kernel of the table width ``D = cols`` alone (row counts dynamic)."""

    cols: int


def _momentum_cases(hidden_size: int, hc_mult: int) -> dict:
    """bf16 with Nesterov, fp32 without, each at both layouts (``_small``: below ``PLAN.momentum_small_numel``)."""
    cases = {}
    for g, m, nesterov in (("bfloat16", "bfloat16", True), ("float32", "float32", False)):
        dtype, variant = ("bf16" if m == "bfloat16" else "fp32"), ("nesterov" if nesterov else "plain")
        name = f"engram_sinkhorn_momentum_update_{dtype}_{variant}"
        cases[name] = MomentumKey(g, m, nesterov, *astuple(PLAN.momentum_large))
        cases[f"{name}_small"] = MomentumKey(g, m, nesterov, *astuple(PLAN.momentum_small))
    return cases


def _cols_cases(name: str, suffix: str = ""):
    """``<name>_d{D}<suffix>`` at the table widths D = 64, 128 (others: tests/engram/test_engram_sinkhorn.py)."""
    return lambda hidden_size, hc_mult: {f"{name}_d{cols}{suffix}": ColsKey(cols) for cols in (64, 128)}


def build_engram_sinkhorn_momentum_update(grad_dtype: str, momentum_dtype: str, nesterov: bool,
                                          vectors: int = PLAN.momentum_large.vectors,
                                          threads: int = PLAN.momentum_large.threads):
    """prim_func(grad (N,), momentum_buffer (N,) in/out, out (N,) f32, beta1 f32, one_minus_beta1 f32), ``N``
    dynamic (any element count); ``vectors`` 4-element vectors per thread of ``threads``-thread CTAs."""
    from tilelang import language as T

    f32, vec = T.float32, 4
    numel = T.dynamic("numel")

    @T.macro
    def update(m, g, v, beta1, one_minus_beta1):  # m = m * beta1 + g * (1 - beta1); the output into g
        m[v] = T.ieee_add(T.ieee_mul(m[v], beta1), T.ieee_mul(g[v], one_minus_beta1))
        if nesterov:  # the update once more
            g[v] = T.ieee_add(T.ieee_mul(m[v], beta1), T.ieee_mul(g[v], one_minus_beta1))
        else:
            g[v] = m[v]

    @T.prim_func
    def engram_sinkhorn_momentum_update_cuda(
        grad: T.Tensor((numel,), grad_dtype),
        momentum_buffer: T.Tensor((numel,), momentum_dtype),
        out: T.Tensor((numel,), f32),
        beta1: f32,
        one_minus_beta1: f32,
    ):
        with T.Kernel(T.ceildiv(numel, threads * vectors * vec), threads=threads) as bx:
            tid = T.get_thread_binding()
            g = T.alloc_local((vectors * vec,), f32)
            m = T.alloc_local((vectors * vec,), f32)
            # vector j of the thread: index (bx * vectors + j) * threads + tid, compared in vectors (no int32
            # overflow up to 2^31 - 1 elements); every load issued before the first update
            for j in T.unroll(vectors):
                if (bx * vectors + j) * threads + tid < numel // vec:
                    for v in T.vectorized(vec):
                        g[j * vec + v] = T.cast(grad[((bx * vectors + j) * threads + tid) * vec + v], f32)
                    for v in T.vectorized(vec):
                        m[j * vec + v] = T.cast(momentum_buffer[((bx * vectors + j) * threads + tid) * vec + v], f32)
            for j in T.unroll(vectors):
                i = (bx * vectors + j) * threads + tid
                if i < numel // vec:
                    for v in T.unroll(vec):
                        update(m, g, j * vec + v, beta1, one_minus_beta1)
                    for v in T.vectorized(vec):
                        momentum_buffer[i * vec + v] = T.cast(m[j * vec + v], momentum_dtype)
                    for v in T.vectorized(vec):
                        out[i * vec + v] = g[j * vec + v]
                elif i == numel // vec:  # the masked tail: N % vec elements, one by one
                    for v in T.serial(vec):
                        if i * vec + v < numel:
                            g[0] = T.cast(grad[i * vec + v], f32)
                            m[0] = T.cast(momentum_buffer[i * vec + v], f32)
                            update(m, g, 0, beta1, one_minus_beta1)
                            momentum_buffer[i * vec + v] = T.cast(m[0], momentum_dtype)
                            out[i * vec + v] = g[0]

    return engram_sinkhorn_momentum_update_cuda


MOMENTUM_UPDATE = Kernel(
    "engram_sinkhorn_momentum_update", MomentumKey, build_engram_sinkhorn_momentum_update, cases=_momentum_cases,
    derive=lambda grad, momentum_buffer, nesterov: MomentumKey(
        _DTYPES[grad.dtype], _DTYPES[momentum_buffer.dtype], bool(nesterov), *astuple(momentum_plan(grad.numel()))))


def engram_sinkhorn_momentum_update(grad, momentum_buffer, beta1, nesterov, out) -> None:
    """grad, momentum_buffer (any shape, N elements) bf16/fp32; momentum updated in place, out (N) fp32."""
    kernel = MOMENTUM_UPDATE.compiled(MOMENTUM_UPDATE.key(grad, momentum_buffer, nesterov))
    kernel(grad.view(-1), momentum_buffer.view(-1), out.view(-1), float(beta1), 1.0 - float(beta1))


# ---- step -----------------------------------------------------------------------------------------------


def _row_macros(T, cols: int):
    """The finalize's row loads (``rows_in_flight`` rows of this row group and their scales, zeros past ``hi``)
    and the scaled iterate's row sums of squares (xor butterfly over the G lanes), which the step shares."""
    lanes, chunks, _groups = astuple(row_layout(cols))
    f32 = T.float32
    nv, fl = 4 * chunks, rows_in_flight(cols)

    @T.macro
    def load_rows(matrix, row_scale, x, rs, first, stride, hi, lane):
        for u in T.unroll(fl):
            row = first + u * stride
            if row < hi:
                for c in T.unroll(chunks):
                    for v in T.vectorized(4):
                        x[u, c * 4 + v] = matrix[row, (c * lanes + lane) * 4 + v]
                rs[u] = row_scale[row]
            else:
                for j in T.unroll(nv):
                    x[u, j] = T.float32(0)
                rs[u] = T.float32(0)

    @T.macro
    def lane_sumsq(x, rs, cs, s):
        for u in T.unroll(fl):
            s[u] = T.float32(0)
            for j in T.unroll(nv):
                t = (rs[u] * x[u, j]) * cs[j]
                s[u] = s[u] + T.ieee_mul(t, t)

    @T.macro
    def row_sumsq(x, rs, cs, s):
        lane_sumsq(x, rs, cs, s)
        for u in T.unroll(fl):
            for o in T.unroll(lanes.bit_length() - 1):
                s[u] = s[u] + T.shfl_xor(s[u], 1 << o)

    return load_rows, lane_sumsq, row_sumsq, f32


def scatter_row(lane, rows: int):
    """The row whose sum of squares lane ``lane`` holds after :func:`_scatter_macro` over ``rows`` rows (a power
    of two): bit ``b`` of the lane selects the upper half of the rows left at level ``b``."""
    return sum(((lane >> b) & 1) * (rows >> (b + 1)) for b in range(rows.bit_length() - 1))


def _scatter_macro(T, cols: int):
    """Row sums of squares over the G lanes of a row, scattered: where a butterfly per row would leave each of
    the ``fl`` sums in every lane, level ``b < log2(fl)`` halves the sums a lane carries (it sends the half
    selected by the other value of its lane bit ``b``) and the remaining levels add one value, so that lane
    ``l`` ends with the sum of row :func:`scatter_row`; each addition pairs the lanes a butterfly pairs, in
    the same tree, so the sums are bitwise the butterfly's. One square root and division per lane then
    serve the ``fl`` rows (was one per row in every lane)."""
    lanes, _chunks, _groups = astuple(row_layout(cols))
    fl = rows_in_flight(cols)

    # Python lists: the builder unrolls them with constant halves and xor masks (a range() would be a TIR loop)
    halving = [(1 << b, fl >> (b + 1)) for b in range(fl.bit_length() - 1)]
    folding = [1 << b for b in range(fl.bit_length() - 1, lanes.bit_length() - 1)]

    @T.macro
    def scatter_sumsq(s, lane):
        for mask, half in halving:
            upper = (lane & mask) != 0
            for j in list(range(half)):
                keep = T.if_then_else(upper, s[j + half], s[j])
                send = T.if_then_else(upper, s[j], s[j + half])
                s[j] = keep + T.shfl_xor(send, mask)
        for mask in folding:
            s[0] = s[0] + T.shfl_xor(s[0], mask)

    return scatter_sumsq


@compile_key
class StepKey:
    """Compile-time key of the step: ``D = cols``, ``split`` where :func:`step_split` is above 1 (rows dynamic)."""

    cols: int
    split: bool = False


def build_engram_sinkhorn_step(cols: int, split: bool = False):
    """prim_func(matrix (R, D) f32, row_scale (R,) f32 in/out, col_scale (D,) f32, row_norm (R,) f32,
    col_sumsq_partial (PLAN.ctas, D) f32, eps f32), ``R`` dynamic; ``D`` in ``limits.ENGRAM_SINKHORN_COLS``.
    With ``split``, col_sumsq_partial is (PLAN.ctas * S, D), ``S`` (:func:`step_split`) dynamic, and CTA
    ``p * S + s`` takes piece ``s`` of partial ``p``'s rows."""
    from tilelang import language as T

    lanes, chunks, groups = astuple(row_layout(cols))
    _, lane_sumsq, _, f32 = _row_macros(T, cols)
    scatter_sumsq = _scatter_macro(T, cols)
    rows = T.dynamic("num_rows")
    nv, fl, ctas, slots = 4 * chunks, rows_in_flight(cols), PLAN.ctas, step_slots(cols)
    subs = T.dynamic("num_sub_partials") if split else ctas

    @T.macro
    def issue(matrix, row_scale, xs, rss, slot, first, hi, lane, tid):
        # cp.async of this thread's vectors of rows first + u * groups (those below hi) into its own 16-byte
        # columns of slot `slot`, and lane u < fl of a row group the scale of row u into its own word (one copy
        # per row, not one per lane); one commit group per call. The table's rows are read once: evict-first in
        # L2, so that L2 replaces them before the row norms and scales being written in pieces
        # (docs/perf/h100/engram.md, 2026-12-06 fourth and fifth sessions).
        for u in T.unroll(fl):
            if first + u * groups < hi:
                for c in T.unroll(chunks):
                    T.call_extern("void", "ops_cp_async16_evict_first",
                                  T.access_ptr(xs[(slot * fl + u) * chunks + c, tid * 4], "w", 4),
                                  T.access_ptr(matrix[first + u * groups, (c * lanes + lane) * 4], "r", 4))
        if lane < fl:
            if first + lane * groups < hi:
                T.ptx_cp_async(T.access_ptr(rss[slot, tid], "w", 1),
                               T.access_ptr(row_scale[first + lane * groups], "r", 1), 1)
        T.ptx_commit_group()

    @T.prim_func
    def engram_sinkhorn_step_cuda(
        matrix: T.Tensor((rows, cols), f32),
        row_scale: T.Tensor((rows,), f32),
        col_scale: T.Tensor((cols,), f32),
        row_norm: T.Tensor((rows,), f32),
        col_sumsq_partial: T.Tensor((subs, cols), f32),
        eps: f32,
    ):
        with T.Kernel(subs, threads=PLAN.threads, prelude=CP_ASYNC_PRELUDE) as b:
            T.annotate_min_blocks_per_sm(PLAN.step_resident)
            tid = T.get_thread_binding()
            lane = tid % lanes
            grp = tid // lanes
            cs = T.alloc_local((nv,), f32)
            acc = T.alloc_local((nv,), f32)
            x = T.alloc_local((fl, nv), f32)
            rs = T.alloc_local((fl,), f32)
            s = T.alloc_local((fl,), f32)
            sc = T.alloc_local((fl,), f32)
            tot = T.alloc_local((4,), f32)
            red = T.alloc_shared((groups, cols), f32)
            xs = T.alloc_shared((slots * fl * chunks, PLAN.threads * 4), f32)  # slots of the thread's rows
            rss = T.alloc_shared((slots, PLAN.threads), f32)
            for c in T.unroll(chunks):
                for v in T.vectorized(4):
                    cs[c * 4 + v] = col_scale[(c * lanes + lane) * 4 + v]
            for j in T.unroll(nv):
                acc[j] = T.float32(0)
            if split:
                # piece b % S of partial b // S's rows, once: the divisions would be repeated in every load index
                lo = T.alloc_var(T.int32)
                hi = T.alloc_var(T.int32)
                per = T.alloc_var(T.int32)
                pieces = subs // ctas
                whole = T.ceildiv(rows, ctas)
                start = T.min((b // pieces) * whole, rows)
                per = T.ceildiv(whole, pieces)
                lo = T.min(start + (b % pieces) * per, T.min(start + whole, rows))
                hi = T.min(T.min(lo + per, start + whole), rows)
            else:
                per = T.ceildiv(rows, ctas)
                lo = T.min(b * per, rows)
                hi = T.min(lo + per, rows)
            for sl in T.unroll(slots - 1):
                issue(matrix, row_scale, xs, rss, sl, lo + sl * groups * fl + grp, hi, lane, tid)
            for it in T.serial(T.ceildiv(per, groups * fl)):
                first = lo + it * groups * fl + grp
                # the rows of the next slots - 1 iterations in flight while this one's are reduced
                # (thread-private slots: a wait_group, no barrier; the scales pass between lanes by shuffles)
                issue(matrix, row_scale, xs, rss, (it + slots - 1) % slots, first + (slots - 1) * groups * fl, hi,
                      lane, tid)
                T.ptx_wait_group(slots - 1)
                mine = rss[it % slots, tid]
                for u in T.unroll(fl):
                    rs[u] = T.shfl_sync(mine, u, lanes)
                for u in T.unroll(fl):
                    for c in T.unroll(chunks):
                        for v in T.vectorized(4):
                            x[u, c * 4 + v] = xs[((it % slots) * fl + u) * chunks + c, tid * 4 + v]
                lane_sumsq(x, rs, cs, s)
                scatter_sumsq(s, lane)
                own = scatter_row(lane, fl)
                nrm = T.ieee_fsqrt(s[0])
                scale = T.ieee_fdiv(T.shfl_sync(mine, own, lanes), nrm + eps)
                if lane < fl:
                    if first + own * groups < hi:
                        row_norm[first + own * groups] = nrm
                        row_scale[first + own * groups] = scale
                for u in list(range(fl)):
                    sc[u] = T.shfl_sync(scale, scatter_row(u, fl), lanes)
                for u in T.unroll(fl):
                    if first + u * groups < hi:
                        for j in T.unroll(nv):
                            y = (sc[u] * x[u, j]) * cs[j]
                            acc[j] = acc[j] + T.ieee_mul(y, y)
            T.sync_threads()  # red may share the staging slots' memory: every thread is past its last read
            for c in T.unroll(chunks):
                for v in T.vectorized(4):
                    red[grp, (c * lanes + lane) * 4 + v] = acc[c * 4 + v]
            T.sync_threads()
            if tid < cols // 4:
                for v in T.vectorized(4):
                    tot[v] = red[0, tid * 4 + v]
                for g in T.unroll(1, groups):  # row groups in order: a fixed sum
                    for v in T.vectorized(4):
                        tot[v] = tot[v] + red[g, tid * 4 + v]
                for v in T.vectorized(4):
                    col_sumsq_partial[b, tid * 4 + v] = tot[v]

    return engram_sinkhorn_step_cuda


STEP = Kernel("engram_sinkhorn_step", StepKey, build_engram_sinkhorn_step,
              derive=lambda matrix: StepKey(int(matrix.shape[1]), step_split(int(matrix.shape[0])) > 1),
              cases=lambda hidden_size, hc_mult: {f"engram_sinkhorn_step_d{cols}{tag}": StepKey(cols, split) for cols
                                                  in (64, 128) for split, tag in ((False, ""), (True, "_split"))})


def build_engram_sinkhorn_step_combine(cols: int):
    """prim_func(sub_partial (PLAN.ctas * S, D) f32, col_sumsq_partial (PLAN.ctas, D) f32), ``S`` dynamic: row
    ``p`` is ``sub[p S] + sub[p S + 1] + ...`` in that order, one rounding per addition; a thread per 4 columns."""
    from tilelang import language as T

    cols = ENGRAM_SINKHORN_COLS.require("engram_sinkhorn_step", cols)
    f32 = T.float32
    subs = T.dynamic("num_sub_partials")
    ctas, threads, quads = PLAN.ctas, PLAN.threads, cols // 4

    @T.prim_func
    def engram_sinkhorn_step_combine_cuda(
        sub_partial: T.Tensor((subs, cols), f32),
        col_sumsq_partial: T.Tensor((ctas, cols), f32),
    ):
        with T.Kernel(T.ceildiv(ctas * quads, threads), threads=threads) as b:
            acc = T.alloc_local((4,), f32)
            split = subs // ctas
            i = b * threads + T.get_thread_binding()
            if i < ctas * quads:
                for v in T.vectorized(4):
                    acc[v] = sub_partial[(i // quads) * split, (i % quads) * 4 + v]
                for k in T.serial(split - 1):
                    for v in T.vectorized(4):
                        acc[v] = acc[v] + sub_partial[(i // quads) * split + k + 1, (i % quads) * 4 + v]
                for v in T.vectorized(4):
                    col_sumsq_partial[i // quads, (i % quads) * 4 + v] = acc[v]

    return engram_sinkhorn_step_combine_cuda


# the sum of the split step's sub-partials (its key from the step's launcher)
STEP_COMBINE = Kernel("engram_sinkhorn_step_combine", ColsKey, build_engram_sinkhorn_step_combine,
                      cases=_cols_cases("engram_sinkhorn_step", "_combine"))


def engram_sinkhorn_step(matrix, row_scale, col_scale, eps, row_norm, col_sumsq_partial) -> None:
    """matrix (R, D) f32, row_scale (R,) in/out, col_scale (D,), row_norm (R,) out, partials (PLAN.ctas, D) out;
    where :func:`step_split` is above 1, the sub-partials go to a scratch buffer and a second kernel adds them."""
    kernel = STEP.compiled(STEP.key(matrix))
    pieces = step_split(matrix.shape[0])
    sub = col_sumsq_partial if pieces == 1 else matrix.new_empty((PLAN.ctas * pieces, matrix.shape[1]))
    kernel(matrix, row_scale, col_scale, row_norm, sub, float(eps))
    if pieces > 1:
        STEP_COMBINE.compiled(ColsKey(int(matrix.shape[1])))(sub, col_sumsq_partial)


# ---- step reduce ----------------------------------------------------------------------------------------


def build_engram_sinkhorn_step_reduce(cols: int):
    """prim_func(col_sumsq_partial (P, D) f32, col_sumsq (D,) f32, col_scale (D,) f32 in/out, rows i32,
    eps f32), ``P >= 1`` dynamic."""
    from tilelang import language as T

    cols = ENGRAM_SINKHORN_COLS.require("engram_sinkhorn_step_reduce", cols)
    f32 = T.float32
    parts = T.dynamic("num_partials")
    cw, chunk, threads, un = PLAN.reduce_cols, PLAN.reduce_chunk, PLAN.threads, PLAN.reduce_unroll

    @T.prim_func
    def engram_sinkhorn_step_reduce_cuda(
        col_sumsq_partial: T.Tensor((parts, cols), f32),
        col_sumsq: T.Tensor((cols,), f32),
        col_scale: T.Tensor((cols,), f32),
        rows: T.int32,
        eps: f32,
    ):
        with T.Kernel(cols // cw, threads=threads) as b:
            tid = T.get_thread_binding()
            stage = T.alloc_shared((chunk, cw), f32)
            acc = T.alloc_local((1,), f32)
            for ch in T.serial(T.ceildiv(parts, chunk)):
                # the chunk's rows of this CTA's columns, every thread loading (rows past P: not read)
                for r, c in T.Parallel(chunk, cw):
                    if ch * chunk + r < parts:
                        stage[r, c] = col_sumsq_partial[ch * chunk + r, b * cw + c]
                T.sync_threads()
                if tid < cw:
                    if ch == 0:
                        acc[0] = stage[0, tid]
                    # rows 1.. (0.. after the first chunk) in ascending order, 8 loads in flight; a select,
                    # not an added zero, past the ends (exact for every input, -0 included)
                    n = T.min(chunk, parts - ch * chunk)
                    for blk in T.serial(T.ceildiv(n, un)):
                        for k in T.unroll(un):
                            acc[0] = T.if_then_else(
                                T.And(blk * un + k >= T.if_then_else(ch == 0, 1, 0), blk * un + k < n),
                                acc[0] + stage[blk * un + k, tid],
                                acc[0],
                            )
                T.sync_threads()
            if tid < cw:
                col_sumsq[b * cw + tid] = acc[0]
                # epilogue: c <- c / (sqrt(s * (D / R)) + eps) where s > 0, each operation rounded on its own
                balance = T.ieee_fdiv(T.float32(cols), T.cast(rows, f32))
                if acc[0] > T.float32(0):
                    col_scale[b * cw + tid] = T.ieee_fdiv(
                        col_scale[b * cw + tid], T.ieee_add(T.ieee_fsqrt(T.ieee_mul(acc[0], balance)), eps))

    return engram_sinkhorn_step_reduce_cuda


STEP_REDUCE = Kernel("engram_sinkhorn_step_reduce", ColsKey, build_engram_sinkhorn_step_reduce,
                     derive=lambda col_sumsq_partial: ColsKey(int(col_sumsq_partial.shape[1])),
                     cases=_cols_cases("engram_sinkhorn_step_reduce"))


def engram_sinkhorn_step_reduce(col_sumsq_partial, col_sumsq, col_scale, rows, eps) -> None:
    """partials (P >= 1, D) f32 -> col_sumsq (D,) f32 (written); col_scale (D,) f32 updated in place."""
    kernel = STEP_REDUCE.compiled(STEP_REDUCE.key(col_sumsq_partial))
    kernel(col_sumsq_partial, col_sumsq, col_scale, int(rows), float(eps))


# ---- finalize -------------------------------------------------------------------------------------------


@compile_key
class ApplyKey:
    """Compile-time key of the finalize's apply variant: ``D = cols`` and the table's dtype."""

    cols: int
    param_dtype: str


def build_engram_sinkhorn_finalize(cols: int):
    """prim_func(matrix (R, D) f32, row_scale (R,) f32, col_scale (D,) f32, out (R, D) f32, eps f32,
    alpha f32), ``R`` dynamic."""
    from tilelang import language as T

    lanes, chunks, groups = astuple(row_layout(cols))
    load_rows, _, row_sumsq, f32 = _row_macros(T, cols)
    rows = T.dynamic("num_rows")
    nv, fl = 4 * chunks, rows_in_flight(cols)
    per_cta = groups * fl

    @T.prim_func
    def engram_sinkhorn_finalize_cuda(
        matrix: T.Tensor((rows, cols), f32),
        row_scale: T.Tensor((rows,), f32),
        col_scale: T.Tensor((cols,), f32),
        out: T.Tensor((rows, cols), f32),
        eps: f32,
        alpha: f32,
    ):
        with T.Kernel(T.ceildiv(rows, per_cta), threads=PLAN.threads) as b:
            tid = T.get_thread_binding()
            lane = tid % lanes
            grp = tid // lanes
            cs = T.alloc_local((nv,), f32)
            x = T.alloc_local((fl, nv), f32)
            rs = T.alloc_local((fl,), f32)
            s = T.alloc_local((fl,), f32)
            o = T.alloc_local((nv,), f32)
            for c in T.unroll(chunks):
                for v in T.vectorized(4):
                    cs[c * 4 + v] = col_scale[(c * lanes + lane) * 4 + v]
            first = b * per_cta + grp
            load_rows(matrix, row_scale, x, rs, first, groups, rows, lane)
            row_sumsq(x, rs, cs, s)
            for u in T.unroll(fl):
                row = first + u * groups
                if row < rows:
                    f = T.ieee_fdiv(alpha, T.ieee_fsqrt(s[u]) + eps)
                    for j in T.unroll(nv):
                        o[j] = T.ieee_mul((rs[u] * x[u, j]) * cs[j], f)
                    for c in T.unroll(chunks):
                        for v in T.vectorized(4):
                            out[row, (c * lanes + lane) * 4 + v] = o[c * 4 + v]

    return engram_sinkhorn_finalize_cuda


def build_engram_sinkhorn_finalize_apply(cols: int, param_dtype: str):
    """prim_func(matrix (R, D) f32, row_scale (R,) f32, col_scale (D,) f32, param (R, D) in/out, eps f32,
    alpha f32, lr f32, decay f32), ``R`` dynamic: the finalize's ``u`` (same arithmetic), then
    ``param <- (f32(param) * decay) - (u * lr)`` with every operation rounded on its own."""
    from tilelang import language as T

    lanes, chunks, groups = astuple(row_layout(cols))
    load_rows, _, row_sumsq, f32 = _row_macros(T, cols)
    rows = T.dynamic("num_rows")
    nv, fl = 4 * chunks, rows_in_flight(cols)
    per_cta = groups * fl

    @T.prim_func
    def engram_sinkhorn_finalize_apply_cuda(
        matrix: T.Tensor((rows, cols), f32),
        row_scale: T.Tensor((rows,), f32),
        col_scale: T.Tensor((cols,), f32),
        param: T.Tensor((rows, cols), param_dtype),
        eps: f32,
        alpha: f32,
        lr: f32,
        decay: f32,
    ):
        with T.Kernel(T.ceildiv(rows, per_cta), threads=PLAN.threads) as b:
            tid = T.get_thread_binding()
            lane = tid % lanes
            grp = tid // lanes
            cs = T.alloc_local((nv,), f32)
            x = T.alloc_local((fl, nv), f32)
            rs = T.alloc_local((fl,), f32)
            s = T.alloc_local((fl,), f32)
            w = T.alloc_local((nv,), f32)
            for c in T.unroll(chunks):
                for v in T.vectorized(4):
                    cs[c * 4 + v] = col_scale[(c * lanes + lane) * 4 + v]
            first = b * per_cta + grp
            load_rows(matrix, row_scale, x, rs, first, groups, rows, lane)
            row_sumsq(x, rs, cs, s)
            for u in T.unroll(fl):
                row = first + u * groups
                if row < rows:
                    f = T.ieee_fdiv(alpha, T.ieee_fsqrt(s[u]) + eps)
                    for c in T.unroll(chunks):
                        for v in T.vectorized(4):
                            w[c * 4 + v] = T.cast(param[row, (c * lanes + lane) * 4 + v], f32)
                    for j in T.unroll(nv):
                        upd = T.ieee_mul((rs[u] * x[u, j]) * cs[j], f)
                        w[j] = T.ieee_sub(T.ieee_mul(w[j], decay), T.ieee_mul(upd, lr))
                    for c in T.unroll(chunks):
                        for v in T.vectorized(4):
                            param[row, (c * lanes + lane) * 4 + v] = T.cast(w[c * 4 + v], param_dtype)

    return engram_sinkhorn_finalize_apply_cuda


FINALIZE = Kernel("engram_sinkhorn_finalize", ColsKey, build_engram_sinkhorn_finalize,
                  derive=lambda matrix: ColsKey(int(matrix.shape[1])), cases=_cols_cases("engram_sinkhorn_finalize"))
# with a table: bf16 at D = 64, fp32 at D = 128 (the mixed dtypes are lowered once by test_engram_sinkhorn.py)
FINALIZE_APPLY = Kernel("engram_sinkhorn_finalize_apply", ApplyKey, build_engram_sinkhorn_finalize_apply,
                        derive=lambda matrix, param: ApplyKey(int(matrix.shape[1]), _DTYPES[param.dtype]),
                        cases=lambda hidden_size, hc_mult: {"engram_sinkhorn_finalize_apply_bf16_d64": ApplyKey(
                            64, "bfloat16"), "engram_sinkhorn_finalize_apply_fp32_d128": ApplyKey(128, "float32")})


def engram_sinkhorn_finalize(matrix, row_scale, col_scale, eps, alpha, out=None, param=None, lr=0.0,
                             decay=1.0) -> None:
    """matrix (R, D) f32, row_scale (R,), col_scale (D,) -> out (R, D) f32 (pre-allocated), or with ``param``
    (R, D) bf16/fp32 instead: ``param <- param * decay - lr * U`` in place."""
    if param is None:
        FINALIZE.compiled(FINALIZE.key(matrix))(matrix, row_scale, col_scale, out, float(eps), float(alpha))
    else:
        FINALIZE_APPLY.compiled(FINALIZE_APPLY.key(matrix, param))(matrix, row_scale, col_scale, param, float(eps),
                                                                   float(alpha), float(lr), float(decay))


# The kernels at the optimizer's table widths, independent of hidden_size.
KERNELS, lowering_cases, __all__ = kernel_module(__name__, MOMENTUM_UPDATE, STEP, STEP_COMBINE, STEP_REDUCE, FINALIZE,
                                                 FINALIZE_APPLY)
