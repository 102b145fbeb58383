"""Bad calls of every op, generated: each gets a TypeError/ValueError naming the op and an argument before
anything is written.

For every declared op a valid call is corrupted in one way (hypothesis picks the op, the argument and the
corruption): a list, a wrong dtype, a wrong shape with the same element count or one size too large where a
tensor belongs; ``True`` (or a numpy bool) for an int or a float, a string or a numpy bool for a bool; a scalar
that does not survive fp32 (``1e300``, or ``1e-50`` where the op needs a positive value) or that the schema
cannot hold (``2**63``, ``10**400``); a written buffer that shares memory with another argument (the same
tensor, or an overlapping view of one storage); a written buffer that is a leaf requiring grad.
The package's own CPU behaviour runs (the CPU reference kernels are disabled), so the argument checks are
the only thing between the call and the "no kernel for cpu" RuntimeError. Every tensor of the call is
compared bit for bit before and after. Every corruption of every op is also run once to check that its message
reads right (:func:`message_problems`: no ``None`` in a shape, no doubled words or ranks, a received type named
unlike the expected one).
"""

import re
import typing

import numpy as np
import pytest
import torch
from _plugins import cases
from _plugins.references import without_cpu_references
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cann_ops_tilelang as ops

TOKENS, MHC_HIDDEN, ENGRAM_HIDDEN = cases.TOKENS, cases.smallest_hidden("mhc"), cases.smallest_hidden("engram")
OPS = sorted(ops.registered_ops())


def valid_call(name: str) -> dict:
    """A valid call of the op ``name`` on CPU tensors, by argument name: its example call (tests/<family>/
    <family>_cases.py) at ``TOKENS`` tokens and the family's smallest hidden size."""
    return cases.call(name, TOKENS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # a contiguous copy: a strided argument (column-major scales) views as bytes only with a unit last stride
    t = t.detach().clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def _hints(name: str) -> dict:
    return typing.get_type_hints(ops.registered_ops()[name].prepare)


def _others(call: dict, arg: str) -> int:
    """How many tensors of the call are not the written argument ``arg`` (nor its list's elements)."""
    count = 0
    for k, v in call.items():
        if isinstance(v, torch.Tensor):
            count += k != arg
        elif isinstance(v, list):
            count += sum(isinstance(t, torch.Tensor) for t in v) - (k == arg)
    return count


def corruptions(name: str) -> list[tuple[str, str]]:
    """Every (argument, corruption) this test can apply to a valid call of ``name``."""
    public = ops.registered_ops()[name]
    call, hints, decl = valid_call(name), _hints(name), public.declaration
    any_shape = cases.any_shape(name)  # reshaped or resized, these stay valid
    out = []
    for arg, value in call.items():
        kind = hints[arg]
        if isinstance(value, torch.Tensor):
            out += [(arg, "list"), (arg, "dtype")]
            if value.dim() >= 1 and value.numel() > 1 and arg not in any_shape:
                out.append((arg, "shape"))
            if value.dim() >= 1 and arg not in any_shape:
                out.append((arg, "size"))
        if kind is int:
            out += [(arg, "bool"), (arg, "numpy_bool"), (arg, "float"), (arg, "int64_overflow")]
        if kind is float:
            out += [(arg, "bool"), (arg, "numpy_bool"), (arg, "huge"), (arg, "double_overflow")]
            if call[arg] > 0:
                out.append((arg, "tiny"))
        if kind is bool:
            out += [(arg, "string"), (arg, "numpy_bool")]
        if isinstance(value, list):
            out += [(arg, "element_dtype"), (arg, "element_shape"), (arg, "tensor_for_list")]
    for arg in decl.mutates_args:
        if _others(call, arg):  # something to alias with
            out += [(arg, "alias"), (arg, "overlap")]
        first = call[arg][0] if isinstance(call[arg], list) else call[arg]
        if first.is_floating_point():
            out.append((arg, "requires_grad"))
    return out


CASES = [(name, arg, how) for name in OPS for arg, how in corruptions(name)]


def _all_tensors(call: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for k, v in call.items():
        if isinstance(v, torch.Tensor):
            out.append((k, v))
        elif isinstance(v, list):
            out += [(f"{k}[{i}]", t) for i, t in enumerate(v) if isinstance(t, torch.Tensor)]
    return out


def corrupt(name: str, call: dict, arg: str, how: str) -> dict:
    value = call[arg]
    if isinstance(value, list) and how in ("alias", "overlap", "requires_grad"):
        # the written list's first element is the buffer; the list itself is rebuilt around it
        call[arg] = list(value)
        element = f"{arg}[0]"
        others = [(k, t) for k, t in _all_tensors(call) if k != element and t.numel() > 0]
        if how == "alias":
            other = next((t for _, t in others if t.shape == value[0].shape and t.dtype == value[0].dtype), None)
            call[arg][0] = other if other is not None else _view_of(others[0][1], value[0])
        elif how == "overlap":
            key, other = next((k, t) for k, t in others if "[" not in k)
            call[arg][0], call[key] = _overlapping(value[0], other)
        else:
            call[arg][0] = value[0].detach().clone().requires_grad_(True)
        return call
    if how == "element_dtype":
        call[arg] = [value[0].to(torch.float64), *value[1:]]
    elif how == "element_shape":
        call[arg] = [value[0].reshape(-1), *value[1:]]
    elif how == "tensor_for_list":
        call[arg] = value[0]
    elif how == "list":
        call[arg] = value.tolist()
    elif how == "dtype":
        call[arg] = value.to(torch.float64 if value.dtype != torch.float64 else torch.float32)
    elif how == "shape":
        call[arg] = value.reshape(-1) if value.dim() > 1 else value.reshape(1, -1)
    elif how == "size":  # the same rank, the last dim one too large (every last dim is checked against another)
        call[arg] = torch.zeros(*value.shape[:-1], value.shape[-1] + 1, dtype=value.dtype)
    elif how == "numpy_bool":
        call[arg] = np.bool_(True)
    elif how == "bool":
        call[arg] = True
    elif how == "float":
        call[arg] = float(value) + 0.5
    elif how == "huge":
        call[arg] = 1e300
    elif how == "int64_overflow":  # an int the dispatcher cannot convert to the schema's int64
        call[arg] = 2**63
    elif how == "double_overflow":  # an int where a float belongs, too large for a double
        call[arg] = 10**400
    elif how == "tiny":
        call[arg] = 1e-50
    elif how == "string":
        call[arg] = "False"
    elif how == "alias":
        # another argument becomes the written buffer itself
        other = next((k for k, v in call.items() if k != arg and isinstance(v, torch.Tensor)), None)
        call[other] = value if call[other].shape == value.shape and call[other].dtype == value.dtype else \
            _view_of(value, call[other])
    elif how == "overlap":
        # the written buffer and another argument: views of one storage that share their last/first bytes
        other = next(k for k, v in call.items() if k != arg and isinstance(v, torch.Tensor) and v.numel() > 0)
        call[arg], call[other] = _overlapping(value, call[other])
    elif how == "requires_grad":
        call[arg] = value.detach().clone().requires_grad_(True)
    return call


def _view_of(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed as ``like`` whose bytes start at ``buffer``'s (sharing its storage)."""
    nbytes = like.numel() * like.element_size()
    storage = torch.empty(max(nbytes, buffer.numel() * buffer.element_size()), dtype=torch.uint8)
    storage[: buffer.numel() * buffer.element_size()].copy_(buffer.reshape(-1).view(torch.uint8))
    buffer.data = storage[: buffer.numel() * buffer.element_size()].view(buffer.dtype).view(buffer.shape)
    return storage[:nbytes].view(like.dtype).view(like.shape)


def _overlapping(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``a`` and ``b`` in one byte storage where ``b`` starts 16 bytes before ``a`` ends."""
    na, nb = a.numel() * a.element_size(), b.numel() * b.element_size()
    shift = max(0, na - 16)
    storage = torch.zeros(shift + nb + na, dtype=torch.uint8)
    va = storage[:na].view(a.dtype).view(a.shape)
    va.copy_(a)
    vb = storage[shift:shift + nb].view(b.dtype).view(b.shape)
    return va, vb


def test_every_op_has_corruptions_of_every_kind():
    kinds = {how for _, _, how in CASES}
    assert kinds == {"list", "dtype", "shape", "size", "bool", "numpy_bool", "float", "huge", "tiny", "string", "alias",
                     "overlap", "requires_grad", "element_dtype", "element_shape", "tensor_for_list", "int64_overflow",
                     "double_overflow"}
    assert {name for name, _, _ in CASES} == set(OPS)
    for name in OPS:  # every op writing a buffer next to another tensor argument is probed for aliasing
        call = valid_call(name)
        written = ops.registered_ops()[name].declaration.mutates_args
        if written and _others(call, written[0]):
            assert (name, ops.registered_ops()[name].declaration.mutates_args[0], "alias") in CASES


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2**16))
def test_bad_calls_raise_before_anything_is_written(case, seed):
    name, arg, how = case
    torch.manual_seed(seed)
    call = corrupt(name, valid_call(name), arg, how)
    before = {k: _bits(v) for k, v in _all_tensors(call)}
    public = ops.registered_ops()[name]
    with without_cpu_references(), pytest.raises((TypeError, ValueError)) as info:
        public(**call)
    message = str(info.value)
    assert f"cann_ops_tilelang::{name}: argument '" in message, message
    is_list = isinstance(valid_call(name)[arg], list)
    if how in ("list", "dtype", "bool", "numpy_bool", "float", "huge", "tiny", "string", "requires_grad",
               "tensor_for_list", "int64_overflow", "double_overflow"):
        # the corrupted argument itself is named (a list's element by its index)
        named = f"{arg}[0]" if is_list and how == "requires_grad" else arg
        assert f"argument '{named}'" in message, (how, message)
    if how in ("element_dtype", "element_shape") and is_list:
        assert f"argument '{arg}[0]'" in message, (how, message)
    expected = TypeError if how in ("list", "dtype", "bool", "numpy_bool", "float", "string", "element_dtype",
                                    "tensor_for_list") else ValueError
    assert isinstance(info.value, expected), (how, message)
    after = dict(_all_tensors(call))
    for k, bits in before.items():
        assert torch.equal(_bits(after[k]), bits), f"{name}: argument {k} was written ({how} of {arg})"


# --- the messages read right ------------------------------------------------------------------------------

# "expected <what>, got <what>": the heads of both sides (articles and "dtype"/"shape" dropped)
_EXPECTED_GOT = re.compile(r"expected (?:an? |dtype |shape )?(?P<want>[^,]+?)(?: of shape .*?)?, got (?:an? |shape )?"
                           r"(?P<got>\S+)")


def message_problems(message: str) -> list[str]:
    """What reads wrong in an error message: ``None`` inside a shape, a word or a rank said twice in a row ("a
    2-D tensor 2-D"), a received type named like the expected one ("expected a bool, got bool" for a numpy
    bool), a Python type repr, an ``expected`` without a ``got``."""
    problems = []
    if re.search(r"\([^()]*\bNone\b[^()]*\)", message):
        problems.append("None inside a shape")
    ranks = re.findall(r"\b\d+-D\b", message)
    if len(ranks) != len(set(ranks)):
        problems.append(f"a rank said twice: {ranks}")
    doubled = re.search(r"(?<![\w.(,])([A-Za-z][\w.-]*) \1\b", message)
    if doubled:
        problems.append(f"a doubled word: {doubled[0]!r}")
    if "<class " in message or "torch._tensor" in message:
        problems.append("a Python type repr")
    match = _EXPECTED_GOT.search(message)
    if "expected" in message and match is None and "got" not in message:
        problems.append("expected without got")
    # where a type was expected ("a bool", "a torch.Tensor or None", "a list of torch.Tensor"), the type received
    # is named unlike it
    is_type = match and re.fullmatch(r"(list of )?[\w.]+( or None)?", match["want"])
    if is_type and match["want"].split()[0] == match["got"]:
        problems.append(f"expected and got read alike: {match['want']!r} / {match['got']!r}")
    return problems


def test_message_problems_finds_the_known_defects():
    """The checker itself: the messages of before the fix are caught, those of now pass."""
    bad = ["cann_ops_tilelang::op: argument 'x': expected a 2-D tensor 2-D, got shape (3,)",
           "cann_ops_tilelang::op: argument 'x': expected a 3-D tensor (2, 2, None), got shape (32,)",
           "cann_ops_tilelang::op: argument 'x': expected shape (2, 2, None), got (2, 3, 8)",
           "cann_ops_tilelang::op: argument 'flag': expected a bool, got bool",
           "cann_ops_tilelang::op: argument 'n': expected an int, got <class 'numpy.bool'>"]
    good = ["cann_ops_tilelang::op: argument 'x': expected a 2-D tensor, got shape (3,)",
            "cann_ops_tilelang::op: argument 'x': expected a 3-D tensor of shape (2, 2, *), got shape (32,)",
            "cann_ops_tilelang::op: argument 'x': expected shape (4, 4), got (4, 5)",
            "cann_ops_tilelang::op: argument 'flag': expected a bool, got numpy.bool True",
            ("cann_ops_tilelang::op: argument 'x': expected a torch.Tensor or None, got list whose element [0] is "
             "bool False")]
    assert all(message_problems(m) for m in bad), [m for m in bad if not message_problems(m)]
    assert not any(message_problems(m) for m in good), [message_problems(m) for m in good]


@pytest.mark.parametrize("name", OPS)
def test_every_corruption_reads_right(name):
    """Every corruption of the op, once each: the error names the op and an argument ('the argument' itself
    where the corruption is of a kind the op checks on it alone), and its message reads right."""
    public = ops.registered_ops()[name]
    for arg, how in corruptions(name):
        torch.manual_seed(0)
        call = corrupt(name, valid_call(name), arg, how)
        with without_cpu_references(), pytest.raises((TypeError, ValueError)) as info:
            public(**call)
        message = str(info.value)
        assert message.startswith(f"cann_ops_tilelang::{name}: argument '"), (how, message)
        if how in ("list", "dtype", "bool", "numpy_bool", "float", "string", "huge", "tiny", "int64_overflow",
                   "double_overflow", "tensor_for_list"):
            assert message.startswith(f"cann_ops_tilelang::{name}: argument '{arg}': expected "), (how, message)
        assert not message_problems(message), (how, message, message_problems(message))
        if how == "numpy_bool":
            assert message.endswith(", got numpy.bool True"), message
        if how == "double_overflow":
            assert message.endswith("got int of 401 digits (100000...)"), message
        if how in ("shape", "element_shape") and "-D tensor" in message:
            assert re.search(r": expected a \d-D tensor(?: of shape \([^)]*\))?, got shape \(\d+(, \d+)*,?\)$",
                             message), message


def test_check_messages_exactly():
    from cann_ops_tilelang._checks import OpError, check_bool, check_float, check_int, check_tensor

    err = OpError("op")
    f32 = torch.float32
    cases = [
        (lambda: check_tensor(err, "x", torch.zeros(3), dtype=f32, ndim=2), ValueError,
         "expected a 2-D tensor, got shape (3,)"),
        (lambda: check_tensor(err, "x", torch.zeros(3), dtype=f32, shape=(None, 4, 512)), ValueError,
         "expected a 3-D tensor of shape (*, 4, 512), got shape (3,)"),
        (lambda: check_tensor(err, "x", torch.zeros(3, 5, 512), dtype=f32, shape=("T", 4, 512)), ValueError,
         "expected shape (T, 4, 512), got (3, 5, 512)"),
        (lambda: check_tensor(err, "x", torch.zeros(2, 3), dtype=f32, shape=(2, None)), None, ""),
        (lambda: check_tensor(err, "x", np.zeros(3), dtype=f32, ndim=1), TypeError,
         "expected a torch.Tensor, got numpy.ndarray"),
        (lambda: check_bool(err, "flag", np.bool_(True)), TypeError, "expected a bool, got numpy.bool True"),
        (lambda: check_bool(err, "flag", 1), TypeError, "expected a bool, got int 1"),
        (lambda: check_int(err, "n", np.bool_(False)), TypeError, "expected an int, got numpy.bool False"),
        (lambda: check_int(err, "n", np.float32(1.5)), TypeError, "expected an int, got numpy.float32 1.5"),
        (lambda: check_int(err, "n", True), TypeError, "expected an int, got bool True"),
        (lambda: check_float(err, "eps", "1e-6", minimum=0.0), TypeError, "expected a float, got str '1e-6'"),
        (lambda: check_float(err, "eps", torch.tensor(1.0), minimum=0.0), TypeError,
         "expected a float, got torch.Tensor"),
        (lambda: check_float(err, "eps", None, minimum=0.0), TypeError, "expected a float, got None"),
    ]
    for call, exc, text in cases:
        if exc is None:
            call()
            continue
        with pytest.raises(exc) as info:
            call()
        assert str(info.value) == f"cann_ops_tilelang::op: argument '{info.value.args[0].split(chr(39))[1]}': {text}"
        assert not message_problems(str(info.value)), str(info.value)
    assert check_int(err, "n", np.int64(3)) == 3 and type(check_int(err, "n", np.int64(3))) is int


def test_public_kind_checks_name_numpy_and_list_elements():
    """The public functions' kind checks (before the dispatcher) name the received type as the checks do."""
    call = valid_call("engram_gate_forward")
    with pytest.raises(TypeError) as info:
        ops.engram_gate_forward(**{**call, "save_for_backward": np.bool_(False)})
    assert str(info.value) == ("cann_ops_tilelang::engram_gate_forward: argument 'save_for_backward': expected a bool, "
                               "got numpy.bool False")
    call = valid_call("mhc_multilayer_recompute")
    with pytest.raises(TypeError) as info:
        ops.mhc_multilayer_recompute(**{**call, "pre_mix_list": [1.0, *call["pre_mix_list"][1:]]})
    assert str(info.value) == ("cann_ops_tilelang::mhc_multilayer_recompute: argument 'pre_mix_list': expected a "
                               "list of torch.Tensor, got list whose element [0] is float 1.0")


@pytest.mark.parametrize("name", OPS)
def test_calls_that_do_not_bind_name_the_op(name):
    """A missing, unknown or repeated argument is a TypeError naming the op (not the dispatcher's error)."""
    call = valid_call(name)
    public = ops.registered_ops()[name]
    first, *rest = call
    for args, kwargs, text in (((), {k: call[k] for k in rest}, f"missing a required argument: '{first}'"),
                               ((), {**call, "bogus": 1}, "got an unexpected keyword argument 'bogus'"),
                               ((call[first],), call, f"multiple values for argument '{first}'")):
        with without_cpu_references(), pytest.raises(TypeError, match=f"cann_ops_tilelang::{name}: {text}"):
            public(*args, **kwargs)


@pytest.mark.parametrize("name", OPS)
def test_valid_calls_pass_every_check(name):
    """The uncorrupted calls are valid: they reach the 'no kernel for cpu' error (naming the op, the device and
    the devices with kernels, then, on a second line, what works without them), so every error above comes from
    the corruption."""
    with without_cpu_references(), pytest.raises(RuntimeError) as info:
        ops.registered_ops()[name](**valid_call(name))
    assert str(info.value) == (
        f"cann_ops_tilelang::{name}: no kernel for tensors on device 'cpu'; supported devices: cuda, npu\n"
        'without a GPU or NPU: device="meta" runs the modules forward and backward (shapes only) and '
        'torch.compile(backend="aot_eager") traces a model on meta tensors (README.md, section "Without a GPU")')


# --- the Python wrappers that reshape: leading dims are checked before any reshape --------------------------

def test_post_wrappers_check_leading_dims_before_reshaping():
    x, residual, post, comb = valid_call("mhc_post_forward").values()
    with pytest.raises(ValueError, match=r"mhc_post_forward: argument 'x': expected shape \(3, 256\)"):
        ops.mhc_post_forward(x.reshape(6, 128), residual, post, comb)
    out = torch.empty(TOKENS, MHC_HIDDEN, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"mhc_post_forward_out: argument 'out': expected shape \(3, 4, 256\)"):
        ops.mhc_post_forward(x, residual, post, comb, out=out)
    with pytest.raises(ValueError, match=r"mhc_post_backward: argument 'grad_out'"):
        ops.mhc_post_backward(x, residual, post, comb, torch.empty(TOKENS * 4, MHC_HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"mhc_post_forward_out: argument 'out': expected a buffer that shares no "
                                         r"memory with 'residual'"), without_cpu_references():
        ops.mhc_post_forward(x, residual, post, comb, out=residual)
    with pytest.raises(TypeError, match=r"mhc_post_forward: argument 'comb_res_mix': expected a torch.Tensor"):
        ops.mhc_post_forward(x, residual, post, comb.tolist())


def test_post_wrappers_refuse_what_a_flat_view_cannot_take():
    """Sizes of 0 reach the op's own size checks (no reshape error), every argument must be a contiguous tensor
    (flattening is a view, never a silent copy) and ``out`` is on the inputs' device."""
    import numpy as np

    x, residual, post, comb = valid_call("mhc_post_forward").values()
    bf16 = torch.bfloat16
    cases = [
        (lambda: ops.mhc_post_forward(torch.empty(TOKENS, 0, dtype=bf16), torch.empty(TOKENS, 4, 0, dtype=bf16),
                                      post, comb), ValueError, r"mhc_post_forward: argument 'residual': expected a "
                                                               r"hidden size"),
        (lambda: ops.mhc_post_forward(x, torch.empty(TOKENS, 0, MHC_HIDDEN, dtype=bf16), torch.empty(TOKENS, 0),
                                      torch.empty(TOKENS, 0, 0)), ValueError, r"'residual': expected hc_mult 4"),
        (lambda: ops.mhc_post_forward(x.view(1, TOKENS, -1).expand(2, -1, -1),
                                      residual.view(1, *residual.shape).expand(2, -1, -1, -1), post.expand(2, -1, -1),
                                      comb.expand(2, -1, -1, -1)), ValueError, r"'x': expected a contiguous tensor"),
        (lambda: ops.mhc_post_forward(x, np.zeros(tuple(residual.shape)), post, comb), TypeError,
         r"mhc_post_forward: argument 'residual': expected a torch.Tensor, got numpy.ndarray"),
        (lambda: ops.mhc_post_backward(x, residual, post, comb, np.zeros(tuple(residual.shape))), TypeError,
         r"mhc_post_backward: argument 'grad_out': expected a torch.Tensor"),
        (lambda: ops.mhc_post_forward(x, residual, post, comb, out=torch.empty(residual.shape, dtype=bf16,
                                                                                device="meta")),
         ValueError, r"mhc_post_forward_out: argument 'out': expected a tensor on cpu"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def test_engram_gate_checks_kv_and_mask_before_reshaping():
    from cann_ops_tilelang.modeling import engram_gate

    x = torch.randn(TOKENS, 4, ENGRAM_HIDDEN, dtype=torch.bfloat16)
    wh = torch.ones(4, ENGRAM_HIDDEN, dtype=torch.bfloat16)
    kv_wrong = torch.randn(5, 1536 * TOKENS * 5 // 5 // 5 * 0 + TOKENS * 5 * ENGRAM_HIDDEN // 5,
                           dtype=torch.bfloat16)
    assert kv_wrong.numel() == TOKENS * 5 * ENGRAM_HIDDEN  # the right element count, the wrong shape
    with pytest.raises(ValueError, match=r"modeling.engram_gate: argument 'kv': expected shape \(3, 2560\)"):
        engram_gate(x, kv_wrong, wh, wh)
    kv = torch.randn(TOKENS, 5 * ENGRAM_HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument 'image_token_mask': expected shape \(3,\)"):
        engram_gate(x, kv, wh, wh, image_token_mask=torch.zeros(1, TOKENS, dtype=torch.bool))


def test_engram_gate_forward_flags_are_bools():
    x = torch.randn(TOKENS, 4, ENGRAM_HIDDEN, dtype=torch.bfloat16)
    kv = torch.randn(TOKENS, 5, ENGRAM_HIDDEN, dtype=torch.bfloat16)
    x0 = x.clone()
    with pytest.raises(TypeError, match="engram_gate_forward: argument 'inplace': expected a bool, got str 'False'"):
        ops.engram_gate_forward(x, kv, torch.ones(4, ENGRAM_HIDDEN), 1e-6, 1e-6, False, None, "False")
    assert torch.equal(x, x0)


def test_main_grad_must_be_contiguous():
    from cann_ops_tilelang.modeling._buffers import honoured_main_grad

    weight = torch.nn.Parameter(torch.ones(4, ENGRAM_HIDDEN, dtype=torch.bfloat16))
    weight.main_grad = torch.zeros(ENGRAM_HIDDEN, 4).t()
    with pytest.raises(ValueError, match="modeling.engram_gate: argument 'weight_hidden.main_grad': expected a "
                                         "contiguous fp32 buffer .*, not contiguous"):
        honoured_main_grad(weight, "modeling.engram_gate", "weight_hidden")


def test_scalars_that_do_not_survive_fp32():
    call = valid_call("engram_gate_backward")
    for value, text in ((1e-50, "stays so in fp32"), (-1e-40, "number > 0"), (1e300, "finite in fp32"), (float("nan"), "finite")):
        call["clamp_value"] = value
        with pytest.raises(ValueError, match=f"engram_gate_backward: argument 'clamp_value': expected .*{text}"):
            ops.engram_gate_backward(**call)
    call["clamp_value"] = 1e-30  # small but a normal fp32 number: valid (the CPU reference kernel runs)
    grads = ops.engram_gate_backward(**call)
    assert all(torch.isfinite(g.float()).all() for g in grads)
