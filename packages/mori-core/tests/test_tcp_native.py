"""The native TCP data plane (``mori.core.tcp.Target/Peer``) on its own, across two
processes: striping, scatter-gather, region checks, tokens, notifications, dead and hung peers."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mori.core import tcp
from mori.core.batch import Batch
from mori.core.codes import TransferCode
from mori.core.testing import CommandProcess, serve_commands

READ, WRITE = 1, 2
SIZE = 16 << 20
TICKET = "t" * 32


def _serve(path, token, timeout):
    """The target process: a tcp.Target serving the shared file ``path`` as region 1."""
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, SIZE)
    os.close(fd)
    arr = np.frombuffer(mm, dtype=np.uint8)
    t = tcp.Target("127.0.0.1", 0, token, timeout)
    t.register_region(1, int(arr.ctypes.data), SIZE)
    t.issue_ticket("init", TICKET)  # what mori-io's control plane hands an authenticated engine

    def pop(key, uid):  # the record, waiting for it at most 10 s
        deadline = time.monotonic() + 10
        code = t.pop_inbound(key, uid)
        while code is None and time.monotonic() < deadline:
            time.sleep(0.001)
            code = t.pop_inbound(key, uid)
        return code

    serve_commands(
        {
            "pop_now": t.pop_inbound,
            "pop": pop,
            "deregister": t.deregister_region,
            "conns": t.connection_count,
            "close": t.close,
        },
        mm,
    )
    return t.port


@pytest.fixture()
def remote():
    path = f"/dev/shm/mori-native-test-{os.getpid()}-{time.monotonic_ns()}"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, SIZE)
    os.close(fd)
    try:
        target = CommandProcess(_serve, (path, "tok", 2.0), "target", timeout=60.0)
        try:
            yield np.frombuffer(mm, dtype=np.uint8), target.ready, target.call, target
        finally:
            target.kill()
    finally:
        os.unlink(path)


def _peer(port, nconn=4, token="tok", **kw):
    return tcp.Peer("target", "127.0.0.1", port, nconn, "init", token, TICKET, 2.0, **kw)


@pytest.mark.parametrize("nconn", [1, 3])
@pytest.mark.parametrize("size,batch", [(1, 1), (7, 4096), (4096, 1000), (3 << 20, 3), (SIZE - 5, 1)])
def test_write_then_read_striped(remote, nconn, size, batch):
    arr, port, call, _ = remote
    rng = np.random.default_rng(size + batch)
    arr[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    src = rng.integers(0, 256, SIZE, dtype=np.uint8)
    slots = rng.permutation(batch)
    lofs = [int(i) * size for i in range(batch)]
    rofs = [int(j) * size + 5 for j in slots] if size * batch + 5 <= SIZE else [0]
    expect = arr.copy()
    for lo, ro in zip(lofs, rofs):
        expect[ro : ro + size] = src[lo : lo + size]
    p = _peer(port, nconn)
    t = p.submit(WRITE, Batch(lofs, rofs, [size] * batch, int(src.ctypes.data)), 1, 77, True, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
    assert np.array_equal(arr, expect)
    assert call("pop", "init", 77) == 0
    back = np.zeros(SIZE, dtype=np.uint8)
    t = p.submit(READ, Batch(lofs, rofs, [size] * batch, int(back.ctypes.data)), 1, 78, False, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
    for lo, ro in zip(lofs, rofs):
        assert np.array_equal(back[lo : lo + size], arr[ro : ro + size])
    p.close()


@pytest.mark.parametrize("size,batch", [(1, 1), (100 << 10, 1), (4096, 300), (3 << 20, 2)])
def test_notification_recorded_before_finish(remote, size, batch):
    # On one connection the requests carry the notification: the target has the record by the
    # time the initiator sees the transfer finish, for writes and reads (a read larger than the
    # inline reply holds its last byte back until the record is made), with the first failure
    # of the transfer as its code.
    arr, port, call, _ = remote
    rng = np.random.default_rng(size * 7 + batch)
    arr[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    src = rng.integers(0, 256, size * batch, dtype=np.uint8)
    rofs = [int(j) * size for j in rng.permutation(batch)]
    lofs = [i * size for i in range(batch)]
    p = _peer(port, 1)
    t = p.submit(WRITE, Batch(lofs, rofs, [size] * batch, int(src.ctypes.data)), 1, 90, True, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
    assert call("pop_now", "init", 90) == 0 and call("pop_now", "init", 90) is None
    for lo, ro in zip(lofs, rofs):
        assert np.array_equal(arr[ro : ro + size], src[lo : lo + size])
    back = np.zeros_like(src)
    t = p.submit(READ, Batch(lofs, rofs, [size] * batch, int(back.ctypes.data)), 1, 91, True, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
    assert call("pop_now", "init", 91) == 0
    assert np.array_equal(back, src)
    # A transfer whose middle block is out of range: the others land, the record says why not all.
    bad = list(rofs)
    bad[len(bad) // 2] = SIZE
    t = p.submit(WRITE, Batch(lofs, bad, [size] * batch, int(src.ctypes.data)), 1, 92, True, 1 << 20)
    assert t.wait(30) and t.code() == TransferCode.ERR_INVALID_ARGS
    assert call("pop_now", "init", 92) == TransferCode.ERR_INVALID_ARGS
    # Back-to-back transfers on the connection keep their own outcomes.
    t = p.submit(READ, Batch(lofs, rofs, [size] * batch, int(back.ctypes.data)), 1, 93, True, 1 << 20)
    assert t.wait(30) and t.code() == 0 and call("pop_now", "init", 93) == 0
    p.close()


def _settled(t, seconds=30.0):
    """Whether t finished within seconds without anyone waiting on it (code() only looks)."""
    deadline = time.monotonic() + seconds
    while t.code() == TransferCode.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    return t.code() != TransferCode.IN_PROGRESS


def test_submit_one_and_replies_nobody_waits_for(remote):
    # One block through submit_one, byte for byte with its record; transfers no one waits for
    # finish through the receiver thread, before, between and after transfers whose waiter reads
    # the replies itself (and mutes the receiver thread's watch meanwhile); a closed peer starts
    # nothing.
    arr, port, call, _ = remote
    rng = np.random.default_rng(11)
    arr[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    base = int(src.ctypes.data)
    p = _peer(port, 1)
    t = p.submit_one(WRITE, base + 100, 4096 * 3, 5000, 1, 40, True, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
    assert np.array_equal(arr[4096 * 3 : 4096 * 3 + 5000], src[100:5100])
    assert call("pop", "init", 40) == 0
    back = np.zeros(5000, dtype=np.uint8)
    t = p.submit_one(READ, int(back.ctypes.data), 4096 * 3, 5000, 1, 41, False, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
    assert np.array_equal(back, src[100:5100])
    for round_ in range(20):
        off = round_ * 8192
        alone = p.submit_one(WRITE, base + off, off, 4096, 1, 100 + round_, False, 1 << 20)
        waited = p.submit_one(WRITE, base + off + 4096, off + 4096, 4096, 1, 200 + round_, False, 1 << 20)
        assert waited.wait(30) and waited.code() == 0, waited.message()
        later = p.submit_one(WRITE, base + off, (1 << 20) + off, 4096, 1, 300 + round_, False, 1 << 20)
        for t in (alone, later):
            assert _settled(t) and t.code() == 0, t.message()
    assert np.array_equal(arr[: 20 * 8192], src[: 20 * 8192])
    for round_ in range(20):
        off = round_ * 8192
        assert np.array_equal(arr[(1 << 20) + off : (1 << 20) + off + 4096], src[off : off + 4096])
    p.close()
    assert p.submit_one(WRITE, base, 0, 4096, 1, 500, False, 1 << 20) is None


def test_rejections_write_nothing(remote):
    arr, port, call, _ = remote
    arr[:] = 3
    src = np.full(4096, 9, dtype=np.uint8)
    p = _peer(port)
    cases = [
        (1, SIZE - 10, 11, TransferCode.ERR_INVALID_ARGS, "out of range"),
        (2, 0, 8, TransferCode.ERR_NOT_FOUND, "memory is not registered"),
    ]
    for mem, off, n, code, text in cases:
        t = p.submit(WRITE, Batch([0], [off], [n], int(src.ctypes.data)), mem, 1, True, 1 << 20)
        assert t.wait(10) and t.code() == code and text in t.message()
        assert call("pop", "init", 1) == code  # the target records the failed outcome too
    assert (arr == 3).all()
    with pytest.raises(ValueError):
        p.submit(WRITE, Batch([0], [0, 1], [1], int(src.ctypes.data)), 1, 3, False, 1 << 20)
    p.close()


def test_deregister_and_token(remote):
    arr, port, call, _ = remote
    with pytest.raises(RuntimeError, match="rejected"):
        _peer(port, token="bad")
    assert call("deregister", 1) is True and call("deregister", 1) is False
    src = np.ones(64, dtype=np.uint8)
    p = _peer(port)
    t = p.submit(READ, Batch([0], [0], [64], int(src.ctypes.data)), 1, 4, False, 1 << 20)
    assert t.wait(10) and t.code() == TransferCode.ERR_NOT_FOUND
    p.close()


def test_garbage_drops_only_that_connection(remote):
    arr, port, call, _ = remote
    p = _peer(port, 2)
    for junk in (b"\x00" * 64, os.urandom(1000), struct.pack("<IHHHH", 0x4F49524D, 9, 1, 0, 0) + b"x"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(junk)
            s.settimeout(10)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
    src = np.arange(256, dtype=np.uint8)
    t = p.submit(WRITE, Batch([0], [0], [256], int(src.ctypes.data)), 1, 5, False, 1 << 20)
    assert t.wait(10) and t.code() == 0 and np.array_equal(arr[:256], src)
    p.close()


def test_dead_and_hung_target(remote):
    arr, port, call, target = remote
    p = _peer(port, 2, timeout_setting="TEST_IO_TIMEOUT")  # the caller's name for io_timeout
    src = np.ones(SIZE, dtype=np.uint8)
    target.stop()
    t0 = time.monotonic()
    t = p.submit(READ, Batch([0], [0], [4096], int(src.ctypes.data)), 1, 6, False, 1 << 20)
    assert t.wait(10) and t.code() == TransferCode.ERR_BAD_STATE and "(TEST_IO_TIMEOUT)" in t.message()
    assert 1.5 < time.monotonic() - t0 < 8
    assert not p.healthy()
    target.signal(signal.SIGCONT)
    q = _peer(port, 2)
    scattered = Batch([0] * 64, [i * 65536 for i in range(64)], [65536] * 64, int(src.ctypes.data))
    t = q.submit(WRITE, scattered, 1, 7, False, 1 << 16)
    target.signal(signal.SIGKILL)
    assert t.wait(10)  # finished (succeeded before the kill, or failed after it): never hangs
    t = q.submit(WRITE, Batch([0], [0], [64], int(src.ctypes.data)), 1, 8, False, 1 << 20)
    assert t.wait(10) and t.code() == TransferCode.ERR_BAD_STATE
    p.close()
    q.close()


def test_MORI_TRACE_DIR_timestamps_a_transfers_steps(tmp_path):
    # csrc/base/trace.hpp on the TCP plane: each transfer's steps in order (posted T, about to send
    # m, request at the target G, reply about to go n, reply read Q, finished F, wait returned Z), and
    # ci/trace_report.py --ladder T times them. A child process: a process's first mark decides
    # whether it records (the target serves in the same process here, so one file has both sides).
    script = f"""
import ctypes
from mori.core import tcp
memory = (ctypes.c_uint8 * 65536)()
buffer = (ctypes.c_uint8 * 4096)(*range(256), *range(256), *([7] * 3584))
target = tcp.Target("127.0.0.1", 0, "tok", 10.0)
target.register_region(1, ctypes.addressof(memory), 65536)
target.issue_ticket("init", {TICKET!r})
peer = tcp.Peer("target", "127.0.0.1", target.port, 1, "init", "tok", {TICKET!r}, 10.0)
for i in range(3):
    t = peer.submit_one({WRITE}, ctypes.addressof(buffer), i * 4096, 4096, 1, 10 + i, False, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
    t = peer.submit_one({READ}, ctypes.addressof(buffer), i * 4096, 4096, 1, 20 + i, False, 1 << 20)
    assert t.wait(30) and t.code() == 0, t.message()
assert bytes(memory[:4096]) == bytes(buffer)
peer.close(); target.close()
"""
    env = {**os.environ, "MORI_TRACE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    (path,) = tmp_path.glob("mori-trace-*.bin")
    data = path.read_bytes()
    steps = "".join(chr(step) for ns, step, _ in struct.iter_unpack("<QQQ", data[: 24 * 4096]) if ns)
    transfers = steps.split("T")[1:]
    assert len(transfers) == 6, steps
    for one in transfers:  # each in order: sent, served, answered, read back, finished, returned
        rest = iter(one)
        # (A subsequence: the connection's own frames mark too. M and N, after a send returned, may
        # come after the other side's next step.)
        assert all(step in rest for step in "mGnQFZ"), one
    report = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[3] / "ci" / "trace_report.py"), str(tmp_path), "--ladder", "T"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert report.returncode == 0 and "episodes from T: 5" in report.stdout and "i:Z" in report.stdout, report.stdout
