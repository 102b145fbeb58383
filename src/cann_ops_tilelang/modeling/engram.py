"""The Engram layer as an ``nn.Module`` (docs/ops/engram.md#layer): hashed n-gram memory lookup, key
and value projections, the Engram gate and a causal depthwise short convolution over the gated values.

The math follows DeepSeek's demo (``engram_demo_v1.py`` of deepseek-ai/Engram: ``Engram.forward``,
``ShortConv``, ``MultiHeadEmbedding`` and the ``TransformerBlock`` residual add); the gate runs as the custom op
without its residual (``engram_gate(..., residual=False)``), so ``g·v`` comes from one rounding and is never
recovered by a bf16 subtraction. Embedding, projections, norms and convolution are PyTorch.
"""

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import limits
from .._checks import OpError, check_float, check_int
from .engram_gate import EngramGate, check_gate_config, engram_gate

__all__ = ["Engram", "ngram_token_ids"]

_OP = "modeling.Engram"


class _CausalDepthwiseConv(torch.autograd.Function):
    """``y[n, t, c] = sum_k w[c, k] · x[n, t - (K-1-k)·d, c]`` for ``x (N, L, C)``, ``w (C, 1, K)``, zeros before
    the sequence start: the demo's causal depthwise ``Conv1d`` in the token-major layout of the layer (no
    channels-first copies), products summed in fp32 and rounded once to ``x``'s dtype.

    NOTE: the taps are shifted slices, which inductor fuses with the norm and the SiLU around them; ATen's
    depthwise convolution and its two transposes were 44 % of the compiled layer step (docs/perf/h200/engram.md).
    Only ``x`` (bf16) and ``w`` are saved; the fp32 sums are formed in place."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, dilation: int) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dilation = dilation
        w, length = weight.squeeze(1).float(), x.shape[1]
        taps = w.shape[1]
        padded = F.pad(x, (0, 0, (taps - 1) * dilation, 0))
        y = padded[:, :length] * w[:, 0]
        for k in range(1, taps):
            y.addcmul_(padded[:, k * dilation:k * dilation + length], w[:, k])
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        dilation = ctx.dilation
        w, length = weight.squeeze(1).float(), x.shape[1]
        taps = w.shape[1]
        last = (taps - 1) * dilation
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:  # first: its fp32 copy of grad is freed before grad_x's sums exist
            padded, grad32, sums = F.pad(x, (0, 0, last, 0)), grad.float(), []
            for k in range(taps):
                sums.append((grad32 * padded[:, k * dilation:k * dilation + length]).sum((0, 1)))
            padded = grad32 = None
            grad_w = torch.stack(sums, -1).unsqueeze(1).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            # x[t] feeds y[t + (K-1-k)·d] through tap k: the same sums over grad padded after the sequence end
            padded = F.pad(grad, (0, 0, 0, last))
            gx = padded[:, last:last + length] * w[:, 0]
            for k in range(1, taps):
                shift = last - k * dilation
                gx.addcmul_(padded[:, shift:shift + length], w[:, k])
            grad_x = gx.to(x.dtype)
        return grad_x, grad_w, None


def ngram_token_ids(token_ids: Tensor, max_ngram_size: int, pad_id: int) -> Tensor:
    """The n-gram windows of every token: ``(*, L)`` token ids -> ``(*, L, N)`` with column ``k`` the token
    ``k`` positions back in the same sequence (the last dim of ``token_ids``) and ``pad_id`` before its start
    (the demo's ``shift_k``). Same dtype as ``token_ids``; the columns ``engram_hash`` takes."""
    err = OpError("modeling.ngram_token_ids")
    if not isinstance(token_ids, Tensor) or token_ids.dtype not in (torch.int32, torch.int64):
        raise err.type("token_ids", f"expected an int32 or int64 torch.Tensor, got "
                                    f"{getattr(token_ids, 'dtype', type(token_ids).__name__)}")
    if token_ids.dim() < 1:
        raise err.value("token_ids", "expected shape (*, L), got a 0-d tensor")
    if check_int(err, "max_ngram_size", max_ngram_size) < 2:
        raise err.value("max_ngram_size", f"expected an int >= 2, got {max_ngram_size!r}")
    pad_id = check_int(err, "pad_id", pad_id)
    # traced: a SymInt's range is the schema's to check (Dynamo cannot trace the range test)
    if not torch.compiler.is_compiling():
        limits.ENGRAM_HASH_TOKEN_ID.check(err, "pad_id", pad_id)
    length = token_ids.shape[-1]
    padded = F.pad(token_ids, (max_ngram_size - 1, 0), value=pad_id)
    start = max_ngram_size - 1
    return torch.stack([padded[..., start - k : start - k + length] for k in range(max_ngram_size)], dim=-1)


class Engram(nn.Module):
    """One Engram layer over an ``m``-stream residual (docs/ops/engram.md#layer has the parameter table).

    Per token (leading dims ``*`` arbitrary, ``L`` the sequence axis of the convolution)::

        e   = concat_j table[hash_ids[..., j]]                      (*, L, (N-1)·n_embed_per_ngram)
        kv  = e @ W_kv^T + b_kv = [k_0 | ... | k_{m-1} | v]         (*, L, (m+1)·H)
        y   = g·v, g_h = σ(signed_sqrt(<RMSNorm(x_h; wh_h), RMSNorm(k_h; we_h)> / sqrt(H)))   (gate op, no residual)
        c   = SiLU(causal depthwise conv over L (kernel K, dilation N, no bias) of RMSNorm_h(y; wc_h))
        out = x + (y + c)

    Args:
        hidden_size: ``H`` (the gate's range: a multiple of 256 in [512, 8192]).
        table_sizes: rows of each of the ``(N-1)·n_head_per_ngram`` tables, n-gram order major.
        hc_mult: ``m`` (4); max_ngram_size: ``N`` (3), also the dilation; n_embed_per_ngram (512) split over
            n_head_per_ngram (8) tables per order; conv_kernel_size: ``K`` (4): the demo's ``EngramConfig``.
        clamp_value: the gate's signed-sqrt clamp (1e-6).
        gate_eps: the gate's RMSNorm epsilon; the demo's ``nn.RMSNorm(H)`` uses ``finfo(fp32).eps``, the default.
        conv_eps: the convolution's RMSNorm epsilon (1e-5, the demo's ``ShortConv``).
        device, dtype: of the parameters (bf16, the gate's dtype).

    Initialization is the demo's (PyTorch's defaults): ``embedding`` N(0, 1); ``kv_proj`` (rows ``h·H ..`` the key
    projection of stream ``h``, the last ``H`` the value projection) and ``conv`` (``(m·H, 1, K)``) uniform
    ±1/sqrt(fan_in); the norm weights ``gate.weight_hidden``, ``gate.weight_embed``, ``conv_norm_weight`` ones.
    The buffer ``offsets`` (int32) holds each table's first row. The gate's two weights accumulate into an fp32
    ``main_grad`` when they have one (eager, :func:`engram_gate`); the other parameters get ``.grad``.
    """

    def __init__(self, hidden_size: int, table_sizes: Sequence[int], hc_mult: int = 4, max_ngram_size: int = 3,
                 n_embed_per_ngram: int = 512, n_head_per_ngram: int = 8, conv_kernel_size: int = 4,
                 clamp_value: float = 1e-6, gate_eps: float = float(torch.finfo(torch.float32).eps),
                 conv_eps: float = 1e-5, device=None, dtype=torch.bfloat16):
        super().__init__()
        err = OpError(_OP)
        for arg, value, low in (("hidden_size", hidden_size, 1), ("hc_mult", hc_mult, 1),
                                ("max_ngram_size", max_ngram_size, 2), ("n_embed_per_ngram", n_embed_per_ngram, 1),
                                ("n_head_per_ngram", n_head_per_ngram, 1), ("conv_kernel_size", conv_kernel_size, 1)):
            if check_int(err, arg, value) < low:
                raise err.value(arg, f"expected an int >= {low}, got {value!r}")
        check_gate_config(err, hidden_size, hc_mult, clamp_value, gate_eps, dtype, eps_arg="gate_eps")
        check_float(err, "conv_eps", conv_eps, minimum=0.0)
        if n_embed_per_ngram % n_head_per_ngram:
            raise err.value("n_head_per_ngram", f"expected a divisor of n_embed_per_ngram {n_embed_per_ngram}, "
                                                f"got {n_head_per_ngram}")
        try:
            table_sizes = list(table_sizes)  # once: a generator is consumed by the checks
        except TypeError:
            raise err.type("table_sizes", f"expected a sequence of ints, got {type(table_sizes).__name__}") from None
        sizes = [check_int(err, "table_sizes", s) for s in table_sizes]
        cols = (max_ngram_size - 1) * n_head_per_ngram
        if len(sizes) != cols or min(sizes) < 1:
            raise err.value("table_sizes", f"expected {cols} positive sizes ((max_ngram_size - 1) * "
                                           f"n_head_per_ngram), got {len(sizes)}: {sizes[:8]}")
        if sum(sizes) >= 2**31:
            raise err.value("table_sizes", f"expected fewer than 2**31 rows in all (int32 rows), got {sum(sizes)}")
        self.hidden_size, self.hc_mult = hidden_size, hc_mult
        self.max_ngram_size, self.n_embed_per_ngram = max_ngram_size, n_embed_per_ngram
        self.n_head_per_ngram = n_head_per_ngram
        self.table_sizes = tuple(sizes)
        self.clamp_value, self.gate_eps, self.conv_eps = float(clamp_value), float(gate_eps), float(conv_eps)
        factory = dict(device=device, dtype=dtype)
        starts = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0).to(torch.int32)
        self.register_buffer("offsets", starts.to(device), persistent=False)
        self.embedding = nn.Embedding(sum(sizes), n_embed_per_ngram // n_head_per_ngram, **factory)
        memory = (max_ngram_size - 1) * n_embed_per_ngram
        self.kv_proj = nn.Linear(memory, (hc_mult + 1) * hidden_size, **factory)
        self.gate = EngramGate(hidden_size, hc_mult, clamp_value, gate_eps, **factory)
        self.conv_norm_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, **factory))
        channels = hc_mult * hidden_size
        # causal: padded by (k-1)·dilation on both sides and cut to the first L outputs, as the demo
        self.conv = nn.Conv1d(channels, channels, conv_kernel_size, groups=channels, bias=False,
                              padding=(conv_kernel_size - 1) * max_ngram_size, dilation=max_ngram_size, **factory)

    def _check(self, hidden_states: Tensor, hash_ids: Tensor) -> None:
        err = OpError(_OP)
        if not isinstance(hidden_states, Tensor):
            raise err.type("hidden_states", f"expected a torch.Tensor, got {type(hidden_states).__name__}")
        if not isinstance(hash_ids, Tensor):
            raise err.type("hash_ids", f"expected a torch.Tensor, got {type(hash_ids).__name__}")
        m, hidden = self.hc_mult, self.hidden_size
        if hidden_states.dim() < 3 or tuple(hidden_states.shape[-2:]) != (m, hidden):
            raise err.value("hidden_states", f"expected shape (*, L, {m}, {hidden}), got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != self.kv_proj.weight.dtype:
            raise err.type("hidden_states", f"expected {self.kv_proj.weight.dtype} (the parameters' dtype), got "
                                            f"{hidden_states.dtype}")
        if hash_ids.dtype not in (torch.int32, torch.int64):
            raise err.type("hash_ids", f"expected int32 or int64, got {hash_ids.dtype}")
        cols = len(self.table_sizes)
        lead = tuple(hidden_states.shape[:-2])
        if tuple(hash_ids.shape) != lead + (cols,):
            raise err.value("hash_ids", f"expected shape {lead + (cols,)} (the leading dims of hidden_states, then "
                                        f"(max_ngram_size - 1) * n_head_per_ngram), got {tuple(hash_ids.shape)}")
        if hash_ids.device != hidden_states.device:
            raise err.value("hash_ids", f"expected a tensor on {hidden_states.device} (hidden_states'), got "
                                        f"{hash_ids.device}")
        if hidden_states.device != self.kv_proj.weight.device:
            raise err.value("hidden_states", f"expected a tensor on {self.kv_proj.weight.device} (the layer's "
                                             f"parameters'), got {hidden_states.device}")

    def gated_value(self, hidden_states: Tensor, hash_ids: Tensor) -> Tensor:
        """``g·v`` ``(*, L, m, H)`` (the lookup, the projections and the gate without its residual)."""
        memory = self.embedding(hash_ids).flatten(-2)
        kv = self.kv_proj(memory)
        return engram_gate(hidden_states, kv, self.gate.weight_hidden, self.gate.weight_embed, self.clamp_value,
                           self.gate_eps, None, residual=False)

    def short_conv(self, value: Tensor) -> Tensor:
        """``SiLU(causal depthwise conv(RMSNorm_h(value)))`` over the sequence axis of ``value (*, L, m, H)``."""
        lead, length = value.shape[:-3], value.shape[-3]
        normed = F.rms_norm(value, (self.hidden_size,), eps=self.conv_eps) * self.conv_norm_weight
        # the sequences counted, not -1 (ambiguous where L = 0)
        tokens = normed.reshape(math.prod(lead), length, self.hc_mult * self.hidden_size)
        mixed = F.silu(_CausalDepthwiseConv.apply(tokens, self.conv.weight, self.conv.dilation[0]))
        return mixed.reshape(*lead, length, self.hc_mult, self.hidden_size)

    def forward(self, hidden_states: Tensor, hash_ids: Tensor) -> Tensor:
        """The layer with its residual.

        Args:
            hidden_states: ``(*, L, m, H)`` in the parameters' dtype (bf16); ``L`` is the sequence axis the
                convolution runs along (causal, per sequence; ``*`` may be empty).
            hash_ids: ``(*, L, (N-1)·n_head_per_ngram)`` int32 or int64: rows of the layer's table, i.e. the
                hash of table ``j`` plus ``offsets[j]`` (what ``engram_hash`` returns for this layer given these
                offsets, see :meth:`hash_ids`). Rows are not range-checked here (the lookup is).

        Returns:
            ``(*, L, m, H)``: ``hidden_states + (g·v + short_conv(g·v))``.
        """
        self._check(hidden_states, hash_ids)
        value = self.gated_value(hidden_states, hash_ids)
        return hidden_states + (value + self.short_conv(value))

    def hash_ids(self, token_ids: Tensor, multipliers: Tensor, pad_id: int) -> Tensor:
        """This layer's ``hash_ids`` from (compressed) token ids through the ``engram_hash`` op.

        Args:
            token_ids: ``(*, L)`` int32 token ids after the demo's tokenizer compression.
            multipliers: ``(N,)`` int64, this layer's hash multipliers (odd, per n-gram position).
            pad_id: the id that fills the n-gram positions before a sequence's start.

        Returns:
            ``(*, L, (N-1)·n_head_per_ngram)`` int32 rows of this layer's table.
        """
        from .. import engram as _family

        hash_op = getattr(_family, "engram_hash", None)
        if hash_op is None:
            from ..engram.hash import engram_hash as hash_op
        err = OpError(_OP)
        if not isinstance(multipliers, Tensor):
            raise err.type("multipliers", f"expected a torch.Tensor, got {type(multipliers).__name__}")
        if tuple(multipliers.shape) != (self.max_ngram_size,):
            raise err.value("multipliers", f"expected a ({self.max_ngram_size},) int64 tensor, got "
                                           f"{tuple(getattr(multipliers, 'shape', ()))}")
        if multipliers.dtype != torch.int64:
            raise err.type("multipliers", f"expected int64, got {multipliers.dtype}")
        windows = ngram_token_ids(token_ids, self.max_ngram_size, pad_id)  # checks token_ids and pad_id
        if multipliers.device != token_ids.device:
            raise err.value("multipliers", f"expected a tensor on {token_ids.device} (token_ids'), got "
                                           f"{multipliers.device}")
        lead = windows.shape[:-1]
        sizes = torch.tensor(self.table_sizes, dtype=torch.int32, device=token_ids.device)
        rows = hash_op(windows.reshape(-1, self.max_ngram_size).to(torch.int32).contiguous(),
                       multipliers.reshape(1, -1).contiguous(),
                       sizes.view(1, self.max_ngram_size - 1, self.n_head_per_ngram),
                       self.offsets.to(token_ids.device).view(1, -1).contiguous())
        return rows[0].view(*lead, len(self.table_sizes))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, hc_mult={self.hc_mult}, max_ngram_size={self.max_ngram_size}, "
                f"n_embed_per_ngram={self.n_embed_per_ngram}, n_head_per_ngram={self.n_head_per_ngram}, "
                f"tables={len(self.table_sizes)}, clamp_value={self.clamp_value}, gate_eps={self.gate_eps}, "
                f"conv_eps={self.conv_eps}")
