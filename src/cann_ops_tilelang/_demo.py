"""A small language model built from the package's modules, for the main command and the tests: an embedding,
attention-free sublayers (RMSNorm + SwiGLU FFNs) wrapped in mHC, one Engram gate, the mHC head and an LM head,
trained on a synthetic next-token task whose loss can go down. ``norms="torch"`` builds the same model with
``torch.nn.RMSNorm`` and a PyTorch SwiGLU (the comparison of docs/perf/norm_training.md)."""

import time

import torch
from torch import nn

from .modeling import EngramGate, MHCHead, MHCSublayer, RMSNorm, SwiGLU, expand_from_embedding

__all__ = ["SmallModel", "synthetic_batch", "train"]


class _TorchSwiGLU(nn.Module):
    def forward(self, x):
        gate, up = x.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _norm_and_act(norms: str):
    """The RMSNorm class and the SwiGLU module of ``norms``: ``"ours"`` (the norm family's) or ``"torch"``."""
    if norms not in ("ours", "torch"):
        raise ValueError(f"SmallModel: norms must be 'ours' or 'torch', got {norms!r}")
    return (RMSNorm, SwiGLU()) if norms == "ours" else (nn.RMSNorm, _TorchSwiGLU())


class _FFN(nn.Module):
    def __init__(self, hidden: int, device=None, norms: str = "ours"):
        super().__init__()
        norm, self.act = _norm_and_act(norms)
        self.norm = norm(hidden, device=device, dtype=torch.bfloat16)
        self.up = nn.Linear(hidden, 2 * hidden, device=device, dtype=torch.bfloat16)  # [gate | up]
        self.down = nn.Linear(hidden, hidden, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        return self.down(self.act(self.up(self.norm(x))))


class SmallModel(nn.Module):
    """``ids (T,) int64 -> logits (T, vocab) fp32``: embedding, ``layers`` mHC-wrapped FFNs with an Engram gate
    after the first (its keys and value projected from the token's embedding, a stand-in for the Engram
    tables), the mHC head, RMSNorm and the LM head."""

    def __init__(self, vocab: int = 256, hidden: int = 512, layers: int = 3, device=None, norms: str = "ours"):
        super().__init__()
        norm, _ = _norm_and_act(norms)
        self.embed = nn.Embedding(vocab, hidden, device=device, dtype=torch.bfloat16)
        self.blocks = nn.ModuleList(MHCSublayer(hidden, _FFN(hidden, device, norms), device=device)
                                    for _ in range(layers))
        self.kv = nn.Linear(hidden, 5 * hidden, device=device, dtype=torch.bfloat16)
        self.gate = EngramGate(hidden, device=device)
        self.head = MHCHead(hidden, device=device)
        self.norm = norm(hidden, device=device, dtype=torch.bfloat16)
        self.lm_head = nn.Linear(hidden, vocab, device=device, dtype=torch.bfloat16)

    def forward(self, ids):
        e = self.embed(ids)
        residual = expand_from_embedding(e)
        for i, block in enumerate(self.blocks):
            residual = block(residual)
            if i == 0:
                residual = self.gate(residual, self.kv(e))
        return self.lm_head(self.norm(self.head(residual))).float()


def synthetic_batch(tokens: int, vocab: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of an affine recurrence ``next = (5 * id + 3) % vocab`` (a learnable next-token map)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    return ids.to(device), ((5 * ids + 3) % vocab).to(device)


def train(model: nn.Module, steps: int, tokens: int, device, *, compiled: bool = False, lr: float = 3e-3,
          seed: int = 0, synchronize=lambda: None) -> tuple[list[float], list[float]]:
    """``steps`` AdamW steps on fresh synthetic batches; returns the losses and the step times (ms)."""
    forward = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    vocab = model.lm_head.out_features
    losses, times = [], []
    for step in range(steps):
        ids, target = synthetic_batch(tokens, vocab, seed + step, device)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(forward(ids), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    return losses, times
