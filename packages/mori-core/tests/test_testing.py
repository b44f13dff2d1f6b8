"""mori.core.testing's ProcPool (environment, one-worker calls, failures with and without
keep_on_error) and CommandProcess (commands, their errors, close, timeouts)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from mori.core.testing import (
    CommandProcess,
    ProcPool,
    WorkerError,
    context,
    host_congestion_control,
    network_namespaces,
    serve_commands,
    start_in_netns,
)


def _env_and_index(name: str) -> tuple[int, str | None]:
    return context().index, os.environ.get(name)


def _fail_on_odd() -> int:
    if context().index % 2:
        raise KeyError(f"odd {context().index}")
    return context().index


def test_env_run_on_and_errors_that_keep_the_pool() -> None:
    with ProcPool(3, timeout=60, env={"MORI_TEST_MARK": "x"}, label="PE", keep_on_error=True) as pool:
        assert pool.run(_env_and_index, "MORI_TEST_MARK") == [(0, "x"), (1, "x"), (2, "x")]
        assert pool.run_on(2, _env_and_index, "MORI_TEST_MARK") == (2, "x")
        with pytest.raises(WorkerError) as info:
            pool.run(_fail_on_odd)
        assert list(info.value.failures) == [1] and "PE 1: KeyError: 'odd 1'" in str(info.value)
        assert pool.run_on(0, _fail_on_odd) == 0  # still open


def test_an_error_closes_the_pool_by_default() -> None:
    with ProcPool(2, timeout=60) as pool:
        with pytest.raises(WorkerError, match="process 1: KeyError"):
            pool.run(_fail_on_odd)
        with pytest.raises(RuntimeError, match="closed"):
            pool.run(_fail_on_odd)


def test_start_hook_and_pids() -> None:
    started: list[int | None] = []

    def start(proc) -> None:  # runs here, in the parent, in place of proc.start()
        proc.start()
        started.append(proc.pid)

    with ProcPool(2, timeout=60, start=start) as pool:
        assert pool.pids == started and len(set(started)) == 2
        assert pool.run(os.getpid) == started


def _counter_setup(start: int, closed_flag: str) -> int:
    """A CommandProcess setup: a counter, a buffer only ``keep`` holds, and a close that leaves a mark."""
    buf = bytearray(b"kept")
    state = {"n": start}

    def add(k: int) -> int:
        state["n"] += k
        return state["n"]

    def close() -> None:
        with open(closed_flag, "w") as f:
            f.write(str(state["n"]))

    def fail() -> None:
        raise ValueError("refused on purpose")

    serve_commands(
        {
            "add": add,
            "fail": fail,
            "close": close,
            "pid": os.getpid,
            "kept": lambda: bytes(context().state["keep"][0]),
            "sleep": time.sleep,
        },
        buf,
    )
    return start * 10


def test_command_process_calls_errors_and_close(tmp_path) -> None:
    flag = tmp_path / "closed"
    proc = CommandProcess(_counter_setup, (5, str(flag)), "target", timeout=30)
    try:
        assert proc.ready == 50 and proc.exitcode is None
        assert proc.call("add", 2) == 7 and proc.call("add", 3) == 10  # state lives across calls
        assert proc.call("pid") == proc.pid and proc.call("kept") == b"kept"
        with pytest.raises(RuntimeError, match="target fail failed: target 0: ValueError: refused on purpose"):
            proc.call("fail")
        with pytest.raises(RuntimeError, match=r"no command 'nope' \(this process serves \['add', "):
            proc.call("nope")
        assert proc.call("add", 1) == 11  # a command that raised leaves the process serving
    finally:
        proc.close()
    assert flag.read_text() == "11" and proc.exitcode == 0  # close ran the close command, then stopped


def test_command_process_timeout_kills_and_signal_after_death(tmp_path) -> None:
    proc = CommandProcess(_counter_setup, (0, str(tmp_path / "closed")), "slow", timeout=30)
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"slow \[0\] did not finish within 0.5 s"):
        proc.call("sleep", 60, timeout=0.5)
    assert time.monotonic() - t0 < 10 and proc.exitcode is not None  # killed, not waited for
    proc.signal(signal.SIGKILL)  # a no-op once it is gone
    proc.close()
    assert not (tmp_path / "closed").exists()


def _congestion_control(sock: Any) -> str:
    import socket

    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def _listen(host: str) -> int:
    """In namespace B: listens on ``host``, serves ``accepted`` (the congestion control of the
    next connection accepted); returns the port."""
    import socket

    listener = socket.create_server((host, 0))
    listener.settimeout(30)

    def accepted() -> str:
        conn, _ = listener.accept()
        with conn:
            return _congestion_control(conn)

    serve_commands({"accepted": accepted, "close": listener.close})
    return int(listener.getsockname()[1])


def _connect_to(host: str, port: int) -> str:
    import socket

    with socket.create_connection((host, port), timeout=30) as s:
        return _congestion_control(s)


def test_network_namespaces_talk_tcp_with_the_hosts_congestion_control() -> None:
    """Both ends of a connection between the namespaces (the connecting side's route and the
    accepting side's) run host_congestion_control's algorithm: CUBIC wherever the kernel has it."""
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        has_cubic = "cubic" in f.read().split()
    assert host_congestion_control() == ("cubic" if has_cubic else "")
    with network_namespaces("10.231.6") as (a, b):
        server = CommandProcess(_listen, (b.address,), "listener", 60, start=start_in_netns(b.name))
        client = ProcPool(1, timeout=60, start=start_in_netns(a.name))
        try:
            used = client.run_on(0, _connect_to, b.address, server.ready)
            accepted = server.call("accepted")
        finally:
            client.close()
            server.close()
    assert used == accepted
    if has_cubic:
        assert used == "cubic"


def test_network_namespaces_pass_over_names_that_are_taken_and_remove_only_their_own(monkeypatch) -> None:
    """A namespace of the first tag's name exists already (another test's, or one a killed run
    left): the pair takes the next tag, and on exit removes its own namespaces only."""
    import subprocess

    from mori.core import testing

    tags = iter([7, 7, 8])
    monkeypatch.setattr(testing.random, "randrange", lambda n: next(tags))
    taken = f"mori_c{os.getpid() % 100000}x7a"
    subprocess.run(["ip", "netns", "add", taken], check=True, timeout=30)
    try:
        with network_namespaces("10.231.7") as (a, b):
            assert (a.name, b.name) == (f"mori_c{os.getpid() % 100000}x8a", f"mori_c{os.getpid() % 100000}x8b")
        assert os.path.exists(f"/run/netns/{taken}")
        assert not os.path.exists(f"/run/netns/{a.name}") and not os.path.exists(f"/run/netns/{b.name}")
    finally:
        subprocess.run(["ip", "netns", "del", taken], timeout=30)
