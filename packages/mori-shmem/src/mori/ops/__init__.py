"""mori.ops: MORI-EP, expert-parallel MoE dispatch and combine on mori.shmem's symmetric heap.

``EpDispatchCombineConfig``, ``EpDispatchCombineKernelType`` and ``EpDispatchCombineOp`` keep
MORI's names, fields and call signatures, so vLLM's and SGLang's MORI-EP code paths run on mori.
Ships with the mori-shmem distribution; needs torch (``pip install mori-shmem[torch]``).
"""

from ._config import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineQuantType
from ._routing import EpDispatchRoutingHandle
from ._stdmoe import launch_local_expert_count
from .dispatch_combine import EpDispatchCombineOp, warmup_jit_kernels

__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchCombineQuantType",
    "EpDispatchRoutingHandle",
    "launch_local_expert_count",
    "warmup_jit_kernels",
]
