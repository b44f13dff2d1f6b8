"""mori.ops: MORI-EP, expert-parallel MoE dispatch and combine on mori.shmem's symmetric heap.

``EpDispatchCombineConfig``, ``EpDispatchCombineKernelType`` and ``EpDispatchCombineOp`` keep
MORI's names, fields and call signatures, so vLLM's and SGLang's MORI-EP code paths run on mori.
Ships with the mori-shmem distribution; needs torch (``pip install mori-shmem[torch]``).
"""

from ._config import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineQuantType
from .dispatch_combine import EpDispatchCombineOp

__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchCombineQuantType",
]
