"""The Engram layer as an ``nn.Module`` (docs/ops/engram.md#layer): hashed n-gram memory lookup, key
and value projections, the Engram gate and a causal depthwise short convolution over the gated values.

The math follows DeepSeek's demo (``engram_demo_v1.py`` of deepseek-ai/Engram: ``Engram.forward``,
``ShortConv``, ``MultiHeadEmbedding`` and the ``TransformerBlock`` residual add); the gate runs as the custom op
without its residual (``engram_gate(..., residual=False)``), so ``g·v`` comes from one rounding and is never
recovered by a bf16 subtraction. Embedding, projections, norms and convolution are PyTorch.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import limits
from .._checks import OpError, check_float, check_int, describe
from ._buffers import check_device
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
    (the demo's ``shift_k``). Same dtype as ``token_ids``; the columns ``engram_hash`` takes.

    Args:
        token_ids: ``(*, L)`` int32 or int64 tensor.
        max_ngram_size: ``N``, an int >= 2 (numpy integers too).
        pad_id: an int in int32's range (numpy integers too).
    """
    return _ngram_windows(OpError("modeling.ngram_token_ids"), token_ids, max_ngram_size, pad_id)


def _ngram_windows(err: OpError, token_ids: Tensor, max_ngram_size: int, pad_id: int) -> Tensor:
    """:func:`ngram_token_ids` with its errors built by ``err`` (the caller's name: ``Engram.hash_ids`` names
    itself)."""
    if not isinstance(token_ids, Tensor) or token_ids.dtype not in (torch.int32, torch.int64):
        raise err.type("token_ids", f"expected an int32 or int64 torch.Tensor, got "
                                    f"{token_ids.dtype if isinstance(token_ids, Tensor) else describe(token_ids)}")
    if token_ids.dim() < 1:
        raise err.value("token_ids", "expected shape (*, L), got a 0-d tensor")
    max_ngram_size = check_int(err, "max_ngram_size", max_ngram_size)
    if max_ngram_size < 2:
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
    The buffers ``offsets`` and ``sizes`` (int32, not in the ``state_dict``) hold each table's first row and its
    number of rows. The gate's two weights accumulate into an fp32 ``main_grad`` when they have one (eager,
    :func:`engram_gate`); the other parameters get ``.grad``.
    """

    def __init__(self, hidden_size: int, table_sizes: Sequence[int], hc_mult: int = 4, max_ngram_size: int = 3,
                 n_embed_per_ngram: int = 512, n_head_per_ngram: int = 8, conv_kernel_size: int = 4,
                 clamp_value: float = 1e-6, gate_eps: float = float(torch.finfo(torch.float32).eps),
                 conv_eps: float = 1e-5, device=None, dtype=torch.bfloat16):
        super().__init__()
        err = OpError(_OP)
        ints = {}  # numpy integers become Python ints here, as the ops take them
        for arg, value, low in (("hidden_size", hidden_size, 1), ("hc_mult", hc_mult, 1),
                                ("max_ngram_size", max_ngram_size, 2), ("n_embed_per_ngram", n_embed_per_ngram, 1),
                                ("n_head_per_ngram", n_head_per_ngram, 1), ("conv_kernel_size", conv_kernel_size, 1)):
            ints[arg] = check_int(err, arg, value)
            if ints[arg] < low:
                raise err.value(arg, f"expected an int >= {low}, got {value!r}")
        hidden_size, hc_mult, max_ngram_size, n_embed_per_ngram, n_head_per_ngram, conv_kernel_size = ints.values()
        hidden_size, hc_mult, clamp_value, gate_eps = check_gate_config(err, hidden_size, hc_mult, clamp_value,
                                                                        gate_eps, dtype, eps_arg="gate_eps")
        conv_eps = check_float(err, "conv_eps", conv_eps, minimum=0.0)
        if n_embed_per_ngram % n_head_per_ngram:
            raise err.value("n_head_per_ngram", f"expected a divisor of n_embed_per_ngram {n_embed_per_ngram}, "
                                                f"got {n_head_per_ngram}")
        device = check_device(err, device)
        sizes = self._table_sizes(err, table_sizes)
        cols = (max_ngram_size - 1) * n_head_per_ngram
        if len(sizes) != cols or min(sizes) < 1:  # min of [] is never reached: cols >= 1
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
        # the sizes engram_hash takes, made here and not in hash_ids: a tensor made in a traced call is a real one
        # among fake ones (torch.compile on meta fails); not persistent, so checkpoints keep their keys
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.int32, device=device), persistent=False)
        self.embedding = nn.Embedding(sum(sizes), n_embed_per_ngram // n_head_per_ngram, **factory)
        memory = (max_ngram_size - 1) * n_embed_per_ngram
        self.kv_proj = nn.Linear(memory, (hc_mult + 1) * hidden_size, **factory)
        self.gate = EngramGate(hidden_size, hc_mult, clamp_value, gate_eps, **factory)
        self.conv_norm_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, **factory))
        channels = hc_mult * hidden_size
        # causal: padded by (k-1)·dilation on both sides and cut to the first L outputs, as the demo
        self.conv = nn.Conv1d(channels, channels, conv_kernel_size, groups=channels, bias=False,
                              padding=(conv_kernel_size - 1) * max_ngram_size, dilation=max_ngram_size, **factory)

    @staticmethod
    def _table_sizes(err: OpError, table_sizes: object) -> list[int]:
        """``table_sizes`` as a list of Python ints: a sequence or an iterable of ints (numpy integers, a numpy
        array, a generator: read once) or a 1-D integer tensor; a str or a mapping is no sequence of sizes (it
        would iterate characters or keys)."""
        if isinstance(table_sizes, (str, bytes, Mapping)):
            raise err.type("table_sizes", f"expected a sequence of ints, got {describe(table_sizes)}")
        if isinstance(table_sizes, Tensor):
            if table_sizes.dim() != 1 or table_sizes.dtype.is_floating_point or table_sizes.dtype.is_complex \
                    or table_sizes.dtype == torch.bool:
                raise err.type("table_sizes", f"expected a sequence of ints or a 1-D integer tensor, got a "
                                              f"{table_sizes.dim()}-D {table_sizes.dtype} tensor")
            return table_sizes.tolist()
        try:
            table_sizes = list(table_sizes)  # once: a generator is consumed by the checks
        except TypeError:
            raise err.type("table_sizes", f"expected a sequence of ints, got {describe(table_sizes)}") from None
        return [check_int(err, "table_sizes", s) for s in table_sizes]

    def _check(self, hidden_states: Tensor, hash_ids: Tensor) -> None:
        err = OpError(_OP)
        self._check_value("hidden_states", hidden_states)
        if not isinstance(hash_ids, Tensor):
            raise err.type("hash_ids", f"expected a torch.Tensor, got {describe(hash_ids)}")
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

    def gated_value(self, hidden_states: Tensor, hash_ids: Tensor) -> Tensor:
        """``g·v`` ``(*, L, m, H)`` (the lookup, the projections and the gate without its residual); the arguments
        as :meth:`forward`'s."""
        self._check(hidden_states, hash_ids)
        return self._gated_value(hidden_states, hash_ids)

    def _gated_value(self, hidden_states: Tensor, hash_ids: Tensor) -> Tensor:
        memory = self.embedding(hash_ids).flatten(-2)
        kv = self.kv_proj(memory)
        return engram_gate(hidden_states, kv, self.gate.weight_hidden, self.gate.weight_embed, self.clamp_value,
                           self.gate_eps, None, residual=False)

    def short_conv(self, value: Tensor) -> Tensor:
        """``SiLU(causal depthwise conv(RMSNorm_h(value)))`` over the sequence axis of ``value (*, L, m, H)`` (in the
        parameters' dtype and on their device)."""
        self._check_value("value", value)
        return self._short_conv(value)

    def _check_value(self, arg: str, value: object) -> None:
        err, m, hidden = OpError(_OP), self.hc_mult, self.hidden_size
        if not isinstance(value, Tensor):
            raise err.type(arg, f"expected a torch.Tensor, got {describe(value)}")
        if value.dim() < 3 or tuple(value.shape[-2:]) != (m, hidden):
            raise err.value(arg, f"expected shape (*, L, {m}, {hidden}) (L tokens of the module's hc_mult = {m} "
                                 f"streams of its hidden size {hidden}), got {tuple(value.shape)}")
        if value.dtype != self.kv_proj.weight.dtype:
            raise err.type(arg, f"expected {self.kv_proj.weight.dtype} (the parameters' dtype), got {value.dtype}")
        if value.device != self.kv_proj.weight.device:
            raise err.value(arg, f"expected a tensor on {self.kv_proj.weight.device} (the layer's parameters'), got "
                                 f"{value.device}")

    def _short_conv(self, value: Tensor) -> Tensor:
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
        value = self._gated_value(hidden_states, hash_ids)
        return hidden_states + (value + self._short_conv(value))

    def hash_ids(self, token_ids: Tensor, multipliers: Tensor, pad_id: int) -> Tensor:
        """This layer's ``hash_ids`` from (compressed) token ids through the ``engram_hash`` op.

        Args:
            token_ids: ``(*, L)`` int32 token ids after the demo's tokenizer compression (int64 ids are cast;
                they must fit in int32, not checked: that would read them).
            multipliers: ``(N,)`` int64, this layer's hash multipliers (odd, per n-gram position).
            pad_id: the int (numpy integers too) that fills the n-gram positions before a sequence's start.

        Errors name ``modeling.Engram`` and the argument (``token_ids``, ``multipliers``, ``pad_id``; the op's
        limits as ``max_ngram_size``, ``table_sizes`` or ``token_ids``).

        Returns:
            ``(*, L, (N-1)·n_head_per_ngram)`` int32 rows of this layer's table.
        """
        from .. import engram as _family

        hash_op = getattr(_family, "engram_hash", None)
        if hash_op is None:
            from ..engram.hash import engram_hash as hash_op
        err = OpError(_OP)
        if not isinstance(multipliers, Tensor):
            raise err.type("multipliers", f"expected a torch.Tensor, got {describe(multipliers)}")
        if tuple(multipliers.shape) != (self.max_ngram_size,):
            raise err.value("multipliers", f"expected a ({self.max_ngram_size},) int64 tensor (one per n-gram "
                                           f"position, max_ngram_size), got shape {tuple(multipliers.shape)}")
        if multipliers.dtype != torch.int64:
            raise err.type("multipliers", f"expected int64, got {multipliers.dtype}")
        # the windows checked under this method's name (token_ids, pad_id), not ngram_token_ids'
        windows = _ngram_windows(err, token_ids, self.max_ngram_size, pad_id)
        if multipliers.device != token_ids.device:
            raise err.value("multipliers", f"expected a tensor on {token_ids.device} (token_ids'), got "
                                           f"{multipliers.device}")
        lead, cols = windows.shape[:-1], len(self.table_sizes)
        if not torch.compiler.is_compiling():  # traced: the op checks them (Dynamo cannot trace the ranges)
            # the op's limits under the names the caller gave (the op would name its internal tensors)
            device = token_ids.device.type
            limits.ENGRAM_HASH_NGRAM.of(device).check(err, "max_ngram_size", self.max_ngram_size)
            limits.ENGRAM_HASH_COLUMNS.of(device).check(err, "table_sizes", cols)
            tokens = math.prod(lead)
            if tokens * cols not in limits.ENGRAM_HASH_ELEMENTS:
                raise err.value("token_ids", f"expected fewer than 2**31 rows in all ({tokens} tokens of shape "
                                             f"{tuple(token_ids.shape)} times {cols} tables), got {tokens * cols}")
        rows = hash_op(windows.reshape(-1, self.max_ngram_size).to(torch.int32).contiguous(),
                       multipliers.reshape(1, -1).contiguous(),
                       self.sizes.to(token_ids.device).view(1, self.max_ngram_size - 1, self.n_head_per_ngram),
                       self.offsets.to(token_ids.device).view(1, -1).contiguous())
        return rows[0].view(*lead, cols)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, hc_mult={self.hc_mult}, max_ngram_size={self.max_ngram_size}, "
                f"n_embed_per_ngram={self.n_embed_per_ngram}, n_head_per_ngram={self.n_head_per_ngram}, "
                f"tables={len(self.table_sizes)}, clamp_value={self.clamp_value}, gate_eps={self.gate_eps}, "
                f"conv_eps={self.conv_eps}")
