"""Example calls of the mHC ops, the family's cases registry (read through tests/_plugins/cases.py): for each op
``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema order,
drawn as the device tests need them (buffers an op accumulates into start with random content so that the tests
see the prior content used). ``make_args(op, tokens, hidden, ...)`` gives the same call as a list.
"""

import inspect

import torch

import cann_ops_tilelang as ops

M = 4
M3 = M * (M + 2)
EPS = 1e-6
SPLITS = 16
PARTIALS = 8
SINKHORN_REPEAT = 10
RECOMPUTE_LAYERS = (3, 2)  # (L, Lp); read at each call (tests set it)
BF16, F32 = torch.bfloat16, torch.float32

# the family's ops as registered, not listed here (each has an <op>_call below: tests/test_example_calls.py)
OPS = [name for name, public in ops.registered_ops().items() if public.declaration.family == "mhc"]

# fused ops: held to the chains they replace, bit for bit (tests/mhc/test_mhc_pre_big_fuse.py,
# tests/mhc/test_mhc_multilayer_recompute.py)
FUSED_OPS = {"mhc_pre_big_fuse", "mhc_multilayer_recompute"}

# token-independent ops (weights only)
WEIGHT_OPS = {"mhc_fn_normw_merge_forward", "mhc_fn_normw_merge_backward"}


class _Draw:
    """The tensors of one call, drawn in order from one generator seeded with ``seed`` (the order is the call's:
    the device tests' expected values depend on it)."""

    def __init__(self, tokens: int, hidden: int, seed: int, device):
        self.gen = torch.Generator().manual_seed(seed)
        self.tokens, self.hidden, self.k, self.device = tokens, hidden, M * hidden, device

    def randn(self, *shape, dtype=F32, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=self.gen) * scale + shift
        return t.to(device=self.device, dtype=dtype)

    def empty(self, *shape, dtype=F32):
        return torch.empty(*shape, dtype=dtype, device=self.device)

    def residual(self):
        # streams of slightly different scale, as the design's tests draw them
        scale = (1 + 0.01 * torch.arange(M, dtype=F32)).view(1, M, 1).to(self.device)
        return (self.randn(self.tokens, M, self.hidden) * scale).to(BF16)

    def positive_sq(self, *shape):
        return (self.randn(*shape).abs() + 0.5) * self.k


def expand_to_mhc_forward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"x": d.randn(tokens, hidden, dtype=BF16), "out": d.empty(tokens, M, hidden, dtype=BF16)}


def expand_to_mhc_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"grad_out": d.randn(tokens, M, hidden, dtype=BF16), "grad_x": d.empty(tokens, hidden, dtype=BF16)}


def mhc_fn_normw_merge_forward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"fn": d.randn(M3, d.k, scale=1e-4), "normw": d.randn(d.k, scale=0.1, shift=1.0),
            "out_fn": d.empty(M3, d.k)}


def mhc_fn_normw_merge_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"fn": d.randn(M3, d.k, scale=1e-4), "normw": d.randn(d.k, scale=0.1, shift=1.0),
            "grad_out_fn": d.randn(M3, d.k), "grad_fn": d.randn(M3, d.k), "grad_normw": d.randn(d.k)}


def mhc_gemm_with_sqrsum_forward_call(tokens, hidden, *, seed=0, device="cpu", splits=SPLITS):
    d = _Draw(tokens, hidden, seed, device)
    return {"x": d.residual().view(tokens, d.k), "fn": d.randn(M3, d.k, scale=1e-2), "n_splits": splits}


def mhc_gemm_with_sqrsum_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"grad_out_mul": d.randn(tokens, M3), "grad_sqrsum": d.randn(tokens, scale=1e-3),
            "x": d.residual().view(tokens, d.k), "fn": d.randn(M3, d.k, scale=1e-2),
            "grad_x": d.randn(tokens, d.k, dtype=BF16)}


def mhc_reduce_partials_and_rmsnorm_forward_call(tokens, hidden, *, seed=0, device="cpu", splits=SPLITS):
    d = _Draw(tokens, hidden, seed, device)
    return {"out_mul_splitted": d.randn(splits, tokens, 1, M3),
            "sqrsum_splitted": d.positive_sq(splits, tokens, 1) / splits, "out_mul": d.empty(tokens, 1, M3),
            "sqrsum": d.empty(tokens, 1), "out": d.empty(tokens, M3), "rms_group_size": d.k, "rms_eps": EPS,
            "n_splits": splits}


def mhc_reduce_partials_and_rmsnorm_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"grad_out": d.randn(tokens, M3), "out_mul": d.randn(tokens, 1, M3), "sqrsum": d.positive_sq(tokens, 1),
            "grad_out_mul": d.empty(tokens, 1, M3), "grad_sqrsum": d.empty(tokens, 1), "rms_group_size": d.k,
            "rms_eps": EPS}


def mhc_pre_split_mixes_forward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"input_mixes": d.randn(tokens, M3), "mhc_scale": d.randn(3), "mhc_base": d.randn(M3),
            "pre": d.empty(tokens, M), "post": d.empty(tokens, M), "comb": d.empty(tokens, M * M),
            "post_mult_value": 2.0, "pre_eps": 1e-2}


def mhc_pre_split_mixes_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    mixes, scale, base = d.randn(tokens, M3), d.randn(3), d.randn(M3)
    z = mixes[:, M : 2 * M] * scale[1] + base[M : 2 * M]
    return {"grad_pre": d.randn(tokens, M), "grad_post": d.randn(tokens, M), "grad_comb": d.randn(tokens, M * M),
            "input_mixes": mixes, "post": torch.sigmoid(z) * 2.0, "mhc_scale": scale, "mhc_base": base,
            "grad_input_mixes": d.empty(tokens, M3), "grad_mhc_scale": d.randn(3), "grad_mhc_base": d.randn(M3),
            "post_mult_value": 2.0}


def mhc_sinkhorn_forward_call(tokens, hidden, *, seed=0, device="cpu", repeat=SINKHORN_REPEAT, logit_offset=0.0,
                              sinkhorn_eps=EPS):
    d = _Draw(tokens, hidden, seed, device)
    return {"comb": d.randn(tokens, M, M, shift=logit_offset), "comb_out": d.empty(tokens, M, M), "repeat": repeat,
            "eps": sinkhorn_eps}


def mhc_sinkhorn_backward_call(tokens, hidden, *, seed=0, device="cpu", repeat=SINKHORN_REPEAT, logit_offset=0.0,
                               sinkhorn_eps=EPS):
    d = _Draw(tokens, hidden, seed, device)
    return {"grad_comb_out": d.randn(tokens, M, M), "comb": d.randn(tokens, M, M, shift=logit_offset),
            "grad_comb": d.empty(tokens, M, M), "repeat": repeat, "eps": sinkhorn_eps}


def mhc_pre_apply_mix_forward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"x": torch.sigmoid(d.randn(tokens, M, hidden)).to(BF16), "mix": torch.softmax(d.randn(tokens, M), -1),
            "out": d.empty(tokens, hidden, dtype=BF16)}


def mhc_pre_apply_mix_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"grad_out": d.randn(tokens, hidden, dtype=BF16), "x": torch.sigmoid(d.randn(tokens, M, hidden)).to(BF16),
            "mix": torch.softmax(d.randn(tokens, M), -1), "grad_x": d.randn(tokens, M, hidden, dtype=BF16)}


def _post_inputs(d: _Draw) -> dict:
    return {"x": d.randn(d.tokens, d.hidden, dtype=BF16), "residual": d.residual(), "post_layer_mix": d.randn(d.tokens, M),
            "comb_res_mix": d.randn(d.tokens, M, M)}


def mhc_post_forward_call(tokens, hidden, *, seed=0, device="cpu"):
    return _post_inputs(_Draw(tokens, hidden, seed, device))


def mhc_post_forward_out_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {**_post_inputs(d), "out": d.empty(tokens, M, hidden, dtype=BF16)}


def mhc_post_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    inputs = _post_inputs(d)
    return {**inputs, "grad_out": d.randn(tokens, M, hidden, dtype=BF16)}


def mhc_head_compute_mix_forward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"input_mix": d.randn(tokens, M), "mhc_scale": d.randn(1), "mhc_base": d.randn(M),
            "output_mix": d.empty(tokens, M), "pre_eps": 1e-2}


def mhc_head_compute_mix_backward_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    return {"grad_output_mix": d.randn(tokens, M), "input_mix": d.randn(tokens, M), "mhc_scale": d.randn(1),
            "mhc_base": d.randn(M), "grad_input_mix": d.empty(tokens, M), "grad_mhc_scale_partial": d.empty(PARTIALS, 1),
            "grad_mhc_base_partial": d.empty(PARTIALS, M)}


def mhc_pre_big_fuse_call(tokens, hidden, *, seed=0, device="cpu", repeat=SINKHORN_REPEAT, splits=SPLITS,
                          sinkhorn_eps=EPS):
    d = _Draw(tokens, hidden, seed, device)
    return {"gemm_out_mul": d.randn(splits, tokens, M3), "gemm_out_sqrsum": d.positive_sq(splits, tokens) / splits,
            "mhc_scale": d.randn(3, scale=0.1), "mhc_base": d.randn(M3, scale=0.1), "residual": d.residual(),
            "post_mix": d.empty(tokens, M), "comb_mix": d.empty(tokens, M * M),
            "layer_input": d.empty(tokens, hidden, dtype=BF16), "rms_eps": EPS, "pre_eps": EPS,
            "sinkhorn_eps": sinkhorn_eps, "post_mult_value": 2.0, "sinkhorn_repeat": repeat, "n_splits": splits}


def mhc_multilayer_recompute_call(tokens, hidden, *, seed=0, device="cpu"):
    d = _Draw(tokens, hidden, seed, device)
    layers, kept = RECOMPUTE_LAYERS
    return {"initial_residual": d.residual(),
            "pre_mix_list": [torch.softmax(d.randn(tokens, M), -1) for _ in range(layers)],
            "layer_output_list": [d.randn(tokens, hidden, dtype=BF16) for _ in range(kept)],
            "post_mix_list": [torch.sigmoid(d.randn(tokens, M)) * 2 for _ in range(kept)],
            "comb_mix_list": [torch.softmax(d.randn(tokens, M, M), -1) for _ in range(kept)],
            "layer_input_list": [d.empty(tokens, hidden, dtype=BF16) for _ in range(layers)],
            "residual_list": [d.empty(tokens, M, hidden, dtype=BF16) for _ in range(kept)]}


def make_args(op: str, tokens: int, hidden: int, *, seed: int = 0, device="cpu", repeat: int = SINKHORN_REPEAT,
              splits: int = SPLITS, logit_offset: float = 0.0, sinkhorn_eps: float = EPS) -> list:
    """The op's call (``<op>_call``) as a list in schema order; options an op does not take are ignored."""
    build = globals().get(f"{op}_call")
    if build is None:
        raise KeyError(op)
    options = dict(seed=seed, device=device, repeat=repeat, splits=splits, logit_offset=logit_offset,
                   sinkhorn_eps=sinkhorn_eps)
    taken = inspect.signature(build).parameters
    return list(build(tokens, hidden, **{k: v for k, v in options.items() if k in taken}).values())
