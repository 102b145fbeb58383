"""Shared build helpers of the CUDA (TileLang) kernels.

Two code paths:

* :func:`jit_compile` is what every ``get_<op>_kernel`` getter calls: it JIT-compiles a prim_func for
  the current CUDA device with the package's pass configuration and logs the first compile of each
  cache key at INFO level on the ``cann_ops_tilelang`` logger.
* :func:`compile_cubin` lowers a prim_func for an explicit architecture and compiles the generated
  CUDA source with nvcc. It needs no GPU, which is how the CPU tests prove every kernel variant
  builds; its result also carries the launch resources of the lowered kernel (dynamic shared memory
  and threads per CTA) so that they can be checked against the architecture's limits.

TileLang is imported lazily (inside the functions) so that importing the package never does.
"""

import dataclasses
import logging
import os
import subprocess
import tempfile
import time
from typing import Any

from ...chips import cuda_arch

__all__ = ["CudaBuild", "compile_cubin", "jit_compile", "lower", "lower_source", "smem_budget_bytes"]

logger = logging.getLogger("cann_ops_tilelang")


def _pass_configs() -> dict[str, Any]:
    import tilelang

    # The kernels schedule their own loads and place every barrier explicitly (shared memory that
    # several threads touch is fenced by T.sync_threads(); thread-private shared tiles need none, unless
    # TileLang's planner overlays them with a buffer other warps share: then a barrier separates the
    # two), so TileLang's warp specialization and automatic barrier insertion are both off.
    return {
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    }


def jit_compile(op: str, key: tuple, prim_func: Any) -> Any:
    """JIT-compiles ``prim_func`` for the current CUDA device and logs the compile.

    Args:
        op: Op name, for the log line.
        key: The compile-time key the kernel was built from, for the log line.
        prim_func: A TileLang ``T.prim_func``.

    Returns:
        The compiled ``tilelang.JITKernel``; calling it with torch tensors launches on the current
        torch stream.
    """
    import tilelang

    start = time.perf_counter()
    kernel = tilelang.compile(prim_func, target="cuda", pass_configs=_pass_configs())
    logger.info("compiled CUDA kernel op=%s key=%s in %.2f s", op, key, time.perf_counter() - start)
    return kernel


def smem_budget_bytes(arch: str) -> int:
    """Shared memory one CTA may use on ``arch`` (e.g. ``"sm_90a"``: 232448 bytes), from
    :func:`cann_ops_tilelang.chips.cuda_arch`; ``ValueError`` for an architecture it does not know."""
    return cuda_arch(arch).smem_per_cta


@dataclasses.dataclass(frozen=True)
class CudaBuild:
    """Result of :func:`compile_cubin`.

    cubin:      the nvcc output (an ELF file).
    source:     the generated CUDA source.
    arch:       the target architecture.
    smem_bytes: dynamic shared memory of the launch: the ``dyn_shared_memory_buf`` attribute that
                TileLang stamps on the device kernel after merging every shared buffer (largest over
                the module's kernels; 0 when the kernel uses none).
    threads:    threads per CTA (the product of the ``threadIdx`` extents; largest over the kernels).
    """

    cubin: bytes
    source: str
    arch: str
    smem_bytes: int
    threads: int

    @property
    def budget_bytes(self) -> int:
        return smem_budget_bytes(self.arch)

    @property
    def fits(self) -> bool:
        return self.smem_bytes <= self.budget_bytes and 0 < self.threads <= cuda_arch(self.arch).max_threads_per_cta


def _lower(prim_func: Any, arch: str):
    import tilelang
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": arch})
    with tilelang.transform.PassContext(config=_pass_configs()), target:
        return tilelang.lower(prim_func, target=target)


def _launch_resources(artifact: Any) -> tuple[int, int]:
    """``(dynamic shared memory bytes, threads per CTA)`` of the lowered kernel(s) of ``artifact``."""
    smem, threads = 0, 0
    for _, func in artifact.device_mod.functions.items():
        attrs = func.attrs or {}
        smem = max(smem, int(attrs.get("dyn_shared_memory_buf", 0)))
        extent = attrs.get("thread_extent", {})
        per_cta = 1
        for axis in ("threadIdx.x", "threadIdx.y", "threadIdx.z"):
            if axis in extent:
                per_cta *= int(extent[axis])
        threads = max(threads, per_cta)
    return smem, threads


def lower(prim_func: Any, arch: str = "sm_90a") -> CudaBuild:
    """Lowers ``prim_func`` for ``arch`` without nvcc: the :class:`CudaBuild` of the generated source and its
    launch resources, with an empty ``cubin`` (what the budget checks need, in a fraction of the time)."""
    artifact = _lower(prim_func, arch)
    smem, threads = _launch_resources(artifact)
    return CudaBuild(cubin=b"", source=artifact.kernel_source, arch=arch, smem_bytes=smem, threads=threads)


def lower_source(prim_func: Any, arch: str = "sm_90a") -> str:
    """Lowers ``prim_func`` for the CUDA architecture ``arch`` and returns the generated CUDA source."""
    return _lower(prim_func, arch).kernel_source


def compile_cubin(prim_func: Any, arch: str = "sm_90a") -> CudaBuild:
    """Lowers a prim_func for an explicit CUDA architecture and compiles it to a cubin with nvcc.

    Needs no GPU: the target architecture is given explicitly.

    Args:
        prim_func: A TileLang ``T.prim_func``.
        arch: CUDA architecture, e.g. ``"sm_90a"`` (H100/H200).

    Returns:
        A :class:`CudaBuild`: the cubin bytes, the source and the kernel's launch resources.

    Raises:
        RuntimeError: nvcc failed (its output is in the message).
    """
    from tilelang.contrib.nvcc import default_compile_options

    artifact = _lower(prim_func, arch)
    source = artifact.kernel_source
    smem, threads = _launch_resources(artifact)
    nvcc = os.environ.get("NVCC") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else "nvcc"
    )
    with tempfile.TemporaryDirectory(prefix="cann_ops_tilelang_cubin_") as tmp:
        src_path = os.path.join(tmp, "kernel.cu")
        out_path = os.path.join(tmp, "kernel.cubin")
        with open(src_path, "w") as f:
            f.write(source)
        cmd = [
            nvcc,
            "--cubin",
            "-O3",
            f"-arch={arch}",
            "-lineinfo",
            "-w",
            *default_compile_options(),
            "-o",
            out_path,
            src_path,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stdout}\n{proc.stderr}")
        with open(out_path, "rb") as f:
            cubin = f.read()
    return CudaBuild(cubin=cubin, source=source, arch=arch, smem_bytes=smem, threads=threads)
