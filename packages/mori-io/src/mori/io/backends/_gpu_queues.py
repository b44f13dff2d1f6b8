"""Per-device copy resources of the NVLink backend and the completion object of one transfer.

:class:`DeviceQueues` owns, for one local GPU, a pool of streams (copies of concurrent
transfers spread over them, and a large transfer over several), a pool of events, and the gather
kernel. :class:`GpuTransfer` is what a :class:`~mori.io.TransferStatus` polls: it asks CUDA
whether the transfer's events have fired, so a caller spinning on ``InProgress()`` sees the end
of the copy at once, without waiting for a background thread to get the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mori.core import cuda as _cuda

from ..types import StatusCode
from ._copy_kernels import CopyKernel, TableBuffer
from ._memcpy_batch import BatchMemcpy
from ._nvlink_plan import KERNEL_PIECE, CopyPlan

__all__ = ["DeviceQueues", "GpuTransfer"]

_NOT_READY = 600  # CUDA_ERROR_NOT_READY: an event that has not fired yet
_DONE = (StatusCode.SUCCESS, "")

# A waiter polls without sleeping for this long (each poll releases the GIL inside the driver
# call): a transfer of up to ~1 GiB ends within it, and Linux oversleeps any sleep by ~50 us of
# timer slack, which would be a large part of a short transfer.
_SPIN_S = 5e-3
_MAX_PAUSE_S = 200e-6  # after the spin: longest sleep between polls (a 5 ms+ transfer oversleeps < 4 %)


class DeviceQueues:
    """Streams, events and the gather kernel of one device. Call with its context current."""

    def __init__(self, device: int, num_streams: int, num_events: int) -> None:
        self.device = device
        self._drv = drv = _cuda.driver()
        self._ctx = _cuda.init_device(device)
        # Driver entry points of the per-transfer path, looked up once.
        self._set_current = drv.cuCtxSetCurrent
        self._event_record = drv.cuEventRecord
        self._memcpy = drv.cuMemcpyAsync
        self._stream_query = drv.cuStreamQuery
        self._event_flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self._num_streams = num_streams
        self._num_events = num_events
        self._streams: list[Any] = []
        self._next = 0
        self._events: list[Any] = []
        self._kernel: CopyKernel | None = None
        self._lock = threading.Lock()
        self._batch = BatchMemcpy()

    def make_current(self) -> None:
        """Makes this device's primary context current in the calling thread (one driver call)."""
        done = self._set_current(self._ctx)
        if done[0]:
            _cuda.check(done, "cuCtxSetCurrent", f"device {self.device}")

    def streams(self, n: int) -> list[Any]:
        """``n`` streams (fewer if the pool is smaller), round-robin over the pool.

        The pool grows only while the streams it would hand out still have work queued (up to
        ``num_streams``): transfers issued one after another reuse an idle stream instead of
        paying for a new one (cuStreamCreate costs tens of microseconds), and transfers that
        overlap get streams of their own. Streams are blocking ones: work queued earlier on the
        legacy default stream (where PyTorch runs unless told otherwise) finishes before a
        transfer's copies start.
        """
        n = max(1, min(n, self._num_streams))
        with self._lock:
            pool = self._streams
            while len(pool) < n or (len(pool) < self._num_streams and self._busy(pool[self._next % len(pool)])):
                flags = self._drv.CUstream_flags.CU_STREAM_DEFAULT.value
                pool.insert(self._next % len(pool) if pool else 0,
                            _cuda.call("cuStreamCreate", flags, detail=f"device {self.device}"))
            out = [pool[(self._next + i) % len(pool)] for i in range(n)]
            self._next = (self._next + n) % len(pool)
        return out

    def _busy(self, stream: Any) -> bool:
        (res,) = self._stream_query(stream)
        return bool(res)  # CUDA_SUCCESS (0): idle; NOT_READY or an error: do not reuse it now

    def event(self) -> Any:
        """An event from the pool (created when the pool is empty)."""
        with self._lock:
            if self._events:
                return self._events.pop()
        return _cuda.call("cuEventCreate", self._event_flags, detail=f"device {self.device}")

    def give_events(self, events: list[Any]) -> None:
        """Returns fired events; beyond ``num_events`` idle ones they are destroyed."""
        with self._lock:
            keep = max(0, self._num_events - len(self._events))
            self._events.extend(events[:keep])
            extra = events[keep:]
        for ev in extra:
            self._drv.cuEventDestroy(ev)

    @property
    def kernel(self) -> CopyKernel:
        """The gather kernel, compiled and loaded on first use."""
        with self._lock:
            if self._kernel is None:
                self._kernel = CopyKernel(self.device)
            return self._kernel

    def _engine_copy(self, rows: np.ndarray, stream: Any) -> None:
        """Copies ``rows`` (src, dst, bytes) with the copy engines on ``stream``."""
        if self._batch.try_queue(rows[:, 1], rows[:, 0], rows[:, 2], stream,
                                 f"{len(rows)} copies on device {self.device}"):
            return
        for src, dst, nbytes in rows.tolist():
            _cuda.check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyAsync",
                        f"{nbytes} bytes 0x{src:x} -> 0x{dst:x}")

    def issue(self, plan: CopyPlan, table: TableBuffer | None = None) -> tuple[list[Any], list[TableBuffer]]:
        """Queues every copy of ``plan``; returns the events that fire when they are done and the
        table buffers to give back then. ``table`` is the buffer the plan was made into (its
        rows are the kernel's when ``plan.in_out``); it is used, or given back here."""
        lanes = len(plan.engines) + (1 if len(plan.kernel) else 0)
        events: list[Any] = []
        tables: list[TableBuffer] = []
        streams: list[Any] = []
        try:
            streams = self.streams(lanes) if lanes else []
            # The kernel first: it starts while the copy engines' copies are being queued.
            if len(plan.kernel):
                stream, n, kernel = streams[-1], len(plan.kernel), self.kernel
                events.append(self.event())
                if n == 1:  # a lone block: passed by value, cut into pieces by the kernel
                    src, dst, nbytes = plan.kernel[0].tolist()
                    kernel.launch(stream, None, 1, single=(src, dst, nbytes), event=events[-1])
                else:
                    given, table = table, None
                    tables.append(self._kernel_table(plan, given, n))
                    kernel.launch(stream, tables[-1], n, plan.kernel_per_row, KERNEL_PIECE, event=events[-1])
            for rows, stream in zip(plan.engines, streams):
                self._engine_copy(rows, stream)
                events.append(self._record(stream))
        except BaseException:
            # Copies (and a table upload) already queued may still run: wait for them before the
            # events and tables are reused.
            for s in streams:
                self._drv.cuStreamSynchronize(s)
            self.give_events(events)
            for t in tables:
                self.kernel.tables.give(t)
            raise
        finally:
            if table is not None:  # not needed by this plan
                self.kernel.tables.give(table)
        return events, tables

    def _kernel_table(self, plan: CopyPlan, table: TableBuffer | None, n: int) -> TableBuffer:
        """A table holding the plan's ``n`` kernel rows. Takes over ``table`` (the one the plan
        was made into, or None): it is returned as is when it holds the rows, filled when it is
        large enough, or given back."""
        if plan.in_out and table is not None:
            return table
        if table is not None and table.capacity < n:  # rows cut on the host outgrew it
            self.kernel.tables.give(table)
            table = None
        if table is None:
            table = self.kernel.tables.take(n)
        table.rows[:n] = plan.kernel
        return table

    def _record(self, stream: Any) -> Any:
        ev = self.event()
        done = self._event_record(ev, stream)
        if done[0]:
            _cuda.check(done, "cuEventRecord", f"device {self.device}")
        return ev

    def close(self) -> None:
        """Destroys streams, events and the kernel (copies must have completed)."""
        with self._lock:
            streams, self._streams = self._streams, []
            events, self._events = self._events, []
            kernel, self._kernel = self._kernel, None
        for s in streams:
            self._drv.cuStreamDestroy(s)
        for ev in events:
            self._drv.cuEventDestroy(ev)
        if kernel is not None:
            kernel.close()


class GpuTransfer:
    """The outcome of one transfer's GPU copies (the ``Completion`` a TransferStatus polls).

    ``on_done`` runs once, from whichever thread first sees the end (it recycles resources and
    sends the target its notification).
    """

    def __init__(self, queues: DeviceQueues, events: list[Any], tables: list[TableBuffer], deadline: float,
                 on_done: Callable[[GpuTransfer], None]) -> None:
        self.queues = queues
        self.events = events
        self.tables = tables
        self.deadline = deadline
        self._on_done = on_done
        self._final: tuple[StatusCode, str] | None = None if events else (StatusCode.SUCCESS, "")
        self.abandoned = False  # ended by the timeout: its events and tables may still be in use
        self._lock = threading.Lock()
        self._query = queues._drv.cuEventQuery
        self._fired = 0  # events[:_fired] are known to have fired

    def _poll(self) -> tuple[StatusCode, str] | None:
        events = self.events
        while self._fired < len(events):
            (res,) = self._query(events[self._fired])
            if res:  # CUresult is an int enum: 0 = success
                if res == _NOT_READY:
                    return None
                name, _ = _cuda.describe(res)
                return StatusCode.ERR_GPU_OP, f"NVLink copy failed on device {self.queues.device}: {name}"
            self._fired += 1
        return _DONE

    def finish(self, code: StatusCode | None = None, message: str = "") -> bool:
        """Checks the events (or forces ``code``); True once the transfer has ended."""
        with self._lock:
            if self._final is not None:
                return True
            result = (code, message) if code is not None else self._poll()
            if result is None:
                return False
            self._final = result
            self.abandoned = code is not None
        self._on_done(self)
        return True

    def code(self) -> int:
        """The transfer's StatusCode (``IN_PROGRESS`` until every copy is done)."""
        final = self._final
        if final is None:
            self.finish()
            final = self._final
        return int(final[0] if final is not None else StatusCode.IN_PROGRESS)

    def message(self) -> str:
        """Why the transfer failed ('' on success or while running)."""
        final = self._final
        return final[1] if final is not None else ""

    def wait(self, timeout: float) -> bool:
        """Polls until the transfer ends or ``timeout`` seconds pass: without sleeping for the
        first ``_SPIN_S`` (the GIL is released in every poll), then sleeping between polls."""
        def ended() -> bool:
            if self.finish():
                return True
            if time.monotonic() < self.deadline:
                return False
            return self.finish(StatusCode.ERR_GPU_OP, f"NVLink copy did not complete in time (MORI_IO_TIMEOUT) on "
                                                      f"device {self.queues.device}")

        return _cuda.poll(ended, timeout, spin=_SPIN_S, pause=50e-6, max_pause=_MAX_PAUSE_S)
