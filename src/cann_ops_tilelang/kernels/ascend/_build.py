"""Lowering and compilation helpers shared by the Ascend kernels.

* :func:`lower_ascendc` runs TileLang's complete Ascend pass pipeline and AscendC code generation on the
  CPU (``tilelang.lower(..., target="ascend", enable_device_compile=False)``): no ``bisheng``, CANN or NPU
  is needed. It returns the generated AscendC source, the unified-buffer (UB) bytes the kernel requests
  and the bytes of its Cube buffers (L1, L0A, L0B, L0C), read from the lowered device function (see
  :class:`LoweredAscend`).
* :func:`jit_compile` JIT-compiles a kernel for the device (needs ``bisheng``) and logs the first
  compile of each (op, key) at INFO on the ``cann_ops_tilelang`` logger.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ... import chips
from . import LOGGER

__all__ = [
    "UB_BUDGET_BYTES",
    "UB_BUDGET_SIMT_BYTES",
    "LoweredAscend",
    "jit_compile",
    "has_simt_region",
    "lower_ascendc",
    "ub_budget_bytes",
]

# UB per vector core a kernel may use, without / with a SimtVF region (chip facts: chips.ASCEND_950)
UB_BUDGET_BYTES = chips.ASCEND_950.ub_bytes
UB_BUDGET_SIMT_BYTES = chips.ASCEND_950.ub_bytes_simt


@dataclasses.dataclass(frozen=True)
class LoweredAscend:
    """Result of lowering one prim_func for target ``ascend``.

    source:   the generated AscendC device source (``CompiledArtifact.kernel_source``).
    ub_bytes: dynamic UB bytes requested by the kernel: the ``dyn_shared_memory_buf`` attribute that
              TileLang's ``MergeUBAllocations`` pass stamps on the device function after planning (and
              merging, multi-buffer versions included) every UB buffer, plus any UB allocation left
              outside that merged pool (none in practice).
    has_simt: whether the kernel contains a SimtVF region (then the smaller SIMT budget applies).
    cube_bytes: bytes of the Cube buffer pools by scope (``"l1"``, ``"l0a"``, ``"l0b"``, ``"l0c"``; zero
              for a vector-only kernel): the merged ``shared.l1.dyn`` / ``shared.l0*.dyn`` allocations of
              the lowered device function, multi-buffer versions included (not the L0A / L0B tiles that
              TileLang's L1-input ``T.gemm`` template stages internally, as the forward GEMM uses it).
    """

    name: str
    source: str
    ub_bytes: int
    has_simt: bool
    cube_bytes: dict = dataclasses.field(default_factory=dict)

    @property
    def budget_bytes(self) -> int:
        return ub_budget_bytes(self.has_simt)

    @property
    def fits(self) -> bool:
        return self.ub_bytes <= self.budget_bytes

    @property
    def cube_fits(self) -> bool:
        """Every Cube buffer pool within the chip's capacity (:attr:`chips.AscendChip.cube_bytes`)."""
        capacity = chips.ASCEND_950.cube_bytes
        return all(self.cube_bytes.get(scope, 0) <= capacity[scope] for scope in capacity)


def ub_budget_bytes(has_simt: bool) -> int:
    """UB budget per vector core (Ascend 950: 216 KiB if the kernel has a SimtVF region, else 248 KiB)."""
    return UB_BUDGET_SIMT_BYTES if has_simt else UB_BUDGET_BYTES


def has_simt_region(source: str) -> bool:
    """Whether generated AscendC source contains a SimtVF function (``__simt_vf__``)."""
    return "__simt_vf__" in source


def _buffer_bytes(buf) -> int:
    n = 1
    for e in buf.shape:
        n *= int(e)
    return n * buf.dtype.bits // 8


def _ub_bytes_of(device_mod) -> int:
    from tvm import tirx

    total = 0
    for _, func in device_mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        attrs = func.attrs
        dyn = int(attrs["dyn_shared_memory_buf"]) if attrs is not None and "dyn_shared_memory_buf" in attrs else 0
        extra = 0

        def visit(node):
            nonlocal extra
            # Any UB ("shared*") allocation other than the merged dynamic pool counts on top of it;
            # the Cube unit's L1 / L0 buffers ("shared.l1*", "shared.l0*") are not UB.
            if isinstance(node, tirx.AllocBuffer):
                buf = node.buffer
                scope = buf.scope()
                cube = scope.startswith("shared.l1") or scope.startswith("shared.l0")
                if scope.startswith("shared") and scope != "shared.dyn" and not cube:
                    extra += _buffer_bytes(buf)

        tirx.stmt_functor.post_order_visit(func.body, visit)
        total = max(total, dyn + extra)
    return total


def _cube_bytes_of(device_mod) -> dict:
    from tvm import tirx

    totals = {"l1": 0, "l0a": 0, "l0b": 0, "l0c": 0}
    for _, func in device_mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        found = dict.fromkeys(totals, 0)

        def visit(node, found=found):
            if isinstance(node, tirx.AllocBuffer):
                buf = node.buffer
                scope = buf.scope()  # shared.l1.dyn, shared.l0a.dyn, ... (sf handles: shared.l0a.sf)
                parts = scope.split(".")
                if len(parts) >= 2 and parts[0] == "shared" and parts[1] in found and not scope.endswith(".sf"):
                    found[parts[1]] += _buffer_bytes(buf)

        tirx.stmt_functor.post_order_visit(func.body, visit)
        for scope, size in found.items():
            totals[scope] = max(totals[scope], size)
    return totals


def lower_ascendc(prim_func) -> LoweredAscend:
    """Lower ``prim_func`` for target ``ascend`` on the CPU (no bisheng) -> :class:`LoweredAscend`."""
    import tilelang

    artifact = tilelang.lower(prim_func, target="ascend", enable_device_compile=False)
    source = artifact.kernel_source
    name = str(prim_func.attrs["global_symbol"]) if prim_func.attrs and "global_symbol" in prim_func.attrs else "kernel"
    device_mod = artifact.device_mod
    return LoweredAscend(name=name, source=source, ub_bytes=_ub_bytes_of(device_mod), has_simt=has_simt_region(source),
                         cube_bytes=_cube_bytes_of(device_mod))


def jit_compile(op: str, key: tuple, prim_func) -> Any:
    """JIT-compile ``prim_func`` for the NPU (target ``ascend``), logging op, key and seconds at INFO."""
    import tilelang

    start = time.perf_counter()
    kernel = tilelang.compile(prim_func, target="ascend")
    LOGGER.info("compiled Ascend kernel %s key=%s in %.2f s", op, key, time.perf_counter() - start)
    return kernel
