"""``engram_gate_forward``, ``engram_gate_forward_inplace`` and ``engram_gate_backward`` (docs/ops/engram.md#gate), with and
without the residual.

CPU tier (the ops run the CPU references of tests/_plugins/references.py): the backward reference against float64
autograd, the no-residual reference against the residual one; validation (every tensor argument, hc_mult, the mask,
the scalars, the flags); torch.compile traces; both backends' kernels lowered at the sizes that matter (AscendC within
the UB, sm_90a cubins within the per-CTA limits), the launch keys (the token count is not in them), the kernels
without the residual, the CUDA forward's thread layout and the backward's schedules. Device tier (skipped without a
GPU/NPU): the forward and the backward against the fp32 reference at the tolerances and bitwise contracts of
docs/ops/engram.md#conventions, with and without the residual, at the model sizes and the CUDA schedules they do not
reach.

Elsewhere: the tests over the gate with the fused weight and the weight reduction together (fakes, opcheck, a
compiled training step) in test_engram_family.py; the autograd wrapper (``modeling.engram_gate``,
``modeling.EngramGate``) in test_engram_modeling.py.
"""

import dataclasses

import pytest
import torch
from _plugins.device import requires_cuda, requires_device
from engram_ref import engram_fused_weight_ref, engram_gate_backward_ref, engram_gate_forward_ref, gate_model
from engram_testing import (
    BF16,
    CLAMP,
    DEVICE_HIDDEN,
    DEVICE_TOKENS,
    EPS,
    F32,
    HIDDEN,
    M,
    SETTINGS,
    all_args,
    assert_equal,
    expect,
    gate_args,
    gate_bwd_args,
    gate_fwd_args,
    gen,
    inputs,
    lowering_tests,
    meta,
    validation_tests,
)
from hypothesis import given
from hypothesis import strategies as st

import cann_ops_tilelang as ops
from cann_ops_tilelang import config
from cann_ops_tilelang.kernels.ascend.engram import gate as ascend_gate
from cann_ops_tilelang.kernels.cuda import _build as cuda_build
from cann_ops_tilelang.kernels.cuda import engram as cuda_engram
from cann_ops_tilelang.kernels.cuda.engram import gate as cuda_gate


# --- the references: backward against float64 autograd, without the residual --------------------------


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [1, 13])
def test_reference_backward_vs_float64_autograd(tokens, masked, seed):
    x, kv, wh, we, _, mask = all_args(tokens, masked, seed)
    d = torch.float64
    eps, clamp = 1e-6, 1e-6
    x64, kv64, wh64, we64 = (t.to(d).requires_grad_() for t in (x, kv, wh, we))
    out = gate_model(x64, kv64, wh64, we64, eps, clamp, mask)
    go = torch.randn(out.shape, generator=gen(seed + 1), dtype=d)
    out.backward(go)
    # closed-form backward in float64 from float64 statistics
    with torch.no_grad():
        m = x.shape[1]
        xd, kd = x64.detach(), kv64.detach()
        wf = wh64.detach() * we64.detach()
        raw = (xd * wf * kd[:, :m]).sum(-1)
        rx = torch.rsqrt(xd.square().mean(-1) + eps)
        rk = torch.rsqrt(kd[:, :m].square().mean(-1) + eps)
        z = raw * rx * rk / x.shape[-1] ** 0.5
        g = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp_min(z.abs(), clamp)), z))
        gx, gkv, part = engram_gate_backward_ref(go, xd, kd, wf, raw, g, rx, rk, clamp, mask, partials=3)
        gwh = torch.zeros_like(wf)
        gwe = torch.zeros_like(wf)
        gw = part.sum(0)
        gwh += gw * we64.detach()
        gwe += gw * wh64.detach()
    for name, got, want in (("x", gx, x64.grad), ("kv", gkv, kv64.grad), ("wh", gwh, wh64.grad),
                            ("we", gwe, we64.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("masked", [False, True])
def test_gate_no_residual_reference_is_the_residual_output_without_x(masked, seed):
    """``residual=False``: output ``bf16(g·v)`` (zeros on masked tokens), the same statistics; the backward's
    ``grad_x`` lacks exactly ``go`` (masked tokens: 0), ``grad_kv`` and the partials are unchanged."""
    x, kv, wh, we, wf, mask = gate_args(33, masked, seed)
    res = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)
    nores = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask, residual=False)
    for a, b in zip(res[1:], nores[1:]):
        assert torch.equal(a, b)
    gated = (res[2].unsqueeze(-1) * kv[:, 4:].float()).bfloat16()
    if mask is not None:
        gated[mask] = 0
    assert torch.equal(nores[0], gated)
    go = torch.randn(x.shape, generator=gen(seed + 1)).bfloat16()
    full = engram_gate_backward_ref(go.float(), x, kv, wf, *res[1:], CLAMP, mask, partials=3)
    part = engram_gate_backward_ref(go.float(), x, kv, wf, *res[1:], CLAMP, mask, False, partials=3)
    assert torch.equal(full[1], part[1]) and torch.equal(full[2], part[2])
    # masked tokens: go with the residual, 0 without; others: go + the gate's term, the term alone
    torch.testing.assert_close(full[0] - go.float(), part[0], rtol=0, atol=2e-6)
    if mask is not None:
        assert torch.equal(part[0][mask], torch.zeros_like(part[0][mask]))


@pytest.mark.parametrize("masked", [False, True])
def test_gate_no_residual_backward_vs_float64_autograd(masked, seed):
    x, kv, wh, we, _, mask = gate_args(13, masked, seed)
    d, eps, clamp = torch.float64, 1e-6, 1e-6
    x64, kv64, wh64, we64 = (t.to(d).requires_grad_() for t in (x, kv, wh, we))
    out = gate_model(x64, kv64, wh64, we64, eps, clamp, mask, residual=False)
    go = torch.randn(out.shape, generator=gen(seed + 1), dtype=d)
    out.backward(go)
    with torch.no_grad():
        xd, kd, wf = x64.detach(), kv64.detach(), wh64.detach() * we64.detach()
        raw = (xd * wf * kd[:, :4]).sum(-1)
        rx = torch.rsqrt(xd.square().mean(-1) + eps)
        rk = torch.rsqrt(kd[:, :4].square().mean(-1) + eps)
        z = raw * rx * rk / HIDDEN**0.5
        g = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp_min(z.abs(), clamp)), z))
        gx, gkv, part = engram_gate_backward_ref(go, xd, kd, wf, raw, g, rx, rk, clamp, mask, False, partials=3)
        gw = part.sum(0)
    for name, got, want in (("x", gx, x64.grad), ("kv", gkv, kv64.grad), ("wh", gw * we64.detach(), wh64.grad),
                            ("we", gw * wh64.detach(), we64.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)


# --- validation ---------------------------------------------------------------------------------------


# every tensor argument: wrong dtype -> TypeError, wrong rank/shape/layout -> ValueError, not a tensor -> TypeError
test_wrong_dtype, test_wrong_rank_or_shape, test_non_contiguous, test_not_a_tensor = validation_tests(
    "engram_gate_forward", "engram_gate_backward")


@given(m=st.integers(1, 8).filter(lambda m: m != M))
@SETTINGS
def test_unsupported_hc_mult(m):
    hidden, tokens = 512, 2
    kwargs = gate_fwd_args(tokens, hidden)
    kwargs.update(
        hidden_states=meta((tokens, m, hidden), BF16),
        kv=meta((tokens, m + 1, hidden), BF16),
        weight_fused=meta((m, hidden), F32),
    )
    message = expect(ValueError, ops.engram_gate_forward, kwargs, "engram_gate_forward", "hidden_states")
    assert "hc_mult" in message and str(m) in message


@given(tokens=st.integers(0, 40), wrong=st.integers(0, 40))
@SETTINGS
def test_mask_shape_and_dtype(tokens, wrong):
    kwargs = gate_fwd_args(tokens)
    if wrong != tokens:
        kwargs["image_token_mask"] = meta((wrong,), torch.bool)
        expect(ValueError, ops.engram_gate_forward, kwargs, "engram_gate_forward", "image_token_mask")
    kwargs["image_token_mask"] = meta((tokens,), torch.uint8)
    expect(TypeError, ops.engram_gate_forward, kwargs, "engram_gate_forward", "image_token_mask")
    kwargs = gate_bwd_args(tokens)
    kwargs["image_token_mask"] = meta((tokens, 1), torch.bool)
    expect(ValueError, ops.engram_gate_backward, kwargs, "engram_gate_backward", "image_token_mask")


@pytest.mark.parametrize("arg,value,exc", [
    ("eps", -1.0, ValueError), ("eps", float("nan"), ValueError), ("eps", "1e-6", TypeError),
    ("clamp_value", 0.0, ValueError), ("clamp_value", float("inf"), ValueError),
])
def test_scalars(arg, value, exc):
    kwargs = gate_fwd_args()
    kwargs[arg] = value
    expect(exc, ops.engram_gate_forward, kwargs, "engram_gate_forward", arg)


def test_inplace_with_save_for_backward():
    kwargs = gate_fwd_args()
    kwargs["inplace"] = True
    message = expect(ValueError, ops.engram_gate_forward, kwargs, "engram_gate_forward", "inplace")
    assert "save_for_backward" in message


def test_gate_no_residual_refusals(seed):
    x, kv, wh, we, wf, mask = gate_args(5, False, seed)
    with pytest.raises(ValueError, match="engram_gate_forward: argument 'inplace': .*residual=False"):
        ops.engram_gate_forward(x.clone(), kv, wf, EPS, CLAMP, False, None, inplace=True, residual=False)
    with pytest.raises(TypeError, match="engram_gate_forward: argument 'residual'"):
        ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, None, residual=1)
    out, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP)
    with pytest.raises(TypeError, match="engram_gate_backward: argument 'residual'"):
        ops.engram_gate_backward(out, x, kv, wf, dot, g, rx, rk, CLAMP, None, "no")


# --- torch.compile traces through the fakes -----------------------------------------------------------


def gate_model_compiled(x, kv, wf, mask):
    out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)
    return out.float() * 2, dot + g, rx * rk


def test_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(gate_model_compiled, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (7, 9, 17):  # (not 4, 5: duck sizing would tie T to m or m + 1)
            x, kv, wh, we, wf, mask = all_args(tokens, True, seed + tokens)
            got = compiled(x, kv, wf, mask)
            want = gate_model_compiled(x, kv, wf, mask)
            for a, b in zip(got, want):
                assert torch.equal(a, b)


# --- kernels: lowering, launch keys, layouts and schedules --------------------------------------------


test_ascend_lowers_within_ub, test_cuda_compiles_to_sm90a_cubin = lowering_tests("gate")


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


# --- device tier: engram_gate_forward ---------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_fwd(tokens, hidden, masked, device, seed):
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    x0 = x.clone()
    out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)
    r_out, r_dot, r_g, r_rx, r_rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)
    assert_equal(x, x0)
    torch.testing.assert_close(out, r_out, rtol=8e-3, atol=8e-3)
    text = slice(None) if mask is None else ~mask
    torch.testing.assert_close(dot[text], r_dot[text], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(g[text], r_g[text], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rx[text], r_rx[text])
    torch.testing.assert_close(rk[text], r_rk[text])
    if mask is not None:
        assert_equal(out[mask], x[mask])
        for stat in (dot, g, rx, rk):
            assert torch.equal(stat[mask], torch.zeros_like(stat[mask]))
    # bitwise contracts: no statistics, and in place, give the very same output
    out_nosave, *nones = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, False, mask)
    assert nones == [None] * 4
    assert_equal(out_nosave, out)
    y = x.clone()
    out_inplace, *nones = ops.engram_gate_forward(y, kv, wf, EPS, CLAMP, False, mask, inplace=True)
    assert out_inplace is y and nones == [None] * 4
    assert_equal(y, out)


# --- device tier: engram_gate_backward ---------------------------------------------------------------------


def check_gate_bwd(tokens, hidden, masked, device, seed, mask=None):
    x, kv, wh, we, drawn = inputs(tokens, hidden, masked, device, seed)
    mask = drawn if mask is None else mask.to(device)
    wf = engram_fused_weight_ref(wh, we)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().to(device)
    _, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)  # statistics from the fp32 reference
    gx, gkv, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
    r_gx, r_gkv, r_part = engram_gate_backward_ref(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, partials=part.shape[0])
    torch.testing.assert_close(gx, r_gx, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(gkv, r_gkv, rtol=7e-3, atol=7e-3)
    gw, r_gw = part.sum(0), r_part.sum(0)
    torch.testing.assert_close(gw * we.float(), r_gw * we.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw * wh.float(), r_gw * wh.float(), rtol=1e-4, atol=2e-4)
    if x.device.type == "cuda":
        # CUDA partition: row p is the sum over worker p's contiguous token range
        torch.testing.assert_close(part, r_part, rtol=1e-4, atol=1e-4)
    if mask is not None:
        assert_equal(gx[mask], go[mask])
        assert torch.equal(gkv[mask], torch.zeros_like(gkv[mask]))
    if tokens == 0:
        assert torch.equal(part, torch.zeros_like(part))


@requires_device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_bwd(tokens, hidden, masked, device, seed):
    check_gate_bwd(tokens, hidden, masked, device, seed)


@requires_device
@requires_cuda
@pytest.mark.parametrize(
    "hidden",
    [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in (4352, 5120, 7424)],
    ids=["tile-in-smem", "cluster-split", "one-warp"],
)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [509, 4001])
def test_gate_bwd_other_schedules(tokens, hidden, masked, device, seed):
    """The CUDA schedules the model sizes above do not reach: the weight-gradient tile in shared memory
    (H = 4352), a second size of the two-CTA column split (H = 5120, P = 66; its token-pipelined kernel at
    T = 509, 8 tokens per worker, the other one at T = 4001, 61 per worker) and the untuned one-warp
    schedule of H / 256 prime (H = 7424: 29 column vectors per thread)."""
    check_gate_bwd(tokens, hidden, masked, device, seed)


@requires_device
@requires_cuda
@pytest.mark.parametrize(
    "hidden", [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in (5120, 7168)]
)
@pytest.mark.parametrize("tokens", [67, 133, 509, 2112])
def test_gate_bwd_image_tokens_at_worker_edges(tokens, hidden, device, seed):
    """Image tokens where the token-pipelined split kernel changes how it loads (CUDA, one worker of
    ``per`` tokens per cluster): in worker w, by w % 5, its first token (go/v and x/k loaded before the
    loop), its second (go/v in its x/k buffer), its third (the first from the prefetched go/v rows), its
    last, or none; at T = 67, 133, 509 and 2112, 2, 3, 8 and 32 tokens per worker at P = 66."""
    per = -(-tokens // config.grad_w_partials("cuda", hidden))
    t = torch.arange(tokens)
    worker, at = t // per, t % per
    edge = torch.tensor([0, 1, 2, per - 1, -1])[worker % 5]
    check_gate_bwd(tokens, hidden, False, device, seed, mask=at == edge)


@requires_device
def test_gate_bwd_is_deterministic(device, seed):
    x, kv, wh, we, mask = inputs(509, 4096, True, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    _, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)
    first = ops.engram_gate_backward(x, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
    for _ in range(3):
        for a, b in zip(ops.engram_gate_backward(x, x, kv, wf, dot, g, rx, rk, CLAMP, mask), first):
            assert_equal(a, b)


# --- device tier: the gate without its residual (residual=False) --------------------------------------


@requires_device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_fwd_no_residual(tokens, hidden, masked, device, seed):
    """``residual=False``: the output within the forward's tolerance of ``bf16(g·v)`` of the reference, and
    bitwise ``bf16(gate_score · f32(v))`` of the kernel's own gate (one fp32 product, one rounding); masked
    tokens 0; the statistics byte-equal to the residual forward's; saving or not gives the same output."""
    check_gate_fwd_no_residual(tokens, hidden, masked, device, seed)


@requires_device
@pytest.mark.parametrize("hidden", [2304, 6400])
@pytest.mark.parametrize("masked", [False, True])
def test_gate_fwd_no_residual_guarded_rows(hidden, masked, device, seed):
    """The same at hidden sizes whose last vector slot is guarded (the no-residual build has its own thread
    layout there: two warps per stream)."""
    check_gate_fwd_no_residual(509, hidden, masked, device, seed)


def check_gate_fwd_no_residual(tokens, hidden, masked, device, seed):
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    out, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask, residual=False)
    r_out = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask, residual=False)[0]
    torch.testing.assert_close(out, r_out, rtol=8e-3, atol=8e-3)
    for a, b in zip((dot, g, rx, rk), ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask)[1:]):
        assert_equal(a, b)
    text = slice(None) if mask is None else ~mask
    own = (g.unsqueeze(-1) * kv[:, -1:].float()).bfloat16()
    assert_equal(out[text], own[text])
    if mask is not None:
        assert_equal(out[mask], torch.zeros_like(out[mask]))
    out_nosave, *nones = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, False, mask, residual=False)
    assert nones == [None] * 4
    assert_equal(out_nosave, out)


def check_gate_bwd_no_residual(tokens, hidden, masked, device, seed):
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    wf = engram_fused_weight_ref(wh, we)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().to(device)
    _, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask)
    gx, gkv, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, False)
    r_gx = engram_gate_backward_ref(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, False, partials=part.shape[0])[0]
    torch.testing.assert_close(gx, r_gx, rtol=8e-3, atol=7e-3)
    # grad_kv and the partials do not depend on the residual: byte-equal to the residual backward's
    _, gkv_res, part_res = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask)
    assert_equal(gkv, gkv_res)
    assert_equal(part, part_res)
    if mask is not None:
        assert_equal(gx[mask], torch.zeros_like(gx[mask]))


@requires_device
@pytest.mark.parametrize("hidden", DEVICE_HIDDEN)
@pytest.mark.parametrize("tokens", DEVICE_TOKENS)
@pytest.mark.parametrize("masked", [False, True])
def test_gate_bwd_no_residual(tokens, hidden, masked, device, seed):
    check_gate_bwd_no_residual(tokens, hidden, masked, device, seed)


@requires_device
@requires_cuda
@pytest.mark.parametrize("hidden", [pytest.param(h, marks=pytest.mark.xdist_group(f"H{h}")) for h in (4352, 7168)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tokens", [509, 4001])
def test_gate_bwd_no_residual_schedules(tokens, hidden, masked, device, seed):
    """The no-residual backward on the tile-in-shared-memory schedule (H = 4352) and on the split schedule,
    token-pipelined (H = 7168, T = 509: 8 tokens per worker) and not (T = 4001)."""
    check_gate_bwd_no_residual(tokens, hidden, masked, device, seed)
