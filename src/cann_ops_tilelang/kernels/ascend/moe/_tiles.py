"""What the Ascend 950 kernels of the MoE gates share: the tile plan of a token-per-thread SIMT kernel over rows of
``E`` fp32 values (``topk_gate``, ``moe_topk_gate_forward`` / ``_backward``)."""

import dataclasses

__all__ = ["RowTilePlan"]


@dataclasses.dataclass(frozen=True)
class RowTilePlan:
    """Tiles of up to ``max_rows`` tokens (one SIMT thread each) whose ``E`` fp32 values take at most ``tile_bytes``
    of UB per stage, ``stages`` tiles in flight."""

    max_rows: int
    tile_bytes: int
    stages: int

    def rows(self, experts: int) -> int:
        """Tokens per tile at ``E = experts``: a power of two, at least 8."""
        rows = self.max_rows
        while rows > 8 and rows * experts * 4 > self.tile_bytes:
            rows //= 2
        return rows
