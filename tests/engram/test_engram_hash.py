"""``engram_hash`` (docs/ops/engram.md#hash): the exact int64 contract of the reference, validation, fakes,
opcheck and torch.compile (CPU tier), both backends' kernels lowered (at the sizes that matter and at the Ascend
range edges) and their generated code run on the host against the reference (CPU tier), and the device kernels
bitwise against the reference (device tier)."""

import ctypes
import os
import re
import shutil
import subprocess

import pytest
import torch
from _plugins import cases
from _plugins.device import requires_device
from _plugins.references import without_cpu_references
from engram_ref import engram_hash_ref, make_hash_inputs
from engram_testing import lowering_tests
from torch._subclasses.fake_tensor import FakeTensorMode

import cann_ops_tilelang as ops
from cann_ops_tilelang import limits

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
# (N, L, E): the Engram layer's shape, a wider one, the smallest, one with V = 2 and one with odd E (V = 1)
SHAPES = [(3, 2, 8), (3, 3, 8), (2, 1, 1), (4, 3, 2), (5, 2, 3)]
HAVE_GXX = shutil.which("g++") is not None


def gen(seed):
    return torch.Generator().manual_seed(seed)


def wrap32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value


def wrap64(value: int) -> int:
    value &= 0xFFFFFFFFFFFFFFFF
    return value - 2**64 if value >= 2**63 else value


def scalar_hash(ids, mult, sizes, offs, mask):
    """The contract element by element in Python integers (a second, loop-by-loop oracle)."""
    layers, orders, tables = sizes.shape
    out = torch.empty(layers, ids.shape[0], orders * tables, dtype=torch.int32)
    for lay in range(layers):
        for t in range(ids.shape[0]):
            h = 0
            for k in range(orders + 1):
                h = wrap64(h ^ wrap64(int(ids[t, k]) * int(mult[lay, k])))
                if k == 0:
                    continue
                for e in range(tables):
                    col = (k - 1) * tables + e
                    value = h % int(sizes[lay, k - 1, e]) + int(offs[lay, col])  # Python %: floor modulo
                    out[lay, t, col] = -1 if mask is not None and mask[t] else wrap32(value)
    return out


# --- the reference's contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("ngram,layers,tables", SHAPES)
def test_reference_is_the_scalar_contract(ngram, layers, tables, masked, extreme, seed):
    """The vectorized reference equals the element-by-element Python computation: random ids and multipliers,
    and (``extreme``) the int32 id edges, int64 multiplier edges, negative ids and products (floor modulo),
    table sizes up to 2**31 - 1 and of 1 and 2, offsets that wrap."""
    args = make_hash_inputs(23, ngram, layers, tables, masked=masked, extreme=extreme, generator=gen(seed))
    got = engram_hash_ref(*args)
    assert got.dtype == torch.int32 and got.shape == (layers, 23, (ngram - 1) * tables)
    assert torch.equal(got, scalar_hash(*args))


def test_reference_edge_values_by_hand():
    """A few values worked out by hand: the floor modulo of a negative hash, the wrap of the product and of
    the offset sum, the mask."""
    ids = torch.tensor([[-7, 3], [I32_MAX, I32_MIN], [5, 0]], dtype=torch.int32)
    mult = torch.tensor([[1, 1], [2**62, 3]], dtype=torch.int64)
    sizes = torch.tensor([[[5, 2**31 - 1]], [[7, 2**31 - 1]]], dtype=torch.int32)
    offs = torch.tensor([[0, I32_MAX], [10, -5]], dtype=torch.int32)
    out = engram_hash_ref(ids, mult, sizes, offs, torch.tensor([False, False, True]))
    # layer 0, token 0: h = -7 ^ 3 = -6; -6 mod 5 = 4; -6 mod (2**31 - 1) = 2**31 - 7, + (2**31 - 1) wraps
    assert out[0, 0].tolist() == [4, wrap32(2**31 - 7 + I32_MAX)]
    # layer 1, token 1: (2**31 - 1) * 2**62 wraps to -2**62 (odd times 2**62), xor (-2**31 * 3)
    h = wrap64((I32_MAX * 2**62)) ^ (I32_MIN * 3)
    assert out[1, 1].tolist() == [h % 7 + 10, wrap32(h % (2**31 - 1) - 5)]
    assert out[:, 2].eq(-1).all()


@pytest.mark.parametrize("ngram,layers,tables", SHAPES[:3])
def test_reference_matches_the_peer_reference(ngram, layers, tables, seed):
    """Where DeepSeek's tile_kernels is importable: its PyTorch reference gives the same bits (also on the
    extreme inputs), and its make_offsets the same offsets."""
    peer = pytest.importorskip("tile_kernels.torch.engram")
    for extreme in (False, True):
        for masked in (False, True):
            args = make_hash_inputs(41, ngram, layers, tables, masked=masked, extreme=extreme, generator=gen(seed))
            assert torch.equal(peer.engram_hash_ref(*args), engram_hash_ref(*args))
            assert torch.equal(peer.make_offsets(args[2]), args[3])


# --- validation, fakes, opcheck, torch.compile -----------------------------------------------------------


def meta_args(tokens=3, ngram=3, layers=2, tables=8, device="meta", masked=True):
    mode = FakeTensorMode() if device != "meta" else None

    def empty(*shape, dtype):
        if mode is None:
            return torch.empty(*shape, dtype=dtype, device=device)
        with mode:
            return torch.empty(*shape, dtype=dtype, device=device)

    return dict(
        ngram_token_ids=empty(tokens, ngram, dtype=torch.int32),
        multipliers=empty(layers, ngram, dtype=torch.int64),
        vocab_sizes=empty(layers, ngram - 1, tables, dtype=torch.int32),
        offsets=empty(layers, (ngram - 1) * tables, dtype=torch.int32),
        image_token_mask=empty(tokens, dtype=torch.bool) if masked else None,
    )


def _bad_calls():
    """(argument, corrupt, error type, message) for each way a call can be wrong."""
    i32, i64 = torch.int32, torch.int64

    def replace(arg, make):
        return lambda a: {**a, arg: make(a)}

    return [
        ("ngram_token_ids", replace("ngram_token_ids", lambda a: a["ngram_token_ids"].to(i64)), TypeError,
         "expected dtype torch.int32"),
        ("ngram_token_ids", replace("ngram_token_ids", lambda a: a["ngram_token_ids"][:, :1].contiguous()), ValueError,
         "max n-gram size N >= 2, got 1"),
        ("ngram_token_ids", replace("ngram_token_ids", lambda a: a["ngram_token_ids"].reshape(-1)), ValueError,
         "expected a 2-D tensor"),
        ("multipliers", replace("multipliers", lambda a: a["multipliers"].to(i32)), TypeError,
         "expected dtype torch.int64"),
        ("multipliers", replace("multipliers", lambda a: a["multipliers"][:, :2].contiguous()), ValueError,
         "one multiplier per column"),
        ("multipliers", replace("multipliers", lambda a: a["multipliers"][:0].contiguous()), ValueError, "layers L"),
        ("vocab_sizes", replace("vocab_sizes", lambda a: a["vocab_sizes"].to(i64)), TypeError,
         "expected dtype torch.int32"),
        ("vocab_sizes", replace("vocab_sizes", lambda a: a["vocab_sizes"][:1].contiguous()), ValueError,
         "expected shape"),
        ("vocab_sizes", replace("vocab_sizes", lambda a: a["vocab_sizes"][:, :, :0].contiguous()), ValueError,
         "E >= 1"),
        ("offsets", replace("offsets", lambda a: a["offsets"][:, :15].contiguous()), ValueError,
         r"expected shape \(2, 16\)"),
        ("offsets", replace("offsets", lambda a: a["offsets"].to(i64)), TypeError, "expected dtype torch.int32"),
        ("image_token_mask", replace("image_token_mask", lambda a: a["image_token_mask"][:2].contiguous()), ValueError,
         r"expected shape \(3,\)"),
        ("image_token_mask", replace("image_token_mask", lambda a: a["image_token_mask"].to(i32)), TypeError,
         "expected dtype torch.bool"),
        ("ngram_token_ids", replace("ngram_token_ids", lambda a: a["ngram_token_ids"].t().contiguous().t()),
         ValueError, "contiguous"),
    ]


@pytest.mark.parametrize("arg,corrupt,error,message", _bad_calls(),
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(_bad_calls())])
def test_validation_names_op_and_argument(arg, corrupt, error, message):
    with pytest.raises(error, match=rf"cann_ops_tilelang::engram_hash: argument '{arg}': .*{message}"):
        ops.engram_hash(**corrupt(meta_args()))


@pytest.mark.parametrize("device", ["cuda", "meta"])
def test_validation_refuses_one_step_past_the_ranges(device):
    """On fake tensors of a device with kernels (CUDA) and one without (meta: the widest ranges): the token
    count whose output reaches 2**31 elements, and the CUDA grid's layer count."""
    big = 2**31 // (2 * 16)  # L * T * (N - 1) * E = 2**31 with N = 3, E = 8, L = 2
    with pytest.raises(ValueError, match=r"argument 'ngram_token_ids': expected output elements .* got 2147483648"):
        ops.engram_hash(**meta_args(tokens=big, device=device, masked=False))
    out = ops.engram_hash(**meta_args(tokens=big - 1, device=device, masked=False))
    assert out.shape == (2, big - 1, 16) and out.dtype == torch.int32
    layers = limits.ENGRAM_HASH_LAYERS.of(device).high
    with pytest.raises(ValueError, match=r"argument 'multipliers': expected layers L in \[1, 65535\]"):
        ops.engram_hash(**meta_args(layers=layers + 1, tables=1, device=device, masked=False))


def test_ascend_ranges():
    assert limits.ENGRAM_HASH_NGRAM.of("npu").high == 8 and limits.ENGRAM_HASH_NGRAM.of("cuda").high is None
    assert limits.ENGRAM_HASH_COLUMNS.of("privateuseone").high == 128
    assert limits.ENGRAM_HASH_LAYERS.of("npu").high == 32 and limits.ENGRAM_HASH_LAYERS.of("meta").high == 65535


def test_no_kernel_on_cpu_after_the_checks(seed):
    args = make_hash_inputs(4, generator=gen(seed))
    with without_cpu_references(), pytest.raises(RuntimeError, match="engram_hash: no kernel for tensors on "
                                                                     "device 'cpu'; supported devices: cuda, npu"):
        ops.engram_hash(*args)
    with without_cpu_references(), pytest.raises(ValueError, match="argument 'offsets'"):
        ops.engram_hash(*args[:3], args[3][:, 1:].contiguous())


@pytest.mark.parametrize("tokens", [0, 1, 7, 33])
@pytest.mark.parametrize("masked", [False, True])
def test_fake_matches_reference(tokens, masked, seed):
    args = make_hash_inputs(tokens, 3, 2, 8, masked=masked, generator=gen(seed))
    real = engram_hash_ref(*args)
    mode = FakeTensorMode()
    with mode:
        fake = ops.engram_hash(*[None if t is None else mode.from_tensor(t) for t in args])
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(tokens, masked, seed):
    args = cases.call("engram_hash", tokens, seed=seed, masked=masked, extreme=True)  # N = 3, L = 2, E = 8
    torch.library.opcheck(torch.ops.cann_ops_tilelang.engram_hash.default, tuple(args.values()))


def hash_model(ids, mult, sizes, offs, mask):
    rows = ops.engram_hash(ids, mult, sizes, offs, mask)
    return rows.clamp_min(0).sum(dim=1), rows


def test_compile_fullgraph_dynamic_no_recompile(seed):
    torch._dynamo.reset()
    compiled = torch.compile(hash_model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (7, 9, 17):
            args = make_hash_inputs(tokens, 3, 2, 8, masked=True, generator=gen(seed + tokens))
            for got, want in zip(compiled(*args), hash_model(*args)):
                assert torch.equal(got, want)


# --- kernels: lowering, launch keys, and the generated code run on the host ------------------------------


test_ascend_lowers_within_ub, test_cuda_compiles_to_sm90a_cubin = lowering_tests("hash")


def test_both_backends_lower_at_the_ascend_range_edges():
    """The Ascend kernel lowers within the UB at the edges of its ranges (8 positions, 128 or 126 columns,
    32 layers) and its buffers are what :func:`hash_ub_bytes` counts; the CUDA kernel compiles there too; one
    past an edge gets ``limits.LimitError`` from either builder."""
    pytest.importorskip("tilelang")
    from cann_ops_tilelang.kernels.ascend import _build as ascend_build
    from cann_ops_tilelang.kernels.ascend.engram import hash as ascend_hash
    from cann_ops_tilelang.kernels.cuda import _build as cuda_build
    from cann_ops_tilelang.kernels.cuda.engram import hash as cuda_hash

    cores = 64
    for ngram, layers, tables, masked in ((8, 32, 18, True), (2, 32, 128, True), (8, 1, 1, False), (2, 1, 1, True)):
        lowered = ascend_build.lower_ascendc(ascend_hash.build_engram_hash(ngram, layers, tables, masked, cores))
        assert lowered.has_simt and 0 < lowered.ub_bytes <= lowered.budget_bytes, (ngram, layers, tables)
        assert lowered.ub_bytes >= ascend_hash.hash_ub_bytes(ngram, layers, tables, masked) > lowered.ub_bytes - 512
        built = cuda_build.lower(cuda_hash.build_engram_hash(ngram, layers, tables, masked), arch="sm_90a")
        assert built.fits and built.smem_bytes == 0 and built.threads == 256
    refusals = [((9, 1, 1), "max n-gram size N must be in \\[2, 8\\]"), ((2, 33, 1), "layers L must be in \\[1, 32\\]"),
                ((2, 1, 129), "columns \\(N - 1\\) \\* E must be in \\[1, 128\\]"),
                ((3, 1, 0), "tables E must be >= 1"),
                ((1, 1, 1), "max n-gram size N must be")]
    for (ngram, layers, tables), match in refusals:
        with pytest.raises(limits.LimitError, match=match):
            ascend_hash.build_engram_hash(ngram, layers, tables, True, cores)
    for args, match in (((1, 1, 1, True), "max n-gram size N must be >= 2"), ((2, 65536, 1, True), "layers L"),
                        ((3, 1, 0, False), "tables E must be >= 1")):
        with pytest.raises(limits.LimitError, match=match):
            cuda_hash.build_engram_hash(*args)


def test_launch_keys_ignore_the_token_count(monkeypatch):
    pytest.importorskip("tilelang")
    from cann_ops_tilelang.kernels.ascend.engram import hash as ascend_hash
    from cann_ops_tilelang.kernels.cuda.engram import hash as cuda_hash

    monkeypatch.setattr(ascend_hash, "num_vector_cores", lambda: 64)
    keys = []
    for tokens in (509, 8001):
        ids, _, sizes, _, mask = make_hash_inputs(tokens, 4, 3, 2, masked=True, generator=gen(0))
        keys.append((cuda_hash.KERNEL.key(ids, sizes, mask), cuda_hash.KERNEL.key(ids, sizes, None),
                     ascend_hash.KERNEL.key(ids, sizes, mask)))
    assert keys[0] == keys[1] == (cuda_hash.HashKey(4, 3, 2, True), cuda_hash.HashKey(4, 3, 2, False),
                                  ascend_hash.HashKey(4, 3, 2, True, 64))


def test_cuda_kernel_stores_vectors_and_takes_no_int64_remainder():
    """The CUDA kernel writes ``V`` columns per thread as one vector (int4 for E = 8, int2 for E = 2, scalars
    for odd E), reads every input element by element, and reduces modulo each column's table size through
    one fp64 reciprocal per column, never an int64 ``%``."""
    pytest.importorskip("tilelang")
    from _plugins.cuda_vectors import vector_accesses

    from cann_ops_tilelang.kernels.cuda import _build as cuda_build
    from cann_ops_tilelang.kernels.cuda.engram import hash as cuda_hash

    for tables, vector in ((8, "int4"), (2, "int2"), (3, None)):
        source = cuda_build.lower_source(cuda_hash.build_engram_hash(3, 2, tables, True))
        body = source[source.index("__launch_bounds__"):]
        widths = {"int4": 16, "int2": 8}
        assert vector_accesses(source) == ({"output": widths[vector]} if vector else {}), tables
        assert "% ((int64_t)" not in body and "/ ((int64_t)" not in body
        assert len(re.findall(r"/ \(\(double\)size\)", body)) == 1  # in the unrolled per-column loop
    assert [cuda_hash.column_vector(e) for e in (1, 2, 3, 4, 6, 8, 12)] == [1, 2, 1, 4, 2, 4, 4]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build PTX here")
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_ptx_keeps_one_vector_store_and_no_int64_division(tmp_path, masked):
    """In the PTX nvcc makes for sm_90a the thread's ``V`` results leave in one store (``st.global.v4`` for
    E = 8, ``.v2`` for E = 2), and each thread takes ``V`` fp64 reciprocals and no int64 division or
    remainder (nvcc expands those into a long subroutine)."""
    pytest.importorskip("tilelang")
    from tilelang.contrib.nvcc import default_compile_options

    from cann_ops_tilelang.kernels.cuda import _build as cuda_build
    from cann_ops_tilelang.kernels.cuda.engram import hash as cuda_hash

    for tables, store, reciprocals in ((8, "st.global.v4.u32", 4), (2, "st.global.v2.u32", 2)):
        source = tmp_path / f"hash_{tables}_{int(masked)}.cu"
        source.write_text(cuda_build.lower_source(cuda_hash.build_engram_hash(3, 2, tables, masked)))
        ptx = source.with_suffix(".ptx")
        subprocess.run(["nvcc", "--ptx", "-O3", "-arch=sm_90a", "-w", *default_compile_options(), "-o", str(ptx),
                        str(source)], check=True, capture_output=True)
        text = ptx.read_text()
        assert re.findall(r"\bst\.global\.\S+", text) == [store], (tables, re.findall(r"\bst\.global\.\S+", text))
        assert not re.findall(r"\b(?:rem|div)\.[su]64\b", text), tables
        assert len(re.findall(r"\brcp\.rn\.f64\b", text)) == reciprocals, tables


# The generated sources run on the host, compiled by g++ with a sequential model of the launch. CUDA: every
# (block, thread) in turn. Ascend: every core in turn, each SimtVF call as every thread in turn, DMAs (single
# bursts in this kernel: checked) as memcpy, flags and barriers as no-ops (no thread reads another's data).
# Signed int64 arithmetic wraps (-fwrapv) as the devices' 64-bit multiply does.
_HOST_PRELUDE = r"""
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
using std::min;
#define __global__
#define __vector__
#define __simt_vf__
#define __gm__
#define __ubuf__
#define __restrict__
#define __launch_bounds__(...)
struct HostDim { int x, y, z; };
static HostDim blockIdx, threadIdx;
struct int4 { int x, y, z, w; };
struct int2 { int x, y; };
static inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
static inline int2 make_int2(int a, int b) { return {a, b}; }
enum { PIPE_MTE2, PIPE_MTE3, PIPE_V };
typedef int event_t;
typedef int asc_load_l2_cache_mode;
typedef int asc_store_l2_cache_mode;
static int block_idx;
alignas(64) static uint8_t host_ub[256 * 1024];
static inline void asc_init() {}
static inline void asc_syncthreads() {}
static inline void asc_sync_notify(int, int, event_t) {}
static inline void asc_sync_wait(int, int, event_t) {}
static inline void asc_copy_gm2ub_align(uint8_t* dst, const uint8_t* src, int bursts, int bytes, int, int, int,
                                        int, int, int) { if (bursts != 1) abort(); memcpy(dst, src, bytes); }
static inline void asc_copy_ub2gm_align(uint8_t* dst, const uint8_t* src, int bursts, int bytes, int, int, int) {
  if (bursts != 1) abort(); memcpy(dst, src, bytes);
}
namespace cce { struct dim3 { int x; explicit dim3(int x) : x(x) {} }; }
template <auto F, typename... A> static inline void asc_vf_call(cce::dim3 d, A... a) {
  for (int t = 0; t < d.x; ++t) { threadIdx = {t, 0, 0}; F(a...); }
}
"""


def _host_library(tmp_path, backend, prim_func):
    """``(launch, parameter names)``: ``launch(cuda: grid x, grid y, threads | ascend: cores, *parameters)``."""
    if backend == "cuda":
        from cann_ops_tilelang.kernels.cuda import _build as cuda_build

        source = cuda_build.lower_source(prim_func)
        head = re.search(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\(([^)]*)\) \{', source)
        body = source[head.start():]
        loops = ("int gx, int gy, int threads", "for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) "
                 "for (int t = 0; t < threads; ++t) { blockIdx = {x, y, 0}; threadIdx = {t, 0, 0};")
    else:
        from cann_ops_tilelang.kernels.ascend import _build as ascend_build

        source = ascend_build.lower_ascendc(prim_func).source
        body = source[source.index("__simt_vf__"):].replace("(__ubuf__ uint8_t *)0", "host_ub")
        head = re.search(r'extern "C" __global__ __vector__ void (\w+)\(([^)]*)\) \{', body)
        loops = ("int cores", "for (int c = 0; c < cores; ++c) { block_idx = c;")
    name, params = head.group(1), head.group(2)
    names = [p.split()[-1].lstrip("*") for p in params.split(",")]
    call = f'{name}({", ".join(names)});'
    driver = f'extern "C" void host_launch({loops[0]}, {params}) {{\n  {loops[1]} {call} }}\n}}\n'
    stem = tmp_path / f"{backend}_{abs(hash(source))}"
    stem.with_suffix(".cpp").write_text(_HOST_PRELUDE + body + "\n" + driver)
    subprocess.run(["g++", "-std=c++17", "-O1", "-fwrapv", "-fno-strict-aliasing", "-shared", "-fPIC",
                    str(stem.with_suffix(".cpp")), "-o", str(stem.with_suffix(".so"))], check=True)
    return ctypes.CDLL(os.fspath(stem.with_suffix(".so"))).host_launch, names


@pytest.mark.skipif(not HAVE_GXX, reason="g++ not found: cannot run the generated kernels on the host")
@pytest.mark.parametrize("backend", ["cuda", "ascend"])
@pytest.mark.parametrize("ngram,layers,tables,masked", [(3, 2, 8, True), (3, 2, 8, False), (4, 3, 2, True),
                                                        (2, 1, 1, True), (8, 4, 18, False)])
def test_generated_kernel_on_the_host_equals_the_reference(tmp_path, backend, ngram, layers, tables, masked, seed):
    """Every output element of the generated kernel, run on the host, equals the reference: random and extreme
    inputs, token counts around the tile (128 on Ascend) and block (256 threads on CUDA) edges, several core
    counts on Ascend (tails, idle cores)."""
    pytest.importorskip("tilelang")
    from cann_ops_tilelang.kernels.ascend.engram import hash as ascend_hash
    from cann_ops_tilelang.kernels.cuda.engram import hash as cuda_hash

    cores = (64, 7, 3)
    launches = {}
    for n_cores in cores if backend == "ascend" else (None,):
        if backend == "cuda":
            prim_func = cuda_hash.build_engram_hash(ngram, layers, tables, masked)
            launches[None] = _host_library(tmp_path, backend, prim_func)
        else:
            prim_func = ascend_hash.build_engram_hash(ngram, layers, tables, masked, n_cores)
            launches[n_cores] = _host_library(tmp_path, backend, prim_func)
    columns = (ngram - 1) * tables
    groups = columns // cuda_hash.column_vector(tables)
    for index, tokens in enumerate((1, 127, 129, 509, 1000)):
        n_cores = cores[index % len(cores)] if backend == "ascend" else None
        launch, names = launches[n_cores]
        for extreme in (False, True):
            ids, mult, sizes, offs, mask = make_hash_inputs(tokens, ngram, layers, tables, masked=masked,
                                                            extreme=extreme, generator=gen(seed + tokens))
            out = torch.full((layers, tokens, columns), 0x5A5A5A5A, dtype=torch.int32)
            tensors = dict(ngram_token_ids=ids, multipliers=mult, vocab_sizes=sizes, offsets=offs,
                           image_token_mask=mask, output=out)
            params = [ctypes.c_int(tokens) if n == "num_tokens" else ctypes.c_void_p(tensors[n].data_ptr())
                      for n in names]
            grid = ((-(-tokens * groups // 256), layers, 256) if backend == "cuda" else (n_cores,))
            launch(*[ctypes.c_int(g) for g in grid], *params)
            want = engram_hash_ref(ids, mult, sizes, offs, mask)
            assert torch.equal(out, want), (tokens, extreme, int((out != want).sum()))


# --- device tier: the kernels bitwise against the reference ------------------------------------------------


def assert_equal(got, want):
    """dtype, shape and (with elements) strides identical, then every value."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.numel() == 0 or got.stride() == want.stride()
    assert torch.equal(got.cpu(), want.cpu())


@requires_device
@pytest.mark.parametrize("tokens", [0, 1, 509, 8192])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("ngram,layers,tables", SHAPES)
def test_device_kernel_bitwise(tokens, masked, ngram, layers, tables, device, seed):
    for extreme in (False, True):
        args = make_hash_inputs(tokens, ngram, layers, tables, masked=masked, extreme=extreme,
                                generator=gen(seed + extreme))
        want = engram_hash_ref(*args)
        on_device = [None if t is None else t.to(device) for t in args]
        snapshot = [None if t is None else t.clone() for t in on_device]
        got = ops.engram_hash(*on_device)
        assert got.device == device
        assert_equal(got, want.to(device))
        for before, after in zip(snapshot, on_device):  # inputs untouched
            assert before is None or torch.equal(before, after)


@requires_device
def test_device_peer_shapes_and_compile(device, seed):
    """The peer's test inputs (ids < 1e5, multipliers < 1e5, sizes in [1e5, 1e6)) at T = 8001, eager and
    under torch.compile(fullgraph=True) with dynamic T (one compile for two token counts)."""
    g = gen(seed)
    layers, ngram, tables = 2, 3, 8

    def inputs(tokens):
        ids = torch.randint(0, 100000, (tokens, ngram), generator=g, dtype=torch.int32)
        mult = torch.randint(0, 100000, (layers, ngram), generator=g, dtype=torch.int64)
        sizes = torch.randint(100000, 1000000, (layers, ngram - 1, tables), generator=g, dtype=torch.int32)
        offs = torch.cat([torch.zeros(layers, 1, dtype=torch.int32),
                          sizes.view(layers, -1)[:, :-1].cumsum(1, dtype=torch.int32)], 1)
        mask = torch.arange(tokens) % 3 == 0
        return [ids, mult, sizes, offs, mask]

    torch._dynamo.reset()
    compiled = torch.compile(hash_model, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (8001, 4097):
            args = inputs(tokens)
            want = hash_model(*args)
            on_device = [t.to(device) for t in args]
            assert_equal(ops.engram_hash(*on_device), want[1].to(device))
            for got, ref in zip(compiled(*on_device), want):
                assert_equal(got, ref.to(device))
