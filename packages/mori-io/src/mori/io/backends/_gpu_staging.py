"""GPU memory for backends whose transport cannot reach it (TCP; RDMA over UCX transports without
GPUDirect): mori-core's one native staging (:mod:`mori.core.staging`) for the device that holds a
region, checked to be CUDA device memory first.

A process has one :class:`~mori.core.staging.Stager` per device with the engine's settings
(``MORI_IO_TIMEOUT`` bounds its waits; ``MORI_IO_TCP_STAGING_SIZE`` of pinned memory is kept
between transfers), shared by every backend and engine that asks: the copies of one device go
through one pool of pinned memory and one stream.
"""

from __future__ import annotations

from typing import Any

from mori.core import config as mori_config
from mori.core.staging import device_stager

from ..types import MemoryDesc
from .base import BackendContext

__all__ = ["stager_for"]


def stager_for(ctx: BackendContext, desc: MemoryDesc, backend: str) -> Any:
    """The staging for GPU region ``desc``: its device's Stager, once ``desc`` is checked to be CUDA
    device memory. Raises ``RuntimeError`` (no cuda-bindings or GPU: what the backend needs) or
    ``ValueError`` (not device memory), naming ``backend``."""
    try:
        stager = device_stager(
            desc.device_id,
            timeout=ctx.io_timeout(),
            timeout_setting="MORI_IO_TIMEOUT",
            cache_bytes=int(mori_config.get("MORI_IO_TCP_STAGING_SIZE")),
        )
    except (ImportError, RuntimeError, ValueError) as err:
        raise RuntimeError(
            f"{backend}: GPU memory (device {desc.device_id}) is staged through pinned host memory, "
            f"which needs cuda-bindings and a CUDA GPU: {err}"
        ) from None
    try:
        stager.check_device_memory(desc.data, desc.size)
    except ValueError as err:
        raise ValueError(f"{backend}: memory registered as GPU memory of device {desc.device_id}: {err}") from None
    return stager
