"""The modeling layer of the Engram family: ``modeling.Engram``, and the gate's autograd wrapper
``modeling.engram_gate`` / ``modeling.EngramGate`` (the gate ops themselves: test_engram_gate.py).

CPU tier (the gate runs on the CPU references of tests/_plugins/references.py): the layer's output and the
gradient of every input and parameter against float64 autograd of the demo's math (``engram_layer_model``
in engram_ref.py), eager and under ``torch.compile(fullgraph=True)``; ``main_grad``; bad inputs; the n-gram
windows and the hash helper; the autograd wrapper against autograd of the gate's fp32 model, with and without the
residual, into ``main_grad``, compiled. Device tier (skipped without a device): the layer, compared the same way,
compiled by inductor; the autograd wrapper against the gate's fp32 model and its weight gradients bitwise against
the op chain, into ``main_grad``, compiled by inductor and CUDA graphs.

Comparison metric (docs/ops/engram.md#layer): the module stores ``kv``, ``g·v``, the norms'
and the convolution's outputs and every gradient in bf16, so it is compared with the float64 model with
the projections and ``g·v`` rounded to bf16 where the module stores them (gradients straight through; see
``engram_layer_model(stored=...)``) by ``calc_diff`` (relative squared error, the peer's test metric) below
``CALC_DIFF`` and by a largest error below ``MAX_ERR`` of the reference's largest magnitude.
"""

import math

import pytest
import torch
from _plugins.device import requires_cuda, requires_device
from engram_ref import (
    calc_diff,
    engram_fused_weight_ref,
    engram_gate_backward_ref,
    engram_gate_forward_ref,
    engram_grad_w_reduce_ref,
    engram_layer_model,
    gate_model,
    make_inputs,
)
from engram_testing import all_args, assert_equal, gate_args, inputs

import cann_ops_tilelang as ops
from cann_ops_tilelang import config
from cann_ops_tilelang.modeling import Engram, EngramGate, engram_gate, ngram_token_ids

# A bf16 rounding contributes u^2 = 2^-18 (3.8e-6) to calc_diff; the layer's longest chain (projection, gate,
# norm, convolution, SiLU, two adds, then the same backwards) has about eight. Measured on the CPU tier:
# at most 7.4e-6 (conv_norm_weight), largest error 0.0066 of the largest magnitude.
CALC_DIFF = 3e-5
MAX_ERR = 2**-6
EPS, CLAMP = 1e-20, 1e-6
HIDDEN = 512
SIZES = [31, 37, 41, 43, 47, 53, 59, 61]  # (N - 1) * heads = 2 * 4 tables, primes as in the demo
SMALL = dict(n_embed_per_ngram=64, n_head_per_ngram=4)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def assert_near(name, got, want):
    diff = calc_diff(got, want)
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert diff < CALC_DIFF and err <= MAX_ERR * scale, \
        f"{name}: calc_diff {diff:.3g}, max error {err:.3g} of {scale:.3g}"


def make_module(seed, hidden=HIDDEN, device="cpu"):
    torch.manual_seed(seed)
    return Engram(hidden, SIZES, **SMALL, device=device)


def layer_inputs(module, lead, length, seed, device="cpu"):
    g = gen(seed)
    m, hidden = module.hc_mult, module.hidden_size
    x = torch.randn(*lead, length, m, hidden, generator=g).bfloat16().to(device)
    local = torch.stack([torch.randint(0, s, (*lead, length), generator=g) for s in module.table_sizes], -1)
    ids = (local.to(device) + module.offsets.long()).to(torch.int32)
    go = torch.randn(*lead, length, m, hidden, generator=g).bfloat16().to(device)
    return x, ids, go


def parameters(module):
    return {
        "embedding.weight": module.embedding.weight, "kv_proj.weight": module.kv_proj.weight,
        "kv_proj.bias": module.kv_proj.bias, "gate.weight_hidden": module.gate.weight_hidden,
        "gate.weight_embed": module.gate.weight_embed, "conv_norm_weight": module.conv_norm_weight,
        "conv.weight": module.conv.weight,
    }


def reference(module, x, ids, go):
    """Output and gradients (of x, then each parameter) of the float64 demo model at the module's values."""
    d = torch.float64
    lead, length = x.shape[:-3], x.shape[-3]
    params = [p.detach().to(d).requires_grad_() for p in parameters(module).values()]
    x64 = x.detach().to(d).reshape(-1, length, *x.shape[-2:]).requires_grad_()
    out = engram_layer_model(x64, ids.long().reshape(-1, length, ids.shape[-1]), *params,
                             max_ngram_size=module.max_ngram_size, gate_eps=module.gate_eps,
                             conv_eps=module.conv_eps, clamp_value=module.clamp_value, stored=torch.bfloat16)
    out.backward(go.to(d).reshape(out.shape))
    return out.detach().reshape(*lead, *out.shape[1:]), [x64.grad.reshape(x.shape)] + [p.grad for p in params]


def ours(fn, module, x, ids, go):
    module.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    out = fn(xr, ids)
    out.backward(go)
    return out.detach(), [xr.grad] + [p.grad for p in parameters(module).values()]


def compare(module, got, want):
    out, grads = got
    ref_out, ref_grads = want
    assert out.dtype == torch.bfloat16
    assert_near("output", out, ref_out)
    for name, g, r in zip(["hidden_states", *parameters(module)], grads, ref_grads):
        assert g is not None and g.dtype == torch.bfloat16, name
        assert_near(name, g, r)


# --- the layer against the demo's math -----------------------------------------------------------------


@pytest.mark.parametrize("lead,length", [((2,), 16), ((), 9), ((2, 3), 5)])
def test_layer_matches_demo_math(lead, length, seed):
    module = make_module(seed)
    x, ids, go = layer_inputs(module, lead, length, seed + 1)
    got = ours(module, module, x, ids, go)
    compare(module, got, reference(module, x, ids, go))


def test_layer_compiled_fullgraph_equals_eager(seed):
    """``torch.compile(fullgraph=True)`` (no graph break) gives the eager bits, for two sequence lengths without
    a recompile (dynamic shapes)."""
    module = make_module(seed)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (7, 13):
            x, ids, go = layer_inputs(module, (2,), length, seed + length)
            eager_out, eager_grads = ours(module, module, x, ids, go)
            out, grads = ours(compiled, module, x, ids, go)
            assert torch.equal(out, eager_out)
            for a, b in zip(grads, eager_grads):
                assert torch.equal(a, b)
    compare(module, (out, grads), reference(module, x, ids, go))


def test_layer_is_causal(seed):
    """Changing the last token changes no earlier output (the convolution is causal, the rest per token)."""
    module = make_module(seed)
    x, ids, _ = layer_inputs(module, (1,), 12, seed + 2)
    with torch.no_grad():
        before = module(x, ids)
        x2, ids2 = x.clone(), ids.clone()
        x2[:, -1] = torch.randn(x2[:, -1].shape, generator=gen(seed + 3)).bfloat16()
        ids2[:, -1] = module.offsets
        after = module(x2, ids2)
    assert torch.equal(before[:, :-1], after[:, :-1]) and not torch.equal(before[:, -1], after[:, -1])


def test_gate_weights_main_grad(seed):
    """The gate's weights with an fp32 ``main_grad`` accumulate there (the gate's autograd function) and get
    no ``.grad``; the other parameters' gradients do not change; a second backward adds the same again."""
    module = make_module(seed)
    x, ids, go = layer_inputs(module, (2,), 8, seed + 4)
    _, grads = ours(module, module, x, ids, go)
    module.gate.weight_hidden.main_grad = torch.zeros(module.gate.weight_hidden.shape)
    module.gate.weight_embed.main_grad = torch.zeros(module.gate.weight_embed.shape)
    _, grads2 = ours(module, module, x, ids, go)
    assert module.gate.weight_hidden.grad is None and module.gate.weight_embed.grad is None
    # the bf16 .grad is the rounded fp32 gradient that main_grad accumulates
    once_h, once_e = module.gate.weight_hidden.main_grad.clone(), module.gate.weight_embed.main_grad.clone()
    assert torch.equal(once_h.bfloat16(), grads[4]) and torch.equal(once_e.bfloat16(), grads[5])
    for a, b in zip(grads2[:4] + grads2[6:], grads[:4] + grads[6:]):
        assert torch.equal(a, b)
    ours(module, module, x, ids, go)
    assert torch.equal(module.gate.weight_hidden.main_grad, 2 * once_h)
    assert torch.equal(module.gate.weight_embed.main_grad, 2 * once_e)


def test_frozen_gate_weights_get_nothing_in_their_main_grad(seed):
    module = make_module(seed)
    x, ids, go = layer_inputs(module, (2,), 8, seed + 4)
    for weight in (module.gate.weight_hidden, module.gate.weight_embed):
        weight.requires_grad_(False)
        weight.main_grad = torch.zeros(weight.shape)
    _, grads = ours(module, module, x, ids, go)
    for weight in (module.gate.weight_hidden, module.gate.weight_embed):
        assert weight.grad is None and not weight.main_grad.any()
    assert grads[0] is not None and module.kv_proj.weight.grad is not None


@pytest.mark.parametrize("lead,length", [((2,), 0), ((0,), 5), ((0, 3), 0)])
def test_layer_and_hash_of_no_tokens(lead, length, seed):
    module = make_module(seed)
    x, ids, go = layer_inputs(module, lead, length, seed)
    out, grads = ours(module, module, x, ids, go)
    assert out.shape == x.shape and grads[0].shape == x.shape
    # no token: every parameter's gradient is zero
    assert all(g is None or not g.any() for g in grads[1:])
    tokens = torch.zeros(*lead, length, dtype=torch.int32)
    rows = module.hash_ids(tokens, torch.tensor([3, 5, 7]), pad_id=0)
    assert rows.shape == (*lead, length, len(SIZES)) and rows.dtype == torch.int32


def test_parameters_and_initialization(seed):
    module = make_module(seed)
    m, hidden = 4, HIDDEN
    assert module.embedding.weight.shape == (sum(SIZES), 16)
    assert module.kv_proj.weight.shape == ((m + 1) * hidden, 2 * 64)
    assert module.kv_proj.bias.shape == ((m + 1) * hidden,)
    assert module.conv.weight.shape == (m * hidden, 1, 4) and module.conv.bias is None
    assert module.conv.dilation == (3,) and module.conv.padding == (9,)
    assert module.offsets.tolist() == [sum(SIZES[:i]) for i in range(len(SIZES))]
    assert module.offsets.dtype == torch.int32
    assert module.sizes.tolist() == SIZES and module.sizes.dtype == torch.int32
    for p in (module.gate.weight_hidden, module.gate.weight_embed, module.conv_norm_weight):
        assert torch.equal(p, torch.ones_like(p))
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert abs(module.embedding.weight.float().std().item() - 1) < 0.05  # N(0, 1)
    bound = 1 / math.sqrt(2 * 64)
    assert module.kv_proj.weight.abs().max().item() <= bound and module.kv_proj.bias.abs().max().item() <= bound
    assert module.conv.weight.abs().max().item() <= 0.5
    assert module.gate_eps == torch.finfo(torch.float32).eps and module.conv_eps == 1e-5 and module.clamp_value == 1e-6


# --- bad inputs --------------------------------------------------------------------------------------


def test_bad_inputs_name_the_module_and_argument(seed):
    module = make_module(seed)
    x, ids, _ = layer_inputs(module, (2,), 4, seed)
    prefix = "cann_ops_tilelang::modeling.Engram: argument"
    cases = [
        (lambda: module(x[..., :256], ids), ValueError, "'hidden_states'.*expected shape"),
        (lambda: module(x[0, 0], ids), ValueError, "'hidden_states'.*expected shape"),
        (lambda: module(x.float(), ids), TypeError, "'hidden_states'.*expected torch.bfloat16"),
        (lambda: module(x, ids.float()), TypeError, "'hash_ids'.*expected int32 or int64"),
        (lambda: module(x, ids[..., :3]), ValueError, "'hash_ids'.*expected shape"),
        (lambda: module(x, ids[:1]), ValueError, "'hash_ids'.*expected shape"),
        (lambda: module(x, ids.tolist()), TypeError, "'hash_ids'.*expected a torch.Tensor"),
        (lambda: Engram(HIDDEN, SIZES[:5], **SMALL), ValueError, "'table_sizes'.*expected 8 positive sizes"),
        (lambda: Engram(HIDDEN, SIZES, n_embed_per_ngram=64, n_head_per_ngram=5), ValueError, "'n_head_per_ngram'"),
        (lambda: Engram(HIDDEN, SIZES, max_ngram_size=1, **SMALL), ValueError, "'max_ngram_size'"),
        (lambda: module.hash_ids(ids[..., 0], [3, 5, 7], 0), TypeError, "'multipliers': expected a torch.Tensor"),
        (lambda: module.hash_ids(ids[..., 0], torch.tensor([3, 5, 7], dtype=torch.int32), 0), TypeError,
         "'multipliers': expected int64"),
        (lambda: module.hash_ids(ids[..., 0], torch.tensor([3, 5, 7], device="meta"), 0), ValueError,
         "'multipliers': expected a tensor on cpu"),
        # inputs on another device than the parameters (the forgotten .to(device)): named here, not by an op
        (lambda: module(x.to("meta"), ids.to("meta")), ValueError, "'hidden_states': expected a tensor on cpu"),
        # the constructor refuses what the gate, the norms or the tables would refuse (or turn into NaN) later
        (lambda: Engram(256, SIZES, **SMALL), ValueError, "'hidden_size': expected a hidden size a multiple of 256"),
        (lambda: Engram(512.0, SIZES, **SMALL), TypeError, "'hidden_size': expected an int"),
        (lambda: Engram(HIDDEN, SIZES, hc_mult=3, **SMALL), ValueError, "'hc_mult': expected hc_mult 4"),
        (lambda: Engram(HIDDEN, SIZES, dtype=torch.float32, **SMALL), TypeError, "'dtype': expected torch.bfloat16"),
        (lambda: Engram(HIDDEN, SIZES, clamp_value=-1.0, **SMALL), ValueError, "'clamp_value': expected a number >"),
        (lambda: Engram(HIDDEN, SIZES, gate_eps=-1.0, **SMALL), ValueError, "'gate_eps': expected a number >="),
        (lambda: Engram(HIDDEN, SIZES, conv_eps=float("nan"), **SMALL), ValueError, "'conv_eps': expected a number"),
        (lambda: Engram(HIDDEN, ["a"] * 8, **SMALL), TypeError, "'table_sizes': expected an int, got str"),
        (lambda: Engram(HIDDEN, 8, **SMALL), TypeError, "'table_sizes': expected a sequence of ints"),
        # the n-gram windows of hash_ids are checked under the method's name (the caller called hash_ids)
        (lambda: module.hash_ids(ids[..., 0], torch.tensor([3, 5, 7]), 0.5), TypeError, "'pad_id': expected an int"),
    ]
    for call, kind, match in cases:
        with pytest.raises(kind, match=f"{prefix} {match}"):
            call()
    prefix = "cann_ops_tilelang::modeling.ngram_token_ids: argument"
    for call, kind, match in [
        (lambda: ngram_token_ids(ids.float(), 3, 0), TypeError, "'token_ids'"),
        (lambda: ngram_token_ids(ids, "3", 0), TypeError, "'max_ngram_size': expected an int"),
        (lambda: ngram_token_ids(ids, 3, 2**40), ValueError, "'pad_id': expected an int32 token id"),
    ]:
        with pytest.raises(kind, match=f"{prefix} {match}"):
            call()
    prefix = "cann_ops_tilelang::modeling.EngramGate: argument"
    for call, kind, match in [
        (lambda: EngramGate(256), ValueError, "'hidden_size': expected a hidden size"),
        (lambda: EngramGate(HIDDEN, hc_mult=2), ValueError, "'hc_mult'"),
        (lambda: EngramGate(HIDDEN, eps=-1.0), ValueError, "'eps': expected a number >= 0"),
        (lambda: EngramGate(HIDDEN, clamp_value=0.0), ValueError, "'clamp_value': expected a number > 0"),
        (lambda: EngramGate(HIDDEN, dtype=torch.float16), TypeError, "'dtype': expected torch.bfloat16"),
    ]:
        with pytest.raises(kind, match=f"{prefix} {match}"):
            call()


# --- the modeling API's checks: the caller's names, before anything is built ----------------------------

GATE = "cann_ops_tilelang::modeling.engram_gate: argument"


def gate_leaves(tokens, seed):
    """Inputs of ``modeling.engram_gate`` (kv flat per token) and its two weights as parameters."""
    x, kv, wh, we, _ = make_inputs(tokens, HIDDEN, generator=gen(seed))
    return x, kv.view(tokens, -1), torch.nn.Parameter(wh), torch.nn.Parameter(we)


def test_gate_main_grads_that_overlap_are_refused_at_the_forward(seed):
    """Two weights sharing a main_grad (one buffer, or overlapping views of one bucket), or a main_grad on the bytes
    of an input: a ValueError at the forward naming engram_gate and the user's arguments; nothing is written. Views
    of one bucket that do not intersect are fine and give what separate buffers give."""
    x, kv, wh, we = gate_leaves(6, seed)
    bucket = torch.zeros(12, HIDDEN)
    on_kv = kv.view(torch.float32).reshape(-1)[: 4 * HIDDEN].view(4, HIDDEN)  # fp32 view of kv's bytes
    for main_h, main_e, match in (
        (bucket[0:4], bucket[0:4], "'weight_embed': expected a main_grad of its own, got one that overlaps the "
                                   "main_grad of 'weight_hidden'"),
        (bucket[0:4], bucket[3:7], "'weight_embed': expected a main_grad of its own, got one that overlaps the "
                                   "main_grad of 'weight_hidden'"),
        (on_kv, None, "'weight_hidden': expected a main_grad that shares no memory with the call's tensors, got one "
                      "that overlaps 'kv'"),
    ):
        kv_before = kv.clone()
        wh.main_grad = main_h
        we.main_grad = main_e
        with pytest.raises(ValueError, match=f"{GATE} {match}"):
            engram_gate(x, kv, wh, we)
        assert not bucket.any() and torch.equal(kv, kv_before) and wh.grad is None and we.grad is None
    go = torch.randn(x.shape, generator=gen(seed + 1)).bfloat16()
    results = []
    for mains in ((bucket[0:4], bucket[4:8]), (torch.zeros(4, HIDDEN), torch.zeros(4, HIDDEN))):
        wh.main_grad, we.main_grad = mains
        engram_gate(x, kv, wh, we).backward(go)
        results.append([m.clone() for m in mains])
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][0].any() and not bucket[8:].any()


def test_gate_main_grad_of_the_wrong_kind_is_refused_at_the_forward(seed):
    x, kv, wh, we = gate_leaves(6, seed)
    for bad, kind, match in (
        ([0.0] * 4, TypeError, "expected a torch.Tensor, got list"),
        # one wording with the mHC parameters' (modeling._buffers.honoured_main_grad)
        (torch.zeros(4, HIDDEN, dtype=torch.bfloat16), ValueError,
         "expected a contiguous fp32 buffer of the parameter's shape"),
        (torch.zeros(4, 2 * HIDDEN), ValueError,
         r"expected a contiguous fp32 buffer of the parameter's shape \(4, 512\)"),
        (torch.zeros(4, HIDDEN, device="meta"), ValueError,
         "expected a contiguous fp32 buffer .* on cpu, got .* on meta"),
        (torch.zeros(HIDDEN, 4).t(), ValueError,
         r"expected a contiguous fp32 buffer .*, got torch.float32 \(4, 512\) on cpu, not contiguous "
         r"\(strides \(1, 4\)\)"),
    ):
        we.main_grad = bad
        with pytest.raises(kind, match=f"{GATE} 'weight_embed.main_grad': {match}"):
            engram_gate(x, kv, wh, we)  # the forward, not the backward
        assert wh.grad is None and we.grad is None


def test_gate_flags_take_bools_only(seed):
    import numpy as np

    x, kv, wh, we = gate_leaves(4, seed)
    for bad, got in ((np.bool_(True), "numpy.bool True"), (np.bool_(False), "numpy.bool False"), (1, "int 1"),
                     ("True", "str 'True'"), (None, "None")):
        with pytest.raises(TypeError, match=f"{GATE} 'residual': expected a bool, got {got}"):
            engram_gate(x, kv, wh, we, residual=bad)
    assert wh.grad is None
    # the op's Python function: every flag, numpy bools named as such
    x3, kv3, wf = x, kv.view(4, 5, HIDDEN), engram_fused_weight_ref(wh.detach(), we.detach())
    for flags in ({"save_for_backward": np.bool_(True)}, {"inplace": np.bool_(False)}, {"residual": np.bool_(True)}):
        (arg,) = flags
        with pytest.raises(TypeError, match=f"engram_gate_forward: argument '{arg}': expected a bool, got numpy.bool"):
            ops.engram_gate_forward(x3, kv3, wf, EPS, CLAMP, **flags)


def test_gate_misuse_names_the_function_and_the_argument(seed):
    """Every argument of ``modeling.engram_gate``: a TypeError or ValueError naming the function and the argument
    the caller passed (never the fused weight or the flat views built from them, never an AttributeError)."""
    x, kv, wh, we = gate_leaves(6, seed)
    plain = torch.randn(2, 3, HIDDEN).bfloat16()  # (B, S, H): no stream dim
    cases = [
        ((x, kv, None, we), {}, TypeError, "'weight_hidden': expected a torch.Tensor"),
        ((x, kv, wh, None), {}, TypeError, "'weight_embed': expected a torch.Tensor"),
        ((x, kv, wh, [[1.0]]), {}, TypeError, "'weight_embed': expected a torch.Tensor"),
        ((x, kv, wh.float(), we), {}, TypeError, "'weight_hidden': expected torch.bfloat16"),
        ((x, kv, torch.ones(4, 2 * HIDDEN).bfloat16(), we), {}, ValueError,
         r"'weight_hidden': expected shape \(4, 512\) \(m, H of hidden_states \(6, 4, 512\)\), got \(4, 1024\)"),
        ((x, kv, wh, we.detach().t().contiguous().t()), {}, ValueError, "'weight_embed': expected a contiguous"),
        ((x, kv, wh, we.detach().to("meta")), {}, ValueError, "'weight_embed': expected a tensor on cpu"),
        ((None, kv, wh, we), {}, TypeError, "'hidden_states': expected a torch.Tensor"),
        ((x.float(), kv, wh, we), {}, TypeError, "'hidden_states': expected torch.bfloat16"),
        ((x[0, 0], kv, wh, we), {}, ValueError, r"'hidden_states': expected shape \(\*, m, H\)"),
        ((plain, kv, wh, we), {}, ValueError,
         r"'hidden_states': expected shape \(\*, m, H\) with m = hc_mult = 4 hidden streams \(those of the mHC "
         r"residual\) in dim -2, got shape \(2, 3, 512\) \(m = 3\); .*expand_from_embedding"),
        ((x[..., :256], kv, wh, we), {}, ValueError,
         r"'hidden_states': expected shape \(\*, m, H\) with H a hidden size a multiple of 256 in \[512, 8192\]"),
        ((x, None, wh, we), {}, TypeError, "'kv': expected a torch.Tensor"),
        ((x, kv.float(), wh, we), {}, TypeError, "'kv': expected torch.bfloat16"),
        ((x, kv.view(6, 5, HIDDEN), wh, we), {}, ValueError,
         r"'kv': expected shape \(6, 2560\), i.e. \(\*, \(m \+ 1\)·H\): per token the m = 4 keys then the value, "
         r"flat, .* got \(6, 5, 512\) \(a \(\*, m \+ 1, H\) kv: pass kv.flatten\(-2\)\)"),
        ((x, kv[:3], wh, we), {}, ValueError, r"'kv': expected shape \(6, 2560\)"),
        ((x, kv.to("meta"), wh, we), {}, ValueError, "'kv': expected a tensor on cpu"),
        ((x, kv, wh, we), {"image_token_mask": [True] * 6}, TypeError, "'image_token_mask': expected a torch.Tensor"),
        ((x, kv, wh, we), {"image_token_mask": torch.zeros(6)}, TypeError, "'image_token_mask': expected torch.bool"),
        ((x, kv, wh, we), {"image_token_mask": torch.zeros(1, 6, dtype=torch.bool)}, ValueError,
         r"'image_token_mask': expected shape \(6,\)"),
        ((x, kv, wh, we), {"image_token_mask": torch.zeros(6, dtype=torch.bool, device="meta")}, ValueError,
         "'image_token_mask': expected a tensor on cpu"),
        ((x, kv, wh, we), {"clamp_value": "1e-6"}, TypeError, "'clamp_value': expected a float"),
        ((x, kv, wh, we), {"clamp_value": 0.0}, ValueError, "'clamp_value': expected a number > 0"),
        ((x, kv, wh, we), {"eps": None}, TypeError, "'eps': expected a float"),
        ((x, kv, wh, we), {"eps": -1.0}, ValueError, "'eps': expected a number >= 0"),
    ]
    for args, kwargs, kind, match in cases:
        with pytest.raises(kind, match=f"{GATE} {match}") as info:
            engram_gate(*args, **kwargs)
        assert "weight_fused" not in str(info.value)
    assert wh.grad is None and we.grad is None


def test_gate_module_checks_its_sizes_against_the_input(seed):
    x, kv, _, _ = gate_leaves(6, seed)
    module = EngramGate(HIDDEN)
    wide = torch.randn(6, 4, 1024).bfloat16()
    prefix = "cann_ops_tilelang::modeling.EngramGate: argument"
    for args, kind, match in (
        ((wide, torch.randn(6, 5 * 1024).bfloat16()), ValueError,
         r"'hidden_states': expected shape \(\*, 4, 512\): the module's hc_mult = 4 hidden streams of its hidden "
         r"size 512, got shape \(6, 4, 1024\) \(4 streams of hidden size 1024\)$"),
        ((torch.randn(2, 3, HIDDEN).bfloat16(), kv), ValueError,
         r"'hidden_states': expected shape \(\*, 4, 512\).*\(3 streams of hidden size 512\); .*expand_from_embedding"),
        ((x, kv[:, :2048]), ValueError, r"'kv': expected shape \(\*, 2560\): per token the module's 4 keys then"),
        ((x, kv.view(6, 5, HIDDEN)), ValueError, r"'kv': .* pass kv.flatten\(-2\)"),
    ):
        with pytest.raises(kind, match=f"{prefix} {match}"):
            module(*args)
    for device, kind in (("nope", ValueError), (1.5, TypeError)):
        with pytest.raises(kind, match=f"{prefix} 'device'"):
            EngramGate(HIDDEN, device=device)


def test_layer_misuse_names_the_layer_and_the_argument(seed):
    module = make_module(seed)
    x, ids, _ = layer_inputs(module, (2,), 4, seed)
    tokens = torch.zeros(2, 4, dtype=torch.int32)
    mult = torch.tensor([3, 5, 7])
    prefix = "cann_ops_tilelang::modeling.Engram: argument"
    for call, kind, match in (
        (lambda: Engram(HIDDEN, "abcdefgh", **SMALL), TypeError, "'table_sizes': expected a sequence of ints, got str"),
        (lambda: Engram(HIDDEN, dict.fromkeys(SIZES, 1), **SMALL), TypeError,
         "'table_sizes': expected a sequence of ints, got dict"),
        (lambda: Engram(HIDDEN, torch.tensor(SIZES, dtype=torch.float32), **SMALL), TypeError,
         "'table_sizes': expected a sequence of ints or a 1-D integer tensor, got a 1-D torch.float32 tensor"),
        (lambda: Engram(HIDDEN, None, **SMALL), TypeError, "'table_sizes': expected a sequence of ints, got None$"),
        (lambda: Engram(HIDDEN, SIZES, device="nope", **SMALL), ValueError, "'device'"),
        (lambda: module.gated_value(x.float(), ids), TypeError, "'hidden_states': expected torch.bfloat16"),
        (lambda: module.gated_value(x, None), TypeError, "'hash_ids': expected a torch.Tensor"),
        (lambda: module.short_conv(None), TypeError, "'value': expected a torch.Tensor"),
        (lambda: module.short_conv(x[..., :256]), ValueError, r"'value': expected shape \(\*, L, 4, 512\)"),
        (lambda: module.hash_ids([[1, 2]], mult, 0), TypeError, "'token_ids': expected an int32 or int64"),
        (lambda: module.hash_ids(tokens, mult, 2**40), ValueError, "'pad_id': expected an int32 token id"),
        (lambda: module.hash_ids(tokens, mult, None), TypeError, "'pad_id': expected an int"),
        (lambda: module.hash_ids(tokens, None, 0), TypeError, "'multipliers': expected a torch.Tensor"),
        # the op's element limit, under the caller's argument (meta tensors: nothing is allocated)
        (lambda: module.hash_ids(torch.zeros(2**28, dtype=torch.int32, device="meta"), mult.to("meta"), 0),
         ValueError, r"'token_ids': expected fewer than 2\*\*31 rows in all"),
    ):
        with pytest.raises(kind, match=f"{prefix} {match}"):
            call()
    # a 1-D integer tensor of sizes is a sequence of ints
    assert Engram(HIDDEN, torch.tensor(SIZES), **SMALL).table_sizes == tuple(SIZES)


def test_numpy_scalars_are_taken_as_the_ops_take_them(seed):
    """numpy numbers (numbers.Real / numbers.Integral) work wherever Python numbers do, with the same results, and
    the modules keep Python numbers."""
    import numpy as np

    x, kv, wh, we = gate_leaves(6, seed)
    go = torch.randn(x.shape, generator=gen(seed + 1)).bfloat16()
    outs = []
    for clamp, eps in ((np.float32(1e-6), np.float64(1e-5)), (float(np.float32(1e-6)), 1e-5)):
        wh.grad = we.grad = None
        xr = x.clone().requires_grad_()
        out = engram_gate(xr, kv, wh, we, clamp, eps)
        out.backward(go)
        outs.append([out, xr.grad, wh.grad, we.grad])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    gate = EngramGate(np.int64(HIDDEN), np.int64(4), np.float32(1e-6), np.float64(1e-6))
    assert [type(v) for v in (gate.hidden_size, gate.hc_mult, gate.clamp_value, gate.eps)] == [int, int, float, float]
    plain_gate = EngramGate(HIDDEN, 4, float(np.float32(1e-6)), 1e-6)
    with torch.no_grad():
        assert torch.equal(gate(x, kv), plain_gate(x, kv))
    torch.manual_seed(seed)
    layer = Engram(np.int64(HIDDEN), np.array(SIZES), hc_mult=np.int64(4), max_ngram_size=np.int64(3),
                   n_embed_per_ngram=np.int64(64), n_head_per_ngram=np.int32(4), conv_kernel_size=np.int64(4),
                   clamp_value=np.float32(1e-6), gate_eps=np.float32(1e-6), conv_eps=np.float64(1e-5))
    assert "np." not in repr(layer) and type(layer.max_ngram_size) is int and type(layer.gate.eps) is float
    torch.manual_seed(seed)
    plain = Engram(HIDDEN, SIZES, **SMALL, clamp_value=float(np.float32(1e-6)), gate_eps=float(np.float32(1e-6)))
    xs, ids, _ = layer_inputs(plain, (2,), 5, seed)
    with torch.no_grad():
        assert torch.equal(layer(xs, ids), plain(xs, ids))
    tokens = torch.randint(0, 1000, (2, 7), generator=gen(seed), dtype=torch.int32)
    mult = torch.tensor([3, 5, 7])
    assert torch.equal(layer.hash_ids(tokens, mult, np.int64(2)), plain.hash_ids(tokens, mult, 2))
    assert torch.equal(ngram_token_ids(tokens, np.int64(3), np.int32(-5)), ngram_token_ids(tokens, 3, -5))


# --- n-gram windows and the hash helper ----------------------------------------------------------------


def test_table_sizes_from_a_generator_and_numpy_scalars(seed):
    import numpy as np

    module = Engram(np.int64(HIDDEN), (np.int64(s) for s in SIZES), **SMALL)
    assert module.table_sizes == tuple(SIZES) and module.offsets.tolist()[-1] == sum(SIZES[:-1])


def test_ngram_token_ids_compiled_with_a_traced_pad_id(seed):
    """``pad_id`` may become a traced SymInt (dynamic=True): its range check is left to the eager call."""
    tokens = torch.randint(0, 1000, (2, 7), generator=gen(seed), dtype=torch.int32)
    compiled = torch.compile(ngram_token_ids, fullgraph=True, dynamic=True, backend="eager")
    for pad in (0, 5):
        assert torch.equal(compiled(tokens, 3, pad), ngram_token_ids(tokens, 3, pad))


def test_ngram_token_ids_shift_like_the_demo(seed):
    tokens = torch.randint(0, 1000, (2, 7), generator=gen(seed), dtype=torch.int32)
    windows = ngram_token_ids(tokens, 3, pad_id=-5)
    assert windows.shape == (2, 7, 3) and windows.dtype == torch.int32
    for k in range(3):
        shifted = torch.cat([torch.full((2, k), -5, dtype=torch.int32), tokens[:, : 7 - k]], dim=1)
        assert torch.equal(windows[..., k], shifted)


def test_hash_helper_matches_the_demo_hash(seed):
    """:meth:`Engram.hash_ids` through ``engram_hash`` equals the demo's hash (XOR of id * multiplier over the
    n-gram, mod each table's size) plus each table's offset."""
    module = make_module(seed)
    tokens = torch.randint(0, 129280, (2, 9), generator=gen(seed), dtype=torch.int32)
    multipliers = torch.randint(0, 2**20, (3,), generator=gen(seed + 1), dtype=torch.int64) * 2 + 1
    rows = module.hash_ids(tokens, multipliers, pad_id=2)
    windows = ngram_token_ids(tokens.long(), 3, 2)
    want = []
    for n in (2, 3):
        mix = windows[..., 0] * multipliers[0]
        for k in range(1, n):
            mix = torch.bitwise_xor(mix, windows[..., k] * multipliers[k])
        for e in range(4):
            j = (n - 2) * 4 + e
            want.append(torch.remainder(mix, SIZES[j]) + int(module.offsets[j]))
    assert rows.dtype == torch.int32 and torch.equal(rows.long(), torch.stack(want, -1))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_hash_ids_compiled_fullgraph_equals_eager(device, seed):
    """:meth:`Engram.hash_ids` traced whole (``fullgraph=True``): the table sizes are a buffer made at construction,
    not a tensor made in the traced call (a real meta tensor among the fake ones, which failed on meta). On meta
    (a layer moved there by ``.to``) the eager result's shape and dtype; on the CPU (the test references) its bits.
    The buffer is not in the ``state_dict`` (checkpoints keep their keys)."""
    module = make_module(seed).to(device)
    assert module.sizes.device.type == device and module.sizes.dtype == torch.int32
    assert "sizes" not in module.state_dict() and "offsets" not in module.state_dict()
    tokens = torch.randint(0, 129280, (2, 9), generator=gen(seed), dtype=torch.int32).to(device)
    multipliers = (torch.randint(0, 2**20, (3,), generator=gen(seed + 1), dtype=torch.int64) * 2 + 1).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(module.hash_ids, backend="aot_eager", fullgraph=True)
    want, got = module.hash_ids(tokens, multipliers, pad_id=2), compiled(tokens, multipliers, pad_id=2)
    assert got.shape == want.shape == (2, 9, len(SIZES)) and got.dtype == want.dtype == torch.int32
    assert got.device.type == device
    if device == "cpu":
        assert torch.equal(got, want)


# --- the autograd wrapper over the CPU reference kernels ----------------------------------------------


def wrapper_vs_reference(tokens, masked, seed, lead=None):
    x, kv, wh, we, _, mask = all_args(tokens, masked, seed)
    eps, clamp = 1e-6, 1e-6
    go = torch.randn(x.shape, generator=gen(seed + 2)).bfloat16()
    shape_x = x.shape if lead is None else (*lead, *x.shape[1:])
    ours = [t.clone().requires_grad_() for t in (x.view(shape_x), kv.view(*shape_x[:-2], -1), wh, we)]
    m_arg = None if mask is None else mask.view(shape_x[:-2])
    out = engram_gate(*ours, clamp, eps, m_arg)
    out.backward(go.view(shape_x))
    ref = [t.float().clone().requires_grad_() for t in (x, kv, wh, we)]
    ref_out = gate_model(*ref, eps, clamp, mask)
    ref_out.backward(go.float())
    return out.view(x.shape), ours, ref_out, ref


@pytest.mark.parametrize("masked", [False, True])
def test_autograd_wrapper_vs_reference_autograd(masked, seed):
    out, ours, ref_out, ref = wrapper_vs_reference(64, masked, seed, lead=(8, 8))
    torch.testing.assert_close(out.float(), ref_out, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(ours[0].grad.float().view(ref[0].shape), ref[0].grad, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(ours[1].grad.float().view(ref[1].shape), ref[1].grad, rtol=8e-3, atol=7e-3)
    # bf16 parameter gradients: compare at bf16 resolution
    torch.testing.assert_close(ours[2].grad.float(), ref[2].grad, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(ours[3].grad.float(), ref[3].grad, rtol=1.6e-2, atol=1e-3)
    assert ours[2].grad.dtype == torch.bfloat16


def test_autograd_wrapper_main_grad(seed):
    x, kv, wh, we, _, mask = all_args(16, True, seed)
    go = torch.randn(x.shape, generator=gen(seed + 3)).bfloat16()
    module = EngramGate(HIDDEN)
    with torch.no_grad():
        module.weight_hidden.copy_(wh)
        module.weight_embed.copy_(we)
    prior_h = torch.randn(4, HIDDEN, generator=gen(seed + 4))
    prior_e = torch.randn(4, HIDDEN, generator=gen(seed + 5))
    module.weight_hidden.main_grad = prior_h.clone()
    module.weight_embed.main_grad = prior_e.clone()
    module(x, kv.view(16, -1), mask).backward(go)
    assert module.weight_hidden.grad is None and module.weight_embed.grad is None
    # the expected increment: the reference partials reduced in order, as grad_w_reduce does
    out, dot, g, rx, rk = engram_gate_forward_ref(x, kv, engram_fused_weight_ref(wh, we), 1e-6, 1e-6, True, mask)
    _, _, part = engram_gate_backward_ref(go, x, kv, engram_fused_weight_ref(wh, we), dot, g, rx, rk, 1e-6, mask,
                              partials=config.grad_w_partials("cpu", HIDDEN))
    want_h, want_e = prior_h.clone(), prior_e.clone()
    engram_grad_w_reduce_ref(part, wh, we, want_h, want_e)
    assert torch.equal(module.weight_hidden.main_grad, want_h)
    assert torch.equal(module.weight_embed.main_grad, want_e)


def test_autograd_wrapper_compiled(seed):
    module = EngramGate(HIDDEN)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)

    def grads(fn, x, kv, mask):
        x = x.clone().requires_grad_()
        module.zero_grad()
        fn(x, kv, mask).float().square().sum().backward()
        return [x.grad, module.weight_hidden.grad.clone(), module.weight_embed.grad.clone()]

    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (8, 12):
            x, kv, wh, we, _, mask = all_args(tokens, True, seed + tokens)
            kv = kv.view(tokens, -1)
            for a, b in zip(grads(compiled, x, kv, mask), grads(module, x, kv, mask)):
                assert torch.equal(a, b)


# --- the gate without its residual: opcheck and the autograd wrapper ----------------------------------


def test_gate_no_residual_opcheck_and_wrapper(seed):
    x, kv, wh, we, wf, mask = gate_args(7, True, seed)
    out, dot, g, rx, rk = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask, False)
    torch.library.opcheck(torch.ops.cann_ops_tilelang.engram_gate_forward.default,
                          (x, kv, wf, EPS, CLAMP, True, mask, False))
    torch.library.opcheck(torch.ops.cann_ops_tilelang.engram_gate_backward.default,
                          (out, x, kv, wf, dot, g, rx, rk, CLAMP, mask, False))
    got = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, False, mask, residual=False)
    assert torch.equal(got[0], out) and got[1:] == (None,) * 4
    # the autograd wrapper: output and gradients against the fp32 model without the residual
    go = torch.randn(x.shape, generator=gen(seed + 2)).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (x, kv.view(7, -1), wh, we)]
    engram_gate(*leaves, CLAMP, 1e-6, mask, residual=False).backward(go)
    ref = [t.float().clone().requires_grad_() for t in (x, kv, wh, we)]
    ref_out = gate_model(*ref, 1e-6, CLAMP, mask, residual=False)
    ref_out.backward(go.float())
    torch.testing.assert_close(leaves[0].grad.float(), ref[0].grad, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(leaves[1].grad.float().view(ref[1].shape), ref[1].grad, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(leaves[2].grad.float(), ref[2].grad, rtol=1.6e-2, atol=1e-3)
    torch.testing.assert_close(leaves[3].grad.float(), ref[3].grad, rtol=1.6e-2, atol=1e-3)


# --- device tier ----------------------------------------------------------------------------------------


@requires_device
@pytest.mark.parametrize("hidden", [512, 4096])
def test_layer_on_device_matches_demo_math(hidden, device, seed):
    torch.manual_seed(seed)
    module = Engram(hidden, SIZES, **SMALL, device=device)
    x, ids, go = layer_inputs(module, (2,), 64, seed + 1, device=device)
    got = ours(module, module, x, ids, go)
    compare(module, got, reference(module, x, ids, go))
    # inductor, fullgraph: the same comparison (inductor fuses the PyTorch parts around the gate differently)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    got_c = ours(compiled, module, x, ids, go)
    compare(module, got_c, reference(module, x, ids, go))


@requires_device
def test_layer_on_device_main_grad(device, seed):
    torch.manual_seed(seed)
    module = Engram(4096, SIZES, **SMALL, device=device)
    x, ids, go = layer_inputs(module, (2,), 32, seed + 1, device=device)
    _, grads = ours(module, module, x, ids, go)
    module.gate.weight_hidden.main_grad = torch.zeros(4, 4096, device=device)
    module.gate.weight_embed.main_grad = torch.zeros(4, 4096, device=device)
    ours(module, module, x, ids, go)
    assert module.gate.weight_hidden.grad is None
    assert torch.equal(module.gate.weight_hidden.main_grad.bfloat16(), grads[4])
    assert torch.equal(module.gate.weight_embed.main_grad.bfloat16(), grads[5])


# --- device tier: the autograd wrapper ----------------------------------------------------------------


# Weight gradients: the wrapper's contract is exact, bf16 of the op chain's fp32 sums (fused weight -> forward ->
# backward -> grad_w_reduce into zeros), each op checked against its reference at the tolerances of §E with shared
# statistics. Against a float64 model they are ill-posed: the signed sqrt's derivative is singular at z = 0, so a
# token with |z| ~ 1e-5 turns the rounding of its dot product into errors of ~1e-3 of the largest gradient, and the
# bf16 rounding of the gradient alone gives calc_diff 1.3e-6 .. 1.8e-6 (the fp32 reference chain on the CPU).


def check_wrapper_vs_model(masked, device, seed, residual):
    """``modeling.engram_gate`` forward and backward (T = 509, H = 4096): output and activation gradients against
    autograd of the gate's fp32 model at the op tolerances, weight gradients bitwise against the op chain (see
    the note above)."""
    tokens, hidden = 509, 4096
    x, kv, wh, we, mask = inputs(tokens, hidden, masked, device, seed)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 2)).bfloat16().to(device)
    ours = [t.clone().requires_grad_() for t in (x, kv.view(tokens, -1), wh, we)]
    out = engram_gate(*ours, CLAMP, EPS, mask, residual=residual)
    out.backward(go)
    ref32 = [t.float().clone().requires_grad_() for t in (x, kv, wh, we)]
    ref_out = gate_model(*ref32, EPS, CLAMP, mask, residual=residual)
    ref_out.backward(go.float())
    torch.testing.assert_close(out.float(), ref_out, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(ours[0].grad.float(), ref32[0].grad, rtol=8e-3, atol=7e-3)
    torch.testing.assert_close(ours[1].grad.float().view(ref32[1].shape), ref32[1].grad, rtol=8e-3, atol=7e-3)
    wf = ops.engram_fused_weight(wh, we)
    _, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, EPS, CLAMP, True, mask, residual=residual)
    _, _, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, CLAMP, mask, residual)
    want_h, want_e = torch.zeros_like(wf), torch.zeros_like(wf)
    ops.engram_grad_w_reduce(part, wh, we, want_h, want_e)
    assert_equal(ours[2].grad, want_h.bfloat16())
    assert_equal(ours[3].grad, want_e.bfloat16())


@requires_device
@pytest.mark.parametrize("masked", [False, True])
def test_autograd_wrapper_vs_reference(masked, device, seed):
    check_wrapper_vs_model(masked, device, seed, residual=True)


@requires_device
@pytest.mark.parametrize("masked", [False, True])
def test_autograd_wrapper_no_residual_vs_reference(masked, device, seed):
    """``modeling.engram_gate(..., residual=False)``: ``g*v`` alone, masked tokens 0."""
    check_wrapper_vs_model(masked, device, seed, residual=False)


@requires_device
def test_autograd_wrapper_main_grad_on_device(device, seed):
    tokens, hidden = 257, 2560
    x, kv, wh, we, mask = inputs(tokens, hidden, True, device, seed)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 3)).bfloat16().to(device)
    module = EngramGate(hidden, device=device)
    with torch.no_grad():
        module.weight_hidden.copy_(wh)
        module.weight_embed.copy_(we)
    prior = torch.randn(2, 4, hidden, generator=torch.Generator().manual_seed(seed + 4)).to(device)
    module.weight_hidden.main_grad = prior[0].clone()
    module.weight_embed.main_grad = prior[1].clone()
    module(x, kv.view(tokens, -1), mask).backward(go)
    assert module.weight_hidden.grad is None and module.weight_embed.grad is None
    wf = ops.engram_fused_weight(wh, we)
    _, dot, g, rx, rk = ops.engram_gate_forward(x, kv, wf, 1e-6, 1e-6, True, mask)
    _, _, part = ops.engram_gate_backward(go, x, kv, wf, dot, g, rx, rk, 1e-6, mask)
    want_h, want_e = prior[0].clone(), prior[1].clone()
    ops.engram_grad_w_reduce(part, wh, we, want_h, want_e)
    assert_equal(module.weight_hidden.main_grad, want_h)
    assert_equal(module.weight_embed.main_grad, want_e)


@requires_device
@requires_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_gate_training_step_cuda(mode, device, seed):
    """The gate module compiled (inductor, then CUDA graphs) gives the eager forward and gradients."""
    tokens, hidden = 512, 4096
    x, kv, wh, we, mask = inputs(tokens, hidden, True, device, seed)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 5)).bfloat16().to(device)
    module = EngramGate(hidden, device=device)
    with torch.no_grad():
        module.weight_hidden.copy_(wh)
        module.weight_embed.copy_(we)

    def run(fn):
        module.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        kvg = kv.view(tokens, -1).clone().requires_grad_()
        out = fn(xg, kvg, mask)
        out.backward(go)
        return [out.detach().clone(), xg.grad, kvg.grad, module.weight_hidden.grad.clone(),
                module.weight_embed.grad.clone()]

    want = run(module)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, mode=mode)
    for _ in range(3):  # CUDA graphs record on a later call
        got = run(compiled)
    for a, b in zip(got, want):
        assert_equal(a, b)
