"""The NVLink transport (MORI's XGMI): :class:`NvlinkBackend` (``backend``), its plan over a batch
(``plan``: kernel rows and copy-engine streams), and its pieces (``_peer_memory``: GPU memory
shared between processes of one host; ``_exports``: the regions this engine exports and who opened
them; ``_remote_regions``: the regions of other engines mapped here; ``_queues``: per-device
streams, events and the completion of a transfer; ``_kernels``: the gather kernel and its pinned
tables; ``_housekeeping``: transfers in flight and the inbound records owed)."""

from .backend import NvlinkBackend

__all__ = ["NvlinkBackend"]
