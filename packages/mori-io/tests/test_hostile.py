"""mori-io under hostile load (issue 11): each test reproduces one numbered hole of the issue and
checks that it is closed. Targets run in their own processes with lowered limits (``MORI_IO_*``
set before they start) so every case takes seconds; the data plane's own cases are in
mori-core's ``test_tcp_limits.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
from _hostile import REGION, good_write

from mori.core import tcp as _tcp
from mori.core.testing import connect_many
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
)
from mori.io._control import ControlClient, ControlError, encode_frame
from mori.io._registry import MAX_NOTIFY_BATCH, check_notify, notify_bodies
from mori.io.backends.tcp import TcpBackend


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _hello(s: socket.socket, key: str = "raw", token: str = "") -> None:
    s.sendall(encode_frame({"op": "hello", "key": key, "token": token}))
    (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
    assert msgpack.unpackb(s.recv(n, socket.MSG_WAITALL))["ok"]


@pytest.mark.quiet  # what the target did within a fraction of a second
def test_control_plane_survives_fd_exhaustion(make_target):
    # Hole 1: with its descriptors used up by silent connections, the control plane's accept
    # loop used to die for good; now it backs off and serves again once they close.
    target = make_target()
    target.call("limit_fds", 24)
    socks = connect_many(target.desc.port, 150)
    time.sleep(1.0)
    assert target.call("probe")["accept_errors"] > 0
    for s in socks:
        s.close()
    time.sleep(0.5)
    good_write(target, 5)


@pytest.mark.quiet  # what the target did within a fraction of a second
def test_control_plane_bounds_handshakes_idlers_and_buffers(make_target):
    # Hole 3: threads, time and bytes that unauthenticated or idle peers hold are bounded.
    target = make_target(
        {
            "MORI_IO_MAX_HANDSHAKES": "4",
            "MORI_IO_HELLO_TIMEOUT": "1",
            "MORI_IO_MAX_CONNECTIONS": "40",
            "MORI_IO_IDLE_TIMEOUT": "1.5",
            "MORI_IO_CONTROL_BUFFER": "1M",
        }
    )
    base = target.call("probe")["threads"]
    silent = connect_many(target.desc.port, 200)
    time.sleep(0.5)
    probe = target.call("probe")
    assert probe["threads"] <= base + 6 and probe["conns"] <= 40, probe
    assert probe["refused"] + probe["evicted"] >= 150
    good_write(target, 6)  # a newcomer's hello pushes the oldest silent one out
    for s in silent:
        assert _closed_within(s, 3.0)
    # A hello trickled a byte at a time is cut at the hello timeout, however often bytes come.
    trickle = socket.create_connection(("127.0.0.1", target.desc.port), timeout=5)
    t0 = time.monotonic()
    with pytest.raises(OSError):
        for b in encode_frame({"op": "hello", "key": "k" * 100, "token": ""}):
            trickle.send(bytes([b]))
            time.sleep(0.2)
    assert time.monotonic() - t0 < 5.0  # byte by byte the hello would take 25 s
    # An authenticated connection that stays silent is closed after the idle timeout.
    idle = socket.create_connection(("127.0.0.1", target.desc.port), timeout=5)
    _hello(idle)
    assert _closed_within(idle, 4.0)
    # Frames being received share one budget: a second 900 KB frame in flight is refused.
    first, second = (socket.create_connection(("127.0.0.1", target.desc.port), timeout=5) for _ in range(2))
    for s in (first, second):
        _hello(s)
        s.sendall(struct.pack(">I", 900_000) + b"\x00" * 1000)
        time.sleep(0.2)
    assert _closed_within(second, 2.0) and not _closed_within(first, 0.3)
    for s in (first, second, trickle):
        s.close()


def _notify(client: ControlClient, uids: list, codes: list, messages: list | None = None) -> None:
    client.request(
        "notify", {"uids": uids, "codes": codes, "messages": [""] * len(uids) if messages is None else messages}
    )


def test_notifications_bounded_and_checked(make_target):
    # Hole 4: completion records are bounded (oldest dropped), and a forged code is refused
    # instead of making pop_inbound_transfer_status raise later.
    target = make_target({"MORI_IO_MAX_INBOUND_RECORDS": "50"})
    client = ControlClient("127.0.0.1", target.desc.port, "flooder", "", 10)
    for first in range(0, 200, 20):
        _notify(client, list(range(first, first + 20)), [0] * 20)
    for uid, code, message in (
        (1, 99, ""),
        (-1, 0, ""),
        (-(2**63), 0, ""),
        (True, 0, ""),
        (1, 2, ""),
        (1, 0, "x" * 5000),
        (1, 0, None),
        (1.0, 0, ""),
    ):
        with pytest.raises(ControlError) as err:
            _notify(client, [uid], [code], [message])
        assert err.value.code == StatusCode.ERR_INVALID_ARGS
    client.close()
    assert target.call("probe")["inbound"] == 50
    assert target.call("pop_inbound", "flooder", 0, 0) is None  # the oldest went first
    assert target.call("pop_inbound", "flooder", 199, 0) == StatusCode.SUCCESS


def test_every_channel_writes_one_bounded_table(make_target):
    # Issue 20: the TCP data plane's in-band records (written natively, no Python per record) and
    # the control plane's notify records go to the engine's one table, under its one bound.
    target = make_target({"MORI_IO_MAX_INBOUND_RECORDS": "50"})
    src = np.arange(64, dtype=np.uint8)
    with IOEngine("writer", IOEngineConfig()) as eng:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        # One write at a time, so that the target records them in uid order and the oldest are
        # known: writes in flight together may be recorded in any order (seen on a busy CPU).
        for uid in range(30):
            assert eng.write(ld, 0, target.region, 64 * uid, 64, uid).WaitFor(10_000) == StatusCode.SUCCESS
        assert target.call("probe")["inbound"] == 30  # recorded before each write finished
        client = ControlClient("127.0.0.1", target.desc.port, "notifier", "", 10)
        _notify(client, list(range(40)), [int(StatusCode.ERR_NOT_FOUND)] * 40, ["from the control plane"] * 40)
        client.close()
        assert target.call("probe")["inbound"] == 50  # 70 records, one bound: the 20 oldest went
        assert target.call("pop_inbound", "writer", 19, 0) is None
        assert target.call("pop_inbound", "writer", 20, 0) == StatusCode.SUCCESS
        assert target.call("pop_inbound", "notifier", 0, 0) == StatusCode.ERR_NOT_FOUND
    assert target.call("bytes", 0, 64 * 30) == src.tobytes() * 30


def test_malformed_notify_batch_records_nothing(make_target):
    # A batch is checked whole before any record is kept: one bad record, lists of different
    # lengths, or not lists at all, and none of the batch's records is recorded.
    target = make_target()
    client = ControlClient("127.0.0.1", target.desc.port, "forger", "", 10)
    for body in (
        {"uids": [1, 2, 3], "codes": [0, 0, 99], "messages": ["", "", ""]},
        {"uids": [1, 2, 3], "codes": [0, 0, 0], "messages": ["", "", "x" * 5000]},
        {"uids": [1, 2, -5], "codes": [0, 0, 0], "messages": ["", "", ""]},
        {"uids": [1, 2], "codes": [0, 0, 0], "messages": ["", "", ""]},
        {"uids": [1, 2], "codes": [0, 0]},
        {"uids": 1, "codes": 0, "messages": ""},
        {"uid": 1, "code": 0},
    ):  # a single record is a batch of one, not this form
        with pytest.raises(ControlError) as err:
            client.request("notify", body)
        assert err.value.code == StatusCode.ERR_INVALID_ARGS and "notif" in str(err.value), err.value
    assert target.call("probe")["inbound"] == 0
    for uid in (1, 2, 3):
        assert target.call("pop_inbound", "forger", uid, 0) is None
    # The engine still serves the same connection.
    _notify(client, [1, 2, 3], [0, 0, 0])
    client.close()
    assert [target.call("pop_inbound", "forger", uid, 0) for uid in (1, 2, 3)] == [StatusCode.SUCCESS] * 3


def test_over_long_notify_batch_is_refused(make_target):
    target = make_target()
    client = ControlClient("127.0.0.1", target.desc.port, "flooder", "", 10)
    n = MAX_NOTIFY_BATCH + 1
    with pytest.raises(ControlError) as err:
        _notify(client, list(range(n)), [0] * n)
    assert err.value.code == StatusCode.ERR_INVALID_ARGS and f"at most {MAX_NOTIFY_BATCH}" in str(err.value)
    assert target.call("probe")["inbound"] == 0
    _notify(client, list(range(MAX_NOTIFY_BATCH)), [0] * MAX_NOTIFY_BATCH)  # the bound itself is allowed
    client.close()
    assert target.call("probe")["inbound"] == MAX_NOTIFY_BATCH
    assert target.call("pop_inbound", "flooder", MAX_NOTIFY_BATCH - 1, 0) == StatusCode.SUCCESS


def test_send_completions_delivers_any_batch_in_requests_a_target_accepts(make_target):
    # BackendContext.send_completions (what NVLink and TCP GPU staging report with) cuts a batch
    # into requests within the bound and the control frame, and never raises.
    target = make_target()
    long = "\u00e9\U0001f600" * 3000  # 6000 characters, up to 4 UTF-8 bytes each: cut to 4096
    records = [
        (uid, StatusCode.SUCCESS if uid % 3 else StatusCode.ERR_BAD_STATE, long if uid % 7 == 0 else f"m{uid}")
        for uid in range(2 * MAX_NOTIFY_BATCH + 5)
    ]
    bodies = list(notify_bodies(records))
    assert len(bodies) >= 3 and all(len(b["uids"]) <= MAX_NOTIFY_BATCH for b in bodies)
    for body in bodies:
        encode_frame({"op": "notify", "id": 1, "body": body})  # fits a control frame (raises if not)
    assert [r for b in bodies for r in check_notify(b)] == [(u, c, m[:4096]) for u, c, m in records]
    with IOEngine("sender", IOEngineConfig()) as eng:
        eng.register_remote_engine(target.desc)
        eng._ctx.send_completions("target", records)
        eng._ctx.send_completions("nobody", records[:3])  # not registered: logged, not raised
    assert target.call("probe")["inbound"] == len(records)
    for uid in (0, 7, 8, len(records) - 1):
        assert target.call("pop_inbound", "sender", uid, 0) == records[uid][1]


@pytest.mark.parametrize("uid", [-1, 2**64, 2**70])
def test_out_of_range_uid_fails_at_once(pair, uid):
    # Hole 5: such a uid used to leave the transfer IN_PROGRESS forever.
    target, engine, _, ld = pair
    st = engine.write(ld, 0, target.region, 0, 64, uid)
    assert not st.InProgress() and st.Code() == StatusCode.ERR_INVALID_ARGS and "uid" in st.Message()
    with pytest.raises(TypeError, match="uid"):
        engine.write(ld, 0, target.region, 0, 64, True)


def test_failure_on_the_connecting_thread_ends_the_transfer(make_target, monkeypatch):
    # Hole 5: any exception while starting a transfer after connecting finishes it.
    target = make_target()

    def broken_start(self, peer, request):
        raise RuntimeError("injected")

    monkeypatch.setattr(TcpBackend, "_start", broken_start)
    src = np.zeros(64, dtype=np.uint8)
    with IOEngine("unlucky", IOEngineConfig()) as eng:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(src.ctypes.data), 64, -1, MemoryLocationType.CPU)
        st = eng.write(ld, 0, target.region, 0, 64, 1)
        assert (
            st.WaitFor(10_000) != StatusCode.IN_PROGRESS
            and st.Code() == StatusCode.ERR_BAD_STATE
            and "injected" in st.Message()
        )


def test_local_descriptor_must_match_a_live_registration(pair):
    # Hole 6: forged or stale local descriptors and wrongly typed offsets move nothing.
    target, engine, src, ld = pair
    before = target.call("bytes", 0, 4096)
    for forged in (dataclasses.replace(ld, size=ld.size * 4), dataclasses.replace(ld, data=ld.data + 4096)):
        st = engine.write(forged, ld.size - 64, target.region, 0, 64, 2)
        assert st.Code() == StatusCode.ERR_INVALID_ARGS and "does not match" in st.Message()
    with IOEngine("hostile-init-2", IOEngineConfig()) as other:
        stale = other.register_memory(ld.data, 64, -1, MemoryLocationType.CPU)
    with IOEngine("hostile-init-2", IOEngineConfig()) as reborn:  # same key, the id is reused
        reborn.create_backend(BackendType.TCP)
        reborn.register_remote_engine(target.desc)
        buf = np.zeros(128, dtype=np.uint8)
        fresh = reborn.register_memory(int(buf.ctypes.data), 128, -1, MemoryLocationType.CPU)
        assert fresh.id == stale.id
        st = reborn.write(stale, 0, target.region, 0, 64, 3)
        assert st.Code() == StatusCode.ERR_INVALID_ARGS
    for bad in ({0: 0}, {0}, [True], "0", [0] * 99 + [True]):  # 100 blocks: the native conversion
        with pytest.raises(TypeError):
            engine.batch_write(ld, bad, target.region, [0] * len(bad), [8] * len(bad), 4)
    with pytest.raises(TypeError):
        engine.write(ld, False, target.region, 0, 8, 5)
    assert target.call("bytes", 0, 4096) == before


def test_deregister_memory_waits_for_transfers_on_it(make_target):
    # Hole 6: deregister_memory used to return while a read was still landing in the region.
    target = make_target()
    dst = np.zeros(REGION, dtype=np.uint8)
    with IOEngine("reader", IOEngineConfig()) as eng:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(dst.ctypes.data), REGION, -1, MemoryLocationType.CPU)
        warm = eng.read(ld, 0, target.region, 0, 64, 1)
        assert warm.WaitFor(10_000) != StatusCode.IN_PROGRESS and warm.Succeeded()
        statuses = [eng.read(ld, 0, target.region, 0, REGION, uid) for uid in range(2, 34)]  # 32 MiB
        eng.deregister_memory(ld)
        assert not any(st.InProgress() for st in statuses), "deregister_memory returned while reads ran"
        snapshot = dst.copy()
        time.sleep(0.3)
        assert np.array_equal(dst, snapshot)
        late = eng.read(ld, 0, target.region, 0, 64, 40)
        assert late.Code() == StatusCode.ERR_NOT_FOUND


def test_unreachable_peer_does_not_delay_others(make_target, monkeypatch):
    # Hole 7: while a connect to a peer that never answers waits out its timeout, a healthy
    # peer's first transfer goes ahead at once.
    monkeypatch.setenv("MORI_IO_TIMEOUT", "4")
    target = make_target()
    black_hole = socket.create_server(("127.0.0.1", 0))  # accepts into the backlog, never answers
    try:
        with IOEngine("hol", IOEngineConfig()) as eng:
            eng.create_backend(BackendType.TCP)
            stuck_desc = EngineDesc("stuck", "127.0.0.1", black_hole.getsockname()[1])
            eng.register_remote_engine(stuck_desc)
            eng.register_remote_engine(target.desc)
            src = np.full(4096, 8, dtype=np.uint8)
            ld = eng.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
            stuck_region = dataclasses.replace(target.region, engine_key="stuck")
            stuck = eng.write(ld, 0, stuck_region, 0, 64, 1)
            time.sleep(0.2)
            st = eng.write(ld, 0, target.region, 0, 4096, 2)
            assert st.WaitFor(10_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st
            assert stuck.InProgress()  # the healthy peer did not wait for the stuck connect
            assert stuck.WaitFor(15_000) != StatusCode.IN_PROGRESS and stuck.Code() != StatusCode.SUCCESS
    finally:
        black_hole.close()


def test_data_plane_key_needs_the_control_session(pair):
    # Hole 8: a token holder claiming another engine's key on the data plane is refused; the
    # ticket a control session gets admits only that session's own key.
    target, engine, _, _ = pair
    client = ControlClient("127.0.0.1", target.desc.port, "mallory", "", 10)
    info = client.request("tcp.info", {})
    client.close()
    with pytest.raises(RuntimeError, match="rejected"):
        _tcp.Peer("t", "127.0.0.1", info["port"], 1, "hostile-init", "", info["ticket"], 5.0)
    with pytest.raises(RuntimeError, match="rejected"):
        _tcp.Peer("t", "127.0.0.1", info["port"], 1, "hostile-init", "", "", 5.0)
    _tcp.Peer("t", "127.0.0.1", info["port"], 1, "mallory", "", info["ticket"], 5.0).close()


def test_good_peer_keeps_working_during_attack(make_target):
    # The hostile mix at once (silent connections on both planes, a trickler) while a peer that
    # already has its connections keeps transferring.
    target = make_target({"MORI_IO_MAX_HANDSHAKES": "8", "MORI_IO_HELLO_TIMEOUT": "2"})
    src = np.full(4096, 4, dtype=np.uint8)
    with IOEngine("steady", IOEngineConfig()) as eng:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        assert (
            eng.write(ld, 0, target.region, 0, 4096, 1).WaitFor(10_000) != StatusCode.IN_PROGRESS
        )  # connected from now on
        stop = threading.Event()
        held: list[socket.socket] = []

        def attack():
            while not stop.is_set():
                held.extend(connect_many(target.desc.port, 20))
                time.sleep(0.05)

        th = threading.Thread(target=attack, daemon=True)
        th.start()
        try:
            for uid in range(2, 200):
                st = eng.write(ld, 0, target.region, 0, 4096, uid)
                assert st.WaitFor(5_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st
        finally:
            stop.set()
            th.join(timeout=10)
            for s in held:
                s.close()


def test_nvlink_fd_server_is_not_held_up_by_silent_connections(tmp_path):
    # The NVLink backend's descriptor server: a local process that connects and says nothing
    # holds it a second at most; a peer with a valid nonce then gets its descriptor.
    from mori.io.backends.nvlink._peer_memory import FdServer, fetch_fd

    server = FdServer(ttl=30.0)
    path = tmp_path / "region"
    path.write_bytes(b"mori")
    fd = os.open(path, os.O_RDONLY)
    silent = []
    try:
        nonce = server.grant(fd)
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(server.address)
            silent.append(s)
        got = fetch_fd(server.address, nonce, timeout=10)
        assert os.pread(got, 4, 0) == b"mori"
        os.close(got)
        with pytest.raises(ConnectionError):  # single use
            fetch_fd(server.address, nonce, timeout=10)
    finally:
        for s in silent:
            s.close()
        os.close(fd)
        server.close()


class _TricklingTarget:
    """A fake engine whose data plane answers a read and then sends its bytes one every 50 ms:
    the transfer never times out (data keeps coming) and never ends by itself."""

    def __init__(self) -> None:
        import logging

        from mori.io._control import ControlServer
        from mori.io._limits import Limits

        self._data = socket.create_server(("127.0.0.1", 0))
        self.control = ControlServer("127.0.0.1", 0, "", Limits.from_config(), logging.getLogger("fake"))
        port = self._data.getsockname()[1]
        self.control.handlers["tcp.info"] = lambda key, body: {"port": port, "staging_chunk": 4 << 20, "ticket": "t"}
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._data.accept()
        with conn:
            magic, _, key_len, token_len, ticket_len = struct.unpack("<IHHHH", conn.recv(12, socket.MSG_WAITALL))
            conn.recv(key_len + token_len + ticket_len, socket.MSG_WAITALL)
            conn.sendall(struct.pack("<Ii", magic, 0))
            _, op, _, _, _, size = struct.unpack("<IBB2xQQQ", conn.recv(32, socket.MSG_WAITALL))
            conn.sendall(struct.pack("<IiQ", 0x5045524D, 0, size))
            with contextlib.suppress(OSError):
                for _ in range(size):
                    if self._stop.is_set():
                        return
                    conn.sendall(b"\x07")
                    time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self.control.close()
        self._data.close()


def test_deregister_memory_fails_transfers_that_outlive_the_timeout(monkeypatch):
    # Hole 6: a read that keeps receiving (slowly) past MORI_IO_TIMEOUT is failed by
    # deregister_memory, which returns once nothing writes into the region any more.
    monkeypatch.setenv("MORI_IO_TIMEOUT", "2")
    fake = _TricklingTarget()
    dst = np.zeros(1 << 16, dtype=np.uint8)
    try:
        with IOEngine("victim", IOEngineConfig()) as eng:
            eng.create_backend(BackendType.TCP)
            eng.register_remote_engine(EngineDesc("fake", "127.0.0.1", fake.control.port))
            ld = eng.register_memory(int(dst.ctypes.data), dst.size, -1, MemoryLocationType.CPU)
            remote = MemoryDesc("fake", 1, 1 << 20, dst.size)
            st = eng.read(ld, 0, remote, 0, dst.size, 1)
            deadline = time.monotonic() + 10
            while not dst.any() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert dst.any() and st.InProgress()  # bytes are landing, slowly
            t0 = time.monotonic()
            eng.deregister_memory(ld)
            took = time.monotonic() - t0
            assert st.Code() == StatusCode.ERR_BAD_STATE, st
            snapshot = dst.copy()
            time.sleep(0.3)
            assert np.array_equal(dst, snapshot), "bytes landed after deregister_memory returned"
            assert 1.5 < took < 10, took  # it waited the timeout (2 s), then failed the transfer
    finally:
        fake.close()
