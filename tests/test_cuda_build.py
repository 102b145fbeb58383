"""CPU tier: the CUDA build helper reports the launch resources of a lowered kernel and judges them
against the architecture's per-CTA limits (the same check the lowering tests apply to every kernel)."""

import shutil

import pytest

pytest.importorskip("tilelang")

from cann_ops_tilelang.kernels.cuda import _build as cuda_build  # noqa: E402

HAVE_NVCC = shutil.which("nvcc") is not None


def _shared_copy(cols: int, threads: int):
    """A kernel that stages ``cols`` fp32 values per CTA in shared memory (``4 * cols`` bytes)."""
    from tilelang import language as T

    @T.prim_func
    def shared_copy(a: T.Tensor((4, cols), T.float32), b: T.Tensor((4, cols), T.float32)):
        with T.Kernel(4, threads=threads) as bx:
            tid = T.get_thread_binding()
            buf = T.alloc_shared((cols,), T.float32)
            for j in T.serial(T.ceildiv(cols, threads)):
                if j * threads + tid < cols:
                    buf[j * threads + tid] = a[bx, j * threads + tid]
            T.sync_threads()
            for j in T.serial(T.ceildiv(cols, threads)):
                if j * threads + tid < cols:
                    b[bx, j * threads + tid] = buf[cols - 1 - (j * threads + tid)]

    return shared_copy


def test_budget_of_known_and_unknown_architectures():
    assert cuda_build.smem_budget_bytes("sm_90a") == 227 * 1024
    with pytest.raises(ValueError, match="sm_75"):
        cuda_build.smem_budget_bytes("sm_75")


@pytest.mark.parametrize(
    "smem,threads,fits",
    [(0, 256, True), (227 * 1024, 1024, True), (227 * 1024 + 1, 256, False), (1024, 1056, False), (1024, 0, False)],
)
def test_fits_judges_shared_memory_and_cta_size(smem, threads, fits):
    built = cuda_build.CudaBuild(cubin=b"", source="", arch="sm_90a", smem_bytes=smem, threads=threads)
    assert built.fits is fits


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not found: cannot build CUDA cubins here")
@pytest.mark.parametrize("cols,fits", [(1024, True), (60 * 1024, False)])
def test_compile_cubin_reports_the_lowered_launch_resources(cols, fits):
    built = cuda_build.compile_cubin(_shared_copy(cols, 128), arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF"
    assert built.threads == 128
    assert built.smem_bytes >= 4 * cols  # the staged row, possibly padded by the allocator
    assert built.fits is fits
