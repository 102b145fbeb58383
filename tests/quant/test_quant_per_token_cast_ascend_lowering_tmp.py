"""The Ascend 950 kernel of per_token_cast on the CPU: every lowering case lowers to AscendC within the UB budget
at the sizes that matter (limits.QUANT_HIDDEN_SIZES), the odd-UE8M0-word and ragged-hidden-tile paths lower,
the key's checks and the launcher's arguments. (Temporary file: to be folded into the op's test file.)"""

import pytest

pytest.importorskip("tilelang")

import torch  # noqa: E402

from cann_ops_tilelang import limits  # noqa: E402
from cann_ops_tilelang.kernels.ascend import _build  # noqa: E402
from cann_ops_tilelang.kernels.ascend import quant as ascend_quant  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import per_token_cast as kernel  # noqa: E402
from cann_ops_tilelang.quant import ScaleLayout  # noqa: E402

CASES = sorted(kernel.per_token_cast_cases(limits.QUANT_HIDDEN_SIZES[0], 4))


def _lowers_within_budget(key):
    lowered = _build.lower_ascendc(kernel.PER_TOKEN_CAST.prim_func(key))
    assert "__global__" in lowered.source, lowered.source[:400]
    assert not lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, f"{key}: UB {lowered.ub_bytes} B > {lowered.budget_bytes} B"
    # the tile formula the hidden tile is chosen by counts at least what the kernel requests
    til = kernel.tiling(key.hidden, key.group, key.in_dtype, key.fmt, key.sf, key.storage)
    assert lowered.ub_bytes <= til.ub_bytes <= _build.UB_BUDGET_BYTES, (key, lowered.ub_bytes, til)
    return lowered


@pytest.mark.parametrize("hidden", limits.QUANT_HIDDEN_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_ascend_per_token_cast_lowers_within_ub(hidden, name):
    key = kernel.per_token_cast_cases(hidden, 4)[name]
    lowered = _lowers_within_budget(key)
    source = lowered.source
    if key.fmt == "e2m1":
        assert "float4_e2m1x2_t" in source  # bf16 (with the sticky bit) -> e2m1
    else:
        assert "vcvt<fp8_e4_t>" in source and "RS_ENABLE" in source  # fp32 -> e4m3, saturating
    if key.sf == "ue8m0":
        assert "vsts_pack_b32" in source  # the int16 words
    if not key.round_sf:
        assert "vdiv_0ulp_ftz_true" in source  # the correctly rounded a / max, max / a (or 1 / s)


def test_family_aggregates_the_cases():
    hidden = limits.QUANT_HIDDEN_SIZES[0]
    cases = ascend_quant.lowering_cases(hidden)
    assert {f"per_token_cast/{name}" for name in CASES} <= set(cases)
    assert all(name.startswith("per_token_cast_") for name in CASES)


@pytest.mark.parametrize("hidden,storage,in_dtype", [
    (384, "row", "bfloat16"),  # one tile, 3 groups: the second byte of word 1 zeroed (a lane mask)
    (384, "col_tma", "bfloat16"),  # the same, a zeroed word row half
    (128 * 63, "row", "bfloat16"),  # no 256-multiple divides H: a ragged last tile of 7 groups
    (128 * 63, "col_tma", "float32"),  # ragged last tile of 1 group
])
def test_ascend_per_token_cast_odd_words_and_ragged_tiles_lower(hidden, storage, in_dtype):
    key = kernel.PerTokenCastKey(hidden, 128, in_dtype, "e4m3", "ue8m0", storage, True, 64)
    til = kernel.tiling(hidden, 128, in_dtype, "e4m3", "ue8m0", storage)
    assert (til.last // 128) % 2 == 1
    assert til.ragged == (hidden > 384)
    _lowers_within_budget(key)


def test_ascend_per_token_cast_key_checks():
    LimitError = limits.LimitError
    good = dict(hidden=2048, group=128, in_dtype="bfloat16", fmt="e4m3", sf="fp32", storage="row",
                round_sf=False, num_cores=64)
    kernel.check_key("t", **good)
    for change, match in [
        (dict(hidden=100), "a multiple of 128"),
        (dict(hidden=32768 + 128), r"in \[128, 32768\]"),
        (dict(group=48), "group must be one of"),
        (dict(in_dtype="float16"), "x must be one of"),
        (dict(sf="ue8m0", round_sf=False), "round_sf"),
        (dict(sf="e4m3", round_sf=True), "round_sf"),
        (dict(num_cores=0), "num_cores"),
    ]:
        with pytest.raises(LimitError, match=match):
            kernel.check_key("t", **{**good, **change})
        with pytest.raises(LimitError, match=match):
            kernel.build_per_token_cast(**{**good, **change})


def test_ascend_per_token_cast_launcher_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel.PER_TOKEN_CAST, "compiled", lambda key: lambda *args: calls.append((key, args)))
    tokens, hidden = 5, 256
    x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
    for spec in ("1x128/e4m3/ue8m0/col_tma/round", "1x32/e2m1/ue8m0/row/round", "1x16/e4m3/fp32/row/exact"):
        layout = ScaleLayout.parse(spec)
        data = layout.empty_data(tokens, hidden, like=x)
        sf = layout.empty_sf(tokens, hidden, "ascend", like=x)
        kernel.per_token_cast(x=x, layout=spec, data=data, sf=sf)
        key, (x_arg, data_arg, sf_arg) = calls[-1]
        assert key == kernel.PerTokenCastKey(hidden, layout.block[1], "bfloat16", layout.fmt, layout.sf,
                                             layout.storage, layout.round_sf, key.num_cores)
        assert x_arg is x and data_arg is data
        if layout.storage == "col_tma":  # the (cols, T) row-major buffer behind the transposed view
            assert sf_arg.shape == (sf.shape[1], tokens) and sf_arg.is_contiguous()
        else:
            assert sf_arg is sf
    with pytest.raises(limits.LimitError, match="not per-token"):
        kernel.per_token_cast_key(x, "128x128/e4m3/fp32/row/exact", 64)
