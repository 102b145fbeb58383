"""Optimizers built on the package's ops (docs/ops/engram.md#sinkhorn)."""

from .sinkhorn import EngramSinkhorn, sinkhorn_update

__all__ = ["EngramSinkhorn", "sinkhorn_update"]
