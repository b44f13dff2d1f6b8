"""Per-device CUDA streams and events, the wait for their completion, and batched copies.

The pieces mori's GPU transports are built from (mori-io's NVLink backend and the GPU staging of
its TCP backend):

* :func:`on_device` — a device's primary context current for a block, the caller's restored after;
* :class:`PrimaryContext` — a device's primary context, made current with one driver call;
* :class:`StreamPool` — streams of one device (blocking ones by default), handed out
  round-robin, more created only while the ones that would be handed out are busy;
* :class:`EventPool` — events of one device, reused up to a bound; ``record(stream)``;
* :class:`Completion` — the end of the work recorded by a list of events: a non-blocking
  :meth:`~Completion.poll` and a :meth:`~Completion.wait` built on :func:`mori.core.cuda.poll`;
* :class:`BatchMemcpy` — many copies on one stream in one ``cuMemcpyBatchAsync``, or one
  ``cuMemcpyAsync`` per copy where the driver has no batch call;
* :class:`GatherLauncher` (native) — a gather table's upload (rows (src, dst, bytes), say a
  :class:`mori.core.batch.Batch`'s), the launch of the caller's gather kernel and an event, in one
  call through driver entry points.

Host memory these copies use comes from :class:`mori.core.memory.PinnedPool`. Everything here needs
the ``mori-core[cuda]`` extra when used, not when imported. The driver entry points that a
per-transfer path calls are looked up once per object, and results are checked with a comparison
before any message is built: these calls sit on latency-critical paths (a 4 KiB NVLink transfer
takes a few microseconds).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from . import cuda
from ._native import gpu as _native_gpu
from ._native.gpu import BATCH_REFUSALS, GatherLauncher

__all__ = [
    "BatchMemcpy",
    "Completion",
    "EventPool",
    "GatherLauncher",
    "PrimaryContext",
    "StreamPool",
    "batch_entry_point",
    "on_device",
]

_NOT_READY = 600  # CUDA_ERROR_NOT_READY: an event or stream with work still queued


def _check_count(value: object, name: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@contextlib.contextmanager
def on_device(device: int) -> Iterator[Any]:
    """Makes ``device``'s primary context current for the block (yields the ``CUcontext``), then
    restores the context the thread had, so a user's thread keeps the device PyTorch reads from it."""
    cuda.call("cuInit", 0)  # cuCtxGetCurrent needs an initialised driver
    previous = cuda.call("cuCtxGetCurrent")
    context = cuda.init_device(device)
    try:
        yield context
    finally:
        cuda.call("cuCtxSetCurrent", previous)


class PrimaryContext:
    """The primary context of ``device`` (retained by :func:`mori.core.cuda.init_device`, which
    also makes it current); :meth:`make_current` costs one driver call."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.handle = cuda.init_device(device)
        self._set_current = cuda.driver().cuCtxSetCurrent

    def make_current(self) -> None:
        """Makes this context current in the calling thread."""
        done = self._set_current(self.handle)
        if done[0]:
            cuda.check(done, "cuCtxSetCurrent", f"device {self.device}")


class StreamPool:
    """Up to ``max_streams`` streams of one device, handed out round-robin.

    Blocking streams (the default): work queued earlier on the legacy default stream (where
    PyTorch runs unless told otherwise) finishes before their work starts. ``blocking=False``
    makes non-blocking ones, which do not wait for it (for a poll that must not queue behind a
    running kernel). The pool grows only while the streams it would hand out still have work
    queued: work issued one piece after another reuses an idle stream instead of paying for a new
    one (``cuStreamCreate`` costs tens of microseconds), and work that overlaps gets streams of
    its own. Streams are made in the context current when :meth:`take` creates them: use the pool
    with the device's context current (:func:`on_device`, :class:`PrimaryContext`, or the
    caller's own context of that device); ``device`` names it in errors.
    """

    def __init__(self, device: int, max_streams: int, *, blocking: bool = True) -> None:
        self.device = device
        self.max_streams = _check_count(max_streams, "max_streams", 1)
        drv = cuda.driver()
        flags = drv.CUstream_flags
        self._flags = (flags.CU_STREAM_DEFAULT if blocking else flags.CU_STREAM_NON_BLOCKING).value
        self._query = drv.cuStreamQuery
        self._synchronize = drv.cuStreamSynchronize
        self._destroy = drv.cuStreamDestroy
        self._streams: list[Any] = []
        self._next = 0
        self._lock = threading.Lock()

    def take(self, n: int = 1) -> list[Any]:
        """``n`` streams (fewer when ``max_streams`` is smaller), the next ones round-robin; the
        caller does not own them (other callers may get the same ones later)."""
        n = max(1, min(n, self.max_streams))
        with self._lock:
            pool = self._streams
            while len(pool) < n or (len(pool) < self.max_streams and self._busy(pool[self._next % len(pool)])):
                stream = cuda.call("cuStreamCreate", self._flags, detail=f"device {self.device}")
                pool.insert(self._next % len(pool) if pool else 0, stream)
            out = [pool[(self._next + i) % len(pool)] for i in range(n)]
            self._next = (self._next + n) % len(pool)
        return out

    def _busy(self, stream: Any) -> bool:
        (res,) = self._query(stream)
        return bool(res)  # CUDA_SUCCESS (0): idle; NOT_READY or an error: do not reuse it now

    def synchronize(self, streams: Sequence[Any]) -> None:
        """Waits until the work queued on ``streams`` is done, ignoring errors (for cleanup after
        a failure: buffers their copies use must not be reused before)."""
        for stream in streams:
            self._synchronize(stream)

    def __len__(self) -> int:
        return len(self._streams)

    def close(self) -> None:
        """Destroys the streams (the driver lets queued work finish first). Context current."""
        with self._lock:
            streams, self._streams = self._streams, []
        for stream in streams:
            self._destroy(stream)


class Completion:
    """The end of the GPU work recorded by ``events`` (any order).

    :meth:`poll` asks the driver about the events not yet seen fired (``fired`` counts those
    seen), so a caller spinning on it sees the end at once, with no background thread. ``query``
    is ``cuEventQuery`` (:meth:`EventPool.completion` passes the one it looked up; tests pass a
    scripted one); ``what`` names the work in errors.
    """

    __slots__ = ("events", "fired", "what", "_query")

    def __init__(
        self, events: list[Any], query: Callable[[Any], tuple[Any]] | None = None, what: str = "GPU work"
    ) -> None:
        self.events = events
        self.fired = 0
        self.what = what
        self._query = cuda.driver().cuEventQuery if query is None else query

    def poll(self) -> bool:
        """True once every event has fired; raises :class:`~mori.core.cuda.CudaError` when the
        work failed (the event's query answers the error)."""
        events = self.events
        while self.fired < len(events):
            (res,) = self._query(events[self.fired])
            if res:  # CUresult is an int enum: 0 = fired
                if res == _NOT_READY:
                    return False
                cuda.check((res,), "cuEventQuery", self.what)
            self.fired += 1
        return True

    @property
    def done(self) -> bool:
        """Whether every event was seen fired (no driver call)."""
        return self.fired == len(self.events)

    def wait(
        self,
        timeout: float,
        *,
        spin: float = 5e-3,
        pause: float = 50e-6,
        max_pause: float = 200e-6,
        yield_while_spinning: bool = False,
    ) -> bool:
        """Polls until the work is done (True) or ``timeout`` seconds passed (False), with
        :func:`mori.core.cuda.poll`'s schedule: no sleep for ``spin`` seconds, then sleeps from
        ``pause`` doubling up to ``max_pause``. Raises like :meth:`poll` when the work failed."""
        return cuda.poll(
            self.poll, timeout, spin=spin, pause=pause, max_pause=max_pause, yield_while_spinning=yield_while_spinning
        )


class EventPool:
    """Events of one device (timing disabled), reused: at most ``max_idle`` returned events are
    kept, the others destroyed. Use with the device's context current (events are made in the
    context current when :meth:`take` creates them)."""

    def __init__(self, device: int, max_idle: int) -> None:
        self.device = device
        self.max_idle = _check_count(max_idle, "max_idle", 0)
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        drv = cuda.driver()
        self._flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self._record, self._query, self._destroy = drv.cuEventRecord, drv.cuEventQuery, drv.cuEventDestroy
        self._what = f"GPU work on device {device}"

    def take(self) -> Any:
        """An idle event, or a new one when none is idle."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return cuda.call("cuEventCreate", self._flags, detail=f"device {self.device}")

    def give(self, events: Sequence[Any]) -> None:
        """Returns events whose work is done (or that were never recorded)."""
        with self._lock:
            keep = max(0, self.max_idle - len(self._idle))
            self._idle.extend(events[:keep])
            extra = events[keep:]
        for event in extra:
            self._destroy(event)

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream``: it fires when the work queued there before it is done."""
        event = self.take()
        done = self._record(event, stream)
        if done[0]:
            self.give([event])
            cuda.check(done, "cuEventRecord", f"device {self.device}")
        return event

    def completion(self, events: list[Any], what: str = "") -> Completion:
        """A :class:`Completion` over ``events`` (taken from this pool) using this pool's query."""
        return Completion(events, self._query, what or self._what)

    @property
    def idle(self) -> int:
        """Events kept for reuse."""
        return len(self._idle)

    def close(self) -> None:
        """Destroys the idle events (events still out are the takers' to give back first)."""
        with self._lock:
            events, self._idle = self._idle, []
        for event in events:
            self._destroy(event)


def batch_entry_point() -> int:
    """The address of ``cuMemcpyBatchAsync`` in its CUDA 13 form (no ``failIdx``), the form mori's
    native code calls; 0 where the driver lacks it (that form exists only on a CUDA 13 driver)."""
    if int(cuda.call("cuDriverGetVersion")) < 13000:
        return 0
    try:
        return cuda.entry_point("cuMemcpyBatchAsync", 13000)
    except cuda.CudaError:
        return 0


def _as_list(values: Any) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


class BatchMemcpy:
    """Copies on one stream: ``cuMemcpyBatchAsync`` (its CUDA 13 form, called from native code)
    for two or more, where the driver has it, else ``cuMemcpyAsync`` per copy. Addresses are
    unified (device, peer-mapped or pinned host memory alike). Create with a context current."""

    def __init__(self) -> None:
        drv = cuda.driver()
        self._result = drv.CUresult
        self._memcpy = drv.cuMemcpyAsync
        self._entry = batch_entry_point()

    @property
    def batched(self) -> bool:
        """Whether batches go to ``cuMemcpyBatchAsync`` (False after the driver refused one)."""
        return bool(self._entry)

    def try_queue(self, dsts: Any, srcs: Any, sizes: Any, stream: Any, detail: str = "") -> bool:
        """Queues ``sizes[i]`` bytes ``srcs[i]`` -> ``dsts[i]`` on ``stream`` in one call (numpy
        uint64 arrays, or lists of ints; other dtypes raise ``TypeError``). False when there are fewer than two copies or the
        driver has no usable batch call (then, and from then on, nothing was queued); any other
        failure raises :class:`~mori.core.cuda.CudaError` with ``detail``."""
        if len(sizes) < 2 or not self._entry:
            return False
        code = _native_gpu.memcpy_batch(self._entry, dsts, srcs, sizes, int(stream))
        if code == 0:
            return True
        # "This driver will not take these as a batch", not "the copy is wrong" (the native
        # staging's own definition, gpu/memcpy_batch.hpp).
        if code in BATCH_REFUSALS:
            self._entry = 0
            return False
        cuda.check((self._result(code),), "cuMemcpyBatchAsync", detail)
        return False  # not reached: check raised

    def copy(self, dsts: Any, srcs: Any, sizes: Any, stream: Any, detail: str = "") -> None:
        """Queues every copy (one batch call, or one call each); asynchronous on ``stream``."""
        if self.try_queue(dsts, srcs, sizes, stream, detail):
            return
        memcpy = self._memcpy
        for dst, src, nbytes in zip(_as_list(dsts), _as_list(srcs), _as_list(sizes)):
            done = memcpy(dst, src, nbytes, stream)
            if done[0]:
                cuda.check(done, "cuMemcpyAsync", f"{detail}: {nbytes} bytes 0x{src:x} -> 0x{dst:x}")
