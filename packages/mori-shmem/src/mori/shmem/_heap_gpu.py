"""The GPU heap: CUDA VMM memory per PE, exported as POSIX file descriptors and mapped by every PE.

Each PE reserves virtual addresses for its own heap and for every peer's
(:class:`mori.core.memory.cuda_vmm.VmmReservation`), then backs them in chunks: ``static`` mode maps the whole heap at init (one chunk), ``vmm`` mode maps
``MORI_SHMEM_VMM_CHUNK_SIZE`` chunks as the allocator's high-water mark grows. Growing is
collective: every PE creates its next chunk, the chunks' descriptors are exchanged through
:class:`mori.core.memory.FdExchange`, and every PE maps every peer's chunk at the same offset of
that peer's reservation, so ``peer_bases`` never change and device state stays valid.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from mori.core import cuda as cu
from mori.core import gpu
from mori.core.codes import Cmp
from mori.core.memory import FdExchange, cuda_vmm

from ._cuda import Context
from ._heap import Heap
from ._reach import Reach

__all__ = ["GpuHeap"]

#: Seconds a host ``wait_until`` on the GPU heap reads the word back to back before it pauses.
WAIT_SPIN_S = 1e-3
#: With the remote transport's store log: seconds between the first two reads of the word while
#: waiting on the log (doubling up to 1 ms): the reads catch writes that do not go through it.
STORE_WAIT_PAUSE_S = 10e-6
_NOT_READY = 600  # CUDA_ERROR_NOT_READY


def _copied(stream: Any) -> bool:
    """Whether the work queued on ``stream`` has ended; raises :class:`mori.core.cuda.CudaError`
    when it failed."""
    returned = cu.driver().cuStreamQuery(stream)
    if int(returned[0]) == _NOT_READY:
        return False
    cu.check(returned, "cuStreamQuery")
    return True


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


class GpuHeap(Heap):
    """CUDA VMM heap; ``mode`` is ``static`` or ``vmm`` (grown in ``chunk_size`` steps)."""

    kind = "gpu"
    ops: Any = None  # HostOps (helper kernels), attached once the device state exists

    def __init__(
        self, bootstrap: Any, ctx: Context, size: int, mode: str, chunk_size: int, reach: Reach, initial: int
    ) -> None:
        self.ctx = ctx
        self.mode = mode
        self.p2p_disabled = reach.p2p_disabled
        self._rank, self._world = bootstrap.rank, bootstrap.world
        # Collective on every PE alike (p2p_disabled is agreed); only this host's PEs send fds.
        self._fdx = FdExchange(bootstrap) if bootstrap.world > 1 and not reach.p2p_disabled else None
        granule = cuda_vmm.granularity(ctx.device, recommended=True)
        ctx.make_current()  # granularity() made the device's primary context current; the PE may use another
        self.chunk = _round_up(size if mode == "static" else chunk_size, granule)
        self.size = _round_up(size, self.chunk)
        self.mapped = 0
        self._reservations: list[cuda_vmm.VmmReservation | None] = [None] * self._world
        # wait_until's copies: a non-blocking stream, so that a kernel still running on the legacy
        # default stream (say, the one that will write the word) does not hold the poll back.
        self._poll_streams = gpu.StreamPool(ctx.device, 1, blocking=False)
        # ... into pinned memory: a copy into pageable memory is synchronous, through the driver's
        # own bounce buffer, and several times slower.
        self._poll_word = 0
        try:
            self._poll_word = int(cu.call("cuMemHostAlloc", 8, 0))
            for pe in reach.mapped:
                self._reservations[pe] = cuda_vmm.VmmReservation(self.size, ctx.device, granule)
            own = self._reservations[self._rank]
            assert own is not None
            self.base = own.base
            self.peer_bases = [r.base if r is not None else 0 for r in self._reservations]
            self.ensure_mapped(self.size if mode == "static" else initial)
        except BaseException:
            self.close()
            raise

    def ensure_mapped(self, end: int) -> None:
        """Maps chunks on every PE until ``[0, end)`` is backed (collective: all PEs call it alike)."""
        if end <= self.mapped:
            return
        if end > self.size:
            raise ValueError(f"offset {end:#x} is past the heap ({self.size} bytes)")
        self.ctx.make_current()
        new_offsets = list(range(self.mapped, _round_up(end, self.chunk), self.chunk))
        own = self._reservations[self._rank]
        assert own is not None
        fds = []
        try:
            for offset in new_offsets:
                own.create_chunk(offset, self.chunk)
                # cuMemCreate memory is not zeroed (barrier slots and signals must start at 0).
                cu.call("cuMemsetD8", self.base + offset, 0, self.chunk)
                if self._fdx is not None:
                    fds.append(own.export_chunk(offset))
            # Zeroed before the exchange: no peer can write into a chunk before its owner cleared it.
            self.ctx.synchronize()
            if self._fdx is not None:
                self._map_peers(new_offsets, self._fdx.allgather_fds(fds))
        finally:
            for fd in fds:
                os.close(fd)
        self.mapped = new_offsets[-1] + self.chunk
        if self.on_grow is not None:
            self.on_grow(self.mapped)

    def _map_peers(self, offsets: list[int], peer_fds: list[list[int]]) -> None:
        try:
            for pe, fds in enumerate(peer_fds):
                reservation = self._reservations[pe]
                if pe == self._rank or reservation is None:
                    continue
                if len(fds) != len(offsets):
                    raise RuntimeError(
                        f"PE {pe} sent {len(fds)} heap chunks, expected {len(offsets)}: "
                        "shmem_malloc/shmem_free sequences differ between PEs"
                    )
                for offset, fd in zip(offsets, fds):
                    reservation.import_chunk(offset, self.chunk, fd)
        finally:
            for fds in peer_fds:
                for fd in fds:
                    os.close(fd)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """``cuMemcpy`` on the legacy default stream (ordered after the caller's default-stream work)."""
        self.ctx.make_current()
        cu.call("cuMemcpyAsync", dst, src, nbytes, 0)
        cu.call("cuStreamSynchronize", 0)

    def atomic(self, op: str, pe: int, offset: int, value: int, compare: int, width: int) -> int:
        """Runs a one-thread kernel that applies the device API's atomic to PE ``pe``."""
        if self.ops is None:
            raise RuntimeError("GPU heap atomics need the helper kernels (HostOps) loaded first")
        return int(self.ops.atomic(op, self.base + offset, pe, value, compare, width))

    def wait_until(self, offset: int, cmp: Cmp, value: int, timeout: float, width: int, stores: Any = None) -> int:
        """Polls the word with small device-to-host copies on a non-blocking stream, through
        mori-core's completion wait: back to back for the first :data:`WAIT_SPIN_S` (a peer's
        signal is usually microseconds away, and a sleep lasts ~50 us at least), then with pauses
        from 20 us doubling up to 1 ms.

        With ``stores`` (the remote transport's engine, which writes remote PEs' signals and
        atomics into this heap), it waits on the engine's log of those writes between the copies
        instead: a remote signal is seen the moment the engine's write is visible, with no copy;
        the copies, from :data:`STORE_WAIT_PAUSE_S` apart doubling up to 1 ms, catch the writes
        of everyone else (this device's kernels, peers over P2P)."""
        nbytes = width // 8
        word = (ctypes.c_uint32 if width == 32 else ctypes.c_uint64).from_address(self._poll_word)
        self.ctx.make_current()
        stream = self._poll_streams.take()[0]
        seen = [0]

        deadline = time.monotonic() + timeout

        def holds() -> bool:
            cu.call("cuMemcpyDtoHAsync", self._poll_word, self.base + offset, nbytes, stream)
            while not _copied(stream):  # a few microseconds: no sleep is that short
                if time.monotonic() >= deadline:
                    return False
            seen[0] = word.value
            return cmp.holds(seen[0], value)

        if stores is not None:
            if self._wait_on_stores(stores, holds, seen, self.base + offset, cmp, value, width, deadline):
                return seen[0]
        elif cu.poll(holds, timeout, spin=WAIT_SPIN_S, pause=20e-6, max_pause=1e-3, yield_while_spinning=True):
            return seen[0]
        # Worded like mori.core.atomics.wait_until's, so both heaps report alike.
        raise TimeoutError(
            f"wait_until timed out after {timeout:.3f} s: the {width}-bit value at "
            f"{self.base + offset:#x} never became {cmp.name.lower()} {value}; last seen {seen[0]}"
        )

    @staticmethod
    def _wait_on_stores(
        stores: Any, holds: Any, seen: list[int], addr: int, cmp: Cmp, value: int, width: int, deadline: float
    ) -> bool:
        """wait_until's wait on a store log: a read of the word (``holds``), then the log's writes
        into it until a pause passes, in turn; True once one satisfied the condition (its value
        in ``seen``), False at the deadline."""
        since = stores.store_mark()  # before the read: a write that the read misses comes after it
        pause = STORE_WAIT_PAUSE_S
        while True:
            if holds():
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            end = min(deadline, now + pause)
            while (left := end - time.monotonic()) > 0:
                written, since, _lost = stores.next_store(addr, width, since, left)
                if written is None:
                    break  # nothing within the pause, or writes left the log unseen: read the word
                seen[0] = written
                if cmp.holds(written, value):
                    return True
            pause = min(2 * pause, 1e-3)

    def synchronize(self) -> None:
        """Waits for the device (every copy and kernel mori or the caller issued)."""
        self.ctx.synchronize()

    def close(self) -> None:
        """Unmaps every chunk, releases the handles and frees the reservations (own last)."""
        self.ctx.make_current()
        if self._fdx is not None:
            self._fdx.close()
        self._poll_streams.close()
        if self._poll_word:
            cu.call("cuMemFreeHost", self._poll_word)
            self._poll_word = 0
        order = [pe for pe in range(self._world) if pe != self._rank] + [self._rank]
        for pe in order:
            reservation = self._reservations[pe]
            if reservation is not None:
                reservation.free()
                self._reservations[pe] = None
