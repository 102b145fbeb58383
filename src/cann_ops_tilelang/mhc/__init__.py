"""The mHC (manifold-constrained hyper-connection) primitives (docs/ops/mhc.md): one module per op."""

from .expand import expand_to_mhc_backward, expand_to_mhc_forward
from .fn_normw_merge import mhc_fn_normw_merge_backward, mhc_fn_normw_merge_forward
from .gemm_with_sqrsum import mhc_gemm_with_sqrsum_backward, mhc_gemm_with_sqrsum_forward
from .head_compute_mix import mhc_head_compute_mix_backward, mhc_head_compute_mix_forward
from .multilayer_recompute import mhc_multilayer_recompute
from .post import mhc_post_backward, mhc_post_forward
from .pre_big_fuse import mhc_pre_big_fuse
from .pre_apply_mix import mhc_pre_apply_mix_backward, mhc_pre_apply_mix_forward
from .pre_split_mixes import mhc_pre_split_mixes_backward, mhc_pre_split_mixes_forward
from .reduce_partials_and_rmsnorm import (
    mhc_reduce_partials_and_rmsnorm_backward,
    mhc_reduce_partials_and_rmsnorm_forward,
)
from .sinkhorn import mhc_sinkhorn_backward, mhc_sinkhorn_forward

__all__ = [
    "expand_to_mhc_backward",
    "expand_to_mhc_forward",
    "mhc_fn_normw_merge_backward",
    "mhc_fn_normw_merge_forward",
    "mhc_gemm_with_sqrsum_backward",
    "mhc_gemm_with_sqrsum_forward",
    "mhc_head_compute_mix_backward",
    "mhc_head_compute_mix_forward",
    "mhc_multilayer_recompute",
    "mhc_post_backward",
    "mhc_post_forward",
    "mhc_pre_apply_mix_backward",
    "mhc_pre_apply_mix_forward",
    "mhc_pre_big_fuse",
    "mhc_pre_split_mixes_backward",
    "mhc_pre_split_mixes_forward",
    "mhc_reduce_partials_and_rmsnorm_backward",
    "mhc_reduce_partials_and_rmsnorm_forward",
    "mhc_sinkhorn_backward",
    "mhc_sinkhorn_forward",
]
