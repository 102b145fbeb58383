"""``quantize`` (quant/_quantize.py), the one Python entry over the three casts of a layout kind: each kind goes to
its op, a ``QuantTensor`` input re-quantizes where the cast does, refusals name the cast and the argument. (Family
file: the function spans the per_token_cast, per_block_cast and per_channel_cast modules.)"""

import pytest
import torch
from quant_cases import sample
from quant_testing import same

import cann_ops_tilelang as ops
from cann_ops_tilelang.quant import QuantTensor, ScaleLayout


@pytest.mark.parametrize("layout,op", [
    ("1x32/e2m1/ue8m0/row/round", "per_token_cast"),
    ("1x128/e4m3/ue8m0/col_tma/round", "per_token_cast"),
    ("128x128/e4m3/ue8m0/col_tma/round", "per_block_cast"),
    ("32x32/e4m3/fp32/row/exact", "per_block_cast"),
    ("128x1/e4m3/ue8m0/row/round", "per_channel_cast"),
])
def test_quantize_takes_each_layout_kind_to_its_cast(layout, op, seed):
    x = sample(130, 256, seed=seed)
    for given in (layout, ScaleLayout.parse(layout)):
        q = ops.quantize(x, given)
        assert isinstance(q, QuantTensor) and q.layout == ScaleLayout.parse(layout) and q.tokens == 130
        assert all(same(a, b) for a, b in zip(q[:2], getattr(ops, op)(x, layout)))


def test_quantize_requantizes_a_quant_tensor(seed):
    x = sample(40, 256, seed=seed)
    src = ops.quantize(x, "1x128/e4m3/ue8m0/col_tma/round")
    for layout, op in (("1x32/e4m3/fp32/row/exact", ops.per_token_cast), ("128x1/e4m3/fp32/row/exact",
                                                                           ops.per_channel_cast)):
        q = ops.quantize(src, layout)
        assert all(same(a, b) for a, b in zip(q[:2], op(src.data, layout, src.sf, src.layout.spec)))
    with pytest.raises(TypeError, match=r"cann_ops_tilelang::per_block_cast: argument 'x': expected a bf16 or fp32 "
                                        r"tensor \(a per-block cast does not re-quantize\), got a QuantTensor"):
        ops.quantize(src, "128x128/e4m3/fp32/row/exact")


def test_quantize_refuses_a_bad_layout_by_name():
    x = sample(4, 256)
    with pytest.raises(ValueError, match=r"cann_ops_tilelang::per_token_cast: argument 'layout': expected a "
                                         r"ScaleLayout spec"):
        ops.quantize(x, "1x128")
    with pytest.raises(TypeError, match=r"cann_ops_tilelang::per_token_cast: argument 'layout': expected a str"):
        ops.quantize(x, 128)
    with pytest.raises(ValueError, match=r"cann_ops_tilelang::per_block_cast: argument 'x': expected a hidden size"):
        ops.quantize(torch.zeros(4, 192, dtype=torch.bfloat16), "128x128/e4m3/fp32/row/exact")
