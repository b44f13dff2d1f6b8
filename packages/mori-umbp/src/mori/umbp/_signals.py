"""A server process's main thread waiting for SIGINT or SIGTERM (the standalone server, the master)."""

from __future__ import annotations

import signal
import time

__all__ = ["StopSignals"]


class StopSignals:
    """Catches SIGINT and SIGTERM from construction on; :meth:`wait` returns once one came.

    The handler only records the signal. It runs in the main thread between two of its bytecodes,
    possibly while that thread holds a lock (a ``threading.Event``'s, inside its ``wait``), so a
    handler that took one could deadlock the process. And a signal the kernel hands to another
    thread (gRPC's, a pool's) does not interrupt a blocking wait of the main thread, whose handler
    then never runs: the main thread looks every ``poll_s`` instead of blocking.
    """

    def __init__(self) -> None:
        self._caught: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: self._caught.append(signum))

    def wait(self, poll_s: float = 0.2) -> int:
        """Blocks until SIGINT or SIGTERM came (at most ``poll_s`` after it); returns its number."""
        while not self._caught:
            time.sleep(poll_s)
        return self._caught[0]
