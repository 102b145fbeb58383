"""Shared build helpers of the CUDA (TileLang) kernels.

Two code paths:

* :func:`jit_compile` is what every ``get_<op>_kernel`` getter calls: it JIT-compiles a prim_func for
  the current CUDA device with the package's pass configuration and logs the first compile of each
  cache key at INFO level on the ``cann_ops_tilelang`` logger.
* :func:`compile_cubin` lowers a prim_func for an explicit architecture and compiles the generated
  CUDA source with nvcc. It needs no GPU, which is how the CPU tests prove every kernel variant
  builds.

TileLang is imported lazily (inside the functions) so that importing the package never does.
"""

import logging
import os
import subprocess
import tempfile
import time
from typing import Any

__all__ = ["compile_cubin", "jit_compile", "lower_source"]

logger = logging.getLogger("cann_ops_tilelang")


def _pass_configs() -> dict[str, Any]:
    import tilelang

    # The kernels schedule their own loads and place every barrier explicitly (shared memory that
    # several threads touch is fenced by T.sync_threads(); thread-private shared tiles need none), so
    # TileLang's warp specialization and automatic barrier insertion are both off.
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


def lower_source(prim_func: Any, arch: str = "sm_90a") -> str:
    """Lowers ``prim_func`` for the CUDA architecture ``arch`` and returns the generated CUDA source."""
    import tilelang
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": arch})
    with tilelang.transform.PassContext(config=_pass_configs()), target:
        artifact = tilelang.lower(prim_func, target=target)
    return artifact.kernel_source


def compile_cubin(prim_func: Any, arch: str = "sm_90a") -> bytes:
    """Lowers a prim_func for an explicit CUDA architecture and compiles it to a cubin with nvcc.

    Needs no GPU: the target architecture is given explicitly.

    Args:
        prim_func: A TileLang ``T.prim_func``.
        arch: CUDA architecture, e.g. ``"sm_90a"`` (H100/H200).

    Returns:
        The cubin bytes.

    Raises:
        RuntimeError: nvcc failed (its output is in the message).
    """
    from tilelang.contrib.nvcc import default_compile_options

    source = lower_source(prim_func, arch)
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
            return f.read()
