"""The public names renamed in 0.2 (src/cann_ops_tilelang/_deprecated.py) keep working for one release: each old
function, op and keyword name gives what the new one gives, bitwise, with a ``DeprecationWarning`` naming the new
name; the new names never warn. Remove with ``_deprecated.py`` in 0.3."""

import importlib
import warnings

import pytest
import torch
from _plugins import cases

import cann_ops_tilelang as ops
from cann_ops_tilelang import _deprecated

OLD_OPS = sorted(_deprecated.RENAMED_OPS.items())
OLD_KEYWORDS = sorted(_deprecated.RENAMED_ARGUMENTS)


def test_every_renamed_name_is_registered_under_its_new_name_and_the_old_one_is_gone():
    registered = ops.registered_ops()
    for old, new in _deprecated.RENAMED_OPS.items():
        assert new in registered and old not in registered and old not in ops.__all__
    for op, renamed in _deprecated.RENAMED_ARGUMENTS.items():
        params = [a.name for a in registered[op].op._schema.arguments]
        assert set(renamed.values()) <= set(params) and not set(renamed) & set(params), op


@pytest.mark.parametrize("old,new", OLD_OPS)
@pytest.mark.parametrize("module", ["cann_ops_tilelang", "cann_ops_tilelang.engram", "cann_ops_tilelang.engram.gate"])
def test_old_function_names_warn_and_are_the_new_functions(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated .* use '{new}'"):
        got = getattr(mod, old)
    assert got is getattr(mod, new)
    with pytest.raises(AttributeError, match="no attribute 'engram_gate_sideways'"):
        mod.engram_gate_sideways  # noqa: B018


@pytest.mark.parametrize("old,new", OLD_OPS)
def test_old_op_names_warn_and_resolve_to_the_new_ops(old, new):
    with pytest.warns(DeprecationWarning, match=f"torch.ops.cann_ops_tilelang.{new}"):
        overload = getattr(torch.ops.cann_ops_tilelang, old).default
    assert overload is getattr(torch.ops.cann_ops_tilelang, new).default


def _results(value):
    return [value] if isinstance(value, torch.Tensor) else list(value or ())


@pytest.mark.parametrize("name", OLD_KEYWORDS)
def test_old_keywords_warn_and_give_the_new_keywords_results_bitwise(name):
    renamed = _deprecated.RENAMED_ARGUMENTS[name]
    public = ops.registered_ops()[name]
    new_call = cases.call(name)
    old_call = cases.call(name)  # the same draws (seeded), its own buffers
    back = {new: old for old, new in renamed.items()}
    old_call = {back.get(k, k): v for k, v in old_call.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names never warn
        new_out = _results(public(**new_call))
    with pytest.warns(DeprecationWarning) as record:
        old_out = _results(public(**old_call))
    assert sorted(str(w.message).split("'")[1] for w in record) == sorted(renamed)
    for a, b in zip(old_out, new_out, strict=True):
        assert torch.equal(a, b)
    for key, value in new_call.items():  # the written buffers too
        if isinstance(value, torch.Tensor):
            assert torch.equal(old_call[back.get(key, key)], value), key


def test_an_argument_under_both_names_is_refused():
    name = "expand_to_mhc_backward"
    call = cases.call(name)
    with pytest.raises(TypeError, match=r"expand_to_mhc_backward\(\) got the argument 'grad_out' twice"):
        ops.expand_to_mhc_backward(**call, out_grad=call["grad_out"])
