"""The RDMA backend: not available on our machines (no RDMA NIC); creating it fails clearly."""

from __future__ import annotations

import os
from typing import Any

from .base import Backend, BackendContext

__all__ = ["create_rdma_backend"]


def _rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def create_rdma_backend(ctx: BackendContext, config: Any) -> Backend:
    """Refuses: the RDMA data plane is a later issue, and our machines have no RDMA NIC."""
    devices = _rdma_devices()
    where = f"RDMA devices present ({', '.join(devices)})" if devices else "no RDMA device on this host"
    raise RuntimeError(
        f"BackendType.RDMA is not available: {where}, and mori-io has no RDMA data plane yet. "
        "Use BackendType.TCP (any host) or BackendType.XGMI/NVLINK (GPUs on one host)."
    )
