"""MORI's ``IOEngineSession``: a pre-resolved pair of regions of an :class:`~mori.io.IOEngine`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from ._router import Router
from ._transfers import Transfers
from .backends import Backend, TransferOp
from .types import MemoryDesc, TransferStatus

__all__ = ["IOEngineSession"]


class IOEngineSession:
    """A pre-resolved pair of regions: transfers skip routing and registration lookups."""

    def __init__(
        self,
        allocate_uid: Callable[[], int],
        router: Router,
        transfers: Transfers,
        local: MemoryDesc,
        remote: MemoryDesc,
        backend: Backend,
    ) -> None:
        # The owning engine's parts: its transfer ids, its routing between backends, its transfers.
        self._allocate_uid, self._router, self._transfers = allocate_uid, router, transfers
        self._local, self._remote, self._backend = local, remote, backend

    def allocate_transfer_uid(self) -> int:
        """A transfer id from the owning engine."""
        return self._allocate_uid()

    def read(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        """Reads ``size`` bytes from the remote region into the local one."""
        return self.batch_read([local_offset], [remote_offset], [size], transfer_uid)

    def write(self, local_offset: int, remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        """Writes ``size`` bytes from the local region into the remote one."""
        return self.batch_write([local_offset], [remote_offset], [size], transfer_uid)

    def _backend_now(self) -> Backend:
        if self._backend.healthy(self._remote.engine_key):
            return self._backend
        return self._router.choose(self._local, self._remote) or self._backend

    def batch_read(
        self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int], transfer_uid: int
    ) -> TransferStatus:
        """Reads many blocks as one transfer."""
        return self._move(TransferOp.READ, local_offsets, remote_offsets, sizes, transfer_uid)

    def batch_write(
        self, local_offsets: Sequence[int], remote_offsets: Sequence[int], sizes: Sequence[int], transfer_uid: int
    ) -> TransferStatus:
        """Writes many blocks as one transfer."""
        return self._move(TransferOp.WRITE, local_offsets, remote_offsets, sizes, transfer_uid)

    def _move(
        self,
        op: TransferOp,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        sizes: Sequence[int],
        transfer_uid: int,
    ) -> TransferStatus:
        # A block through the lane the last transfer on this pair left (Transfers.single), else
        # the batch submitted to the backend that is healthy now.
        local, remote, transfers = self._local, self._remote, self._transfers
        return transfers.single(
            op, local, local_offsets, remote, remote_offsets, sizes, transfer_uid, self._backend
        ) or transfers.submit(
            op, local, local_offsets, remote, remote_offsets, sizes, transfer_uid, self._backend_now()
        )

    def alive(self) -> bool:
        """Whether both regions and the remote engine are still registered and a backend is healthy."""
        with contextlib.suppress(Exception):
            return self._transfers.reject(self._local, self._remote) is None and self._backend_now().healthy(
                self._remote.engine_key
            )
        return False
