"""CUDA kernels of ``mhc_gemm_with_sqrsum_forward`` / ``_backward``, the split-K pre-norm GEMM with the sum of
squares (docs/ops/mhc.md#gemm_with_sqrsum): :mod:`.forward` (resident and streaming schedules, the ``fn``
preparation) and :mod:`.backward` (the tensor-core main kernel and its partial reduction).

The weight ``fn`` is ``(M3, K)`` with ``K`` a multiple of 64 and ``M3`` a multiple of 8 up to 32 (``M3 = 24``,
``K = 4 * H`` for ``m = 4``); any ``T > 0``; ``n_splits`` in ``limits.mhc_gemm_splits(K)``.
"""

from ...._kernel import kernel_module
from .backward import (
    BACKWARD,
    BACKWARD_REDUCE,
    BackwardKey,
    build_mhc_gemm_with_sqrsum_backward,
    build_mhc_gemm_with_sqrsum_backward_reduce,
    mhc_gemm_with_sqrsum_backward,
    mhc_gemm_with_sqrsum_backward_partials,
)
from .forward import (
    FN_SPLIT,
    FORWARD,
    ForwardKey,
    build_mhc_gemm_fn_split,
    build_mhc_gemm_with_sqrsum_forward,
    build_mhc_gemm_with_sqrsum_forward_main,
    build_mhc_gemm_with_sqrsum_forward_resident,
    forward_key,
    mhc_gemm_with_sqrsum_forward,
    mhc_gemm_with_sqrsum_forward_block_k,
    mhc_gemm_with_sqrsum_forward_ctas_per_split,
    mhc_gemm_with_sqrsum_forward_resident_stages,
)

# Forward schedules as on the H200's SMs and the streaming schedule's fn preparation (forward._cases); the
# backward's main kernel, its single-stage variant and its partial reduction (backward._cases).
KERNELS, lowering_cases, __all__ = kernel_module(__name__, FN_SPLIT, FORWARD, BACKWARD, BACKWARD_REDUCE)
