"""Per-device copy resources of the NVLink backend and the completion object of one transfer.

:class:`DeviceQueues` holds, for one local GPU, mori-core's pieces (a :class:`~mori.core.gpu.StreamPool`:
copies of concurrent transfers spread over its streams, and a large transfer over several; an
:class:`~mori.core.gpu.EventPool`; a :class:`~mori.core.gpu.BatchMemcpy`) and the gather kernel.
:class:`GpuTransfer` is what a :class:`~mori.io.TransferStatus` polls: a
:class:`~mori.core.gpu.Completion` over the transfer's events, so a caller spinning on
``InProgress()`` sees the end of the copy at once, without waiting for a background thread to get
the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mori.core import cuda as _cuda
from mori.core.gpu import BatchMemcpy, Completion, EventPool, PrimaryContext, StreamPool

from ...types import StatusCode
from ._kernels import CopyKernel, TableBuffer
from .plan import KERNEL_PIECE, CopyPlan

__all__ = ["DeviceQueues", "GpuTransfer"]

_DONE = (StatusCode.SUCCESS, "")

# A waiter polls without sleeping for this long (each poll releases the GIL inside the driver
# call): a transfer of up to ~1 GiB ends within it, and Linux oversleeps any sleep by ~50 us of
# timer slack, which would be a large part of a short transfer.
_SPIN_S = 5e-3
_MAX_PAUSE_S = 200e-6  # after the spin: longest sleep between polls (a 5 ms+ transfer oversleeps < 4 %)


class DeviceQueues:
    """Streams, events, batched copies and the gather kernel of one device. Call with its context
    current."""

    def __init__(self, device: int, num_streams: int, num_events: int) -> None:
        self.device = device
        self._context = PrimaryContext(device)
        self.make_current = self._context.make_current
        self.streams = StreamPool(device, num_streams)
        self.events = EventPool(device, num_events)
        self._batch = BatchMemcpy()
        self._what = f"NVLink copy on device {device}"
        self._kernel: CopyKernel | None = None
        self._lock = threading.Lock()

    @property
    def kernel(self) -> CopyKernel:
        """The gather kernel, compiled and loaded on first use."""
        with self._lock:
            if self._kernel is None:
                self._kernel = CopyKernel(self.device)
            return self._kernel

    def issue(self, plan: CopyPlan, table: TableBuffer | None = None) -> tuple[list[Any], list[TableBuffer]]:
        """Queues every copy of ``plan``; returns the events that fire when they are done and the
        table buffers to give back then. ``table`` is the buffer the plan was made into (its
        rows are the kernel's when ``plan.in_out``); it is used, or given back here."""
        lanes = len(plan.engines) + (1 if len(plan.kernel) else 0)
        events: list[Any] = []
        tables: list[TableBuffer] = []
        streams: list[Any] = []
        try:
            streams = self.streams.take(lanes) if lanes else []
            # The kernel first: it starts while the copy engines' copies are being queued.
            if len(plan.kernel):
                stream, n, kernel = streams[-1], len(plan.kernel), self.kernel
                events.append(self.events.take())
                if n == 1:  # a lone block: passed by value, cut into pieces by the kernel
                    src, dst, nbytes = plan.kernel[0].tolist()
                    kernel.launch(stream, None, 1, single=(src, dst, nbytes), event=events[-1])
                else:
                    given, table = table, None
                    tables.append(self._kernel_table(plan, given, n))
                    kernel.launch(stream, tables[-1], n, plan.kernel_per_row, KERNEL_PIECE, event=events[-1])
            for rows, stream in zip(plan.engines, streams):
                self._batch.copy(rows[:, 1], rows[:, 0], rows[:, 2], stream, self._what)
                events.append(self.events.record(stream))
        except BaseException:
            # Copies (and a table upload) already queued may still run: wait for them before the
            # events and tables are reused.
            self.streams.synchronize(streams)
            self.events.give(events)
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

    def transfer(
        self, events: list[Any], tables: list[TableBuffer], deadline: float, on_done: Callable[[GpuTransfer], None]
    ) -> GpuTransfer:
        """The completion object of a transfer whose copies :meth:`issue` queued."""
        return GpuTransfer(self, self.events.completion(events, self._what), tables, deadline, on_done)

    def close(self) -> None:
        """Destroys streams, events and the kernel (copies must have completed)."""
        with self._lock:
            kernel, self._kernel = self._kernel, None
        self.streams.close()
        self.events.close()
        if kernel is not None:
            kernel.close()


class GpuTransfer:
    """The outcome of one transfer's GPU copies (the ``Completion`` a TransferStatus polls).

    ``on_done`` runs once, from whichever thread first sees the end (it recycles resources and
    sends the target its notification).
    """

    def __init__(
        self,
        queues: DeviceQueues,
        done: Completion,
        tables: list[TableBuffer],
        deadline: float,
        on_done: Callable[[GpuTransfer], None],
    ) -> None:
        self.queues = queues
        self.events = done.events
        self.tables = tables
        self._done = done
        self.deadline = deadline
        self._on_done = on_done
        self._final: tuple[StatusCode, str] | None = None if done.events else _DONE
        self.abandoned = False  # ended by the timeout: its events and tables may still be in use
        self._lock = threading.Lock()

    def _poll(self) -> tuple[StatusCode, str] | None:
        try:
            return _DONE if self._done.poll() else None
        except _cuda.CudaError as err:
            return StatusCode.ERR_GPU_OP, f"NVLink copy failed on device {self.queues.device}: {err.name}"

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
            return self.finish(
                StatusCode.ERR_GPU_OP,
                f"NVLink copy did not complete in time (MORI_IO_TIMEOUT) on device {self.queues.device}",
            )

        return _cuda.poll(ended, timeout, spin=_SPIN_S, pause=50e-6, max_pause=_MAX_PAUSE_S)
