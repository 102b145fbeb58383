"""Validation of the Engram ops (CPU tier): bad input gets a TypeError/ValueError naming the op and
the argument, before anything is written; a tensor on a device without kernels gets a RuntimeError
naming the op, the device and the supported devices."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cann_ops_tilelang as ops

M = 4
BF16, F32 = torch.bfloat16, torch.float32
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def gate_fwd_args(tokens=3, hidden=512):
    return dict(
        hidden_states=meta((tokens, M, hidden), BF16),
        kv=meta((tokens, M + 1, hidden), BF16),
        weight_fused=meta((M, hidden), F32),
        eps=1e-6,
        clamp_value=1e-6,
        save_for_backward=True,
        image_token_mask=None,
    )


def gate_bwd_args(tokens=3, hidden=512):
    return dict(
        grad_out=meta((tokens, M, hidden), BF16),
        hidden_states=meta((tokens, M, hidden), BF16),
        kv=meta((tokens, M + 1, hidden), BF16),
        weight_fused=meta((M, hidden), F32),
        dot=meta((tokens, M), F32),
        gate_score=meta((tokens, M), F32),
        rstd_x=meta((tokens, M), F32),
        rstd_k=meta((tokens, M), F32),
        clamp_value=1e-6,
        image_token_mask=None,
    )


def reduce_args(partials=5, hidden=512):
    return dict(
        grad_w_partial=meta((partials, M, hidden), F32),
        weight_hidden=meta((M, hidden), BF16),
        weight_embed=meta((M, hidden), BF16),
        grad_weight_hidden=meta((M, hidden), F32),
        grad_weight_embed=meta((M, hidden), F32),
    )


OPS = {
    "engram_gate_forward": (ops.engram_gate_forward, gate_fwd_args),
    "engram_gate_backward": (ops.engram_gate_backward, gate_bwd_args),
    "engram_grad_w_reduce": (ops.engram_grad_w_reduce, reduce_args),
}


def expect(exc, fn, kwargs, op, arg):
    with pytest.raises(exc) as info:
        fn(**kwargs)
    message = str(info.value)
    assert f"cann_ops_tilelang::{op}" in message, message
    assert f"'{arg}'" in message, message
    return message


# --- every tensor argument: wrong dtype -> TypeError, wrong rank/shape/layout -> ValueError ----------

TENSOR_ARGS = [
    (name, arg)
    for name, (_, make) in OPS.items()
    for arg, value in make().items()
    if isinstance(value, torch.Tensor)
]


@pytest.mark.parametrize("name,arg", TENSOR_ARGS)
@given(dtype=st.sampled_from([torch.float16, torch.float64, torch.int32, torch.uint8]))
@SETTINGS
def test_wrong_dtype(name, arg, dtype):
    fn, make = OPS[name]
    kwargs = make()
    kwargs[arg] = meta(kwargs[arg].shape, dtype)
    message = expect(TypeError, fn, kwargs, name, arg)
    assert str(dtype) in message


@pytest.mark.parametrize("name,arg", TENSOR_ARGS)
@given(extra=st.integers(1, 3), where=st.sampled_from(["rank", "shape"]))
@SETTINGS
def test_wrong_rank_or_shape(name, arg, extra, where):
    fn, make = OPS[name]
    kwargs = make()
    good = kwargs[arg]
    if where == "rank":
        shape = (*good.shape, extra)
    else:
        # grow the last dim by a non-multiple of 256, or the first one for the leading argument
        shape = list(good.shape)
        shape[-1] += extra
        shape = tuple(shape)
    kwargs[arg] = meta(shape, good.dtype)
    expect(ValueError, fn, kwargs, name, arg)


@pytest.mark.parametrize("name,arg", [(n, a) for n, a in TENSOR_ARGS if OPS[n][1]()[a].dim() >= 2])
def test_non_contiguous(name, arg):
    fn, make = OPS[name]
    kwargs = make()
    good = kwargs[arg]
    kwargs[arg] = meta(tuple(reversed(good.shape)), good.dtype).transpose(0, -1)
    assert kwargs[arg].shape == good.shape
    message = expect(ValueError, fn, kwargs, name, arg)
    assert "contiguous" in message


@pytest.mark.parametrize("name,arg", TENSOR_ARGS)
def test_not_a_tensor(name, arg):
    fn, make = OPS[name]
    kwargs = make()
    kwargs[arg] = [1.0, 2.0]
    message = expect(TypeError, fn, kwargs, name, arg)  # the public function's kind check, before the schema's
    assert "expected a torch.Tensor" in message, message


# --- sizes the kernels do not support ------------------------------------------------------------


@given(hidden=st.integers(1, 9000).filter(lambda h: h % 256 != 0 or h < 512 or h > 8192))
@SETTINGS
def test_unsupported_hidden_size(hidden):
    for name, (fn, make) in OPS.items():
        kwargs = make(hidden=hidden)
        first = next(iter(kwargs))
        message = expect(ValueError, fn, kwargs, name, first)
        assert str(hidden) in message


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


def test_fused_weight_validation():
    wh = meta((4, 512), BF16)
    expect(ValueError, ops.engram_fused_weight, dict(weight_hidden=wh, weight_embed=meta((4, 256), BF16)),
           "engram_fused_weight", "weight_embed")
    expect(ValueError, ops.engram_fused_weight, dict(weight_hidden=meta((3, 100), BF16),
                                                     weight_embed=meta((3, 100), BF16)),
           "engram_fused_weight", "weight_hidden")
    expect(TypeError, ops.engram_fused_weight, dict(weight_hidden=wh, weight_embed=meta((4, 512), F32)),
           "engram_fused_weight", "weight_embed")
    expect(ValueError, ops.engram_fused_weight, dict(weight_hidden=meta((2048,), BF16),
                                                     weight_embed=meta((2048,), BF16)),
           "engram_fused_weight", "weight_hidden")


def test_same_buffer_for_both_gradients():
    kwargs = reduce_args()
    kwargs["grad_weight_embed"] = kwargs["grad_weight_hidden"]
    expect(ValueError, ops.engram_grad_w_reduce, kwargs, "engram_grad_w_reduce", "grad_weight_embed")


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
