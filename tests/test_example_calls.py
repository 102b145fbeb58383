"""The example calls of every op, generated from the families' cases registries (tests/<family>/<family>_cases.py,
read through tests/_plugins/cases.py): the registries hold exactly the registered ops, every call binds in the
schema's order and passes the op's checks at every size, its fake on meta tensors gives what the CPU reference
gives, and ``torch.library.opcheck`` (schema, fake against the reference, autograd registration, AOT dispatch)
passes on every example call: T = 0 and T > 0 at each hidden size that matters (test level 0: the smallest)."""

import pytest
import torch
from _plugins import cases
from _plugins.levels import test_level

import cann_ops_tilelang as ops

OPS = sorted(ops.registered_ops())


def _sizes(name: str) -> list[tuple[int, int]]:
    sizes = cases.example_sizes(name)
    return sizes if test_level() >= 1 else [size for size in sizes if size[1] == sizes[0][1]]


EXAMPLES = [(name, tokens, hidden) for name in OPS for tokens, hidden in _sizes(name)]


def test_every_registered_op_has_example_calls_and_nothing_else_is_there():
    assert cases.registry_problems() == []
    assert sorted(name for family in cases.families() for name in cases.builders(family)) == OPS
    assert set(cases.registry_files()) == set(cases.families())


def test_registry_problems_names_what_is_missing_and_what_is_extra(monkeypatch):
    module = cases.cases_module("mhc")

    def mhc_no_such_op_call(tokens, hidden):
        return {}

    mhc_no_such_op_call.__module__ = module.__name__
    monkeypatch.setattr(module, "mhc_no_such_op_call", mhc_no_such_op_call, raising=False)
    monkeypatch.delattr(module, "mhc_post_forward_out_call")
    assert cases.registry_problems() == [
        "mhc_post_forward_out: no mhc_post_forward_out_call in tests/mhc/mhc_cases.py",
        "tests/mhc/mhc_cases.py: mhc_no_such_op_call calls no registered op of the family"]
    with pytest.raises(LookupError, match="no example call mhc_post_forward_out_call in tests/mhc/mhc_cases.py"):
        cases.call("mhc_post_forward_out")


@pytest.mark.parametrize("name", OPS)
def test_example_calls_bind_in_schema_order_and_pass_the_checks(name):
    public = ops.registered_ops()[name]
    for tokens, hidden in cases.example_sizes(name):
        call = cases.call(name, tokens, hidden)
        assert list(call) == list(public.op_state.names), (tokens, hidden)
        public.prepare(**call)  # validation and allocation: metadata only


def _metadata(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.stride()
    if isinstance(value, (list, tuple)):
        return [_metadata(v) for v in value]
    return value


@pytest.mark.parametrize("name", OPS)
def test_fakes_on_meta_tensors_match_the_reference_results(name, seed):
    """The op on meta tensors (its prepare function, the fake) gives outputs shaped, typed and strided as the CPU
    reference's, at T = 0 and T > 0."""
    public = ops.registered_ops()[name]
    for tokens in (0, cases.TOKENS):
        real = public(**cases.call(name, tokens, seed=seed))
        fake = public(**cases.call(name, tokens, seed=seed, device="meta"))
        assert _metadata(fake) == _metadata(real), tokens
        assert all(t.device.type == "meta" for t in (fake if isinstance(fake, (tuple, list)) else (fake,))
                   if t is not None)


@pytest.mark.parametrize("name,tokens,hidden", EXAMPLES, ids=[f"{n}-T{t}-H{h}" for n, t, h in EXAMPLES])
def test_opcheck(name, tokens, hidden, seed):
    op = getattr(torch.ops.cann_ops_tilelang, name).default
    args = tuple(cases.call(name, tokens, hidden, seed=seed).values())
    torch.library.opcheck(op, args, test_utils=opcheck_utils(args))


def opcheck_utils(args) -> tuple[str, ...]:
    """opcheck's tests for these arguments: all, but test_schema where an input is float8 (torch's SchemaCheckMode
    compares the inputs before and after with allclose, which CPU float8 tensors lack: a torch limitation; mutations
    are still checked by the fake against the reference)."""
    utils = tuple(torch.library._OPCHECK_DEFAULT_UTILS)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if any(isinstance(a, torch.Tensor) and a.dtype in fp8 for a in args):
        utils = tuple(u for u in utils if u != "test_schema")
    return utils
