"""Autograd wrappers and modules that chain the forward and backward primitives."""

from .engram_gate import EngramGate, engram_gate

__all__ = ["EngramGate", "engram_gate"]
