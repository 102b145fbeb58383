"""CPU tier: every Engram kernel lowers for both targets at the model hidden sizes (4096, 7168; the range's edges in
tests/test_limits.py).

* Ascend 950: lowered to AscendC on the CPU (no CANN needed); the dynamic UB size the lowered kernel
  requests must fit the budget (248 KiB, 216 KiB with a SimtVF region).
* CUDA: lowered for sm_90a and compiled to a cubin with nvcc (skipped when nvcc is absent); the
  lowered kernel's dynamic shared memory must fit the 227 KiB of one H200 CTA and its CTA the
  1024-thread limit.
* JIT cache keys: the compile-time key of every launcher is the same for two token counts, and the
  token count is a dynamic dimension of every kernel (a new T never compiles a new kernel).
"""

import dataclasses
import importlib
import re
import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared

pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels import _family  # noqa: E402
from cann_ops_tilelang.kernels._kernel import Kernel  # noqa: E402
from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import engram as ascend_engram  # noqa: E402
from cann_ops_tilelang.kernels.ascend.engram import gate as ascend_gate  # noqa: E402
from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda import engram as cuda_engram  # noqa: E402
from cann_ops_tilelang.kernels.cuda.engram import gate as cuda_gate  # noqa: E402

# The sizes that matter: the model sizes H = 4096 and 7168 here (CUDA: sm_90a cubins, their vector accesses checked
# against the ops' declarations; budgets checked at the largest, 7168); the range's edges (512, 8192) are lowered on
# both backends with their budgets by tests/test_limits.py. Other sizes take the same code paths.
HIDDEN = [4096, 7168]
# op module -> the launchers of its kernel module (each lowering case is named after the one that launches it)
LAUNCHERS = {
    "fused_weight": ("engram_fused_weight",),
    "gate": ("engram_gate_forward", "engram_gate_backward"),
    "grad_w_reduce": ("engram_grad_w_reduce",),
    "sinkhorn": ("engram_sinkhorn_momentum_update", "engram_sinkhorn_step", "engram_sinkhorn_step_reduce",
                 "engram_sinkhorn_finalize"),
    "hash": ("engram_hash",),
}


# op modules whose kernels do not depend on the hidden size: lowered at the first H only
SIZE_FREE = ("hash/", "sinkhorn/")


def cases(module):
    return [(h, name) for h in HIDDEN for name in sorted(module.lowering_cases(h))
            if h == HIDDEN[0] or not name.startswith(SIZE_FREE)]


@pytest.mark.parametrize("hidden,name", cases(ascend_engram))
def test_ascend_lowers_within_ub(hidden, name):
    prim_func = ascend_engram.lowering_cases(hidden)[name]
    lowered = ascend_build.lower_ascendc(prim_func)
    assert "__aicore__" in lowered.source or "__global__" in lowered.source, lowered.source[:400]
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (
        f"{name} at H={hidden}: UB {lowered.ub_bytes} B > budget {lowered.budget_bytes} B"
    )


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden,name", cases(cuda_engram))
def test_cuda_compiles_to_sm90a_cubin(hidden, name):
    prim_func = cuda_engram.lowering_cases(hidden)[name]
    built = cuda_build.compile_cubin(prim_func, arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
    # launch resources of the lowered kernel within the H200's per-CTA limits
    assert built.fits, (
        f"{name} at H={hidden}: shared memory {built.smem_bytes} B (budget {built.budget_bytes} B), "
        f"{built.threads} threads per CTA"
    )
    # every argument its ops pass in and the kernel accesses in vectors is declared (op helper's alignment check)
    assert not undeclared(name, built.source, declared_vector_args())


def test_both_backends_have_the_same_kernels():
    # the CUDA forward has no statistics-free variant (it always writes them): compare without that flag; the
    # CUDA reduction's vector schedule is a second kernel of the same op for aligned buffers, the CUDA momentum
    # update's small-table plan one for small buffers, and the CUDA step has two more: its split schedule and the
    # kernel that adds the pieces' rows
    def families(module):
        return sorted({re.sub(r"_(no)?save|_vector$|_small$|_split$|_combine$", "", name)
                       for name in module.lowering_cases(4096)})

    assert families(ascend_engram) == families(cuda_engram)
    for family in (ascend_engram, cuda_engram):
        assert _family.op_modules(family.__name__) == tuple(sorted(LAUNCHERS))
        for op_module, launchers in LAUNCHERS.items():
            module = importlib.import_module(f"{family.__name__}.{op_module}")
            for name in launchers:
                assert callable(getattr(module, name)), (module.__name__, name)
                kernel = module.KERNELS[name]  # the launcher's kernel, declared with kernels._kernel.Kernel
                assert isinstance(kernel, Kernel) and callable(kernel.key) and callable(kernel.compiled), name
                assert kernel.build is getattr(module, f"build_{name}"), (module.__name__, name)
            # every case of the kernel module is named after the launcher that launches it
            for case in module.lowering_cases(4096):
                assert any(case == n or case.startswith(n + "_") for n in launchers), (module.__name__, case)
        # the family only aggregates: "<op module>/<case>" over its kernel modules
        assert all(name.split("/", 1)[0] in LAUNCHERS for name in family.lowering_cases(512))


def test_cuda_argument_and_launcher_checked_tables_name_real_parameters_and_cases():
    """``ARGUMENTS`` of a CUDA kernel module maps parameters of its generated kernels to op arguments, and
    ``LAUNCHER_CHECKED`` names lowering cases of that module (the ops' alignment check reads both)."""
    from _plugins.cuda_vectors import kernel_params

    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce

    for module in (cuda_gate, grad_w_reduce):
        cases = module.lowering_cases(7168)
        params = set()
        for prim_func in cases.values():
            params |= set(kernel_params(cuda_build.lower_source(prim_func)))
        assert set(module.ARGUMENTS) <= params, (module.__name__, set(module.ARGUMENTS) - params)
        assert set(getattr(module, "LAUNCHER_CHECKED", {})) <= set(cases), module.__name__
    assert grad_w_reduce.LAUNCHER_CHECKED == {"engram_grad_w_reduce_vector": grad_w_reduce.VECTOR_UPDATE_WIDTHS}


def test_builders_refuse_values_outside_the_ranges():
    """A builder (or the CUDA backward's plan) called directly with a size outside ``limits`` raises
    ``limits.LimitError`` naming the range, never an assert."""
    from cann_ops_tilelang.kernels.ascend.engram import fused_weight as ascend_fused
    from cann_ops_tilelang.kernels.ascend.engram import grad_w_reduce as ascend_reduce
    from cann_ops_tilelang.kernels.cuda.engram import fused_weight as cuda_fused
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as cuda_reduce
    from cann_ops_tilelang.limits import LimitError

    calls = [
        (lambda: ascend_gate.build_engram_gate_forward(4096, 2, True, False, False, 64), "hc_mult must be 4"),
        (lambda: ascend_gate.build_engram_gate_forward(8448, 4, True, False, False, 64), r"in \[512, 8192\]"),
        (lambda: ascend_gate.build_engram_gate_forward(4096, 4, True, False, False, 63), "num_cores"),
        (lambda: ascend_gate.build_engram_gate_backward(4160, 4, False, 16, 64), "a multiple of 256"),
        (lambda: ascend_gate.build_engram_gate_backward(4096, 4, False, 0, 64), "num_partials"),
        (lambda: ascend_fused.build_engram_fused_weight(100, 64), "engram_fused_weight"),
        (lambda: ascend_reduce.build_engram_grad_w_reduce(ascend_reduce.max_partials() + 1, 4 * 4096, 64),
         "num_partials"),
        (lambda: cuda_gate.build_engram_gate_forward(256, 4, False, False), "engram_gate_forward"),
        (lambda: cuda_gate.build_engram_gate_backward(4096, 4, 0, False), "num_partials"),
        (lambda: cuda_gate.bwd_plan(4096, 3), "hc_mult must be 4"),
        (lambda: cuda_fused.build_engram_fused_weight(100), "engram_fused_weight"),
        (lambda: cuda_reduce.build_engram_grad_w_reduce(9216, 4, 66), "engram_grad_w_reduce"),
    ]
    for call, match in calls:
        with pytest.raises(LimitError, match=match):
            call()
    # the most rows of the Ascend reduction still fit the UB at the narrowest block
    assert ascend_reduce.reduce_ub_bytes(ascend_reduce.max_partials(), 64) <= ascend_build.UB_BUDGET_BYTES


def _dynamic_token_dim(prim_func):
    """The leading dims of the kernel's tensor parameters."""
    dims = []
    for param in prim_func.params:
        buf = prim_func.buffer_map.get(param)
        if buf is None:
            continue
        dims.append(buf.shape[0])
    return dims


@pytest.mark.parametrize("module", [ascend_engram, cuda_engram], ids=["ascend", "cuda"])
def test_token_count_is_dynamic(module):
    from tvm import tirx

    for name, prim_func in module.lowering_cases(2560).items():
        if "fused_weight" in name or "grad_w_reduce" in name:
            continue  # no token dimension
        dims = _dynamic_token_dim(prim_func)
        assert any(isinstance(d, tirx.Var) for d in dims), f"{name}: no dynamic leading dim in {dims}"


def _gate_tensors(tokens, hidden=512, masked=True):
    m = 4
    x = torch.zeros(tokens, m, hidden, dtype=torch.bfloat16)
    return dict(
        x=x,
        out=torch.empty_like(x),
        dot=torch.empty(tokens, m),
        mask=torch.zeros(tokens, dtype=torch.bool) if masked else None,
        partial=torch.empty(16, m, hidden),
    )


@pytest.mark.parametrize("masked", [False, True])
def test_two_token_counts_give_one_cache_key(masked, monkeypatch):
    """The compile-time key of every launcher ignores the token count."""
    monkeypatch.setattr(ascend_gate, "num_vector_cores", lambda: 64)
    keys = []
    for tokens in (509, 8001):
        t = _gate_tensors(tokens, masked=masked)
        keys.append((
            cuda_gate.FORWARD.key(t["x"], t["out"], t["mask"]),
            cuda_gate.FORWARD.key(t["x"], t["x"], t["mask"]),
            cuda_gate.BACKWARD.key(t["x"], t["partial"], t["mask"]),
            ascend_gate.FORWARD.key(t["x"], t["mask"], t["out"], t["dot"]),  # statistics saved
            ascend_gate.FORWARD.key(t["x"], t["mask"], t["x"], None),  # in place, not saved
            ascend_gate.BACKWARD.key(t["x"], t["mask"], t["partial"]),
        ))
    assert keys[0] == keys[1]
    assert all(509 not in dataclasses.astuple(key) and 8001 not in dataclasses.astuple(key) for key in keys[0])
    # the flags that do change the kernel do change the key
    assert len({keys[0][0], keys[0][1]}) == 2 and len({keys[0][3], keys[0][4]}) == 2
    t = _gate_tensors(509, masked=masked)
    assert cuda_gate.FORWARD.key(t["x"], t["out"], t["mask"], False) != keys[0][0]
    assert cuda_gate.BACKWARD.key(t["x"], t["partial"], t["mask"], False) != keys[0][2]
    assert ascend_gate.FORWARD.key(t["x"], t["mask"], t["out"], t["dot"], False) != keys[0][3]
    assert ascend_gate.BACKWARD.key(t["x"], t["mask"], t["partial"], False) != keys[0][5]


def test_gate_no_residual_kernels():
    """Without the residual the forward stores ``bf16(g * v)`` (no ``x`` in the output expression) and
    refuses an in-place build on both backends; the CUDA sources of both directions differ from the residual
    ones only where documented (the backward's ``grad_x`` drops ``go``)."""
    from cann_ops_tilelang.kernels.cuda.engram.gate import backward, forward

    for build, kwargs in ((forward.build_engram_gate_forward, dict(hidden_size=4096, hc_mult=4, has_mask=True,
                                                               inplace=True, residual=False)),
                          (lambda **kw: ascend_gate.build_engram_gate_forward(4096, 4, False, True, True, 64, **kw),
                           dict(residual=False))):
        with pytest.raises(ValueError, match="no in-place kernel without the residual"):
            build(**kwargs)
    cases = cuda_gate.lowering_cases(7168)
    for mask in ("mask", "nomask"):
        with_res = cuda_build.lower_source(cases[f"engram_gate_forward_{mask}"])
        without = cuda_build.lower_source(cases[f"engram_gate_forward_noresidual_{mask}"])
        assert with_res != without
        bwd_res = cuda_build.lower_source(cases[f"engram_gate_backward_{mask}"])
        bwd_nores = cuda_build.lower_source(cases[f"engram_gate_backward_noresidual_{mask}"])
        assert bwd_res != bwd_nores
    assert {f"engram_gate_backward_noresidual_pipelined_{m}" for m in ("mask", "nomask")} <= set(cases)
    assert backward.bwd_plan(7168, 4).pipe


def test_gate_fwd_layout():
    """The CUDA forward's summation groups cover the row exactly once; one warp serves a stream exactly
    where H <= 4096 and no vector slot is guarded (else one warp per group; without the residual one per two
    groups); at most 16 vectors per thread and 2048 threads per SM."""
    from cann_ops_tilelang.chips import H200
    from cann_ops_tilelang.kernels.cuda.engram.gate import forward

    def fields(layout):
        return (layout.warps_per_stream, layout.groups_per_stream, layout.vectors, layout.guarded,
                layout.min_blocks)

    for hidden in range(256, 8193, 256):
        wps, gps, nv, guarded, min_blocks = fields(forward.fwd_layout(hidden, 4))
        n32 = hidden // 256
        assert gps % wps == 0 and nv * gps >= n32 and (nv * gps == n32) != guarded, (hidden, wps, gps, nv)
        assert 4 * 32 * wps * min_blocks <= 2048 and nv * (gps // wps) <= 16, (hidden, wps, nv, min_blocks)
        assert (wps == 1) == (hidden <= 4096 and not guarded), (hidden, wps, guarded)
        assert wps in (1, gps), (hidden, wps, gps)
        # without the residual: the same summation groups (the same sums, bit for bit), half the warps per
        # stream where several serve it, at twice the registers per thread (128)
        wps_nores, *rest = fields(forward.fwd_layout(hidden, 4, residual=False))
        assert rest == [gps, nv, guarded, min_blocks], hidden
        assert wps_nores == (1 if wps == 1 else wps // 2), hidden
        regs = H200.arch.regs_per_sm // (4 * 32 * wps_nores * min_blocks)
        assert regs >= 128 and nv * (gps // wps_nores) <= 16, hidden
    assert forward.fwd_layout(4096, 4) == forward.FwdLayout(1, 4, 4, False, 4)
    assert forward.fwd_layout(7168, 4) == forward.FwdLayout(4, 4, 7, False, 2)
    assert forward.fwd_layout(7168, 4, residual=False) == forward.FwdLayout(2, 4, 7, False, 2)


def test_gate_bwd_split_schedule():
    """The CUDA backward splits the columns over a 2-CTA cluster exactly where the full width cannot
    keep the weight-gradient accumulators in registers, and only where the split is possible (H / 2 a
    multiple of 256); the split kernel is launched as clusters, one worker (row of the partials) per
    cluster, and exchanges the dL/dg partials through distributed shared memory."""
    from cann_ops_tilelang import config
    from cann_ops_tilelang import policy
    from cann_ops_tilelang.kernels.cuda.engram.gate import backward

    for hidden in range(512, 8193, 256):
        plan = backward.bwd_plan(hidden, 4)
        whole = policy.column_plan(hidden, 4)
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.split = 3  # a frozen plan
        if plan.split == 1:
            assert plan == dataclasses.replace(whole, split=1)
            assert whole.gw_regs or hidden % 512 != 0, hidden
        else:
            assert plan.split == 2 and not whole.gw_regs and hidden % 512 == 0, hidden
            assert plan.gw_regs and plan.threads * 2 == hidden // 8, (hidden, plan)
        # P: one row per worker, 132 SMs on CUDA (the fakes' device-free count), 16 on Ascend
        assert config.grad_w_partials("cuda", hidden) == 132 // plan.split, hidden
        assert config.grad_w_partials("meta", hidden) == 132 // plan.split, hidden
        assert config.grad_w_partials("npu", hidden) == 16
    assert backward.bwd_plan(7168, 4).split == 2 and config.grad_w_partials("cuda", 7168) == 66
    assert backward.bwd_plan(4096, 4).split == 1 and config.grad_w_partials("cuda", 4096) == 132
    # the token-pipelined variant: every split schedule whose second x/k buffer fits (all but H = 8192)
    pipelined = [h for h in range(512, 8193, 256) if backward.bwd_plan(h, 4).pipe]
    assert pipelined == [h for h in range(4608, 8192, 512)], pipelined
    with pytest.raises(ValueError, match="no pipelined schedule at hidden_size 4096"):
        backward.build_engram_gate_backward(4096, 4, 132, False, pipelined=True)
    assert {"gate/engram_gate_backward_pipelined_mask", "gate/engram_gate_backward_pipelined_nomask"} <= set(
        cuda_engram.lowering_cases(7168)
    )
    source = cuda_build.lower_source(backward.build_engram_gate_backward(7168, 4, 66, False))
    assert "cluster_arrive" in source and "st.shared::cluster" in source
    source = cuda_build.lower_source(backward.build_engram_gate_backward(4096, 4, 132, False))
    assert "cluster" not in source.split("engram_gate_backward_cuda_kernel", 1)[1]


@pytest.mark.parametrize("hidden,partials,tokens,expected", [
    (7168, 66, 1, "pipelined"), (7168, 66, 2112, "pipelined"), (7168, 66, 2113, "plain"),
    (7168, 66, 8192, "plain"), (7168, 132, 4224, "pipelined"), (7168, 132, 4225, "plain"),
    (4096, 132, 512, "plain"), (8192, 66, 512, "plain"), (7168, 131, 512, "pipelined"),
])
def test_gate_bwd_launcher_picks_the_pipelined_kernel_by_tokens_per_worker(monkeypatch, hidden, partials, tokens,
                                                                           expected):
    """The CUDA backward launcher takes the token-pipelined kernel of its key where the key has one and a
    worker gets at most ``_PIPE_MAX_PER`` (32) tokens, else the plain one; the kernels come from one
    compile per key, whatever the token count."""
    from cann_ops_tilelang.kernels.cuda.engram.gate import backward

    calls, keys = [], []

    def fake_kernels(key):
        keys.append(key)
        plain = lambda *args: calls.append("plain")  # noqa: E731
        pipelined = lambda *args: calls.append("pipelined")  # noqa: E731
        return plain, (pipelined if backward.bwd_plan(key.hidden_size, key.hc_mult).pipe else None)

    monkeypatch.setattr(backward.BACKWARD, "compiled", fake_kernels)
    meta = dict(device="meta")
    x = torch.empty(tokens, 4, hidden, dtype=torch.bfloat16, **meta)
    kv = torch.empty(tokens, 5, hidden, dtype=torch.bfloat16, **meta)
    stats = torch.empty(tokens, 4, **meta)
    part = torch.empty(partials, 4, hidden, **meta)
    # keyword arguments, as the op layer calls the launcher (through the kernel module ``gate``)
    cuda_gate.engram_gate_backward(
        grad_out=x, hidden_states=x, kv=kv, weight_fused=torch.empty(4, hidden, **meta), dot=stats,
        gate_score=stats, rstd_x=stats, rstd_k=stats, image_token_mask=None, clamp_value=1e-6,
        grad_hidden_states=torch.empty_like(x), grad_kv=torch.empty_like(kv), grad_w_partial=part,
    )
    assert calls == [expected] and keys == [backward.BwdKey(hidden, 4, partials, False, True)]


@pytest.mark.parametrize("partials", [1, 2, 66, 113, 128, 129, 132, 133, 257, 400, 1000])
def test_cuda_grad_w_reduce_chunks_sum_every_row_once_in_order(partials):
    """The TMA chunks of the CUDA weight-gradient reduction (boxes of ``rows`` rows, the last one starting at
    ``P - rows`` and skipping what the one before summed) visit rows 0 .. P-1 exactly once, ascending, with
    every box inside the tensor, at most 128 rows per box, at least two boxes (the sum of one overlaps the
    load of the next) and the buffers in flight within shared memory."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    plan = gwr.chunk_plan(partials)
    chunks, rows, nbuf = plan.chunks, plan.rows, plan.buffers
    assert 1 <= rows <= 128 and 1 <= nbuf <= min(chunks, 3) and chunks >= min(2, partials)
    assert nbuf * rows * 128 * 4 <= 227 * 1024
    order = []
    for c in range(chunks):
        start = min(c * rows, partials - rows)
        assert 0 <= start and start + rows <= partials
        order += [start + i for i in range(rows) if start + i >= c * rows]
    assert order == list(range(partials))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("vector,partials", [(False, p) for p in (1, 2, 7, 133, 400, 1001)]
                         + [(True, p) for p in (1, 2, 5, 7, 64, 65, 66)])
def test_cuda_grad_w_reduce_paths_compile(vector, partials):
    """The reduction's paths the default P does not take compile within the per-CTA limits. TMA: one row (a
    1-D bulk copy), two chunks of one row, a last chunk that skips rows, a refilled buffer, a buffer filled
    three times. Vectors: one row in one group, two groups of one row, a short last group, the most rows."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    built = cuda_build.compile_cubin(gwr.build_engram_grad_w_reduce(512, 4, partials, vector), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits, (built.smem_bytes, built.budget_bytes)


@pytest.mark.parametrize("partials,rows,groups", [(1, 1, 1), (2, 1, 2), (5, 2, 3), (9, 3, 3), (66, 17, 4)])
def test_cuda_grad_w_reduce_vector_waits_for_each_group(partials, rows, groups):
    """The vector schedule commits ``groups`` groups of ``ceil(P / 4)`` row copies, then per summing step
    waits until at most ``groups - 1`` are pending and commits one (empty) group: so step g sums only rows
    whose groups 0 .. g have landed, whatever the number of groups."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    source = cuda_build.lower_source(gwr.build_engram_grad_w_reduce(512, 4, partials, vector=True))
    body = source[source.index("__global__ void __launch_bounds__"):]
    loops = re.findall(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\)", body)  # (variable, trips)
    # the issue loop (g, i) and the summing loop (g_1, i_1); one-trip loops are unrolled away
    assert loops == [(v, str(n)) for v, n in (("g", groups), ("i", rows), ("g_1", groups), ("i_1", rows)) if n > 1]
    assert re.findall(r"cp_async_wait<(\d+)>\(\)", body) == [str(groups - 1)]
    assert body.count("cp_async_commit()") == 2  # one in the issue loop, one (empty) per summing step
    assert body.index("cp_async_wait") < body.index("cp_async_commit", body.index("cp_async_wait"))


@pytest.mark.parametrize("cols", [64, 128, 1024])
def test_cuda_sinkhorn_step_streams_the_table_evict_first(cols):
    """The step's table rows come in by the evict-first helper only (kernels/cuda/_cp_async.py), every
    16-byte copy of the table one of them, inside the step's commit groups; the row scales by TileLang's
    4-byte cp.async; and the helper's PTX carries the L2 policy on the copy."""
    from cann_ops_tilelang.kernels.cuda import _cp_async
    from cann_ops_tilelang.kernels.cuda.engram import sinkhorn as sk

    for split in (False, True):  # the split schedule's row bounds are variables: TileLang guards the scale copy
        body = cuda_build.lower_source(sk.build_engram_sinkhorn_step(cols, split))
        body = body[body.index("__global__ void __launch_bounds__"):]
        hinted = re.findall(r"ops_cp_async16_evict_first\([^;]*?\)\),\s*\(&\((\w+)\[", body)
        plain = re.findall(r"cp_async_gs(?:_conditional)?<(\d+)>\([^;]*?\)\),\s*\(&\((\w+)\[", body)
        assert hinted and set(hinted) == {"matrix"}
        assert set(plain) == {("4", "row_scale")}
        assert body.index("ops_cp_async16_evict_first") < body.index("cp_async_commit")
    helper = _cp_async.PRELUDE[_cp_async.PRELUDE.index("ops_cp_async16_evict_first"):]
    assert '"l"(0x12f0000000000000ull)' in helper and _cp_async.L2_EVICT_FIRST_POLICY == 0x12F0000000000000
    assert "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, 16, %2;" in helper


def test_cuda_grad_w_reduce_takes_vectors_only_where_aligned():
    """The launcher's key: the vector schedule for P <= 66 when the weights start on 8-byte and the buffers on
    16-byte boundaries; the TMA schedule for more rows or for any one of the four at a smaller offset (a
    main_grad view into a flat bucket); the builder refuses vectors beyond 66 rows."""
    from cann_ops_tilelang.kernels.cuda.engram import grad_w_reduce as gwr

    hidden = 512
    fresh = {
        "weight_hidden": torch.zeros(4, hidden, dtype=torch.bfloat16),
        "weight_embed": torch.zeros(4, hidden, dtype=torch.bfloat16),
        "grad_weight_hidden": torch.zeros(4, hidden),
        "grad_weight_embed": torch.zeros(4, hidden),
    }

    def key(partials, **tensors):
        args = {**fresh, **tensors}
        return gwr.KERNEL.key(
            torch.zeros(partials, 4, hidden), args["weight_hidden"], args["weight_embed"],
            args["grad_weight_hidden"], args["grad_weight_embed"],
        )

    assert key(66) == gwr.ReduceKey(hidden, 4, 66, True) and key(1) == gwr.ReduceKey(hidden, 4, 1, True)
    assert key(67) == gwr.ReduceKey(hidden, 4, 67, False) and key(132) == gwr.ReduceKey(hidden, 4, 132, False)
    for name, width in gwr.VECTOR_UPDATE_WIDTHS.items():
        t = fresh[name]
        for offset in range(1, width // t.element_size()):
            view = torch.zeros(t.numel() + offset, dtype=t.dtype)[offset:].view(t.shape)
            assert view.data_ptr() % width == offset * t.element_size()
            assert key(66, **{name: view}) == gwr.ReduceKey(hidden, 4, 66, False), (name, offset)
        step = width // t.element_size()
        aligned = torch.zeros(t.numel() + step, dtype=t.dtype)[step:].view(t.shape)
        assert key(66, **{name: aligned}) == gwr.ReduceKey(hidden, 4, 66, True), name
    with pytest.raises(ValueError, match="engram_grad_w_reduce"):
        gwr.build_engram_grad_w_reduce(hidden, 4, 67, vector=True)


def test_vector_access_check_sees_vectors_cp_async_and_tma():
    """The source reading behind the alignment declarations (``_plugins.cuda_vectors``) finds 16-byte
    vector accesses, cp.async copies and TMA loads, and reports an argument whose width is not declared."""
    from _plugins.cuda_vectors import vector_accesses

    fused = cuda_build.lower_source(cuda_engram.lowering_cases(512)["fused_weight/engram_fused_weight"])
    assert vector_accesses(fused) == {"weight_hidden": 16, "weight_embed": 16, "weight_fused": 16}
    bwd = vector_accesses(cuda_build.lower_source(cuda_engram.lowering_cases(4096)["gate/engram_gate_backward_nomask"]))
    assert bwd["grad_out"] == 16 and "dot" not in bwd  # cp.async-staged rows; scalars read one at a time
    reduce = vector_accesses(
        cuda_build.lower_source(cuda_engram.lowering_cases(512)["grad_w_reduce/engram_grad_w_reduce"])
    )
    assert reduce.get("grad_w_partial_desc") == 16 and "grad_weight_hidden" not in reduce
    # the vector reduction: cp.async rows, and the weights and buffers its launcher checks (not the op)
    from cann_ops_tilelang.kernels.cuda.engram.grad_w_reduce import VECTOR_UPDATE_WIDTHS

    vector_case, tma_case = "grad_w_reduce/engram_grad_w_reduce_vector", "grad_w_reduce/engram_grad_w_reduce"
    vector_source = cuda_build.lower_source(cuda_engram.lowering_cases(7168)[vector_case])
    assert vector_accesses(vector_source) == {"grad_w_partial": 16, **VECTOR_UPDATE_WIDTHS}
    assert not undeclared(vector_case, vector_source, declared_vector_args())
    assert len(undeclared(tma_case, vector_source, declared_vector_args())) == 4  # were it unchecked
    declared = declared_vector_args()
    fused_case = "fused_weight/engram_fused_weight"
    assert not undeclared(fused_case, fused, declared)
    declared["engram_fused_weight"]["vector_args"] = {"weight_hidden": 16, "weight_embed": 8}
    assert undeclared(fused_case, fused, declared) == [
        f"{fused_case}: engram_fused_weight argument 'weight_embed' is accessed in 16-byte vectors, declared 8"
    ]
