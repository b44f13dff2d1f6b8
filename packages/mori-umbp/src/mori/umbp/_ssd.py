"""The SSD tier: segment files in a local directory, records written and read with large aligned
I/O (``O_DIRECT`` where the file system has it) on worker threads, never the client's caller's
(a peer's request may read one run on its own thread). Each record carries its XXH3-64 hash
(``xxhash``: 1 MiB in tens of µs, where zlib's CRC-32 took a quarter of a millisecond), checked
on every read: a record that does not match is a miss.

A segment is a sparse file of ``segment_size_bytes``; its space is handed out in aligned extents
(:mod:`._extents`), so a record is one extent of one segment and a batch of pages moving out of
DRAM is, where the segment has the room, one extent written by one ``pwritev`` straight from the
DRAM tier's slots. The tier is a cache: it starts empty (segments a previous client left in the
directory are removed) and removes its segments when it closes. One client owns a directory at a
time, by a lock file.

Not thread-safe for allocation: the store calls :meth:`SsdTier.allocate` and :meth:`free` under
its lock; :meth:`write` and :meth:`read` touch no shared state but the files and run on the
tier's workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import os

import xxhash

from mori.core.log import get_logger

from ._config import UMBPCopyPipelineConfig, UMBPSsdConfig
from ._enums import UMBPDurabilityMode
from ._extents import ExtentAllocator, aligned

_log = get_logger("umbp")
_SEGMENT_PREFIX = "umbp-seg-"
_LOCK_NAME = "umbp.lock"
#: Buffers per ``pwritev``/``preadv`` call (Linux's IOV_MAX).
_IOV_MAX = 1024
#: The most bytes one ``preadv`` of neighbouring records reads: longer runs are split, so that
#: a large batch is read by several workers at once.
READ_RUN_BYTES = 1 << 20


def read_runs(records: list[SsdRecord]) -> list[list[int]]:
    """Groups records to read into runs of one ``preadv`` each: indices into ``records``, each
    run of one segment with each record starting where the one before it ends (aligned), at most
    :data:`READ_RUN_BYTES` (or one record) and ``IOV_MAX`` records long."""
    order = sorted(range(len(records)), key=lambda i: (records[i].segment, records[i].offset))
    runs: list[list[int]] = []
    end = length = -1
    segment = -1
    for i in order:
        record = records[i]
        size = aligned(record.size)
        if (
            runs
            and record.segment == segment
            and record.offset == end
            and length + size <= READ_RUN_BYTES
            and len(runs[-1]) < _IOV_MAX
        ):
            runs[-1].append(i)
            length += size
        else:
            runs.append([i])
            length = size
        segment, end = record.segment, record.offset + size
    return runs


@dataclasses.dataclass(frozen=True, slots=True)
class SsdRecord:
    """Where a value lives on SSD: a segment, an offset in it, the value's size and checksum
    (its XXH3-64 hash, 0 without ``verify_crc``)."""

    segment: int
    offset: int
    size: int
    checksum: int


class SsdTierBusyError(RuntimeError):
    """Another client holds the SSD directory."""


class SsdTier:
    """The segment files of one client's SSD tier (see the module's docstring)."""

    def __init__(self, cfg: UMBPSsdConfig, pipeline: UMBPCopyPipelineConfig) -> None:
        self.directories = [d.strip() for d in cfg.storage_dir.split(",") if d.strip()]
        self.segment_size = cfg.segment_size_bytes
        self.segment_count = max(1, cfg.capacity_bytes // self.segment_size)
        self.capacity = self.segment_count * self.segment_size
        self.strict = cfg.durability.mode == UMBPDurabilityMode.Strict
        self.verify_crc = cfg.verify_crc
        self._want_direct = cfg.direct_io
        self._segments: list[ExtentAllocator | None] = [None] * self.segment_count
        self._fds: list[int] = [-1] * self.segment_count
        self._locks: list[int] = []
        try:
            for directory in self.directories:
                self._claim(directory)
        except BaseException:
            self._release_locks()
            raise
        self.direct = self._want_direct and self._probe_direct()
        workers = max(1, pipeline.worker_threads, cfg.shard_io_threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="umbp-ssd")

    # -- the directory ------------------------------------------------------------------------

    def _claim(self, directory: str) -> None:
        """Takes the directory's lock file and removes segments a previous client left."""
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, _LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SsdTierBusyError(
                f"ssd.storage_dir {directory!r} is in use by another UMBP client (give each client its own directory)"
            ) from None
        self._locks.append(fd)
        for name in os.listdir(directory):
            if name.startswith(_SEGMENT_PREFIX):
                os.unlink(os.path.join(directory, name))

    def _probe_direct(self) -> bool:
        """Whether the first directory's file system takes ``O_DIRECT`` (tmpfs does not)."""
        path = os.path.join(self.directories[0], _SEGMENT_PREFIX + "probe")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _log.warning(
                "ssd.storage_dir %r does not take O_DIRECT; the SSD tier uses buffered I/O", self.directories[0]
            )
            return False
        os.close(fd)
        os.unlink(path)
        return True

    def _path(self, segment: int) -> str:
        directory = self.directories[segment % len(self.directories)]
        return os.path.join(directory, f"{_SEGMENT_PREFIX}{segment:05d}")

    def _open_segment(self, segment: int) -> ExtentAllocator:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self._path(segment), flags, 0o644)
        try:
            os.ftruncate(fd, self.segment_size)  # sparse: blocks are taken as records land
        except BaseException:
            os.close(fd)
            raise
        self._fds[segment] = fd
        allocator = self._segments[segment] = ExtentAllocator(self.segment_size)
        return allocator

    # -- space (under the store's lock) -------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes taken by records (aligned)."""
        return sum(a.used for a in self._segments if a is not None)

    def allocate(self, sizes: list[int]) -> list[tuple[int, int]] | None:
        """Space for records of ``sizes``: one extent for all of them where a segment has the
        room (then they are written by one call), else one extent each. ``(segment, offset)``
        per record, or None when the tier is full (nothing is then taken)."""
        total = sum(aligned(s) for s in sizes)
        for segment in range(self.segment_count):
            allocator = self._segments[segment]
            if allocator is None:
                allocator = self._open_segment(segment)
            offset = allocator.allocate(total)
            if offset is not None:
                places = []
                for size in sizes:
                    places.append((segment, offset))
                    offset += aligned(size)
                # Each record is freed on its own later: split the one extent into records.
                return places
        places = []
        for size in sizes:
            place = self._allocate_one(size)
            if place is None:
                for (segment, offset), taken in zip(places, sizes):
                    self.free_place(segment, offset, taken)
                return None
            places.append(place)
        return places

    def _allocate_one(self, size: int) -> tuple[int, int] | None:
        for segment in range(self.segment_count):
            allocator = self._segments[segment] or self._open_segment(segment)
            offset = allocator.allocate(size)
            if offset is not None:
                return segment, offset
        return None

    def fd(self, segment: int) -> int:
        """The open file of ``segment`` (a record's; for reads elsewhere until the tier closes)."""
        return self._fds[segment]

    def free_place(self, segment: int, offset: int, size: int) -> None:
        """Returns space from :meth:`allocate` that no record was written to."""
        allocator = self._segments[segment]
        assert allocator is not None
        allocator.free(offset, size)

    def free(self, record: SsdRecord) -> None:
        """Returns a record's space."""
        self.free_place(record.segment, record.offset, record.size)

    # -- I/O (on the workers) -----------------------------------------------------------------

    def submit(self, fn, *args) -> concurrent.futures.Future:  # type: ignore[no-untyped-def]
        """Runs ``fn(*args)`` on one of the tier's workers."""
        return self._pool.submit(fn, *args)

    def write(self, places: list[tuple[int, int]], views: list[memoryview], sizes: list[int]) -> list[SsdRecord]:
        """Writes each ``views[i]`` (aligned memory of ``aligned(sizes[i])`` bytes) to
        ``places[i]``, runs of neighbouring places in one call; with the Strict durability mode
        the data is on the device when this returns. Raises OSError."""
        records = []
        i = 0
        while i < len(places):
            segment, start = places[i]
            j, end = i, start
            while j < len(places) and places[j] == (segment, end) and j - i < _IOV_MAX:
                end += aligned(sizes[j])
                j += 1
            chunk = views[i:j]
            written = os.pwritev(self._fds[segment], chunk, start)
            if written != end - start:
                raise OSError(errno.EIO, f"short write to SSD segment {segment}: {written} of {end - start} bytes")
            for k in range(i, j):
                checksum = xxhash.xxh3_64_intdigest(views[k][: sizes[k]]) if self.verify_crc else 0
                records.append(SsdRecord(segment, places[k][1], sizes[k], checksum))
            i = j
        if self.strict:
            for segment in sorted({p[0] for p in places}):
                os.fdatasync(self._fds[segment])
        return records

    def read(self, record: SsdRecord, view: memoryview) -> None:
        """Reads a record into ``view`` (aligned memory of ``aligned(record.size)`` bytes) and
        checks its checksum. Raises OSError on a short read or a checksum that does not match."""
        error = self.read_run([record], [view])[0]
        if error is not None:
            raise error

    def read_run(self, records: list[SsdRecord], views: list[memoryview]) -> list[OSError | None]:
        """Reads a run from :func:`read_runs` (neighbouring records of one segment) into
        ``views`` (aligned memory of ``aligned(size)`` bytes each) by one ``preadv``, and checks
        each record's checksum. Per record, None or the OSError that failed it: a failed or short
        call fails the whole run, a checksum that does not match only its record."""
        segment, start = records[0].segment, records[0].offset
        length = sum(aligned(r.size) for r in records)
        try:
            got = os.preadv(self._fds[segment], [v[: aligned(r.size)] for r, v in zip(records, views)], start)
        except OSError as exc:
            return [exc] * len(records)
        if got != length:
            short = OSError(errno.EIO, f"short read from SSD segment {segment}: {got} of {length} bytes")
            return [short] * len(records)
        errors: list[OSError | None] = [None] * len(records)
        if self.verify_crc:
            for i, (record, view) in enumerate(zip(records, views)):
                if xxhash.xxh3_64_intdigest(view[: record.size]) != record.checksum:
                    errors[i] = OSError(
                        errno.EIO, f"checksum mismatch in SSD segment {record.segment} at {record.offset}"
                    )
        return errors

    def sync(self) -> None:
        """Puts every written record on the device (``fdatasync`` each segment)."""
        for fd in self._fds:
            if fd >= 0:
                os.fdatasync(fd)

    def close(self) -> None:
        """Stops the workers (after their queued work), removes the segments, frees the lock."""
        self._pool.shutdown(wait=True)
        for segment, fd in enumerate(self._fds):
            if fd >= 0:
                os.close(fd)
                self._fds[segment] = -1
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(segment))
        self._release_locks()

    def _release_locks(self) -> None:
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()
