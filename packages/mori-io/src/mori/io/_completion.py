"""What a backend's ``submit`` returns and a :class:`~mori.io.TransferStatus` reads: a transfer's
completion, one shape for every transport.

A completion answers three questions: its ``code()`` (a :class:`~mori.io.StatusCode` value,
``IN_PROGRESS`` until the transfer ends), its ``message()`` (why it failed, '' otherwise) and
``wait(timeout)`` (True once it has ended, False when ``timeout`` seconds passed first). The native
transfers of mori-core (:class:`mori.core.tcp.Transfer`, :class:`mori.core.ucx.UcxTransfer`) and
the NVLink backend's event-polled transfer are completions as they are; :class:`Outcome` is one
that ended when it was made (a refusal, nothing to copy), and :class:`Deferred` one that Python
code finishes later (a transfer waiting for its peer's first contact, a staged GPU transfer run
by a worker thread).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from mori.core.codes import TransferCode

__all__ = ["Completion", "Deferred", "Outcome"]

_IN_PROGRESS = int(TransferCode.IN_PROGRESS)


class Completion(Protocol):
    """A transfer's outcome as a :class:`~mori.io.TransferStatus` reads it (see the module)."""

    def code(self) -> int:
        """The status code; ``IN_PROGRESS`` until the transfer ends."""

    def message(self) -> str:
        """Why the transfer failed ('' on success or while it runs)."""

    def wait(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds; True once the transfer has ended."""


class Outcome:
    """A completion that ended when it was made: ``code`` (a final status code) and ``message``."""

    __slots__ = ("_code", "_message")

    def __init__(self, code: int, message: str = "") -> None:
        self._code = int(code)
        self._message = message

    def code(self) -> int:
        """The code it was made with."""
        return self._code

    def message(self) -> str:
        """The message it was made with."""
        return self._message

    def wait(self, timeout: float) -> bool:
        """True at once: it has ended."""
        return True

    def __repr__(self) -> str:
        return f"Outcome({self._code}, {self._message!r})"


class Deferred:
    """A completion that another thread settles once: with :meth:`finish` (an outcome) or
    :meth:`follow` (the completion, often native, that carries the transfer from then on).
    ``IN_PROGRESS`` until then."""

    __slots__ = ("_inner", "_settled")

    def __init__(self) -> None:
        self._inner: Completion | None = None
        self._settled = threading.Event()

    def follow(self, completion: Completion) -> None:
        """Reports what ``completion`` reports from now on (call once)."""
        self._inner = completion
        self._settled.set()

    def finish(self, code: int, message: str = "") -> None:
        """Ends with ``code`` and ``message`` (call once)."""
        self.follow(Outcome(code, message))

    def code(self) -> int:
        """``IN_PROGRESS`` until settled, then the settled completion's code."""
        inner = self._inner
        return _IN_PROGRESS if inner is None else inner.code()

    def message(self) -> str:
        """'' until settled, then the settled completion's message."""
        inner = self._inner
        return "" if inner is None else inner.message()

    def wait(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for it to be settled, then for what it follows."""
        deadline = time.monotonic() + timeout
        if not self._settled.wait(timeout):
            return False
        inner = self._inner
        assert inner is not None
        return inner.wait(max(deadline - time.monotonic(), 0.0))

    def __repr__(self) -> str:
        return f"Deferred({self._inner!r})"
