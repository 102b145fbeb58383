"""Kernel generators and launchers, one package per backend (``cuda``, ``ascend``).

Imported lazily by the ops on first use on a device; importing ``cann_ops_tilelang`` never
imports this package's backends (nor TileLang).
"""
