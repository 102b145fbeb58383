"""The package's own ``cp.async`` helpers for CUDA kernels, passed to ``T.Kernel(..., prelude=PRELUDE)`` and called
with ``T.call_extern("void", name, ...)`` where TileLang's ``T.ptx_cp_async`` cannot express the copy.

* ``ops_cp_async16(smem, gmem, offset, pred)``: 16 bytes from ``gmem + offset`` bytes into ``smem`` where
  ``pred`` holds (else nothing is copied). Raw offsets keep TileLang's bounds predicate (both dimensions, per
  chunk) out of the load issue (the pre-norm GEMM forward's x tiles).
* ``ops_cp_async16_evict_first(smem, gmem)``: 16 bytes from ``gmem`` into ``smem`` under an L2 evict-first
  policy, for data read once while the kernel writes elsewhere: L2 then replaces these lines before the lines
  of the kernel's partly written outputs (the Engram Sinkhorn step's table rows; docs/perf/h100/engram.md,
  2026-12-06). The policy is :data:`L2_EVICT_FIRST_POLICY`, a constant operand rather than a ``createpolicy``
  in the helper: ptxas 13.0 folds that ``createpolicy`` into uniform registers and, in the step, mis-encoded
  the copies of one stage (an illegal instruction on an H100); with the constant it emits plain predicated
  copies. The source size is written out (16) so that no assembler can take the policy for it.

The lowering tests read both names as 16-byte accesses to the argument of their second operand
(tests/_plugins/cuda_vectors.py).
"""

# The sm_90 policy word of `createpolicy.fractional.L2::evict_first.b64 p, 1.0` (what ptxas folds it to; the same
# word as CUTLASS's CacheHintSm90::EVICT_FIRST for TMA loads).
L2_EVICT_FIRST_POLICY = 0x12F0000000000000

PRELUDE = r"""
__device__ __forceinline__ void ops_cp_async16(void* smem, const void* gmem, long long offset, bool pred) {
  unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  const char* src = static_cast<const char*>(gmem) + offset;
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}\n"
               :: "r"(dst), "l"(src), "r"(static_cast<int>(pred)) : "memory");
}
__device__ __forceinline__ void ops_cp_async16_evict_first(void* smem, const void* gmem) {
  unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, 16, %2;\n"
               :: "r"(dst), "l"(gmem), "l"(L2_EVICT_FIRST_POLICY) : "memory");
}
""".replace("L2_EVICT_FIRST_POLICY", f"{L2_EVICT_FIRST_POLICY:#x}ull")
