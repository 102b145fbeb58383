"""Registers the device-free PyTorch references as the CPU kernels of the custom ops.

The package has no CPU kernels: a CPU tensor normally gets a RuntimeError. For the CPU test tier
(opcheck, compile traces, autograd wrappers) every op gets a CPU kernel here that runs the op's own
prepare step (the same validation and allocation the device kernels use) and then the reference named
after the op, ``<op>_ref`` in ``tests/<family>/<family>_ref.py`` (no table: a declared op without one is an
error). An op that returns new outputs gets the reference's results copied into the outputs its prepare
step allocated (a reference with an ``outputs`` keyword gets them too, e.g. to partition as they are
shaped); an op that only writes its buffer arguments runs the reference on them. Tests that need the
package's real CPU behaviour disable this with :func:`without_cpu_references`.
"""

import contextlib
import importlib
import inspect
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent

import torch  # noqa: E402

import cann_ops_tilelang as ops  # noqa: E402

_registered = False
_enabled = True
_LIBRARY = None  # the references' registrations on the CPU key (kept alive with the process)


def _family_refs(family: str):
    path = str(_TESTS / family)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(f"{family}_ref")


def _copy_all(outputs, results):
    if isinstance(outputs, (tuple, list)):  # several outputs, or one list of tensors (Tensor[] returns)
        for out, res in zip(outputs, results):
            out.copy_(res)
    else:
        outputs.copy_(results)


def reference(public):
    """The reference function of a declared op (``<op>_ref`` of its family's reference module)."""
    decl = public.declaration
    module = _family_refs(decl.family)
    ref = getattr(module, f"{decl.name}_ref", None)
    if ref is None:
        raise RuntimeError(f"no CPU reference {decl.name}_ref in tests/{decl.family}/{decl.family}_ref.py")
    return ref


def register() -> None:
    """Registers every reference once per process."""
    global _registered, _LIBRARY
    if _registered:
        return
    _LIBRARY = torch.library.Library("cann_ops_tilelang", "IMPL", "CPU")
    for name, public in ops.registered_ops().items():
        _LIBRARY.impl(name, _kernel(public, reference(public)))
    _registered = True


def _kernel(public, ref):
    """A CPU kernel: the op's prepare step (validation, allocation), then the reference; arguments are bound
    as the device kernels bind them (``_Op.bind``: every argument in order, defaults filled)."""
    wants_outputs = "outputs" in inspect.signature(ref).parameters

    def kernel(*args, **kwargs):
        if not _enabled:  # the package's own behaviour on the CPU
            return public.op_state.unsupported(*args, **kwargs)
        full, _arguments = public.op_state.bind(args, kwargs)
        outputs = public.prepare(*full)
        extra = {"outputs": outputs} if wants_outputs else {}
        results = ref(*full, **extra)
        if outputs is not None:
            _copy_all(outputs, results)
        return outputs

    return kernel


@contextlib.contextmanager
def without_cpu_references():
    """Disables the CPU reference kernels inside the block (the package's own CPU behaviour)."""
    global _enabled
    saved, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = saved


def pytest_configure(config):  # noqa: ARG001 - pytest hook signature
    register()
