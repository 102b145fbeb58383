"""The tests over several Engram ops at once: each checks ops or kernel modules together, so it cannot be split per
op without changing what it checks (the ops' own tests are in test_engram_<op module>.py).

* The gate's chain, ``engram_fused_weight`` -> ``engram_gate_forward`` / ``_inplace`` -> ``engram_gate_backward`` ->
  ``engram_grad_w_reduce`` (CPU tier): the fakes against the references, opcheck on the example calls
  (tests/engram/engram_cases.py), a compiled training step (one graph with all of them), a hidden size every one
  refuses, nothing written on bad input; the CUDA kernel modules' argument tables, the builders' range refusals and
  the reading of their vector, cp.async and TMA accesses (``_plugins.cuda_vectors``). Device tier: opcheck of the
  chain on the device.
* The family's kernel modules (CPU tier): both backends have the same kernels, one launcher declared per kernel,
  the token count a dynamic dimension of every kernel.
"""

import importlib
import re

import pytest
import torch
from _plugins import cases
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_device
from _plugins.levels import level_choice
from engram_ref import engram_fused_weight_ref, engram_gate_backward_ref, engram_gate_forward_ref
from engram_testing import BF16, CLAMP, EPS, HIDDEN, M, OPS, SETTINGS, all_args, expect
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import cann_ops_tilelang as ops
from cann_ops_tilelang import config
from cann_ops_tilelang.kernels import _family
from cann_ops_tilelang.kernels._kernel import Kernel
from cann_ops_tilelang.kernels.ascend import _build as ascend_build
from cann_ops_tilelang.kernels.ascend import engram as ascend_engram
from cann_ops_tilelang.kernels.ascend.engram import gate as ascend_gate
from cann_ops_tilelang.kernels.cuda import _build as cuda_build
from cann_ops_tilelang.kernels.cuda import engram as cuda_engram
from cann_ops_tilelang.kernels.cuda.engram import gate as cuda_gate


TOKENS = level_choice([0, 1, 7], [0, 1, 7, 33], [0, 1, 7, 33, 130])


def metadata(t):
    return (t.shape, t.dtype, t.stride(), t.device.type)


# --- the gate's chain: fakes, opcheck, a compiled training step ---------------------------------------


def gate_calls(tokens, masked, seed):
    """The example calls (tests/engram/engram_cases.py) of the gate's ops: the fused weight, the forward saving the
    statistics or not, in place, the backward (given the reference forward's statistics), the weight reduction."""
    gate = dict(masked=masked)
    variants = [("engram_fused_weight", {}), ("engram_gate_forward", {**gate, "save_for_backward": True}),
                ("engram_gate_forward", {**gate, "save_for_backward": False}), ("engram_gate_forward_inplace", gate),
                ("engram_gate_backward", gate), ("engram_grad_w_reduce", {})]
    return [(name, cases.call(name, tokens, HIDDEN, seed=seed, **variant)) for name, variant in variants]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("save", [False, True])
def test_fakes_match_references(tokens, masked, save, seed):
    """The fakes on the example calls against the reference functions' own results."""
    fused = cases.call("engram_fused_weight", tokens, HIDDEN, seed=seed)
    fwd = cases.call("engram_gate_forward", tokens, HIDDEN, seed=seed, masked=masked, save_for_backward=save)
    bwd = cases.call("engram_gate_backward", tokens, HIDDEN, seed=seed, masked=masked)
    partials = config.grad_w_partials("cpu", HIDDEN)
    real = {
        "fused": [engram_fused_weight_ref(**fused)],
        "fwd": list(engram_gate_forward_ref(**fwd)),
        "bwd": list(engram_gate_backward_ref(**bwd, partials=partials)),
    }
    mode = FakeTensorMode()

    def faked(call):
        return {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in call.items()}

    with mode:
        fake = {
            "fused": [ops.engram_fused_weight(**faked(fused))],
            "fwd": list(torch.ops.cann_ops_tilelang.engram_gate_forward(**faked(fwd))),
            "bwd": list(ops.engram_gate_backward(**faked(bwd))),
        }
    for key in real:
        assert [metadata(t) for t in fake[key]] == [metadata(t) for t in real[key]], key


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(tokens, masked, seed):
    for name, call in gate_calls(tokens, masked, seed):
        torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, name).default, tuple(call.values()))


def test_compile_inplace_and_bwd_graphs(seed):
    def step(x, kv, wf, mask):
        out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)
        gx, gkv, part = ops.engram_gate_backward(out, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
        gwh = torch.zeros_like(wf)
        gwe = torch.zeros_like(wf)
        ops.engram_grad_w_reduce(part, x[0], x[1], gwh, gwe)
        y = x.clone()
        ops.engram_gate_forward(y, kv, wf, EPS, CLAMP, False, mask, inplace=True)
        return gx, gkv, gwh, gwe, y

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (6, 11):
            x, kv, wh, we, wf, mask = all_args(tokens, True, seed + tokens)
            for a, b in zip(compiled(x, kv, wf, mask), step(x, kv, wf, mask)):
                assert torch.equal(a, b)


# --- the gate's chain: validation ---------------------------------------------------------------------


@given(hidden=st.integers(1, 9000).filter(lambda h: h % 256 != 0 or h < 512 or h > 8192))
@SETTINGS
def test_unsupported_hidden_size(hidden):
    for name, (fn, make) in OPS.items():
        kwargs = make(hidden=hidden)
        first = next(iter(kwargs))
        message = expect(ValueError, fn, kwargs, name, first)
        assert str(hidden) in message


def test_nothing_written_on_bad_input():
    """A real call with one bad argument leaves the in-place buffers untouched."""
    hidden = 512
    gwh = torch.full((M, hidden), 3.0)
    gwe = torch.full((M, hidden), 5.0)
    partial = torch.ones(7, M, hidden)
    wh = torch.ones(M, hidden, dtype=BF16)
    we = torch.ones(M, hidden + 256, dtype=BF16)  # wrong shape
    with pytest.raises(ValueError, match=r"engram_grad_w_reduce: argument 'weight_embed': expected shape"):
        ops.engram_grad_w_reduce(partial, wh, we, gwh, gwe)
    assert torch.equal(gwh, torch.full((M, hidden), 3.0))
    assert torch.equal(gwe, torch.full((M, hidden), 5.0))
    x = torch.ones(2, M, hidden, dtype=BF16)
    with pytest.raises(ValueError, match=r"engram_gate_forward_inplace: argument 'kv': expected shape"):
        ops.engram_gate_forward(x, torch.ones(2, M, hidden, dtype=BF16), torch.ones(M, hidden), 1e-6, 1e-6,
                            False, None, True)
    assert torch.equal(x, torch.ones(2, M, hidden, dtype=BF16))


# --- the gate's chain: kernel modules -----------------------------------------------------------------


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


# --- the family's kernel modules ----------------------------------------------------------------------


# op module -> the launchers of its kernel module (each lowering case is named after the one that launches it)
LAUNCHERS = {
    "fused_weight": ("engram_fused_weight",),
    "gate": ("engram_gate_forward", "engram_gate_backward"),
    "grad_w_reduce": ("engram_grad_w_reduce",),
    "sinkhorn": ("engram_sinkhorn_momentum_update", "engram_sinkhorn_step", "engram_sinkhorn_step_reduce",
                 "engram_sinkhorn_finalize"),
    "hash": ("engram_hash",),
}


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


# --- device tier: opcheck of the gate's chain ---------------------------------------------------------


@requires_device
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck_on_device(masked, device, seed):
    """The gate's ops on their example calls (tests/engram/engram_cases.py) at T = 37, H = 512, on the device."""
    gate = dict(masked=masked)
    variants = [("engram_fused_weight", {}), ("engram_gate_forward", {**gate, "save_for_backward": True}),
                ("engram_gate_forward", {**gate, "save_for_backward": False}), ("engram_gate_forward_inplace", gate),
                ("engram_gate_backward", gate), ("engram_grad_w_reduce", {"partials": 7})]
    for name, variant in variants:
        args = cases.call(name, 37, 512, seed=seed, device=device, **variant)
        torch.library.opcheck(getattr(torch.ops.cann_ops_tilelang, name).default, tuple(args.values()))
