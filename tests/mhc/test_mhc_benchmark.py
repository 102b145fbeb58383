"""Benchmarks of the mHC primitives (run only when asked: ``-m benchmark``), side by side in one run:
ours, the peer (DeepSeek tile_kernels 2.1.0, when importable), the eager PyTorch reference and the
inductor-compiled reference, with the device copy ceiling measured in the same run. The pre-norm GEMM
has no peer: it is compared with PyTorch's TF32 matmul plus a sum of squares (``torch_tf32``).

Implementations of one case are timed against each other by ``bench.side_by_side`` (rotated rounds, the
mean recorded). Bytes: every tensor the op reads or writes once, buffers it accumulates into twice;
``gbs = bytes / time_us / 1e3``. Results are compared with tests/mhc/benchmark/<chip>/.
"""

import importlib.util

import mhc_ref as ref
import pytest
import torch
from _plugins.device import requires_cuda
from mhc_cases import make_args

pytestmark = [pytest.mark.benchmark, requires_cuda]

HAVE_PEER = importlib.util.find_spec("tile_kernels") is not None
SHAPES = [(512, 4096), (512, 7168), (8192, 4096), (8192, 7168)]
# buffers each op accumulates into (read and written): counted twice
ACCUMULATED = {"mhc_fn_normw_merge_backward": (3, 4), "mhc_gemm_with_sqrsum_backward": (4,),
               "mhc_pre_apply_mix_backward": (3,)}


def tensor_bytes(values):
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def as_tuple(result):
    if result is None:
        return ()
    return result if isinstance(result, tuple) else (result,)


def peer_call(name, args):
    """The peer's entry point for ``name`` on our arguments, or None (no peer, or no such op there)."""
    if not HAVE_PEER:
        return None
    from tile_kernels import mhc

    short = name.replace("_forward", "_fwd").replace("_backward", "_bwd")
    if name == "mhc_post_forward":
        x, res, post, comb = args
        t, m, h = res.shape
        return lambda: mhc.mhc_post_fwd(x.view(1, t, h), res.view(1, t, m, h), post.view(1, t, m, 1),
                                        comb.view(1, t, m, m))
    if name == "mhc_post_backward":
        x, res, post, comb, d_o = args
        t, m, h = res.shape
        return lambda: mhc.mhc_post_bwd(x.view(1, t, h), res.view(1, t, m, h), post.view(1, t, m, 1),
                                        comb.view(1, t, m, m), d_o.view(1, t, m, h))
    if name == "mhc_head_compute_mix_backward":
        return lambda: mhc.mhc_head_compute_mix_bwd(*args, args[-1].shape[0])
    fn = getattr(mhc, short, None)
    return None if fn is None else (lambda: fn(*args))


def bench_op(bench, device, name, tokens, hidden, case, **make):
    args = make_args(name, tokens, hidden, device=device, **make)
    op = getattr(torch.ops.cann_ops_tilelang, name).default
    outputs = as_tuple(op(*args))
    nbytes = tensor_bytes(args) + tensor_bytes(outputs) + tensor_bytes(args[i] for i in ACCUMULATED.get(name, ()))
    reference = getattr(ref, f"{name}_ref")
    torch._dynamo.reset()
    compiled = torch.compile(reference, fullgraph=True, dynamic=False)
    impls = {"ours": lambda: op(*args), "eager": lambda: reference(*args), "inductor": lambda: compiled(*args)}
    peer = peer_call(name, args)
    if peer is not None:
        try:
            peer()
            impls["peer"] = peer
        except Exception as exc:  # the peer's wrappers assert their own layouts; record that, don't fail
            bench.record(case, impl="peer", error=f"{type(exc).__name__}: {exc}"[:300])
    bench.side_by_side(case, impls, bytes=nbytes)


def test_copy_ceiling(bench, device):
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bench.record("copy_1GiB", impl="copy", time_us=bench.time_us(lambda: dst.copy_(src)), bytes=2 * src.numel())


STREAMING = ["expand_to_mhc_forward", "expand_to_mhc_backward", "mhc_pre_apply_mix_forward",
             "mhc_pre_apply_mix_backward", "mhc_post_forward", "mhc_post_backward", "mhc_gemm_with_sqrsum_forward",
             "mhc_gemm_with_sqrsum_backward"]


@pytest.mark.parametrize("tokens,hidden", SHAPES)
@pytest.mark.parametrize("name", STREAMING)
def test_bench_streaming(bench, device, name, tokens, hidden):
    bench_op(bench, device, name, tokens, hidden, f"{name}-T{tokens}-H{hidden}")


@pytest.mark.parametrize("tokens,hidden", [(8192, 4096), (8192, 7168)])
def test_bench_gemm_vs_torch_tf32(bench, device, tokens, hidden):
    x, fn, _ = make_args("mhc_gemm_with_sqrsum_forward", tokens, hidden, device=device)

    def torch_tf32():
        torch.backends.cuda.matmul.allow_tf32 = True
        xf = x.float()
        return xf @ fn.T, xf.square().sum(-1)

    nbytes = tensor_bytes([x, fn]) + tokens * (24 + 1) * 4
    time_us = bench.time_us(torch_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    bench.record(f"gemm_tf32-T{tokens}-H{hidden}", impl="torch_tf32", time_us=time_us, bytes=nbytes,
                 tflops=2 * tokens * 24 * 4 * hidden / time_us / 1e6)


@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("name", ["mhc_fn_normw_merge_forward", "mhc_fn_normw_merge_backward"])
def test_bench_normw(bench, device, name, hidden):
    bench_op(bench, device, name, 0, hidden, f"{name}-K{4 * hidden}")


@pytest.mark.parametrize("tokens", [512, 8192])
@pytest.mark.parametrize("name", ["mhc_reduce_partials_and_rmsnorm_forward", "mhc_reduce_partials_and_rmsnorm_backward",
                                  "mhc_pre_split_mixes_forward", "mhc_pre_split_mixes_backward",
                                  "mhc_head_compute_mix_forward", "mhc_head_compute_mix_backward"])
def test_bench_per_token(bench, device, name, tokens):
    bench_op(bench, device, name, tokens, 4096, f"{name}-T{tokens}")


@pytest.mark.parametrize("repeat", [10, 20])
@pytest.mark.parametrize("tokens", [512, 8192])
@pytest.mark.parametrize("name", ["mhc_sinkhorn_forward", "mhc_sinkhorn_backward"])
def test_bench_sinkhorn(bench, device, name, tokens, repeat):
    bench_op(bench, device, name, tokens, 4096, f"{name}-T{tokens}-R{repeat}", repeat=repeat)


# --- fused ops: against the peer and against the chains of our own kernels they replace ---------------------


def _unfused_pre(args):
    from mhc_testing import unfused_pre

    mul, sq, scale, base, residual = args[:5]
    rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat, splits = args[8:14]
    return lambda: unfused_pre(mul, sq, scale, base, residual, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat,
                               splits)


@pytest.mark.parametrize("repeat", [10, 20])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_pre_big_fuse(bench, device, tokens, hidden, repeat):
    name = "mhc_pre_big_fuse"
    args = make_args(name, tokens, hidden, device=device, repeat=repeat)
    op = torch.ops.cann_ops_tilelang.mhc_pre_big_fuse.default
    op(*args)
    nbytes = tensor_bytes(args)
    compiled = torch.compile(ref.mhc_pre_big_fuse_ref, fullgraph=True, dynamic=False)
    impls = {"ours": lambda: op(*args), "unfused": _unfused_pre(args), "eager": lambda: ref.mhc_pre_big_fuse_ref(*args),
             "inductor": lambda: compiled(*args)}
    if HAVE_PEER:
        from tile_kernels import mhc

        impls["peer"] = lambda: mhc.mhc_pre_big_fuse_fwd(*args)
    _side_by_side_tolerant(bench, f"{name}-T{tokens}-H{hidden}-R{repeat}", impls, nbytes)


@pytest.mark.parametrize("kept", [9, 10])
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_multilayer_recompute(bench, device, tokens, hidden, kept, monkeypatch):
    import mhc_cases

    name = "mhc_multilayer_recompute"
    monkeypatch.setattr(mhc_cases, "RECOMPUTE_LAYERS", (10, kept))
    args = make_args(name, tokens, hidden, device=device)
    op = torch.ops.cann_ops_tilelang.mhc_multilayer_recompute.default
    op(*args)
    nbytes = sum(tensor_bytes(a) if isinstance(a, list) else tensor_bytes([a]) for a in args)
    r0, pres, ys, posts, combs, inputs, residuals = args

    def unfused():
        r = r0
        for layer, pre in enumerate(pres):
            torch.ops.cann_ops_tilelang.mhc_pre_apply_mix_forward(r, pre, inputs[layer])
            if layer < len(ys):
                torch.ops.cann_ops_tilelang.mhc_post_forward_out(ys[layer], r, posts[layer], combs[layer],
                                                                 residuals[layer])
                r = residuals[layer]

    impls = {"ours": lambda: op(*args), "unfused": unfused, "eager": lambda: ref.mhc_multilayer_recompute_ref(*args)}
    if HAVE_PEER:
        from tile_kernels import mhc

        impls["peer"] = lambda: mhc.mhc_multilayer_recompute(
            r0.unsqueeze(0), [p.view(1, tokens, 4, 1) for p in pres], [y.unsqueeze(0) for y in ys],
            [p.view(1, tokens, 4, 1) for p in posts], [c.unsqueeze(0) for c in combs],
            [li.unsqueeze(0) for li in inputs], [r.unsqueeze(0) for r in residuals])
    _side_by_side_tolerant(bench, f"{name}-T{tokens}-H{hidden}-L10-Lp{kept}", impls, nbytes)


def _side_by_side_tolerant(bench, case, impls, nbytes):
    """Times every implementation that runs; one that raises (e.g. the peer's layout asserts) is recorded."""
    runnable = {}
    for impl, fn in impls.items():
        try:
            fn()
            runnable[impl] = fn
        except Exception as exc:
            bench.record(case, impl=impl, error=f"{type(exc).__name__}: {exc}"[:300])
    bench.side_by_side(case, runnable, bytes=nbytes)


# --- one sublayer forward + backward through the modeling API -----------------------------------------------


def _peer_chain(monkeypatch):
    """Points the modeling chain's kernels at the peer's: the peer (2.1.0) ships the mHC primitives but no mHC
    autograd Functions and no pre-norm GEMM, so its users' chain is ours with its kernels and a TF32 matmul."""
    import cann_ops_tilelang.modeling.mhc as chain

    def peer(name, shape_like=None):
        def call(*args):
            result = peer_call(name, args)()
            if shape_like is None:
                return result
            if isinstance(result, tuple):
                return tuple(r.view(args[i].shape) for r, i in zip(result, shape_like))
            return result.view(args[shape_like].shape)
        return call

    def gemm_forward(x, fn, n_splits):  # one split: the chain's reduce runs with n_splits = 1
        xf = x.float()
        return (xf @ fn.T).unsqueeze(0), xf.square().sum(-1).unsqueeze(0)

    def gemm_backward(d_mul, d_sqrsum, x, fn, grad_x):
        xf = x.float()
        grad_x.copy_((grad_x.float() + d_mul @ fn + 2 * xf * d_sqrsum[:, None]).bfloat16())
        return d_mul.T @ xf

    for name in ("mhc_reduce_partials_and_rmsnorm_forward", "mhc_reduce_partials_and_rmsnorm_backward",
                 "mhc_pre_split_mixes_forward", "mhc_pre_split_mixes_backward", "mhc_sinkhorn_forward",
                 "mhc_sinkhorn_backward", "mhc_pre_apply_mix_forward"):
        monkeypatch.setattr(chain, name, peer(name))
    monkeypatch.setattr(chain, "mhc_pre_apply_mix_backward", peer("mhc_pre_apply_mix_backward", 2))
    monkeypatch.setattr(chain, "mhc_post_forward", peer("mhc_post_forward", 1))
    monkeypatch.setattr(chain, "mhc_post_backward", peer("mhc_post_backward", (0, 1, 2, 3)))
    monkeypatch.setattr(chain, "mhc_gemm_with_sqrsum_forward", gemm_forward)
    monkeypatch.setattr(chain, "mhc_gemm_with_sqrsum_backward", gemm_backward)


@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_bench_sublayer_fwd_bwd(bench, device, tokens, hidden, monkeypatch):
    """``MHCSublayer`` around an identity sublayer, forward + backward: compiled (inductor, and inductor with CUDA
    graphs) and eager against the sum of the kernels' device times (CUPTI) and against the peer's kernels in
    the same chain, with peak memory."""
    from torch import nn

    from cann_ops_tilelang.modeling import MHCSublayer

    torch.manual_seed(0)
    residual = torch.randn(tokens, 4, hidden, device=device).bfloat16().requires_grad_()
    grad = torch.randn_like(residual)
    torch.backends.cuda.matmul.allow_tf32 = True

    def stepper(layer, graphs=False):
        def step():
            if graphs:  # a new training step for the CUDA-graph trees: the last replay's outputs are dead
                torch.compiler.cudagraph_mark_step_begin()
            residual.grad = None
            for p in layer.parameters():
                p.grad = None
            layer(residual).backward(grad)
        return step

    def peak_bytes(step):
        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def captured(step):
        """``step`` (forward, backward, the gradients' allocation) captured whole in one CUDA graph, as a training
        loop captures its compiled step: the replay runs the compiled graphs' kernels with no host time between
        them and, unlike reduce-overhead's graph trees, no copies of the inputs into static buffers."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph.replay

    layer = MHCSublayer(hidden, nn.Identity(), device=device)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    # reduce-overhead: the same graphs replayed as CUDA graphs (no host time between the kernels)
    graphed = torch.compile(layer, mode="reduce-overhead", fullgraph=True, dynamic=False)
    impls = {"ours": stepper(compiled), "graphs": stepper(graphed, graphs=True), "eager": stepper(layer)}
    impls["captured"] = captured(impls["ours"])
    if HAVE_PEER:
        peer_layer = MHCSublayer(hidden, nn.Identity(), n_splits=1, device=device)
        peer_layer.load_state_dict(layer.state_dict())
        with monkeypatch.context() as patch:
            _peer_chain(patch)
            peer_step = stepper(peer_layer)
            peer_step()
            stream = bench.stream_time_us(peer_step)
            bench.record(f"sublayer-T{tokens}-H{hidden}", impl="peer", time_us=stream, kernels_us=bench.time_us(peer_step),
                         peak_bytes=peak_bytes(peer_step), timer="event")
    for impl, step in impls.items():
        step()
        kernels = bench.time_us(step)
        stream = bench.stream_time_us(step)
        peak = None if impl == "captured" else peak_bytes(step)  # a replay allocates nothing
        bench.record(f"sublayer-T{tokens}-H{hidden}", impl=impl, time_us=stream, kernels_us=kernels,
                     over_kernels=stream / kernels, peak_bytes=peak, timer="event")
