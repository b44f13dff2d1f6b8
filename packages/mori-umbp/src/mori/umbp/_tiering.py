"""The store's bookkeeping of where each page is, and its moves between tiers: pins (every user
of an entry's memory holds one; the last unpin frees what was dropped meanwhile), read leases
(a peer's read of a DRAM slot: a slot dropped while a lease on it runs is held back until the
leases end, so a reader that finishes within its lease has the value's bytes), LRU eviction
from DRAM to SSD by watermark, SSD eviction, and SSD pages staged back into DRAM. A mixin of
:class:`._store.LocalStore`, whose lock every method here runs under unless it says otherwise."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mori.core.log import get_logger

from ._enums import UMBPTierType
from ._events import KvEvent, KvEventType
from ._extents import ExtentAllocator, aligned
from ._hostmem import UMBPHostBufferHandle, allocate_host_buffer, free_host_buffer
from ._ssd import SsdRecord, SsdTier, read_runs

_log = get_logger("umbp")
#: The longest a call waits for room in DRAM or for SSD I/O.
IO_TIMEOUT_S = 30.0
#: The longest a staging waits for DRAM that pages moving to SSD free (a peer's reader waits).
STAGE_ROOM_S = 1.0


class _Entry:
    __slots__ = (
        "key",
        "size",
        "depth",
        "serial",
        "dram",
        "ssd",
        "pins",
        "leases",
        "committed",
        "gone",
        "moving",
        "staging",
        "drop_dram",
    )

    def __init__(self, key: str, size: int, depth: int, dram: int, serial: int) -> None:
        self.key, self.size, self.depth, self.serial = key, size, depth, serial
        self.dram: int | None = dram
        self.ssd: SsdRecord | None = None
        self.pins = 1  # the writer's, until commit or abort
        #: The read leases on the DRAM slot: lease id -> until (monotonic seconds).
        self.leases: dict[int, float] | None = None
        self.committed = self.gone = self.moving = self.staging = False
        self.drop_dram = False


class _HeldSlot:
    """A DRAM slot dropped while read leases on it ran: freed when they have all ended."""

    __slots__ = ("key", "offset", "size", "leases")

    def __init__(self, key: str, offset: int, size: int, leases: dict[int, float]) -> None:
        self.key, self.offset, self.size, self.leases = key, offset, size, leases


def _live(leases: dict[int, float] | None, now: float) -> bool:
    return bool(leases) and any(until > now for until in leases.values())  # type: ignore[union-attr]


class Tiers:
    """Where pages are, and how they move (see the module's docstring)."""

    _lock: threading.Condition
    _dram: ExtentAllocator
    _ssd: SsdTier | None
    _view: memoryview
    _dram_lru: collections.OrderedDict[str, _Entry]
    _ssd_lru: collections.OrderedDict[str, _Entry]
    _index: dict[str, _Entry]
    _listeners: list[Callable[[KvEvent], None]]
    _window: int
    _batch_max: int
    _ssd_high: float
    _ssd_low: float
    _moves: int
    _moving_bytes: int
    _pinned: int
    #: Slots held back for read leases, by lease id (a slot under each of its leases' ids).
    _held: dict[int, _HeldSlot]
    _lease_ids: Iterator[int]
    #: A ``_grpc_native.PeerSsdReads`` told of every key on SSD only (see
    #: ``LocalStore.attach_ssd_reads``), or None.
    _ssd_reads: Any = None

    def _offer_ssd_read(self, entry: _Entry) -> None:
        """Tells the peer service's C++ reads (if attached) of ``entry`` if it is on SSD only now:
        committed, not gone, no DRAM copy, an SSD record."""
        record = entry.ssd
        if self._ssd_reads is None or record is None or entry.dram is not None or not entry.committed or entry.gone:
            return
        assert self._ssd is not None
        self._ssd_reads.add(entry.key, self._ssd.fd(record.segment), record.offset, record.size, record.checksum)

    def _withdraw_ssd_read(self, entry: _Entry) -> None:
        """Takes ``entry`` out of those reads: before its SSD record is freed or its DRAM copy
        comes back (a read of it in flight is then thrown away)."""
        if self._ssd_reads is not None and entry.dram is None:
            self._ssd_reads.remove(entry.key)

    def _touch_ssd_reads(self) -> None:
        """The keys the C++ reads served count as used, for SSD eviction."""
        if self._ssd_reads is not None:
            for key in self._ssd_reads.take_hits():
                if key in self._ssd_lru:
                    self._ssd_lru.move_to_end(key)

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
        """Whether DRAM will come back when read leases end: a leased page, or a held slot."""
        self._reclaim()
        now = time.monotonic()
        return bool(self._held) or any(_live(e.leases, now) for e in self._dram_lru.values())

    def _busy(self, entry: _Entry) -> bool:
        return entry.pins > 0 or entry.moving or _live(entry.leases, time.monotonic())

    def _lease(self, entry: _Entry, until: float) -> int:
        """A new read lease on ``entry``'s DRAM slot, to ``until``; its id. Leases that ran out
        are dropped here, so an entry keeps only those of readers within their time."""
        lease_id = next(self._lease_ids)
        if entry.leases is None:
            entry.leases = {}
        else:
            now = time.monotonic()
            for old in [i for i, end in entry.leases.items() if end <= now]:
                del entry.leases[old]
        entry.leases[lease_id] = until
        return lease_id

    def _end_lease(self, key: str, lease_id: int) -> float | None:
        """Ends one read lease on ``key``'s slot, or on a slot of it held back (then freed once
        no lease on it runs); when it was to run to, or None when no such lease is known."""
        held = self._held.get(lease_id)
        if held is not None and held.key == key:
            del self._held[lease_id]
            until = held.leases.pop(lease_id, 0.0)
            if not _live(held.leases, time.monotonic()):
                self._free_held(held)
            self._lock.notify_all()
            return until
        entry = self._index.get(key)
        if entry is None or not entry.leases or lease_id not in entry.leases:
            return None
        until = entry.leases.pop(lease_id)
        self._lock.notify_all()
        return until

    def _drop_dram(self, entry: _Entry) -> None:
        """Frees ``entry``'s DRAM slot, or, while a read lease on it runs, holds it back until
        the leases end (a reader within its lease reads the value's bytes)."""
        offset, leases = entry.dram, entry.leases
        assert offset is not None
        entry.dram, entry.leases, entry.drop_dram = None, None, False
        self._offer_ssd_read(entry)
        if leases and _live(leases, time.monotonic()):
            held = _HeldSlot(entry.key, offset, entry.size, leases)
            for lease_id in leases:
                self._held[lease_id] = held
        else:
            self._dram.free(offset, entry.size)

    def _free_held(self, held: _HeldSlot) -> None:
        for lease_id in held.leases:
            self._held.pop(lease_id, None)
        held.leases = {}
        self._dram.free(held.offset, held.size)

    def _reclaim(self) -> None:
        """Frees the held slots whose leases have all ended."""
        if not self._held:
            return
        now = time.monotonic()
        done = {id(h): h for h in self._held.values() if not _live(h.leases, now)}
        for held in done.values():
            self._free_held(held)

    def _pin(self, entry: _Entry) -> None:
        entry.pins += 1
        self._pinned += 1

    def _unpin(self, entry: _Entry) -> None:
        """Drops a pin; the last one frees what was dropped meanwhile."""
        entry.pins -= 1
        self._pinned -= 1
        if entry.pins == 0:
            if entry.dram is not None and (entry.gone or entry.drop_dram):
                self._drop_dram(entry)
            if entry.ssd is not None and self._ssd is not None and entry.gone:
                self._ssd.free(entry.ssd)
                entry.ssd = None
        self._lock.notify_all()

    def _forget(self, entry: _Entry) -> None:
        """Takes a committed entry out of the index and every tier (REMOVE events); its memory
        is freed now, or by the last unpin."""
        if self._index.get(entry.key) is entry:
            del self._index[entry.key]
        self._withdraw_ssd_read(entry)
        entry.gone = True
        if self._dram_lru.pop(entry.key, None) is not None:
            self._emit(KvEventType.REMOVE, entry, UMBPTierType.DRAM)
        if self._ssd_lru.pop(entry.key, None) is not None:
            self._emit(KvEventType.REMOVE, entry, UMBPTierType.SSD)
        self._pin(entry)
        self._unpin(entry)

    def _room_for(self, size: int, deadline: float) -> int | None:
        """A DRAM slot of ``size`` bytes for a staged page, or None: one free now, or freed by
        dropping clean pages, or by the moves to SSD that making room starts (waited for until
        ``deadline``; the lock is let go meanwhile)."""
        offset = self._dram.allocate(size)
        if offset is None and self._make_room(aligned(size)):
            offset = self._dram.allocate(size)
            if offset is None and self._wait_moves(deadline):
                offset = self._dram.allocate(size)
        return offset

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
                self._drop_dram(entry)
            elif self._ssd is None:
                self._forget(entry)
            else:
                moving.append(entry)
        for start in range(0, len(moving), self._batch_max):
            self._start_move(moving[start : start + self._batch_max])
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
            views.append(self._view[start : start + aligned(entry.size)])
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
        self._touch_ssd_reads()
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

    def _stage(
        self, entries: list[_Entry], promote: bool, scratch: bool = True, here: bool = False
    ) -> dict[int, UMBPHostBufferHandle]:
        """Reads pinned SSD-only entries on the SSD workers, all at once; with ``here``, one read
        run on this thread (a peer's request, which waits for them anyway: no handoff for a
        single page). With ``promote``, each into a new DRAM slot where one is free now (an ADD
        on DRAM when read); the others, with ``scratch``, into scratch buffers, returned as
        ``{id(entry): buffer}`` for the caller to free (without, they are not read)."""
        assert self._ssd is not None
        jobs: list[tuple[_Entry, SsdRecord, int | None, UMBPHostBufferHandle | None]] = []
        room_deadline = time.monotonic() + STAGE_ROOM_S
        with self._lock:
            for entry in entries:
                if entry.dram is not None or entry.ssd is None:
                    continue
                offset = None
                if promote and not entry.staging:
                    offset = self._room_for(entry.size, room_deadline)
                    entry.staging = offset is not None
                if offset is not None or scratch:
                    jobs.append((entry, entry.ssd, offset, None))
        views: list[memoryview] = []
        for i, (entry, record, offset, _) in enumerate(jobs):
            if offset is not None:
                views.append(self._view[offset : offset + aligned(record.size)])
            else:
                scratch_buffer = allocate_host_buffer(aligned(record.size), prefault=False)
                jobs[i] = (entry, record, offset, scratch_buffer)
                views.append(scratch_buffer.view())
        # Neighbouring records are read by one call, and the runs by the workers at once.
        records = [job[1] for job in jobs]
        runs = read_runs(records)
        ssd = self._ssd
        on_workers = runs[:-1] if here else runs
        futures: list[concurrent.futures.Future[list[OSError | None]]] = [
            ssd.submit(ssd.read_run, [records[i] for i in run], [views[i] for i in run]) for run in on_workers
        ]
        outcome: list[bool | None] = [False] * len(jobs)  # None: timed out, the buffer abandoned

        def settle(run: list[int], errors: list[OSError | None]) -> None:
            for i, error in zip(run, errors):
                if error is not None:
                    _log.error("reading %r from SSD failed: %s", jobs[i][0].key, error)
                outcome[i] = error is None

        if here and runs:  # this thread's run, while the workers read theirs
            settle(runs[-1], ssd.read_run([records[i] for i in runs[-1]], [views[i] for i in runs[-1]]))
        deadline = time.monotonic() + IO_TIMEOUT_S
        for run, future in zip(on_workers, futures):
            try:
                errors = future.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                # The read may still land in its buffers: leave that memory taken for good.
                for i in run:
                    _log.error(
                        "reading %r from SSD took over %s s; its buffer is abandoned", jobs[i][0].key, IO_TIMEOUT_S
                    )
                    outcome[i] = None
                continue
            settle(run, errors)
        buffers: dict[int, UMBPHostBufferHandle] = {}
        with self._lock:
            for (entry, record, offset, buffer), view, ok in zip(jobs, views, outcome):
                if ok is None:
                    entry.staging = False
                    continue
                view.release()
                if buffer is not None:
                    if ok:
                        buffers[id(entry)] = buffer
                    else:
                        free_host_buffer(buffer)
                    continue
                entry.staging = False
                if ok and not entry.gone:
                    self._withdraw_ssd_read(entry)
                    entry.dram = offset
                    self._dram_lru[entry.key] = entry
                    self._emit(KvEventType.ADD, entry, UMBPTierType.DRAM)
                else:
                    self._dram.free(offset, record.size)  # type: ignore[arg-type]
        return buffers

    def _wait_moves(self, deadline: float) -> bool:
        while self._moves:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._lock.wait(min(remaining, 1.0))
        return True
