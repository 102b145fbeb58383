"""cann_ops_tilelang: PyTorch custom ops with TileLang kernels for Ascend 950 NPUs and CUDA GPUs.

Every operator is a ``torch.library`` custom op ``cann_ops_tilelang::<name>`` with a fake
implementation, so it runs in eager mode, under ``torch.compile(fullgraph=True)`` and inside the
autograd wrappers of :mod:`cann_ops_tilelang.modeling`. Importing the package registers every op;
it touches no device and imports neither TileLang nor torch_npu.
"""

from . import _deprecated
from ._library import registered_ops
from ._version import __version__
from .engram import *  # noqa: F403 - the Engram ops
from .engram import __all__ as _engram_all
from .mhc import *  # noqa: F403 - the mHC primitives
from .mhc import __all__ as _mhc_all
from .moe import *  # noqa: F403 - the MoE routing gates
from .moe import __all__ as _moe_all
from .norm import *  # noqa: F403 - RMSNorm, LayerNorm, SwiGLU
from .norm import __all__ as _norm_all
from .quant import *  # noqa: F403 - the quant casts and their layout type
from .quant import __all__ as _quant_all

__all__ = ["__version__", "registered_ops", *_engram_all, *_mhc_all, *_moe_all, *_norm_all, *_quant_all]

_deprecated.install_op_aliases()
__getattr__ = _deprecated.module_getattr(__name__, globals())  # the names renamed in 0.2, for one release
