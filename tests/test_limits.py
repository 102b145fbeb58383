"""Every range declared in limits.py, at its edges: both backends' kernels lower there (CUDA for sm_90a with
its shared memory and threads within the budget, AscendC within the UB), and one step past an edge is refused
by the op's validation (a ValueError naming the op and the argument) and by the kernel builders
(``limits.LimitError``, a ValueError), never by an assert."""

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cann_ops_tilelang as ops
from cann_ops_tilelang import chips, limits
from cann_ops_tilelang.limits import LimitError

pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402

ARCH = chips.H200.arch.name
CORES = chips.ASCEND_950.vector_cores
M, M3 = 4, 24
# op modules whose kernels do not depend on H (lowered at the other ranges' edges and in the lowering tests): the
# mHC per-token kernels, the Engram hash and the Engram Sinkhorn optimizer's kernels (also "sinkhorn/")
_SIZE_FREE = ("reduce_partials_and_rmsnorm/", "pre_split_mixes/", "sinkhorn/", "head_compute_mix/", "hash/")
# the fused mHC kernels: every case is lowered at the hidden-size edges by their own files, with their stricter
# checks (tests/mhc/test_mhc_pre_big_fuse.py, tests/mhc/test_mhc_multilayer_recompute.py), so not twice
_OWN_EDGES = ("pre_big_fuse/", "multilayer_recompute/")


def kernels(backend: str, family: str, module: str):
    return importlib.import_module(f"cann_ops_tilelang.kernels.{backend}.{family}.{module}")


def lowers(backend: str, prim_func) -> None:
    """Lowers for the backend and checks the kernel's on-chip memory against the chip's budget."""
    if backend == "cuda":
        built = cuda_build.lower(prim_func, arch=ARCH)
        assert "__global__" in built.source and built.fits, (built.smem_bytes, built.threads)
    else:
        lowered = ascend_build.lower_ascendc(prim_func)
        assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (lowered.ub_bytes, lowered.budget_bytes)


HIDDEN_EDGES = [(family, h, backend) for family in sorted({p.declaration.family for p in ops.registered_ops().values()})
                for h in limits.hidden_sizes(family)[1].edges() for backend in ("cuda", "ascend")]


@pytest.mark.parametrize("family,hidden,backend", HIDDEN_EDGES)
def test_every_kernel_lowers_at_the_hidden_size_edges(family, hidden, backend):
    family_kernels = importlib.import_module(f"cann_ops_tilelang.kernels.{backend}.{family}")
    cases = {k: v for k, v in family_kernels.lowering_cases(hidden).items()
             if not k.startswith(_SIZE_FREE + _OWN_EDGES)}
    assert cases
    for name, prim_func in sorted(cases.items()):
        try:
            lowers(backend, prim_func)
        except AssertionError as exc:
            raise AssertionError(f"{backend} {family} {name} at H = {hidden}: {exc}") from None


@pytest.mark.parametrize("backend", ["cuda", "ascend"])
def test_sinkhorn_lowers_at_both_repeat_edges_and_refuses_one_more(backend):
    module = kernels(backend, "mhc", "sinkhorn")
    rng = limits.MHC_SINKHORN_REPEAT[backend]
    extra = (M,) if backend == "cuda" else ()
    for repeat in rng.edges():
        for build in (module.build_mhc_sinkhorn_forward, module.build_mhc_sinkhorn_backward):
            args = (*extra, repeat) if backend == "cuda" else (repeat, CORES)
            lowers(backend, build(*args))
    for build in (module.build_mhc_sinkhorn_forward, module.build_mhc_sinkhorn_backward):
        args = (*extra, rng.high + 1) if backend == "cuda" else (rng.high + 1, CORES)
        with pytest.raises(LimitError, match=f"repeat must be in \\[1, {rng.high}\\]"):
            build(*args)


@pytest.mark.parametrize("hidden", limits.MHC_HIDDEN.edges())
def test_gemm_forward_lowers_at_both_split_edges(hidden):
    k = M * hidden
    splits = limits.mhc_gemm_splits(k)
    cuda = kernels("cuda", "mhc", "gemm_with_sqrsum")
    from cann_ops_tilelang.kernels.cuda.mhc.gemm_with_sqrsum.forward import forward_key

    ascend = kernels("ascend", "mhc", "gemm_with_sqrsum")
    for s in splits.edges():
        lowers("cuda", cuda.FORWARD.prim_func(forward_key(k, M3, s, chips.H200.sms)))
        lowers("ascend", ascend.build_mhc_gemm_with_sqrsum_forward(M3, k, s, CORES // 2))


def test_grad_w_reduce_lowers_at_the_partial_row_edges():
    cuda = kernels("cuda", "engram", "grad_w_reduce")
    ascend = kernels("ascend", "engram", "grad_w_reduce")
    high = limits.ENGRAM_GRAD_W_PARTIALS["ascend"].high
    assert ascend.max_partials() == high  # the UB bound and the declared limit agree
    for p in (1, high):
        lowers("ascend", ascend.build_engram_grad_w_reduce(p, M * 8192, CORES))
        lowers("cuda", cuda.build_engram_grad_w_reduce(8192, M, p))
    with pytest.raises(LimitError):
        ascend.build_engram_grad_w_reduce(high + 1, M * 8192, CORES)


def test_head_mix_backward_lowers_at_the_partial_row_edges():
    cuda = kernels("cuda", "mhc", "head_compute_mix")
    ascend = kernels("ascend", "mhc", "head_compute_mix")
    high = limits.MHC_HEAD_MIX_PARTIALS["cuda"].high
    for p in (1, high):
        lowers("cuda", cuda.build_mhc_head_compute_mix_backward(M, p))
        lowers("ascend", ascend.build_mhc_head_compute_mix_backward(M, p, CORES))
    with pytest.raises(LimitError):
        cuda.build_mhc_head_compute_mix_backward(M, high + 1)


def test_fused_weight_lowers_at_the_smallest_and_a_model_size():
    for numel in (limits.ENGRAM_FUSED_WEIGHT_ALIGN, M * limits.ENGRAM_HIDDEN.high):
        lowers("cuda", kernels("cuda", "engram", "fused_weight").build_engram_fused_weight(numel))
        lowers("ascend", kernels("ascend", "engram", "fused_weight").build_engram_fused_weight(numel, CORES))


@pytest.mark.parametrize("builder", ["cuda", "ascend"])
def test_builders_refuse_hidden_sizes_past_the_edges(builder):
    gate = kernels(builder, "engram", "gate")
    for hidden in (limits.ENGRAM_HIDDEN.low - 256, limits.ENGRAM_HIDDEN.high + 256):
        with pytest.raises(LimitError, match="hidden size"):
            if builder == "cuda":
                gate.build_engram_gate_forward(hidden, M, False, False)
            else:
                gate.build_engram_gate_forward(hidden, M, True, False, False, CORES)


# --- validation: one step past every edge, on fake tensors of each backend's device -----------------------

def _fake(device: str):
    mode = FakeTensorMode()

    def empty(*shape, dtype=torch.float32):
        with mode:
            return torch.empty(*shape, dtype=dtype, device=device)

    return empty


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_validation_refuses_one_step_past_every_edge(device):
    empty = _fake(device)
    bf = torch.bfloat16
    cases = []
    for hidden in (limits.ENGRAM_HIDDEN.low - 256, limits.ENGRAM_HIDDEN.high + 256, 768 + 128):
        cases.append(("engram_fused_weight", "weight_hidden", lambda h=hidden: ops.engram_gate_forward(
            empty(2, M, h, dtype=bf), empty(2, M + 1, h, dtype=bf), empty(M, h), 1e-6, 1e-6), "hidden_states"))
    for hidden in (limits.MHC_HIDDEN.low - 64, limits.MHC_HIDDEN.high + 64, 320 + 32):
        cases.append(("", "", lambda h=hidden: ops.expand_to_mhc_forward(empty(2, h, dtype=bf),
                                                                           empty(2, M, h, dtype=bf)), "x"))
    repeat = limits.MHC_SINKHORN_REPEAT.of(device).high + 1
    cases.append(("", "", lambda: ops.mhc_sinkhorn_forward(empty(2, M, M), empty(2, M, M), repeat, 1e-6), "repeat"))
    cases.append(("", "", lambda: ops.mhc_sinkhorn_forward(empty(2, M, M), empty(2, M, M), 0, 1e-6), "repeat"))
    k = M * 256
    for s in (0, k // 64 + 1):
        cases.append(("", "", lambda s=s: ops.mhc_gemm_with_sqrsum_forward(empty(2, k, dtype=bf), empty(M3, k), s),
                      "n_splits"))
    if device == "cuda":
        p = limits.MHC_HEAD_MIX_PARTIALS["cuda"].high + 1
        cases.append(("", "", lambda: ops.mhc_head_compute_mix_backward(
            empty(2, M), empty(2, M), empty(1), empty(M), empty(2, M), empty(p, 1), empty(p, M)),
            "grad_mhc_scale_partial"))
    for _, _, call, arg in cases:
        with pytest.raises(ValueError, match=f"argument '{arg}': expected"):
            call()


def test_backend_ranges_by_device_type():
    assert limits.MHC_SINKHORN_REPEAT.of("cuda").high == 64
    assert limits.MHC_SINKHORN_REPEAT.of("privateuseone").high == limits.MHC_SINKHORN_REPEAT.of("npu").high == 22
    assert limits.ENGRAM_GRAD_W_PARTIALS.of("privateuseone").high == 476
    assert limits.ENGRAM_GRAD_W_PARTIALS.of("cuda").high is None
    # no kernel on the device: the widest range (the op then reports the device itself)
    assert limits.MHC_SINKHORN_REPEAT.of("cpu").high == 64
