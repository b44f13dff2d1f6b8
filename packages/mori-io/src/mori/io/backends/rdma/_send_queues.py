"""MORI's send-queue admission for the RDMA backend ("SQ full"), checked before a transfer is
ordered among its engine's transfers."""

from __future__ import annotations

import threading
import time

from mori.core import config as mori_config

from ...types import StatusCode, TransferStatus
from ..base import Outcome, TransferOp

__all__ = ["SEND_WR_DEFAULT", "SendQueues"]

SEND_WR_DEFAULT = 8192  # MORI's send queue depth per queue pair when max_send_wr is 0


class _Queue:
    """One worker's operations towards one peer: the transfers admitted, and an upper bound of
    the operations they hold (finished ones count until the next prune)."""

    __slots__ = ("entries", "used")

    def __init__(self) -> None:
        self.entries: list[tuple[TransferStatus, int]] = []
        self.used = 0

    def prune(self) -> None:
        """Drops the finished transfers. Their own codes, not Code(): a finished transfer frees
        its operations even while an earlier transfer to the same engine keeps its status
        IN_PROGRESS (one admitted and not submitted yet is IN_PROGRESS already: the engine
        admits only statuses made so). ``_running`` reads the code without making the enum: a
        full queue's prune looks at every entry."""
        self.entries = [e for e in self.entries if e[0]._running()]
        self.used = sum(n for _, n in self.entries)


class SendQueues:
    """Each worker's endpoints to one peer hold at most ``depth`` operations (``max_send_wr`` per
    lane, as MORI's per queue pair). A transfer waits up to ``MORI_IO_SQ_BACKOFF_TIMEOUT_US`` for
    room, then fails with ``ERR_RDMA_OP`` and a message starting ``SQ full`` (MORI's words, which
    vLLM's MoRIIO connector matches to re-post). A transfer larger than the whole queue takes all
    of it. Room frees when a transfer's own outcome is final (read from its completion slot):
    finished transfers are counted until the queue looks full, then dropped, so admitting one
    costs no look at the others while there is room."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, str], _Queue] = {}

    def admit(self, worker: int, key: str, status: TransferStatus, ops: int, op: TransferOp) -> Outcome | None:
        """Reserves room for ``ops`` operations of ``status`` (None), or refuses: SQ full (naming ``op``)."""
        need = ops if ops < self.depth else self.depth
        where = (worker, key)
        deadline = None  # read when the queue is full: the common case costs no setting lookup
        while True:
            with self._lock:
                queue = self._queues.get(where)
                if queue is None:
                    queue = self._queues[where] = _Queue()
                if queue.used + need > self.depth:
                    queue.prune()
                if queue.used + need <= self.depth:
                    queue.entries.append((status, need))
                    queue.used += need
                    return None
                used = queue.used
            if deadline is None:
                deadline = time.monotonic() + int(mori_config.get("MORI_IO_SQ_BACKOFF_TIMEOUT_US")) / 1e6
            left = deadline - time.monotonic()
            if left <= 0:
                return Outcome(StatusCode.ERR_RDMA_OP, f"SQ full ({op.name.lower()}): engine={key} worker={worker} "
                                                       f"depth={used} requested={need} max={self.depth}")
            time.sleep(min(left, 0.001))  # finished transfers do not notify: look again soon

    def forget(self, key: str) -> None:
        """Drops the queues to engine ``key`` (its transfers have been failed or finished)."""
        with self._lock:
            for k in [k for k in self._queues if k[1] == key]:
                del self._queues[k]
