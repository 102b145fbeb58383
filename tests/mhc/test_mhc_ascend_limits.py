"""CPU tier: the Ascend mHC kernels agree with the declared ranges (``cann_ops_tilelang.limits``).

The Sinkhorn repeat range of the Ascend backend is bounded by the UB of its backward kernel: both edges of
the declared range fit the UB estimate (and lower within the budget: tests/test_limits.py), and the estimate one
past the high edge does not fit. Builders and key functions called outside a declared range raise
``limits.LimitError`` (a ``ValueError``) naming the range, never an ``AssertionError``.
"""

import ast
import pathlib

import pytest
import torch

pytest.importorskip("tilelang")

from cann_ops_tilelang import chips, limits  # noqa: E402
from cann_ops_tilelang.kernels.ascend import _build  # noqa: E402
from cann_ops_tilelang.kernels.ascend.mhc import (  # noqa: E402
    expand,
    fn_normw_merge,
    gemm_with_sqrsum,
    head_compute_mix,
    post,
    pre_apply_mix,
    pre_split_mixes,
    reduce_partials_and_rmsnorm,
    sinkhorn,
)

REPEAT = limits.MHC_SINKHORN_REPEAT["ascend"]
CORES = chips.ASCEND_950.vector_cores


def test_ub_budgets_are_the_chip_facts():
    assert _build.UB_BUDGET_BYTES == chips.ASCEND_950.ub_bytes
    assert _build.UB_BUDGET_SIMT_BYTES == chips.ASCEND_950.ub_bytes_simt


def test_cube_capacities_are_the_chip_facts():
    assert chips.ASCEND_950.cube_bytes == {"l1": 512 * 1024, "l0a": 64 * 1024, "l0b": 64 * 1024, "l0c": 256 * 1024}


@pytest.mark.parametrize("width", gemm_with_sqrsum.BACKWARD_PLAN.widths)
def test_gemm_backward_plan_fits_the_cube_and_ub_at_every_width(width):
    """The Cube backward's budget (UB per vector core, L1 / L0A / L0B / L0C per Cube core) fits at every
    column tile the plan may pick; the lowering equals this arithmetic (test_mhc_lowering.py)."""
    plan = gemm_with_sqrsum.BACKWARD_PLAN
    budget = plan.budget(width, chips.ASCEND_950.l0b_bytes)
    assert budget.pop("ub") <= _build.UB_BUDGET_BYTES
    for scope, size in budget.items():
        assert 0 < size <= chips.ASCEND_950.cube_bytes[scope], (width, scope, size)


@pytest.mark.parametrize("hidden", [limits.MHC_HIDDEN.low, 1280, 2560, 4096, 7168, limits.MHC_HIDDEN.high])
def test_gemm_backward_width_is_the_shortest_critical_path(hidden):
    """Every Cube core sweeps all tokens of its column tiles: W minimizes the columns of the busiest Cube core
    (ties to the widest) and divides K."""
    plan, k, cores = gemm_with_sqrsum.BACKWARD_PLAN, 4 * hidden, CORES // 2
    width = plan.width(k, cores)
    assert k % width == 0
    busiest = {w: -(-(k // w) // cores) * w for w in plan.widths if k % w == 0}
    shortest = min(busiest.values())
    assert busiest[width] == shortest and width == max(w for w, c in busiest.items() if c == shortest)


@pytest.mark.parametrize("repeat", REPEAT.edges())
def test_sinkhorn_repeat_edges_fit_the_ub_estimate(repeat):
    # both kernels are lowered within the UB budget at both repeat edges by tests/test_limits.py (not twice)
    assert sinkhorn.mhc_sinkhorn_backward_ub_bytes(repeat) <= _build.UB_BUDGET_BYTES


def test_sinkhorn_repeat_limit_is_the_largest_that_fits():
    assert sinkhorn.mhc_sinkhorn_max_repeat() == REPEAT.high
    assert sinkhorn.mhc_sinkhorn_backward_ub_bytes(REPEAT.high + 1) > _build.UB_BUDGET_BYTES


@pytest.mark.parametrize("repeat", [REPEAT.low - 1, REPEAT.high + 1])
def test_sinkhorn_repeat_outside_the_range_is_refused(repeat):
    comb = torch.empty((8, 4, 4))
    calls = [
        lambda: sinkhorn.build_mhc_sinkhorn_forward(repeat, CORES),
        lambda: sinkhorn.build_mhc_sinkhorn_backward(repeat, CORES),
        lambda: sinkhorn.FORWARD.key(comb, repeat),
        lambda: sinkhorn.BACKWARD.key(comb, repeat),
    ]
    for call in calls:
        with pytest.raises(limits.LimitError, match=rf"mhc_sinkhorn_(forward|backward): repeat must be in \[1, {REPEAT.high}\]"):
            call()


OUT_OF_RANGE = {
    "expand hc_mult": lambda: expand.build_expand_to_mhc_forward(2560, 3, CORES),
    "expand hidden": lambda: expand.build_expand_to_mhc_backward(2560 + 32, 4, CORES),
    "pre_apply_mix hidden": lambda: pre_apply_mix.build_mhc_pre_apply_mix_forward(limits.MHC_HIDDEN.high + 64, 4, CORES),
    "post hc_mult": lambda: post.build_mhc_post_backward(2560, 8, CORES),
    "fn_normw_merge K": lambda: fn_normw_merge.build_mhc_fn_normw_merge_forward(24, 4 * 2560 + 64, CORES),
    "gemm M3": lambda: gemm_with_sqrsum.build_mhc_gemm_with_sqrsum_backward(33, 4 * 2560, CORES),
    "gemm n_splits": lambda: gemm_with_sqrsum.build_mhc_gemm_with_sqrsum_forward(24, 4 * 2560, 0, CORES // 2),
    "reduce n_splits": lambda: reduce_partials_and_rmsnorm.build_mhc_reduce_partials_and_rmsnorm_forward(0, CORES),
    "reduce M3": lambda: reduce_partials_and_rmsnorm.build_mhc_reduce_partials_and_rmsnorm_backward(33, CORES),
    "split mixes hc_mult": lambda: pre_split_mixes.build_mhc_pre_split_mixes_forward(2, CORES),
    "split mixes key": lambda: pre_split_mixes.FORWARD.key(torch.empty((8, 32))),
    "split mixes partials": lambda: pre_split_mixes.build_mhc_pre_split_mixes_backward_reduce(0),
    "head mix key": lambda: head_compute_mix.FORWARD.key(torch.empty((8, 2))),
    "head mix partials": lambda: head_compute_mix.build_mhc_head_compute_mix_backward(4, 0, CORES),
    "sinkhorn m": lambda: sinkhorn.BACKWARD.key(torch.empty((8, 3, 3)), 10),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_values_outside_the_declared_ranges_raise_limit_error(case):
    with pytest.raises(limits.LimitError, match=r"must be"):
        OUT_OF_RANGE[case]()


def test_no_assert_in_the_kernel_modules():
    """Ranges are checked with limits.LimitError, never with an assert (stripped under ``python -O``)."""
    package = pathlib.Path(sinkhorn.__file__).parent
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not asserts, (path.name, asserts)
