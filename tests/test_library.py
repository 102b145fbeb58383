"""The op helper's device path on the CPU, with a stub kernel module: prepare (validation and
allocation) runs first, then the memory checks (written buffers share no memory with other arguments;
vector arguments aligned), then the op's launch binding hands the arguments and the new outputs to the
launcher by name; zero tokens launch nothing; OPS_TILELANG_DEBUG logs each call."""

import contextlib
import logging
import types

import pytest
import torch

import cann_ops_tilelang as ops
from cann_ops_tilelang import _library, config


@pytest.fixture
def stub_backend(monkeypatch):
    calls = []

    def record(name):
        def launcher(**kwargs):
            calls.append((name, kwargs))
            for value in kwargs.values():  # mark every floating output-like tensor the launcher was handed
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.dim() == 2:
                    value.fill_(7.0)
        return launcher

    launchers = {public.declaration.kernel for public in ops.registered_ops().values()}
    module = types.SimpleNamespace(**{name: record(name) for name in launchers})
    monkeypatch.setattr(_library, "_backend_module", lambda backend, family, op_module: module)
    return calls


def test_prepare_then_launch_with_new_outputs(stub_backend, monkeypatch, caplog):
    monkeypatch.setattr(config, "debug_enabled", lambda: True)
    wh = torch.ones(4, 512, dtype=torch.bfloat16)
    we = torch.ones(4, 512, dtype=torch.bfloat16)
    run = ops.engram_fused_weight.backend_kernel("cuda")
    with caplog.at_level(logging.DEBUG, logger="cann_ops_tilelang"):
        out = run(wh, we)
    assert out.shape == (4, 512) and out.dtype == torch.float32 and torch.equal(out, torch.full((4, 512), 7.0))
    (name, args), = stub_backend
    assert name == "engram_fused_weight" and args["weight_hidden"] is wh and args["weight_embed"] is we
    assert args["out"] is out
    assert "cann_ops_tilelang::engram_fused_weight on cuda: weight_hidden=(4, 512):bfloat16" in caplog.text


def test_bad_arguments_never_reach_the_backend(stub_backend):
    run = ops.engram_fused_weight.backend_kernel("ascend")
    with pytest.raises(ValueError):
        run(torch.ones(4, 512, dtype=torch.bfloat16), torch.ones(4, 256, dtype=torch.bfloat16))
    assert stub_backend == []


def test_zero_tokens_launch_nothing(stub_backend):
    x = torch.empty(0, 4, 512, dtype=torch.bfloat16)
    kv = torch.empty(0, 5, 512, dtype=torch.bfloat16)
    result = ops.registered_ops()["engram_gate_forward"].backend_kernel("cuda")(x, kv, torch.ones(4, 512), 1e-6, 1e-6)
    assert [t.shape for t in result] == [(0, 4, 512), (0, 4), (0, 4), (0, 4), (0, 4)]
    mixes = torch.empty(0, 24)
    grad_scale, grad_base = torch.full((3,), 5.0), torch.full((24,), 5.0)
    ops.registered_ops()["mhc_pre_split_mixes_backward"].backend_kernel("cuda")(
        torch.empty(0, 4), torch.empty(0, 4), torch.empty(0, 16), mixes, torch.empty(0, 4), torch.ones(3),
        torch.ones(24), torch.empty(0, 24), grad_scale, grad_base, 2.0)
    # sums over no tokens are zeros, written without a launch
    assert torch.equal(grad_scale, torch.zeros(3)) and torch.equal(grad_base, torch.zeros(24))
    assert stub_backend == []


def test_mhc_launchers_get_arguments_and_new_outputs_by_name(stub_backend):
    x = torch.randn(3, 4 * 256).bfloat16()
    fn = torch.randn(24, 4 * 256)
    run = ops.registered_ops()["mhc_gemm_with_sqrsum_forward"].backend_kernel("cuda")
    parts, sq = run(x, fn, 4)
    (name, args), = stub_backend
    assert name == "mhc_gemm_with_sqrsum_forward"
    assert args["x"] is x and args["fn"] is fn and args["n_splits"] == 4
    assert args["out_mul_part"] is parts and args["sqrsum_part"] is sq
    assert parts.shape == (4, 3, 24) and sq.shape == (4, 3)


def test_device_kernel_binds_positional_and_keyword_calls_alike(stub_backend):
    """The device path binds an all-positional call by position (the custom op's backend calls it so) and any
    other call by the signature: the launcher gets the same arguments by name; a wrong call is a TypeError
    naming the op."""
    x = torch.randn(3, 4 * 256).bfloat16()
    fn = torch.randn(24, 4 * 256)
    run = ops.registered_ops()["mhc_gemm_with_sqrsum_forward"].backend_kernel("cuda")
    run(x, fn, 4)
    run(x, fn=fn, n_splits=4)
    run(n_splits=4, fn=fn, x=x)
    (_, first), *rest = stub_backend
    assert len(rest) == 2
    for _, args in rest:
        assert args.keys() == first.keys()
        assert args["x"] is x and args["fn"] is fn and args["n_splits"] == 4
    with pytest.raises(TypeError, match=r"cann_ops_tilelang::mhc_gemm_with_sqrsum_forward: "):
        run(x, fn)
    with pytest.raises(TypeError, match=r"cann_ops_tilelang::mhc_gemm_with_sqrsum_forward: "):
        run(x, fn, 4, 5)
    assert len(stub_backend) == 3


def test_misaligned_vector_arguments_never_reach_the_backend(stub_backend):
    """An argument the kernels access in vectors (the op's ``vector_args``) whose data does not start on a
    multiple of the access width (a contiguous view at an odd storage offset) gets a ValueError naming the
    op and the argument, before any launch; aligned views, empty tensors and the arguments accessed element
    by element (masks, fp32 gradient buffers such as a Megatron main_grad view) pass at any offset."""
    assert ops.engram_fused_weight.vector_args == {"weight_hidden": 16, "weight_embed": 16}
    flat = torch.ones(4 * 512 + 8, dtype=torch.bfloat16)
    good = torch.ones(4, 512, dtype=torch.bfloat16)
    run = ops.engram_fused_weight.backend_kernel("cuda")
    for offset in (1, 2, 4):  # 2, 4 and 8 bytes past a boundary
        bad = flat[offset:offset + 4 * 512].view(4, 512)
        assert bad.is_contiguous()
        with pytest.raises(ValueError, match=r"cann_ops_tilelang::engram_fused_weight: argument 'weight_embed': "
                                             r"expected data starting on a 16-byte boundary .* "
                                             rf"{2 * offset} bytes past one \(a view at storage offset {offset}\)"):
            run(good, bad)
    assert stub_backend == []
    run(good, flat[8:8 + 4 * 512].view(4, 512))  # 16 bytes past: aligned
    assert [name for name, _ in stub_backend] == ["engram_fused_weight"]
    # the TMA-loaded partials must be aligned; the fp32 gradient buffers (element-wise) need not be
    reduce = ops.registered_ops()["engram_grad_w_reduce"].backend_kernel("cuda")
    partial = torch.zeros(2 * 4 * 512 + 1)[1:].view(2, 4, 512)
    grad = torch.zeros(4 * 512 + 1)[1:].view(4, 512)
    with pytest.raises(ValueError, match="engram_grad_w_reduce: argument 'grad_w_partial': .* 4 bytes past one"):
        reduce(partial, good, good, torch.zeros(4, 512), torch.zeros(4, 512))
    assert len(stub_backend) == 1
    reduce(torch.zeros(2, 4, 512), good, good, grad, torch.zeros(4 * 512 + 3)[3:].view(4, 512))
    assert [name for name, _ in stub_backend][1:] == ["engram_grad_w_reduce"]
    # a mask at an odd offset (read one element at a time) and empty tensors pass
    x = torch.zeros(3, 4, 512, dtype=torch.bfloat16)
    kv = torch.zeros(3, 5, 512, dtype=torch.bfloat16)
    mask = torch.zeros(4, dtype=torch.bool)[1:]
    ops.registered_ops()["engram_gate_forward"].backend_kernel("cuda")(x, kv, torch.ones(4, 512), 1e-6, 1e-6, True, mask)
    assert [name for name, _ in stub_backend][2:] == ["engram_gate_forward"]
    empty = flat[1:1].view(0, 4, 512)
    assert empty.numel() == 0 and empty.storage_offset() == 1
    ops.registered_ops()["engram_gate_forward"].backend_kernel("cuda")(empty, torch.empty(0, 5, 512, dtype=torch.bfloat16),
                                                                 torch.ones(4, 512), 1e-6, 1e-6)
    assert len(stub_backend) == 3  # zero tokens: no launch


def test_vector_args_name_arguments_of_the_op():
    def prepare(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)

    with pytest.raises(ValueError, match=r"cann_ops_tilelang::_test_vector_args: vector_args names no argument "
                                         r"of the op: \['y'\]"):
        prepare.__module__ = "cann_ops_tilelang.engram.fused_weight"
        _library.declare("_test_vector_args", vector_args={"y": 16})(prepare)
    assert "_test_vector_args" not in ops.registered_ops()


@pytest.mark.parametrize("outputs,returns,match", [
    ((), "one", r"outputs must name each of the 1 new outputs .*, got \(\)"),
    (("out", "extra"), "one", r"outputs must name each of the 1 new outputs"),
    (("a", "a"), "two", r"outputs must name each of the 2 new outputs .*, got \('a', 'a'\)"),
    (("out",), "none", r"outputs must name each of the 0 new outputs"),
    (("x", "b"), "two", r"outputs names arguments of the op: \['x'\]"),
])
def test_outputs_name_every_returned_tensor_once(outputs, returns, match):
    """``outputs`` names the tensors the prepare function returns (its annotation), each once and none an argument
    (the default launch passes them to the launcher by these names); refused before anything is registered."""
    def one(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)

    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape)

    def none(x: torch.Tensor) -> None:
        pass

    prepare = {"one": one, "two": two, "none": none}[returns]
    prepare.__module__ = "cann_ops_tilelang.engram.fused_weight"
    with pytest.raises(ValueError, match=rf"cann_ops_tilelang::_test_outputs: {match}"):
        _library.declare("_test_outputs", outputs=outputs)(prepare)
    assert "_test_outputs" not in ops.registered_ops()


def test_default_launch_passes_arguments_and_outputs_by_name(stub_backend):
    """An op without a binding of its own launches ``kernels.<kernel>(**arguments, **{output name: output})``: one
    output (mhc_pre_apply_mix_backward's grad_mix), several (mhc_post_backward's four), none (an ``out=`` variant
    launching another op's launcher under its own argument names)."""
    states = ops.registered_ops()
    assert states["mhc_post_backward"].op_state.launch == states["mhc_post_backward"].op_state.default_launch
    x, mix = torch.randn(3, 4, 256).bfloat16(), torch.softmax(torch.randn(3, 4), -1)
    grad_out, grad_x = torch.randn(3, 256).bfloat16(), torch.empty(3, 4, 256, dtype=torch.bfloat16)
    grad_mix = states["mhc_pre_apply_mix_backward"].backend_kernel("cuda")(grad_out, x, mix, grad_x)
    residual, post, comb = torch.randn(3, 4, 256).bfloat16(), torch.rand(3, 4), torch.rand(3, 4, 4)
    grads = states["mhc_post_backward"].backend_kernel("ascend")(grad_out, residual, post, comb, x)
    out = torch.empty(3, 4, 256, dtype=torch.bfloat16)
    assert states["mhc_post_forward_out"].backend_kernel("cuda")(grad_out, residual, post, comb, out) is None
    (first, a), (second, b), (third, c) = stub_backend
    assert first == "mhc_pre_apply_mix_backward" and a["grad_mix"] is grad_mix and a["grad_x"] is grad_x
    assert list(a) == ["grad_out", "x", "mix", "grad_x", "grad_mix"]
    assert second == "mhc_post_backward"
    assert all(b[k] is g for k, g in zip(("grad_x", "grad_residual", "grad_post", "grad_comb"), grads, strict=True))
    assert third == "mhc_post_forward" and c["out"] is out and list(c) == ["x", "residual", "post_layer_mix",
                                                                          "comb_res_mix", "out"]


def test_device_kernel_fills_the_defaults_the_dispatcher_leaves_out(stub_backend):
    """The dispatcher leaves out trailing arguments equal to their defaults: the device path fills them in, so the
    launcher gets the same arguments as for a call that names them all."""
    x = torch.zeros(3, 4, 512, dtype=torch.bfloat16)
    kv = torch.zeros(3, 5, 512, dtype=torch.bfloat16)
    w = torch.ones(4, 512)
    run = ops.registered_ops()["engram_gate_forward"].backend_kernel("cuda")
    run(x, kv, w, 1e-6, 1e-6)
    run(x, kv, w, 1e-6, 1e-6, True, None, True)
    run(hidden_states=x, kv=kv, weight_fused=w, eps=1e-6, clamp_value=1e-6)
    (_, short), (_, full), (_, named) = stub_backend
    for args in (full, named):
        assert list(args) == list(short)
        for name in ("hidden_states", "kv", "weight_fused", "image_token_mask", "eps", "clamp_value", "residual"):
            assert args[name] is short[name] or args[name] == short[name]
        assert [t.shape for t in (args["dot"], args["rstd_k"])] == [t.shape for t in (short["dot"], short["rstd_k"])]


def test_written_buffers_are_marked_modified_for_autograd():
    """An op that writes a buffer bumps the buffer's version counter, with gradients on or off and under
    inference mode, so autograd refuses a backward that needs the overwritten values."""
    op = torch.ops.cann_ops_tilelang.mhc_sinkhorn_forward.default
    logits = torch.randn(3, 4, 4)
    out = torch.empty(3, 4, 4)
    start = out._version
    op(logits, out, 20, 1e-6)
    with torch.no_grad():
        op(logits, out, 20, 1e-6)
    with torch.inference_mode():
        op(logits, out, 20, 1e-6)
    assert out._version == start + 3
    with_grad = logits.clone().requires_grad_()  # torch's node without a formula, then ADInplaceOrView: once
    op(with_grad, out, 20, 1e-6)
    assert out._version == start + 4
    a = torch.randn(3, 4, 4, requires_grad=True)
    product = (a * out).sum()  # saves out for the backward
    op(logits, out, 20, 1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.backward()


def test_backward_through_a_primitive_raises():
    """The primitives have no autograd formula (the modeling layer chains their backward ops): a call with an
    input that requires grad runs, and a backward through its output raises instead of a silent zero."""
    tokens, hidden = 3, 256
    x = torch.randn(tokens, hidden).bfloat16().requires_grad_()
    residual = torch.randn(tokens, 4, hidden).bfloat16()
    out = torch.ops.cann_ops_tilelang.mhc_post_forward.default(x, residual, torch.rand(tokens, 4),
                                                               torch.rand(tokens, 4, 4))
    assert out.requires_grad and out.shape == (tokens, 4, hidden)
    with pytest.raises(RuntimeError, match="mhc_post_forward.* no autograd formula"):
        out.float().sum().backward()


def test_written_lists_are_marked_modified_for_autograd():
    """Every tensor of a written list argument gets its version bumped once per call (grad on, off, inference
    mode, and with an input that requires grad)."""
    tokens, hidden, layers = 3, 256, 2
    recompute = torch.ops.cann_ops_tilelang.mhc_multilayer_recompute.default
    residual = torch.randn(tokens, 4, hidden).bfloat16()
    mixes = [[torch.softmax(torch.randn(tokens, 4), -1) for _ in range(layers)],
             [torch.randn(tokens, hidden).bfloat16() for _ in range(layers)],
             [torch.sigmoid(torch.randn(tokens, 4)) * 2 for _ in range(layers)],
             [torch.softmax(torch.randn(tokens, 4, 4), -1) for _ in range(layers)]]
    written = [[torch.empty(tokens, hidden, dtype=torch.bfloat16) for _ in range(layers)],
               [torch.empty(tokens, 4, hidden, dtype=torch.bfloat16) for _ in range(layers)]]
    start = [t._version for buffers in written for t in buffers]
    recompute(residual, *mixes, *written)
    with torch.no_grad():
        recompute(residual, *mixes, *written)
    with torch.inference_mode():
        recompute(residual, *mixes, *written)
    recompute(residual.clone().requires_grad_(), *mixes, *written)
    assert [t._version for buffers in written for t in buffers] == [v + 4 for v in start]


def test_a_launch_runs_on_the_arguments_device(stub_backend, monkeypatch):
    """The kernels launch on the current device and its current stream: tensors on another device of the same
    type make that device current for the launch, and only then (simulated: fake CUDA tensors, a fake
    device module whose current device is 0)."""
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    entered = []
    mode = FakeTensorMode()
    # a fake CUDA tensor initializes the real runtime on its device, which fails for cuda:1 on a one-GPU host
    monkeypatch.setattr(fake_tensor, "init_gpu_context", lambda device: None)

    def on(device):
        return FakeTensor(mode, torch.empty(2, device="meta"), torch.device(device))

    class FakeCuda:
        @staticmethod
        def current_device():
            return 0

        @staticmethod
        def device(index):
            entered.append(index)
            return contextlib.nullcontext()

    monkeypatch.setattr(torch, "get_device_module", lambda kind: FakeCuda if kind == "cuda" else pytest.fail(kind))
    for arguments in ({"x": on("cuda:1"), "n": 3}, {"x": on("cuda:0")}, {"xs": [on("cuda:1")]}):
        with _library._on_their_device(arguments):
            pass
    assert entered == [1, 1]
    # CPU tensors (the stub backend's): nothing to switch, and the launch happens
    run = ops.engram_fused_weight.backend_kernel("cuda")
    run(torch.ones(4, 512, dtype=torch.bfloat16), torch.ones(4, 512, dtype=torch.bfloat16))
    assert entered == [1, 1] and len(stub_backend) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="requires 2 CUDA devices visible to this process")
def test_ops_on_the_second_gpu_while_the_first_is_current():
    gen = torch.Generator().manual_seed(0)
    wh, we = (torch.randn(4, 512, generator=gen).bfloat16() for _ in range(2))
    x = torch.randn(64, 512, generator=gen).bfloat16()
    residual = torch.randn(64, 4, 512, generator=gen).bfloat16()
    post, comb = torch.rand(64, 4, generator=gen), torch.rand(64, 4, 4, generator=gen)
    results = []
    for device in ("cuda:0", "cuda:1"):
        with torch.cuda.device(0):
            fused = ops.engram_fused_weight(wh.to(device), we.to(device))
            out = ops.mhc_post_forward(x.to(device), residual.to(device), post.to(device), comb.to(device))
        torch.cuda.synchronize(device)
        assert fused.device == out.device == torch.device(device)
        results.append((fused.cpu(), out.cpu()))
    assert all(torch.equal(a, b) for a, b in zip(*results))
