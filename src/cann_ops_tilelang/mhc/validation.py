"""Validation of the mHC primitives: one metadata-only function per op (OPS.md §B.2).

Shared by the fakes and every kernel wrapper. Supported sizes on both backends: ``hc_mult == 4``;
hidden size ``H`` a multiple of 64 in [256, 8192] (``K = m*H``); ``M3 = m*(m+2) = 24``; RMS groups
``G == 1``; any token count ``T >= 0``; Sinkhorn ``repeat >= 1``; ``n_splits >= 1`` and at most
``K / 64``.
"""

import torch

from .._checks import OpError, check_float, check_same_device, check_tensor

__all__ = ["COMB", "HC_MULT", "MIX"]  # and one check_<op> per op

HC_MULT = 4
MIX = HC_MULT * (HC_MULT + 2)
COMB = HC_MULT * HC_MULT
HIDDEN_ALIGN = 64
MIN_HIDDEN = 256
MAX_HIDDEN = 8192
BF16, F32 = torch.bfloat16, torch.float32


def _hidden(err: OpError, arg: str, hidden: int) -> None:
    if hidden % HIDDEN_ALIGN != 0 or not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise err.value(
            arg, f"expected a hidden size that is a multiple of {HIDDEN_ALIGN} in [{MIN_HIDDEN}, {MAX_HIDDEN}], got {hidden}"
        )


def _width(err: OpError, arg: str, k: int) -> int:
    """Checks a flattened residual width ``K = m*H`` and returns ``H``."""
    if k % HC_MULT != 0:
        raise err.value(arg, f"expected a width K = {HC_MULT}*H, got {k}")
    _hidden(err, arg, k // HC_MULT)
    return k // HC_MULT


def _hc(err: OpError, arg: str, m: int) -> None:
    if m != HC_MULT:
        raise err.value(arg, f"expected hc_mult {HC_MULT} (the only one with kernels), got {m}")


def _int(err: OpError, arg: str, value: object, minimum: int, maximum: int | None = None) -> int:
    # SymInt: a size-derived int traced by torch.compile with dynamic shapes
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise err.type(arg, f"expected an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise err.value(arg, f"expected an int {bound}, got {value}")
    return value


def _same_device(err: OpError, named: dict) -> None:
    check_same_device(err, [(k, v) for k, v in named.items() if isinstance(v, torch.Tensor)])


def check_expand_to_mhc_forward(x, out):
    err = OpError("expand_to_mhc_forward")
    xt = check_tensor(err, "x", x, dtype=BF16, ndim=2)
    tokens, hidden = xt.shape
    _hidden(err, "x", hidden)
    o = check_tensor(err, "out", out, dtype=BF16, ndim=3)
    _hc(err, "out", o.shape[1])
    check_tensor(err, "out", out, dtype=BF16, shape=(tokens, HC_MULT, hidden))
    _same_device(err, dict(x=x, out=out))


def check_expand_to_mhc_backward(out_grad, x_grad):
    err = OpError("expand_to_mhc_backward")
    g = check_tensor(err, "out_grad", out_grad, dtype=BF16, ndim=3)
    tokens, m, hidden = g.shape
    _hc(err, "out_grad", m)
    _hidden(err, "out_grad", hidden)
    check_tensor(err, "x_grad", x_grad, dtype=BF16, shape=(tokens, hidden))
    _same_device(err, dict(out_grad=out_grad, x_grad=x_grad))


def check_mhc_fn_normw_merge_forward(fn, normw, out_fn):
    err = OpError("mhc_fn_normw_merge_forward")
    f = check_tensor(err, "fn", fn, dtype=F32, ndim=2)
    rows, k = f.shape
    if rows != MIX:
        raise err.value("fn", f"expected {MIX} rows (m*(m+2) mixes), got {rows}")
    _width(err, "fn", k)
    check_tensor(err, "normw", normw, dtype=F32, shape=(k,))
    check_tensor(err, "out_fn", out_fn, dtype=F32, shape=(rows, k))
    _same_device(err, dict(fn=fn, normw=normw, out_fn=out_fn))


def check_mhc_fn_normw_merge_backward(fn, normw, out_fn_grad, fn_grad, normw_grad):
    err = OpError("mhc_fn_normw_merge_backward")
    f = check_tensor(err, "fn", fn, dtype=F32, ndim=2)
    rows, k = f.shape
    if rows != MIX:
        raise err.value("fn", f"expected {MIX} rows (m*(m+2) mixes), got {rows}")
    _width(err, "fn", k)
    check_tensor(err, "normw", normw, dtype=F32, shape=(k,))
    check_tensor(err, "out_fn_grad", out_fn_grad, dtype=F32, shape=(rows, k))
    check_tensor(err, "fn_grad", fn_grad, dtype=F32, shape=(rows, k))
    check_tensor(err, "normw_grad", normw_grad, dtype=F32, shape=(k,))
    _same_device(err, dict(fn=fn, normw=normw, out_fn_grad=out_fn_grad, fn_grad=fn_grad, normw_grad=normw_grad))


def check_mhc_gemm_with_sqrsum_forward(x, fn, n_splits):
    err = OpError("mhc_gemm_with_sqrsum_forward")
    xt = check_tensor(err, "x", x, dtype=BF16, ndim=2)
    k = xt.shape[1]
    _width(err, "x", k)
    check_tensor(err, "fn", fn, dtype=F32, shape=(MIX, k))
    _int(err, "n_splits", n_splits, 1, k // 64)
    _same_device(err, dict(x=x, fn=fn))


def check_mhc_gemm_with_sqrsum_backward(out_mul_grad, sqrsum_grad, x, fn, x_grad):
    err = OpError("mhc_gemm_with_sqrsum_backward")
    xt = check_tensor(err, "x", x, dtype=BF16, ndim=2)
    tokens, k = xt.shape
    _width(err, "x", k)
    check_tensor(err, "out_mul_grad", out_mul_grad, dtype=F32, shape=(tokens, MIX))
    check_tensor(err, "sqrsum_grad", sqrsum_grad, dtype=F32, shape=(tokens,))
    check_tensor(err, "fn", fn, dtype=F32, shape=(MIX, k))
    check_tensor(err, "x_grad", x_grad, dtype=BF16, shape=(tokens, k))
    _same_device(err, dict(out_mul_grad=out_mul_grad, sqrsum_grad=sqrsum_grad, x=x, fn=fn, x_grad=x_grad))


def _group(err: OpError, arg: str, groups: int) -> None:
    if groups != 1:
        raise err.value(arg, f"expected 1 RMS group (G == 1, the only layout with kernels), got {groups}")


def check_mhc_reduce_partials_and_rmsnorm_forward(out_mul_splitted, sqrsum_splitted, out_mul, sqrsum, out,
                                                  rms_group_size, rms_eps, n_splits):
    err = OpError("mhc_reduce_partials_and_rmsnorm_forward")
    parts = check_tensor(err, "out_mul_splitted", out_mul_splitted, dtype=F32, ndim=4)
    splits, tokens, groups, mixes = parts.shape
    _group(err, "out_mul_splitted", groups)
    if mixes != MIX:
        raise err.value("out_mul_splitted", f"expected {MIX} mixes in the last dim, got {mixes}")
    _int(err, "n_splits", n_splits, 1)
    if splits != n_splits:
        raise err.value("out_mul_splitted", f"expected {n_splits} splits (n_splits) in dim 0, got {splits}")
    check_tensor(err, "sqrsum_splitted", sqrsum_splitted, dtype=F32, shape=(splits, tokens, groups))
    check_tensor(err, "out_mul", out_mul, dtype=F32, shape=(tokens, groups, mixes))
    check_tensor(err, "sqrsum", sqrsum, dtype=F32, shape=(tokens, groups))
    check_tensor(err, "out", out, dtype=F32, shape=(tokens, mixes))
    _int(err, "rms_group_size", rms_group_size, 1)
    check_float(err, "rms_eps", rms_eps, minimum=0.0)
    _same_device(err, dict(out_mul_splitted=out_mul_splitted, sqrsum_splitted=sqrsum_splitted, out_mul=out_mul,
                           sqrsum=sqrsum, out=out))


def check_mhc_reduce_partials_and_rmsnorm_backward(out_grad, out_mul, sqrsum, out_mul_grad, sqrsum_grad,
                                                   rms_group_size, rms_eps):
    err = OpError("mhc_reduce_partials_and_rmsnorm_backward")
    om = check_tensor(err, "out_mul", out_mul, dtype=F32, ndim=3)
    tokens, groups, mixes = om.shape
    _group(err, "out_mul", groups)
    if mixes != MIX:
        raise err.value("out_mul", f"expected {MIX} mixes in the last dim, got {mixes}")
    check_tensor(err, "out_grad", out_grad, dtype=F32, shape=(tokens, mixes))
    check_tensor(err, "sqrsum", sqrsum, dtype=F32, shape=(tokens, groups))
    check_tensor(err, "out_mul_grad", out_mul_grad, dtype=F32, shape=(tokens, groups, mixes))
    check_tensor(err, "sqrsum_grad", sqrsum_grad, dtype=F32, shape=(tokens, groups))
    _int(err, "rms_group_size", rms_group_size, 1)
    check_float(err, "rms_eps", rms_eps, minimum=0.0)
    _same_device(err, dict(out_grad=out_grad, out_mul=out_mul, sqrsum=sqrsum, out_mul_grad=out_mul_grad,
                           sqrsum_grad=sqrsum_grad))


def _mixes(err: OpError, arg: str, value) -> int:
    t = check_tensor(err, arg, value, dtype=F32, ndim=2)
    if t.shape[1] != MIX:
        raise err.value(arg, f"expected {MIX} mixes (hc_mult {HC_MULT}) in the last dim, got {t.shape[1]}")
    return t.shape[0]


def check_mhc_pre_split_mixes_forward(input_mixes, mhc_scale, mhc_base, pre, post, comb, post_mult_value, pre_eps):
    err = OpError("mhc_pre_split_mixes_forward")
    tokens = _mixes(err, "input_mixes", input_mixes)
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(MIX,))
    check_tensor(err, "pre", pre, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "post", post, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "comb", comb, dtype=F32, shape=(tokens, COMB))
    check_float(err, "post_mult_value", post_mult_value, minimum=0.0, inclusive=False)
    check_float(err, "pre_eps", pre_eps, minimum=0.0)
    _same_device(err, dict(input_mixes=input_mixes, mhc_scale=mhc_scale, mhc_base=mhc_base, pre=pre, post=post,
                           comb=comb))


def check_mhc_pre_split_mixes_backward(pre_grad, post_grad, comb_grad, input_mixes, post, mhc_scale, mhc_base,
                                       input_mixes_grad, mhc_scale_grad, mhc_base_grad, post_mult_value):
    err = OpError("mhc_pre_split_mixes_backward")
    tokens = _mixes(err, "input_mixes", input_mixes)
    check_tensor(err, "pre_grad", pre_grad, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "post_grad", post_grad, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "comb_grad", comb_grad, dtype=F32, shape=(tokens, COMB))
    check_tensor(err, "post", post, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(MIX,))
    check_tensor(err, "input_mixes_grad", input_mixes_grad, dtype=F32, shape=(tokens, MIX))
    check_tensor(err, "mhc_scale_grad", mhc_scale_grad, dtype=F32, shape=(3,))
    check_tensor(err, "mhc_base_grad", mhc_base_grad, dtype=F32, shape=(MIX,))
    check_float(err, "post_mult_value", post_mult_value, minimum=0.0, inclusive=False)
    _same_device(err, dict(pre_grad=pre_grad, post_grad=post_grad, comb_grad=comb_grad, input_mixes=input_mixes,
                           post=post, mhc_scale=mhc_scale, mhc_base=mhc_base, input_mixes_grad=input_mixes_grad,
                           mhc_scale_grad=mhc_scale_grad, mhc_base_grad=mhc_base_grad))


def _square(err: OpError, arg: str, value) -> int:
    t = check_tensor(err, arg, value, dtype=F32, ndim=3)
    if t.shape[1] != t.shape[2]:
        raise err.value(arg, f"expected (T, m, m) matrices, got shape {tuple(t.shape)}")
    _hc(err, arg, t.shape[1])
    return t.shape[0]


def check_mhc_sinkhorn_forward(comb, comb_out, repeat, eps):
    err = OpError("mhc_sinkhorn_forward")
    tokens = _square(err, "comb", comb)
    check_tensor(err, "comb_out", comb_out, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    _int(err, "repeat", repeat, 1, 64)
    check_float(err, "eps", eps, minimum=0.0)
    _same_device(err, dict(comb=comb, comb_out=comb_out))


def check_mhc_sinkhorn_backward(grad_output, x, grad_input, repeat, eps):
    err = OpError("mhc_sinkhorn_backward")
    tokens = _square(err, "x", x)
    check_tensor(err, "grad_output", grad_output, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    check_tensor(err, "grad_input", grad_input, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    _int(err, "repeat", repeat, 1, 64)
    check_float(err, "eps", eps, minimum=0.0)
    _same_device(err, dict(grad_output=grad_output, x=x, grad_input=grad_input))


def _residual(err: OpError, arg: str, value) -> tuple[int, int]:
    r = check_tensor(err, arg, value, dtype=BF16, ndim=3)
    tokens, m, hidden = r.shape
    _hc(err, arg, m)
    _hidden(err, arg, hidden)
    return tokens, hidden


def check_mhc_pre_apply_mix_forward(x, mix, out):
    err = OpError("mhc_pre_apply_mix_forward")
    tokens, hidden = _residual(err, "x", x)
    check_tensor(err, "mix", mix, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "out", out, dtype=BF16, shape=(tokens, hidden))
    _same_device(err, dict(x=x, mix=mix, out=out))


def check_mhc_pre_apply_mix_backward(out_grad, x, mix, x_grad):
    err = OpError("mhc_pre_apply_mix_backward")
    tokens, hidden = _residual(err, "x", x)
    check_tensor(err, "out_grad", out_grad, dtype=BF16, shape=(tokens, hidden))
    check_tensor(err, "mix", mix, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "x_grad", x_grad, dtype=BF16, shape=(tokens, HC_MULT, hidden))
    _same_device(err, dict(out_grad=out_grad, x=x, mix=mix, x_grad=x_grad))


def check_mhc_post_forward(x, residual, post_layer_mix, comb_res_mix, op="mhc_post_forward"):
    err = OpError(op)
    tokens, hidden = _residual(err, "residual", residual)
    check_tensor(err, "x", x, dtype=BF16, shape=(tokens, hidden))
    check_tensor(err, "post_layer_mix", post_layer_mix, dtype=F32, shape=(tokens, HC_MULT))
    check_tensor(err, "comb_res_mix", comb_res_mix, dtype=F32, shape=(tokens, HC_MULT, HC_MULT))
    _same_device(err, dict(x=x, residual=residual, post_layer_mix=post_layer_mix, comb_res_mix=comb_res_mix))
    return err, tokens, hidden


def check_mhc_post_backward(x, residual, post_layer_mix, comb_res_mix, d_o):
    err, tokens, hidden = check_mhc_post_forward(x, residual, post_layer_mix, comb_res_mix, op="mhc_post_backward")
    check_tensor(err, "d_o", d_o, dtype=BF16, shape=(tokens, HC_MULT, hidden))
    _same_device(err, dict(x=x, d_o=d_o))


def check_mhc_head_compute_mix_forward(input_mix, mhc_scale, mhc_base, output_mix, pre_eps):
    err = OpError("mhc_head_compute_mix_forward")
    im = check_tensor(err, "input_mix", input_mix, dtype=F32, ndim=2)
    _hc(err, "input_mix", im.shape[1])
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(1,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(HC_MULT,))
    check_tensor(err, "output_mix", output_mix, dtype=F32, shape=tuple(im.shape))
    check_float(err, "pre_eps", pre_eps, minimum=0.0)
    _same_device(err, dict(input_mix=input_mix, mhc_scale=mhc_scale, mhc_base=mhc_base, output_mix=output_mix))


def check_mhc_head_compute_mix_backward(output_mix_grad, input_mix, mhc_scale, mhc_base, input_mix_grad,
                                        mhc_scale_grad_partial, mhc_base_grad_partial):
    err = OpError("mhc_head_compute_mix_backward")
    im = check_tensor(err, "input_mix", input_mix, dtype=F32, ndim=2)
    _hc(err, "input_mix", im.shape[1])
    shape = tuple(im.shape)
    check_tensor(err, "output_mix_grad", output_mix_grad, dtype=F32, shape=shape)
    check_tensor(err, "mhc_scale", mhc_scale, dtype=F32, shape=(1,))
    check_tensor(err, "mhc_base", mhc_base, dtype=F32, shape=(HC_MULT,))
    check_tensor(err, "input_mix_grad", input_mix_grad, dtype=F32, shape=shape)
    part = check_tensor(err, "mhc_scale_grad_partial", mhc_scale_grad_partial, dtype=F32, ndim=2)
    if part.shape[0] < 1 or part.shape[1] != 1:
        raise err.value("mhc_scale_grad_partial", f"expected shape (P, 1) with P >= 1, got {tuple(part.shape)}")
    check_tensor(err, "mhc_base_grad_partial", mhc_base_grad_partial, dtype=F32, shape=(part.shape[0], HC_MULT))
    _same_device(err, dict(output_mix_grad=output_mix_grad, input_mix=input_mix, mhc_scale=mhc_scale,
                           mhc_base=mhc_base, input_mix_grad=input_mix_grad,
                           mhc_scale_grad_partial=mhc_scale_grad_partial, mhc_base_grad_partial=mhc_base_grad_partial))
