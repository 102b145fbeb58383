"""Device-free PyTorch references of the Engram gate family (docs/ops/engram.md).

They are the numerical oracle of the tests (never part of the package): the fp32 forward and
backward with the ops' exact output contracts (masked tokens, zero statistics, per-worker weight
partials), and a differentiable float64 model of the gate used to check the backward formulas
against autograd.
"""

import math

import torch

HC_MULT = 4


def engram_fused_weight_ref(weight_hidden: torch.Tensor, weight_embed: torch.Tensor) -> torch.Tensor:
    """``f32(wh) * f32(we)``: exact in fp32 (8-bit by 8-bit significands)."""
    return weight_hidden.float() * weight_embed.float()


def _signed_sqrt(z: torch.Tensor, clamp_value: float) -> torch.Tensor:
    # copysign semantics: z = +0 gives +sqrt(clamp), as the kernels compute it (decision 6).
    return torch.copysign(torch.sqrt(torch.clamp_min(z.abs(), clamp_value)), z)


def engram_gate_fwd_ref(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    weight_fused: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
    image_token_mask: torch.Tensor | None = None,
):
    """fp32 reference of ``engram_gate_fwd`` with the op's output contract.

    Returns:
        ``(output bf16 (T, m, H), dot, gate_score, rstd_x, rstd_k)``; the statistics are ``(T, m)``
        fp32 (zeros on masked tokens) or empty ``(0,)`` tensors when not saving.
    """
    tokens, m, hidden = hidden_states.shape
    x = hidden_states.float()
    k = kv[:, :m].float()
    v = kv[:, m].float()
    raw = (x * weight_fused.float() * k).sum(-1)
    rstd_x = torch.rsqrt(x.square().sum(-1) / hidden + eps)
    rstd_k = torch.rsqrt(k.square().sum(-1) / hidden + eps)
    z = raw * rstd_x * rstd_k * (hidden ** -0.5)
    gate = torch.sigmoid(_signed_sqrt(z, clamp_value))
    out = (x + gate.unsqueeze(-1) * v.unsqueeze(1)).to(torch.bfloat16)
    stats = [raw, gate, rstd_x, rstd_k]
    if image_token_mask is not None:
        keep = image_token_mask.view(tokens, 1, 1)
        out = torch.where(keep, hidden_states, out)
        stats = [torch.where(image_token_mask.view(tokens, 1), torch.zeros_like(s), s) for s in stats]
    if not save_for_backward:
        stats = [x.new_empty((0,)) for _ in stats]
    return (out.contiguous(), *[s.contiguous() for s in stats])


def engram_gate_fwd_inplace_ref(hidden_states, kv, weight_fused, eps, clamp_value, image_token_mask=None) -> None:
    """In-place variant: writes the reference output into ``hidden_states``."""
    out = engram_gate_fwd_ref(hidden_states, kv, weight_fused, eps, clamp_value, False, image_token_mask)[0]
    hidden_states.copy_(out)


def worker_ranges(tokens: int, partials: int) -> list[tuple[int, int]]:
    """The fixed token partition of the weight-gradient partials: worker ``p`` owns
    ``[p*ceil(T/P), min((p+1)*ceil(T/P), T))`` (possibly empty)."""
    per = -(-tokens // partials) if tokens else 0
    return [(min(p * per, tokens), min((p + 1) * per, tokens)) for p in range(partials)]


def engram_gate_bwd_ref(
    grad_out: torch.Tensor,
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    weight_fused: torch.Tensor,
    dot: torch.Tensor,
    gate_score: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
    image_token_mask: torch.Tensor | None = None,
    partials: int = 1,
    outputs=None,
):
    """fp32 reference of ``engram_gate_bwd`` from the closed-form gradients (docs/ops/engram.md#gate); with
    the op's ``outputs``, its partial rows as they are allocated.

    Computes in the dtype of ``dot`` (fp32 normally; float64 in the autograd cross-check).

    Returns:
        ``(grad_x (T, m, H), grad_kv (T, m + 1, H), grad_w_partial (partials, m, H))``; bf16
        gradients when the inputs are bf16, else in the compute dtype.
    """
    tokens, m, hidden = hidden_states.shape
    ct = dot.dtype
    go = grad_out.to(ct)
    x = hidden_states.to(ct)
    k = kv[:, :m].to(ct)
    v = kv[:, m].to(ct)
    wf = weight_fused.to(ct)
    scale = hidden ** -0.5
    big_g = (go * v.unsqueeze(1)).sum(-1)
    c = scale * rstd_x * rstd_k
    active = dot.abs() * c >= clamp_value
    safe = torch.where(active, dot.abs(), torch.ones_like(dot))
    beta = torch.where(active, big_g * gate_score * (1 - gate_score) * 0.5 * torch.sqrt(c / safe), torch.zeros_like(dot))
    alpha_x = dot * rstd_x.square() / hidden
    alpha_k = dot * rstd_k.square() / hidden
    b = beta.unsqueeze(-1)
    grad_x = go + b * (k * wf - x * alpha_x.unsqueeze(-1))
    grad_k = b * (x * wf - k * alpha_k.unsqueeze(-1))
    grad_v = (go * gate_score.unsqueeze(-1)).sum(1)
    contrib = b * x * k
    if image_token_mask is not None:
        masked = image_token_mask.view(tokens, 1, 1)
        grad_x = torch.where(masked, go, grad_x)
        grad_k = torch.where(masked, torch.zeros_like(grad_k), grad_k)
        grad_v = torch.where(image_token_mask.view(tokens, 1), torch.zeros_like(grad_v), grad_v)
        contrib = torch.where(masked, torch.zeros_like(contrib), contrib)
    out_dtype = grad_out.dtype
    grad_kv = torch.cat([grad_k, grad_v.unsqueeze(1)], dim=1)
    if outputs is not None:
        partials = outputs[2].shape[0]
    partial = torch.stack([contrib[lo:hi].sum(0) for lo, hi in worker_ranges(tokens, partials)])
    if out_dtype == torch.bfloat16:
        # f32 of a bf16 value converts back exactly, so masked rows stay bit-equal to grad_out.
        grad_x = grad_x.to(out_dtype)
        grad_kv = grad_kv.to(out_dtype)
    return grad_x.contiguous(), grad_kv.contiguous(), partial.to(dot.dtype).contiguous()


def engram_grad_w_reduce_ref(grad_w_partial, weight_hidden, weight_embed, grad_weight_hidden, grad_weight_embed) -> None:
    """In place: ``gw = sum_p partial[p]`` (p ascending, fp32), then the two ``+=`` updates."""
    gw = torch.zeros_like(grad_w_partial[0]) if grad_w_partial.shape[0] == 0 else grad_w_partial[0].clone()
    for p in range(1, grad_w_partial.shape[0]):
        gw += grad_w_partial[p]
    grad_weight_hidden += gw * weight_embed.float()
    grad_weight_embed += gw * weight_hidden.float()


def gate_model(hidden_states, kv, weight_hidden, weight_embed, eps, clamp_value, image_token_mask=None):
    """The gate as a differentiable function of ``x, kv, wh, we`` (any float dtype, no rounding):
    ``out = x + sigmoid(signed_sqrt(<RMSNorm(x; wh), RMSNorm(k; we)> / sqrt(H))) * v``."""
    tokens, m, hidden = hidden_states.shape
    x, k, v = hidden_states, kv[:, :m], kv[:, m]
    xn = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight_hidden
    kn = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps) * weight_embed
    z = (xn * kn).sum(-1) / math.sqrt(hidden)
    gate = torch.sigmoid(_signed_sqrt(z, clamp_value))
    out = x + gate.unsqueeze(-1) * v.unsqueeze(1)
    if image_token_mask is not None:
        out = torch.where(image_token_mask.view(tokens, 1, 1), x, out)
    return out


def make_inputs(tokens: int, hidden: int, *, device="cpu", masked: bool = False, generator=None):
    """Random gate inputs as the tests draw them: randn bf16 ``x, kv, wh, we``; mask ``t % 4 < 2``."""
    m = HC_MULT

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

    x = randn(tokens, m, hidden)
    kv = randn(tokens, m + 1, hidden)
    wh = randn(m, hidden)
    we = randn(m, hidden)
    mask = (torch.arange(tokens, device=device) % 4 < 2) if masked else None
    return x, kv, wh, we, mask
