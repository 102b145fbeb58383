"""CUDA kernels of ``cann_ops_tilelang``, written in TileLang.

One sub-package per op family (``engram``, ...). Importing these modules does not import TileLang
or touch a device: every kernel is built and compiled on its first launch.
"""
