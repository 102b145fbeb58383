"""What the quant family's test files share: the layouts of a kind, output metadata and bitwise comparison."""

import torch
from quant_cases import sample

from cann_ops_tilelang.quant import BLOCKS, ScaleLayout

__all__ = ["assert_compiles_once", "assert_same", "layouts", "metadata", "same"]

# the (sf, round_sf) pairs the layout rules allow (UE8M0 needs rounding, e4m3 scales refuse it)
SCALE_KINDS = (("fp32", False), ("fp32", True), ("e4m3", False), ("ue8m0", True))


def layouts(*kinds: str) -> list[str]:
    """The spec of every valid layout of ``kinds`` (every kind when none): block x format x scale kind x storage,
    in that order; the type's rules leave per-channel blocks e4m3 and row-major."""
    out = []
    for kind in kinds or tuple(BLOCKS):
        for block in BLOCKS[kind]:
            for fmt in ("e4m3", "e2m1"):
                for sf, round_sf in SCALE_KINDS:
                    for storage in ("row", "col_tma"):
                        try:
                            out.append(ScaleLayout(block, fmt, sf, storage, round_sf).spec)
                        except ValueError:
                            pass
    return out


def metadata(t):
    """What a fake must reproduce of a real output: shape, dtype and strides (any strides when empty)."""
    return tuple(t.shape), t.dtype, t.stride() if t.numel() else None


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # torch.equal refuses float8


def same(got, want) -> bool:
    """Equal dtype, shape and bits."""
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got.cpu()), _bits(want.cpu()))


def assert_same(got, want):
    """:func:`same`, and the strides too (where they matter: a non-empty tensor without a size-1 dim)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.numel() == 0 or got.stride() == want.stride() or min(got.shape) == 1
    assert torch.equal(_bits(got.cpu()), _bits(want.cpu()))


def assert_compiles_once(model, layouts_, token_counts, seed):
    """``model(x, layout)`` under ``torch.compile(fullgraph=True, dynamic=True)`` equals eager for each layout (a spec
    or a ScaleLayout) at every token count, compiled once per layout (a recompile over T fails)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for layout in layouts_:
        for i, tokens in enumerate(token_counts):
            x = sample(tokens, 256, seed=seed + tokens)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = compiled(x, layout)
            assert all(torch.equal(g, w) for g, w in zip(got, model(x, layout))), (layout, tokens)
