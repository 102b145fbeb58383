"""Which arguments the generated CUDA kernels access with vectors (or TMA), read from the CUDA source.

``vector_accesses(source)`` maps each kernel parameter to the widest access the source makes to it, in
bytes: a vector cast ``*(uint4*)(param + ...)`` (16 bytes for ``uint4``, 8 for ``float2``...), a
``cp.async`` copy from it (``cp_async_gs<16>(dst, &(param[...]))``, or the GEMM forward's
``ops_cp_async16(dst, &(param[0]), ...)``) or a TMA load through its descriptor
(``param_desc``: 16 bytes, the TMA alignment of global addresses). ``KERNEL_OPS`` says which ops launch a
lowering case and under which argument names its parameters arrive; the lowering tests check with
:func:`undeclared` that every op declares (``declare(..., vector_args=...)``) at least the width its
kernels use, so that the op helper's alignment check covers every vector access, except where the
launcher itself checks an argument and otherwise launches another variant (:func:`launcher_checked`).
"""

import re

_WIDTH = {"uint4": 16, "int4": 16, "float4": 16, "longlong2": 16, "ulonglong2": 16, "double2": 16,
          "uint2": 8, "int2": 8, "float2": 8, "longlong1": 8, "ulonglong1": 8,
          "uint1": 4, "int1": 4, "float1": 4, "half2": 4, "__nv_bfloat162": 4}
_SCALAR = {"float", "int", "uint", "bool", "char", "signed", "int64_t", "uint64_t", "void", "bfloat16_t", "half_t",
           "int8_t", "uint8_t", "int16_t", "short", "double"}

# lowering case (CUDA, name without the family's module prefix) -> [(op, {kernel parameter: op argument})];
# parameters that are no op argument (workspaces, outputs the op allocates) are not checked
_ENGRAM_FWD = {"x": "hidden_states", "wf": "weight_fused", "mask": "image_token_mask"}
KERNEL_OPS = {
    "fused_weight": [("engram_fused_weight", {})],
    "gate_fwd_mask": [("engram_gate_fwd", _ENGRAM_FWD)],
    "gate_fwd_nomask": [("engram_gate_fwd", _ENGRAM_FWD)],
    "gate_fwd_mask_inplace": [("engram_gate_fwd_inplace", _ENGRAM_FWD)],
    "gate_fwd_nomask_inplace": [("engram_gate_fwd_inplace", _ENGRAM_FWD)],
    "gate_bwd_mask": [("engram_gate_bwd", {})],
    "gate_bwd_nomask": [("engram_gate_bwd", {})],
    "gate_bwd_pipelined_mask": [("engram_gate_bwd", {})],
    "gate_bwd_pipelined_nomask": [("engram_gate_bwd", {})],
    "grad_w_reduce": [("engram_grad_w_reduce", {"grad_w_partial_desc": "grad_w_partial"})],
    "streaming/expand_fwd": [("expand_to_mhc_forward", {})],
    "streaming/expand_bwd": [("expand_to_mhc_backward", {})],
    "streaming/normw_merge_fwd": [("mhc_fn_normw_merge_forward", {})],
    "streaming/normw_merge_bwd": [("mhc_fn_normw_merge_backward", {})],
    "streaming/pre_apply_mix_fwd": [("mhc_pre_apply_mix_forward", {})],
    "streaming/pre_apply_mix_bwd": [("mhc_pre_apply_mix_backward", {})],
    "streaming/post_fwd": [("mhc_post_forward", {}), ("mhc_post_forward_out", {})],
    "streaming/post_bwd": [("mhc_post_backward", {})],
    "gemm/gemm_fn_split": [("mhc_gemm_with_sqrsum_forward", {})],
    "gemm/gemm_fwd": [("mhc_gemm_with_sqrsum_forward", {})],
    "gemm/gemm_bwd": [("mhc_gemm_with_sqrsum_backward", {})],
    "gemm/gemm_bwd_reduce": [("mhc_gemm_with_sqrsum_backward", {})],
    "small/reduce_rmsnorm_fwd": [("mhc_reduce_partials_and_rmsnorm_forward", {})],
    "small/reduce_rmsnorm_bwd": [("mhc_reduce_partials_and_rmsnorm_backward", {})],
    "small/split_mixes_fwd": [("mhc_pre_split_mixes_forward", {})],
    "small/split_mixes_bwd": [("mhc_pre_split_mixes_backward", {})],
    "small/split_mixes_bwd_reduce": [("mhc_pre_split_mixes_backward", {})],
    "small/sinkhorn_fwd": [("mhc_sinkhorn_forward", {})],
    "small/sinkhorn_bwd": [("mhc_sinkhorn_backward", {})],
    "small/head_mix_fwd": [("mhc_head_compute_mix_forward", {})],
    "small/head_mix_bwd": [("mhc_head_compute_mix_backward", {})],
}


def launcher_checked(case: str) -> dict[str, int]:
    """``{argument: bytes}`` whose alignment the launcher checks before it launches ``case`` (taking another
    kernel where one is not aligned), from the ``LAUNCHER_CHECKED`` tables of the CUDA family modules."""
    import importlib

    table = {}
    for family in ("engram", "mhc"):
        module = importlib.import_module(f"cann_ops_tilelang.kernels.cuda.{family}")
        table.update(getattr(module, "LAUNCHER_CHECKED", {}))
    best = max((k for k in table if case == k or case.startswith(k + "_")), key=len, default=None)
    return dict(table[best]) if best is not None else {}


def kernel_ops(case: str) -> list[tuple[str, dict[str, str]]]:
    """``KERNEL_OPS`` entry of a lowering case; a case may extend its entry's name with ``_<variant>``
    (``gemm/gemm_fwd_s16``, ``small/sinkhorn_fwd_r10``...)."""
    best = max((k for k in KERNEL_OPS if case == k or case.startswith(k + "_")), key=len, default=None)
    if best is None:
        raise KeyError(f"lowering case {case!r} has no entry in KERNEL_OPS")
    return KERNEL_OPS[best]


def kernel_params(source: str) -> list[str]:
    """Pointer and scalar parameter names of the ``__global__`` kernels of ``source``."""
    names = []
    for sig in re.finditer(r"__global__ void (?:__launch_bounds__\([^)]*\) )?\w+\(([^)]*)\)", source):
        for p in sig.group(1).split(","):
            name = p.strip().split()[-1].lstrip("*") if p.strip() else ""
            if name and name not in names:
                names.append(name)
    return names


def vector_accesses(source: str) -> dict[str, int]:
    """``{kernel parameter: widest access in bytes}`` for the parameters accessed by vector, cp.async or TMA."""
    params = set(kernel_params(source))
    out: dict[str, int] = {}

    def note(name: str, width: int) -> None:
        if name in params:
            out[name] = max(out.get(name, 0), width)

    for ty, name in re.findall(r"\*\((\w+)\s*\*\)\s*\(\s*(\w+)\s*[+)]", source):
        if ty in _SCALAR or name not in params:
            continue
        if ty not in _WIDTH:
            raise ValueError(f"unknown vector type {ty!r} in an access to {name!r}")
        note(name, _WIDTH[ty])
    for width, name in re.findall(r"cp_async_gs(?:_conditional)?<(\d+)>\([^;]*?\)\),\s*\(&\((\w+)\[", source):
        note(name, int(width))
    # the package's own raw-offset helper (ops_cp_async16(dst, &(param[0]), byte offset, predicate))
    for width, name in re.findall(r"ops_cp_async(\d+)\([^;]*?\)\),\s*\(&\((\w+)\[", source):
        note(name, int(width))
    for name in re.findall(r"tma_load\(\s*(\w+)\s*,", source):
        note(name, 16)
    return out


def undeclared(case: str, source: str, declared: dict[str, dict[str, int]]) -> list[str]:
    """The accesses of ``case`` (CUDA source ``source``) wider than what its ops declare in ``declared``
    (``{op: {argument: bytes}}``) or its launcher checks (:func:`launcher_checked`), as messages; empty when
    all are covered."""
    problems = []
    accesses = vector_accesses(source)
    checked = launcher_checked(case)
    for op, rename in kernel_ops(case):
        for param, width in sorted(accesses.items()):
            arg = rename.get(param, param)
            allowed = max(declared[op]["vector_args"].get(arg, 0), checked.get(arg, 0))
            if arg in declared[op]["arguments"] and allowed < width:
                problems.append(f"{case}: {op} argument {arg!r} is accessed in {width}-byte vectors, declared "
                                f"{declared[op]['vector_args'].get(arg, 'none')}")
    return problems


def declared_vector_args() -> dict[str, dict]:
    """``{op: {"arguments": its argument names, "vector_args": its declared widths}}`` of every op."""
    import inspect

    import cann_ops_tilelang as ops

    return {name: {"arguments": set(inspect.signature(public.prepare).parameters), "vector_args": public.vector_args}
            for name, public in ops.registered_ops().items()}
