"""CPU tier: the CUDA kernel of ``mhc_pre_big_fuse`` (kernels/cuda/mhc/pre_big_fuse.py).

Every lowering case builds an sm_90a cubin within the CTA limits at the model sizes H in {4096, 7168} and lowers
within them at the guarded and edge hidden sizes (which tests/test_limits.py leaves to this file), the token count
is a dynamic dimension and never part of the compile key, the 16-byte accesses are the ones the op declares,
out-of-range builds raise ``LimitError``, and the launcher passes its tensors in the kernel's order with
``rms_group_size = m*H``. Bitwise equality with the unfused chain is a device test
(tests/mhc/test_mhc_fused_device.py).
"""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared, vector_accesses

pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda import mhc as cuda_mhc  # noqa: E402
from cann_ops_tilelang.kernels.cuda.mhc import pre_big_fuse as pbf  # noqa: E402
from cann_ops_tilelang.limits import MHC_SINKHORN_REPEAT, LimitError  # noqa: E402

HAVE_NVCC = shutil.which("nvcc") is not None
# The sizes that matter: the model sizes (cubins) and the range's edges plus a guarded layout (H / 8 = 40 vectors:
# 64 streaming threads, the last 24 slots guarded), lowered with the CTA limits; other sizes take the same paths.
HIDDEN = [4096, 7168]
EDGE_HIDDEN = [256, 320, 8192]
PARAMS = ["gemm_out_mul", "gemm_out_sqrsum", "mhc_scale", "mhc_base", "residual", "post_mix", "comb_mix",
          "layer_input", "rms_group_size", "rms_eps", "pre_eps", "sinkhorn_eps", "post_mult_value"]


def _case_names(hidden):
    return sorted(pbf.lowering_cases(hidden))


def test_lowering_cases_are_named_after_the_launcher_and_aggregated():
    cases = pbf.lowering_cases(4096)
    most = 4 * 4096 // 64
    assert sorted(cases) == sorted(["mhc_pre_big_fuse_s16_r10", "mhc_pre_big_fuse_s16_r20", "mhc_pre_big_fuse_s1_r20",
                                    f"mhc_pre_big_fuse_s{most}_r1"])
    family = cuda_mhc.lowering_cases(4096)
    assert {f"pre_big_fuse/{name}" for name in cases} <= set(family)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("index", range(4))
def test_compiles_to_sm90a_cubin(hidden, index):
    name = _case_names(hidden)[index]
    built = cuda_build.compile_cubin(pbf.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
    assert built.fits, (name, hidden, built.smem_bytes, built.budget_bytes, built.threads)
    threads, tokens, _ = pbf.grid_layout(hidden)
    assert built.threads == threads
    layout = pbf.stream_layout(hidden)
    assert built.smem_bytes >= pbf.plan_for(hidden).stages * 4 * layout.threads * 16 + tokens * 4 * 4  # ring + pre table
    assert not undeclared(f"pre_big_fuse/{name}", built.source, declared_vector_args())


@pytest.mark.parametrize("hidden", EDGE_HIDDEN)
def test_edge_and_guarded_hidden_sizes_lower_within_the_cta_limits(hidden):
    for name, prim_func in pbf.lowering_cases(hidden).items():
        built = cuda_build.lower(prim_func)
        assert built.fits, (name, hidden, built.smem_bytes, built.threads)
        assert built.threads == pbf.grid_layout(hidden)[0]


def test_parameters_and_vector_accesses():
    """The kernel takes the launcher's tensors under their op names (no ARGUMENTS needed) plus ``rms_group_size``,
    reads ``residual`` (cp.async) and writes ``layer_input`` in 16-byte vectors, every mix by scalar accesses."""
    prim_func = pbf.build_mhc_pre_big_fuse(16, 4096, 4, 20)
    names = [prim_func.buffer_map[p].name if p in prim_func.buffer_map else p.name for p in prim_func.params]
    assert names == PARAMS
    source = cuda_build.lower_source(prim_func)
    assert vector_accesses(source) == {"residual": 16, "layer_input": 16}
    assert not hasattr(pbf, "ARGUMENTS")


@pytest.mark.parametrize("hidden", [1280, 4096])
def test_token_count_is_dynamic_and_never_in_the_key(hidden):
    from tvm import tirx

    prim_func = pbf.build_mhc_pre_big_fuse(16, hidden, 4, 10)
    dims = {prim_func.buffer_map[p].shape[0] for p in prim_func.params
            if p in prim_func.buffer_map and len(prim_func.buffer_map[p].shape) == 3}
    assert any(isinstance(d, tirx.Var) for d in dims)
    assert isinstance(prim_func.buffer_map[prim_func.params[1]].shape[1], tirx.Var)  # gemm_out_sqrsum (S, T)

    def key(tokens):
        gemm_out_mul = torch.empty(16, tokens, 24, device="meta")
        residual = torch.empty(tokens, 4, hidden, dtype=torch.bfloat16, device="meta")
        return pbf.KERNEL.key(gemm_out_mul, residual, 10, 16)

    assert key(1) == key(509) == key(8192) == pbf.BigFuseKey(n_splits=16, hidden_size=hidden, hc_mult=4, repeat=10)


@pytest.mark.parametrize("args", [
    (16, 4000, 4, 10),  # H not a multiple of 64
    (16, 192, 4, 10),  # H below the range
    (16, 8256, 4, 10),  # H above the range
    (0, 4096, 4, 10),  # no split
    (4 * 4096 // 64 + 1, 4096, 4, 10),  # more splits than 64-column blocks
    (16, 4096, 4, 0),  # no Sinkhorn iteration
    (16, 4096, 4, MHC_SINKHORN_REPEAT["cuda"].high + 1),
    (16, 4096, 2, 10),  # m != 4
])
def test_out_of_range_builds_raise_limit_error(args):
    with pytest.raises(LimitError):
        pbf.build_mhc_pre_big_fuse(*args)


def test_key_refuses_a_split_count_that_is_not_the_partials():
    gemm_out_mul = torch.empty(8, 3, 24, device="meta")
    residual = torch.empty(3, 4, 4096, dtype=torch.bfloat16, device="meta")
    with pytest.raises(LimitError):
        pbf.KERNEL.key(gemm_out_mul, residual, 10, 16)


def test_launch_order(monkeypatch):
    """The key is (S, H, m, R); the launcher passes the tensors in the kernel's order (``comb_mix`` as (T, m*m)),
    ``rms_group_size = m*H`` and the scalars as floats."""
    tokens, hidden, splits = 3, 256, 4
    f32, bf16 = torch.float32, torch.bfloat16
    tensors = dict(gemm_out_mul=torch.zeros(splits, tokens, 24), gemm_out_sqrsum=torch.zeros(splits, tokens),
                   mhc_scale=torch.zeros(3), mhc_base=torch.zeros(24),
                   residual=torch.zeros(tokens, 4, hidden, dtype=bf16), post_mix=torch.zeros(tokens, 4, dtype=f32),
                   comb_mix=torch.zeros(tokens, 16), layer_input=torch.zeros(tokens, hidden, dtype=bf16))
    calls = []
    monkeypatch.setattr(pbf.KERNEL, "compiled", lambda key: lambda *args: calls.append((key, args)))
    pbf.mhc_pre_big_fuse(**tensors, rms_eps=1e-6, pre_eps=1e-2, sinkhorn_eps=1e-6, post_mult_value=2,
                         sinkhorn_repeat=20, n_splits=splits)
    (key, args), = calls
    assert key == pbf.BigFuseKey(n_splits=splits, hidden_size=hidden, hc_mult=4, repeat=20)
    assert len(args) == len(PARAMS)
    for name, arg in zip(PARAMS[:8], args[:8]):
        assert arg.data_ptr() == tensors[name].data_ptr() and arg.shape == tensors[name].shape, name
    assert args[8:] == (4.0 * hidden, 1e-6, 1e-2, 1e-6, 2.0)
    assert all(type(a) is float for a in args[8:])


@pytest.mark.parametrize("hidden,warps,threads", [(1280, 1, 224), (1280, 4, 320), (4096, 4, 192), (7168, 1, 192)])
def test_sinkhorn_warps_plan_lowers(hidden, warps, threads):
    """The alternative schedule with Sinkhorn warps of their own (up to one per pass left to the CTA after sharing
    the group's passes out over its chunks): within the CTA limits, a named barrier for the pre warp and streams."""
    import dataclasses

    plan = dataclasses.replace(pbf.PLAN, sinkhorn_warps=warps)
    assert pbf.grid_layout(hidden, plan)[0] == threads
    built = cuda_build.lower(pbf.build_mhc_pre_big_fuse(16, hidden, 4, 20, plan))
    assert built.fits and built.threads == threads
    assert "__sync_thread_partial(1, " in built.source and "__syncthreads()" not in built.source
