"""mori-io backends: the :class:`Backend` interface, the completions its ``submit`` returns
(:class:`Completion`, :class:`Outcome`, :class:`Deferred`) and the factory table the engine uses.

A backend module registers its factory with :func:`register_backend_factory`; the engine's
``create_backend(type, config)`` looks it up here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..types import BackendType
from .base import (
    Backend,
    BackendContext,
    Completion,
    ControlHandler,
    Deferred,
    Lane,
    Outcome,
    TransferOp,
    TransferRequest,
)

__all__ = [
    "Backend",
    "BackendContext",
    "Completion",
    "ControlHandler",
    "Deferred",
    "Lane",
    "Outcome",
    "TransferOp",
    "TransferRequest",
    "BackendFactory",
    "register_backend_factory",
    "backend_factory",
]

BackendFactory = Callable[[BackendContext, Any], Backend]
_FACTORIES: dict[BackendType, Callable[[], BackendFactory]] = {}


def register_backend_factory(kind: BackendType, loader: Callable[[], BackendFactory]) -> None:
    """Registers how to build backends of ``kind``; ``loader`` imports lazily and returns the factory."""
    _FACTORIES[kind] = loader


def backend_factory(kind: BackendType) -> BackendFactory:
    """The factory for ``kind``; raises ``ValueError`` naming the kinds available."""
    try:
        return _FACTORIES[kind]()
    except KeyError:
        known = ", ".join(k.name for k in _FACTORIES)
        raise ValueError(f"no backend of type {kind!r}; available: {known}") from None


def _tcp() -> BackendFactory:
    from .tcp import TcpBackend

    return TcpBackend


def _rdma() -> BackendFactory:
    from .rdma import RdmaBackend

    return RdmaBackend


def _nvlink() -> BackendFactory:
    from .nvlink import NvlinkBackend

    return NvlinkBackend


register_backend_factory(BackendType.TCP, _tcp)
register_backend_factory(BackendType.RDMA, _rdma)
register_backend_factory(BackendType.XGMI, _nvlink)
