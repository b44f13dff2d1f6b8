"""mori-io under hostile peers (issue 23, item 4): transfers with descriptors that cannot travel
or a backend that raises, a slow reader while the target deregisters, and engine keys claimed by
another engine. Targets run in their own processes (``_hostile.Target``) with lowered limits."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import threading
import time

import numpy as np
import pytest
from _hostile import good_write

from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TransferStatus,
)
from mori.io._control import ControlClient, ControlError
from mori.io._keys import KeyBindings
from mori.io.backends.tcp import TcpBackend


@pytest.mark.parametrize(
    "forged", [{"id": -1}, {"id": 2**64}, {"size": 2**65}, {"data": -1}, {"data": 2**64 - 8, "size": 64}, {"id": 1.0}]
)
def test_unencodable_remote_descriptor_fails_without_wedging_the_peer(pair, forged):
    # Issue 23: a remote descriptor whose id or offset does not fit 64 bits made read() raise
    # TypeError after the transfer had joined the peer's completion order, so every later
    # transfer and session to that peer stayed IN_PROGRESS.
    target, engine, src, ld = pair
    warm = engine.write(ld, 0, target.region, 0, 64, 10)  # connected: the next submit goes straight to the peer
    assert warm.WaitFor(10_000) == StatusCode.SUCCESS, warm
    bad = dataclasses.replace(target.region, **forged)
    offset = 2**64 if forged.get("size") == 2**65 else 0  # an offset past 64 bits, inside the forged size
    st = engine.read(ld, 0, bad, offset, 64, 11)
    assert st.Code() == StatusCode.ERR_INVALID_ARGS and "remote memory descriptor" in st.Message(), st
    assert engine.create_session(ld, bad) is None
    later = engine.write(ld, 64, target.region, 64, 64, 12)
    assert later.WaitFor(10_000) == StatusCode.SUCCESS, later
    session = engine.create_session(ld, target.region)
    assert session is not None and session.write(128, 128, 64, 13).WaitFor(10_000) == StatusCode.SUCCESS
    assert target.call("bytes", 0, 192) == bytes(src[:192])


def test_backend_raising_after_queuing_does_not_wedge_the_order(make_target, monkeypatch):
    # Issue 23: whatever fails between joining the completion order and posting finishes the
    # transfer, so the peer's later transfers, Wait() and deregister_memory are not held up.
    monkeypatch.setenv("MORI_IO_TIMEOUT", "5")
    target = make_target()
    src = np.full(4096, 9, dtype=np.uint8)
    real_submit = TcpBackend.submit
    calls = []

    def flaky_submit(self, request):
        calls.append(request.uid)
        if len(calls) == 2:
            raise OverflowError("injected")
        if len(calls) == 4:
            return None  # no completion: a backend breaking its contract
        return real_submit(self, request)

    monkeypatch.setattr(TcpBackend, "submit", flaky_submit)
    monkeypatch.setattr(TcpBackend, "lane", lambda self, local, remote: None)  # every write through submit
    with IOEngine("flaky", IOEngineConfig()) as eng:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        assert eng.write(ld, 0, target.region, 0, 64, 1).WaitFor(10_000) == StatusCode.SUCCESS
        broken = eng.write(ld, 0, target.region, 0, 64, 2)
        assert broken.Code() == StatusCode.ERR_BAD_STATE and "injected" in broken.Message(), broken
        after = eng.write(ld, 0, target.region, 0, 4096, 3)
        assert after.WaitFor(10_000) == StatusCode.SUCCESS, after
        lost = eng.write(ld, 0, target.region, 0, 64, 4)
        assert lost.Code() == StatusCode.ERR_BAD_STATE and "returned no completion" in lost.Message(), lost
        after = eng.write(ld, 0, target.region, 0, 4096, 5)
        assert after.WaitFor(10_000) == StatusCode.SUCCESS, after
        t0 = time.monotonic()
        eng.deregister_memory(ld)
        assert time.monotonic() - t0 < 4.0  # nothing left in flight: no wait for MORI_IO_TIMEOUT (5 s)
    assert target.call("bytes", 0, 4096) == bytes(src)


def _data_session(control_port: int, key: str, rcvbuf: int = 0) -> socket.socket:
    """A hand-made data connection of a token holder named ``key`` (ticket from tcp.info)."""
    client = ControlClient("127.0.0.1", control_port, key, "", 10)
    info = client.request("tcp.info", {})
    client.close()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", info["port"]))
    ticket = info["ticket"].encode()
    s.sendall(struct.pack("<IHHHH", 0x4F49524D, 3, len(key), 0, len(ticket)) + key.encode() + ticket)
    assert struct.unpack("<Ii", s.recv(8, socket.MSG_WAITALL))[1] == 0
    return s


def test_slow_reader_cannot_hold_deregister_memory_or_stall_other_peers(make_target, monkeypatch):
    # Issue 23: a token holder reading 64 MiB at 256 KiB/s held the target's deregister_memory
    # until it disconnected, and every other peer's requests (any region) waited meanwhile. Now
    # the deregistration waits MORI_IO_TIMEOUT (2 s here), cuts the slow reader and returns, no
    # byte of the region is touched afterwards (the target unmaps it at once), and an unrelated
    # peer's reads of another region all succeed throughout.
    monkeypatch.setenv("MORI_IO_TIMEOUT", "2")
    target = make_target({"MORI_IO_TIMEOUT": "2"})
    big = MemoryDesc.unpack(target.call("add_region", 64 << 20))
    slow = _data_session(target.desc.port, "slow-reader", rcvbuf=64 << 10)
    slow.sendall(struct.pack("<IBB2xQQQ", 0x5145524D, 1, 0, big.id, 0, big.size))  # one read of 64 MiB
    received, ended = [0], threading.Event()

    def read_slowly():  # 64 KiB every 0.25 s: 256 KiB/s, steady, so no send on the target times out
        stop = time.monotonic() + 20
        with contextlib.suppress(OSError):
            while time.monotonic() < stop:
                chunk = slow.recv(64 << 10)
                if not chunk:
                    break
                received[0] += len(chunk)
                time.sleep(0.25)
        ended.set()

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    dst = np.zeros(4096, dtype=np.uint8)
    with IOEngine("bystander", IOEngineConfig()) as eng:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(dst.ctypes.data), dst.size, -1, MemoryLocationType.CPU)
        assert eng.read(ld, 0, target.region, 0, 4096, 1).WaitFor(10_000) == StatusCode.SUCCESS
        deadline = time.monotonic() + 10
        while received[0] < 256 << 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert received[0] >= 256 << 10 and not ended.is_set()  # the slow read is under way
        outcomes: list[StatusCode] = []

        def bystander():  # 12 reads of another region while the target deregisters
            for uid in range(2, 14):
                outcomes.append(eng.read(ld, 0, target.region, 0, 4096, uid).WaitFor(10_000))
                time.sleep(0.25)

        th = threading.Thread(target=bystander, daemon=True)
        th.start()
        took = target.call("drop_region", big.id)
        th.join(timeout=60)
    assert took < 6.0, f"deregister_memory took {took:.1f} s with MORI_IO_TIMEOUT=2"
    assert ended.wait(10), "the slow reader was not cut"
    reader.join(timeout=10)
    slow.close()
    assert received[0] < big.size
    assert outcomes == [StatusCode.SUCCESS] * 12, outcomes
    assert target.exitcode is None and target.call("probe")["conns"] >= 0  # alive after the unmap
    good_write(target, 3)


def test_a_key_is_bound_to_the_engine_that_proved_it(make_target):
    # Issue 23: any token holder could claim another engine's key in its control hello, and so
    # take that key's data-plane ticket, read as that engine and plant completion records in its
    # name. Now the target binds the key to the first engine that proves it and refuses another
    # claimant while that engine lives, connected or not; once it is gone the key is free again.
    target = make_target({"MORI_IO_IDLE_TIMEOUT": "1"})
    src = np.full(4096, 0x33, dtype=np.uint8)

    def write_as(eng: IOEngine, uid: int) -> TransferStatus:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        st = eng.write(ld, 0, target.region, 0, 4096, uid)
        st.WaitFor(15_000)
        return st

    def impostor_refused() -> None:
        for guess in ({}, {"proof": "0" * 64}):  # no proof, a wrong one
            with pytest.raises(ControlError, match="held by another engine") as err:
                ControlClient("127.0.0.1", target.desc.port, "victim", "", 10, **guess)
            assert err.value.code == StatusCode.ERR_BAD_STATE

    with IOEngine("victim", IOEngineConfig()) as victim:
        assert write_as(victim, 1).Succeeded()
        impostor_refused()  # the victim holds a control connection: it lives
        with IOEngine("victim", IOEngineConfig()) as twin:  # same key, its own secret
            st = write_as(twin, 2)
            assert st.Code() == StatusCode.ERR_BAD_STATE and "held by another engine" in st.Message(), st
        deadline = time.monotonic() + 10
        while target.call("probe")["conns"] > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert target.call("probe")["conns"] == 0  # its control connection idled out...
        impostor_refused()  # ...and it still lives: it answered the target's challenge
        assert target.call("pop_inbound", "victim", 2, 0) is None  # the twin recorded nothing
        st = victim.write(
            victim.register_memory(int(src.ctypes.data), 64, -1, MemoryLocationType.CPU), 0, target.region, 0, 64, 3
        )
        assert st.WaitFor(15_000) == StatusCode.SUCCESS, st  # the holder is not harmed
    deadline = time.monotonic() + 10
    while target.call("probe")["conns"] > 0 and time.monotonic() < deadline:  # the target saw it go
        time.sleep(0.1)
    with IOEngine("victim", IOEngineConfig()) as reborn:  # the holder is gone: a new engine takes the key
        assert write_as(reborn, 4).Succeeded()
    assert target.call("pop_inbound", "victim", 4, 5) == StatusCode.SUCCESS


def test_key_bindings_are_bounded_and_follow_their_holders():
    # Bindings a flood of fresh keys makes are bounded; a binding whose holder is connected is
    # never the one dropped, and a holder that cannot be challenged holds its key only while
    # connected.
    bindings = KeyBindings(None, max_keys=4)
    assert bindings.claim("held", "p", None) is None  # stays connected
    for i in range(10):
        assert bindings.claim(f"fresh-{i}", "q", None) is None
        bindings.release(f"fresh-{i}", "q")
    assert len(bindings) == 4
    assert bindings.claim("held", "other", None) is not None and bindings.refused == 1
    bindings.release("held", "p")
    assert bindings.claim("held", "other", None) is None  # gone with its connection
