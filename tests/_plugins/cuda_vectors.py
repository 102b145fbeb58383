"""Which arguments the generated CUDA kernels access with vectors (or TMA), read from the CUDA source.

``vector_accesses(source)`` maps each kernel parameter to the widest access the source makes to it, in
bytes: a vector cast ``*(uint4*)(param + ...)`` (16 bytes for ``uint4``, 8 for ``float2``...), a
``cp.async`` copy from it (``cp_async_gs<16>(dst, &(param[...]))``, or the package's
``ops_cp_async16(dst, &(param[0]), ...)`` and ``ops_cp_async16_evict_first(dst, &(param[...]))``) or a TMA
load through its descriptor (``param_desc``: 16 bytes, the TMA alignment of global addresses).
:func:`kernel_ops` finds the ops that launch a lowering case from their declarations (the case name starts
with the op's launcher name) and the kernel module's ``ARGUMENTS`` (parameters named differently from the
op's arguments); the lowering tests check with :func:`undeclared` that every op declares
(``declare(..., vector_args=...)``) at least the width its kernels use, so that the op helper's alignment
check covers every vector access, except where the launcher itself checks an argument and otherwise
launches another variant (:func:`launcher_checked`).
"""

import re

_WIDTH = {"uint4": 16, "int4": 16, "float4": 16, "longlong2": 16, "ulonglong2": 16, "double2": 16,
          "uint2": 8, "int2": 8, "float2": 8, "longlong1": 8, "ulonglong1": 8,
          "uint1": 4, "int1": 4, "float1": 4, "half2": 4, "__nv_bfloat162": 4,
          "uchar2": 2, "char2": 2, "uchar4": 4, "char4": 4, "ushort2": 4, "short2": 4, "ushort4": 8, "short4": 8,
          **{f"fp8_{kind}_{n}_t": n for kind in ("e4", "e5") for n in (2, 4, 8, 16)}}
_SCALAR = {"float", "int", "uint", "bool", "char", "signed", "int64_t", "uint64_t", "void", "bfloat16_t", "half_t",
           "int8_t", "uint8_t", "int16_t", "short", "double"}

def _kernel_module(module: str, name: str = ""):
    """The CUDA kernel module of an op module (``gate``, ``sinkhorn``...) and its family; where several
    families have an op module of that name (``mhc`` and ``engram`` both have ``sinkhorn``), the one with
    an op whose launcher starts the case name ``name``."""
    import importlib

    import cann_ops_tilelang as ops

    decls = [p.declaration for p in ops.registered_ops().values() if p.declaration.module == module]
    families = {d.family for d in decls}
    if len(families) > 1 and name:
        families = {d.family for d in decls if name == d.kernel or name.startswith(d.kernel + "_")}
    if len(families) != 1:
        raise KeyError(f"no single family declares ops in the op module {module!r}: {sorted(families)}")
    family = families.pop()
    return family, importlib.import_module(f"cann_ops_tilelang.kernels.cuda.{family}.{module}")


def launcher_checked(case: str) -> dict[str, int]:
    """``{argument: bytes}`` whose alignment the launcher checks before it launches ``case``
    (``"<op module>/<case>"``, taking another kernel where one is not aligned): the ``LAUNCHER_CHECKED``
    declaration of the op's CUDA kernel module."""
    module, name = case.split("/", 1)
    table = getattr(_kernel_module(module, name)[1], "LAUNCHER_CHECKED", {})
    best = max((k for k in table if name == k or name.startswith(k + "_")), key=len, default=None)
    return dict(table[best]) if best is not None else {}


def kernel_ops(case: str) -> list[tuple[str, dict[str, str]]]:
    """The ops that launch a lowering case ``"<op module>/<case>"`` with the op argument each kernel parameter
    receives: the ops of that module whose launcher (``declaration.kernel``) is the longest prefix of the case
    name, and the kernel module's ``ARGUMENTS`` (parameters named differently from the op's arguments)."""
    import cann_ops_tilelang as ops

    module, name = case.split("/", 1)
    family, kernels = _kernel_module(module, name)
    decls = [p.declaration for p in ops.registered_ops().values()
             if p.declaration.family == family and p.declaration.module == module
             and (name == p.declaration.kernel or name.startswith(p.declaration.kernel + "_"))]
    if not decls:
        raise KeyError(f"lowering case {case!r}: no op of {family}.{module} launches a kernel of that name")
    longest = max(len(d.kernel) for d in decls)
    rename = dict(getattr(kernels, "ARGUMENTS", {}))
    return [(d.name, rename) for d in decls if len(d.kernel) == longest]


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
    # the package's own helpers (kernels/cuda/_cp_async.py): ops_cp_async16(dst, &(param[0]), byte offset,
    # predicate) and ops_cp_async16_evict_first(dst, &(param[...]))
    for width, name in re.findall(r"ops_cp_async(\d+)(?:_evict_first)?\([^;]*?\)\),\s*\(&\((\w+)\[", source):
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
