"""CPU tier: the CUDA kernel of ``mhc_multilayer_recompute`` (kernels/cuda/mhc/multilayer_recompute.py).

Every lowering case builds an sm_90a cubin within the CTA limits at the edge, guarded and model hidden sizes (which
tests/test_limits.py and the family's lowering test leave to this file), its parameters are the list elements in
the launcher's order with one dynamic token count, the 16-byte accesses are the ones the op declares, out-of-range
builds raise
``LimitError``, and the kernel's fp32 arithmetic has the contraction shape of the chain it replaces
(``mhc_pre_apply_mix_forward`` then ``mhc_post_forward``), which is what makes it bitwise equal to it.
"""

import re
import shutil
import subprocess
import tempfile

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared, vector_accesses

pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda import mhc as cuda_mhc  # noqa: E402
from cann_ops_tilelang.kernels.cuda.mhc import _common, post, pre_apply_mix  # noqa: E402
from cann_ops_tilelang.kernels.cuda.mhc import multilayer_recompute as mr  # noqa: E402
from cann_ops_tilelang.limits import MHC_RECOMPUTE_LAYERS, LimitError  # noqa: E402

HAVE_NVCC = shutil.which("nvcc") is not None
LAYERS = [(1, 1), (3, 2), (3, 3), (10, 9), (10, 10)]
# the sizes that matter: the range's edges, a guarded layout (H / 8 = 40 vectors: 64 threads, the last 24 slots
# guarded) and the model sizes
HIDDEN = [256, 320, 4096, 7168, 8192]


def test_lowering_cases_cover_the_layer_counts():
    cases = mr.lowering_cases(4096)
    assert sorted(cases) == sorted(f"mhc_multilayer_recompute_l{l}_p{p}" for l, p in LAYERS)
    assert all(name.startswith("mhc_multilayer_recompute") for name in cases)
    family = cuda_mhc.lowering_cases(4096)
    assert {f"multilayer_recompute/{name}" for name in cases} <= set(family)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("name", sorted(mr.lowering_cases(4096)))
def test_compiles_to_sm90a_cubin(hidden, name):
    built = cuda_build.compile_cubin(mr.lowering_cases(hidden)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and len(built.cubin) > 1000
    assert built.fits, (name, hidden, built.smem_bytes, built.budget_bytes, built.threads)
    assert built.threads == mr.recompute_layout(hidden).threads
    layers, post_layers = (int(v) for v in re.search(r"_l(\d+)_p(\d+)", name).groups())
    # the per-layer scalar table and the threads' slots of the layer outputs in flight (16 bytes each)
    slots = min(mr.PLAN.y_stages, post_layers) * built.threads * 16
    assert built.smem_bytes == layers * 24 * 4 + slots
    assert not undeclared(f"multilayer_recompute/{name}", built.source, declared_vector_args())


def test_widest_chain_lowers():
    """L = Lp = 64 (the top of limits.MHC_RECOMPUTE_LAYERS): 385 parameters, within the CTA limits."""
    high = MHC_RECOMPUTE_LAYERS.high
    prim_func = mr.build_mhc_multilayer_recompute(8192, 4, high, high)
    assert len(prim_func.params) == 6 * high + 1
    assert 6 * high * 8 + 8 + 4 <= 4096  # pointers and the token count in the classic kernel parameter space
    assert cuda_build.lower(prim_func).fits


@pytest.mark.parametrize("layers,post_layers", LAYERS + [(1, 0), (7, 6)])
def test_parameters_are_the_list_elements_in_launcher_order(layers, post_layers):
    from tvm import tirx

    prim_func = mr.build_mhc_multilayer_recompute(1280, 4, layers, post_layers)
    names = [prim_func.buffer_map[p].name for p in prim_func.params]
    assert names == mr.kernel_arguments(layers, post_layers)
    assert names[0] == "initial_residual"
    assert sum(n.startswith("pre_mix_list_") for n in names) == layers
    assert sum(n.startswith("residual_list_") for n in names) == post_layers
    # one dynamic token count shared by every buffer
    dims = {prim_func.buffer_map[p].shape[0] for p in prim_func.params}
    assert len(dims) == 1 and isinstance(dims.pop(), tirx.Var)
    # every parameter maps to its op argument
    assert all(mr.ARGUMENTS.get(n, n) in {"initial_residual", *(name for name, _ in mr.LISTS)} for n in names)


def test_arguments_cover_every_layer():
    high = MHC_RECOMPUTE_LAYERS.high
    for name, _ in mr.LISTS:
        assert mr.ARGUMENTS[f"{name}_0"] == name and mr.ARGUMENTS[f"{name}_{high - 1}"] == name
        assert f"{name}_{high}" not in mr.ARGUMENTS


def test_vector_accesses():
    """16-byte vectors on the (T, ., H) tensors of every layer; the mixes are read by scalar loads."""
    source = cuda_build.lower_source(mr.build_mhc_multilayer_recompute(4096, 4, 3, 2))
    accesses = vector_accesses(source)
    expected = {"initial_residual": 16, "layer_output_list_0": 16, "layer_output_list_1": 16,
                **{f"layer_input_list_{l}": 16 for l in range(3)}, "residual_list_0": 16, "residual_list_1": 16}
    assert accesses == expected


def test_key_and_launch_order(monkeypatch):
    """The key is (H, m, L, Lp), never T; the launcher passes the lists unpacked in the kernel's parameter order."""
    tokens, hidden, layers, post_layers = 3, 256, 3, 2
    bf16, f32 = torch.bfloat16, torch.float32
    named = {"initial_residual": torch.zeros(tokens, 4, hidden, dtype=bf16)}
    shapes = {"pre_mix_list": ((tokens, 4), f32), "layer_output_list": ((tokens, hidden), bf16),
              "post_mix_list": ((tokens, 4), f32), "comb_mix_list": ((tokens, 4, 4), f32),
              "layer_input_list": ((tokens, hidden), bf16), "residual_list": ((tokens, 4, hidden), bf16)}
    lists = {}
    for name, count in mr.LISTS:
        shape, dtype = shapes[name]
        lists[name] = [torch.zeros(shape, dtype=dtype) for _ in range(layers if count == "L" else post_layers)]
        named.update({f"{name}_{l}": t for l, t in enumerate(lists[name])})
    calls = []
    monkeypatch.setattr(mr.KERNEL, "compiled", lambda key: lambda *args: calls.append((key, args)))
    mr.mhc_multilayer_recompute(named["initial_residual"], **lists)
    (key, args), = calls
    assert key == mr.RecomputeKey(hidden, 4, layers, post_layers)
    expected = [named[n] for n in mr.kernel_arguments(layers, post_layers)]
    assert len(args) == len(expected) and all(a is e for a, e in zip(args, expected))


@pytest.mark.parametrize("args", [
    (4096, 4, 0, 0),  # no layer
    (4096, 4, MHC_RECOMPUTE_LAYERS.high + 1, MHC_RECOMPUTE_LAYERS.high + 1),
    (4096, 4, 3, 1),  # Lp must be L - 1 or L
    (4096, 4, 3, 4),
    (4000, 4, 3, 3),  # H not a multiple of 64
    (128, 4, 3, 3),  # H below the range
    (4096, 2, 3, 3),  # m != 4
])
def test_out_of_range_builds_raise_limit_error(args):
    with pytest.raises(LimitError):
        mr.build_mhc_multilayer_recompute(*args)


def _ptx_float_ops(prim_func) -> dict:
    """Counts of the fp32 multiply, add and fused multiply-add instructions in the PTX of ``prim_func``."""
    from tilelang.contrib.nvcc import default_compile_options

    source = cuda_build.lower_source(prim_func)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/kernel.cu"
        with open(path, "w") as f:
            f.write(source)
        subprocess.run(["nvcc", "--ptx", "-O3", "-arch=sm_90a", "-w", *default_compile_options(), "-o",
                        f"{tmp}/kernel.ptx", path], check=True, capture_output=True)
        with open(f"{tmp}/kernel.ptx") as f:
            ptx = f.read()
    return {op: len(re.findall(rf"^\s*{op}(?:\.rn)?\.f32\s", ptx, re.M)) for op in ("mul", "add", "fma")}


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build PTX here")
def test_arithmetic_has_the_chains_contraction_shape():
    """Per output element, the chain's kernels leave exactly one product unfused (rounded) and fuse the rest into
    FMAs (m - 1 for a sublayer input, m for a residual), with no separate add; the fused kernel does exactly the
    same per layer, so nvcc gave it the same fp32 sequences (checked bitwise on an H200 as well)."""
    hidden, m, layers, post_layers = 4096, 4, 3, 2
    apply_vectors = _common.row_chunk(pre_apply_mix.forward_layout(hidden).nv)  # vectors per thread
    post_vectors = _common.row_chunk(post.forward_layout(hidden).nv)
    apply_ops = _ptx_float_ops(pre_apply_mix.build_mhc_pre_apply_mix_forward(hidden, m))
    post_ops = _ptx_float_ops(post.build_mhc_post_forward(hidden, m))
    ours = _ptx_float_ops(mr.build_mhc_multilayer_recompute(hidden, m, layers, post_layers))
    vec = _common.VEC
    assert apply_ops == {"mul": apply_vectors * vec, "add": 0, "fma": apply_vectors * vec * (m - 1)}
    assert post_ops == {"mul": post_vectors * m * vec, "add": 0, "fma": post_vectors * m * vec * m}
    assert ours == {op: layers * apply_ops[op] // apply_vectors + post_layers * post_ops[op] // post_vectors
                    for op in ("mul", "add", "fma")}
