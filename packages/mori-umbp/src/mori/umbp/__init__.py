"""mori.umbp: UMBP, the KV-cache pool that SGLang's HiCache storage backend ``mori`` stores into.

MORI's Python API: build a :class:`UMBPConfig` (or ``UMBPConfig.from_environment()``), create a
:class:`UMBPClient` from it, then put and get pages by key from and into raw pointers, singly or
in batches. A pool has a DRAM tier in host memory and an optional SSD tier of files; a cluster of
nodes is joined by a master (``mori-umbp-master``) when ``UMBPConfig.distributed`` names one.
"""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING as _TYPE_CHECKING

from mori.core.log import set_log_level as _set_level

from ._client import UMBPClient
from ._config import (
    UMBPConfig,
    UMBPCopyPipelineConfig,
    UMBPDistributedConfig,
    UMBPDramConfig,
    UMBPDurabilityConfig,
    UMBPEvictionConfig,
    UMBPHbmConfig,
    UMBPIoConfig,
    UMBPIoEngineConfig,
    UMBPMasterClientConfig,
    UMBPSsdConfig,
    UMBPStandaloneProcessConfig,
)
from ._enums import (
    CacheRemoteAdmission,
    UMBPDeploymentMode,
    UMBPDurabilityMode,
    UMBPHostBufferBacking,
    UMBPIoBackend,
    UMBPMedium,
    UMBPRole,
    UMBPSsdLayoutMode,
    UMBPTierType,
)
from ._events import KvEvent, KvEventType
from ._external import UMBPExternalKvHitCountEntry, UMBPExternalKvMatch
from ._hostmem import UMBPHostBufferHandle, UMBPHostMemAllocator

if _TYPE_CHECKING:
    from ._master_client import (
        BlockLocation as BlockLocation,
    )
    from ._master_client import (
        EventBundle as EventBundle,
    )
    from ._master_client import (
        HeartbeatReply as HeartbeatReply,
    )
    from ._master_client import (
        MasterClient as MasterClient,
    )
    from ._master_client import (
        MasterError as MasterError,
    )
    from ._master_client import (
        MasterUnavailableError as MasterUnavailableError,
    )
    from ._master_client import (
        NodeStatus as NodeStatus,
    )
    from ._master_client import (
        PutRoute as PutRoute,
    )
    from ._master_client import (
        RoutePutOutcome as RoutePutOutcome,
    )
    from ._master_client import (
        UMBPMasterClient as UMBPMasterClient,
    )

# The master's client speaks gRPC (the grpc extra): loaded on first use, so that the one-node
# pool imports without grpcio.
_MASTER_CLIENT_NAMES = frozenset(
    {
        "BlockLocation",
        "EventBundle",
        "HeartbeatReply",
        "MasterClient",
        "MasterError",
        "MasterUnavailableError",
        "NodeStatus",
        "PutRoute",
        "RoutePutOutcome",
        "UMBPMasterClient",
    }
)


def __getattr__(name: str) -> object:
    if name in _MASTER_CLIENT_NAMES:
        from . import _master_client

        return getattr(_master_client, name)
    raise AttributeError(f"module 'mori.umbp' has no attribute {name!r}")


__version__ = _metadata.version("mori-umbp")


def set_log_level(level: str | int) -> None:
    """Sets mori-umbp's log level (``trace``, ``debug``, ``info``, ``warning``, ``error``, ``critical``)."""
    _set_level(level, module="umbp")


__all__ = [
    "CacheRemoteAdmission",
    "KvEvent",
    "KvEventType",
    "UMBPClient",
    "UMBPConfig",
    "UMBPCopyPipelineConfig",
    "UMBPDeploymentMode",
    "UMBPDistributedConfig",
    "UMBPDramConfig",
    "UMBPDurabilityConfig",
    "UMBPDurabilityMode",
    "UMBPEvictionConfig",
    "UMBPExternalKvHitCountEntry",
    "UMBPExternalKvMatch",
    "UMBPHbmConfig",
    "UMBPHostBufferBacking",
    "UMBPHostBufferHandle",
    "UMBPHostMemAllocator",
    "UMBPIoBackend",
    "UMBPIoConfig",
    "UMBPIoEngineConfig",
    "UMBPMasterClientConfig",
    "UMBPMedium",
    "UMBPRole",
    "UMBPSsdConfig",
    "UMBPSsdLayoutMode",
    "UMBPStandaloneProcessConfig",
    "UMBPTierType",
    "__version__",
    "set_log_level",
]
