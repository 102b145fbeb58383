"""Ascend 950 (``dav-3510``) TileLang kernels of ``cann_ops_tilelang``.

Importing this package (or any kernel module below it) never imports ``torch_npu``: the vector core
count is read lazily from :mod:`cann_ops_tilelang.config`, only by launchers.
"""

import logging

from ... import config

__all__ = ["LOGGER", "num_vector_cores"]

LOGGER = logging.getLogger("cann_ops_tilelang")


def num_vector_cores() -> int:
    """Number of AIV (vector) cores a kernel of the current stream may use (lazy, cached in config).

    A wrong count costs performance, never correctness: every kernel is a persistent loop whose grid
    size is a compile-time parameter independent of the data.
    """
    return config.num_vec_cores()
