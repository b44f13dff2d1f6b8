"""Statuses together: the completion order of an engine's transfers per remote engine (see
:class:`~mori.io.TransferStatus`, "Order"), and MORI's ``wait_all`` over many statuses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from .types import StatusCode, TransferStatus

__all__ = ["PeerOrder", "wait_all"]


class PeerOrder:
    """Per remote engine, the newest transfer started towards it."""

    def __init__(self) -> None:
        self._last: dict[str, TransferStatus] = {}
        self._lock = threading.Lock()
        # The newest transfer to a remote engine, or None: the dict's own get, with no Python
        # frame around it (a transfer that finished as it started asks it, see running()).
        self.last: Callable[[str], TransferStatus | None] = self._last.get

    def join(self, remote_key: str, status: TransferStatus) -> None:
        """Makes ``status`` the newest transfer to ``remote_key``: it reports finished only after
        every transfer joined before it did."""
        with self._lock:
            earlier = self._last.get(remote_key)
            self._last[remote_key] = status
        # Outside the lock: until the caller attaches its completion, status reads as running,
        # so a transfer joined after it meanwhile links to it whatever it links to itself.
        if earlier is not None:
            status._after(earlier)

    def running(self, remote_key: str) -> bool:
        """Whether the newest transfer to ``remote_key`` may still run. A transfer that finished
        as it started needs to join only then: with none running before it, nothing holds it back,
        and a later one skips it (a finished link) anyway."""
        last = self._last.get(remote_key)
        return last is not None and last._running()

    def drop_finished(self, remote_key: str, status: TransferStatus) -> None:
        """Drops ``status``, found finished, as the newest transfer to ``remote_key`` unless a newer
        one joined meanwhile: a later transfer then has none to ask (a finished one holds no one
        back, and ``_after`` skips it anyway)."""
        with self._lock:
            if self._last.get(remote_key) is status:
                del self._last[remote_key]

    def forget(self, remote_key: str) -> None:
        """Drops the order towards ``remote_key`` (deregistered)."""
        with self._lock:
            self._last.pop(remote_key, None)


def wait_all(statuses: Sequence[TransferStatus], timeout_ms: float = -1) -> StatusCode:
    """Waits for every status, MORI's way: the first error code found wins; ``IN_PROGRESS`` when
    ``timeout_ms`` (< 0: no limit, 0: only look) ran out first; ``SUCCESS`` for an empty list."""
    if timeout_ms == 0:
        codes = [s.WaitFor(0) for s in statuses]
        for code in codes:
            if code not in (StatusCode.SUCCESS, StatusCode.IN_PROGRESS):
                return code
        return StatusCode.IN_PROGRESS if StatusCode.IN_PROGRESS in codes else StatusCode.SUCCESS
    deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000.0
    first_error: StatusCode = StatusCode.SUCCESS
    for status in statuses:
        left = -1.0 if deadline is None else (deadline - time.monotonic()) * 1000.0
        if deadline is not None and left <= 0:
            return first_error if first_error != StatusCode.SUCCESS else StatusCode.IN_PROGRESS
        code = status.WaitFor(left)
        if code == StatusCode.IN_PROGRESS:
            return first_error if first_error != StatusCode.SUCCESS else StatusCode.IN_PROGRESS
        if code != StatusCode.SUCCESS and first_error == StatusCode.SUCCESS:
            first_error = code
    return first_error
