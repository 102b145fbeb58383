"""Every size and value range the ops support, declared once.

Validation (before anything is launched or written), both backends' kernel builders and the CPU lowering
tests read the ranges here; nothing else states them. A range that differs between the backends is a
:class:`PerBackend` and is looked up by the device of the tensors.
"""

import dataclasses
from collections.abc import Mapping

__all__ = [
    "BACKENDS",
    "ENGRAM_FUSED_WEIGHT_ALIGN",
    "ENGRAM_GRAD_W_PARTIALS",
    "ENGRAM_HASH_COLUMNS",
    "ENGRAM_HASH_ELEMENTS",
    "ENGRAM_HASH_LAYERS",
    "ENGRAM_HASH_NGRAM",
    "ENGRAM_HC_MULT",
    "ENGRAM_HIDDEN",
    "ENGRAM_HIDDEN_SIZES",
    "ENGRAM_SINKHORN_COLS",
    "ENGRAM_SINKHORN_ELEMENTS",
    "MHC_HC_MULT",
    "MHC_HEAD_MIX_PARTIALS",
    "MHC_HIDDEN",
    "MHC_HIDDEN_SIZES",
    "MHC_MIX",
    "MHC_RECOMPUTE_LAYERS",
    "MHC_RMS_GROUPS",
    "MHC_SINKHORN_REPEAT",
    "MOE_EXPERTS",
    "MOE_HIDDEN",
    "MOE_HIDDEN_SIZES",
    "MOE_TOPK",
    "NORM_ELEMENTS",
    "NORM_HIDDEN",
    "NORM_HIDDEN_SIZES",
    "QUANT_ELEMENTS",
    "QUANT_HIDDEN",
    "QUANT_HIDDEN_SIZES",
    "IntRange",
    "LimitError",
    "PerBackend",
    "backend_of",
    "hidden_sizes",
    "mhc_gemm_splits",
]

# kernel backends, by the device types whose tensors they take
BACKENDS = {"cuda": "cuda", "privateuseone": "ascend", "npu": "ascend"}


def backend_of(device_type: str) -> str | None:
    """The kernel backend of a device type (``"cuda"``, ``"ascend"``), or None where there is none."""
    return BACKENDS.get(device_type)


class LimitError(ValueError):
    """A value outside a declared range, raised by a kernel builder called directly (the ops' validation
    reports the same range as a ``ValueError`` naming the op and the argument first)."""


@dataclasses.dataclass(frozen=True)
class IntRange:
    """The ints ``low <= v <= high`` (``high`` None: unbounded) that are multiples of ``multiple_of``."""

    what: str
    low: int
    high: int | None = None
    multiple_of: int = 1

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            return False
        # no int(value): a traced size (SymInt) is compared symbolically, guarding on the range only
        upper = self.high is None or value <= self.high
        return bool(self.low <= value and upper and value % self.multiple_of == 0)

    def describe(self) -> str:
        span = f">= {self.low}" if self.high is None else f"in [{self.low}, {self.high}]"
        if self.high is not None and self.low == self.high:
            span = f"{self.low}"
        return (f"a multiple of {self.multiple_of} " if self.multiple_of > 1 else "") + span

    def edges(self) -> tuple[int, ...]:
        """The smallest and the largest value in the range (the smallest alone when unbounded)."""
        return (self.low,) if self.high is None or self.high == self.low else (self.low, self.high)

    def check(self, err, arg: str, value: int) -> int:
        """``value`` when it is in the range, else ``err.value(arg, ...)`` (an op's ``OpError``)."""
        if value not in self:
            raise err.value(arg, f"expected {self.what} {self.describe()}, got {value}")
        return value

    def require(self, where: str, value: int) -> int:
        """For kernel builders: ``value`` when in the range, else a :class:`LimitError` naming ``where``."""
        if value not in self:
            raise LimitError(f"{where}: {self.what} must be {self.describe()}, got {value}")
        return int(value)


@dataclasses.dataclass(frozen=True)
class PerBackend:
    """A range that differs between the backends: ``ranges`` by backend name."""

    ranges: Mapping[str, IntRange]

    def of(self, device_type: str) -> IntRange:
        """The range of the backend of ``device_type``; on a device without kernels (CPU, meta) the widest."""
        backend = backend_of(device_type)
        if backend is not None:
            return self.ranges[backend]
        return max(self.ranges.values(), key=lambda r: (r.high is None, r.high or 0))

    def __getitem__(self, backend: str) -> IntRange:
        return self.ranges[backend]


def hidden_sizes(family: str) -> tuple[str, IntRange, tuple[int, ...]]:
    """``(name, range, sizes)`` of a family's hidden sizes: ``<FAMILY>_HIDDEN`` of this module (its name and the
    supported range) and ``<FAMILY>_HIDDEN_SIZES``, the sizes that matter, at which the kernel manifest
    (tools/kernel_manifest.py) and the tests' example calls are drawn. Found by name, as the ops' families are
    found by their packages, so that nothing lists the families: a new one declares its two names here."""
    name = f"{family.upper()}_HIDDEN"
    found = globals().get(name), globals().get(f"{name}_SIZES")
    if not isinstance(found[0], IntRange) or not isinstance(found[1], tuple):
        raise LookupError(f"limits.py declares no hidden sizes of the family {family!r} (expected {name}, an IntRange, "
                          f"and {name}_SIZES, a tuple of sizes in it)")
    return name, found[0], found[1]


# Engram gate (both backends): m = 4 streams; H a multiple of 256 (the Ascend kernels' 64-lane vectors
# times 4 accumulators; the CUDA layouts' 8-element vectors per thread) up to 8192.
ENGRAM_HC_MULT = IntRange("hc_mult", 4, 4)
ENGRAM_HIDDEN = IntRange("a hidden size", 512, 8192, multiple_of=256)
# the hidden sizes that matter (see hidden_sizes): the range's low edge and the model sizes
ENGRAM_HIDDEN_SIZES = (512, 2560, 4096, 7168)
# engram_fused_weight takes any 2-D shape whose element count is a multiple of this
ENGRAM_FUSED_WEIGHT_ALIGN = 256
# rows P of the weight-gradient partials engram_grad_w_reduce sums: the Ascend kernel stages all P rows of a
# 64-column block in the UB (two stages), which holds 476; the CUDA kernels stream them
ENGRAM_GRAD_W_PARTIALS = PerBackend({"cuda": IntRange("partial rows P", 0),
                                     "ascend": IntRange("partial rows P", 0, 476)})

# mHC (both backends): m = 4 streams, M3 = m * (m + 2) = 24 mixes, one RMS group; H a multiple of 64 (one
# 64-column block of the pre-norm GEMM) up to 8192.
MHC_HC_MULT = IntRange("hc_mult", 4, 4)
MHC_MIX = 24
MHC_RMS_GROUPS = IntRange("RMS groups", 1, 1)
MHC_HIDDEN = IntRange("a hidden size", 256, 8192, multiple_of=64)
# the hidden sizes that matter (see hidden_sizes): the range's edges and the model sizes
MHC_HIDDEN_SIZES = (256, 1280, 2560, 4096, 7168, 8192)
# Sinkhorn iterations: the Ascend backward keeps 2R - 1 normalization steps of a 64-token block in the UB
# (R = 22: 243 KiB of 248); the CUDA backward keeps them in shared memory for 64.
MHC_SINKHORN_REPEAT = PerBackend({"cuda": IntRange("repeat", 1, 64), "ascend": IntRange("repeat", 1, 22)})
# rows P of the head-mix backward's partial buffers (the caller's): the CUDA kernel's per-worker index is
# bounded at 4096; the Ascend kernel spreads any count over its cores
MHC_HEAD_MIX_PARTIALS = PerBackend({"cuda": IntRange("partial rows P", 1, 4096),
                                    "ascend": IntRange("partial rows P", 1)})
# sublayers L of one mhc_multilayer_recompute chunk: the CUDA kernel takes each list tensor as its own parameter
# (6 L + 1 pointers, within the 4 KiB of classic kernel parameters) and unrolls the layers
MHC_RECOMPUTE_LAYERS = IntRange("layers L", 1, 64)
# split-K of the pre-norm GEMM: split s owns whole 64-column blocks of K = m * H
MHC_GEMM_BLOCK = 64


def mhc_gemm_splits(width: int) -> IntRange:
    """The split counts of the pre-norm GEMM over ``width = K`` columns: 1 to one 64-column block each."""
    return IntRange("n_splits", 1, max(1, width // MHC_GEMM_BLOCK))


# engram_hash: the Ascend kernel stages two tiles of 128 tokens' ids and one layer's (128, (N - 1) * E) output
# in the UB with every layer's multipliers, table sizes and offsets (N <= 8, 128 columns, 32 layers: at most
# 171 KiB of the 216 KiB beside a SimtVF region); the CUDA grid has one row of blocks per layer (grid.y <=
# 65535). Both index the output with int32 token counts, so L * T * (N - 1) * E stays below 2**31.
ENGRAM_HASH_NGRAM = PerBackend({"cuda": IntRange("max n-gram size N", 2),
                                "ascend": IntRange("max n-gram size N", 2, 8)})
ENGRAM_HASH_COLUMNS = PerBackend({"cuda": IntRange("columns (N - 1) * E", 1),
                                  "ascend": IntRange("columns (N - 1) * E", 1, 128)})
ENGRAM_HASH_LAYERS = PerBackend({"cuda": IntRange("layers L", 1, 65535), "ascend": IntRange("layers L", 1, 32)})
ENGRAM_HASH_ELEMENTS = IntRange("output elements L * T * (N - 1) * E", 0, 2**31 - 1)
ENGRAM_HASH_TOKEN_ID = IntRange("an int32 token id", -2**31, 2**31 - 1)  # the op's ids (and pad id) are int32

# Engram Sinkhorn optimizer ops: the momentum update takes any element count (whole vectors in the main
# pass, the few trailing elements staged by the launchers); the scaled matrix has 64..1024 columns in steps
# of 64 (one 64-lane fp32 vector on the Ascend 950; on CUDA 16 or 32 lanes of 4 columns per row, at most 8
# vectors of row, column-scale and accumulator registers per thread).
ENGRAM_SINKHORN_COLS = IntRange("a column count D", 64, 1024, multiple_of=64)
# both backends index the flat table with int32 (10^7 rows x 128 columns is 1.28e9 elements)
ENGRAM_SINKHORN_ELEMENTS = IntRange("element count", 0, 2**31 - 1)

# Quant casts (both backends): H a multiple of 128, so that every per-token group (16, 32, 64 or 128 channels)
# divides it and each row is whole 16-byte vectors of any input dtype on CUDA and whole vectors of the Ascend
# 950's vector unit, up to 32768 (one compile per H; the kernels stream each row's groups, so nothing on chip
# grows with H beyond one row's share per thread). The peer needs H % 64 == 0: its bitwise comparison covers
# these sizes.
QUANT_HIDDEN = IntRange("a hidden size", 128, 32768, multiple_of=128)
# the hidden sizes that matter (see hidden_sizes): the range's edges and the model sizes
QUANT_HIDDEN_SIZES = (128, 2048, 4096, 7168, 32768)
# both backends index x, data and scales with int32 element offsets: T times the row pitch of x (its row
# stride, at least H) stays below 2**31
QUANT_ELEMENTS = IntRange("elements T * row pitch of x", 0, 2**31 - 1)

# Norms and SwiGLU (both backends): H (the normalized row; SwiGLU's output width, its input rows 2 H) a multiple of
# 64, so that a fused per-token cast's groups (32 or 128 channels: 64 needs 128 | H, checked with the layout) and
# every row's 16-byte CUDA vectors and 256-byte Ascend vectors tile it, up to 32768 (beyond the peer's 8192 / 7168:
# the kernels stream a row through on-chip memory in chunks when it does not fit whole).
NORM_HIDDEN = IntRange("a hidden size", 64, 32768, multiple_of=64)
# the hidden sizes that matter (see hidden_sizes): the range's edges and the model sizes
NORM_HIDDEN_SIZES = (64, 2048, 4096, 7168, 32768)
# both backends index rows with int32 element offsets: T times the row pitch stays below 2**31
NORM_ELEMENTS = IntRange("elements T * row pitch", 0, 2**31 - 1)

# MoE routing (both backends): E routed experts per token's score row, up to 512 (DeepSeek-V3's 256, the peer's 72
# and room for replicas); k experts picked per token, with the shared experts appended k + shared <= 32 (one
# warp's lanes on CUDA, one id per lane).
MOE_EXPERTS = IntRange("an expert count E", 1, 512)
MOE_TOPK = IntRange("a top-k count k", 1, 32)
# H, the model's hidden size: the width of the token rows the family's permutation will move (issue 63; provisional,
# as the norms' rows until its kernels fix it). The gates do not read it: their kernels are lowered at the expert
# counts of moe/_common.py (TOPK_CASES) whatever the hidden size (as the Engram hash's), so the sizes that matter are
# the low edge and DeepSeek-V3's 7168 only (see hidden_sizes).
MOE_HIDDEN = IntRange("a hidden size", 64, 32768, multiple_of=64)
MOE_HIDDEN_SIZES = (64, 7168)
