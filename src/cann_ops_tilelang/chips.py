"""Facts of the chips the kernels are built and tuned for, declared once.

Every kernel builder, launcher, validation and test reads these instead of literals. A fact here is a
property of the hardware (or of its runtime), not a tuning choice: tuning lives with each kernel as a small
frozen dataclass.
"""

import dataclasses

__all__ = ["ASCEND_950", "CUDA_ARCHS", "H200", "AscendChip", "CudaArch", "CudaChip", "cuda_arch"]


@dataclasses.dataclass(frozen=True)
class CudaArch:
    """Per-CTA limits of a CUDA architecture (CUDA programming guide, compute capabilities table).

    smem_per_cta: the largest dynamic shared memory one CTA may opt into.
    smem_reserved_per_cta: shared memory the runtime reserves per resident CTA (counted against the SM).
    max_threads_per_cta: threads per CTA.
    regs_per_sm: 32-bit registers of one SM, shared by its resident threads.
    """

    name: str
    smem_per_cta: int
    smem_reserved_per_cta: int = 1024
    max_threads_per_cta: int = 1024
    regs_per_sm: int = 65536

    @property
    def smem_per_sm(self) -> int:
        """Shared memory of one SM available to CTAs: the per-CTA opt-in plus one CTA's reservation."""
        return self.smem_per_cta + self.smem_reserved_per_cta


CUDA_ARCHS = {
    "sm_80": CudaArch("sm_80", smem_per_cta=163 * 1024),
    "sm_86": CudaArch("sm_86", smem_per_cta=99 * 1024),
    "sm_89": CudaArch("sm_89", smem_per_cta=99 * 1024),
    "sm_90": CudaArch("sm_90", smem_per_cta=227 * 1024),
    "sm_90a": CudaArch("sm_90a", smem_per_cta=227 * 1024),
}


def cuda_arch(name: str) -> CudaArch:
    """The :class:`CudaArch` of ``name`` (e.g. ``"sm_90a"``); ``ValueError`` for an unknown one."""
    if name not in CUDA_ARCHS:
        raise ValueError(f"no limits known for CUDA architecture {name!r} (known: {', '.join(sorted(CUDA_ARCHS))})")
    return CUDA_ARCHS[name]


@dataclasses.dataclass(frozen=True)
class CudaChip:
    """A CUDA GPU the kernels are tuned for: its SM count and architecture."""

    name: str
    sms: int
    arch: CudaArch


# The GPU every CUDA schedule is tuned and benchmarked on. Its SM count also fixes the partial-row counts
# that fakes allocate without querying a device (policy.py: the Engram gate and Sinkhorn step partials, the mHC
# split-mix partials).
H200 = CudaChip("H200", sms=132, arch=CUDA_ARCHS["sm_90a"])


@dataclasses.dataclass(frozen=True)
class AscendChip:
    """An Ascend NPU: vector cores, the unified buffer (UB) of one vector core and the buffers of one Cube
    core (shared by the two vector cores of its group in a mixed kernel).

    ub_bytes: UB per vector core a kernel may use (256 KiB less 8 KiB the runtime reserves).
    ub_bytes_simt: the same for a kernel with a SimtVF region (another 32 KiB go to the SIMT stack and
        data cache).
    l1_bytes, l0a_bytes, l0b_bytes, l0c_bytes: L1 and the Cube's operand (L0A, L0B) and accumulator (L0C)
        buffers of one Cube core (the limits TileLang's Ascend scheduler plans them against).
    """

    name: str
    vector_cores: int
    ub_bytes: int
    ub_bytes_simt: int
    l1_bytes: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int

    @property
    def cube_bytes(self) -> dict[str, int]:
        """Capacity per Cube buffer scope: ``{"l1": .., "l0a": .., "l0b": .., "l0c": ..}``."""
        return {"l1": self.l1_bytes, "l0a": self.l0a_bytes, "l0b": self.l0b_bytes, "l0c": self.l0c_bytes}


ASCEND_950 = AscendChip("Ascend 950", vector_cores=64, ub_bytes=248 * 1024, ub_bytes_simt=216 * 1024,
                        l1_bytes=512 * 1024, l0a_bytes=64 * 1024, l0b_bytes=64 * 1024, l0c_bytes=256 * 1024)
