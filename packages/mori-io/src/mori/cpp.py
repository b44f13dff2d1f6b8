"""``mori.cpp``: the name of MORI's compiled module, for code that imports from it.

MORI's Python packages re-export their types from ``mori.cpp``, and its clients import some of
them from there directly (SGLang: ``from mori.cpp import TransferStatus``; MORI's tests too). In
mori those types are Python classes of :mod:`mori.io`; this module re-exports the same objects
under MORI's module name. It ships with mori-io, so an io-only install has it. MORI's raw
CamelCase bindings (``mori.cpp.IOEngine`` with ``CreateBackend``...) are not provided: use
:class:`mori.io.IOEngine`.
"""

from mori.io import (
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
    set_log_level,
)

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
    "set_log_level",
]
