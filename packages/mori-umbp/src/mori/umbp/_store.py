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
import concurrent.futures
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable

from mori.core.log import get_logger

from ._config import UMBPConfig
from ._enums import UMBPHostBufferBacking, UMBPTierType
from ._events import KvEvent, KvEventType
from ._extents import ExtentAllocator, aligned
from ._hostmem import UMBPHostBufferHandle, allocate_host_buffer, free_host_buffer
from ._ssd import SsdRecord, SsdTier

_log = get_logger("umbp")
#: The longest a call waits for room in DRAM or for SSD I/O.
IO_TIMEOUT_S = 30.0


class StoreFullError(RuntimeError):
    """No room for a value: DRAM is full of pinned or moving pages and nothing frees it in time."""


class StoreClosedError(RuntimeError):
    """The store (its client) is closed."""


class _Entry:
    __slots__ = ("key", "size", "depth", "serial", "dram", "ssd", "pins", "lease_until", "committed",
                 "gone", "moving", "staging", "drop_dram")

    def __init__(self, key: str, size: int, depth: int, dram: int, serial: int) -> None:
        self.key, self.size, self.depth, self.serial = key, size, depth, serial
        self.dram: int | None = dram
        self.ssd: SsdRecord | None = None
        self.pins = 1  # the writer's, until commit or abort
        self.lease_until = 0.0
        self.committed = self.gone = self.moving = self.staging = False
        self.drop_dram = False


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """A value's place in the DRAM buffer: ``offset`` into it, ``address`` in this process;
    ``serial`` names this value of the key (a key stored again after an eviction has another)."""

    key: str
    offset: int
    size: int
    address: int
    serial: int
    _entry: _Entry = dataclasses.field(repr=False, compare=False)


class LocalStore:
    """The DRAM and SSD tiers of one node (see the module's docstring)."""

    def __init__(self, cfg: UMBPConfig) -> None:
        dram, evict = cfg.dram, cfg.eviction
        self._capacity = aligned(dram.capacity_bytes)
        self._high = dram.high_watermark * self._capacity
        self._low = dram.low_watermark * self._capacity
        self._window = max(1, evict.candidate_window)
        self._promote = evict.auto_promote_on_read
        self._wait_for_moves = not cfg.copy_pipeline.async_enabled
        self._batch_max = cfg.copy_pipeline.batch_max_ops
        if dram.use_shared_memory:
            backing = (UMBPHostBufferBacking.AnonymousShmHugetlb if dram.use_hugepages
                       else UMBPHostBufferBacking.AnonymousShm)
        else:
            backing = UMBPHostBufferBacking.AnonymousHugetlb if dram.use_hugepages else UMBPHostBufferBacking.Anonymous
        self._handle = allocate_host_buffer(self._capacity, backing, dram.hugepage_size, dram.prefault,
                                            name=dram.shm_name.lstrip("/") or "umbp_dram")
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
        self._closed = False

    # -- the seam -----------------------------------------------------------------------------

    @property
    def buffer_address(self) -> int:
        """The DRAM buffer's address in this process (register it with mori-io)."""
        return self._handle.ptr

    @property
    def buffer_size(self) -> int:
        """The DRAM buffer's size in bytes."""
        return self._capacity

    def subscribe(self, listener: Callable[[KvEvent], None]) -> None:
        """Calls ``listener(event)`` for every change from now on, with the store's lock held,
        in order: it must not block nor call the store (append to an outbox)."""
        with self._lock:
            self._listeners.append(listener)

    def allocate(self, key: str, size: int, depth: int = -1, timeout: float = IO_TIMEOUT_S) -> Slot | None:
        """A DRAM slot of ``size`` bytes for ``key``, moving older pages to SSD (or dropping
        them, without an SSD tier) to make room; None when ``key`` is stored or being stored
        already. The slot is invisible until :meth:`commit`. Raises :class:`StoreFullError`
        when no room comes within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        need = aligned(size)
        with self._lock:
            while True:
                self._check_open()
                if key in self._index:
                    return None
                offset = self._dram.allocate(size)
                if offset is not None:
                    break
                made = self._make_room(need + max(0.0, self._dram.used - self._low) - self._moving_bytes)
                if not made and not self._moves and not self._pinned and not self._leased():
                    raise StoreFullError(f"no room in DRAM for {size} bytes")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreFullError(f"no room in DRAM for {size} bytes within {timeout} s")
                self._lock.wait(min(remaining, 1.0))
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
        """``key``'s DRAM slot, kept from eviction for ``lease_s`` seconds (a peer reads it in
        that time); an SSD-only key is staged back into DRAM first. None when absent or when
        it cannot be staged."""
        with self._lock:
            self._check_open()
            entry = self._index.get(key)
            if entry is None or not entry.committed or entry.gone:
                return None
            staging = entry.dram is None
            self._pin(entry)
        try:
            if staging:
                for handle in self._stage([entry], promote=True).values():
                    free_host_buffer(handle)
        finally:
            with self._lock:
                self._unpin(entry)
        with self._lock:
            if entry.dram is None or entry.gone or entry.drop_dram:
                return None
            entry.lease_until = max(entry.lease_until, time.monotonic() + lease_s)
            self._touch(entry)
            return Slot(key, entry.dram, entry.size, self.buffer_address + entry.dram, entry.serial, entry)

    def release(self, key: str, serial: int) -> bool:
        """Ends the read lease of ``key``'s value ``serial``; whether the lease held to now: the
        value is still stored, in the slot :meth:`resolve` gave, and the lease had not run out
        (so a reader's bytes are that value's)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.serial != serial or entry.gone or entry.dram is None:
                return False
            held = entry.lease_until >= time.monotonic() and not entry.drop_dram
            entry.lease_until = 0.0
            self._lock.notify_all()
            return held

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
                self._dram.free(entry.dram, entry.size)
                entry.dram = None
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
        """:meth:`contains` for each key, under one hold of the lock (a batch of a thousand keys
        took a millisecond taking it key by key)."""
        with self._lock:
            self._check_open()
            index = self._index
            return [(entry := index.get(key)) is not None and entry.committed and not entry.gone for key in keys]

    def write(self, key: str, src: int, size: int, depth: int = -1) -> bool:
        """Copies ``size`` bytes at ``src`` in as ``key``: allocate, copy, commit. A key that is
        stored already is left as it is (True)."""
        try:
            slot = self.allocate(key, size, depth)
        except StoreFullError as exc:
            _log.warning("put %r: %s", key, exc)
            return False
        if slot is None:
            return True
        try:
            ctypes.memmove(slot.address, src, size)
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
            committed = [e for e in self._index.values() if e.committed and not e.gone]
            return {
                "keys": len(committed),
                "dram_keys": sum(1 for e in committed if e.dram is not None and not e.drop_dram),
                "ssd_keys": sum(1 for e in committed if e.ssd is not None),
                "dram_used": self._dram.used, "dram_capacity": self._capacity,
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

    def _emit(self, kind: KvEventType, entry: _Entry, tier: UMBPTierType) -> None:
        event = KvEvent(kind, entry.key, tier, entry.size, entry.depth)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not break the store's bookkeeping
                _log.exception("KvEvent listener failed")

    def _touch(self, entry: _Entry) -> None:
        if entry.key in self._dram_lru:
            self._dram_lru.move_to_end(entry.key)
        if entry.key in self._ssd_lru:
            self._ssd_lru.move_to_end(entry.key)

    def _leased(self) -> bool:
        now = time.monotonic()
        return any(e.lease_until > now for e in self._dram_lru.values())

    def _busy(self, entry: _Entry) -> bool:
        return entry.pins > 0 or entry.moving or entry.lease_until > time.monotonic()

    def _pin(self, entry: _Entry) -> None:
        entry.pins += 1
        self._pinned += 1

    def _unpin(self, entry: _Entry) -> None:
        """Drops a pin; the last one frees what was dropped meanwhile."""
        entry.pins -= 1
        self._pinned -= 1
        if entry.pins == 0:
            if entry.dram is not None and (entry.gone or entry.drop_dram):
                self._dram.free(entry.dram, entry.size)
                entry.dram, entry.drop_dram = None, False
            if entry.ssd is not None and self._ssd is not None and entry.gone:
                self._ssd.free(entry.ssd)
                entry.ssd = None
        self._lock.notify_all()

    def _forget(self, entry: _Entry) -> None:
        """Takes a committed entry out of the index and every tier (REMOVE events); its memory
        is freed now, or by the last unpin."""
        if self._index.get(entry.key) is entry:
            del self._index[entry.key]
        entry.gone = True
        if self._dram_lru.pop(entry.key, None) is not None:
            self._emit(KvEventType.REMOVE, entry, UMBPTierType.DRAM)
        if self._ssd_lru.pop(entry.key, None) is not None:
            self._emit(KvEventType.REMOVE, entry, UMBPTierType.SSD)
        self._pin(entry)
        self._unpin(entry)

    def _make_room(self, target: float) -> bool:
        """Starts freeing at least ``target`` bytes of DRAM: pages with an SSD copy are dropped
        from DRAM at once, others move to SSD (or, without one, are dropped). Victims are the
        least recently used, the deepest first within each window of ``candidate_window``.
        Whether anything was freed or started."""
        victims: list[_Entry] = []
        planned = 0
        window: list[_Entry] = []
        candidates = iter(list(self._dram_lru.values()))
        while planned < target:
            for entry in candidates:
                if not self._busy(entry) and not entry.drop_dram:
                    window.append(entry)
                    if len(window) == self._window:
                        break
            if not window:
                break
            victim = max(window, key=lambda e: e.depth)  # max keeps the oldest among equals
            window.remove(victim)
            victims.append(victim)
            planned += aligned(victim.size)
        moving = []
        for entry in victims:
            del self._dram_lru[entry.key]
            if entry.ssd is not None:  # a clean page: SSD has it
                self._emit(KvEventType.REMOVE, entry, UMBPTierType.DRAM)
                self._dram.free(entry.dram, entry.size)  # type: ignore[arg-type]
                entry.dram = None
            elif self._ssd is None:
                self._forget(entry)
            else:
                moving.append(entry)
        for start in range(0, len(moving), self._batch_max):
            self._start_move(moving[start:start + self._batch_max])
        return bool(victims)

    def _start_move(self, batch: list[_Entry]) -> None:
        """Starts writing ``batch`` to SSD on its workers (making room there first); pages the
        SSD tier cannot take are dropped."""
        assert self._ssd is not None
        sizes = [e.size for e in batch]
        places = self._ssd.allocate(sizes)
        if places is None:
            self._evict_ssd(sum(aligned(s) for s in sizes))
            places = self._ssd.allocate(sizes)
        if places is None:
            _log.warning("SSD tier full: %d pages dropped from DRAM instead of moved", len(batch))
            for entry in batch:
                self._forget(entry)
            return
        views = []
        for entry in batch:
            entry.moving = True
            self._pin(entry)
            start = entry.dram
            assert start is not None
            views.append(self._view[start:start + aligned(entry.size)])
        self._moves += 1
        self._moving_bytes += sum(aligned(s) for s in sizes)
        self._ssd.submit(self._finish_move, batch, places, views)

    def _finish_move(self, batch: list[_Entry], places: list[tuple[int, int]], views: list[memoryview]) -> None:
        """On an SSD worker: writes a batch, then records where each page went and drops its
        DRAM copy (ADD on SSD, then REMOVE on DRAM)."""
        assert self._ssd is not None
        sizes = [e.size for e in batch]
        try:
            records: list[SsdRecord] | None = self._ssd.write(places, views, sizes)
        except OSError as exc:
            _log.error("writing %d pages to SSD failed (%s): they stay in DRAM", len(batch), exc)
            records = None
        finally:
            for view in views:
                view.release()
        with self._lock:
            self._moves -= 1
            self._moving_bytes -= sum(aligned(s) for s in sizes)
            for i, entry in enumerate(batch):
                entry.moving = False
                if records is None:
                    self._ssd.free_place(places[i][0], places[i][1], sizes[i])
                    if not entry.gone:
                        self._dram_lru[entry.key] = entry
                elif entry.gone:
                    self._ssd.free(records[i])
                else:
                    entry.ssd = records[i]
                    self._ssd_lru[entry.key] = entry
                    self._emit(KvEventType.ADD, entry, UMBPTierType.SSD)
                    self._emit(KvEventType.REMOVE, entry, UMBPTierType.DRAM)
                    entry.drop_dram = True
                self._unpin(entry)
            if self._ssd.used > self._ssd_high * self._ssd.capacity:
                self._evict_ssd(self._ssd.used - self._ssd_low * self._ssd.capacity)

    def _evict_ssd(self, target: float) -> None:
        """Frees at least ``target`` bytes of SSD, least recently used first: a page also in
        DRAM loses its SSD copy, one only on SSD leaves the store."""
        assert self._ssd is not None
        freed = 0
        for entry in list(self._ssd_lru.values()):
            if freed >= target:
                break
            if self._busy(entry):
                continue
            freed += aligned(entry.size)
            if entry.dram is not None and not entry.drop_dram:
                del self._ssd_lru[entry.key]
                self._emit(KvEventType.REMOVE, entry, UMBPTierType.SSD)
                self._ssd.free(entry.ssd)  # type: ignore[arg-type]
                entry.ssd = None
            else:
                self._forget(entry)

    def _stage(self, entries: list[_Entry], promote: bool) -> dict[int, UMBPHostBufferHandle]:
        """Reads pinned SSD-only entries on the SSD workers, all at once. With ``promote``, each
        into a new DRAM slot where one is free now (an ADD on DRAM when read); the others into
        scratch buffers, returned as ``{id(entry): buffer}`` for the caller to free."""
        assert self._ssd is not None
        jobs: list[tuple[_Entry, SsdRecord, int | None, UMBPHostBufferHandle | None]] = []
        with self._lock:
            for entry in entries:
                if entry.dram is not None or entry.ssd is None:
                    continue
                offset = None
                if promote and not entry.staging:
                    offset = self._dram.allocate(entry.size)
                    if offset is None and self._make_room(aligned(entry.size)):
                        offset = self._dram.allocate(entry.size)
                    entry.staging = offset is not None
                jobs.append((entry, entry.ssd, offset, None))
        futures: list[tuple[concurrent.futures.Future, memoryview]] = []
        for i, (entry, record, offset, _) in enumerate(jobs):
            if offset is not None:
                view = self._view[offset:offset + aligned(record.size)]
            else:
                scratch_buffer = allocate_host_buffer(aligned(record.size), prefault=False)
                jobs[i] = (entry, record, offset, scratch_buffer)
                view = scratch_buffer.view()
            futures.append((self._ssd.submit(self._ssd.read, record, view), view))
        scratch: dict[int, UMBPHostBufferHandle] = {}
        for (entry, record, offset, buffer), (future, view) in zip(jobs, futures):
            try:
                future.result(IO_TIMEOUT_S)
                ok = True
            except concurrent.futures.TimeoutError:
                # The read may still land in its buffer: leave that memory taken for good.
                _log.error("reading %r from SSD took over %s s; its buffer is abandoned", entry.key, IO_TIMEOUT_S)
                with self._lock:
                    entry.staging = False
                continue
            except Exception as exc:
                _log.error("reading %r from SSD failed: %s", entry.key, exc)
                ok = False
            view.release()
            if buffer is not None:
                if ok:
                    scratch[id(entry)] = buffer
                else:
                    free_host_buffer(buffer)
                continue
            with self._lock:
                entry.staging = False
                if ok and not entry.gone:
                    entry.dram = offset
                    self._dram_lru[entry.key] = entry
                    self._emit(KvEventType.ADD, entry, UMBPTierType.DRAM)
                else:
                    self._dram.free(offset, record.size)  # type: ignore[arg-type]
        return scratch

    def _wait_moves(self, deadline: float) -> bool:
        while self._moves:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._lock.wait(min(remaining, 1.0))
        return True
