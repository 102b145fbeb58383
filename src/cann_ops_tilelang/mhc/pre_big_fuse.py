"""``mhc_pre_big_fuse``: the forward of an mHC sublayer's pre stage in one pass over the residual, from the
pre-norm GEMM's partials to the sublayer input (docs/ops/mhc.md#pre_big_fuse).

Bitwise equal to reduce + RMSNorm → split mixes → Sinkhorn → pre apply mix on the same partials; it does not
produce what their backwards need (the mixes, the comb logits), so it serves the forward without gradients.
"""

from torch import Tensor

from .. import limits
from .._checks import OpError, check_float, check_int, check_tensor
from .._library import declare
from ._common import BF16, COMB, F32, HC_MULT, MIX, check_residual, same_device

__all__ = ["mhc_pre_big_fuse"]


@declare("mhc_pre_big_fuse", mutates_args=("post_mix", "comb_mix", "layer_input"),
         vector_args={"residual": 16, "layer_input": 16}, tokens="residual")
def mhc_pre_big_fuse(gemm_out_mul: Tensor, gemm_out_sqrsum: Tensor, mhc_scale: Tensor, mhc_base: Tensor,
                     residual: Tensor, post_mix: Tensor, comb_mix: Tensor, layer_input: Tensor, rms_eps: float,
                     pre_eps: float, sinkhorn_eps: float, post_mult_value: float, sinkhorn_repeat: int,
                     n_splits: int = 16) -> None:
    """Fused pre stage: ``mixes = (sum_s gemm_out_mul[s]) * rsqrt(sum_s gemm_out_sqrsum[s] / (m*H) + rms_eps)``,
    ``pre, post, comb_logits`` split from them as :func:`mhc_pre_split_mixes_forward` does, ``comb`` the
    Sinkhorn of the logits, ``layer_input = sum_i pre[:, i] * residual[:, i]``.

    Args:
        gemm_out_mul: ``(S, T, M3)`` fp32, the partials of :func:`mhc_gemm_with_sqrsum_forward`.
        gemm_out_sqrsum: ``(S, T)`` fp32.
        mhc_scale: ``(3,)`` fp32; mhc_base: ``(M3,)`` fp32.
        residual: ``(T, m, H)`` bf16.
        post_mix: ``(T, m)`` fp32, written.
        comb_mix: ``(T, m*m)`` fp32, written (after Sinkhorn).
        layer_input: ``(T, H)`` bf16, written.
        rms_eps, pre_eps, sinkhorn_eps: >= 0, as in the unfused ops.
        post_mult_value: > 0.
        sinkhorn_repeat: as ``repeat`` of :func:`mhc_sinkhorn_forward`.
        n_splits: ``S``, the partials' dim 0.
    """
    err = OpError("mhc_pre_big_fuse")
    tokens, hidden = check_residual(err, "residual", residual)
    splits = check_tensor(err, "gemm_out_mul", gemm_out_mul, dtype=F32, ndim=3).shape[0]
    check_tensor(err, "gemm_out_mul", gemm_out_mul, dtype=F32, shape=(splits, tokens, MIX))
    limits.mhc_gemm_splits(HC_MULT * hidden).check(err, "n_splits", check_int(err, "n_splits", n_splits))
    if splits != n_splits:
        raise err.value("gemm_out_mul", f"expected {n_splits} splits (n_splits) in dim 0, got {splits}")
    check_tensor(err, "gemm_out_sqrsum", gemm_out_sqrsum, dtype=F32, shape=(splits, tokens))
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(MIX,))
    check_tensor(err, "post_mix", post_mix, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "comb_mix", comb_mix, dtype=F32, shape=(tokens, COMB))
    check_tensor(err, "layer_input", layer_input, dtype=BF16, shape=(tokens, hidden))
    check_float(err, "rms_eps", rms_eps, minimum=0.0)
    check_float(err, "pre_eps", pre_eps, minimum=0.0)
    check_float(err, "sinkhorn_eps", sinkhorn_eps, minimum=0.0)
    check_float(err, "post_mult_value", post_mult_value, minimum=0.0, inclusive=False)
    limits.MHC_SINKHORN_REPEAT.of(residual.device.type).check(
        err, "sinkhorn_repeat", check_int(err, "sinkhorn_repeat", sinkhorn_repeat))
    same_device(err, gemm_out_mul=gemm_out_mul, gemm_out_sqrsum=gemm_out_sqrsum, mhc_scale=mhc_scale,
                mhc_base=mhc_base, residual=residual, post_mix=post_mix, comb_mix=comb_mix, layer_input=layer_input)


# DTensor sharding (docs/distributed.md): token-wise (dim 1 of the GEMM partials).
mhc_pre_big_fuse.sharding({"gemm_out_mul": "S1", "gemm_out_sqrsum": "S1", "residual": "S0", "post_mix": "S0",
                           "comb_mix": "S0", "layer_input": "S0"})
