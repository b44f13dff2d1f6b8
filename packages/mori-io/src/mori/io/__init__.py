"""mori.io: the IOEngine, point-to-point transfers of registered memory (KV cache) between engines.

MORI's Python API: create an :class:`IOEngine`, create a backend (``BackendType.TCP`` on any host,
``BackendType.XGMI``/``NVLINK`` between GPUs of one host), register remote engines and memory,
then ``read``/``write``/``batch_read``/``batch_write`` or an :class:`IOEngineSession`; each call
returns a :class:`TransferStatus`.
"""

from mori.core.log import set_log_level

from .types import (
    BackendType,
    EngineDesc,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
    TransferStatus,
    XgmiBackendConfig,
)

__version__ = "0.1.0"

__all__ = [
    "BackendType",
    "EngineDesc",
    "IOEngineConfig",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TcpBackendConfig",
    "TransferStatus",
    "XgmiBackendConfig",
    "__version__",
    "set_log_level",
]
