"""The RDMA transport on mori-core's UCX engine: :class:`RdmaBackend` (``backend``)."""

from .backend import RdmaBackend, ucx_net_devices

__all__ = ["RdmaBackend", "ucx_net_devices"]
