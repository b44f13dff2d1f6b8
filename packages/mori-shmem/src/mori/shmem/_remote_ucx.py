"""The remote transport on mori-core's UCX engine (:mod:`mori.core.ucx`).

Each PE runs one engine and registers its heap with it as memory id :data:`HEAP_ID`. At init the
PEs hand each other, over the bootstrap, their workers' addresses and a ticket per remote PE
(``admit``), and connect to every PE they reach remotely. Then:

- puts and gets are engine transfers between the caller's buffer and the peer's heap, on the
  engine's checked path (the target checks every block against its registrations). A buffer
  inside the local heap goes as is; a small one elsewhere is staged through mori's part of the
  heap (:data:`STAGING_OFFSET`, one call at a time); a larger one is registered for the call and
  released after (which waits for UCX to let go of it). Large transfers go as 1 MiB blocks of
  one batch, which the engine pipelines.
- atomics are the engine's remote atomics (:mod:`mori.core.ucx_atomic`), checked the same way
  and applied with sequentially consistent atomics, so they mix with the target's own.
- a signal put of up to 16 KiB is one message (the engine's signal put: the target writes the
  bytes, then applies the signal's atomic); a larger one is the put, complete (the target has
  written the bytes when it answers), then the signal's atomic. Either way a PE that sees the
  signal sees the data.

Every operation is complete when it returns, so quiet and fence have nothing left to wait for.
A peer that died or hangs fails the operation within ``MORI_SHMEM_TIMEOUT`` with a
:class:`ShmemError` naming it. Only the CPU heap is served so far.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import threading
from typing import Any

from ._errors import ShmemError
from ._heap import INTERNAL_BYTES, STAGING_OFFSET, Heap
from ._reach import Reach
from ._remote import RemoteTransport

__all__ = ["HEAP_ID", "UcxTransport", "why_unavailable"]

#: The memory id of every PE's heap in its engine.
HEAP_ID = 1
_FIRST_BUFFER_ID = 1 << 32  # ids of buffers registered for one call
_STAGING_BYTES = INTERNAL_BYTES - STAGING_OFFSET
_BLOCK = 1 << 20  # a large transfer's blocks


def why_unavailable(heap_kind: str) -> str:
    """Why this process cannot run the UCX transport for a ``heap_kind`` heap ("" when it can)."""
    if heap_kind != "cpu":
        return "the remote transport serves the CPU heap only so far (MORI_SHMEM_BACKEND=cpu)"
    try:
        from mori.core import ucx

        ucx.load_once()
    except Exception as exc:  # no mori.core.ucx, or no UCX to load: say which
        return f"mori-core's UCX engine cannot start: {type(exc).__name__}: {exc}"
    return ""


def _key(pe: int) -> str:
    return f"PE {pe}"


def _pack_contact(addresses: list[bytes], ticket: int) -> bytes:
    """A PE's worker addresses and the ticket it issued to the receiving PE."""
    return struct.pack("<QI", ticket, len(addresses)) + b"".join(struct.pack("<I", len(a)) + a for a in addresses)


def _unpack_contact(data: bytes) -> tuple[list[bytes], int]:
    ticket, count = struct.unpack_from("<QI", data)
    pos, addresses = 12, []
    for _ in range(count):
        (length,) = struct.unpack_from("<I", data, pos)
        addresses.append(data[pos + 4:pos + 4 + length])
        pos += 4 + length
    return addresses, ticket


class UcxTransport(RemoteTransport):
    """Host RMA to the PEs of ``reach.remote`` through one UCX engine (collective construction)."""

    def __init__(self, bootstrap: Any, heap: Heap, reach: Reach, timeout: float) -> None:
        from mori.core import ucx

        self.reach, self.heap, self.timeout = reach, heap, timeout
        self._ids = itertools.count(_FIRST_BUFFER_ID)
        self._staging = threading.Lock()
        self._engine = ucx.make_engine(f"mori-shmem-pe{reach.rank}", timeout=timeout,
                                       timeout_setting="MORI_SHMEM_TIMEOUT")
        self._peers: dict[int, Any] = {}
        try:
            self._engine.register_memory(HEAP_ID, heap.base, heap.size)
            tickets = {pe: self._engine.admit(_key(pe)) for pe in reach.remote}
            addresses = list(self._engine.addresses)
            sent = [_pack_contact(addresses, tickets[pe]) if pe in tickets else b"" for pe in range(reach.world)]
            got = bootstrap.alltoall(sent)
            for pe in reach.remote:
                their_addresses, ticket = _unpack_contact(got[pe])
                self._peers[pe] = self._engine.connect(_key(pe), their_addresses, ticket)
        except BaseException:
            self.close()
            raise

    # -- data movement -------------------------------------------------------------------------
    def _run(self, op: int, what: str, pe: int, offset: int, mem_id: int, local_off: int, nbytes: int) -> None:
        """One transfer between local memory ``mem_id`` and PE ``pe``'s heap, waited for."""
        starts = list(range(0, nbytes, _BLOCK))
        sizes = [min(_BLOCK, nbytes - s) for s in starts]
        done = self._peers[pe].submit(op, mem_id, [local_off + s for s in starts], HEAP_ID,
                                      [offset + s for s in starts], sizes)
        # The engine fails a transfer at its own deadline (MORI_SHMEM_TIMEOUT); the margin lets
        # its message, which names what was missing, arrive first.
        if not done.wait(self.timeout + 5.0):
            raise ShmemError(f"{what} of {nbytes} bytes to PE {pe}: no answer within {self.timeout:g} s "
                             "(MORI_SHMEM_TIMEOUT)")
        if done.code() != 0:
            raise ShmemError(f"{what} of {nbytes} bytes to PE {pe} failed: {done.message()}")

    def _transfer(self, op: int, what: str, pe: int, offset: int, addr: int, nbytes: int) -> None:
        from mori.core.ucx import WRITE

        heap = self.heap
        if heap.base <= addr and addr + nbytes <= heap.base + heap.size:
            self._run(op, what, pe, offset, HEAP_ID, addr - heap.base, nbytes)
        elif nbytes <= _STAGING_BYTES:
            stage = heap.base + STAGING_OFFSET
            with self._staging:
                if op == WRITE:
                    ctypes.memmove(stage, addr, nbytes)
                self._run(op, what, pe, offset, HEAP_ID, STAGING_OFFSET, nbytes)
                if op != WRITE:
                    ctypes.memmove(addr, stage, nbytes)
        else:
            mem_id = next(self._ids)
            self._engine.register_memory(mem_id, addr, nbytes)
            try:
                self._run(op, what, pe, offset, mem_id, 0, nbytes)
            finally:
                self._engine.deregister_memory(mem_id)

    def put(self, pe: int, offset: int, src: int, nbytes: int) -> None:
        """An engine write of ``nbytes`` from ``src`` into PE ``pe``'s heap."""
        from mori.core.ucx import WRITE

        self._transfer(WRITE, "put", pe, offset, src, nbytes)

    def get(self, pe: int, offset: int, dst: int, nbytes: int) -> None:
        """An engine read of ``nbytes`` of PE ``pe``'s heap into ``dst``."""
        from mori.core.ucx import READ

        self._transfer(READ, "get", pe, offset, dst, nbytes)

    def put_signal(self, pe: int, offset: int, src: int, nbytes: int, sig_offset: int, signal: int,
                   add: bool) -> None:
        """Up to the engine's signal-put size, one message (the target writes the bytes, then
        applies the signal's atomic); beyond it, the put, complete, then the signal's atomic."""
        from mori.core.ucx_atomic import MAX_SIGNAL_PUT_BYTES, signal_put

        op = "fetch_add" if add else "store"
        if nbytes > MAX_SIGNAL_PUT_BYTES:
            self.put(pe, offset, src, nbytes)
            self.atomic(pe, op, sig_offset, signal, 0, 64)
            return
        try:
            signal_put(self._engine, self._peers[pe], HEAP_ID, offset, src, nbytes, HEAP_ID, sig_offset, op, signal,
                       self.timeout)
        except (RuntimeError, ValueError) as exc:
            raise ShmemError(f"signal put of {nbytes} bytes to PE {pe} failed: {exc}") from None

    def atomic(self, pe: int, op: str, offset: int, value: int, compare: int, width: int) -> int:
        """The engine's remote atomic on PE ``pe``'s heap."""
        from mori.core.ucx_atomic import atomic

        try:
            return atomic(self._engine, self._peers[pe], op, HEAP_ID, offset, value, compare, width, self.timeout)
        except (RuntimeError, ValueError) as exc:
            raise ShmemError(f"atomic {op} on PE {pe} failed: {exc}") from None

    def quiet(self) -> None:
        """Nothing is outstanding: every operation completed before it returned."""

    def fence(self) -> None:
        """Nothing is outstanding: every operation completed before it returned."""

    def close(self) -> None:
        """Closes the endpoints and the engine (after finalize's barrier: no peer is mid-access)."""
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        self._engine.close()
