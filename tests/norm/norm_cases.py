"""Example calls of the norm ops, the family's cases registry (read through tests/_plugins/cases.py): for each op
``<op>_call(tokens, hidden, *, seed=0, device="cpu", ...)`` returns a valid call by argument name in schema order.
"""

import torch

import cann_ops_tilelang as ops

BF16, F32 = torch.bfloat16, torch.float32

# the family's ops as registered, not listed here (each has an <op>_call below: tests/test_example_calls.py)
OPS = [name for name, public in ops.registered_ops().items() if public.declaration.family == "norm"]
