"""One node's store: the DRAM tier (slots in one host buffer), the SSD tier behind it, the index
of keys, LRU eviction by watermark, and the seam a peer service and a heartbeat use.

The seam (see docs/umbp.md, "How it works"): :meth:`LocalStore.allocate` a slot for a key in the
DRAM buffer, write the bytes there (a memcpy here, an RDMA/TCP write from a peer there), then
:meth:`~LocalStore.commit` it or :meth:`~LocalStore.abort` it; :meth:`~LocalStore.resolve` a
key to its slot with a read lease (an SSD hit is staged back into DRAM first);
:meth:`~LocalStore.evict` a key; :attr:`~LocalStore.buffer_address` and
:attr:`~LocalStore.buffer_size` for registering the buffer with mori-io; and
:meth:`~LocalStore.subscribe` to the :class:`~._events.KvEvent` of every change.

Memory safety rests on pins: a slot or record is freed only when no one uses it. Every user of an
entry's memory (the writer of a slot not yet committed, a reader copying out, a move to SSD
reading the slot, a staging read into it) holds a pin; dropping a pinned entry or tier copy marks
it, and the last unpin frees it.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from mori.core.log import get_logger

from ._config import UMBPConfig
from ._enums import UMBPHostBufferBacking, UMBPTierType
from ._events import KvEvent, KvEventType
from ._extents import ExtentAllocator, aligned
from ._hostmem import allocate_host_buffer, free_host_buffer
from ._ssd import SsdTier
from ._tiering import IO_TIMEOUT_S, Tiers, _Entry

_log = get_logger("umbp")


class StoreFullError(RuntimeError):
    """No room for a value: DRAM is full of pinned or moving pages and nothing frees it in time."""


class StoreClosedError(RuntimeError):
    """The store (its client) is closed."""


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """A value's place in the DRAM buffer: ``offset`` into it, ``address`` in this process;
    ``serial`` names this value of the key (a key stored again after an eviction has another);
    ``lease_id`` names the read lease :meth:`LocalStore.resolve` took on it (0: none)."""

    key: str
    offset: int
    size: int
    address: int
    serial: int
    _entry: _Entry = dataclasses.field(repr=False, compare=False)
    lease_id: int = 0


class LocalStore(Tiers):
    """The DRAM and SSD tiers of one node (see the module's docstring)."""

    def __init__(self, cfg: UMBPConfig, reserve_bytes: int = 0) -> None:
        dram, evict = cfg.dram, cfg.eviction
        self._capacity = aligned(dram.capacity_bytes)
        #: Bytes of the buffer after the DRAM tier, set aside for a peer service's reads of SSD
        #: pages in C++ (``_grpc_native.PeerSsdReads``; see :meth:`attach_ssd_reads`).
        self.reserve_bytes = aligned(reserve_bytes)
        self._high = dram.high_watermark * self._capacity
        self._low = dram.low_watermark * self._capacity
        self._window = max(1, evict.candidate_window)
        self._promote = evict.auto_promote_on_read
        self._wait_for_moves = not cfg.copy_pipeline.async_enabled
        self._batch_max = cfg.copy_pipeline.batch_max_ops
        if dram.use_shared_memory:
            backing = (
                UMBPHostBufferBacking.AnonymousShmHugetlb if dram.use_hugepages else UMBPHostBufferBacking.AnonymousShm
            )
        else:
            backing = UMBPHostBufferBacking.AnonymousHugetlb if dram.use_hugepages else UMBPHostBufferBacking.Anonymous
        self._handle = allocate_host_buffer(
            self._capacity + self.reserve_bytes,
            backing,
            dram.hugepage_size,
            dram.prefault,
            name=dram.shm_name.lstrip("/") or "umbp_dram",
        )
        if not self._handle:
            raise MemoryError(f"no host memory for the DRAM tier ({self._capacity} bytes)")
        self._view = self._handle.view()
        self._dram = ExtentAllocator(self._capacity)
        try:
            self._ssd = SsdTier(cfg.ssd, cfg.copy_pipeline) if cfg.ssd.enabled else None
        except BaseException:
            self._view.release()
            free_host_buffer(self._handle)
            raise
        self._ssd_high = cfg.ssd.high_watermark
        self._ssd_low = cfg.ssd.low_watermark
        self._lock = threading.Condition()
        self._index: dict[str, _Entry] = {}
        self._dram_lru: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._ssd_lru: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._listeners: list[Callable[[KvEvent], None]] = []
        self._serial = 0  # of the last entry made
        self._moves = 0  # batches moving to SSD
        self._moving_bytes = 0  # DRAM those batches will free
        self._pinned = 0  # pins held on all entries, dropped ones included
        self._held = {}
        self._lease_ids = itertools.count(1)
        self._closed = False

    # -- the seam -----------------------------------------------------------------------------

    @property
    def buffer_address(self) -> int:
        """The DRAM buffer's address in this process (register it with mori-io)."""
        return self._handle.ptr

    @property
    def buffer_size(self) -> int:
        """The DRAM tier's size in bytes: its slots are at offsets below it."""
        return self._capacity

    @property
    def registered_size(self) -> int:
        """The whole buffer's size in bytes (register this much with mori-io): the DRAM tier,
        then the reserve for peers' SSD reads."""
        return self._capacity + self.reserve_bytes

    @property
    def ssd_checksums(self) -> bool:
        """Whether SSD records carry a checksum to check on every read."""
        return self._ssd is not None and self._ssd.verify_crc

    def attach_ssd_reads(self, reads: Any) -> None:
        """Keeps ``reads`` (a ``_grpc_native.PeerSsdReads`` over this buffer's reserve) told of
        every key on SSD only, from now until it is detached (``None``), so that a peer
        service answers its peers' resolves of those keys in C++; its lease ids are released
        by :meth:`release` too. A key it holds leaves it before its SSD record can be freed or
        its DRAM copy comes back, so what it reads is the key's value or is thrown away."""
        with self._lock:
            old, self._ssd_reads = self._ssd_reads, None
            if old is not None:
                old.clear()
            if reads is None or self._ssd is None:
                return
            self._ssd_reads = reads
            for entry in self._index.values():
                self._offer_ssd_read(entry)

    def subscribe(self, listener: Callable[[KvEvent], None]) -> None:
        """Calls ``listener(event)`` for every change from now on, with the store's lock held,
        in order: it must not block nor call the store (append to an outbox)."""
        with self._lock:
            self._listeners.append(listener)

    def allocate(
        self, key: str, size: int, depth: int = -1, timeout: float = IO_TIMEOUT_S, make_room: bool = True
    ) -> Slot | None:
        """A DRAM slot of ``size`` bytes for ``key``, moving older pages to SSD (or dropping
        them, without an SSD tier) to make room; None when ``key`` is stored or being stored
        already. The slot is invisible until :meth:`commit`. Raises :class:`StoreFullError`
        when no room comes within ``timeout`` seconds; without ``make_room``, at once when DRAM
        has no free slot of that size now or the slot would take it over its low watermark (so
        nothing is evicted for it, now or at commit)."""
        deadline = time.monotonic() + timeout
        need = aligned(size)
        with self._lock:
            while True:
                self._check_open()
                if key in self._index:
                    return None
                self._reclaim()
                if not make_room and self._dram.used + need > self._low:
                    raise StoreFullError(f"{size} bytes would take DRAM over its low watermark")
                offset = self._dram.allocate(size)
                if offset is not None:
                    break
                if not make_room:
                    raise StoreFullError(f"no free slot of {size} bytes in DRAM")
                made = self._make_room(need + max(0.0, self._dram.used - self._low) - self._moving_bytes)
                if not made and not self._moves and not self._pinned and not self._leased():
                    raise StoreFullError(f"no room in DRAM for {size} bytes")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreFullError(f"no room in DRAM for {size} bytes within {timeout} s")
                self._lock.wait(min(remaining, 0.05 if self._held else 1.0))  # held slots free unannounced
            self._serial += 1
            entry = self._index[key] = _Entry(key, size, depth, offset, self._serial)
            self._pinned += 1
            return Slot(key, offset, size, self.buffer_address + offset, entry.serial, entry)

    def commit(self, slot: Slot) -> bool:
        """Makes a slot's value visible (an ADD on DRAM); False when the store was cleared or
        the key evicted meanwhile (the slot is then freed)."""
        entry = slot._entry
        with self._lock:
            if entry.committed:
                raise ValueError(f"slot of {slot.key!r} is committed already")
            entry.committed = True
            if entry.gone:
                self._unpin(entry)
                return False
            self._dram_lru[entry.key] = entry
            self._emit(KvEventType.ADD, entry, UMBPTierType.DRAM)
            self._unpin(entry)
            if self._dram.used - self._moving_bytes > self._high:
                self._make_room(self._dram.used - self._moving_bytes - self._low)
                if self._wait_for_moves:
                    self._wait_moves(time.monotonic() + IO_TIMEOUT_S)
        return True

    def abort(self, slot: Slot) -> None:
        """Gives back a slot that will not be committed."""
        entry = slot._entry
        with self._lock:
            if entry.committed:
                raise ValueError(f"slot of {slot.key!r} is committed already")
            entry.committed = True
            if not entry.gone:
                self._forget(entry)
            self._unpin(entry)

    def resolve(self, key: str, lease_s: float) -> Slot | None:
        """``key``'s DRAM slot under a new read lease of ``lease_s`` seconds (a peer reads it in
        that time): kept from eviction, and its memory not reused before the lease ends or is
        released, even if the key is dropped meanwhile. An SSD-only key is staged back into DRAM
        first. None when absent or when it cannot be staged."""
        return self.resolve_many([key], lease_s)[0]

    def resolve_many(self, keys: list[str], lease_s: float) -> list[Slot | None]:
        """:meth:`resolve` of each key (one lease a key, however often it is asked), with the
        SSD-only ones staged back into DRAM together (one read run on this thread, more at once
        on the SSD workers); a key that cannot be staged is None alone."""
        found: dict[str, _Entry] = {}
        with self._lock:
            self._check_open()
            for key in keys:
                entry = self._index.get(key)
                if key not in found and entry is not None and entry.committed and not entry.gone:
                    self._pin(entry)
                    found[key] = entry
            staging = [e for e in found.values() if e.dram is None]
        try:
            if staging:  # a page with no room in DRAM now is not read: the reader asks again
                self._stage(staging, promote=True, scratch=False, here=True)
        except BaseException:
            with self._lock:
                for entry in found.values():
                    self._unpin(entry)
            raise
        slots: list[Slot | None] = []
        leased: dict[str, Slot] = {}
        with self._lock:  # the leases are taken before the pins go, under one hold of the lock
            try:
                until = time.monotonic() + lease_s
                for key in keys:
                    slot = leased.get(key)
                    entry = found.get(key)
                    usable = entry is not None and entry.dram is not None and not entry.gone and not entry.drop_dram
                    if slot is None and usable:
                        assert entry is not None and entry.dram is not None
                        lease_id = self._lease(entry, until)
                        self._touch(entry)
                        address = self.buffer_address + entry.dram
                        slot = Slot(key, entry.dram, entry.size, address, entry.serial, entry, lease_id)
                        leased[key] = slot
                    slots.append(slot)
            finally:
                for entry in found.values():
                    self._unpin(entry)
        return slots

    def release(self, key: str, lease_id: int) -> bool:
        """Ends the read lease ``lease_id`` that :meth:`resolve` took on ``key``'s slot; whether
        it held to now (so a reader's bytes, read before this, are that value's): False when the
        lease had run out or is not known (ended already, or never taken)."""
        reads = self._ssd_reads
        if reads is not None and lease_id & reads.LEASE_BIT:
            return bool(reads.release(key, lease_id))
        with self._lock:
            until = self._end_lease(key, lease_id)
            return until is not None and until >= time.monotonic()

    def evict(self, key: str, force: bool = True) -> int:
        """Removes ``key`` from every tier (REMOVE events); the bytes freed (0 when absent, or,
        without ``force``, when it is being read, leased or moved: the master's advice)."""
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None or not entry.committed or (not force and self._busy(entry)):
                return 0
            self._forget(entry)
            return aligned(entry.size)

    def demote(self, key: str) -> int:
        """Frees ``key``'s place in its fastest tier (the master's eviction advice): a page in
        DRAM moves to SSD (or, without an SSD tier, leaves the store), one only on SSD leaves the
        store; the bytes that frees, 0 when absent or being read, leased or moved."""
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None or not entry.committed or entry.gone or self._busy(entry):
                return 0
            if entry.dram is None or entry.drop_dram or self._ssd is None:
                self._forget(entry)
            elif entry.ssd is not None:
                del self._dram_lru[entry.key]
                self._emit(KvEventType.REMOVE, entry, UMBPTierType.DRAM)
                self._drop_dram(entry)
            else:
                del self._dram_lru[entry.key]
                self._start_move([entry])
            return aligned(entry.size)

    def lookup(self, key: str) -> tuple[UMBPTierType, int] | None:
        """The fastest tier that holds ``key`` and its size, or None."""
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None or not entry.committed or entry.gone:
                return None
            tier = UMBPTierType.DRAM if entry.dram is not None and not entry.drop_dram else UMBPTierType.SSD
            return tier, entry.size

    # -- the client's operations --------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored (committed, in any tier)."""
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            return entry is not None and entry.committed and not entry.gone

    def contains_many(self, keys: list[str]) -> list[bool]:
        """:meth:`contains` for each key, under one acquisition of the lock."""
        with self._lock:
            self._check_open()
            index = self._index
            if index.keys().isdisjoint(keys):  # a node asking about keys it does not hold: no loop
                return [False] * len(keys)
            return [(e := index.get(k)) is not None and e.committed and not e.gone for k in keys]

    def write(self, key: str, src: int, size: int, depth: int = -1, make_room: bool = True) -> bool:
        """Copies ``size`` bytes at ``src`` in as ``key``: allocate, copy, commit. A key that is
        stored already is left as it is (True). Without ``make_room``, only into a slot free now."""
        return self.write_ranges(key, size, [(src, size, 0)], depth, make_room)

    def write_ranges(
        self, key: str, size: int, ranges: list[tuple[int, int, int]], depth: int = -1, make_room: bool = True
    ) -> bool:
        """:meth:`write` of a value of ``size`` bytes assembled from ranges ``(address, length,
        offset)`` that tile it; published whole or not at all."""
        try:
            slot = self.allocate(key, size, depth, make_room=make_room)
        except StoreFullError as exc:
            if make_room:
                _log.warning("put %r: %s", key, exc)
            return False
        if slot is None:
            return True
        try:
            for address, length, offset in ranges:
                ctypes.memmove(slot.address + offset, address, length)
        except BaseException:
            self.abort(slot)
            raise
        return self.commit(slot)

    def read(self, keys: list[str], dsts: list[int], sizes: list[int]) -> list[bool]:
        """Copies each stored ``keys[i]`` (of exactly ``sizes[i]`` bytes) to ``dsts[i]``; SSD hits
        are read on the SSD tier's workers, all at once."""
        plan: list[_Entry | None] = []
        with self._lock:
            self._check_open()
            for key, size in zip(keys, sizes):
                entry = self._index.get(key)
                if entry is None or not entry.committed or entry.gone or entry.size != size:
                    if entry is not None and entry.committed and entry.size != size:
                        _log.debug("get %r: stored %d bytes, asked for %d", key, entry.size, size)
                    plan.append(None)
                    continue
                self._pin(entry)
                self._touch(entry)
                plan.append(entry)
        staged = [e for e in plan if e is not None and e.dram is None]
        scratch = self._stage(staged, self._promote) if staged else {}
        results = []
        try:
            for entry, dst in zip(plan, dsts):
                if entry is None:
                    results.append(False)
                elif entry.dram is not None:
                    ctypes.memmove(dst, self.buffer_address + entry.dram, entry.size)
                    results.append(True)
                elif id(entry) in scratch:
                    ctypes.memmove(dst, scratch[id(entry)].ptr, entry.size)
                    results.append(True)
                else:
                    results.append(False)
        finally:
            for handle in scratch.values():
                free_host_buffer(handle)
            with self._lock:
                for entry in plan:
                    if entry is not None:
                        self._unpin(entry)
        return results

    def read_ranges(self, key: str, ranges: list[tuple[int, int, int]]) -> bool:
        """Copies byte ranges ``(dst, size, src_offset)`` of ``key`` out; False when absent or a
        range runs past its end."""
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None or not entry.committed or entry.gone:
                return False
            if any(off + size > entry.size for _, size, off in ranges):
                return False
        size = entry.size
        buffer = ctypes.create_string_buffer(size)
        if not self.read([key], [ctypes.addressof(buffer)], [size])[0]:
            return False
        base = ctypes.addressof(buffer)
        for dst, length, offset in ranges:
            ctypes.memmove(dst, base + offset, length)
        return True

    def clear(self) -> None:
        """Removes every key from every tier."""
        with self._lock:
            for entry in list(self._index.values()):
                if entry.committed:
                    self._forget(entry)
                else:
                    entry.gone = True
                    del self._index[entry.key]

    def flush(self, timeout: float = IO_TIMEOUT_S) -> bool:
        """Waits for pages moving to SSD; with the Relaxed durability mode also puts the SSD
        tier's writes on the device. False when that did not finish in ``timeout`` seconds."""
        with self._lock:
            if self._closed:
                return True
            if not self._wait_moves(time.monotonic() + timeout):
                return False
        if self._ssd is not None and not self._ssd.strict:
            self._ssd.submit(self._ssd.sync).result(timeout)
        return True

    def snapshot(self, reset: Callable[[], None]) -> list[KvEvent]:
        """An ADD for every tier of every stored key (a full sync's content), taken with the
        store's lock held, under which ``reset()`` runs too: events from then on are after it."""
        with self._lock:
            reset()
            events = []
            for entry in self._index.values():
                if not entry.committed or entry.gone:
                    continue
                if entry.key in self._dram_lru:
                    events.append(KvEvent(KvEventType.ADD, entry.key, UMBPTierType.DRAM, entry.size, entry.depth))
                if entry.key in self._ssd_lru:
                    events.append(KvEvent(KvEventType.ADD, entry.key, UMBPTierType.SSD, entry.size, entry.depth))
            return events

    def stats(self) -> dict[str, int]:
        """Keys and bytes per tier, and capacities (what a heartbeat reports)."""
        with self._lock:
            self._reclaim()
            committed = [e for e in self._index.values() if e.committed and not e.gone]
            return {
                "keys": len(committed),
                "dram_keys": sum(1 for e in committed if e.dram is not None and not e.drop_dram),
                "ssd_keys": sum(1 for e in committed if e.ssd is not None),
                "dram_used": self._dram.used,
                "dram_capacity": self._capacity,
                "ssd_used": self._ssd.used if self._ssd else 0,
                "ssd_capacity": self._ssd.capacity if self._ssd else 0,
            }

    def close(self, timeout: float = IO_TIMEOUT_S) -> None:
        """Drops every key, waits for the I/O in flight, removes the SSD files and unmaps the
        buffer (left mapped, with a warning, if a reader still holds a page)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.clear()
            deadline = time.monotonic() + timeout
            while self._moves or self._pinned:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(min(remaining, 0.5))
            busy = self._moves > 0 or self._pinned > 0
        if self._ssd is not None:
            self._ssd.close()
        if busy:
            _log.warning("closing with pages still in use: the DRAM buffer stays mapped")
            return
        self._view.release()
        free_host_buffer(self._handle)

    # -- inside -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the UMBP client is closed")
