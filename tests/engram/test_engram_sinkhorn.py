"""The Engram Sinkhorn optimizer ops and ``cann_ops_tilelang.optim.EngramSinkhorn`` (docs/ops/engram.md#sinkhorn).

CPU tier (the ops run their references, tests/engram/engram_ref.py): validation, the device-free CPU error,
fakes, opcheck, torch.compile traces, the references against independent fp32/fp64 arithmetic, the optimizer
against a plain PyTorch formulation of its update, determinism, zero rows, the state_dict round trip, refused
steps that change nothing (bitwise), the beta1/momentum alias under torch's schedulers, numpy numbers, bool-only
flags and misuse named by function and argument, and both backends' kernels lowered at the sizes that matter, at the
other widths and with mixed dtypes, the CUDA step's table streaming and schedules (DTensor tables:
tests/test_dtensor.py). Device tier (skipped without a GPU/NPU): every op against its reference on the device and
bitwise run to run, and the optimizer for a few steps.

The optimizer (src/cann_ops_tilelang/optim/sinkhorn.py) is the one user of the ops of
src/cann_ops_tilelang/engram/sinkhorn.py: its tests are here, with theirs.
"""

import copy
import io
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _plugins import cases
from _plugins.device import requires_cuda, requires_device
from _plugins.references import without_cpu_references
from engram_ref import (
    engram_sinkhorn_finalize_apply_ref,
    engram_sinkhorn_finalize_ref,
    engram_sinkhorn_momentum_update_ref,
    engram_sinkhorn_step_reduce_ref,
    engram_sinkhorn_step_ref,
    engram_sinkhorn_update_model,
    sinkhorn_worker_rows,
)
from engram_testing import lowering_tests
from torch._subclasses.fake_tensor import FakeTensorMode

import cann_ops_tilelang as ops
from cann_ops_tilelang.engram.sinkhorn import sinkhorn_partials
from cann_ops_tilelang.kernels.cuda import _build as cuda_build
from cann_ops_tilelang.optim import EngramSinkhorn, sinkhorn_update

BF16, F32 = torch.bfloat16, torch.float32
P_CUDA = sinkhorn_partials("cuda")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def table(rows, cols, seed, dtype=F32, zero_rows=()):
    t = torch.randn(rows, cols, generator=gen(seed)).to(dtype)
    for r in zero_rows:
        t[r] = 0
    return t


def bits(t):
    return t.detach().contiguous().view(torch.uint8) if t.numel() else t.detach().clone()


# --- validation ------------------------------------------------------------------------------------------


def _bad_calls():
    g, m = torch.randn(4, 64), torch.randn(4, 64)
    a, r, c = torch.randn(5, 64), torch.rand(5) + 0.5, torch.rand(64) + 0.5
    part, colsq = torch.rand(3, 64), torch.zeros(64)
    mom = ops.engram_sinkhorn_momentum_update
    step, red, fin = ops.engram_sinkhorn_step, ops.engram_sinkhorn_step_reduce, ops.engram_sinkhorn_finalize
    app = ops.engram_sinkhorn_finalize_apply
    return [
        (mom, (g.half(), m, 0.9, True), TypeError, "engram_sinkhorn_momentum_update", "grad"),
        (mom, (g, m.double(), 0.9, True), TypeError, "engram_sinkhorn_momentum_update", "momentum_buffer"),
        (mom, (g, torch.randn(2, 128), 0.9, True), ValueError, "engram_sinkhorn_momentum_update", "momentum_buffer"),
        (mom, (g, m, 1.5, True), ValueError, "engram_sinkhorn_momentum_update", "beta1"),
        (mom, (g, m, -0.1, True), ValueError, "engram_sinkhorn_momentum_update", "beta1"),
        (mom, (g, m, 0.9, "yes"), TypeError, "engram_sinkhorn_momentum_update", "nesterov"),
        (mom, (g.t(), m, 0.9, True), ValueError, "engram_sinkhorn_momentum_update", "grad"),
        (step, (torch.randn(5, 96), torch.rand(5), torch.rand(96), 1e-8), ValueError, "engram_sinkhorn_step", "matrix"),
        (step, (torch.randn(5, 1088), torch.rand(5), torch.rand(1088), 1e-8), ValueError, "engram_sinkhorn_step",
         "matrix"),
        (step, (a, torch.rand(4), c, 1e-8), ValueError, "engram_sinkhorn_step", "row_scale"),
        (step, (a, r, c.double(), 1e-8), TypeError, "engram_sinkhorn_step", "col_scale"),
        (step, (a.bfloat16(), r, c, 1e-8), TypeError, "engram_sinkhorn_step", "matrix"),
        (step, (a, r, c, -1.0), ValueError, "engram_sinkhorn_step", "eps"),
        (step, (a, r, c, 1e-50), ValueError, "engram_sinkhorn_step", "eps"),
        (red, (part, torch.zeros(128), c, 5, 1e-8), ValueError, "engram_sinkhorn_step_reduce", "col_sumsq"),
        (red, (torch.rand(3, 32), torch.zeros(32), torch.ones(32), 5, 1e-8), ValueError,
         "engram_sinkhorn_step_reduce", "col_sumsq_partial"),
        (red, (part, colsq, torch.ones(128), 5, 1e-8), ValueError, "engram_sinkhorn_step_reduce", "col_scale"),
        (red, (part, colsq, c.double(), 5, 1e-8), TypeError, "engram_sinkhorn_step_reduce", "col_scale"),
        (red, (part, colsq, c, 0, 1e-8), ValueError, "engram_sinkhorn_step_reduce", "rows"),
        (red, (part, colsq, c, 5.0, 1e-8), TypeError, "engram_sinkhorn_step_reduce", "rows"),
        (red, (part, colsq, c, 5, -1e-8), ValueError, "engram_sinkhorn_step_reduce", "eps"),
        (fin, (a, r, c, 1e-8, float("inf")), ValueError, "engram_sinkhorn_finalize", "alpha"),
        (fin, (a, r, c, 1e-8, 8.0, torch.empty(5, 32)), ValueError, "engram_sinkhorn_finalize_out", "out"),
        (fin, (a, r, c, 1e-8, 8.0, a), ValueError, "engram_sinkhorn_finalize_out", "out"),
        (app, (a, r, c, 1e-8, 8.0, torch.randn(5, 64).half(), 0.1, 1.0), TypeError, "engram_sinkhorn_finalize_apply",
         "param"),
        (app, (a, r, c, 1e-8, 8.0, torch.randn(4, 64), 0.1, 1.0), ValueError, "engram_sinkhorn_finalize_apply",
         "param"),
        (app, (a, r, c, 1e-8, 8.0, a, 0.1, 1.0), ValueError, "engram_sinkhorn_finalize_apply", "param"),
        (app, (a, r, c, 1e-8, 8.0, torch.randn(5, 64), float("nan"), 1.0), ValueError,
         "engram_sinkhorn_finalize_apply", "lr"),
        (app, (a, r, c, 1e-8, 8.0, torch.randn(5, 64), 0.1, float("inf")), ValueError,
         "engram_sinkhorn_finalize_apply", "decay"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_calls_name_op_and_argument_and_write_nothing(index):
    fn, args, exc, op, arg = _bad_calls()[index]
    before = [bits(t) for t in args if isinstance(t, torch.Tensor)]
    with without_cpu_references(), pytest.raises(exc, match=rf"cann_ops_tilelang::{op}: argument '{arg}'"):
        fn(*args)
    after = [bits(t) for t in args if isinstance(t, torch.Tensor)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_cpu_tensors_get_a_clear_error():
    a, r, c = torch.randn(5, 64), torch.rand(5), torch.rand(64)
    with without_cpu_references():
        with pytest.raises(RuntimeError, match="engram_sinkhorn_step: no kernel for tensors on device 'cpu'"):
            ops.engram_sinkhorn_step(a, r, c, 1e-8)
        with pytest.raises(RuntimeError, match="engram_sinkhorn_momentum_update: no kernel .* supported devices"):
            ops.engram_sinkhorn_momentum_update(torch.randn(256), torch.zeros(256), 0.9, True)
        opt = EngramSinkhorn([torch.nn.Parameter(torch.randn(4, 64))])
        opt.param_groups[0]["params"][0].grad = torch.randn(4, 64)
        with pytest.raises(RuntimeError, match="no kernel for tensors on device 'cpu'"):
            opt.step()


def test_partial_rows_per_device_type():
    assert sinkhorn_partials("cuda") == 528 and sinkhorn_partials("meta") == 528
    assert sinkhorn_partials("npu") == 64 and sinkhorn_partials("privateuseone") == 64


@pytest.mark.parametrize("kwargs,exc", [
    (dict(lr=-1.0), ValueError), (dict(beta1=1.5), ValueError), (dict(nesterov=1), TypeError),
    (dict(sinkhorn_iters=-1), ValueError), (dict(sinkhorn_iters=True), TypeError), (dict(eps=0.0), ValueError),
    (dict(alpha=0.0), ValueError), (dict(weight_decay=-0.1), ValueError),
])
def test_optimizer_refuses_bad_hyper_parameters(kwargs, exc):
    with pytest.raises(exc, match="EngramSinkhorn"):
        EngramSinkhorn([torch.nn.Parameter(torch.randn(4, 64))], **kwargs)


@pytest.mark.parametrize("group,exc", [
    (dict(sinkhorn_iters=-2), ValueError), (dict(sinkhorn_iters=2.5), TypeError), (dict(lr=-5.0), ValueError),
    (dict(lr=True), ValueError), (dict(lr=1e300), ValueError), (dict(alpha=-1.0), ValueError),
    (dict(eps=0.0), ValueError), (dict(weight_decay=float("inf")), ValueError), (dict(nesterov="yes"), TypeError),
    (dict(beta1=0.5, momentum=0.4), ValueError),
])
def test_optimizer_checks_every_param_group_and_registers_none_it_refuses(group, exc):
    table = torch.nn.Parameter(torch.randn(4, 64))
    with pytest.raises(exc, match="EngramSinkhorn"):
        EngramSinkhorn([{"params": [table], **group}])
    opt = EngramSinkhorn([table])
    with pytest.raises(exc, match="EngramSinkhorn"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 64))], **group})
    with pytest.raises(ValueError, match="EngramSinkhorn: expected a table width"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 100))]})
    assert len(opt.param_groups) == 1


def test_optimizer_takes_named_parameters_generators_and_keeps_the_callers_group():
    table = torch.nn.Embedding(8, 64)
    opt = EngramSinkhorn(table.named_parameters())  # (name, tensor) pairs, as torch's optimizers take them
    assert opt.param_groups[0]["param_names"] == ["weight"]
    opt = EngramSinkhorn(p for p in table.parameters())
    group = {"params": [torch.nn.Parameter(torch.randn(4, 64))], "momentum": 0.3}
    opt.add_param_group(group)
    assert opt.param_groups[-1] is group and group["beta1"] == group["momentum"] == 0.3
    assert len(opt.param_groups[0]["params"]) == 1
    with pytest.raises(ValueError, match="EngramSinkhorn: expected a table width"):
        EngramSinkhorn(torch.nn.Embedding(8, 100).named_parameters())


def test_optimizer_group_momentum_alias_and_gradient_kind():
    tables = [torch.nn.Parameter(torch.randn(4, 64)) for _ in range(2)]
    opt = EngramSinkhorn([{"params": [tables[0]], "momentum": 0.25}, {"params": [tables[1]]}], beta1=0.5)
    assert [(g["beta1"], g["momentum"]) for g in opt.param_groups] == [(0.25, 0.25), (0.5, 0.5)]
    tables[0].grad_dtype = None  # torch refuses a gradient of another dtype unless told
    tables[0].grad = torch.ones(4, 64, dtype=torch.int32)
    with pytest.raises(TypeError, match="EngramSinkhorn: expected a floating-point gradient, got torch.int32"):
        opt.step()


@pytest.mark.parametrize("shape,dtype,exc", [
    ((256,), F32, ValueError), ((4, 96), F32, ValueError), ((4, 64), torch.float16, TypeError),
])
def test_optimizer_refuses_tables_without_kernels(shape, dtype, exc):
    with pytest.raises(exc, match="EngramSinkhorn"):
        EngramSinkhorn([torch.nn.Parameter(torch.randn(shape).to(dtype))])


# --- fakes, opcheck, compile -----------------------------------------------------------------------------


def _op_calls(rows, cols, seed):
    """The optimizer ops' example calls (tests/engram/engram_cases.py) on a ``(rows, cols)`` table, with the
    variants that matter: the momentum's dtypes on a flat gradient of any element count, 7 partial rows whatever
    the table's, the finalize's alphas and the applied table's dtypes and decays."""

    def call(name, **variant):
        args = cases.call(name, rows, seed=seed, cols=cols, **variant)
        return getattr(torch.ops.cann_ops_tilelang, name).default, tuple(args.values())

    flat = (rows * cols + 5,)  # any element count
    momentum = "engram_sinkhorn_momentum_update"
    return [
        call(momentum, shape=flat, grad_dtype=BF16, buffer_dtype=BF16, beta1=0.9, nesterov=True),
        call(momentum, shape=flat, grad_dtype=F32, buffer_dtype=F32, beta1=0.95, nesterov=False),
        call(momentum, shape=flat, grad_dtype=BF16, buffer_dtype=F32, beta1=0.95, nesterov=True),
        call("engram_sinkhorn_step"),
        call("engram_sinkhorn_step_reduce", partials=7),
        call("engram_sinkhorn_finalize", alpha=math.sqrt(cols)),
        call("engram_sinkhorn_finalize_out", alpha=2.0),
        call("engram_sinkhorn_finalize_apply", alpha=2.0, param_dtype=BF16, decay=0.999),
        call("engram_sinkhorn_finalize_apply", alpha=2.0, param_dtype=F32, decay=1.0),
    ]


@pytest.mark.parametrize("rows,cols", [(0, 64), (1, 64), (37, 128), (530, 64), (9, 1024)])
def test_opcheck(rows, cols, seed):
    for op, args in _op_calls(rows, cols, seed):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("rows,cols", [(0, 64), (37, 128)])
def test_fakes_match_references(rows, cols, seed):
    for op, args in _op_calls(rows, cols, seed):
        real = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        mode = FakeTensorMode()
        with mode:
            fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        real = real if isinstance(real, tuple) else (real,) if real is not None else ()
        fake = fake if isinstance(fake, tuple) else (fake,) if fake is not None else ()
        assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


def _update(grad, momentum, beta1, iters, eps):
    x = ops.engram_sinkhorn_momentum_update(grad, momentum, beta1, True)
    return sinkhorn_update(x.view(-1, 64), iters, eps, 8.0)


def test_compile_fullgraph_dynamic_rows_no_recompile(seed):
    compiled = torch.compile(_update, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (8, 12, 36):
            grad = table(rows, 64, seed)
            m1, m2 = torch.zeros(rows, 64), torch.zeros(rows, 64)
            got, want = compiled(grad, m1, 0.9, 3, 1e-8), _update(grad, m2, 0.9, 3, 1e-8)
            assert torch.equal(got, want) and torch.equal(m1, m2)


@pytest.mark.parametrize("dtype,rows,wd", [(F32, 16, 0.0), (BF16, 37, 0.1)])
def test_compile_optimizer_step_fullgraph(dtype, rows, wd, seed):
    p = torch.nn.Parameter(table(rows, 64, seed, dtype=dtype))
    opt = EngramSinkhorn([p], lr=0.01, sinkhorn_iters=2, weight_decay=wd)
    p.grad = table(rows, 64, seed + 1, dtype=dtype)
    ref = copy.deepcopy(p.detach())
    opt_ref = EngramSinkhorn([torch.nn.Parameter(ref)], lr=0.01, sinkhorn_iters=2, weight_decay=wd)
    opt_ref.param_groups[0]["params"][0].grad = p.grad.clone()
    torch.compile(opt.step, backend="aot_eager", fullgraph=True)()
    opt_ref.step()
    assert torch.equal(bits(p), bits(opt_ref.param_groups[0]["params"][0]))


# float arithmetic a compiler may fuse, contract (fma) or evaluate in another precision
_FLOAT_MATH = ("add", "sub", "mul", "div", "sqrt", "rsqrt", "reciprocal", "where", "addcmul", "addcdiv", "fma",
               "lerp", "pow", "norm")


def test_compiled_optimizer_step_leaves_no_float_arithmetic_to_the_compiler(seed):
    """Every float operation of the update is inside the ops (fixed rounding on every backend): the traced
    step holds none on tensors but the step counter's increment, so compiled and eager steps agree bitwise
    whatever the backend (inductor would otherwise fuse them with its own rounding)."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    p = torch.nn.Parameter(table(37, 64, seed, dtype=BF16))
    opt = EngramSinkhorn([p], lr=0.01, sinkhorn_iters=3, weight_decay=0.1)
    p.grad = table(37, 64, seed + 1, dtype=BF16)
    torch.compile(opt.step, backend=backend, fullgraph=True)()
    assert len(graphs) == 1
    math_nodes = []
    for node in graphs[0].graph.nodes:
        if node.op not in ("call_function", "call_method") or not isinstance(node.meta.get("example_value"),
                                                                              torch.Tensor):
            continue  # host scalars (1 - lr * weight_decay: Python doubles in either mode)
        name = getattr(node.target, "__name__", str(node.target)).strip("_").removesuffix("_")
        if name in _FLOAT_MATH or name.removeprefix("i") in _FLOAT_MATH:
            math_nodes.append(node)
    # the only one: state["step"] += 1 (a float32 counter, exact below 2^24; not part of the update)
    assert len(math_nodes) <= 1, [(n.target, n.args) for n in math_nodes]


# --- the references against independent arithmetic -------------------------------------------------------


@pytest.mark.parametrize("gdt", [BF16, F32])
@pytest.mark.parametrize("mdt", [BF16, F32])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("numel", [4096, 1001])
def test_momentum_reference_is_fp32_rounded_step_by_step(gdt, mdt, nesterov, numel, seed):
    """Each product and sum rounded to fp32 on its own: the same numbers through float64 arithmetic rounded
    after every operation (exact: the float64 product of two fp32 values and the sum of two fp32 values
    each round once to fp32 without double rounding error, the float64 result being exact or within
    2^-53 relative, far inside the fp32 rounding interval except on exact ties, which these inputs avoid)."""
    g, m = torch.randn(numel, generator=gen(seed)).to(gdt), torch.randn(numel, generator=gen(seed + 1)).to(mdt)
    beta1 = 0.95
    b, ob = torch.tensor(beta1, dtype=F32).double(), torch.tensor(1 - beta1, dtype=F32).double()

    def r(x):
        return x.float().double()

    gd, md = g.double(), m.double()
    m_new = r(r(md * b) + r(gd * ob))
    want = r(r(m_new * b) + r(gd * ob)) if nesterov else m_new
    buf = m.clone()
    got = ops.engram_sinkhorn_momentum_update(g, buf, beta1, nesterov)
    assert got.dtype == F32 and torch.equal(got, want.float())
    assert torch.equal(buf, m_new.float().to(mdt))


@pytest.mark.parametrize("rows,cols", [(1, 64), (600, 64), (1111, 128), (33, 192), (3, 1024)])
def test_step_reference_against_float64(rows, cols, seed):
    a = table(rows, cols, seed)
    r0 = torch.rand(rows, generator=gen(seed + 1)) + 0.5
    c = torch.rand(cols, generator=gen(seed + 2)) + 0.5
    r = r0.clone()
    norm, partial = ops.engram_sinkhorn_step(a, r, c, 1e-8)
    x = r0.double()[:, None] * a.double() * c.double()
    want_norm = x.norm(dim=1)
    want_scale = r0.double() / (want_norm + 1e-8)
    y2 = (want_scale[:, None] * a.double() * c.double()) ** 2
    # fp32 sums of D <= 1024 squares and a few roundings: relative errors of a few 1e-7
    torch.testing.assert_close(norm, want_norm.float(), rtol=2e-6, atol=0)
    torch.testing.assert_close(r, want_scale.float(), rtol=2e-6, atol=0)
    assert partial.shape == (P_CUDA, cols)
    for p, (lo, hi) in enumerate(sinkhorn_worker_rows(rows, P_CUDA)):
        torch.testing.assert_close(partial[p].double(), y2[lo:hi].sum(0), rtol=1e-5, atol=0)
    torch.testing.assert_close(partial.double().sum(0), y2.sum(0), rtol=1e-5, atol=0)


@pytest.mark.parametrize("parts", [1, 2, 9, 528])
def test_step_reduce_is_the_sequential_fp32_sum_and_updates_the_column_scales(parts, seed):
    partial = torch.rand(parts, 128, generator=gen(seed))
    partial[:, 5] = 0  # a column of zeros keeps its scale
    out = torch.full((128,), float("nan"))
    col_scale = torch.rand(128, generator=gen(seed + 1)) + 0.5
    scale0 = col_scale.numpy().copy()
    rows, eps = 1001, 1e-8
    ops.engram_sinkhorn_step_reduce(partial, out, col_scale, rows, eps)
    acc = partial[0].numpy().copy()
    for p in range(1, parts):
        acc = acc + partial[p].numpy()  # float32 numpy: one rounding per addition
    assert torch.equal(out, torch.from_numpy(acc))
    # float32 numpy, one rounding per operation (IEEE square root and division); the scalars rounded to fp32
    b32, e32 = np.float32(128) / np.float32(rows), np.float32(eps)
    want = np.where(acc > 0, scale0 / (np.sqrt(acc * b32) + e32), scale0).astype(np.float32)
    # numpy's float32 square root is correctly rounded (torch's vectorized CPU one is not: the reference
    # does not use it)
    assert np.array_equal(np.sqrt(acc), np.sqrt(acc.astype(np.float64)).astype(np.float32))
    assert want.dtype == np.float32 and torch.equal(col_scale, torch.from_numpy(want))
    assert col_scale[5] == float(scale0[5])


def test_step_reduce_of_no_partials_is_zero_and_keeps_the_scales():
    out = torch.full((64,), 7.0)
    col_scale = torch.rand(64) + 0.5
    scale0 = col_scale.clone()
    ops.engram_sinkhorn_step_reduce(torch.empty(0, 64), out, col_scale, 1, 1e-8)
    assert torch.equal(out, torch.zeros(64)) and torch.equal(col_scale, scale0)


@pytest.mark.parametrize("rows,cols", [(1, 64), (257, 128), (5, 1024)])
def test_finalize_reference_against_float64(rows, cols, seed):
    a = table(rows, cols, seed, zero_rows=(0,))
    r, c = torch.rand(rows, generator=gen(seed + 1)) + 0.5, torch.rand(cols, generator=gen(seed + 2)) + 0.5
    alpha = math.sqrt(cols)
    out = ops.engram_sinkhorn_finalize(a, r, c, 1e-8, alpha)
    x = r.double()[:, None] * a.double() * c.double()
    want = alpha * x / (x.norm(dim=1, keepdim=True) + 1e-8)
    torch.testing.assert_close(out, want.float(), rtol=3e-6, atol=1e-7)
    assert torch.equal(out[0], torch.zeros(cols))  # a row of zeros stays zero
    buf = torch.empty(rows, cols)
    assert ops.engram_sinkhorn_finalize(a, r, c, 1e-8, alpha, out=buf) is buf and torch.equal(buf, out)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rows,cols,decay", [(1, 64, 1.0), (257, 128, 0.999), (5, 1024, 0.95)])
def test_finalize_apply_is_the_finalize_applied_step_by_step(dtype, rows, cols, decay, seed):
    a = table(rows, cols, seed, zero_rows=(0,))
    r, c = torch.rand(rows, generator=gen(seed + 1)) + 0.5, torch.rand(cols, generator=gen(seed + 2)) + 0.5
    alpha, lr = math.sqrt(cols), 0.013
    u = ops.engram_sinkhorn_finalize(a, r, c, 1e-8, alpha)
    param = table(rows, cols, seed + 3, dtype=dtype)
    p0 = param.float().numpy().copy()
    assert ops.engram_sinkhorn_finalize_apply(a, r, c, 1e-8, alpha, param, lr, decay) is None
    # float32 numpy, one rounding per product and for the difference, then one cast to the table's dtype
    want = (p0 * np.float32(decay)) - (u.numpy() * np.float32(lr))
    assert want.dtype == np.float32
    assert torch.equal(bits(param), bits(torch.from_numpy(want).to(dtype)))
    assert torch.equal(param[0], (torch.from_numpy(p0[0]) * decay).to(dtype))  # a zero row: decay only


# --- the optimizer ---------------------------------------------------------------------------------------


def run_optimizer(param, grads, **kwargs):
    p = torch.nn.Parameter(param.clone())
    opt = EngramSinkhorn([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("rows,cols", [(64, 64), (300, 128), (333, 64), (7, 192)])
def test_optimizer_vs_plain_pytorch_update(nesterov, rows, cols, seed):
    """Three steps against the explicit-iterate formulation (engram_ref.engram_sinkhorn_update_model): the
    momentum bitwise, the parameters within fp32 rounding of updates of unit RMS scaled by lr (different
    summation orders and the scales' extra roundings: ~1e-6 relative per element)."""
    lr, beta1, iters, eps, wd = 0.01, 0.9, 4, 1e-8, 0.1
    w = table(rows, cols, seed)
    grads = [table(rows, cols, seed + 10 + k, zero_rows=(3,)) for k in range(3)]
    got, opt = run_optimizer(w, grads, lr=lr, beta1=beta1, nesterov=nesterov, sinkhorn_iters=iters, eps=eps,
                             weight_decay=wd)
    want, m = w.clone(), torch.zeros(rows, cols)
    for g in grads:
        upd, m = engram_sinkhorn_update_model(g, m, beta1, nesterov, iters, eps, math.sqrt(cols))
        want = want * (1 - lr * wd) - lr * upd
    assert torch.equal(opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"], m)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-7)
    assert torch.equal(got[3], (w[3] * (1 - lr * wd)) * (1 - lr * wd) * (1 - lr * wd))  # zero-gradient row


def test_update_rows_have_norm_alpha_and_balanced_columns(seed):
    rows, cols = 4096, 64
    g = table(rows, cols, seed) * torch.logspace(-3, 3, cols)  # badly scaled columns
    x = ops.engram_sinkhorn_momentum_update(g, torch.zeros(rows, cols), 0.0, False)
    upd = sinkhorn_update(x, 10, 1e-12, 8.0)
    torch.testing.assert_close(upd.norm(dim=1), torch.full((rows,), 8.0), rtol=1e-5, atol=0)
    col = upd.norm(dim=0) / math.sqrt(rows)  # per-entry RMS of each column
    assert float(col.max() / col.min()) < 1.01, col


def test_zero_rows_stay_finite_and_untouched(seed):
    """Rows no gradient has touched: eps = 1e-20 and 8 rounds would overflow a carried row scale
    ((1 / eps)^8); the restarted scale keeps them at 1 / eps and their update exactly zero."""
    w = table(64, 64, seed, dtype=BF16)
    grads = [table(64, 64, seed + 1, zero_rows=range(0, 64, 2)).bfloat16()]
    got, _ = run_optimizer(w, grads, lr=0.1, sinkhorn_iters=8, eps=1e-20)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got[0::2], w[0::2])
    assert not torch.equal(got[1::2], w[1::2])


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_deterministic_and_state_dict_round_trip(dtype, seed):
    w = table(96, 128, seed, dtype=dtype)
    grads = [table(96, 128, seed + k, dtype=dtype) for k in range(1, 5)]
    kwargs = dict(lr=0.02, beta1=0.8, nesterov=True, sinkhorn_iters=3, eps=1e-10, weight_decay=0.01)
    full_a, _ = run_optimizer(w, grads, **kwargs)
    full_b, _ = run_optimizer(w, grads, **kwargs)
    assert torch.equal(bits(full_a), bits(full_b))  # same inputs, same bits
    half, opt = run_optimizer(w, grads[:2], **kwargs)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    p = torch.nn.Parameter(half.clone())
    resumed = EngramSinkhorn([p], **kwargs)
    resumed.load_state_dict(torch.load(buffer))
    state = resumed.state[p]
    assert state["momentum_buffer"].dtype == dtype and float(state["step"]) == 2
    for g in grads[2:]:
        p.grad = g.clone()
        resumed.step()
    assert torch.equal(bits(p), bits(full_a))


def test_optimizer_checks_groups_again_at_step_and_leaves_state_alone_when_it_refuses():
    """Hyper-parameters changed after construction (a scheduler, load_state_dict) are checked, in every group,
    before any table or state changes."""
    q = torch.nn.Parameter(torch.randn(4, 64))
    q.grad = torch.randn(4, 64)
    q_before = q.detach().clone()
    opt = EngramSinkhorn([{"params": [q]}, {"params": [p := torch.nn.Parameter(torch.randn(4, 64))]}])
    p.grad = torch.randn(4, 64)
    opt.param_groups[1]["lr"] = -1.0  # the second group is bad: the first is not updated either
    with pytest.raises(ValueError, match="EngramSinkhorn: lr must be"):
        opt.step()
    assert not opt.state and torch.equal(q.detach(), q_before)
    opt = EngramSinkhorn([p])
    before = p.detach().clone()
    for key, value in (("lr", -1.0), ("lr", 1e-40), ("alpha", 1e-40), ("weight_decay", -0.5)):
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=f"EngramSinkhorn: {key}"):
            opt.step()
        assert not opt.state and torch.equal(p.detach(), before)
        opt.param_groups[0][key] = EngramSinkhorn([p]).param_groups[0][key]
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = -5.0
    opt.load_state_dict(saved)
    with pytest.raises(ValueError, match="EngramSinkhorn: lr must be"):
        opt.step()
    assert not opt.state and torch.equal(p.detach(), before)
    for kwargs in (dict(lr=1e-40), dict(alpha=1e-40), dict(beta1=1e-40), dict(lr=1e30, weight_decay=1e30)):
        with pytest.raises(ValueError, match="EngramSinkhorn"):
            EngramSinkhorn([p], **kwargs)
    assert EngramSinkhorn([p], weight_decay=1e-40).param_groups[0]["weight_decay"] == 1e-40  # no op takes it



def test_optimizer_registers_a_tables_state_only_after_its_update(monkeypatch):
    """An op that refuses (as on a device without kernels) leaves a new table without state or step count."""
    import cann_ops_tilelang.optim.sinkhorn as optim_module

    def refuse(*args):
        raise RuntimeError("refused")

    p = torch.nn.Parameter(torch.randn(4, 64))
    p.grad = torch.randn(4, 64)
    opt = EngramSinkhorn([p])
    monkeypatch.setattr(optim_module, "engram_sinkhorn_finalize_apply", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        opt.step()
    assert not opt.state
    monkeypatch.undo()
    opt.step()
    assert float(opt.state[p]["step"]) == 1
    buffer = opt.state[p]["momentum_buffer"]
    opt.step()  # later steps update the registered buffer in place
    assert opt.state[p]["momentum_buffer"] is buffer and float(opt.state[p]["step"]) == 2


def test_beta1_and_its_alias_momentum():
    p = torch.nn.Parameter(torch.randn(4, 64))
    assert EngramSinkhorn([p]).param_groups[0]["beta1"] == 0.9
    assert EngramSinkhorn([p], momentum=0.5, beta1=0.5).param_groups[0]["beta1"] == 0.5
    with pytest.raises(ValueError, match="EngramSinkhorn: beta1 0.5 and its alias momentum 0.4 both given"):
        EngramSinkhorn([p], beta1=0.5, momentum=0.4)


def test_sinkhorn_update_of_no_rows_is_empty():
    update = sinkhorn_update(torch.empty(0, 64), 5, 1e-8, 8.0)
    assert update.shape == (0, 64) and update.dtype == torch.float32
    with pytest.raises(TypeError, match="sinkhorn_update: iters must be an int"):
        sinkhorn_update(torch.empty(0, 64), 2.0, 1e-8, 8.0)


def test_momentum_alias_and_defaults():
    p = torch.nn.Parameter(torch.randn(4, 64))
    opt = EngramSinkhorn([p], momentum=0.5)
    group = opt.param_groups[0]
    assert group["beta1"] == 0.5 and group["nesterov"] is True and group["sinkhorn_iters"] == 5
    assert group["alpha"] is None and group["weight_decay"] == 0.0
    opt.step()  # no gradient: nothing happens
    assert not opt.state


# --- refusals change nothing; aliases, schedulers, numpy numbers, flags, misuse ----------------------------


def _snapshot(opt):
    """Everything a step may change, by value (bits) and identity: every table, every state entry, every group's
    hyper-parameters (meta tensors by shape and dtype only)."""
    def value(t):
        if not isinstance(t, torch.Tensor):
            return copy.deepcopy(t)
        data = None if t.device.type == "meta" else bits(t.reshape(-1)).clone()
        return (id(t), t.shape, t.dtype, str(t.device), data)

    groups = [{k: (list(map(id, v)) if k == "params" and isinstance(v, list) else copy.deepcopy(v))
               for k, v in g.items()} for g in opt.param_groups]
    tables = [value(p) for g in opt.param_groups for p in (g.get("params") or []) if isinstance(p, torch.Tensor)]
    state = {id(p): {k: value(v) for k, v in s.items()} for p, s in opt.state.items()}
    return groups, tables, state


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


def _sparse_embedding_grad(opt, tables):
    emb = torch.nn.Embedding(16, 64, sparse=True)
    emb(torch.tensor([1, 5, 5])).sum().backward()
    tables[1].grad = emb.weight.grad


def _int_grad(opt, tables):
    tables[1].grad_dtype = None  # torch refuses a gradient of another dtype unless told
    tables[1].grad = torch.ones(16, 64, dtype=torch.int32)


def _state(**entries):
    def edit(opt, tables):
        state = opt.state[tables[1]]
        for key, make in entries.items():
            if make is None:
                del state[key]
            else:
                state[key] = make(tables[1])
    return edit


def _table_data(make):
    def edit(opt, tables):
        tables[1].data = make(tables[1])
    return edit


def _group(i, **values):
    def edit(opt, tables):
        opt.param_groups[i].update(values)
    return edit


# each: how the second table (param group 1, table 0) or its group goes wrong, the error, what it says. The first
# table has a gradient and (after a first step) a momentum buffer and step count: both must stay as they were.
_REFUSED_STEPS = {
    "sparse gradient": (lambda opt, t: setattr(t[1], "grad", torch.randn(16, 64).to_sparse()), TypeError,
                        r"expected a dense \(torch.strided\) gradient, got torch.sparse_coo "
                        r".*\(param group 1, table 0\)"),
    "nn.Embedding(sparse=True)": (_sparse_embedding_grad, TypeError, r"dense .* gradient, got torch.sparse_coo"),
    "integer gradient": (_int_grad, TypeError, r"expected a floating-point gradient, got torch.int32 "
                                               r"\(param group 1, table 0\)"),
    "gradient of another shape": (_table_data(lambda p: torch.randn(8, 64)), ValueError,
                                  r"gradient of the table's shape \(8, 64\), got \(16, 64\) "
                                  r"\(param group 1, table 0\)"),
    "buffer of another shape": (_state(momentum_buffer=lambda p: torch.zeros(8, 64)), ValueError,
                                r"momentum_buffer of the table's shape \(16, 64\), got \(8, 64\)"),
    "buffer of another dtype": (_state(momentum_buffer=lambda p: torch.zeros(16, 64, dtype=BF16)), TypeError,
                                r"momentum_buffer of the table's dtype torch.float32, got torch.bfloat16"),
    "buffer on another device": (_state(momentum_buffer=lambda p: torch.zeros(16, 64, device="meta")), ValueError,
                                 r"momentum_buffer on the table's device cpu, got meta"),
    "buffer not a tensor": (_state(momentum_buffer=lambda p: [0.0] * 64), TypeError,
                            r"expected a tensor momentum_buffer, got list"),
    "buffer not contiguous": (_state(momentum_buffer=lambda p: torch.zeros(64, 16).t()), ValueError,
                              r"contiguous momentum_buffer"),
    "buffer is the gradient": (_state(momentum_buffer=lambda p: p.grad), ValueError,
                               r"momentum_buffer that shares no memory with the gradient"),
    "buffer is the table": (_state(momentum_buffer=lambda p: p.detach()), ValueError,
                            r"momentum_buffer that shares no memory with the table"),
    "state without step": (_state(step=None), ValueError, r"state needs momentum_buffer and step, it has no step"),
    "state without buffer": (_state(momentum_buffer=None), ValueError, r"it has no momentum_buffer"),
    "step not a number": (_state(step=lambda p: "1"), TypeError, r"expected a step count .*, got str"),
    "step of two elements": (_state(step=lambda p: torch.ones(2)), ValueError, r"one-element real step count"),
    "table of another dtype": (_table_data(lambda p: p.detach().half()), TypeError,
                               r"expected bf16 or fp32 tables, got torch.float16 \(param group 1, table 0\)"),
    "table not contiguous": (_table_data(lambda p: torch.randn(64, 16).t()), ValueError, r"contiguous tables"),
    "table misaligned": (_table_data(lambda p: torch.randn(16 * 64 + 1)[1:].view(16, 64)), ValueError,
                         r"16-byte boundary"),
    "a table twice": (lambda opt, t: opt.param_groups[1]["params"].append(t[0]), ValueError,
                      r"a table appears twice .*\(param group 1, table 1\)"),
    "params not tensors": (lambda opt, t: opt.param_groups[1]["params"].append("table"), TypeError,
                           r"expected tensors \(tables\), got str 'table' \(param group 1, table 1\)"),
    "params not a list": (_group(1, params=None), TypeError,
                          r"list of tables under 'params', got None \(param group 1\)"),
    "nesterov a numpy bool": (_group(1, nesterov=np.True_), TypeError,
                              r"nesterov must be a bool, got numpy.bool .*\(param group 1\)"),
    "nesterov an int": (_group(1, nesterov=1), TypeError, r"nesterov must be a bool, got int"),
    "iters a numpy bool": (_group(1, sinkhorn_iters=np.True_), TypeError, r"sinkhorn_iters must be an int, got numpy"),
    "lr a string": (_group(1, lr="0.1"), ValueError, r"lr must be .*got '0.1' \(param group 1\)"),
    "momentum out of range": (_group(1, momentum=1.5), ValueError, r"momentum must be 0 or in .*, got 1.5"),
    "beta1 and momentum both changed": (_group(1, beta1=0.5, momentum=0.4), ValueError,
                                        r"beta1 0.5 and its alias momentum 0.4 differ \(param group 1\)"),
    "eps missing": (lambda opt, t: opt.param_groups[1].pop("eps"), ValueError, r"eps is missing \(param group 1\)"),
    "beta1 and momentum missing": (lambda opt, t: [opt.param_groups[1].pop(k) for k in ("beta1", "momentum")],
                                   ValueError, r"beta1 \(or its alias momentum\) is missing"),
}


@pytest.mark.parametrize("fresh", [False, True], ids=["with state", "first step"])
@pytest.mark.parametrize("case", list(_REFUSED_STEPS))
def test_a_refused_step_changes_nothing(case, fresh, seed):
    """Every table, gradient, state and group is checked before the first op runs: whichever table is refused,
    no table, momentum buffer, step count or group value changes (bitwise), the first table's included."""
    edit, exc, match = _REFUSED_STEPS[case]
    tables = [torch.nn.Parameter(table(16, 64, seed + k)) for k in range(2)]
    opt = EngramSinkhorn([{"params": [tables[0]]}, {"params": [tables[1]]}], lr=0.1, sinkhorn_iters=2)
    if not fresh:
        for k, t in enumerate(tables):
            t.grad = table(16, 64, seed + 10 + k)
        opt.step()
    elif "buffer" in case or "state" in case or "step" in case:
        opt.state[tables[1]].update(momentum_buffer=torch.zeros(16, 64), step=torch.tensor(3.0))  # a loaded state
    for k, t in enumerate(tables):
        t.grad = table(16, 64, seed + 20 + k)
    edit(opt, tables)
    before = _snapshot(opt)
    with pytest.raises(exc, match=rf"^EngramSinkhorn: .*{match}"):
        opt.step()
    assert _same(_snapshot(opt), before)


def test_a_refused_step_on_a_device_without_kernels_changes_nothing():
    """The package itself (no CPU references, a fresh process): a table on the meta device (its fake kernels
    run) next to one on the CPU (no kernels) is refused before the meta table's state is registered."""
    code = ("import torch\nfrom cann_ops_tilelang.optim import EngramSinkhorn\n"
            "a = torch.nn.Parameter(torch.empty(4, 64, device='meta')); a.grad = torch.empty(4, 64, device='meta')\n"
            "b = torch.nn.Parameter(torch.randn(4, 64)); b.grad = torch.randn(4, 64)\n"
            "before = b.detach().clone()\nopt = EngramSinkhorn([a, b])\n"
            "try:\n    opt.step()\nexcept RuntimeError as e:\n    print(repr(str(e)))\n"
            "print(len(opt.state), torch.equal(b.detach(), before))\n"
            "opt = EngramSinkhorn([a]); opt.step(); print(float(opt.state[a]['step']))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(ops.__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    message, unchanged, meta_alone = done.stdout.strip().splitlines()[-3:]
    assert "EngramSinkhorn: no kernel for tensors on device 'cpu' (param group 0, table 1)" in message
    assert unchanged == "0 True"  # no state registered for the meta table, the CPU table untouched
    assert meta_alone == "1.0"  # the meta table alone goes through: the refusal was the CPU table's


def _steps(opt, p, grads, before_each=None):
    for k, g in enumerate(grads):
        if before_each is not None:
            before_each(k)
        p.grad = g.clone()
        opt.step()


def test_momentum_set_on_a_group_is_used_and_kept_in_sync_with_beta1(seed):
    """beta1 and its alias momentum: the one set since the last step wins (either), and the group holds the value
    under both keys again after the step; both set to different values is refused; alike is fine."""
    w, grads = table(32, 64, seed), [table(32, 64, seed + k) for k in range(1, 4)]
    schedule = [0.5, 0.7, 0.2]
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt, ref = EngramSinkhorn([p], lr=0.05), EngramSinkhorn([q], lr=0.05)
    group = opt.param_groups[0]

    def drive(k):  # step 0 through momentum, 1 through beta1, 2 through both alike
        group.update({0: {"momentum": 0.5}, 1: {"beta1": 0.7}, 2: {"beta1": 0.2, "momentum": 0.2}}[k])

    def reference(k):
        ref.param_groups[0]["beta1"] = schedule[k]

    for k, g in enumerate(grads):
        _steps(opt, p, [g], lambda _: drive(k))
        _steps(ref, q, [g], lambda _: reference(k))
        assert group["beta1"] == group["momentum"] == schedule[k]
        assert torch.equal(bits(p), bits(q))
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    m = torch.zeros(32, 64)  # the momentum of the plain PyTorch model at those betas: bitwise
    for g, beta1 in zip(grads, schedule):
        _, m = engram_sinkhorn_update_model(g, m, beta1, True, 5, 1e-8, 8.0)
    assert torch.equal(opt.state[p]["momentum_buffer"], m)
    # the alias is not ignored: a run at the constructor's beta1 ends elsewhere
    assert not torch.equal(bits(run_optimizer(w, grads, lr=0.05)[0]), bits(p))
    group.update(beta1=0.3, momentum=0.4)
    before = _snapshot(opt)
    p.grad = grads[0].clone()
    with pytest.raises(ValueError, match=r"EngramSinkhorn: beta1 0.3 and its alias momentum 0.4 differ"):
        opt.step()
    assert _same(_snapshot(opt), before)


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_torch_schedulers_cycle_beta1_through_momentum(scheduler, seed):
    """torch's schedulers with cycle_momentum (they need "momentum" in the defaults and write group["momentum"])
    drive the beta1 of the step: the same steps as an optimizer given each step's lr and beta1 by hand."""
    from torch.optim.lr_scheduler import CyclicLR, OneCycleLR

    w, grads = table(32, 128, seed), [table(32, 128, seed + k) for k in range(1, 7)]
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt, ref = EngramSinkhorn([p], lr=0.01, sinkhorn_iters=2), EngramSinkhorn([q], lr=0.01, sinkhorn_iters=2)
    if scheduler == "OneCycleLR":
        sched = OneCycleLR(opt, max_lr=0.05, total_steps=len(grads), cycle_momentum=True, base_momentum=0.5,
                           max_momentum=0.95)
    else:
        sched = CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=2, cycle_momentum=True, base_momentum=0.5,
                         max_momentum=0.95)
    used = []
    for g in grads:
        lr, beta1 = opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
        used.append(beta1)
        ref.param_groups[0].update(lr=lr, beta1=beta1)
        _steps(opt, p, [g])
        _steps(ref, q, [g])
        assert opt.param_groups[0]["beta1"] == beta1
        sched.step()
    assert len(set(used)) >= 3 and min(used) < 0.8, used  # the schedule moved beta1 away from its default
    assert torch.equal(bits(p), bits(q))
    assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    m = torch.zeros(32, 128)  # the momentum of the plain PyTorch model at the scheduled betas: bitwise
    for g, beta1 in zip(grads, used):
        _, m = engram_sinkhorn_update_model(g, m, beta1, True, 2, 1e-8, math.sqrt(128))
    assert torch.equal(opt.state[p]["momentum_buffer"], m)
    fixed = torch.nn.Parameter(w.clone())  # beta1 left at its default: another momentum
    plain = EngramSinkhorn([fixed], lr=0.01, sinkhorn_iters=2)
    _steps(plain, fixed, grads)
    assert not torch.equal(plain.state[fixed]["momentum_buffer"], opt.state[p]["momentum_buffer"])


def test_a_state_dict_with_beta1_only_gets_momentum_on_load(seed):
    """A state_dict saved before groups held the alias (beta1 only) loads; a scheduler's momentum then wins."""
    p = torch.nn.Parameter(table(16, 64, seed))
    saved = EngramSinkhorn([p], beta1=0.8).state_dict()
    for key in ("momentum", "beta1_synced"):
        del saved["param_groups"][0][key]
    opt = EngramSinkhorn([p])
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert group["beta1"] == group["momentum"] == 0.8
    group["momentum"] = 0.3
    p.grad = table(16, 64, seed + 1)
    opt.step()
    assert group["beta1"] == group["momentum"] == 0.3


def test_numpy_numbers_are_numbers(seed):
    """numpy scalars are taken as the ops take them (numbers.Real / numbers.Integral), used as the Python numbers
    they equal, and stored as Python numbers (a state_dict loads with weights_only)."""
    w, grads = table(48, 64, seed), [table(48, 64, seed + k) for k in (1, 2)]
    given = dict(lr=np.float32(0.1), beta1=np.float64(0.8), sinkhorn_iters=np.int64(3), eps=np.float32(1e-8),
                 alpha=np.float64(6.0), weight_decay=np.float32(0.01))
    got, opt = run_optimizer(w, grads, **given)
    want, _ = run_optimizer(w, grads, **{k: (int(v) if k == "sinkhorn_iters" else float(v)) for k, v in given.items()})
    assert torch.equal(bits(got), bits(want))
    group = opt.param_groups[0]
    assert all(type(group[k]) is (int if k == "sinkhorn_iters" else float) for k in given)
    assert group["lr"] == float(np.float32(0.1)) and group["momentum"] == 0.8
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["param_groups"][0]["lr"] == group["lr"]
    # set later on a group (by hand or a scheduler) alike
    p = torch.nn.Parameter(w.clone())
    later = EngramSinkhorn([p])
    later.param_groups[0].update(given, momentum=np.float64(0.8))
    _steps(later, p, grads)
    assert torch.equal(bits(p), bits(want)) and type(later.param_groups[0]["lr"]) is float
    # the decay in doubles, as from Python floats (float32 arithmetic would round 1 - lr * wd otherwise)
    assert EngramSinkhorn._hyper(later.param_groups[0], "").decay == 1.0 - float(np.float32(0.1)) * float(
        np.float32(0.01))


@pytest.mark.parametrize("value,got", [(np.True_, "numpy.bool True"), (np.False_, "numpy.bool False"), (1, "int 1"),
                                       ("True", "str 'True'"), (None, "None")])
def test_flags_take_bools_only(value, got):
    """Named as _checks.describe names them (the type, and the value of a scalar): the same wording as the ops'."""
    p = torch.nn.Parameter(torch.randn(4, 64))
    match = rf"EngramSinkhorn: nesterov must be a bool, got {got}( \(param group \d\))?$"
    with pytest.raises(TypeError, match=match):
        EngramSinkhorn([p], nesterov=value)
    opt = EngramSinkhorn([p])
    with pytest.raises(TypeError, match=match):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 64))], "nesterov": value})
    assert len(opt.param_groups) == 1
    saved = opt.state_dict()
    saved["param_groups"][0]["nesterov"] = value
    opt.load_state_dict(saved)  # load_state_dict takes any values; the next step refuses them
    p.grad = torch.randn(4, 64)
    before = p.detach().clone()
    with pytest.raises(TypeError, match=match):
        opt.step()
    assert not opt.state and torch.equal(p.detach(), before)


_MISUSE = {  # name: (call, error, what it says)
    "sinkhorn_update 1-D matrix": (lambda: sinkhorn_update(torch.randn(64), 2, 1e-8, 8.0), ValueError,
                                   r"sinkhorn_update: matrix must be 2-D \(R, D\), got shape \(64,\)"),
    "sinkhorn_update 3-D matrix": (lambda: sinkhorn_update(torch.randn(2, 4, 64), 2, 1e-8, 8.0), ValueError,
                                   r"sinkhorn_update: matrix must be 2-D"),
    "sinkhorn_update list matrix": (lambda: sinkhorn_update([[0.0] * 64], 2, 1e-8, 8.0), TypeError,
                                    r"sinkhorn_update: matrix must be a torch.Tensor, got list"),
    "sinkhorn_update fp64 matrix": (lambda: sinkhorn_update(torch.randn(4, 64).double(), 2, 1e-8, 8.0), TypeError,
                                    r"sinkhorn_update: matrix must be torch.float32, got torch.float64"),
    "sinkhorn_update negative iters": (lambda: sinkhorn_update(torch.randn(4, 64), -1, 1e-8, 8.0), ValueError,
                                       r"sinkhorn_update: iters must be >= 0"),
    "sinkhorn_update numpy bool iters": (lambda: sinkhorn_update(torch.randn(4, 64), np.True_, 1e-8, 8.0), TypeError,
                                         r"sinkhorn_update: iters must be an int, got numpy.bool"),
    "sinkhorn_update string eps": (lambda: sinkhorn_update(torch.randn(4, 64), 2, "1e-8", 8.0), TypeError,
                                   r"sinkhorn_update: eps must be a real number, got str"),
    "sinkhorn_update negative eps": (lambda: sinkhorn_update(torch.randn(4, 64), 2, -1e-8, 8.0), ValueError,
                                     r"sinkhorn_update: eps must be >= 0"),
    "sinkhorn_update infinite alpha": (lambda: sinkhorn_update(torch.randn(4, 64), 2, 1e-8, float("inf")), ValueError,
                                       r"sinkhorn_update: alpha must be finite in fp32"),
    "sinkhorn_update None alpha": (lambda: sinkhorn_update(torch.randn(4, 64), 2, 1e-8, None), TypeError,
                                   r"sinkhorn_update: alpha must be a real number, got None$"),
    "params an int": (lambda: EngramSinkhorn(5), TypeError, r"EngramSinkhorn: params must be an iterable .*, got int"),
    "params a tensor": (lambda: EngramSinkhorn(torch.nn.Parameter(torch.randn(4, 64))), TypeError,
                        r"EngramSinkhorn: params must be an iterable .*\(pass a list"),
    "params a dict": (lambda: EngramSinkhorn({"params": []}), TypeError,
                      r"EngramSinkhorn: params must be an iterable .*got dict"),
    "params empty": (lambda: EngramSinkhorn([]), ValueError, r"EngramSinkhorn: params is empty"),
    "params floats": (lambda: EngramSinkhorn([1.0, 2.0]), TypeError,
                      r"EngramSinkhorn: expected tensors \(tables\), got float 1.0 \(param group 0, table 0\)"),
    "group without params": (lambda: EngramSinkhorn([{"lr": 0.1}]), ValueError,
                             r"EngramSinkhorn: a param group needs 'params'"),
    "group params an int": (lambda: EngramSinkhorn([{"params": 3}]), TypeError,
                            r"EngramSinkhorn: a group's params must be an iterable of tables, got int"),
    "a table twice": (lambda: EngramSinkhorn([torch.nn.Parameter(torch.randn(4, 64))] * 2), ValueError,
                      r"EngramSinkhorn: a table appears twice .*\(param group 0, table 1\)"),
    "group a list": (lambda: EngramSinkhorn([torch.nn.Parameter(torch.randn(4, 64))]).add_param_group([]), TypeError,
                     r"EngramSinkhorn: a param group must be a dict, got list"),
    "closure a float": (lambda: EngramSinkhorn([torch.nn.Parameter(torch.randn(4, 64))]).step(closure=1.0), TypeError,
                        r"EngramSinkhorn.step: closure must be callable or None, got float"),
    "sinkhorn_iters a float": (lambda: EngramSinkhorn([torch.nn.Parameter(torch.randn(4, 64))], sinkhorn_iters=2.0),
                               TypeError, r"EngramSinkhorn: sinkhorn_iters must be an int, got float"),
}


@pytest.mark.parametrize("case", list(_MISUSE))
def test_python_level_misuse_names_the_function_and_the_argument(case):
    call, exc, match = _MISUSE[case]
    with pytest.raises(exc, match=match):
        call()


def test_a_loaded_group_without_a_key_is_refused_at_step_by_name(seed):
    p = torch.nn.Parameter(table(4, 64, seed))
    opt = EngramSinkhorn([p])
    saved = opt.state_dict()
    del saved["param_groups"][0]["eps"]
    opt.load_state_dict(saved)
    p.grad = table(4, 64, seed + 1)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"EngramSinkhorn: eps is missing \(param group 0\)"):
        opt.step()
    assert not opt.state and torch.equal(p.detach(), before)


def test_sinkhorn_update_takes_numpy_ints_and_floats(seed):
    x = table(40, 64, seed)
    want = sinkhorn_update(x, 3, 1e-8, 8.0)
    assert torch.equal(sinkhorn_update(x, np.int64(3), np.float64(1e-8), np.float32(8.0)), want)


# --- lowering: the sizes that matter, the table streaming, other widths and mixed dtypes --------------


test_ascend_lowers_within_ub, test_cuda_compiles_to_sm90a_cubin = lowering_tests("sinkhorn")


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


def test_ascend_lowers_other_widths_and_mixed_dtypes_within_ub():
    pytest.importorskip("tilelang")
    from cann_ops_tilelang.kernels.ascend import _build as ascend_build
    from cann_ops_tilelang.kernels.ascend.engram import sinkhorn as asc

    funcs = [asc.build_engram_sinkhorn_momentum_update("bfloat16", "float32", True, 64),
             asc.build_engram_sinkhorn_momentum_update("float32", "bfloat16", False, 64)]
    for cols in (192, 1024):
        funcs += [asc.build_engram_sinkhorn_step(cols), asc.build_engram_sinkhorn_step_reduce(cols),
                  asc.build_engram_sinkhorn_finalize(cols, 64),
                  asc.build_engram_sinkhorn_finalize_apply(cols, 64, "bfloat16"),
                  asc.build_engram_sinkhorn_finalize_apply(cols, 64, "float32")]
    for f in funcs:
        lowered = ascend_build.lower_ascendc(f)
        assert 0 < lowered.ub_bytes <= lowered.budget_bytes


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_compiles_other_widths_and_mixed_dtypes():
    pytest.importorskip("tilelang")
    from cann_ops_tilelang.kernels.cuda import _build as cuda_build
    from cann_ops_tilelang.kernels.cuda.engram import sinkhorn as cu

    assert [cu.row_layout(d) for d in (64, 128, 192, 256, 1024)] == [cu.RowLayout(*layout) for layout in (
        (16, 1, 16), (32, 1, 8), (16, 3, 16), (32, 2, 8), (32, 8, 8))]
    funcs = [cu.build_engram_sinkhorn_momentum_update("bfloat16", "float32", True),
             cu.build_engram_sinkhorn_momentum_update("float32", "bfloat16", False),
             cu.build_engram_sinkhorn_step(192), cu.build_engram_sinkhorn_step(1024),
             cu.build_engram_sinkhorn_finalize(1024), cu.build_engram_sinkhorn_step_reduce(1024),
             cu.build_engram_sinkhorn_finalize_apply(192, "bfloat16"),
             cu.build_engram_sinkhorn_finalize_apply(1024, "float32")]
    for f in funcs:
        built = cuda_build.compile_cubin(f, arch="sm_90a")
        assert built.cubin[:4] == b"\x7fELF" and built.fits
        assert "__fmul_rn" in built.source  # no contracted products
    # the column-scale epilogue and the table update: every operation explicitly rounded
    reduce_src = cuda_build.compile_cubin(cu.build_engram_sinkhorn_step_reduce(64), arch="sm_90a").source
    assert all(f in reduce_src for f in ("__fmul_rn", "__fsqrt_rn", "__fadd_rn", "__fdiv_rn"))
    apply_src = cuda_build.compile_cubin(cu.build_engram_sinkhorn_finalize_apply(64, "bfloat16"), arch="sm_90a").source
    assert "__fsub_rn(__fmul_rn(" in apply_src
    # the momentum update at both plans: 4-element vectors per buffer in the main pass (16 bytes of fp32, 8 of
    # bf16), a masked element-wise tail; the small tables' plan below its threshold, the large one from it on
    assert cu.momentum_plan(cu.PLAN.momentum_small_numel - 1) == cu.PLAN.momentum_small
    assert cu.momentum_plan(cu.PLAN.momentum_small_numel) == cu.PLAN.momentum_large
    for plan in (cu.PLAN.momentum_small, cu.PLAN.momentum_large):
        for dtype, vector in (("float32", "*(float4*)"), ("bfloat16", "*(uint2*)")):
            mom_src = cuda_build.compile_cubin(cu.build_engram_sinkhorn_momentum_update(
                dtype, dtype, True, plan.vectors, plan.threads), arch="sm_90a").source
            assert vector in mom_src and "< numel" in mom_src and "== (numel >> 2)" in mom_src


def test_cuda_step_splits_a_worker_where_four_pieces_of_the_least_rows_fit():
    from cann_ops_tilelang.kernels.cuda.engram import sinkhorn as cu

    least, pieces = cu.PLAN.step_split_rows, cu.PLAN.step_split
    assert least == 448 and pieces == 4
    edge = P_CUDA * (pieces * least - 1)  # the most rows at which a worker owns fewer than 4 * 448 rows
    rows = [0, 1, 300007, edge, edge + 1, 1000003, 10**7]
    assert [cu.step_split(r) for r in rows] == [1, 1, 1, 1, 4, 4, 4]
    assert [cu.STEP.key(torch.empty(r, 64, device="meta")) for r in (edge, edge + 1)] == [
        cu.StepKey(64, False), cu.StepKey(64, True)]


@pytest.mark.parametrize("cols", [64, 128, 192, 256, 512])
def test_cuda_step_scattered_row_sums_are_the_butterfly_sums(cols, seed):
    """The step's scattered reduction (each lane left with one row's sum of squares), simulated lane by lane in
    fp32: every row's sum is bitwise the one an xor butterfly per row leaves in all its lanes, and the lanes
    ``scatter_row(u)`` (u < rows) hold each row once."""
    pytest.importorskip("tilelang")
    from cann_ops_tilelang.kernels.cuda.engram import sinkhorn as cu

    lanes, rows = cu.row_layout(cols).lanes, cu.rows_in_flight(cols)
    part = (torch.randn(lanes, rows, generator=gen(seed)) * 10.0 ** torch.randint(-6, 7, (lanes, rows),
                                                                                   generator=gen(seed + 1)))
    xor = lambda v, mask: v[[lane ^ mask for lane in range(lanes)]]  # noqa: E731  (shfl_xor over the lanes)
    fly = part.clone()
    for o in range(lanes.bit_length() - 1):
        fly = fly + xor(fly, 1 << o)
    s = part.clone()
    upper = torch.arange(lanes)
    for b in range(rows.bit_length() - 1):
        half, up = rows >> (b + 1), ((upper >> b) & 1).bool()
        keep = torch.where(up[:, None], s[:, half:2 * half], s[:, :half])
        send = torch.where(up[:, None], s[:, :half], s[:, half:2 * half])
        s = torch.cat([keep + xor(send, 1 << b), s[:, 2 * half:]], dim=1)
    for o in range(rows.bit_length() - 1, lanes.bit_length() - 1):
        s[:, 0] = s[:, 0] + xor(s[:, 0], 1 << o)
    for lane in range(lanes):
        assert torch.equal(s[lane, 0], fly[lane, cu.scatter_row(lane, rows)])
    assert [cu.scatter_row(cu.scatter_row(u, rows), rows) for u in range(rows)] == list(range(rows))


def test_builders_refuse_widths_outside_the_range():
    pytest.importorskip("tilelang")
    from cann_ops_tilelang.kernels.ascend.engram import sinkhorn as asc
    from cann_ops_tilelang.kernels.cuda.engram import sinkhorn as cu
    from cann_ops_tilelang.limits import LimitError

    for call in (lambda: cu.build_engram_sinkhorn_step(96), lambda: cu.build_engram_sinkhorn_finalize(1088),
                 lambda: cu.build_engram_sinkhorn_step_reduce(32), lambda: asc.build_engram_sinkhorn_step(96),
                 lambda: asc.build_engram_sinkhorn_step(64, 65), lambda: asc.build_engram_sinkhorn_finalize(2048, 64)):
        with pytest.raises(LimitError, match="a column count D|partial rows"):
            call()


# --- device tier -----------------------------------------------------------------------------------------

# 1000003 rows: 4 CUDA step CTAs per partial row (the split schedule and its second kernel)
DEVICE_SHAPES = [(0, 64), (1, 64), (509, 64), (8001, 128), (100001, 64), (4097, 1024), (1000003, 64)]


@requires_device
@pytest.mark.parametrize("gdt", [BF16, F32])
@pytest.mark.parametrize("mdt", [BF16, F32])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("numel", [0, 5, 256, 1001 * 256 + 7, (1 << 22) - 3, 100001 * 512 + 131])
def test_device_momentum_bitwise(gdt, mdt, nesterov, numel, device, seed):
    g = torch.randn(numel, generator=gen(seed)).to(gdt)
    m = torch.randn(numel, generator=gen(seed + 1)).to(mdt)
    m_ref = m.clone()
    want = engram_sinkhorn_momentum_update_ref(g, m_ref, 0.95, nesterov)
    md = m.to(device)
    got = ops.engram_sinkhorn_momentum_update(g.to(device), md, 0.95, nesterov)
    assert torch.equal(got.cpu(), want) and torch.equal(md.cpu(), m_ref)


@requires_device
@pytest.mark.parametrize("rows,cols", DEVICE_SHAPES)
def test_device_step_reduce_finalize(rows, cols, device, seed):
    a = table(rows, cols, seed, zero_rows=(0,) if rows else ())
    r = torch.rand(rows, generator=gen(seed + 1)) + 0.5
    c = torch.rand(cols, generator=gen(seed + 2)) + 0.5
    r_ref = r.clone()
    norm_ref, part_ref = engram_sinkhorn_step_ref(a, r_ref, c, 1e-8, outputs=(None, torch.empty(P_CUDA, cols)))
    outs = []
    for _ in range(2):  # run to run: bitwise
        rd = r.to(device)
        norm, part = ops.engram_sinkhorn_step(a.to(device), rd, c.to(device), 1e-8)
        colsq = torch.empty(cols, device=device)
        cd = c.to(device)
        ops.engram_sinkhorn_step_reduce(part, colsq, cd, max(rows, 1), 1e-8)
        fin = ops.engram_sinkhorn_finalize(a.to(device), rd, c.to(device), 1e-8, math.sqrt(cols))
        pd = table(rows, cols, seed + 3, dtype=BF16).to(device)
        ops.engram_sinkhorn_finalize_apply(a.to(device), rd, c.to(device), 1e-8, math.sqrt(cols), pd, 0.01, 0.999)
        outs.append([t.cpu() for t in (norm, rd, part, colsq, fin, cd, pd)])
    for x, y in zip(*outs):
        assert torch.equal(bits(x), bits(y))
    norm, rd, part, colsq, fin, cd, pd = outs[0]
    # fp32 sums in another order than torch's (butterfly / per-worker groups): default fp32 tolerances
    torch.testing.assert_close(norm, norm_ref)
    torch.testing.assert_close(rd, r_ref)
    want_colsq, want_cs = torch.empty(cols), c.clone()
    engram_sinkhorn_step_reduce_ref(part, want_colsq, want_cs, max(rows, 1), 1e-8)
    assert torch.equal(colsq, want_colsq)  # the reduce: the same sequential order, bitwise
    assert torch.equal(cd, want_cs)  # and its column-scale epilogue, every operation rounded alike
    # the apply variant: the device's own finalize applied, every operation rounded alike (bitwise)
    want_p = table(rows, cols, seed + 3, dtype=BF16)
    engram_sinkhorn_finalize_apply_ref(a, rd, c, 1e-8, math.sqrt(cols), want_p, 0.01, 0.999)
    torch.testing.assert_close(pd.float(), want_p.float(), rtol=1.6e-2, atol=1e-5)  # finalize's order: bf16 ulps
    p_from_fin = (table(rows, cols, seed + 3, dtype=BF16).float() * 0.999 - fin * 0.01).to(BF16)
    assert torch.equal(bits(pd), bits(p_from_fin))
    torch.testing.assert_close(colsq, part_ref.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part, part_ref)  # each worker's rows (docs/ops/engram.md: default fp32 tolerances)
    torch.testing.assert_close(fin, engram_sinkhorn_finalize_ref(a, r_ref, c, 1e-8, math.sqrt(cols)))


@requires_device
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_device_optimizer_matches_cpu_references_and_repeats_bitwise(dtype, device, seed):
    rows, cols = 20001, 128
    w = table(rows, cols, seed, dtype=dtype)
    grads = [table(rows, cols, seed + k, dtype=dtype, zero_rows=(5,)) for k in range(1, 4)]
    kwargs = dict(lr=0.01, sinkhorn_iters=5, eps=1e-10, weight_decay=0.01)
    cpu, _ = run_optimizer(w, grads, **kwargs)
    dev = []
    for _ in range(2):
        got, _ = run_optimizer(w.to(device), [g.to(device) for g in grads], **kwargs)
        dev.append(got.cpu())
    assert torch.equal(bits(dev[0]), bits(dev[1]))
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == BF16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dev[0].float(), cpu.float(), **tol)


@requires_cuda
def test_cuda_optimizer_compiles_with_inductor(device, seed):
    w = table(4096, 64, seed).to(device)
    grads = [table(4096, 64, seed + k).to(device) for k in (1, 2)]
    eager, _ = run_optimizer(w, grads, lr=0.01)
    p = torch.nn.Parameter(w.clone())
    opt = EngramSinkhorn([p], lr=0.01)
    step = torch.compile(opt.step, fullgraph=True)
    for g in grads:
        p.grad = g.clone()
        step()
    # every float operation of the step is in an op (docs/ops/engram.md#sinkhorn): the compiled step is bitwise
    assert torch.equal(bits(p), bits(eager))
