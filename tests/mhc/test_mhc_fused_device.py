"""Device tier of the fused mHC ops (skipped without a GPU or NPU): each equal bit for bit to the chain of
primitives it replaces, run on the same device with the same inputs (docs/ops/mhc.md#pre_big_fuse,
docs/ops/mhc.md#multilayer_recompute)."""

import pytest
import torch
from _plugins.device import requires_device
from _plugins.levels import level_choice
from mhc_cases import M, M3, make_args

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

pytestmark = requires_device

TOKENS = level_choice([1, 509], [0, 1, 509, 512, 1021, 8192], [0, 1, 509, 512, 1021, 8192])
HIDDEN = level_choice([1280, 4096], [1280, 2560, 4096, 5120, 7168], [1280, 2560, 4096, 5120, 7168])
REPEATS = level_choice([10], [1, 10, 20], [1, 10, 20])


def unfused_pre(gemm_out_mul, gemm_out_sqrsum, scale, base, residual, rms_eps, pre_eps, sinkhorn_eps, post_mult,
                repeat, splits):
    tokens, m, hidden = residual.shape
    new = lambda *shape: torch.empty(shape, device=residual.device)  # noqa: E731
    out_mul, sqrsum, mixes = new(tokens, 1, M3), new(tokens, 1), new(tokens, M3)
    ops.mhc_reduce_partials_and_rmsnorm_forward(gemm_out_mul.view(splits, tokens, 1, M3),
                                                gemm_out_sqrsum.view(splits, tokens, 1), out_mul, sqrsum, mixes,
                                                m * hidden, rms_eps, splits)
    pre, post, logits = new(tokens, m), new(tokens, m), new(tokens, m * m)
    ops.mhc_pre_split_mixes_forward(mixes, scale, base, pre, post, logits, post_mult, pre_eps)
    comb = new(tokens, m, m)
    ops.mhc_sinkhorn_forward(logits.view(tokens, m, m), comb, repeat, sinkhorn_eps)
    layer_input = residual.new_empty(tokens, hidden)
    ops.mhc_pre_apply_mix_forward(residual, pre, layer_input)
    return post, comb.view(tokens, m * m), layer_input


@pytest.mark.parametrize("repeat", REPEATS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_pre_big_fuse_equals_the_unfused_chain(tokens, hidden, repeat, device, seed):
    splits = 16 if device.type == "cuda" else 1
    args = make_args("mhc_pre_big_fuse", tokens, hidden, seed=seed, device=device, repeat=repeat, splits=splits)
    gemm_out_mul, gemm_out_sqrsum, scale, base, residual, post, comb, layer_input = args[:8]
    rms_eps, pre_eps, sinkhorn_eps, post_mult = args[8:12]
    for t in (post, comb):
        t.fill_(float("nan"))  # every element must be written
    layer_input.fill_(float("nan"))
    ops.mhc_pre_big_fuse(*args)
    want = unfused_pre(gemm_out_mul, gemm_out_sqrsum, scale, base, residual, rms_eps, pre_eps, sinkhorn_eps,
                       post_mult, repeat, splits)
    for got, ref in zip((post, comb, layer_input), want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("layers,kept", [(1, 1), (3, 2), (3, 3), (10, 9), (10, 10)])
@pytest.mark.parametrize("hidden", level_choice([1280], [1280, 4096, 7168], [1280, 2560, 4096, 7168]))
@pytest.mark.parametrize("tokens", level_choice([509], [0, 1, 509, 8192], [0, 1, 509, 1021, 8192]))
def test_multilayer_recompute_equals_the_apply_mix_post_chain(layers, kept, tokens, hidden, device, seed):
    import mhc_cases

    saved = mhc_cases.RECOMPUTE_LAYERS
    mhc_cases.RECOMPUTE_LAYERS = (layers, kept)
    try:
        args = make_args("mhc_multilayer_recompute", tokens, hidden, seed=seed, device=device)
    finally:
        mhc_cases.RECOMPUTE_LAYERS = saved
    residual0, pres, outputs, posts, combs, inputs, residuals = args
    ops.mhc_multilayer_recompute(*args)
    r = residual0
    for layer in range(layers):
        li = torch.empty_like(inputs[layer])
        ops.mhc_pre_apply_mix_forward(r, pres[layer], li)
        assert torch.equal(inputs[layer], li), layer
        if layer < kept:
            r = ops.mhc_post_forward(outputs[layer], r, posts[layer], combs[layer])
            assert torch.equal(residuals[layer], r), layer


def test_fused_ops_refuse_out_of_range_arguments_on_the_device(device):
    args = make_args("mhc_pre_big_fuse", 4, 1280, device=device)
    args[12] = limits.MHC_SINKHORN_REPEAT.of(device.type).high + 1
    with pytest.raises(ValueError, match="mhc_pre_big_fuse: argument 'sinkhorn_repeat'"):
        ops.mhc_pre_big_fuse(*args)
    args = make_args("mhc_multilayer_recompute", 4, 1280, device=device)
    args[2] = args[2] + [args[2][0]] * 2  # Lp = L + 1
    with pytest.raises(ValueError, match="mhc_multilayer_recompute: argument 'layer_output_list'"):
        ops.mhc_multilayer_recompute(*args)
    assert M == 4
