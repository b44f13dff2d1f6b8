"""The NVLink transport (MORI's XGMI): :class:`NvlinkBackend` (``backend``), its plan over a batch
(``plan``: kernel rows and copy-engine streams), and its pieces (``_peer_memory``: GPU memory
shared between processes of one host; ``_queues``: per-device streams, events and the completion
of a transfer; ``_kernels``: the gather kernel and its pinned tables)."""

from .backend import NvlinkBackend

__all__ = ["NvlinkBackend"]
