"""Ascend 950 kernel of ``mhc_multilayer_recompute`` (docs/ops/mhc.md#multilayer_recompute), m = 4::

    R = initial_residual
    for l in range(L):
        layer_input_list[l] = mhc_pre_apply_mix_forward(R, pre_mix_list[l])
        if l < Lp:                                          # Lp in {L - 1, L}
            R = residual_list[l] = mhc_post_forward(layer_output_list[l], R, post_mix_list[l], comb_mix_list[l])

bitwise equal to that chain of the Ascend kernels (``pre_apply_mix.py``, ``post.py``): the same ``vmul`` +
``vmula`` sequences, each output rounded to bf16 once. The running residual stays in UB between layers as
the bf16 values the chain stores (its fp32 widening is exact, so it is f32(bf16(.)) as the chain reads it).

**Lists of tensors.** The kernel is specialized on ``(H, m, L, Lp)`` and takes every tensor of the lists as
its own buffer parameter (``pre_mix_list_0 .. pre_mix_list_{L-1}``, ...): TileLang's builder runs the
prim_func body as Python, so :func:`_list_params` registers them with the IR builder's ``arg`` (after the
annotated ``initial_residual``), and the layer loop is a Python loop that picks the layer's buffers. The
launcher passes the lists unpacked; nothing is allocated or copied per call.

**Schedule.** A persistent loop over (token, hidden tile) tasks (streaming scheme of :mod:`._streaming`),
two task stages. Within a task the residual tile alternates between two UB buffers by layer parity (the
post stage of layer l reads one and writes the other, which the store to ``residual_list[l]`` then reads),
and the layer output / layer input tiles and the per-token mixes alternate the same way, so the loads of
layer l + 1 and the stores of layer l overlap the vector work. Each layer is three scheduler tasks (its
loads, its two VFs, its stores). The launcher runs at most ``PLAN.layers_per_kernel`` layers per kernel,
in consecutive launches, each starting from the residual the previous one stored (the same bf16 values, so
bitwise the same): TileLang's Z3 scheduling of the unrolled body grows fast with L.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tvm.script.ir_builder import tirx as ir_builder

from .... import limits
from ..._kernel import Kernel, compile_key, kernel_module
from .. import num_vector_cores
from ._common import CASE_NUM_CORES, LANES
from ._streaming import PAD, StreamingPlan, apply_mix_vf, check, post_vf


OP = "mhc_multilayer_recompute"
LAYERS = limits.MHC_RECOMPUTE_LAYERS

# the op's list arguments in kernel parameter order (after ``initial_residual``) and their lengths: "L" (one
# tensor per layer) or "Lp" (one per layer followed by the post stage)
LISTS = (
    ("pre_mix_list", "L"),
    ("layer_output_list", "Lp"),
    ("post_mix_list", "Lp"),
    ("comb_mix_list", "Lp"),
    ("layer_input_list", "L"),
    ("residual_list", "Lp"),
)

# kernel parameter -> op argument: element l of the list argument ``name`` is the parameter ``name_l``
ARGUMENTS = {f"{name}_{index}": name for name, _ in LISTS for index in range(LAYERS.high)}


@dataclasses.dataclass(frozen=True)
class RecomputePlan(StreamingPlan):
    """``stages`` UB versions of every tile (task pipeline); at most ``layers_per_kernel`` layers per launch."""

    layers_per_kernel: int = 16

    def chunks(self, layers: int, post_layers: int) -> list[tuple[int, int, int]]:
        """(first layer, L, Lp) of each launch: consecutive runs of ``layers_per_kernel`` layers, the last
        one shorter; Lp of a run counts its layers followed by the post stage (all but the chain's last
        when Lp = L - 1)."""
        out = []
        for start in range(0, layers, self.layers_per_kernel):
            stop = min(layers, start + self.layers_per_kernel)
            out.append((start, stop - start, min(post_layers, stop) - start))
        return out


# Two task stages of the parity-buffered tiles (24 bytes per column and stage): the whole row up to
# H = 5120 (H = 4096: 192 KiB); 7168 -> 3584, 8192 -> 4096. 16 layers per kernel: the CPU lowering takes
# 0.5 to 1 min up to L = 16, ~2 min at L = 32, 9 at L = 64 (docs/perf/ascend950/mhc.md, 2026-12-02 —
# pre_big_fuse and multilayer_recompute: schedules, UB, lowering time).
PLAN = RecomputePlan(stages=2)


def _check(hidden_size, hc_mult, layers, post_layers) -> tuple[int, int, int, int]:
    """(H, m, L, Lp) in the declared ranges (``Lp`` in ``{L - 1, L}``), else :class:`LimitError`."""
    H, m = check(OP, hidden_size, hc_mult)
    L = LAYERS.require(OP, int(layers))
    Lp = int(post_layers)
    if Lp not in (L - 1, L):
        raise limits.LimitError(f"{OP}: post layers Lp must be L - 1 or L = {L}, got {Lp}")
    return H, m, L, Lp


def mhc_multilayer_recompute_bytes_per_column(hc_mult: int, layers: int, post_layers: int) -> int:
    """UB bytes per hidden column and task stage: the residual tile (2m bytes) once or, with a post stage,
    in two parity buffers; the layer output (2) and layer input (2) tiles in up to two parity buffers."""
    residual_buffers = 2 if post_layers else 1
    return 2 * hc_mult * residual_buffers + 2 * min(post_layers, 2) + 2 * min(layers, 2)


def kernel_arguments(layers: int, post_layers: int) -> list[str]:
    """The kernel's buffer parameter names in order (the dynamic token count aside)."""
    counts = {"L": layers, "Lp": post_layers}
    return ["initial_residual"] + [f"{name}_{index}" for name, count in LISTS for index in range(counts[count])]


def _list_params(name: str, count: int, shape, dtype) -> list:
    """``count`` buffer parameters ``name_0 ..`` of the prim_func being built (call in its body, before
    ``T.Kernel``): the IR builder's ``arg`` appends them to the parameters in call order."""
    return [ir_builder.arg(f"{name}_{index}", T.Tensor(shape, dtype)) for index in range(count)]


@compile_key
class RecomputeKey:
    """Compile-time key: ``H``, ``m``, ``L = layers``, ``Lp = post_layers`` and the vector cores (never T)."""

    hidden_size: int
    hc_mult: int
    layers: int
    post_layers: int
    num_cores: int


def _key(initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list, layer_input_list,
         residual_list) -> RecomputeKey:
    """L = len(pre_mix_list), Lp = len(layer_output_list); the other lists' lengths checked against them."""
    L, Lp = len(pre_mix_list), len(layer_output_list)
    lengths = {"layer_input_list": (len(layer_input_list), L), "post_mix_list": (len(post_mix_list), Lp),
               "comb_mix_list": (len(comb_mix_list), Lp), "residual_list": (len(residual_list), Lp)}
    for name, (got, expected) in lengths.items():
        if got != expected:
            raise limits.LimitError(f"{OP}: {name} holds {got} tensors, expected {expected}")
    H, m, L, Lp = _check(initial_residual.shape[-1], initial_residual.shape[-2], L, Lp)
    return RecomputeKey(H, m, L, Lp, int(num_vector_cores()))


def build_mhc_multilayer_recompute(hidden_size: int, hc_mult: int, layers: int, post_layers: int, num_cores: int):
    """prim_func(initial_residual (T,m,H) bf16, pre_mix_list_0..L-1 (T,m) f32, layer_output_list_0..Lp-1
    (T,H) bf16, post_mix_list_* (T,m) f32, comb_mix_list_* (T,m,m) f32, layer_input_list_0..L-1 (T,H) bf16,
    residual_list_0..Lp-1 (T,m,H) bf16); T is a dynamic dim.

    Per layer: ``layer_input = bf16(sum_i pre_i * R_i)`` (``vmul`` of i = 0, then ``vmula``, as
    ``pre_apply_mix.py``); with a post stage ``R'[o] = bf16(post_o * y + sum_i comb[i, o] * R_i)`` (``vmul``
    of the post term, then ``vmula`` for i ascending, as ``post.py``).
    """
    H, m, L, Lp = _check(hidden_size, hc_mult, layers, post_layers)
    P, stages = int(num_cores), PLAN.stages
    h_blk = PLAN.hidden_tile(H, mhc_multilayer_recompute_bytes_per_column(m, L, Lp))
    n_tiles = H // h_blk
    n_chunks = h_blk // LANES
    num_tokens = T.dynamic("num_tokens")

    # the VFs of the apply-mix forward (pre_apply_mix.py) and of the post forward (post.py) themselves
    apply_mix, post_stage = apply_mix_vf(m, n_chunks), post_vf(m, n_chunks)

    @T.prim_func
    def mhc_multilayer_recompute_asc(initial_residual: T.Tensor[(num_tokens, m, H), T.bfloat16]):
        pre_mix_list = _list_params("pre_mix_list", L, (num_tokens, m), T.float32)
        layer_output_list = _list_params("layer_output_list", Lp, (num_tokens, H), T.bfloat16)
        post_mix_list = _list_params("post_mix_list", Lp, (num_tokens, m), T.float32)
        comb_mix_list = _list_params("comb_mix_list", Lp, (num_tokens, m, m), T.float32)
        layer_input_list = _list_params("layer_input_list", L, (num_tokens, H), T.bfloat16)
        residual_list = _list_params("residual_list", Lp, (num_tokens, m, H), T.bfloat16)
        with T.Kernel(P) as core_id:
            # parity buffers (index l % 2): the residual in two, the rest in one per parity that occurs
            res_ub = [T.alloc_shared((m, h_blk), T.bfloat16) for _ in range(2 if Lp else 1)]
            y_ub = [T.alloc_shared((h_blk,), T.bfloat16) for _ in range(min(Lp, 2))]
            li_ub = [T.alloc_shared((h_blk,), T.bfloat16) for _ in range(min(L, 2))]
            pre_ub = [T.alloc_shared((PAD,), T.float32) for _ in range(min(L, 2))]
            post_ub = [T.alloc_shared((PAD,), T.float32) for _ in range(min(Lp, 2))]
            comb_ub = [T.alloc_shared((m, m), T.float32) for _ in range(min(Lp, 2))]
            T.annotate_buffer_versions({buf: stages for buf in res_ub + y_ub + li_ub + pre_ub + post_ub + comb_ub})
            for t, ht in T.Persistent([num_tokens, n_tiles], P, core_id, group_size=1, num_stages=stages):
                h0 = ht * h_blk
                T.copy(initial_residual[t, :, h0 : h0 + h_blk], res_ub[0], l2_cache_ctrl="NOTALLOC_KEEP")
                for layer in tuple(range(L)):  # a Python loop (unrolled): it picks the layer's buffers
                    p = layer % 2
                    if layer < Lp:
                        with T.Task():
                            T.copy(pre_mix_list[layer][t, :], pre_ub[p][0:m])
                            T.copy(post_mix_list[layer][t, :], post_ub[p][0:m])
                            T.copy(comb_mix_list[layer][t, :, :], comb_ub[p])
                            T.copy(layer_output_list[layer][t, h0 : h0 + h_blk], y_ub[p])
                        with T.Task():  # both VFs of the layer: one scheduler task on the vector pipe
                            apply_mix(res_ub[p], pre_ub[p], None, li_ub[p])
                            post_stage(y_ub[p], res_ub[p], post_ub[p], comb_ub[p], res_ub[1 - p])
                        with T.Task():
                            T.copy(li_ub[p], layer_input_list[layer][t, h0 : h0 + h_blk])
                            T.copy(res_ub[1 - p], residual_list[layer][t, :, h0 : h0 + h_blk])
                    else:
                        T.copy(pre_mix_list[layer][t, :], pre_ub[p][0:m])
                        apply_mix(res_ub[p], pre_ub[p], None, li_ub[p])
                        T.copy(li_ub[p], layer_input_list[layer][t, h0 : h0 + h_blk])

    return mhc_multilayer_recompute_asc


# One kernel per run of at most PLAN.layers_per_kernel layers (the launcher chains them; equal runs share theirs).
# Lowering cases: (L, Lp) in (1, 1), (3, 2), (3, 3), (10, 9), (10, 10).
KERNEL = Kernel(OP, RecomputeKey, build_mhc_multilayer_recompute, derive=_key,
                cases=lambda hidden_size, hc_mult: {
                    f"{OP}_l{layers}_lp{post}": RecomputeKey(hidden_size, hc_mult, layers, post, CASE_NUM_CORES)
                    for layers, post in ((1, 1), (3, 2), (3, 3), (10, 9), (10, 10))})


def mhc_multilayer_recompute(initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list,
                             layer_input_list, residual_list) -> None:
    """initial_residual (T,m,H) bf16; L tensors pre_mix_list (T,m) f32; Lp tensors layer_output_list (T,H)
    bf16, post_mix_list (T,m) (or (T,m,1)) f32, comb_mix_list (T,m,m) f32 -> L tensors layer_input_list
    (T,H) bf16 and Lp tensors residual_list (T,m,H) bf16 (all overwritten). Current stream, no sync."""
    key = KERNEL.key(initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list,
                     layer_input_list, residual_list)
    t, m = int(initial_residual.shape[0]), key.hc_mult
    for start, run, post_run in PLAN.chunks(key.layers, key.post_layers):
        kernel = KERNEL.compiled(dataclasses.replace(key, layers=run, post_layers=post_run))
        ends = slice(start, start + run), slice(start, start + post_run)
        kernel(
            initial_residual if start == 0 else residual_list[start - 1],
            *pre_mix_list[ends[0]], *layer_output_list[ends[1]], *(p.view(t, m) for p in post_mix_list[ends[1]]),
            *(c.view(t, m, m) for c in comb_mix_list[ends[1]]), *layer_input_list[ends[0]], *residual_list[ends[1]],
        )


KERNELS, lowering_cases, __all__ = kernel_module(__name__, KERNEL)
