"""CUDA kernels of ``mhc_gemm_with_sqrsum_forward`` / ``_backward``, the split-K pre-norm GEMM with the sum of
squares (docs/ops/mhc.md#gemm_with_sqrsum): :mod:`.forward` (resident and streaming schedules, the ``fn``
preparation) and :mod:`.backward` (the tensor-core main kernel and its partial reduction).

The weight ``fn`` is ``(M3, K)`` with ``K`` a multiple of 64 and ``M3`` a multiple of 8 up to 32 (``M3 = 24``,
``K = 4 * H`` for ``m = 4``); any ``T > 0``; ``n_splits`` in ``limits.mhc_gemm_splits(K)``.
"""

from .....chips import H200
from .backward import (
    build_mhc_gemm_with_sqrsum_backward,
    build_mhc_gemm_with_sqrsum_backward_reduce,
    get_mhc_gemm_with_sqrsum_backward_kernel,
    get_mhc_gemm_with_sqrsum_backward_reduce_kernel,
    mhc_gemm_with_sqrsum_backward,
    mhc_gemm_with_sqrsum_backward_key,
    mhc_gemm_with_sqrsum_backward_partials,
)
from .forward import (
    _fwd_key,
    build_mhc_gemm_fn_split,
    build_mhc_gemm_with_sqrsum_forward,
    build_mhc_gemm_with_sqrsum_forward_main,
    build_mhc_gemm_with_sqrsum_forward_resident,
    get_mhc_gemm_fn_split_kernel,
    get_mhc_gemm_with_sqrsum_forward_kernel,
    mhc_gemm_with_sqrsum_forward,
    mhc_gemm_with_sqrsum_forward_block_k,
    mhc_gemm_with_sqrsum_forward_ctas_per_split,
    mhc_gemm_with_sqrsum_forward_key,
    mhc_gemm_with_sqrsum_forward_resident_stages,
)

__all__ = [
    "build_mhc_gemm_fn_split",
    "build_mhc_gemm_with_sqrsum_backward",
    "build_mhc_gemm_with_sqrsum_backward_reduce",
    "build_mhc_gemm_with_sqrsum_forward",
    "build_mhc_gemm_with_sqrsum_forward_main",
    "build_mhc_gemm_with_sqrsum_forward_resident",
    "get_mhc_gemm_fn_split_kernel",
    "get_mhc_gemm_with_sqrsum_backward_kernel",
    "get_mhc_gemm_with_sqrsum_backward_reduce_kernel",
    "get_mhc_gemm_with_sqrsum_forward_kernel",
    "lowering_cases",
    "mhc_gemm_with_sqrsum_backward",
    "mhc_gemm_with_sqrsum_backward_key",
    "mhc_gemm_with_sqrsum_backward_partials",
    "mhc_gemm_with_sqrsum_forward",
    "mhc_gemm_with_sqrsum_forward_block_k",
    "mhc_gemm_with_sqrsum_forward_ctas_per_split",
    "mhc_gemm_with_sqrsum_forward_key",
    "mhc_gemm_with_sqrsum_forward_resident_stages",
]


def lowering_cases(hidden_size: int, hc_mult: int = 4) -> dict:
    """Every kernel variant at ``hidden_size`` (``K = m * H``, ``M3 = m(m+2)``), un-compiled: ``{case: prim_func}``.

    Forward schedules as on the H200's SMs: ``_s16`` (the CUDA default split count; resident up to H = 5632,
    streaming at 7168), ``_s1`` (streaming), ``_s7`` (uneven splits: resident at H = 1280, else streaming),
    ``_s80`` (many splits, streaming; one block per split at H = 1280) and the streaming schedule's ``fn``
    preparation ``_fn_split``; the backward's main kernel (its token partition count is a launch argument),
    its single-stage variant ``_1stage`` and its partial reduction ``_reduce``.
    """
    k, m3 = hc_mult * hidden_size, hc_mult * (hc_mult + 2)
    forward = "mhc_gemm_with_sqrsum_forward"
    cases = {f"{forward}_fn_split": build_mhc_gemm_fn_split(k, m3)}
    for splits in (16, 1, 7, 80):
        cases[f"{forward}_s{splits}"] = build_mhc_gemm_with_sqrsum_forward_main(*_fwd_key(k, m3, splits, H200.sms))
    cases["mhc_gemm_with_sqrsum_backward"] = build_mhc_gemm_with_sqrsum_backward(k, m3)
    cases["mhc_gemm_with_sqrsum_backward_1stage"] = build_mhc_gemm_with_sqrsum_backward(k, m3, 1)
    cases["mhc_gemm_with_sqrsum_backward_reduce"] = build_mhc_gemm_with_sqrsum_backward_reduce(k, m3)
    return cases
