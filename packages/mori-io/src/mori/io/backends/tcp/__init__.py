"""The TCP transport: :class:`TcpBackend` (``backend``) over mori-core's native data plane, its plan
over a batch (``plan``: GPU memory's staging chunks), and its GPU staging (``_gpu``: CUDA copies
through pinned host buffers and the target's lend/commit protocol; ``_staging``: the buffer pool
and the target's leases; ``_staging_size``: the buffer sizing, without numpy)."""

from .backend import TcpBackend

__all__ = ["TcpBackend"]
