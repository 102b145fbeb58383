"""Ascend 950 kernel of ``per_token_cast_and_cast_back`` (docs/ops/quant.md#per_token_cast_and_cast_back):
``x`` is overwritten in place with ``x.dtype(fl(f32(Q(fl(x * inv))) * s))``.

Scheme: the per-token cast's (a persistent loop over (token tile, hidden tile) tasks of ``BM`` tokens by ``hk``
channels, multi-buffered; ragged token tails clamp the DMAs to the valid rows), without the stores of data and
scales: the x tile is rewritten in UB and copied back where it came from. Per task, all arithmetic fp32 (bf16
widened exactly):

1. **amax** of each group, as the per-token cast (``vcmax`` over the group's vectors or lane masks);
2. **scales**: ``a = max(amax, clamp)``; exact ``s = a / max``, ``inv = max / a`` (correctly rounded ``vdiv``);
   power-of-two (``round_sf``, UE8M0) ``s = 2^e``, ``inv = 2^-e`` from the exponent of ``fl(a * fl(1 / max))``
   rounded up; e4m3 scales ``s = f32(e4m3(min(a / max, 448)))``, ``inv = 1 / s``; ``s`` and ``inv`` kept as fp32
   tiles ``[token, group]``;
3. **fake quantization**: ``q = fl(x * inv)`` (inv broadcast per group), e4m3 narrowed by ``vcvt`` (round to nearest
   even, saturating) and widened back in registers; e2m1 narrowed as the per-token cast does (the bf16 with a
   sticky bit, ``vcvt`` to packed e2m1) into a byte tile, then widened back (``UNPK4_B8`` load, ``vcvt`` to bf16,
   interleaved with zeros into fp32); then ``fl(f32(q) * s)`` rounded once to x's dtype (``vcvt`` to bf16) into the
   x tile.
"""

# NOTE: no `from __future__ import annotations` here: TileLang evaluates the prim_func annotations.
import dataclasses

import tilelang  # noqa: F401  (registers the TileLang frontend before the dialect import)
from tilelang.ascend import language as T
from tilelang.ascend.language import simd as S

from .... import limits
from ....policy import ASCEND_CASE_CORES
from ....quant import BLOCKS, ScaleLayout
from ..._kernel import Kernel, compile_key, kernel_module
from .. import _build, num_vector_cores
from ._common import f32, scale_macro

LANES = 64  # fp32 lanes of one 256-byte vector register
SLACK = 8 * 1024  # UB kept free of the tile formula's count (alignment of the buffer versions)
GROUPS = tuple(cols for _, cols in BLOCKS["per_token"])
IN_DTYPES = {"bfloat16": 2, "float32": 4}
SCALES = ("exact", "round", "e4m3")


@dataclasses.dataclass(frozen=True)
class FakeQuantTilePlan:
    """``tokens`` rows per tile and ``stages`` UB versions of the x tile; the hidden tile is the widest divisor of
    ``H`` (a multiple of 128) that fits the UB (:func:`tiling`)."""

    tokens: int
    stages: int


# 32 tokens per tile, as the per-token cast's row plan; two stages (load / compute / store overlap). Not measured
# yet: no Ascend 950 here (docs/perf/ascend950/quant.md to come).
PLAN = FakeQuantTilePlan(tokens=32, stages=2)


@compile_key
class FakeQuantKey:
    """Compile-time key: hidden size, group, x's dtype, data format, how the scale is made (``"exact"`` fp32,
    ``"round"`` power of two (fp32 or UE8M0), ``"e4m3"``) and the vector cores of the persistent grid."""

    hidden: int
    group: int
    in_dtype: str  # "bfloat16" | "float32"
    fmt: str  # "e4m3" | "e2m1"
    scale: str  # "exact" | "round" | "e4m3"
    num_cores: int


def _pow2_at_least(n: int) -> int:
    p = 2
    while p < n:
        p *= 2
    return p


def tile_ub_bytes(hk: int, group: int, in_dtype: str, fmt: str) -> int:
    """UB bytes of a hidden tile of ``hk`` channels: the multi-buffered x tile, the e2m1 byte tile, the amax,
    inverse and scale tiles (fp32), plus :data:`SLACK`."""
    bm = PLAN.tokens
    n = bm * _pow2_at_least(hk // group)
    narrow = bm * hk // 2 if fmt == "e2m1" else 0
    return PLAN.stages * bm * hk * IN_DTYPES[in_dtype] + narrow + 3 * 4 * n + SLACK


def tiling(hidden: int, group: int, in_dtype: str, fmt: str) -> int:
    """The hidden tile: the widest divisor of ``H`` that is a multiple of 128 channels and fits the UB budget."""
    fits = [hk for hk in range(128, hidden + 1, 128)
            if hidden % hk == 0 and tile_ub_bytes(hk, group, in_dtype, fmt) <= _build.UB_BUDGET_BYTES]
    if not fits:
        raise limits.LimitError(f"per_token_cast_and_cast_back: no hidden tile fits the UB at H={hidden}")
    return fits[-1]


def check_key(where: str, hidden, group, in_dtype, fmt, scale, num_cores) -> None:
    """:class:`limits.LimitError` unless the key is a supported fake quantization."""
    limits.QUANT_HIDDEN.require(where, int(hidden))
    limits.IntRange("num_cores", 1).require(where, int(num_cores))
    if group not in GROUPS or hidden % group:
        raise limits.LimitError(f"{where}: group must be one of {GROUPS} and divide H={hidden}; got {group}")
    if in_dtype not in IN_DTYPES:
        raise limits.LimitError(f"{where}: x must be one of {tuple(IN_DTYPES)}; got {in_dtype}")
    if fmt not in ("e4m3", "e2m1"):
        raise limits.LimitError(f"{where}: fmt must be 'e4m3' or 'e2m1'; got {fmt!r}")
    if scale not in SCALES:
        raise limits.LimitError(f"{where}: scale must be one of {SCALES}; got {scale!r}")



def build_per_token_cast_and_cast_back(hidden: int, group: int, in_dtype: str, fmt: str, scale: str,
                                       num_cores: int):
    """prim_func(x (T, H) bf16 | fp32 with row stride x_stride), read and written in place."""
    check_key("per_token_cast_and_cast_back", hidden, group, in_dtype, fmt, scale, num_cores)
    layout = ScaleLayout((1, group), fmt, "e4m3" if scale == "e4m3" else "fp32", "row", scale == "round")
    H, g = int(hidden), int(group)
    hk = tiling(H, g, in_dtype, fmt)
    BM, stages, n_tiles = PLAN.tokens, PLAN.stages, H // hk
    sf_cols = _pow2_at_least(hk // g)  # entries per token row of the scale tiles
    n_vec = BM * sf_cols // LANES
    e2m1 = fmt == "e2m1"
    scale_of = scale_macro(layout, fp32_scales=True)
    n_chunks = hk // LANES
    per_vec = max(1, LANES // g)
    vec_per_group = max(1, g // LANES)
    in_t = T.bfloat16 if in_dtype == "bfloat16" else T.float32
    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_stride")

    def loadf32(x_ub, r, c):
        """64 channels ``c..c+63`` of row ``r`` as fp32 (bf16 widened exactly)."""
        if in_dtype == "bfloat16":
            return S.vcvt(S.vld(x_ub[r, c], dist="UNPK_B16"), T.float32, part=0)
        return S.vld(x_ub[r, c])

    @T.macro
    def store_x(x_ub, r, c, v):
        """64 fp32 values into channels ``c..c+63`` of row ``r``, rounded once to x's dtype."""
        if in_dtype == "bfloat16":
            S.vsts(x_ub[r, c], S.vcvt(v, T.bfloat16), dist="PK_B32")
        else:
            S.vsts(x_ub[r, c], v)

    @T.macro
    def per_lane(tile, r, c, ge1, ge2, ge3):
        """The ``[token, group]`` tile's entry of each lane of the 64-channel vector ``c`` of row ``r``."""
        if g >= LANES:
            return S.vld(tile[r * sf_cols + c // vec_per_group], dist="BRC_B32")
        if g == 32:
            return S.vsel(S.vld(tile[r * sf_cols + 2 * c + 1], dist="BRC_B32"),
                          S.vld(tile[r * sf_cols + 2 * c], dist="BRC_B32"), ge1)
        v01 = S.vsel(S.vld(tile[r * sf_cols + 4 * c + 1], dist="BRC_B32"),
                     S.vld(tile[r * sf_cols + 4 * c], dist="BRC_B32"), ge1)
        v012 = S.vsel(S.vld(tile[r * sf_cols + 4 * c + 2], dist="BRC_B32"), v01, ge2)
        return S.vsel(S.vld(tile[r * sf_cols + 4 * c + 3], dist="BRC_B32"), v012, ge3)

    @T.macro
    def fake_quant_vf(x_ub, amax_ub, inv_ub, s_ub, q_ub, valid):
        with T.SimdVF():
            every = S.pset(32, "PAT_ALL")
            lane = S.vci(0, T.int32)
            ge1 = S.vcmps(lane, g, op="ge")
            ge2 = S.vcmps(lane, 2 * g, op="ge")
            ge3 = S.vcmps(lane, 3 * g, op="ge")
            mk0 = S.pnot(ge1, every)
            mk1 = S.pand(ge1, S.pnot(ge2, every), every)
            mk2 = S.pand(ge2, S.pnot(ge3, every), every)
            mk3 = ge3
            # 1. the amax of each group at its [token, group] entry
            for r in T.serial(valid):
                if g >= LANES:
                    for gi in T.serial(hk // g):
                        m = S.vabs(loadf32(x_ub, r, gi * g))
                        if vec_per_group == 2:
                            m = S.vmax(m, S.vabs(loadf32(x_ub, r, gi * g + LANES)))
                        S.vsts(amax_ub[r * sf_cols + gi], S.vcmax(m), dist="ONEPT_B32")
                else:
                    for c in T.serial(n_chunks):
                        a = S.vabs(loadf32(x_ub, r, c * LANES))
                        S.vsts(amax_ub[r * sf_cols + c * per_vec], S.vcmax(a, mk0), dist="ONEPT_B32")
                        S.vsts(amax_ub[r * sf_cols + c * per_vec + 1], S.vcmax(a, mk1), dist="ONEPT_B32")
                        if g == 16:
                            S.vsts(amax_ub[r * sf_cols + c * per_vec + 2], S.vcmax(a, mk2), dist="ONEPT_B32")
                            S.vsts(amax_ub[r * sf_cols + c * per_vec + 3], S.vcmax(a, mk3), dist="ONEPT_B32")
            S.mem_bar("VST_VLD")
            # 2. scales and inverses, 64 entries at a time
            for v in T.unroll(n_vec, explicit=True):
                s, inv = scale_of(S.vld(amax_ub[v * LANES]))
                S.vsts(inv_ub[v * LANES], inv)
                S.vsts(s_ub[v * LANES], s)
            S.mem_bar("VST_VLD")
            # 3. q = Q(fl(x * inv)), widened back, times s, rounded once to x's dtype
            if e2m1:
                for r in T.serial(valid):
                    for p in T.serial(n_chunks // 2):
                        q0 = S.vmul(loadf32(x_ub, r, 2 * p * LANES), per_lane(inv_ub, r, 2 * p, ge1, ge2, ge3))
                        q1 = S.vmul(loadf32(x_ub, r, (2 * p + 1) * LANES),
                                    per_lane(inv_ub, r, 2 * p + 1, ge1, ge2, ge3))
                        low, high = S.vdintlv(T.reinterpret(q0, "uint16x128"), T.reinterpret(q1, "uint16x128"))
                        sticky = T.reinterpret(S.vor(high, S.vmins(low, 1)), "bfloat16x128")
                        fp4 = S.vcvt(sticky, T.float4_e2m1fn, part=0)
                        S.vsts(q_ub[r, 2 * p * LANES], fp4, dist="PK4_B32")
                S.mem_bar("VST_VLD")
                zero = S.vdup(0.0, T.bfloat16)
                for r in T.serial(valid):
                    for p in T.serial(n_chunks // 2):
                        q = S.vcvt(S.vld(q_ub[r, 2 * p * LANES], dist="UNPK4_B8"), T.bfloat16)
                        lo, hi = S.vintlv(zero, q)  # bf16 bits in the high half: the exact fp32
                        store_x(x_ub, r, 2 * p * LANES, S.vmul(T.reinterpret(lo, "float32x64"),
                                                               per_lane(s_ub, r, 2 * p, ge1, ge2, ge3)))
                        store_x(x_ub, r, (2 * p + 1) * LANES, S.vmul(T.reinterpret(hi, "float32x64"),
                                                                     per_lane(s_ub, r, 2 * p + 1, ge1, ge2, ge3)))
            else:
                for r in T.serial(valid):
                    for c in T.serial(n_chunks):
                        q = S.vcvt(S.vmul(loadf32(x_ub, r, c * LANES), per_lane(inv_ub, r, c, ge1, ge2, ge3)),
                                   T.float8_e4m3fn, part=0)
                        store_x(x_ub, r, c * LANES, S.vmul(S.vcvt(q, T.float32, part=0),
                                                           per_lane(s_ub, r, c, ge1, ge2, ge3)))

    @T.prim_func
    def per_token_cast_and_cast_back_asc(
        x: T.StridedTensor[(num_tokens, H), (x_stride, 1), in_t],
    ):
        with T.Kernel(num_cores) as core_id:
            x_ub = T.alloc_shared((BM, hk), in_t)
            q_ub = T.alloc_shared((BM, hk if e2m1 else 64), T.float4_e2m1fn)  # the e2m1 codes of the tile
            amax_ub = T.alloc_shared((BM * sf_cols,), T.float32)
            inv_ub = T.alloc_shared((BM * sf_cols,), T.float32)
            s_ub = T.alloc_shared((BM * sf_cols,), T.float32)
            T.annotate_buffer_versions({x_ub: stages})
            for tt, ht in T.Persistent([T.ceildiv(num_tokens, BM), n_tiles], num_cores, core_id,
                                       group_size=n_tiles, num_stages=stages):
                row = tt * BM
                valid = T.min(BM, num_tokens - row)
                h0 = ht * hk
                T.copy(x[row : row + valid, h0 : h0 + hk], x_ub[:valid, :], l2_cache_ctrl="NOTALLOC_KEEP")
                fake_quant_vf(x_ub, amax_ub, inv_ub, s_ub, q_ub, valid)
                T.copy(x_ub[:valid, :], x[row : row + valid, h0 : h0 + hk])

    return per_token_cast_and_cast_back_asc


_IN_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float32": "float32"}


def fake_quant_key(x, layout, num_cores: int) -> FakeQuantKey:
    """The key of a launch (``limits.LimitError`` outside the supported ranges)."""
    spec = ScaleLayout.parse(layout)
    if spec.kind != "per_token":
        raise limits.LimitError(f"per_token_cast_and_cast_back: layout {spec.spec} is not per-token")
    scale = "e4m3" if spec.sf == "e4m3" else "round" if spec.round_sf else "exact"
    key = FakeQuantKey(int(x.shape[-1]), spec.block[1], _IN_DTYPE_NAMES.get(str(x.dtype), str(x.dtype)), spec.fmt,
                       scale, int(num_cores))
    check_key("per_token_cast_and_cast_back", *(getattr(key, f.name) for f in dataclasses.fields(key)))
    return key


# the lowering cases: each data format, scale kind, group path and input dtype
_CASES = {
    "e4m3_exact_g128_bf16": (128, "bfloat16", "e4m3", "exact"),
    "e4m3_exact_g128_f32": (128, "float32", "e4m3", "exact"),
    "e4m3_round_g64_bf16": (64, "bfloat16", "e4m3", "round"),
    "e2m1_round_g32_bf16": (32, "bfloat16", "e2m1", "round"),
    "e2m1_e4m3_g16_f32": (16, "float32", "e2m1", "e4m3"),
}


def per_token_cast_and_cast_back_cases(hidden_size: int, hc_mult: int) -> dict:
    del hc_mult
    return {f"per_token_cast_and_cast_back_{name}": FakeQuantKey(hidden_size, group, in_dtype, fmt, scale,
                                                                 ASCEND_CASE_CORES)
            for name, (group, in_dtype, fmt, scale) in _CASES.items()}


FAKE_QUANT = Kernel("per_token_cast_and_cast_back", FakeQuantKey, build_per_token_cast_and_cast_back,
                    cases=per_token_cast_and_cast_back_cases,
                    derive=lambda x, layout: fake_quant_key(x, layout, num_vector_cores()))


def per_token_cast_and_cast_back(x, layout) -> None:
    """x (T, H) bf16 | fp32, overwritten in place (validated upstream, T > 0). Current stream, no sync."""
    FAKE_QUANT.compiled(FAKE_QUANT.key(x, layout))(x)


KERNELS, lowering_cases, __all__ = kernel_module(__name__, FAKE_QUANT)
