"""A small DeepSeek-style language model made of cann_ops_tilelang's modules, trained for a few steps.

    python examples/small_deepseek.py                      # on the GPU (or an NPU with torch_npu); prints the loss
    python examples/small_deepseek.py --steps 50 --layers 6
    python examples/small_deepseek.py --device meta        # any machine: shapes only, no values
    python examples/small_deepseek.py --device cpu --cpu-references --steps 8 --seq 32
                                                           # a checkout's test references as CPU kernels (slow)

The model (``ids (B, L) -> logits (B, L, vocab)``)::

    embedding (B, L, H) -> expand_from_embedding -> residual (B, L, m, H), m = 4 streams
    block i = 0 .. layers-1:
        Engram(residual, hash_ids)                       only in block --engram-layer (hash ids from the token ids)
        MHCSublayer(Attention)(residual, positions, mask=causal)    extra arguments go to the attention
        MHCSublayer(FFN)(residual)
    MHCHead -> RMSNorm -> LM head

The sublayers of the blocks after the Engram block form one checkpointed chunk (``--no-checkpoint`` turns it
off): its forward keeps each sublayer's pre mix, post and combination mixes and output, not its residual; the
backward regenerates the residuals in one ``mhc_recompute_chunk`` pass (bitwise the forward's) and replays each
sublayer with gradients. The attention is plain multi-head attention with rotary positions and the FFN a
SwiGLU (DeepSeek's MLA and MoE are out of scope). The Engram embedding tables are trained by
``optim.EngramSinkhorn``, every other parameter by AdamW. The data: sequences of ``next = (5 * token + 3) % vocab``
from a random first token, a next-token map the model can learn in a few steps.

On a GPU the first run also compiles the kernels it uses (TileLang's JIT, cached on disk: later runs start
in seconds).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cann_ops_tilelang.modeling import Engram, MHCHead, MHCSublayer, expand_from_embedding, mhc_post, mhc_pre, \
    mhc_recompute_chunk
from cann_ops_tilelang.optim import EngramSinkhorn

BF16 = torch.bfloat16
# (max_ngram_size - 1) * n_head_per_ngram = 2 * 4 tables of the Engram layer (distinct primes), 64 columns each
TABLE_SIZES = (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x (B, L, heads, d)`` at ``positions`` ``(L,)`` or ``(B, L)``, in fp32."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.to(torch.float32)[..., None] * inv_freq  # (.., L, half)
    cos, sin = angle.cos()[..., None, :], angle.sin()[..., None, :]  # (.., L, 1, half): broadcast over heads
    a, b = x.float().chunk(2, -1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)


class Attention(nn.Module):
    """Pre-norm multi-head self-attention with rotary positions: ``forward(x (B, L, H), positions, mask=None)``;
    ``mask (L, L)`` bool, True where a query may attend (``scaled_dot_product_attention``'s convention)."""

    def __init__(self, hidden: int, heads: int, device=None):
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(hidden, device=device, dtype=BF16)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, device=device, dtype=BF16)
        self.out = nn.Linear(hidden, hidden, bias=False, device=device, dtype=BF16)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, hidden // self.heads).unbind(2)
        q, k = rope(q, positions), rope(k, positions)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, hidden))


class FFN(nn.Module):
    """Pre-norm SwiGLU feed-forward: ``(B, L, H) -> (B, L, H)``."""

    def __init__(self, hidden: int, inner: int, device=None):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, device=device, dtype=BF16)
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False, device=device, dtype=BF16)
        self.down = nn.Linear(inner, hidden, bias=False, device=device, dtype=BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, -1)
        return self.down(F.silu(gate) * up)


def _pre_with_mix(block: MHCSublayer, residual: torch.Tensor):
    """``block``'s pre stage with its own hyper-parameters (as its forward runs it), also returning the pre mix
    that ``mhc_recompute_chunk`` needs."""
    return mhc_pre(residual, block.fn, block.scale, block.base, norm_weight=block.norm_weight, norm_eps=block.eps,
                   post_mult_value=block.post_mult_value, pre_eps=block.eps, sinkhorn_eps=block.eps,
                   sinkhorn_repeat=block.sinkhorn_repeat, n_splits=block.n_splits, return_pre_mix=True)


class _RecomputedChunk(torch.autograd.Function):
    """Consecutive ``MHCSublayer`` calls ``(block, args, kwargs)`` run without keeping their residuals.

    Forward (no autograd graph): per sublayer ``mhc_pre(..., return_pre_mix=True)``, the sublayer, ``mhc_post``;
    kept: the chunk's input residual and per sublayer its pre mix ``(*, m)`` fp32, post and combination mixes and
    output ``(*, H)`` bf16 (the residuals ``(*, m, H)`` between the sublayers are not kept). Backward:
    ``mhc_recompute_chunk`` regenerates the residual entering every sublayer (bitwise the forward's), then each
    sublayer, last first, runs again with gradients from its residual (``block(residual, *args, **kwargs)``) and
    is differentiated. ``params``: every block's parameters, in order (their gradients are this node's)."""

    @staticmethod
    def forward(ctx, residual, calls, *params):
        first = residual
        pres, outputs, posts, combs = [], [], [], []
        for block, args, kwargs in calls:
            layer_input, (post, comb), pre = _pre_with_mix(block, residual)
            output = block.sublayer(layer_input, *args, **kwargs)
            residual = mhc_post(output, residual, post, comb)
            pres.append(pre), outputs.append(output), posts.append(post), combs.append(comb)
        ctx.calls = calls
        ctx.save_for_backward(first, *pres, *outputs, *posts, *combs)
        return residual

    @staticmethod
    def backward(ctx, grad):
        first, *saved = ctx.saved_tensors
        n = len(ctx.calls)
        pres, outputs, posts, combs = (saved[i * n:(i + 1) * n] for i in range(4))
        # L - 1 posts: the last sublayer's output residual is not needed, its replay recomputes it
        _layer_inputs, residuals = mhc_recompute_chunk(first, pres, outputs[:-1], posts[:-1], combs[:-1])
        entering = [first, *residuals]
        param_grads = []
        for (block, args, kwargs), residual in zip(reversed(ctx.calls), reversed(entering)):
            params = list(block.parameters())
            wanted = [p for p in params if p.requires_grad]
            with torch.enable_grad():
                residual = residual.detach().requires_grad_()
                out = block(residual, *args, **kwargs)
            grad, *got = torch.autograd.grad(out, [residual, *wanted], grad, allow_unused=True)
            got = iter(got)
            param_grads = [next(got) if p.requires_grad else None for p in params] + param_grads
        return (grad, None, *param_grads)


def recomputed_chunk(residual: torch.Tensor, calls: list) -> torch.Tensor:
    """``calls``: ``[(MHCSublayer, args, kwargs), ...]`` applied in order to ``residual (*, m, H)``, as
    ``block(residual, *args, **kwargs)`` would, with the activation recomputation of :class:`_RecomputedChunk`."""
    params = [p for block, _, _ in calls for p in block.parameters()]
    return _RecomputedChunk.apply(residual, calls, *params)


class SmallDeepSeek(nn.Module):
    """``forward(ids (B, L) int64) -> logits (B, L, vocab) fp32`` (the module docstring has the layout)."""

    def __init__(self, vocab: int = 512, hidden: int = 512, heads: int = 8, layers: int = 4, engram_layer: int = 1,
                 checkpoint: bool = True, device=None):
        super().__init__()
        if not 0 <= engram_layer < layers:
            raise ValueError(f"engram_layer must be in [0, {layers}), got {engram_layer}")
        self.layers, self.engram_layer, self.checkpoint = layers, engram_layer, checkpoint
        self.embed = nn.Embedding(vocab, hidden, device=device, dtype=BF16)
        self.attn = nn.ModuleList(MHCSublayer(hidden, Attention(hidden, heads, device), device=device)
                                  for _ in range(layers))
        self.ffn = nn.ModuleList(MHCSublayer(hidden, FFN(hidden, 2 * hidden, device), device=device)
                                 for _ in range(layers))
        # the Engram layer over the m = 4 streams: 2-grams and 3-grams, 4 hashed tables of 64 columns each
        self.engram = Engram(hidden, TABLE_SIZES, max_ngram_size=3, n_embed_per_ngram=256, n_head_per_ngram=4,
                             device=device)
        multipliers = torch.randint(0, 2**30, (3,), generator=torch.Generator().manual_seed(7)) * 2 + 1  # odd
        self.register_buffer("multipliers", multipliers.to(device), persistent=False)
        self.pad_id = vocab  # fills the n-gram windows before a sequence's start (no token has it)
        self.head = MHCHead(hidden, device=device)
        self.norm = nn.RMSNorm(hidden, device=device, dtype=BF16)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, device=device, dtype=BF16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[-1]
        positions = torch.arange(length, device=ids.device)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        hash_ids = self.engram.hash_ids(ids, self.multipliers, self.pad_id)  # (B, L, 8) rows of the Engram table
        residual = expand_from_embedding(self.embed(ids))  # (B, L, 4, H)
        plain = self.engram_layer + 1 if self.checkpoint else self.layers
        for i in range(plain):
            if i == self.engram_layer:
                residual = self.engram(residual, hash_ids)
            residual = self.attn[i](residual, positions, mask=causal)
            residual = self.ffn[i](residual)
        if plain < self.layers:
            calls = []
            for i in range(plain, self.layers):
                calls += [(self.attn[i], (positions,), {"mask": causal}), (self.ffn[i], (), {})]
            residual = recomputed_chunk(residual, calls)
        return self.lm_head(self.norm(self.head(residual))).float()


def synthetic_batch(batch: int, length: int, vocab: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, targets)`` ``(batch, length)`` int64: runs of ``next = (5 * token + 3) % vocab``."""
    token = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(seed))
    run = [token]
    for _ in range(length):
        run.append((5 * run[-1] + 3) % vocab)
    run = torch.stack(run, 1)
    return run[:, :-1].to(device), run[:, 1:].to(device)


def optimizers(model: SmallDeepSeek, lr: float, table_lr: float) -> list[torch.optim.Optimizer]:
    """EngramSinkhorn for the Engram embedding tables, AdamW for every other parameter."""
    tables = [model.engram.embedding.weight]
    rest = [p for p in model.parameters() if all(p is not t for t in tables)]
    return [EngramSinkhorn(tables, lr=table_lr), torch.optim.AdamW(rest, lr=lr)]


def train(model: SmallDeepSeek, steps: int, batch: int, length: int, device, lr: float = 2e-3,
          table_lr: float = 1e-2, log=print) -> list:
    """``steps`` training steps on fresh synthetic batches; returns the losses (None each on the meta device)."""
    opts = optimizers(model, lr, table_lr)
    vocab = model.lm_head.out_features
    losses = []
    for step in range(steps):
        ids, targets = synthetic_batch(batch, length, vocab, step, device)
        start = time.perf_counter()
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in opts:
            opt.step()
        if loss.device.type == "meta":
            losses.append(None)
            log(f"step {step + 1}: logits {tuple(logits.shape)} {logits.dtype}, loss {tuple(loss.shape)} on meta "
                f"(shapes only)")
        else:
            losses.append(loss.item())  # waits for the step
            log(f"step {step + 1}: loss {losses[-1]:.4f} ({(time.perf_counter() - start) * 1e3:.0f} ms)")
    return losses


def _default_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    from cann_ops_tilelang import config

    return "npu" if config.npu_available() else None


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Trains a small DeepSeek-style model (mHC, Engram, attention) for "
                                                 "a few steps and prints the loss.")
    parser.add_argument("--device", default=None,
                        help="cuda (the default where available), npu, meta (shapes only) or cpu (needs "
                             "--cpu-references)")
    parser.add_argument("--cpu-references", action="store_true",
                        help="register the test references (tests/_plugins/references.py of a checkout) as the "
                             "ops' CPU kernels")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--engram-layer", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate")
    parser.add_argument("--table-lr", type=float, default=1e-2, help="EngramSinkhorn's learning rate")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="keep every activation (no recomputed chunk)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.cpu_references else _default_device()
    if args.device is None:
        parser.error("no GPU or NPU found: pass --device meta for a shape-only run, or --device cpu "
                     "--cpu-references in a checkout (README.md, section 'Without a GPU')")
    if args.device == "cpu" and not args.cpu_references:
        parser.error("--device cpu needs --cpu-references (the ops have no CPU kernels of their own)")
    return args


def _register_references() -> None:
    tests = Path(__file__).resolve().parent.parent / "tests"
    if not (tests / "_plugins" / "references.py").exists():
        sys.exit(f"--cpu-references: {tests / '_plugins' / 'references.py'} not found (it comes with a checkout)")
    sys.path.insert(0, str(tests))
    from _plugins import references

    references.register()


def main(argv=None) -> list:
    args = parse(argv)
    if args.cpu_references:
        _register_references()
    torch.manual_seed(args.seed)
    model = SmallDeepSeek(args.vocab, args.hidden, args.heads, args.layers, args.engram_layer,
                          checkpoint=not args.no_checkpoint, device=args.device)
    first = args.engram_layer + 1
    chunk = f"blocks {first}..{args.layers - 1}" if not args.no_checkpoint and first < args.layers else "none"
    print(f"SmallDeepSeek on {args.device}: {args.layers} blocks, H={args.hidden}, Engram in block "
          f"{args.engram_layer}, checkpointed: {chunk}; {args.steps} steps of {args.batch} x {args.seq} tokens")
    losses = train(model, args.steps, args.batch, args.seq, args.device, args.lr, args.table_lr)
    if losses and losses[0] is not None:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
