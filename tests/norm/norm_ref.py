"""Device-free PyTorch references of the norm family (docs/ops/norm.md).

The ``<op>_ref`` of a declared op takes the op's arguments and returns its outputs (writing its buffers): the
test plugin registers it as the op's CPU kernel. fp32 arithmetic in the contract's order where the kernels are
compared bitwise (the fused cast's bytes), float64 oracles (``*_f64``) for the tolerances of docs/ops/norm.md.
"""

import torch

F32, F64 = torch.float32, torch.float64
