"""The Engram Sinkhorn optimizer ops and ``cann_ops_tilelang.optim.EngramSinkhorn`` (docs/ops/engram.md#sinkhorn).

CPU tier (the ops run their references, tests/engram/engram_ref.py): validation, the device-free CPU error,
fakes, opcheck, torch.compile traces, the references against independent fp32/fp64 arithmetic, the optimizer
against a plain PyTorch formulation of its update, determinism, zero rows, the state_dict round trip, and
lowering of both backends at the widths the lowering suite skips. Device tier (skipped without a GPU/NPU):
every op against its reference on the device and bitwise run to run, and the optimizer for a few steps.
"""

import copy
import io
import math
import shutil

import numpy as np
import pytest
import torch
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
from torch._subclasses.fake_tensor import FakeTensorMode

import cann_ops_tilelang as ops
from cann_ops_tilelang.engram.sinkhorn import sinkhorn_partials
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
    assert opt.param_groups[-1] is group and group["beta1"] == 0.3 and "momentum" not in group
    assert len(opt.param_groups[0]["params"]) == 1
    with pytest.raises(ValueError, match="EngramSinkhorn: expected a table width"):
        EngramSinkhorn(torch.nn.Embedding(8, 100).named_parameters())


def test_optimizer_group_momentum_alias_and_gradient_kind():
    tables = [torch.nn.Parameter(torch.randn(4, 64)) for _ in range(2)]
    opt = EngramSinkhorn([{"params": [tables[0]], "momentum": 0.25}, {"params": [tables[1]]}], beta1=0.5)
    assert [g["beta1"] for g in opt.param_groups] == [0.25, 0.5] and "momentum" not in opt.param_groups[0]
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
    a, r, c = table(rows, cols, seed), torch.rand(rows, generator=gen(seed)) + 0.5, torch.rand(cols) + 0.5
    n = rows * cols + 5  # any element count
    g, m = torch.randn(n, generator=gen(seed + 1)), torch.randn(n, generator=gen(seed + 2))
    return [
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_momentum_update.default, (g.bfloat16(), m.bfloat16(), 0.9, True)),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_momentum_update.default, (g, m, 0.95, False)),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_momentum_update.default, (g.bfloat16(), m, 0.95, True)),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_step.default, (a, r, c, 1e-8)),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_step_reduce.default,
         (torch.rand(7, cols), torch.zeros(cols), torch.rand(cols) + 0.5, max(rows, 1), 1e-8)),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_finalize.default, (a, r, c, 1e-8, math.sqrt(cols))),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_finalize_out.default,
         (a, r, c, 1e-8, 2.0, torch.empty(rows, cols))),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_finalize_apply.default,
         (a, r, c, 1e-8, 2.0, table(rows, cols, seed + 3, dtype=BF16), 0.01, 0.999)),
        (torch.ops.cann_ops_tilelang.engram_sinkhorn_finalize_apply.default,
         (a, r, c, 1e-8, 2.0, table(rows, cols, seed + 4), 0.01, 1.0)),
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


# --- lowering at the widths and dtypes the lowering suite does not cover ----------------------------------


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
