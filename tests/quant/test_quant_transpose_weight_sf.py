"""``transpose_weight_sf`` (docs/ops/quant.md#transpose_weight_sf): validation, the fake against the reference on
meta tensors, opcheck, torch.compile and the ``transpose_weight_sf_pairs`` wrapper (CPU tier, the reference as the
CPU kernel); the CUDA kernel lowered to sm_90a cubins and the Ascend 950 kernel to AscendC within the UB budget,
their launch views and keys (CPU tier); and on a GPU the CUDA kernel bitwise against the reference and against the
peer (DeepSeek's tile_kernels) when it imports."""

import shutil

import pytest
import torch
from _plugins.cuda_vectors import declared_vector_args, undeclared
from _plugins.device import requires_cuda
from _plugins.references import without_cpu_references
from quant_cases import transpose_weight_sf_call, weight_scales
from quant_ref import transpose_weight_sf_pairs_ref, transpose_weight_sf_ref
from quant_testing import metadata

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

F32 = torch.float32
HAVE_NVCC = shutil.which("nvcc") is not None


# --- validation -------------------------------------------------------------------------------------------


def _bad_calls():
    good = weight_scales((4, 8))
    return [
        ({"sf": []}, ValueError, r"'sf': expected at least one tensor"),
        ({"sf": good}, TypeError, r"'sf': expected a list of torch.Tensor, got torch.Tensor"),
        ({"sf": [good, 1.0]}, TypeError, r"'sf': expected a list of torch.Tensor, got list whose element \[1\] is "
                                         r"float 1.0"),
        ({"sf": [good.double()]}, TypeError, r"'sf\[0\]': expected dtype torch.float32 \(power-of-two scales\), got "
                                             r"torch.float64"),
        ({"sf": [good, good.view(-1)]}, ValueError, r"'sf\[1\]': expected a 2-D \(N/b, K/b\) or 3-D \(G, N/b, K/b\) "
                                                    r"tensor, got shape \(32,\)"),
        ({"sf": [weight_scales((3, 8))]}, ValueError, r"'sf\[0\]': expected N = N/b \* 32 a positive multiple of "
                                                      r"128, got shape \(3, 8\) \(N = 96\)"),
        ({"sf": [weight_scales((4, 0))]}, ValueError, r"'sf\[0\]': expected K = K/b \* 32 a positive multiple"),
        ({"sf": [weight_scales((8, 4)).t()]}, ValueError, r"'sf\[0\]': expected a contiguous tensor"),
        ({"sf": [good, good.to("meta")]}, ValueError, r"'sf\[1\]': expected a tensor on cpu \(the device of 'sf\[0\]'\)"),
        ({"block_size": 64}, ValueError, r"'block_size': expected one of \(32, 128\), got 64"),
        ({"block_size": 32.0}, TypeError, r"'block_size': expected an int, got float 32.0"),
        ({"transpose_sf1": 1}, TypeError, r"'transpose_sf1': expected a bool, got int 1"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("change,error,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_validation_names_op_and_argument(change, error, message):
    call = {**transpose_weight_sf_call(3, 128), **change}
    with without_cpu_references(), pytest.raises(error, match=rf"cann_ops_tilelang::transpose_weight_sf: argument "
                                                              rf"{message}"):
        ops.transpose_weight_sf(**call)


def test_block_128_takes_one_scale_per_128():
    ops.transpose_weight_sf([weight_scales((1, 3))], 128, False)  # N = 128, K = 384
    with pytest.raises(ValueError, match=r"'sf\[0\]': expected N = N/b \* 128 a positive multiple"):
        ops.transpose_weight_sf([weight_scales((0, 3))], 128, False)


# --- the fake, the reference, opcheck, compile ------------------------------------------------------------


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("transpose_sf1", [False, True])
def test_fake_matches_reference(block_size, transpose_sf1, seed):
    for tokens in (0, 1, 3):
        kw = dict(seed=seed, block_size=block_size, transpose_sf1=transpose_sf1)
        real = ops.transpose_weight_sf(**transpose_weight_sf_call(tokens, 256, **kw))
        fake = ops.transpose_weight_sf(**transpose_weight_sf_call(tokens, 256, device="meta", **kw))
        assert [metadata(t) for t in fake] == [metadata(t) for t in real], tokens
        assert len(real) == 4 and all(t.dtype == torch.int32 for t in real)


def test_outputs_are_the_contracts_words(seed):
    """The op (the reference on the CPU) against the words spelled out: ``sf0[g, n, w]`` byte ``i`` is the exponent
    of scale ``(n / b, 4w + i)``, ``sf1[g, k, w]`` byte ``i`` that of ``(4w + i, k / b)``, 0 past the last; the
    sign and mantissa dropped; the pairs function gives the same tensors as pairs."""
    b = 32
    sf = [weight_scales((2, 8, 12), seed=seed), weight_scales((4, 20), seed=seed + 1)]
    outs = ops.transpose_weight_sf(sf, b, False)
    pairs = ops.transpose_weight_sf_pairs(sf, b, True)
    for i, s in enumerate(sf):
        s3 = s if s.dim() == 3 else s.unsqueeze(0)
        e = ((s3.view(torch.int32) >> 23) & 0xFF).long()
        groups, nn, nk = e.shape
        sf0, sf1 = (t if s.dim() == 3 else t.unsqueeze(0) for t in outs[2 * i:2 * i + 2])
        t0, t1 = (t if s.dim() == 3 else t.unsqueeze(0) for t in pairs[i])
        assert torch.equal(t0, sf0) and torch.equal(t1.transpose(1, 2), sf1) and t1.is_contiguous()
        for g in range(groups):
            for w in range(-(-nk // 4)):
                want = sum((e[g, :, 4 * w + i] if 4 * w + i < nk else 0) << (8 * i) for i in range(4))
                assert torch.equal(sf0[g, :, w].long() & 0xFFFFFFFF, want.repeat_interleave(b))
            for w in range(-(-nn // 4)):
                want = sum((e[g, 4 * w + i, :] if 4 * w + i < nn else 0) << (8 * i) for i in range(4))
                assert torch.equal(sf1[g, :, w].long() & 0xFFFFFFFF, want.repeat_interleave(b))


def test_pairs_of_no_weights_are_no_pairs():
    assert ops.transpose_weight_sf_pairs([], 32, False) == []
    with pytest.raises(ValueError, match="transpose_weight_sf: argument 'block_size'"):
        ops.transpose_weight_sf_pairs([], 48, False)
    with pytest.raises(TypeError, match="transpose_weight_sf: argument 'transpose_sf1'"):
        ops.transpose_weight_sf_pairs([], 32, "no")


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("tokens", [0, 3])
def test_opcheck(block_size, tokens, seed):
    for transpose_sf1 in (False, True):
        call = transpose_weight_sf_call(tokens, 256, seed=seed, block_size=block_size, transpose_sf1=transpose_sf1)
        torch.library.opcheck(torch.ops.cann_ops_tilelang.transpose_weight_sf.default, tuple(call.values()))


def model(sf, transpose_sf1):
    return [a.sum() + b.sum() for a, b in ops.transpose_weight_sf_pairs(sf, 32, transpose_sf1)]


def test_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    first = True
    for groups in (2, 3, 5):
        sf = [weight_scales((groups, 8, 4 * groups + 4), seed=seed), weight_scales((4, 8), seed=seed)]
        with torch._dynamo.config.patch(error_on_recompile=not first):
            got = compiled(sf, True)
        first = False
        assert all(torch.equal(g, w) for g, w in zip(got, model(sf, True))), groups


def test_reference_takes_one_flag_or_one_per_weight(seed):
    sf = transpose_weight_sf_call(3, 128, seed=seed)["sf"]
    both = transpose_weight_sf_pairs_ref(sf, 32, [True, True])
    flat = transpose_weight_sf_ref(sf, 32, True)
    assert all(torch.equal(a, b) for a, b in zip((t for p in both for t in p), flat))


# --- the CUDA kernel: lowering, launch views, keys ----------------------------------------------------------

tilelang = pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402
from cann_ops_tilelang.kernels.cuda.quant import transpose_weight_sf as cuda_kernel  # noqa: E402

CASES = sorted(cuda_kernel.TRANSPOSE_WEIGHT_SF.case_keys(limits.QUANT_HIDDEN_SIZES[0], 4))


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("name", CASES)
def test_cuda_compiles_to_sm90a_cubin(name):
    built = cuda_build.compile_cubin(cuda_kernel.lowering_cases(128)[name], arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == cuda_kernel.TRANSPOSE_PLAN.threads
    assert not undeclared(f"transpose_weight_sf/{name}", built.source, declared_vector_args())
    # both outputs written in 16-byte stores of four words
    assert "*(int4*)(sf0 + " in built.source and "*(int4*)(sf1 + " in built.source


def test_the_kernel_is_one_per_block_size_and_every_shape_is_dynamic():
    from tvm import tirx

    assert {k.block_size for k in cuda_kernel.TRANSPOSE_WEIGHT_SF.case_keys(7168, 4).values()} == {32, 128}
    prim_func = cuda_kernel.lowering_cases(7168)["transpose_weight_sf_b32"]
    sf = prim_func.buffer_map[prim_func.params[0]]
    assert all(isinstance(d, tirx.Var) for d in sf.shape)


@pytest.mark.parametrize("transpose_sf1", [False, True])
def test_launcher_passes_the_buffers_behind_the_outputs(transpose_sf1, monkeypatch):
    """One launch per weight with groups, each with the row-major buffers behind its outputs (the shapes of the
    prim_func's buffers); the key is the block size alone."""
    seen = []
    monkeypatch.setattr(cuda_kernel.TRANSPOSE_WEIGHT_SF, "compiled", lambda key: lambda *args: seen.append((key, args)))
    for tokens in (0, 3):
        call = transpose_weight_sf_call(tokens, 256, transpose_sf1=transpose_sf1)
        outs = ops.transpose_weight_sf.prepare(**call)
        seen.clear()
        cuda_kernel.transpose_weight_sf(**call, outs=outs)
        assert len(seen) == (2 if tokens else 1)  # the grouped weight of no groups launches nothing
        for (key, (sf, sf0, sf1)), weight_sf, i in zip(seen, call["sf"], range(2)):
            assert key == cuda_kernel.TransposeKey(32)
            assert sf.dim() == sf0.dim() == sf1.dim() == 3 and all(t.is_contiguous() for t in (sf, sf0, sf1))
            groups, nn, nk = sf.shape
            assert sf0.shape == (groups, -(-nk // 4), nn * 32) and sf1.shape == (groups, -(-nn // 4), nk * 32)
            assert sf0.data_ptr() == outs[2 * i].data_ptr() and sf1.data_ptr() == outs[2 * i + 1].data_ptr()
            assert sf.data_ptr() == weight_sf.data_ptr()


def test_key_refuses_what_the_limits_refuse():
    with pytest.raises(limits.LimitError, match="block_size must be one of"):
        cuda_kernel.build_transpose_weight_sf(64)


# --- the Ascend 950 kernel ------------------------------------------------------------------------------------

from cann_ops_tilelang.kernels.ascend import _build as ascend_build  # noqa: E402
from cann_ops_tilelang.kernels.ascend.quant import transpose_weight_sf as ascend_kernel  # noqa: E402


@pytest.mark.parametrize("name", sorted(ascend_kernel.transpose_cases(128, 4)))
def test_ascend_lowers_within_ub(name):
    key = ascend_kernel.transpose_cases(128, 4)[name]
    lowered = ascend_build.lower_ascendc(ascend_kernel.TRANSPOSE_WEIGHT_SF.prim_func(key))
    assert "__global__" in lowered.source and not lowered.has_simt
    assert 0 < lowered.ub_bytes <= ascend_kernel.ub_bytes(key.block_size) <= lowered.budget_bytes
    source = lowered.source
    assert "vdintlv" in source and "vsts_pack_b32" in source and "vlds_brc_elem<int16_t>" in source


def test_ascend_key_checks_and_launcher(monkeypatch):
    with pytest.raises(limits.LimitError, match="block_size"):
        ascend_kernel.build_transpose_weight_sf(64, 64)
    with pytest.raises(limits.LimitError, match="num_cores"):
        ascend_kernel.build_transpose_weight_sf(32, 0)
    seen = []
    monkeypatch.setattr(ascend_kernel.TRANSPOSE_WEIGHT_SF, "compiled", lambda key: lambda *a: seen.append((key, a)))
    sf = [weight_scales((4, 6)).to("meta"), weight_scales((2, 8, 4)).to("meta")]
    from cann_ops_tilelang.quant.transpose_weight_sf import weight_sf_outputs

    outs = [t for s in sf for t in weight_sf_outputs(s, 32, True, "ascend")]
    ascend_kernel.transpose_weight_sf(sf=sf, block_size=32, transpose_sf1=True, outs=outs)
    assert len(seen) == 2 and seen[0][0].block_size == 32
    _, (w, sf0, sf1) = seen[0]
    assert w.shape == (1, 4, 6) and sf0.shape == (1, 3, 128) and sf1.shape == (1, 2, 192)
    assert sf0.dtype == sf1.dtype == torch.int16 and sf0.is_contiguous() and sf1.is_contiguous()


# --- device: the kernel bitwise against the reference and the peer ------------------------------------------


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("transpose_sf1", [False, True])
def test_device_kernel_bitwise(block_size, transpose_sf1, seed):
    """Odd and even word counts, ragged packs, a mantissa and a sign dropped, model sizes."""
    nb = 128 // block_size
    shapes = [(nb, nb), (3 * nb, 5 * nb), (4, 9 * nb, 7 * nb), (7168 // block_size, 2048 // block_size),
              (8, 4096 // block_size, 7168 // block_size)]
    sf = [weight_scales(s, seed=seed + i) for i, s in enumerate(shapes)]
    want = transpose_weight_sf_ref(sf, block_size, transpose_sf1)
    got = ops.transpose_weight_sf([s.cuda() for s in sf], block_size, transpose_sf1)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride() and torch.equal(g.cpu(), w)


@requires_cuda
@pytest.mark.device
@pytest.mark.parametrize("block_size", [32, 128])
def test_device_equals_the_peer(block_size, seed):
    peer = pytest.importorskip("tile_kernels.quant")
    nb = 128 // block_size
    sf = [(torch.randint(1, 254, s, dtype=torch.int32) << 23).view(F32).cuda()
          for s in ((3 * nb, 5 * nb), (4, 9 * nb, 7 * nb), (7168 // block_size, 2048 // block_size))]
    for transpose_sf1 in (False, True):
        theirs = peer.batched_transpose_weight_sf(sf, block_size, [transpose_sf1] * len(sf), [None] * len(sf))
        mine = ops.transpose_weight_sf_pairs(sf, block_size, transpose_sf1)
        for pair, their in zip(mine, theirs):
            for a, b in zip(pair, their):
                assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
