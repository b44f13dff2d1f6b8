"""The servers' main threads wait for SIGINT/SIGTERM with mori.umbp._signals.StopSignals: a signal
the kernel hands to another thread of the process (gRPC's, a pool's) still stops the server. A
main thread blocked on a threading.Event, woken by a handler that sets it, never woke in that
case: the standalone server once outlived its SIGTERM in CI."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

# A process whose main thread waits while one of its other threads receives the signal.
_WAITER = """
import signal, sys, threading, time
from mori.umbp._signals import StopSignals

signals = StopSignals()
def other_thread():
    time.sleep(0.2)
    signal.pthread_kill(threading.get_ident(), int(sys.argv[1]))  # to this thread, not the main one
    time.sleep(60)
threading.Thread(target=other_thread, daemon=True).start()
print("caught", signals.wait(), flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_another_thread_stops_the_wait(sig: signal.Signals) -> None:
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", _WAITER, str(int(sig))], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert out.split() == ["caught", str(int(sig))]
    assert time.monotonic() - started < 20  # not the 60 s the other thread sleeps
