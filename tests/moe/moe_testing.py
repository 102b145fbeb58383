"""What the MoE routing family's test files share: the CPU-tier checks every op file runs alike (fakes, zero tokens,
compile once over T, the kernels' lowering and launch views) and the device tier's sizes."""

import shutil

import torch
from _plugins.levels import level_choice

import cann_ops_tilelang as ops

__all__ = ["DEVICE_EXPERTS", "DEVICE_TOKENS", "HAVE_NVCC", "assert_compiles_once",
           "check_ascend_lowers_within_ub", "check_cuda_compiles_to_sm90a_cubin", "check_launcher_views",
           "check_zero_tokens_launch_nothing", "lowering_cases", "metadata"]

HAVE_NVCC = shutil.which("nvcc") is not None
# the gates' kernels do not depend on the hidden size: their cases are lowered at the low edge of limits.MOE_HIDDEN
HIDDEN = 64
DEVICE_TOKENS = level_choice([1, 37, 4001], [1, 2, 37, 513, 4001, 8192])
DEVICE_EXPERTS = level_choice([72, 256], [1, 7, 32, 72, 160, 256, 384, 512])


def metadata(t):
    """What a fake must reproduce of a real output: shape, dtype and strides."""
    return tuple(t.shape), t.dtype, t.stride()


def lowering_cases(module) -> list[str]:
    """The case names of a kernel module (each at its own E and k)."""
    return sorted(_case_keys(module))


def _case_keys(module) -> dict:
    keys = {}
    for kernel in module.KERNELS.values():
        keys.update(kernel.case_keys(HIDDEN, 4))
    return keys


def check_cuda_compiles_to_sm90a_cubin(module, name: str, threads: int) -> str:
    """The case compiles to an sm_90a cubin within the budget, no shared memory, ``threads`` per CTA, ``T``
    dynamic; returns the CUDA source."""
    from tvm import tirx

    from cann_ops_tilelang.kernels.cuda import _build as cuda_build

    key = _case_keys(module)[name]
    kernel = next(k for k in module.KERNELS.values() if isinstance(key, k.key_type))
    prim_func = kernel.prim_func(key)
    tokens = prim_func.buffer_map[prim_func.params[0]].shape[0]
    assert isinstance(tokens, tirx.Var), tokens
    built = cuda_build.compile_cubin(prim_func, arch="sm_90a")
    assert built.cubin[:4] == b"\x7fELF" and built.fits and built.smem_bytes == 0
    assert built.threads == threads
    return built.source


def check_ascend_lowers_within_ub(module, name: str) -> str:
    """The case lowers to AscendC within the SIMT UB budget, ``T`` dynamic; returns the source."""
    from tvm import tirx

    from cann_ops_tilelang.kernels.ascend import _build as ascend_build

    key = _case_keys(module)[name]
    kernel = next(k for k in module.KERNELS.values() if isinstance(key, k.key_type))
    prim_func = kernel.prim_func(key)
    assert isinstance(prim_func.buffer_map[prim_func.params[0]].shape[0], tirx.Var)
    lowered = ascend_build.lower_ascendc(prim_func)
    assert "__global__" in lowered.source and lowered.has_simt
    assert 0 < lowered.ub_bytes <= lowered.budget_bytes, (key, lowered.ub_bytes, lowered.budget_bytes)
    return lowered.source


def check_launcher_views(monkeypatch, module, name: str, call: dict) -> object:
    """The launcher ``module.<name>`` hands its kernel the tensors its prim_func's parameters describe (dtype, shape
    with ``T`` dynamic, contiguous), in order; returns the key."""
    from tvm import tirx

    kernel = module.KERNELS[name]
    seen = []
    monkeypatch.setattr(kernel, "compiled", lambda key: lambda *args: seen.append((key, args)))
    outputs = ops.registered_ops()[name].prepare(**call)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    getattr(module, name)(**call, **dict(zip(ops.registered_ops()[name].declaration.outputs, outputs)))
    (key, args), = seen
    prim_func = kernel.prim_func(key)
    tokens = next(iter(call.values())).shape[0]
    assert len(args) == len(prim_func.params)
    for param, arg in zip(prim_func.params, args):
        buffer = prim_func.buffer_map[param]
        assert arg.dtype == getattr(torch, str(buffer.dtype)), (buffer.name, arg.dtype)
        want = [tokens if isinstance(d, tirx.Var) else int(d) for d in buffer.shape]
        assert list(arg.shape) == want and arg.is_contiguous(), (buffer.name, want, tuple(arg.shape))
    assert args[-len(outputs):] == outputs
    return key


def check_zero_tokens_launch_nothing(monkeypatch, name: str, call: dict) -> None:
    """On the device path (the CUDA kernel of declare, its kernel module stubbed): ``T = 0`` gives the fake's empty
    outputs and imports no kernel module."""
    from cann_ops_tilelang import _library

    calls = []
    monkeypatch.setattr(_library, "_backend_module", lambda *_: calls.append(1))
    public = ops.registered_ops()[name]
    got = public.backend_kernel("cuda")(**call)
    want = public.prepare(**call)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert [metadata(g) for g in got] == [metadata(w) for w in want] and all(g.numel() == 0 for g in got)
    assert calls == []


def assert_compiles_once(model, make_args, token_counts):
    """``model(*make_args(T))`` under ``torch.compile(fullgraph=True, dynamic=True)`` equals eager at every token
    count, compiled once (a recompile over T fails)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, tokens in enumerate(token_counts):
        args = make_args(tokens)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(*args)
        want = model(*args)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), tokens
