"""mori.io: the IOEngine, point-to-point transfers of registered memory (KV cache) between engines.

MORI's Python API: create an :class:`IOEngine`, create a backend (``BackendType.TCP`` on any host,
``BackendType.XGMI``/``NVLINK`` between GPUs of one host, ``BackendType.RDMA`` on UCX), register
remote engines and memory, then ``read``/``write``/``batch_read``/``batch_write`` or an :class:`IOEngineSession`; each call
returns a :class:`TransferStatus`.
"""

from importlib import metadata as _metadata

from mori.core.log import set_log_level as _set_level

from .engine import IOEngine, IOEngineSession
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

__version__ = _metadata.version("mori-io")


def set_log_level(level: str | int) -> None:
    """Sets mori-io's log level (``trace``, ``debug``, ``info``, ``warning``, ``error``, ``critical``)."""
    _set_level(level, module="io")


__all__ = [
    "BackendType",
    "EngineDesc",
    "IOEngine",
    "IOEngineSession",
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
