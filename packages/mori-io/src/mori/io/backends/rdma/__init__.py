"""The RDMA transport on UCX: :class:`RdmaBackend` (``backend``), and its pieces (``_worker``: one
UCX worker and its progress thread; ``_ucx``: the ctypes bindings of libucp)."""

from .backend import RdmaBackend, ucx_net_devices

__all__ = ["RdmaBackend", "ucx_net_devices"]
