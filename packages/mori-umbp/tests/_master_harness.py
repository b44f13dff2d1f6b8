"""A UMBP master in its own process (the ``mori-umbp-master`` console script), a Redis server of
its own (Debian's ``redis-server``, on a free port in a temporary directory), and a scrape of the
master's metrics. Every wait here is bounded.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

#: How long a master or a Redis server may take to come up on a loaded 2-core machine.
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def master_command() -> list[str]:
    """The console script beside this interpreter (``.venv/bin/mori-umbp-master``)."""
    script = Path(sys.executable).with_name("mori-umbp-master")
    if not script.exists():
        raise RuntimeError(f"{script} is missing: install mori-umbp with its master and redis extras (ci/setup.sh)")
    return [str(script)]


class MasterProcess:
    """``mori-umbp-master LISTEN METRICS_PORT`` with ``env`` added to the environment (``listen``
    ``127.0.0.1:0`` unless given: a free port on loopback)."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        metrics_port: int | None = None,
        command: list[str] | None = None,
        listen: str = "127.0.0.1:0",
    ) -> None:
        self.listen = listen
        self._pick_metrics_port = metrics_port is None  # a free port, picked again if taken meanwhile
        self.metrics_port = free_port() if metrics_port is None else metrics_port
        self.env = {**os.environ, **(env or {})}
        self.command = command or master_command()
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.log: collections.deque[str] = collections.deque(maxlen=10000)
        self._ready = threading.Event()

    def start(self) -> MasterProcess:
        # A metrics port found free can be taken by another process (a test lane beside this one)
        # before the master binds it: then the master exits at once saying so, and is started again
        # on another free port.
        for _ in range(5):
            self._ready.clear()
            self.proc = subprocess.Popen(
                [*self.command, self.listen, str(self.metrics_port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=self.env,
            )
            # One thread reads everything the master prints, for as long as it runs: the line with
            # its address, and the rest, so that a full pipe never blocks the master.
            threading.Thread(target=self._read, daemon=True).start()
            if self._ready.wait(START_TIMEOUT_S) and self.address:
                return self
            self.kill()
            if not (self._pick_metrics_port and "Address already in use" in "".join(self.log)):
                break
            self.log.clear()
            self.metrics_port = free_port()
        raise RuntimeError(f"the master did not start within {START_TIMEOUT_S} s:\n{''.join(self.log)}")

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("[Master] Listening on ") and not self.address:
                self.address = line.split()[3]
                self._ready.set()
        self._ready.set()  # it exited

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics``: (name, sorted labels) -> value."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def kill(self) -> None:
        """SIGKILL: a master that dies without a word."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM, then the exit status (the master exits cleanly on it)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                raise
        return int(self.proc.returncode)


@contextlib.contextmanager
def running_master(env: Mapping[str, str] | None = None) -> Iterator[MasterProcess]:
    master = MasterProcess(env).start()
    try:
        yield master
    finally:
        master.kill()


@contextlib.contextmanager
def redis_server(tmp_path: Path, port: int | None = None) -> Iterator[str]:
    """A fresh ``redis-server`` on ``port`` (default: a free one) with its files under
    ``tmp_path``; yields its ``tcp://`` URI (the form ``UMBP_REDIS_URI`` takes) and stops it
    afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is missing: ci/setup.sh installs Debian's redis-server")
    port = free_port() if port is None else port
    data = tmp_path / f"redis-{port}"
    data.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not answer within {START_TIMEOUT_S} s")
            time.sleep(0.05)
        yield f"tcp://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):  # type: ignore[no-untyped-def]
    """Polls ``predicate`` until it returns something true; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true within {timeout_s} s")
        time.sleep(interval_s)
