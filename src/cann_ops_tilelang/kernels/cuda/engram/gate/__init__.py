"""CUDA kernels of the op module ``gate`` (docs/ops/engram.md#gate): ``engram_gate_forward`` (also launched by
``engram_gate_forward_inplace``) in :mod:`.forward`, ``engram_gate_backward`` in :mod:`.backward` (its schedule plan,
which fixes the partial-row count, is device policy: ``policy.py``).

Supported sizes: ``limits.ENGRAM_HIDDEN`` and ``limits.ENGRAM_HC_MULT`` (a builder raises
``limits.LimitError`` outside them); any token count (a dynamic dimension of every kernel). Where the
backward cannot hold its weight-gradient accumulators in registers, even split over a 2-CTA cluster, it
keeps an ``m * H`` fp32 tile in shared memory: at most 124 KiB, at m = 4 and H = 7936.
"""

from ...._kernel import kernel_module
from ._keys import BwdKey, FwdKey
from .backward import (BACKWARD, PIPELINED, BwdPlan, build_engram_gate_backward, bwd_plan, engram_gate_backward,
                       num_partials)
from .forward import FORWARD, build_engram_gate_forward, engram_gate_forward, fwd_layout

# kernel parameters named differently from the op argument they receive (the forward's; the backward's
# parameters carry the op's names)
ARGUMENTS = {"x": "hidden_states", "wf": "weight_fused", "mask": "image_token_mask", "clamp": "clamp_value"}

KERNELS, lowering_cases, __all__ = kernel_module(__name__, FORWARD, BACKWARD, PIPELINED)
