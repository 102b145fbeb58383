"""The scale-factor layout of the quant family and its result type (docs/ops/quant.md#layout).

A :class:`ScaleLayout` says how a 2-D tensor ``x (T, H)`` is quantized: which elements share one scale
(the block), the data format, how each scale is stored (its dtype, UE8M0 packing, row- or TMA-aligned
column-major storage) and whether scales are rounded up to powers of two. It is a frozen, hashable
dataclass: a compile-time constant under ``torch.compile`` (equal layouts share a graph).

Everything here is metadata: shapes, dtypes, strides and allocations of empty tensors (meta and fake
tensors included); nothing reads tensor values or touches a device. The math of the casts is in
docs/ops/quant.md and tests/quant/quant_ref.py.

Two details of the stored bytes depend on the backend, not on the layout (as in the peer, TileKernels):
the UE8M0 word (4 exponent bytes per int32 on CUDA, 2 per int16 on Ascend) and the TMA padding of a
column-major scale tensor (16 bytes on CUDA, none on Ascend). Methods that return them take ``backend``
(``"cuda"`` or ``"ascend"``, the names of ``limits.BACKENDS``); ops derive it from their tensors' device.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

__all__ = [
    "AMAX_CLAMP",
    "BLOCKS",
    "FORMATS",
    "Format",
    "QuantTensor",
    "SF_DTYPES",
    "STORAGES",
    "ScaleLayout",
    "UE8M0_WORDS",
]

# the kernel backends (limits.BACKENDS' values): not imported, so that this module stays importable alone
_BACKENDS = ("cuda", "ascend")


@dataclasses.dataclass(frozen=True)
class Format:
    """A narrow floating-point data format: its largest finite value, mantissa bits, smallest normal
    exponent, and the torch dtype and count of values per stored element of a data tensor."""

    max: float
    mantissa_bits: int
    min_normal_exp: int
    dtype: torch.dtype
    per_element: int


# e2m1 is stored two per byte as torch.uint8 (element 2j in the low nibble, 2j + 1 in the high one): the
# peer's bytes (it uses int8). Not torch.float4_e2m1fn_x2: inductor (torch 2.13) cannot generate code that
# reads such a buffer and torch.equal refuses it; `.view(torch.float4_e2m1fn_x2)` is free where needed.
FORMATS = {
    "e4m3": Format(max=448.0, mantissa_bits=3, min_normal_exp=-6, dtype=torch.float8_e4m3fn, per_element=1),
    "e2m1": Format(max=6.0, mantissa_bits=1, min_normal_exp=0, dtype=torch.uint8, per_element=2),
}
SF_DTYPES = ("fp32", "e4m3", "ue8m0")
STORAGES = ("row", "col_tma")

# the blocks (rows, cols) that share one scale, by kind
BLOCKS = {
    "per_token": ((1, 16), (1, 32), (1, 64), (1, 128)),
    "per_block": ((128, 128), (32, 32)),
    "per_channel": ((32, 1), (128, 1)),
}
_KIND_OF_BLOCK = {block: kind for kind, blocks in BLOCKS.items() for block in blocks}

# the smallest amax a scale is computed from, by (data format, e4m3 scales): the peer's defaults
# (config.set_amax_clamp_for_quant), fixed here. With e4m3 scales the scale amax / max is at least 2^-9,
# the smallest e4m3 subnormal; for e2m1 with fp32 scales the inverse scale 6 / amax stays finite.
AMAX_CLAMP = {
    ("e4m3", False): 1e-4,
    ("e4m3", True): 448.0 * 2.0**-9,
    ("e2m1", False): 6.0 * 2.0**-126,
    ("e2m1", True): 6.0 * 2.0**-9,
}

# UE8M0 exponent bytes per word and the word's dtype, by backend (the words DeepGEMM / the Ascend kernels load)
UE8M0_WORDS = {"cuda": (4, torch.int32), "ascend": (2, torch.int16)}
# bytes to which the token dim of a column-major scale tensor is padded (a TMA box's row; Ascend has no TMA)
_TMA_ALIGN_BYTES = {"cuda": 16, "ascend": 1}

_SF_TORCH = {"fp32": torch.float32, "e4m3": torch.float8_e4m3fn}
_ROUNDING = {True: "round", False: "exact"}


def _ceil_div(a, b):
    return -(-a // b)


def _align(a, b):
    return _ceil_div(a, b) * b


def _is_int(value) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def _check_size(name: str, value, what: str):
    if not _is_int(value):
        raise TypeError(f"ScaleLayout: {name} must be an int ({what}); got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"ScaleLayout: {name} must be >= 0 ({what}); got {value}")


def _check_backend(backend):
    if backend not in _BACKENDS:
        raise ValueError(f"ScaleLayout: backend must be one of {_BACKENDS}; got {backend!r}")


@dataclasses.dataclass(frozen=True)
class ScaleLayout:
    """How ``x (T, H)`` is quantized and how its scales are stored.

    Fields:
        block: ``(rows, cols)`` of x that share one scale: per-token groups ``(1, 16|32|64|128)``, per-block
            ``(128, 128)`` or ``(32, 32)``, per-channel ``(32|128, 1)`` (a sequence of two ints; kept as a tuple).
        fmt: data format, ``"e4m3"`` (torch.float8_e4m3fn) or ``"e2m1"`` (two per byte, torch.uint8).
        sf: scale dtype, ``"fp32"``, ``"e4m3"`` (torch.float8_e4m3fn) or ``"ue8m0"`` (exponent bytes, packed
            into int32 words on CUDA, int16 words on Ascend).
        storage: ``"row"`` (row-major) or ``"col_tma"`` (column-major, token dim padded to 16 bytes on CUDA,
            returned as the transposed view; what DeepGEMM loads). Not with per-channel blocks.
        round_sf: round each scale up to a power of two (required by ``"ue8m0"``, refused with ``"e4m3"``).

    ``spec`` / :meth:`parse` give the layout as one string (``"1x128/e4m3/ue8m0/col_tma/round"``): the form
    the custom ops take it in. Sizes: ``T`` any int >= 0 (a ragged last block row is a partial block), ``H``
    a multiple of the block's cols (so even for e2m1). Raises TypeError / ValueError naming the field.
    """

    block: tuple[int, int]
    fmt: str = "e4m3"
    sf: str = "fp32"
    storage: str = "row"
    round_sf: bool = False

    def __post_init__(self):
        block = self.block
        if isinstance(block, (str, bytes)) or not hasattr(block, "__len__") or len(block) != 2 \
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in block):
            raise TypeError(f"ScaleLayout: field 'block' must be two ints (rows, cols); got {block!r}")
        block = (int(block[0]), int(block[1]))
        object.__setattr__(self, "block", block)
        if block not in _KIND_OF_BLOCK:
            allowed = ", ".join(f"{k} {list(v)}" for k, v in BLOCKS.items())
            raise ValueError(f"ScaleLayout: field 'block' must be one of {allowed}; got {block}")
        for name, allowed in (("fmt", tuple(FORMATS)), ("sf", SF_DTYPES), ("storage", STORAGES)):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"ScaleLayout: field '{name}' must be a str, one of {allowed}; got "
                                f"{type(value).__name__} {value!r}")
            if value not in allowed:
                raise ValueError(f"ScaleLayout: field '{name}' must be one of {allowed}; got {value!r}")
        if not isinstance(self.round_sf, bool):
            raise TypeError(f"ScaleLayout: field 'round_sf' must be a bool; got {type(self.round_sf).__name__} "
                            f"{self.round_sf!r}")
        if self.sf == "ue8m0" and not self.round_sf:
            raise ValueError("ScaleLayout: field 'round_sf' must be True with sf 'ue8m0' (a UE8M0 scale is a "
                             "power of two); got False")
        if self.sf == "e4m3" and self.round_sf:
            raise ValueError("ScaleLayout: field 'round_sf' must be False with sf 'e4m3' (power-of-two scales "
                             "are stored as 'ue8m0' or 'fp32'); got True")
        if self.kind == "per_channel" and self.storage != "row":
            raise ValueError(f"ScaleLayout: field 'storage' must be 'row' with per-channel block {block} (its "
                             f"UE8M0 words pack along tokens); got {self.storage!r}")
        if self.kind == "per_channel" and self.fmt != "e4m3":
            raise ValueError(f"ScaleLayout: field 'fmt' must be 'e4m3' with per-channel block {block} (FP4 packs "
                             f"pairs of channels, which per-channel scales do not share); got {self.fmt!r}")
        # the spec, built once: under torch.compile(dynamic=True) dynamo may read the block's ints of a layout
        # passed in as SymInts, which no string can be formatted from (a str attribute is a guarded constant)
        object.__setattr__(self, "_spec", f"{block[0]}x{block[1]}/{self.fmt}/{self.sf}/{self.storage}/"
                                          f"{_ROUNDING[self.round_sf]}")

    # --- the layout as one string ------------------------------------------------------------------------

    @property
    def spec(self) -> str:
        """The canonical string, ``"<rows>x<cols>/<fmt>/<sf>/<storage>/<round|exact>"``; equal layouts
        have equal specs and ``ScaleLayout.parse(layout.spec) == layout``."""
        return self._spec

    @classmethod
    def parse(cls, spec: str | ScaleLayout) -> ScaleLayout:
        """The layout of a spec string (a layout is returned as is); ValueError naming the part."""
        if isinstance(spec, ScaleLayout):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"ScaleLayout.parse: spec must be a str like '1x128/e4m3/fp32/row/exact'; got "
                            f"{type(spec).__name__} {spec!r}")
        parts = spec.split("/")
        if len(parts) != 5:
            raise ValueError(f"ScaleLayout.parse: spec must have 5 parts '<rows>x<cols>/<fmt>/<sf>/<storage>/"
                             f"<round|exact>'; got {spec!r}")
        block, fmt, sf, storage, rounding = parts
        rows, _, cols = block.partition("x")
        if not (rows.isdigit() and cols.isdigit()):
            raise ValueError(f"ScaleLayout.parse: block part must be '<rows>x<cols>'; got {block!r} in {spec!r}")
        if rounding not in ("round", "exact"):
            raise ValueError(f"ScaleLayout.parse: last part must be 'round' or 'exact'; got {rounding!r} in "
                             f"{spec!r}")
        return cls((int(rows), int(cols)), fmt, sf, storage, rounding == "round")

    # --- formats -----------------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """``"per_token"``, ``"per_block"`` or ``"per_channel"``."""
        return _KIND_OF_BLOCK[self.block]

    @property
    def format(self) -> Format:
        return FORMATS[self.fmt]

    @property
    def fmax(self) -> float:
        """The data format's largest finite value (448 for e4m3, 6 for e2m1)."""
        return FORMATS[self.fmt].max

    @property
    def amax_clamp(self) -> float:
        """The smallest block amax a scale is computed from (``AMAX_CLAMP[fmt, sf == "e4m3"]``)."""
        return AMAX_CLAMP[self.fmt, self.sf == "e4m3"]

    @property
    def data_dtype(self) -> torch.dtype:
        """torch.float8_e4m3fn (e4m3) or torch.uint8 (e2m1, two per byte)."""
        return FORMATS[self.fmt].dtype

    # --- shapes ------------------------------------------------------------------------------------------

    def _check(self, tokens, hidden):
        _check_size("T", tokens, "tokens, dim 0 of x")
        _check_size("H", hidden, "hidden, dim 1 of x (logical: values, not bytes)")
        if hidden % self.block[1]:
            raise ValueError(f"ScaleLayout {self.spec}: H must be a multiple of the block's cols "
                             f"{self.block[1]}; got {hidden}")

    def data_shape(self, tokens, hidden) -> tuple:
        """Shape of the data tensor of ``x (T, H)``: ``(T, H)`` for e4m3, ``(T, H / 2)`` bytes for e2m1."""
        self._check(tokens, hidden)
        return tokens, hidden // FORMATS[self.fmt].per_element

    def hidden_of(self, data: torch.Tensor) -> int:
        """The logical H of a data tensor (two values per byte for e2m1)."""
        return data.shape[-1] * FORMATS[self.fmt].per_element

    def sf_grid(self, tokens, hidden) -> tuple:
        """``(ceil(T / rows), H / cols)``: how many scales there are along each dim (before packing)."""
        self._check(tokens, hidden)
        return _ceil_div(tokens, self.block[0]), hidden // self.block[1]

    def ue8m0_pack(self, backend: str) -> int:
        """Exponent bytes per stored scale element: 4 (CUDA) or 2 (Ascend) for ``"ue8m0"``, else 1."""
        _check_backend(backend)
        return UE8M0_WORDS[backend][0] if self.sf == "ue8m0" else 1

    def sf_dtype(self, backend: str) -> torch.dtype:
        """float32, float8_e4m3fn, or the UE8M0 word: int32 (CUDA) / int16 (Ascend)."""
        _check_backend(backend)
        return UE8M0_WORDS[backend][1] if self.sf == "ue8m0" else _SF_TORCH[self.sf]

    def sf_shape(self, tokens, hidden, backend: str) -> tuple:
        """Shape of the scale tensor (the view the casts return). UE8M0 words pack ``p`` consecutive scales
        along H (per-token, per-block: ``(ceil(T/rows), ceil(H/cols/p))``) or along T (per-channel:
        ``(ceil(ceil(T/rows)/p), H)``); ``"col_tma"`` has the same shape as ``"row"``, transposed strides."""
        rows, cols = self.sf_grid(tokens, hidden)
        pack = self.ue8m0_pack(backend)
        if self.kind == "per_channel":
            return _ceil_div(rows, pack), cols
        return rows, _ceil_div(cols, pack)

    def tma_rows(self, tokens, hidden, backend: str):
        """The padded token count of a ``"col_tma"`` scale tensor (its dim-1 stride): ``ceil(T/rows)``
        rounded up to 16 bytes of the scale's dtype on CUDA, unchanged on Ascend; for ``"row"`` the
        row count itself."""
        rows = self.sf_shape(tokens, hidden, backend)[0]
        if self.storage != "col_tma":
            return rows
        itemsize = self.sf_dtype(backend).itemsize
        return _align(rows, max(1, _TMA_ALIGN_BYTES[backend] // itemsize))

    def sf_strides(self, tokens, hidden, backend: str) -> tuple:
        """Strides (elements) of the scale tensor: ``(cols, 1)`` row-major, ``(1, tma_rows)`` for
        ``"col_tma"`` (the transposed view of a ``(cols, tma_rows)`` row-major buffer)."""
        shape = self.sf_shape(tokens, hidden, backend)
        if self.storage == "col_tma":
            return 1, self.tma_rows(tokens, hidden, backend)
        return shape[1], 1

    def sf_numel(self, tokens, hidden, backend: str):
        """Elements of the buffer behind the scale tensor (the TMA padding included)."""
        shape = self.sf_shape(tokens, hidden, backend)
        if self.storage == "col_tma":
            return shape[1] * self.tma_rows(tokens, hidden, backend)
        return shape[0] * shape[1]

    def empty_sf(self, tokens, hidden, backend: str, device=None, like: torch.Tensor | None = None):
        """An uninitialized scale tensor with the layout's shape, dtype and strides, on ``device`` or on
        ``like``'s device (``like.new_empty``: works on meta and fake tensors, so fakes can call it)."""
        dtype = self.sf_dtype(backend)
        numel = self.sf_numel(tokens, hidden, backend)
        flat = like.new_empty((numel,), dtype=dtype) if like is not None else \
            torch.empty((numel,), dtype=dtype, device=device)
        return flat.as_strided(self.sf_shape(tokens, hidden, backend), self.sf_strides(tokens, hidden, backend))

    def empty_data(self, tokens, hidden, device=None, like: torch.Tensor | None = None):
        """An uninitialized, contiguous data tensor of shape :meth:`data_shape`."""
        shape = self.data_shape(tokens, hidden)
        if like is not None:
            return like.new_empty(shape, dtype=self.data_dtype)
        return torch.empty(shape, dtype=self.data_dtype, device=device)

    def check_sf(self, sf: torch.Tensor, tokens, hidden, backend: str, name: str = "sf") -> None:
        """ValueError / TypeError unless ``sf`` has this layout's dtype, shape and strides at ``(T, H)``
        (metadata only). Strides of a dim of size 1 are not compared (torch leaves them free)."""
        dtype = self.sf_dtype(backend)
        if sf.dtype != dtype:
            raise TypeError(f"ScaleLayout {self.spec}: {name} must be {dtype} on {backend}; got {sf.dtype}")
        shape = self.sf_shape(tokens, hidden, backend)
        if tuple(sf.shape) != tuple(shape):
            raise ValueError(f"ScaleLayout {self.spec}: {name} must have shape {tuple(shape)} for x ({tokens}, "
                             f"{hidden}) on {backend}; got {tuple(sf.shape)}")
        strides = self.sf_strides(tokens, hidden, backend)
        bad = [d for d in range(2) if shape[d] > 1 and sf.stride(d) != strides[d]]
        if bad and sf.numel() > 0:
            raise ValueError(f"ScaleLayout {self.spec}: {name} must have strides {tuple(strides)} "
                             f"({self.storage}); got {tuple(sf.stride())}")


class QuantTensor(NamedTuple):
    """A quantized ``x (T, H)``: ``data`` (``layout.data_shape(T, H)``, ``layout.data_dtype``), ``sf``
    (``layout.sf_shape(T, H, backend)``, ``layout.sf_dtype(backend)``, ``layout.sf_strides``) and the
    ``layout`` they follow.

    A named tuple: ``data, sf, layout = q``; ``torch.compile`` traces it (the layout is a constant, guarded
    by value). Custom ops take and return the two tensors (the layout as its ``spec`` string) and autograd
    Functions return plain tuples: the Python wrappers build the QuantTensor. pytree sees the layout as a
    non-tensor leaf (map tensors with ``tree_map_only(torch.Tensor, ...)``).
    """

    data: torch.Tensor
    sf: torch.Tensor
    layout: ScaleLayout

    @property
    def tokens(self) -> int:
        return self.data.shape[0]

    @property
    def hidden(self) -> int:
        """The logical H (two values per byte for e2m1)."""
        return self.layout.hidden_of(self.data)
