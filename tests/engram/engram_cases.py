"""Example calls of the Engram ops, the family's cases registry (read through tests/_plugins/cases.py): for each op
``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema order.

The gate's inputs are drawn as the tests draw them (``engram_ref.make_inputs``; masked tokens by default) and its
backward gets the statistics of the reference forward, so a call is what a training step would pass; the hash
takes the extreme inputs of ``engram_ref.make_hash_inputs``. The Sinkhorn optimizer's ops run on a ``(tokens,
D)`` table (``tokens`` its rows; the partial rows of the column reduction) with ``D = 64`` per 512 of the hidden
size: 64 at the smallest H, up to the 1024 of ``limits.ENGRAM_SINKHORN_COLS`` at H = 8192.
"""

import torch
from engram_ref import engram_fused_weight_ref, engram_gate_forward_ref, make_hash_inputs, make_inputs

from cann_ops_tilelang import limits

M = 4
EPS, CLAMP = 1e-6, 1e-6
SINKHORN_EPS = 1e-8
PARTIALS = 6  # rows of the weight-gradient partials engram_grad_w_reduce sums (any count is valid)
BF16, F32 = torch.bfloat16, torch.float32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _on(device, call: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call.items()}


def _gate(tokens, hidden, seed, masked):
    """``(gen, x, kv, wh, we, wf, mask)``: the gate's inputs and the generator, for what a call draws next."""
    gen = _gen(seed)
    x, kv, wh, we, mask = make_inputs(tokens, hidden, masked=masked, generator=gen)
    return gen, x, kv, wh, we, engram_fused_weight_ref(wh, we), mask


def engram_fused_weight_call(tokens, hidden, *, seed=0, device="cpu"):
    _, _, _, wh, we, _, _ = _gate(tokens, hidden, seed, False)
    return _on(device, {"weight_hidden": wh, "weight_embed": we})


def engram_gate_forward_call(tokens, hidden, *, seed=0, device="cpu", masked=True, save_for_backward=True,
                         residual=True):
    _, x, kv, _, _, wf, mask = _gate(tokens, hidden, seed, masked)
    return _on(device, {"hidden_states": x, "kv": kv, "weight_fused": wf, "eps": EPS, "clamp_value": CLAMP,
                        "save_for_backward": save_for_backward, "image_token_mask": mask, "residual": residual})


def engram_gate_forward_inplace_call(tokens, hidden, *, seed=0, device="cpu", masked=True):
    _, x, kv, _, _, wf, mask = _gate(tokens, hidden, seed, masked)
    return _on(device, {"hidden_states": x, "kv": kv, "weight_fused": wf, "eps": EPS, "clamp_value": CLAMP,
                        "image_token_mask": mask})


def engram_gate_backward_call(tokens, hidden, *, seed=0, device="cpu", masked=True, residual=True):
    gen, x, kv, _, _, wf, mask = _gate(tokens, hidden, seed, masked)
    _, dot, gate, rstd_x, rstd_k = engram_gate_forward_ref(x, kv, wf, EPS, CLAMP, True, mask, residual)
    grad_out = torch.randn(tokens, M, hidden, generator=gen).to(BF16)
    return _on(device, {"grad_out": grad_out, "hidden_states": x, "kv": kv, "weight_fused": wf, "dot": dot,
                        "gate_score": gate, "rstd_x": rstd_x, "rstd_k": rstd_k, "clamp_value": CLAMP,
                        "image_token_mask": mask, "residual": residual})


def engram_grad_w_reduce_call(tokens, hidden, *, seed=0, device="cpu", partials=PARTIALS):
    gen, _, _, wh, we, _, _ = _gate(tokens, hidden, seed, False)
    return _on(device, {"grad_w_partial": torch.randn(partials, M, hidden, generator=gen), "weight_hidden": wh,
                        "weight_embed": we, "grad_weight_hidden": torch.randn(M, hidden, generator=gen),
                        "grad_weight_embed": torch.randn(M, hidden, generator=gen)})


def engram_hash_call(tokens, hidden, *, seed=0, device="cpu", ngram=3, layers=2, tables=8, masked=True,
                     extreme=True):
    ids, multipliers, sizes, offsets, mask = make_hash_inputs(tokens, ngram, layers, tables, masked=masked,
                                                              generator=_gen(seed), extreme=extreme)
    return _on(device, {"ngram_token_ids": ids, "multipliers": multipliers, "vocab_sizes": sizes, "offsets": offsets,
                        "image_token_mask": mask})


def table_cols(hidden: int) -> int:
    """The table width ``D`` of the Sinkhorn calls at hidden size ``hidden`` (see the module docstring)."""
    cols = limits.ENGRAM_SINKHORN_COLS
    return min(max(cols.low, cols.low * (hidden // 512)), cols.high)


def engram_sinkhorn_momentum_update_call(tokens, hidden, *, seed=0, device="cpu", cols=None, shape=None,
                                         grad_dtype=BF16, buffer_dtype=F32, beta1=0.9, nesterov=True):
    """A table's gradient, ``(tokens, D)`` (``shape``: any other, the op takes any element count)."""
    gen, shape = _gen(seed), shape or (tokens, cols or table_cols(hidden))
    return _on(device, {"grad": torch.randn(shape, generator=gen).to(grad_dtype),
                        "momentum_buffer": torch.randn(shape, generator=gen).to(buffer_dtype), "beta1": beta1,
                        "nesterov": nesterov})


def _scaled_matrix(tokens, cols, gen) -> dict:
    return {"matrix": torch.randn(tokens, cols, generator=gen), "row_scale": torch.rand(tokens, generator=gen) + 0.5,
            "col_scale": torch.rand(cols, generator=gen) + 0.5}


def engram_sinkhorn_step_call(tokens, hidden, *, seed=0, device="cpu", cols=None):
    gen, cols = _gen(seed), cols or table_cols(hidden)
    return _on(device, {**_scaled_matrix(tokens, cols, gen), "eps": SINKHORN_EPS})


def engram_sinkhorn_step_reduce_call(tokens, hidden, *, seed=0, device="cpu", cols=None, partials=None, rows=None):
    """``tokens`` partial rows (its token dim; ``partials``: another count) of a ``(rows, D)`` table (``rows``
    default: ``tokens``, at least 1)."""
    gen, cols = _gen(seed), cols or table_cols(hidden)
    partials = tokens if partials is None else partials
    return _on(device, {"col_sumsq_partial": torch.rand(partials, cols, generator=gen),
                        "col_sumsq": torch.rand(cols, generator=gen), "col_scale": torch.rand(cols, generator=gen) + 0.5,
                        "rows": max(tokens, 1) if rows is None else rows, "eps": SINKHORN_EPS})


def engram_sinkhorn_finalize_call(tokens, hidden, *, seed=0, device="cpu", cols=None, alpha=8.0):
    gen, cols = _gen(seed), cols or table_cols(hidden)
    return _on(device, {**_scaled_matrix(tokens, cols, gen), "eps": SINKHORN_EPS, "alpha": alpha})


def engram_sinkhorn_finalize_out_call(tokens, hidden, *, seed=0, device="cpu", cols=None, alpha=8.0):
    return {**engram_sinkhorn_finalize_call(tokens, hidden, seed=seed, device=device, cols=cols, alpha=alpha),
            "out": torch.empty(tokens, cols or table_cols(hidden), device=device)}


def engram_sinkhorn_finalize_apply_call(tokens, hidden, *, seed=0, device="cpu", cols=None, alpha=8.0,
                                        param_dtype=BF16, lr=0.01, decay=0.999):
    gen, cols = _gen(seed), cols or table_cols(hidden)
    call = {**_scaled_matrix(tokens, cols, gen), "eps": SINKHORN_EPS, "alpha": alpha}
    return _on(device, {**call, "param": torch.randn(tokens, cols, generator=gen).to(param_dtype), "lr": lr,
                        "decay": decay})
