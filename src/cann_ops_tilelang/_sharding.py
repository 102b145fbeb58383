"""DTensor sharding rules of the ops (docs/distributed.md), declared in each op module with
``public.sharding(...)`` and registered with DTensor's sharding propagator on first need.

A rule is a few *strategies*, each a mapping ``{argument: code, "returns": code or tuple of codes}`` over a
single mesh dimension; codes are strings so that declaring a rule imports nothing from torch.distributed:
``"R"`` Replicate, ``"S<d>"`` Shard(d), ``"P"`` Partial (sum). A tensor argument or result a strategy does
not name is Replicate; a list argument's code applies to each element. Every rule ends with the
all-Replicate strategy (the fallback: DTensor gathers, computes everywhere, results replicated).

Written buffers (``mutates_args``) are never redistributed: DTensor would write into a temporary copy and
drop the result (``register_sharding`` guards only self of ``_``-suffixed ops and ``out=`` keywords, so the
rules go to the propagator directly, with this check). Only strategies where every written buffer keeps
the placement it has are offered; if none is left the call raises a ``RuntimeError`` that names the
buffers and the placements the rule accepts.

Registration imports ``torch.distributed.tensor`` (about 0.6 s), so it is lazy: the public functions
register every rule on their first eager call after that module has been imported by someone (FSDP2,
tensor parallel, a DTensor). A build without torch.distributed registers nothing.
"""

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["PENDING", "Rule", "register_all"]

# True while a declared rule is not registered (the public functions check it, then sys.modules).
PENDING = False

_CODE = re.compile(r"R|P|S(\d)")


def _check_code(where: str, code: Any) -> str:
    if not isinstance(code, str) or not _CODE.fullmatch(code):
        raise ValueError(f"{where}: expected a placement code 'R', 'P' or 'S<dim>', got {code!r}")
    return code


class Rule:
    """The sharding strategies of one op, checked against its arguments when declared."""

    def __init__(self, decl: Any, names: Sequence[str], strategies: Sequence[Mapping[str, Any]],
                 unsupported: str | None):
        self.name = decl.name
        self.mutates_args = tuple(decl.mutates_args)
        self.unsupported = unsupported
        if unsupported is not None and strategies:
            raise ValueError(f"{decl.name}: a rule is either strategies or unsupported, not both")
        checked = []
        for i, strategy in enumerate(strategies):
            where = f"{decl.name}: sharding strategy {i}"
            unknown = sorted(set(strategy) - set(names) - {"returns"})
            if unknown:
                raise ValueError(f"{where} names no argument of the op: {unknown}")
            returns = strategy.get("returns", ())
            returns = (returns,) if isinstance(returns, str) else tuple(returns)
            checked.append(({k: _check_code(f"{where}, {k}", v) for k, v in strategy.items() if k != "returns"},
                            tuple(_check_code(f"{where}, returns", c) for c in returns)))
        self.strategies = tuple(checked)
        self.registered = False


def _placement(code: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code == "R":
        return Replicate()
    if code == "P":
        return Partial("sum")
    return Shard(int(code[1:]))


def _named_inputs(names: Sequence[str], op_schema) -> list[tuple[str | None, Any]]:
    """The op's tensor inputs in DTensor's order (``args_strategy + kwargs_strategy``), each with the name of
    the argument it belongs to (a list argument names each of its elements)."""
    from torch.distributed.tensor._op_schema import OpStrategy, TupleStrategy

    owner: dict[int, str] = {}
    given = list(zip(names, op_schema.args_schema)) + list(op_schema.kwargs_schema.items())
    for name, value in given:
        if isinstance(value, OpStrategy):
            owner[id(value)] = name
        elif isinstance(value, (TupleStrategy, list, tuple)):
            for child in value.children if isinstance(value, TupleStrategy) else value:
                owner[id(child)] = name
    return [(owner.get(id(s)), s) for s in (*op_schema.args_strategy, *op_schema.kwargs_strategy)]


def _describe(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


@functools.cache
def _uneven_sharding() -> dict[str, bool]:
    """``allow_uneven_sharding=True`` where torch has it: a tensor already sharded as asked stays valid with fewer
    rows than ranks. torch 2.11 lacks the argument and drops such a strategy: the call takes the all-Replicate
    fallback (gathering), or is refused where a buffer it writes is sharded (docs/distributed.md)."""
    import inspect

    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    known = inspect.signature(expand_to_full_mesh_op_strategy).parameters
    return {"allow_uneven_sharding": True} if "allow_uneven_sharding" in known else {}


def _strategy(rule: Rule, names: Sequence[str], op_schema):
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    from ._library import NAMESPACE

    qualname = f"{NAMESPACE}::{rule.name}"
    if rule.unsupported is not None:
        raise NotImplementedError(f"{qualname} has no DTensor sharding rule: {rule.unsupported}")
    inputs = _named_inputs(names, op_schema)
    outputs = len(op_schema.op._schema.returns)
    single = []
    for codes, returns in (*rule.strategies, ({}, ())):  # the declared strategies, then all-Replicate
        out = [_placement(c) for c in (returns or ("R",) * outputs)]
        single.append(out + [_placement(codes.get(name, "R")) for name, _ in inputs])
    found = expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(validate=False), op_schema, single,
                                            input_index=outputs, **_uneven_sharding())
    written = [(j, name, s.strategies[0].output_spec.placements) for j, (name, s) in enumerate(inputs)
               if name in rule.mutates_args]
    if not written:
        return found
    keep = [s for s in found.strategies if all(s.input_specs[j].placements == now for j, _, now in written)]
    if not keep:
        have = ", ".join(f"{name} {_describe(now)}" for _, name, now in written)
        accepted = "; ".join(
            ", ".join(f"{name} {_describe(s.input_specs[j].placements)}" for j, name, _ in written)
            for s in found.strategies)
        raise RuntimeError(
            f"{qualname} on DTensors: the buffers it writes cannot be redistributed (the result would land in "
            f"a temporary copy), and no strategy of its rule keeps them as they are: {have}. Placements the "
            f"rule accepts with these inputs: {accepted or 'none'}. Pass the buffers with one of those "
            f"placements (docs/distributed.md).")
    return OpStrategy(keep)


def register_all(ops: Mapping[str, Any]) -> list[str]:
    """Registers the rule of every op of ``ops`` (``{name: op state with .sharding and .names}``) not yet
    registered; returns their names. Nothing (and ``[]``) where torch.distributed is unavailable."""
    global PENDING
    PENDING = False
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return []
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    except (ImportError, RuntimeError, AttributeError):
        return []
    from ._library import NAMESPACE

    propagator = DTensor._op_dispatcher.sharding_propagator
    done = []
    for name, op in ops.items():
        rule = op.sharding
        if rule is None or rule.registered:
            continue
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default
        # every argument is part of the propagation cache key (scalars such as n_splits or save_for_backward
        # change output shapes); needs_pytree so list arguments are seen element by element
        info = RuntimeSchemaInfo(static_argnum=0, static_kwargkey=list(op.names), needs_pytree=True)
        propagator.register_op_strategy(overload, functools.partial(_strategy, rule, op.names), info)
        rule.registered = True
        done.append(name)
    return done
