"""The mHC training chain of cann_ops_tilelang.modeling against an independent PyTorch mHC block.

The reference block below is written from the math alone (fp32/float64 autograd over plain torch ops, no op of
the package); the chain runs the package's ops (on the CPU the test references registered as the ops' CPU
kernels, on a GPU the kernels). Gradients of every input and parameter are compared; the training and no-grad
paths, eager and torch.compile(fullgraph=True), and the recompute op against the forward are held equal bit for
bit; main_grad accumulation and the residual-gradient order are checked exactly.
"""

import pytest
import torch
from mhc_ref import post_model, sinkhorn_model

import cann_ops_tilelang as ops
from cann_ops_tilelang.modeling import mhc as modeling

M, M3, H, R = 4, 24, 256, 20
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def params(hidden, seed, device, norm_weight=False):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    p = {"fn": randn(M3, M * hidden, scale=1e-2), "scale": randn(3, scale=0.5) + 1.0, "base": randn(M3, scale=0.5)}
    if norm_weight:
        p["norm_weight"] = randn(M * hidden, scale=0.1) + 1.0
    return p


def residual_of(tokens, hidden, seed, device):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(tokens, M, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)


# --- an independent mHC block --------------------------------------------------------------------------------


def plain_pre(residual, fn, scale, base, norm_weight=None, eps=1e-6, post_mult=2.0, repeat=R):
    tokens, m, hidden = residual.shape
    x = residual.reshape(tokens, m * hidden)
    w = fn if norm_weight is None else fn * norm_weight
    mixes = (x @ w.T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    seg = torch.tensor([0] * m + [1] * m + [2] * m * m, device=x.device)
    z = mixes * scale[seg] + base
    pre = torch.sigmoid(z[:, :m]) + eps
    post = torch.sigmoid(z[:, m:2 * m]) * post_mult
    comb = sinkhorn_model(z[:, 2 * m:].reshape(tokens, m, m), repeat, eps)
    layer_input = (pre.unsqueeze(-1) * residual).sum(1)
    return layer_input, post, comb


def plain_block(residual, p, sublayer, norm_weight=None):
    layer_input, post, comb = plain_pre(residual, p["fn"], p["scale"], p["base"], norm_weight)
    return post_model(sublayer(layer_input), residual, post, comb)


class Sublayer(torch.nn.Module):
    """An attention-free sublayer: y = tanh(x W) (bf16 in and out, its weight fp32)."""

    def __init__(self, hidden, seed, device):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + 2)
        self.weight = torch.nn.Parameter((torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(device))

    def forward(self, x):
        return torch.tanh(x.float() @ self.weight).to(x.dtype)


# --- gradients against the independent block -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_weight", [False, True])
def test_sublayer_gradients_match_an_independent_block(device, norm_weight, seed):
    tokens = 37
    p = params(H, seed, device, norm_weight)
    residual = residual_of(tokens, H, seed, device).requires_grad_(True)
    sub = Sublayer(H, seed, device)
    block = modeling.MHCSublayer(H, sub, norm_weight=norm_weight, device=device)
    with torch.no_grad():
        for name, value in p.items():
            getattr(block, name).copy_(value)
    out = block(residual)
    gen = torch.Generator().manual_seed(seed + 3)
    d_out = torch.randn(out.shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    out.backward(d_out)

    ref_params = {k: v.double().requires_grad_(True) for k, v in p.items()}
    ref_residual = residual.detach().double().requires_grad_(True)
    ref_sub = lambda x: torch.tanh(x @ sub.weight.double())  # noqa: E731
    ref_out = plain_block(ref_residual, ref_params, ref_sub, ref_params.get("norm_weight"))
    ref_out.backward(d_out.double())

    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(residual.grad.double(), ref_residual.grad, rtol=3e-2, atol=3e-2)
    for name in p:
        got, want = getattr(block, name).grad.double(), ref_params[name].grad
        scale = want.abs().max()
        assert (got - want).abs().max() <= 3e-2 * scale + 1e-6, (name, (got - want).abs().max().item(), scale.item())


@pytest.mark.parametrize("device", DEVICES)
def test_head_gradients_match_an_independent_head(device, seed):
    tokens = 29
    head = modeling.MHCHead(H, device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.fn.copy_(torch.randn(M, M * H, generator=gen).to(device) * 1e-2)
        head.base.copy_(torch.randn(M, generator=gen).to(device) * 0.5)
    residual = residual_of(tokens, H, seed, device).requires_grad_(True)
    out = head(residual)
    d_out = torch.randn(out.shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    out.backward(d_out)

    fn, scale, base = (t.detach().double().requires_grad_(True) for t in (head.fn, head.scale, head.base))
    x = residual.detach().double().requires_grad_(True)
    flat = x.reshape(tokens, -1)
    mixes = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    w = torch.sigmoid(mixes * scale[0] + base) + 1e-6
    ref = (w.unsqueeze(-1) * x).sum(1)
    ref.backward(d_out.double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(residual.grad.double(), x.grad, rtol=3e-2, atol=3e-2)
    for got, want in ((head.fn.grad, fn.grad), (head.scale.grad, scale.grad), (head.base.grad, base.grad)):
        assert (got.double() - want).abs().max() <= 3e-2 * want.abs().max() + 1e-6


# --- exact contracts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_training_and_no_grad_paths_are_bitwise_equal(device, seed):
    p = params(H, seed, device, norm_weight=True)
    residual = residual_of(45, H, seed, device)
    kwargs = dict(norm_weight=p["norm_weight"], sinkhorn_repeat=10)
    fn = p["fn"].clone().requires_grad_(True)  # a parameter that requires grad: the training path
    train = modeling.mhc_pre(residual, fn, p["scale"], p["base"], **kwargs)
    with torch.no_grad():
        fused = modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], **kwargs)  # mhc_pre_big_fuse
    assert torch.equal(train[0], fused[0])
    assert torch.equal(train[1][0], fused[1][0]) and torch.equal(train[1][1], fused[1][1])


@pytest.mark.parametrize("device", DEVICES)
def test_residual_gradient_is_accumulated_post_then_pre_then_gemm(device, seed):
    """With the link the residual gradient is one bf16 buffer: post's contribution, then the pre mix's, then
    the GEMM's, each added by its kernel (the backward of each primitive replayed by hand, in that order)."""
    p = {k: v.requires_grad_(True) for k, v in params(H, seed, device).items()}
    residual = residual_of(19, H, seed, device).requires_grad_(True)
    layer_input, (post, comb), linked = modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"],
                                                         return_residual=True)
    y = (layer_input.float() * 0.5).to(torch.bfloat16)
    out = modeling.mhc_post(y, linked, post, comb)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    out.backward(d_out)

    # replay: post backward, then the pre node's two accumulations into the same buffer
    flat = residual.detach()
    d_y, buffer, d_post, d_comb = ops.mhc_post_backward(y.detach(), flat, post.detach().view(-1, M),
                                                        comb.detach(), d_out)
    d_li = (d_y.float() * 0.5).to(torch.bfloat16)
    tokens = flat.shape[0]
    parts = ops.mhc_gemm_with_sqrsum_forward(flat.view(tokens, -1), p["fn"].detach(), 16)
    out_mul, sqrsum, mixes = torch.empty(tokens, 1, M3, device=device), torch.empty(tokens, 1, device=device), \
        torch.empty(tokens, M3, device=device)
    ops.mhc_reduce_partials_and_rmsnorm_forward(parts[0].view(16, tokens, 1, M3), parts[1].view(16, tokens, 1),
                                                out_mul, sqrsum, mixes, M * H, 1e-6, 16)
    pre, post2, logits = (torch.empty(tokens, n, device=device) for n in (M, M, M * M))
    ops.mhc_pre_split_mixes_forward(mixes, p["scale"].detach(), p["base"].detach(), pre, post2, logits, 2.0, 1e-6)
    d_pre = ops.mhc_pre_apply_mix_backward(d_li, flat, pre, buffer)
    d_logits = torch.empty(tokens, M, M, device=device)
    ops.mhc_sinkhorn_backward(d_comb, logits.view(tokens, M, M), d_logits, R, 1e-6)
    d_mixes, d_scale, d_base = torch.empty_like(mixes), torch.empty(3, device=device), torch.empty(M3, device=device)
    ops.mhc_pre_split_mixes_backward(d_pre, d_post, d_logits.view(tokens, -1), mixes, post2, p["scale"].detach(),
                                     p["base"].detach(), d_mixes, d_scale, d_base, 2.0)
    d_out_mul, d_sqrsum = torch.empty_like(out_mul), torch.empty_like(sqrsum)
    ops.mhc_reduce_partials_and_rmsnorm_backward(d_mixes, out_mul, sqrsum, d_out_mul, d_sqrsum, M * H, 1e-6)
    d_fn = ops.mhc_gemm_with_sqrsum_backward(d_out_mul.view(tokens, -1), d_sqrsum.view(tokens), flat.view(tokens, -1),
                                             p["fn"].detach(), buffer.view(tokens, -1))
    assert torch.equal(residual.grad, buffer)
    assert torch.equal(p["fn"].grad, d_fn) and torch.equal(p["scale"].grad, d_scale)


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_accumulates_in_eager_mode(device, seed):
    sub = Sublayer(H, seed, device)
    block = modeling.MHCSublayer(H, sub, device=device)
    residual = residual_of(8, H, seed, device).requires_grad_(True)
    block(residual).float().sum().backward()
    plain = {name: getattr(block, name).grad.clone() for name in ("fn", "scale", "base")}
    for name in plain:
        param = getattr(block, name)
        param.grad = None
        param.main_grad = torch.full_like(param, 0.25)
    block(residual).float().sum().backward()
    for name, grad in plain.items():
        param = getattr(block, name)
        assert param.grad is None
        assert torch.equal(param.main_grad, torch.full_like(param, 0.25) + grad)


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_parameters_get_nothing_in_their_main_grad(device, seed):
    block = modeling.MHCSublayer(H, Sublayer(H, seed, device), device=device)
    head = modeling.MHCHead(H, device=device)
    frozen = [block.scale, block.base, head.fn, head.base]
    for param in frozen:
        param.requires_grad_(False)
        param.main_grad = torch.zeros_like(param)
    residual = residual_of(8, H, seed, device).requires_grad_(True)
    head(block(residual)).float().square().sum().backward()
    for param in frozen:
        assert param.grad is None and torch.equal(param.main_grad, torch.zeros_like(param))
    assert block.fn.grad is not None and head.scale.grad is not None and residual.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead", [(0,), (2, 0, 3)])
def test_zero_tokens_forward_and_backward(device, lead, seed):
    block = modeling.MHCSublayer(H, Sublayer(H, seed, device), norm_weight=True, device=device)
    head = modeling.MHCHead(H, device=device)
    x = torch.zeros(*lead, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    out = head(block(modeling.expand_from_embedding(x)))
    assert out.shape == (*lead, H) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.shape == x.shape
    # no token: every parameter gradient is zero
    for param in [*block.parameters(), *head.parameters()]:
        assert param.grad is not None and not param.grad.any(), param.shape
    with torch.no_grad():
        li, (post, comb) = modeling.mhc_pre(torch.zeros(*lead, M, H, dtype=torch.bfloat16, device=device), block.fn,
                                            block.scale, block.base)
    assert li.shape == (*lead, H) and post.shape == (*lead, M, 1) and comb.shape == (*lead, M, M)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kept", ["all", "all but the last"])
def test_recompute_chunk_from_the_modeling_api(device, kept, seed):
    """A chunk run forward without gradients, keeping the pre mixes (``return_pre_mix``), the mixes and the
    sublayer outputs; ``mhc_recompute_chunk`` regenerates every layer input and residual bitwise, with leading
    dims (2, 11). The pre mix asked for changes nothing else: the same bits as the fused path."""
    layers = 3
    blocks = [modeling.MHCSublayer(H, Sublayer(H, seed + i, device), device=device) for i in range(layers)]
    residual = residual_of(2 * 11, H, seed, device).view(2, 11, M, H)
    pres, outputs, posts, combs, inputs, residuals = [], [], [], [], [], []
    r = residual
    with torch.no_grad():
        for block in blocks:
            li, (post, comb), pre = modeling.mhc_pre(r, block.fn, block.scale, block.base, return_pre_mix=True)
            fused = modeling.mhc_pre(r, block.fn, block.scale, block.base)
            assert torch.equal(li, fused[0]) and torch.equal(post, fused[1][0]) and torch.equal(comb, fused[1][1])
            assert pre.shape == (2, 11, M) and pre.dtype == torch.float32
            y = block.sublayer(li)
            r = modeling.mhc_post(y, r, post, comb)
            pres.append(pre), outputs.append(y), posts.append(post), combs.append(comb)
            inputs.append(li), residuals.append(r)
    n = layers if kept == "all" else layers - 1
    got_inputs, got_residuals = modeling.mhc_recompute_chunk(residual, pres, outputs[:n], posts[:n], combs[:n])
    assert len(got_inputs) == layers and len(got_residuals) == n
    assert all(torch.equal(a, b) for a, b in zip(got_inputs, inputs))
    assert all(torch.equal(a, b) for a, b in zip(got_residuals, residuals[:n]))
    # with gradients: the same pre mix, outside the graph, and the backward as without it
    fn = blocks[0].fn
    li, (post, comb), link, pre = modeling.mhc_pre(residual, fn, blocks[0].scale, blocks[0].base,
                                                   return_residual=True, return_pre_mix=True)
    assert torch.equal(pre, pres[0]) and not pre.requires_grad and torch.equal(li, inputs[0])
    li.float().sum().backward()
    assert fn.grad is not None and fn.grad.abs().sum() > 0
    for args, exc, match in [
        ((residual, pres, outputs[:1], posts, combs), ValueError, "'layer_outputs': expected L - 1 or L = 3"),
        ((residual, [], [], [], []), ValueError,
         r"'pre_mixes': expected in \[1, 64\] tensors \(one per sublayer\), got 0"),
        ((residual, pres, outputs, posts, combs[:2] + [combs[2].view(22, M, M)]), ValueError,
         r"'comb_mixes\[2\]': expected shape \(2, 11, 4, 4\)"),
        ((residual, pres[0], outputs, posts, combs), TypeError, "'pre_mixes': expected a list of tensors"),
        ((residual, pres[:2] + [pres[2].double()], outputs, posts, combs), TypeError,
         r"'pre_mixes\[2\]': expected torch.float32, got torch.float64"),
        ((residual, pres, [outputs[0].to("meta")] + outputs[1:], posts, combs), ValueError,
         rf"'layer_outputs\[0\]': expected a tensor on {device}"),
    ]:
        with pytest.raises(exc, match=f"modeling.mhc_recompute_chunk: argument {match}"):
            modeling.mhc_recompute_chunk(*args)


@pytest.mark.parametrize("device", DEVICES)
def test_recompute_regenerates_the_forward_bitwise(device, seed):
    """A chunk of L sublayers run forward under no_grad (pre_big_fuse, post), then mhc_multilayer_recompute
    from the first residual and the saved small tensors: every layer input and residual bitwise equal."""
    layers = 3
    blocks = [modeling.MHCSublayer(H, Sublayer(H, seed + i, device), device=device) for i in range(layers)]
    residual = residual_of(23, H, seed, device)
    pres, outputs, posts, combs, inputs, residuals = [], [], [], [], [], []
    r = residual
    with torch.no_grad():
        for block in blocks:
            li, (post, comb) = modeling.mhc_pre(r, block.fn, block.scale, block.base)
            # the pre mix itself, which the fused op does not return: from the unfused split
            tokens = r.shape[0]
            parts = ops.mhc_gemm_with_sqrsum_forward(r.view(tokens, -1), block.fn, 16)
            om, sq, mixes = (torch.empty(tokens, 1, M3, device=device), torch.empty(tokens, 1, device=device),
                             torch.empty(tokens, M3, device=device))
            ops.mhc_reduce_partials_and_rmsnorm_forward(parts[0].view(16, tokens, 1, M3), parts[1].view(16, tokens, 1),
                                                        om, sq, mixes, M * H, 1e-6, 16)
            pre, p2, cl = (torch.empty(tokens, n, device=device) for n in (M, M, M * M))
            ops.mhc_pre_split_mixes_forward(mixes, block.scale, block.base, pre, p2, cl, 2.0, 1e-6)
            y = block.sublayer(li)
            r = modeling.mhc_post(y, r, post, comb)
            pres.append(pre), outputs.append(y), posts.append(post.view(tokens, M)), combs.append(comb)
            inputs.append(li), residuals.append(r)
    got_inputs = [torch.empty_like(t) for t in inputs]
    got_residuals = [torch.empty_like(t) for t in residuals]
    ops.mhc_multilayer_recompute(residual, pres, outputs, posts, combs, got_inputs, got_residuals)
    assert all(torch.equal(a, b) for a, b in zip(got_inputs, inputs))
    assert all(torch.equal(a, b) for a, b in zip(got_residuals, residuals))


# --- torch.compile ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_matches_eager_without_graph_breaks_or_recompiles(device, seed):
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[modeling.MHCSublayer(H, Sublayer(H, seed + i, device), device=device)
                                  for i in range(2)])
    head = modeling.MHCHead(H, device=device)

    def forward(x):
        return head(model(modeling.expand_from_embedding(x)))

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor" if device == "cuda" else "aot_eager")
    compiled = torch.compile(forward, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for tokens in (5, 9, 14):
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed + tokens)).to(device, torch.bfloat16)
        grads = []
        for fn in (forward, compiled):
            for p in [*model.parameters(), *head.parameters()]:
                p.grad = None
            xi = x.clone().requires_grad_(True)
            out = fn(xi)
            out.float().square().mean().backward()  # the compiled graph's backward is compiled with it
            grads.append((out, xi.grad, [p.grad.clone() for p in [*model.parameters(), *head.parameters()]]))
        (e_out, e_x, e_p), (c_out, c_x, c_p) = grads
        assert torch.equal(e_out, c_out) and torch.equal(e_x, c_x)
        for a, b in zip(e_p, c_p):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the sublayer's own ops may fuse under inductor
        frames.append(counter.frame_count)
    # the first token count compiles (fullgraph: no break; with AOT autograd the counter sees 2 frames on that
    # first call); later token counts reuse what it compiled
    assert frames[0] >= 1 and frames[1:] == [frames[0]] * 2, frames


# --- errors ------------------------------------------------------------------------------------------------------


def test_modeling_api_errors_name_the_argument():
    p = params(H, 0, "cpu")
    residual = residual_of(3, H, 0, "cpu")
    with pytest.raises(ValueError, match=r"modeling.mhc_pre: argument 'fn': expected shape \(24, 1024\)"):
        modeling.mhc_pre(residual, p["fn"][:, :-64], p["scale"], p["base"])
    with pytest.raises(TypeError, match=r"modeling.mhc_pre: argument 'residual': expected a torch.Tensor"):
        modeling.mhc_pre(residual.tolist(), p["fn"], p["scale"], p["base"])
    li, (post, comb) = modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"])
    with pytest.raises(ValueError, match=r"modeling.mhc_post: argument 'layer_output': expected shape \(3, 256\)"):
        modeling.mhc_post(li.view(6, 128), residual, post, comb)
    with pytest.raises(ValueError, match=r"modeling.MHCSublayer: argument 'hidden_size': expected a hidden size"):
        modeling.MHCSublayer(100, torch.nn.Identity())
    # the scalars and the other tensors under the function's own names, before any kernel runs, with or
    # without gradients
    grad_fn = p["fn"].clone().requires_grad_(True)
    for fn in (p["fn"], grad_fn):
        for kwargs, arg in [(dict(sinkhorn_repeat=0), "sinkhorn_repeat"), (dict(norm_eps=-1.0), "norm_eps"),
                            (dict(pre_eps=float("nan")), "pre_eps"), (dict(sinkhorn_eps=-1.0), "sinkhorn_eps"),
                            (dict(n_splits=0), "n_splits"), (dict(post_mult_value=0.0), "post_mult_value")]:
            with pytest.raises(ValueError, match=rf"modeling.mhc_pre: argument '{arg}'"):
                modeling.mhc_pre(residual, fn, p["scale"], p["base"], **kwargs)
    with pytest.raises(TypeError, match=r"modeling.mhc_pre: argument 'fn': expected torch.float32, got torch.bfloat16"):
        modeling.mhc_pre(residual, p["fn"].bfloat16(), p["scale"], p["base"])
    with pytest.raises(ValueError, match=r"modeling.mhc_pre: argument 'scale': expected a tensor on cpu \(the "
                                         r"residual's\), got meta"):
        modeling.mhc_pre(residual, p["fn"], p["scale"].to("meta"), p["base"])
    with pytest.raises(ValueError, match=r"modeling.mhc_head: argument 'n_splits'"):
        modeling.mhc_head(residual, p["fn"][:M], p["scale"][:1], p["base"][:M], n_splits=10**6)
    with pytest.raises(TypeError, match=r"modeling.mhc_head: argument 'fn_head': expected torch.float32"):
        modeling.mhc_head(residual, p["fn"][:M].double(), p["scale"][:1], p["base"][:M])
    module = modeling.MHCSublayer(H, torch.nn.Identity(), norm_weight=True, device="meta")
    with pytest.raises(ValueError, match=r"modeling.mhc_pre: argument 'fn': expected a tensor on cpu"):
        module(residual)  # the forgotten .to(device): named before the weight merge runs on the wrong device
    for args, exc, match in [
        ((li.float(), residual, post, comb), TypeError, r"'layer_output': expected torch.bfloat16"),
        ((li, residual, post.double(), comb), TypeError, r"'post_mix': expected torch.float32"),
        ((li, residual, post, comb.to("meta")), ValueError, r"'comb_mix': expected a tensor on cpu"),
    ]:
        with pytest.raises(exc, match=rf"modeling.mhc_post: argument {match}"):
            modeling.mhc_post(*args)
    with pytest.raises(TypeError, match=r"modeling.expand_from_embedding: argument 'x': expected torch.bfloat16"):
        modeling.expand_from_embedding(li.float())
    # the hidden size and hc_mult checked under the function's own name, before the primitive
    with pytest.raises(ValueError, match=r"modeling.expand_from_embedding: argument 'x': expected a hidden size"):
        modeling.expand_from_embedding(li[..., :100])
    with pytest.raises(TypeError, match=r"modeling.expand_from_embedding: argument 'hc_mult': expected an int, "
                                        r"got str"):
        modeling.expand_from_embedding(li, hc_mult="4")
    with pytest.raises(ValueError, match=r"modeling.expand_from_embedding: argument 'hc_mult': expected hc_mult 4"):
        modeling.expand_from_embedding(li, hc_mult=3)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda r: r.float(), TypeError, r"modeling.mhc_pre: argument 'residual': expected bf16, got torch.float32"),
    (lambda r: r[:, :3], ValueError, r"modeling.mhc_pre: argument 'residual': expected hc_mult 4"),
    (lambda r: r[..., :100], ValueError, r"modeling.mhc_pre: argument 'residual': expected a hidden size"),
])
def test_mhc_pre_checks_the_residual_itself(bad, exc, match):
    p = params(H, 0, "cpu")
    with pytest.raises(exc, match=match):
        modeling.mhc_pre(bad(residual_of(3, H, 0, "cpu")), p["fn"], p["scale"], p["base"])


def test_modules_check_their_arguments_and_inputs():
    residual = residual_of(3, H, 0, "cpu")
    for kwargs, arg in [(dict(hc_mult=1), "hc_mult"), (dict(hc_mult=3), "hc_mult"), (dict(n_splits=0), "n_splits"),
                        (dict(eps=-1.0), "eps"), (dict(sinkhorn_repeat=0), "sinkhorn_repeat"),
                        (dict(post_mult_value=0.0), "post_mult_value"), (dict(n_splits=2.0), "n_splits"),
                        (dict(hc_mult=4.0), "hc_mult")]:
        exc = TypeError if isinstance(kwargs[arg], float) and arg in ("n_splits", "hc_mult") else ValueError
        with pytest.raises(exc, match=rf"modeling.MHCSublayer: argument '{arg}'"):
            modeling.MHCSublayer(H, torch.nn.Identity(), **kwargs)
        head_kwargs = {k: v for k, v in kwargs.items() if k in ("hc_mult", "n_splits", "eps")}
        if head_kwargs:
            with pytest.raises(exc, match=rf"modeling.MHCHead: argument '{arg}'"):
                modeling.MHCHead(H, **head_kwargs)
    with pytest.raises(ValueError, match=r"modeling.MHCSublayer: argument 'residual': expected the module's hidden "
                                         r"size 256"):
        modeling.MHCSublayer(H, torch.nn.Identity())(residual_of(3, 2 * H, 0, "cpu"))
    with pytest.raises(ValueError, match=r"modeling.MHCHead: argument 'residual': expected the module's hidden size"):
        modeling.MHCHead(H)(residual_of(3, 2 * H, 0, "cpu"))
    # numpy scalars are numbers like any other (as the ops take them)
    import numpy as np

    block = modeling.MHCSublayer(np.int64(H), torch.nn.Identity(), n_splits=np.int64(16), eps=np.float32(1e-6))
    assert block.hidden_size == H and block.fn.shape == (24, 4 * H)
    assert block(residual_of(3, H, 0, "cpu")).shape == (3, 4, H)
    head = modeling.MHCHead(H)
    with pytest.raises(ValueError, match=r"modeling.mhc_head: argument 'scale_head': expected shape \(1,\), "
                                         r"got \(0,\)"):
        modeling.mhc_head(residual, head.fn, head.scale[:0], head.base)
    head.base.main_grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"modeling.mhc_head: argument 'base_head.main_grad': expected a contiguous "
                                         r"fp32 buffer .* got torch.bfloat16 \(4,\) on cpu"):
        head(residual)
    head.base.main_grad = [0.0] * 4  # a wrong kind of thing: a TypeError, as for the Engram gate
    with pytest.raises(TypeError, match=r"modeling.mhc_head: argument 'base_head.main_grad': expected a "
                                        r"torch.Tensor, got list"):
        head(residual)


# --- main_grad buffers that overlap ------------------------------------------------------------------------------


def _zero_main_grads(module):
    for param in module.parameters():
        param.main_grad = torch.zeros_like(param)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", ["two main_grads", "the parameter itself", "another parameter", "the residual"])
def test_overlapping_main_grads_are_refused_at_the_forward(device, case):
    """Two gradients added into one buffer (or into a tensor the graph saved) are refused before anything runs,
    naming the parameters as the caller knows them; the buffers are left as they were (metadata only: on meta
    too)."""
    block = modeling.MHCSublayer(H, torch.nn.Identity(), norm_weight=True, device=device)
    _zero_main_grads(block)
    residual = residual_of(5, H, 0, "cpu").to(device).requires_grad_(True)
    if case == "two main_grads":
        block.base.main_grad = block.fn.main_grad.view(-1)[:M3]
        match = r"modeling.mhc_pre: argument 'base': expected a main_grad of its own, got one that overlaps the " \
                r"main_grad of 'fn'"
    elif case == "the parameter itself":
        block.norm_weight.main_grad = block.norm_weight.data
        match = r"modeling.mhc_pre: argument 'norm_weight': expected a main_grad that shares no memory with the " \
                r"call's tensors, got one that overlaps the parameter's own data"
    elif case == "another parameter":
        block.scale.main_grad = block.base.data[4:7]
        match = r"modeling.mhc_pre: argument 'scale': expected a main_grad that shares no memory .* overlaps 'base'"
    else:
        storage = torch.zeros(5 * M * H, dtype=torch.bfloat16, device=device)
        residual = storage.view(5, M, H).requires_grad_(True)
        block.scale.main_grad = storage.detach().view(torch.float32)[:3]
        match = r"modeling.mhc_pre: argument 'scale': expected a main_grad that shares no memory .* overlaps " \
                r"'residual'"
    before = {name: p.main_grad.clone() for name, p in block.named_parameters()}
    with pytest.raises(ValueError, match=match):
        block(residual)
    with pytest.raises(ValueError, match=match):  # the function, with the same parameters
        modeling.mhc_pre(residual, block.fn, block.scale, block.base, norm_weight=block.norm_weight)
    if device == "cpu":
        assert all(torch.equal(p.main_grad, before[n]) and p.grad is None for n, p in block.named_parameters())


def test_overlapping_main_grads_of_the_head_are_named_as_mhc_head_names_them():
    head = modeling.MHCHead(H, norm_weight=True)
    _zero_main_grads(head)
    head.norm_weight.main_grad = head.fn.main_grad.view(-1)[M * H:2 * M * H]
    residual = residual_of(5, H, 0, "cpu")
    with pytest.raises(ValueError, match=r"modeling.mhc_head: argument 'norm_weight': expected a main_grad of its "
                                         r"own, got one that overlaps the main_grad of 'fn_head'"):
        head(residual)
    head.norm_weight.main_grad = torch.zeros_like(head.norm_weight)
    head.base.main_grad = head.scale.main_grad.expand(M)  # a stride-0 view of scale_head's: not contiguous
    with pytest.raises(ValueError, match=r"modeling.mhc_head: argument 'base_head.main_grad': expected a contiguous"):
        head(residual)
    head.base.main_grad = torch.zeros(M + 1)[1:]  # a buffer of its own at an offset: fine
    head(residual).float().sum().backward()
    assert head.base.grad is None and head.base.main_grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_main_grads_as_disjoint_views_of_one_flat_buffer(device, seed):
    """Megatron's layout: every main_grad a view into one flat fp32 buffer, none overlapping; each gets its own
    gradient, bitwise the .grad of the same step without main_grads. A frozen parameter's main_grad is not
    written, so it may alias another one's."""
    block = modeling.MHCSublayer(H, Sublayer(H, seed, device), norm_weight=True, device=device)
    residual = residual_of(9, H, seed, device).requires_grad_(True)
    block(residual).float().square().sum().backward()
    params = [block.fn, block.scale, block.base, block.norm_weight]
    plain = [p.grad.clone() for p in params]
    flat = torch.zeros(sum(p.numel() for p in params), device=device)
    offset = 0
    for p in params:
        p.grad = None
        p.main_grad = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
    block(residual).float().square().sum().backward()
    for p, want in zip(params, plain):
        assert p.grad is None and torch.equal(p.main_grad, want)
    block.scale.requires_grad_(False)
    block.scale.main_grad = block.fn.main_grad.view(-1)[:3]  # never written: not refused
    block(residual)


# --- flags take bools ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,got", [("False", r"str 'False'"), (1, r"int 1"), (None, r"None"),
                                       ("numpy", r"numpy\.bool_? True")])
def test_flags_take_bools_only(value, got):
    import numpy as np

    value = np.bool_(True) if value == "numpy" else value
    p = params(H, 0, "cpu")
    residual = residual_of(3, H, 0, "cpu")
    for call, where in [(lambda: modeling.MHCSublayer(H, torch.nn.Identity(), norm_weight=value),
                         "MHCSublayer: argument 'norm_weight'"),
                        (lambda: modeling.MHCHead(H, norm_weight=value), "MHCHead: argument 'norm_weight'"),
                        (lambda: modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], return_residual=value),
                         "mhc_pre: argument 'return_residual'"),
                        (lambda: modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], return_pre_mix=value),
                         "mhc_pre: argument 'return_pre_mix'")]:
        with pytest.raises(TypeError, match=rf"modeling.{where}: expected a bool, got {got}"):
            call()
    assert modeling.MHCSublayer(H, torch.nn.Identity(), norm_weight=False).norm_weight is None
    assert len(modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], return_pre_mix=False)) == 2


# --- Python-level misuse -----------------------------------------------------------------------------------------


def test_every_argument_of_the_modules_is_checked_at_construction():
    identity = torch.nn.Identity()
    for kwargs, exc, match in [
        (dict(sublayer=None), TypeError, r"MHCSublayer: argument 'sublayer': expected an nn.Module or a callable, "
                                         r"got None$"),
        (dict(sublayer=3), TypeError, r"MHCSublayer: argument 'sublayer': expected an nn.Module or a callable"),
        (dict(hidden_size="256"), TypeError, r"MHCSublayer: argument 'hidden_size': expected an int, got str"),
        (dict(hidden_size=256.0), TypeError, r"MHCSublayer: argument 'hidden_size': expected an int, got float"),
        (dict(hidden_size=None), TypeError, r"MHCSublayer: argument 'hidden_size': expected an int"),
        (dict(hc_mult="4"), TypeError, r"MHCSublayer: argument 'hc_mult': expected an int"),
        (dict(eps="1e-6"), TypeError, r"MHCSublayer: argument 'eps': expected a float"),
        (dict(post_mult_value=None), TypeError, r"MHCSublayer: argument 'post_mult_value': expected a float"),
        (dict(sinkhorn_repeat=20.0), TypeError, r"MHCSublayer: argument 'sinkhorn_repeat': expected an int"),
        (dict(device=3.5), TypeError, r"MHCSublayer: argument 'device': expected a torch.device, a str, an int "
                                      r"or None, got float"),
        (dict(device="gpu0"), ValueError, r"MHCSublayer: argument 'device': expected a device such as 'cpu'"),
    ]:
        args = dict(hidden_size=H, sublayer=identity)
        args.update(kwargs)
        with pytest.raises(exc, match=rf"cann_ops_tilelang::modeling.{match}"):
            modeling.MHCSublayer(args.pop("hidden_size"), args.pop("sublayer"), **args)
    for kwargs, exc, match in [(dict(hidden_size="256"), TypeError, r"'hidden_size': expected an int, got str"),
                               (dict(device=[0]), TypeError, r"'device': expected a torch.device"),
                               (dict(eps=None), TypeError, r"'eps': expected a float")]:
        args = dict(hidden_size=H)
        args.update(kwargs)
        with pytest.raises(exc, match=rf"modeling.MHCHead: argument {match}"):
            modeling.MHCHead(args.pop("hidden_size"), **args)
    # any callable is a sublayer (kept as it is, not registered as a submodule)
    block = modeling.MHCSublayer(H, lambda x: x, device=torch.device("cpu"))
    assert block(residual_of(3, H, 0, "cpu")).shape == (3, M, H)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda x: (x, x), TypeError, r"expected its output to be a torch.Tensor like its input \(2, 3, 256\) bf16, "
                                  r"got tuple"),
    (lambda x: None, TypeError, r"expected its output to be a torch.Tensor .* got None$"),
    (lambda x: x[:1], ValueError, r"expected its output of its input's shape \(2, 3, 256\), got \(1, 3, 256\)"),
    (lambda x: x.reshape(6, 256), ValueError, r"expected its output of its input's shape \(2, 3, 256\), got "
                                              r"\(6, 256\)"),
    (lambda x: x.float(), TypeError, r"expected its output in torch.bfloat16 \(its input's dtype\), got "
                                     r"torch.float32"),
    (lambda x: x.to("meta"), ValueError, r"expected its output on cpu \(its input's device\), got meta"),
])
def test_a_wrong_sublayer_output_is_named_as_the_sublayers(bad, exc, match):
    block = modeling.MHCSublayer(H, bad)
    with pytest.raises(exc, match=rf"modeling.MHCSublayer: argument 'sublayer': {match}"):
        block(residual_of(6, H, 0, "cpu").view(2, 3, M, H))


def test_wrong_kinds_of_arguments_get_clean_errors_naming_the_function_and_argument():
    p = params(H, 0, "cpu")
    residual = residual_of(3, H, 0, "cpu")
    block, head = modeling.MHCSublayer(H, torch.nn.Identity()), modeling.MHCHead(H)
    li, (post, comb), pre = modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], return_pre_mix=True)
    for call, exc, match in [
        (lambda: block(None), TypeError, r"MHCSublayer: argument 'residual': expected a torch.Tensor, got None$"),
        (lambda: block(residual.tolist()), TypeError, r"MHCSublayer: argument 'residual': expected a torch.Tensor"),
        (lambda: block(residual[0, 0]), ValueError, r"MHCSublayer: argument 'residual': expected \(\*, m, H\)"),
        (lambda: block(residual.float()), TypeError, r"MHCSublayer: argument 'residual': expected bf16"),
        (lambda: head(3.0), TypeError, r"MHCHead: argument 'residual': expected a torch.Tensor, got float"),
        (lambda: head(residual[:, :2]), ValueError, r"MHCHead: argument 'residual': expected hc_mult 4"),
        (lambda: modeling.mhc_head(None, head.fn, head.scale, head.base), TypeError,
         r"mhc_head: argument 'residual': expected a torch.Tensor"),
        (lambda: modeling.mhc_head(residual, head.fn, head.scale, head.base, norm_weight=1.0), TypeError,
         r"mhc_head: argument 'norm_weight': expected a torch.Tensor, got float"),
        (lambda: modeling.mhc_head(residual, head.fn, head.scale, head.base, n_splits="8"), TypeError,
         r"mhc_head: argument 'n_splits': expected an int"),
        (lambda: modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], sinkhorn_repeat=None), TypeError,
         r"mhc_pre: argument 'sinkhorn_repeat': expected an int"),
        (lambda: modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], norm_eps="0"), TypeError,
         r"mhc_pre: argument 'norm_eps': expected a float"),
        (lambda: modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], post_mult_value=None), TypeError,
         r"mhc_pre: argument 'post_mult_value': expected a float"),
        (lambda: modeling.mhc_post(li, None, post, comb), TypeError,
         r"mhc_post: argument 'residual': expected a torch.Tensor"),
        (lambda: modeling.mhc_post(li, residual, (post,), comb), TypeError,
         r"mhc_post: argument 'post_mix': expected a torch.Tensor, got tuple"),
        (lambda: modeling.expand_from_embedding(li, hc_mult=None), TypeError,
         r"expand_from_embedding: argument 'hc_mult': expected an int"),
        (lambda: modeling.mhc_recompute_chunk(None, [pre], [li], [post], [comb]), TypeError,
         r"mhc_recompute_chunk: argument 'residual': expected a torch.Tensor"),
        (lambda: modeling.mhc_recompute_chunk(residual, [pre], [li], [post], comb), TypeError,
         r"mhc_recompute_chunk: argument 'comb_mixes': expected a list of tensors, got torch.Tensor$"),
        (lambda: modeling.mhc_recompute_chunk(residual, [pre], [li], [post, post], [comb]), ValueError,
         r"mhc_recompute_chunk: argument 'post_mixes': expected as many tensors as layer_outputs \(1\), got 2"),
        (lambda: modeling.mhc_recompute_chunk(residual, [pre], [li], [post], []), ValueError,
         r"mhc_recompute_chunk: argument 'comb_mixes': expected as many tensors as layer_outputs \(1\), got 0"),
        (lambda: modeling.mhc_recompute_chunk(residual, [pre], [li, li], [post], [comb]), ValueError,
         r"mhc_recompute_chunk: argument 'layer_outputs': expected L - 1 or L = 1 tensors \(L: pre_mixes\), got 2"),
        (lambda: modeling.mhc_recompute_chunk(residual, [pre, None], [li], [post], [comb]), TypeError,
         r"mhc_recompute_chunk: argument 'pre_mixes\[1\]': expected a torch.Tensor, got None$"),
    ]:
        with pytest.raises(exc, match=rf"cann_ops_tilelang::modeling.{match}"):
            call()


# --- errors name what the caller passed ------------------------------------------------------------------------


def test_wrong_parameters_are_named_as_passed_never_as_the_merged_weight():
    """With or without gradients, with a norm weight (merged into fn before any kernel): the argument named is
    the caller's, and a width that disagrees with the residual's H says so with the residual's shape."""
    p = params(H, 0, "cpu", norm_weight=True)
    residual = residual_of(3, H, 0, "cpu")
    wide = residual_of(3, 2 * H, 0, "cpu")
    context = r"\(m\*H = 4\*256, from residual of shape \(3, 4, 256\)\)"
    head = modeling.MHCHead(H, norm_weight=True)
    for grad in (False, True):
        fn = p["fn"].clone().requires_grad_(grad)
        for kwargs, match in [
            (dict(fn=fn[:, :512]), rf"'fn': expected shape \(24, 1024\) {context}, got \(24, 512\)"),
            (dict(fn=fn[:20]), rf"'fn': expected shape \(24, 1024\) {context}, got \(20, 1024\)"),
            (dict(scale=p["scale"][:2]), r"'scale': expected shape \(3,\), got \(2,\)"),
            (dict(base=p["base"][:4]), r"'base': expected shape \(24,\), got \(4,\)"),
            (dict(norm_weight=p["norm_weight"][:512]), rf"'norm_weight': expected shape \(1024,\) {context}, got "
                                                       r"\(512,\)"),
            (dict(residual=wide), r"'fn': expected shape \(24, 2048\) \(m\*H = 4\*512, from residual of shape "
                                  r"\(3, 4, 512\)\), got \(24, 1024\)"),
        ]:
            args = dict(residual=residual, fn=fn, scale=p["scale"], base=p["base"], norm_weight=p["norm_weight"])
            args.update(kwargs)
            with pytest.raises(ValueError, match=rf"modeling.mhc_pre: argument {match}"):
                modeling.mhc_pre(args.pop("residual"), args.pop("fn"), args.pop("scale"), args.pop("base"), **args)
        for kwargs, match in [
            (dict(fn_head=head.fn[:3]), rf"'fn_head': expected shape \(4, 1024\) {context}, got \(3, 1024\)"),
            (dict(scale_head=head.base), r"'scale_head': expected shape \(1,\), got \(4,\)"),
            (dict(base_head=head.scale), r"'base_head': expected shape \(4,\), got \(1,\)"),
            (dict(norm_weight=head.fn), r"'norm_weight': expected shape \(1024,\), got \(4, 1024\)"),
            (dict(residual=wide), r"'fn_head': expected shape \(4, 2048\) \(m\*H = 4\*512, from residual of shape "
                                  r"\(3, 4, 512\)\), got \(4, 1024\)"),
        ]:
            args = dict(residual=residual.requires_grad_(grad), fn_head=head.fn, scale_head=head.scale,
                        base_head=head.base, norm_weight=head.norm_weight)
            args.update(kwargs)
            with pytest.raises(ValueError, match=rf"modeling.mhc_head: argument {match}"):
                modeling.mhc_head(args.pop("residual"), args.pop("fn_head"), args.pop("scale_head"),
                                  args.pop("base_head"), **args)
        residual = residual.detach()
    # mhc_post's tensors against the residual they are checked with
    li, (post, comb) = modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"])
    with pytest.raises(ValueError, match=r"modeling.mhc_post: argument 'layer_output': expected shape \(3, 512\) "
                                         r"\(from residual of shape \(3, 4, 512\)\), got \(3, 256\)"):
        modeling.mhc_post(li, wide, post, comb)
    # a module whose residual has another H names the residual and the module's hidden size
    with pytest.raises(ValueError, match=r"modeling.MHCHead: argument 'residual': expected the module's hidden size "
                                         r"256 in the last dim, got shape \(3, 4, 512\)"):
        head(wide)


# --- numpy scalars -------------------------------------------------------------------------------------------


def test_numpy_scalars_are_numbers_as_for_the_ops(seed):
    """numpy integers and floats are accepted where the ops accept them, with bitwise the results of the same
    Python numbers; the modules keep Python numbers (so a compiled module sees constants); a numpy float is no
    int, and a numpy bool no number."""
    import numpy as np

    p = params(H, seed, "cpu", norm_weight=True)
    residual = residual_of(7, H, seed, "cpu")
    plain = dict(norm_eps=1e-6, pre_eps=1e-5, sinkhorn_eps=1e-6, post_mult_value=2.0, sinkhorn_repeat=10, n_splits=8)
    numpy = dict(norm_eps=np.float32(1e-6), pre_eps=np.float64(1e-5), sinkhorn_eps=np.float32(1e-6),
                 post_mult_value=np.float32(2.0), sinkhorn_repeat=np.int32(10), n_splits=np.int64(8))
    for grad in (False, True):
        fn = p["fn"].clone().requires_grad_(grad)
        want = modeling.mhc_pre(residual, fn, p["scale"], p["base"], norm_weight=p["norm_weight"], **plain)
        got = modeling.mhc_pre(residual, fn, p["scale"], p["base"], norm_weight=p["norm_weight"], **numpy)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1][1], got[1][1])
    head = modeling.MHCHead(H)
    assert torch.equal(modeling.mhc_head(residual, head.fn, head.scale, head.base, norm_eps=1e-6, n_splits=8),
                       modeling.mhc_head(residual, head.fn, head.scale, head.base, norm_eps=np.float32(1e-6),
                                         n_splits=np.int64(8)))
    block = modeling.MHCSublayer(np.int64(H), torch.nn.Identity(), np.int64(M), post_mult_value=np.float32(2.0),
                                 sinkhorn_repeat=np.int32(10), eps=np.float32(1e-6), n_splits=np.int64(8))
    values = (block.hidden_size, block.hc_mult, block.post_mult_value, block.sinkhorn_repeat, block.eps,
              block.n_splits)
    assert [type(v) for v in values] == [int, int, float, int, float, int]
    head = modeling.MHCHead(np.int16(H), np.int64(M), eps=np.float32(1e-6), n_splits=np.uint8(8))
    assert type(head.hidden_size) is int and type(head.eps) is float and type(head.n_splits) is int
    assert modeling.expand_from_embedding(residual[:, 0], np.int64(M)).shape == (7, M, H)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(residual), block(residual))
    with pytest.raises(TypeError, match=r"modeling.mhc_pre: argument 'n_splits': expected an int, got "
                                        r"(numpy\.)?float64"):
        modeling.mhc_pre(residual, p["fn"], p["scale"], p["base"], n_splits=np.float64(8))
    with pytest.raises(TypeError, match=r"modeling.MHCSublayer: argument 'eps': expected a float, got (numpy\.)?bool"):
        modeling.MHCSublayer(H, torch.nn.Identity(), eps=np.bool_(False))


# --- extra arguments of the sublayer -------------------------------------------------------------------------------


class MaskedSublayer(torch.nn.Module):
    """A sublayer with the signature of an attention block: ``forward(x, mask, *, positions=None)``."""

    def __init__(self, hidden, seed, device):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + 4)
        self.weight = torch.nn.Parameter((torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(device))

    def forward(self, x, mask, *, positions=None):
        y = torch.tanh(x.float() @ self.weight) * mask.unsqueeze(-1)
        if positions is not None:
            y = y + positions.unsqueeze(-1) * 1e-2
        return y.to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_extra_arguments_reach_the_sublayer_eager_and_compiled(device, seed):
    """``MHCSublayer.forward(residual, *args, **kwargs)`` calls ``sublayer(layer_input, *args, **kwargs)``: the
    same result and gradients as mhc_pre → sublayer → mhc_post by hand, and the same under torch.compile
    (aot_eager, fullgraph) with a tensor keyword argument."""
    sub = MaskedSublayer(H, seed, device)
    block = modeling.MHCSublayer(H, sub, device=device)
    gen = torch.Generator().manual_seed(seed)
    residual = residual_of(10, H, seed, device).view(2, 5, M, H)
    mask = (torch.rand(2, 5, generator=gen) > 0.3).float().to(device)
    positions = torch.arange(10.0).view(2, 5).to(device)

    def by_hand(r):
        li, (post, comb), linked = modeling.mhc_pre(r, block.fn, block.scale, block.base, return_residual=True)
        return modeling.mhc_post(sub(li, mask, positions=positions), linked, post, comb)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (by_hand, lambda r: block(r, mask, positions=positions),
               lambda r: compiled(r, mask, positions=positions)):
        for param in block.parameters():
            param.grad = None
        r = residual.clone().requires_grad_(True)
        out = fn(r)
        out.float().square().sum().backward()
        results.append((out, r.grad, [param.grad for param in block.parameters()]))
    for out, grad, grads in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(grad, results[0][1])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][2]))
    # the arguments changed the result: the sublayer got them
    assert not torch.equal(block(residual, mask), results[0][0])
    with pytest.raises(TypeError, match="unexpected keyword argument 'position'"):  # the sublayer's own error
        block(residual, mask, position=positions)


# --- errors under torch.compile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_checks_under_torch_compile_raise_as_documented(device):
    """docs/ops/mhc.md#modeling: a modeling-level check that fails while Dynamo traces (fullgraph=True) surfaces as
    torch._dynamo.exc.Unsupported ("Observed exception"), its message holding the check's own; without fullgraph
    Dynamo runs that frame eagerly and the TypeError/ValueError itself comes out."""
    p = {k: v.to(device) for k, v in params(H, 0, "cpu").items()}
    residual = residual_of(5, H, 0, "cpu").to(device)
    block = modeling.MHCSublayer(H, lambda x: x[:1], device=device)
    cases = [
        (lambda r: modeling.mhc_pre(r, p["fn"], p["scale"][:2], p["base"]), ValueError,
         r"modeling.mhc_pre: argument 'scale': expected shape \(3,\), got \(2,\)"),
        (lambda r: modeling.mhc_pre(r, p["fn"], p["scale"], p["base"], return_pre_mix="False"), TypeError,
         r"modeling.mhc_pre: argument 'return_pre_mix': expected a bool"),
        (lambda r: modeling.mhc_post(r[:, 0].float(), r, r[..., :1].float(), r[..., :M].float()), TypeError,
         r"modeling.mhc_post: argument 'layer_output': expected torch.bfloat16"),
        (block, ValueError, r"modeling.MHCSublayer: argument 'sublayer': expected its output of its input's shape"),
    ]
    for fn, exc, match in cases:
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=match) as info:
            torch.compile(fn, backend="aot_eager", fullgraph=True)(residual)
        assert "Observed exception" in str(info.value) and exc.__name__ in str(info.value)
        torch._dynamo.reset()
        with pytest.raises(exc, match=match):
            torch.compile(fn, backend="aot_eager")(residual)
    # a scalar the modeling layer leaves to the ops while traced: the op's fake raises, wrapped by torch (no
    # gradient here: the fused op; with one, the reduce + RMSNorm forward names its rms_eps the same way)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=r"mhc_pre_big_fuse: argument 'rms_eps': "
                                                                  r"expected a number >= 0.0"):
        torch.compile(lambda r: modeling.mhc_pre(r, p["fn"], p["scale"], p["base"], norm_eps=-1.0),
                      backend="aot_eager", fullgraph=True)(residual)
