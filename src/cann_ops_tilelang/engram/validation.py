"""Validation of the Engram gate ops: one metadata-only function per op.

Shared by the fakes and by every kernel wrapper (the kernels run the fake's prepare function
first), so a bad argument raises the same ``TypeError``/``ValueError`` everywhere, before any
output is written.

Supported sizes (both backends): ``hc_mult == 4``; hidden size ``H`` a multiple of 256 with
``512 <= H <= 8192``; any token count ``T >= 0``.
"""

import torch

from .._checks import OpError, check_float, check_same_device, check_tensor

__all__ = [
    "HC_MULT",
    "MAX_HIDDEN",
    "MIN_HIDDEN",
    "HIDDEN_ALIGN",
    "check_engram_fused_weight",
    "check_engram_gate_bwd",
    "check_engram_gate_fwd",
    "check_engram_grad_w_reduce",
]

HC_MULT = 4
HIDDEN_ALIGN = 256
MIN_HIDDEN = 512
MAX_HIDDEN = 8192
FUSED_WEIGHT_ALIGN = 256


def _check_hc_hidden(err: OpError, arg: str, m: int, hidden: int) -> None:
    if m != HC_MULT:
        raise err.value(arg, f"expected hc_mult {HC_MULT} (the only one with kernels), got {m}")
    if hidden % HIDDEN_ALIGN != 0 or not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise err.value(
            arg,
            f"expected a hidden size that is a multiple of {HIDDEN_ALIGN} in [{MIN_HIDDEN}, {MAX_HIDDEN}], "
            f"got {hidden}",
        )


def _check_mask(err: OpError, mask: object, tokens: int) -> torch.Tensor | None:
    if mask is None:
        return None
    return check_tensor(err, "image_token_mask", mask, dtype=torch.bool, shape=(tokens,))


def check_engram_fused_weight(weight_hidden: object, weight_embed: object) -> None:
    """``weight_hidden``/``weight_embed``: contiguous 2-D bf16 of equal shape; a non-empty element
    count must be divisible by 256."""
    err = OpError("engram_fused_weight")
    wh = check_tensor(err, "weight_hidden", weight_hidden, dtype=torch.bfloat16, ndim=2)
    we = check_tensor(err, "weight_embed", weight_embed, dtype=torch.bfloat16, ndim=2)
    if wh.shape != we.shape:
        raise err.value(
            "weight_embed", f"expected the shape of weight_hidden {tuple(wh.shape)}, got {tuple(we.shape)}"
        )
    numel = wh.numel()
    if numel % FUSED_WEIGHT_ALIGN != 0:
        raise err.value(
            "weight_hidden", f"expected an element count divisible by {FUSED_WEIGHT_ALIGN}, got {numel}"
        )
    check_same_device(err, [("weight_hidden", wh), ("weight_embed", we)])


def check_engram_gate_fwd(
    hidden_states: object,
    kv: object,
    weight_fused: object,
    eps: object,
    clamp_value: object,
    image_token_mask: object,
    *,
    save_for_backward: bool,
    inplace: bool,
    op: str = "engram_gate_fwd",
) -> None:
    """Checks the arguments of the Engram gate forward (OPS.md B.1.2)."""
    err = OpError(op)
    x = check_tensor(err, "hidden_states", hidden_states, dtype=torch.bfloat16, ndim=3)
    tokens, m, hidden = x.shape
    _check_hc_hidden(err, "hidden_states", m, hidden)
    kv_t = check_tensor(err, "kv", kv, dtype=torch.bfloat16, shape=(tokens, m + 1, hidden))
    wf = check_tensor(err, "weight_fused", weight_fused, dtype=torch.float32, shape=(m, hidden))
    check_float(err, "eps", eps, minimum=0.0)
    check_float(err, "clamp_value", clamp_value, minimum=0.0, inclusive=False)
    mask = _check_mask(err, image_token_mask, tokens)
    if not isinstance(save_for_backward, bool):
        raise err.type("save_for_backward", f"expected a bool, got {type(save_for_backward).__name__}")
    if not isinstance(inplace, bool):
        raise err.type("inplace", f"expected a bool, got {type(inplace).__name__}")
    if inplace and save_for_backward:
        raise err.value(
            "inplace",
            "inplace=True cannot be combined with save_for_backward=True (backward needs the original "
            "hidden_states)",
        )
    check_same_device(err, [("hidden_states", x), ("kv", kv_t), ("weight_fused", wf), ("image_token_mask", mask)])


def check_engram_gate_bwd(
    grad_out: object,
    hidden_states: object,
    kv: object,
    weight_fused: object,
    dot: object,
    gate_score: object,
    rstd_x: object,
    rstd_k: object,
    clamp_value: object,
    image_token_mask: object,
) -> None:
    """Checks the arguments of the Engram gate backward (OPS.md B.1.3)."""
    err = OpError("engram_gate_bwd")
    go = check_tensor(err, "grad_out", grad_out, dtype=torch.bfloat16, ndim=3)
    tokens, m, hidden = go.shape
    _check_hc_hidden(err, "grad_out", m, hidden)
    x = check_tensor(err, "hidden_states", hidden_states, dtype=torch.bfloat16, shape=(tokens, m, hidden))
    kv_t = check_tensor(err, "kv", kv, dtype=torch.bfloat16, shape=(tokens, m + 1, hidden))
    wf = check_tensor(err, "weight_fused", weight_fused, dtype=torch.float32, shape=(m, hidden))
    stats = [
        (arg, check_tensor(err, arg, value, dtype=torch.float32, shape=(tokens, m)))
        for arg, value in (("dot", dot), ("gate_score", gate_score), ("rstd_x", rstd_x), ("rstd_k", rstd_k))
    ]
    check_float(err, "clamp_value", clamp_value, minimum=0.0, inclusive=False)
    mask = _check_mask(err, image_token_mask, tokens)
    check_same_device(
        err,
        [("grad_out", go), ("hidden_states", x), ("kv", kv_t), ("weight_fused", wf), *stats, ("image_token_mask", mask)],
    )


def check_engram_grad_w_reduce(
    grad_w_partial: object,
    weight_hidden: object,
    weight_embed: object,
    grad_weight_hidden: object,
    grad_weight_embed: object,
) -> None:
    """Checks the arguments of the weight-gradient reduction (OPS.md B.1.4)."""
    err = OpError("engram_grad_w_reduce")
    partial = check_tensor(err, "grad_w_partial", grad_w_partial, dtype=torch.float32, ndim=3)
    _, m, hidden = partial.shape
    _check_hc_hidden(err, "grad_w_partial", m, hidden)
    wh = check_tensor(err, "weight_hidden", weight_hidden, dtype=torch.bfloat16, shape=(m, hidden))
    we = check_tensor(err, "weight_embed", weight_embed, dtype=torch.bfloat16, shape=(m, hidden))
    gwh = check_tensor(err, "grad_weight_hidden", grad_weight_hidden, dtype=torch.float32, shape=(m, hidden))
    gwe = check_tensor(err, "grad_weight_embed", grad_weight_embed, dtype=torch.float32, shape=(m, hidden))
    if gwh is gwe:
        raise err.value("grad_weight_embed", "expected a buffer distinct from grad_weight_hidden, got the same one")
    check_same_device(
        err,
        [
            ("grad_w_partial", partial),
            ("weight_hidden", wh),
            ("weight_embed", we),
            ("grad_weight_hidden", gwh),
            ("grad_weight_embed", gwe),
        ],
    )
