"""Host shared-memory segments and descriptor passing, across real processes."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core import atomics
from mori.core import cuda as _cuda
from mori.core.bootstrap import Bootstrap, get_unique_id
from mori.core.memory import FdExchange, HostSegment, LiveRanges, buffer_span, cuda_vmm, recv_fds, send_fds
from mori.core.testing import context, run_procs


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@settings(max_examples=25, deadline=None)
@given(size=st.integers(1, 3 << 20), seed=st.integers(0, 2**32 - 1))
def test_segment_is_zeroed_and_shared_between_mappings(size: int, seed: int) -> None:
    data = np.random.default_rng(seed).bytes(size)
    with HostSegment.create(size) as seg, HostSegment.attach(seg.fd, size) as other:
        assert seg.size == other.size == size and seg.addr != other.addr
        assert bytes(seg.view()) == bytes(size)
        seg.view()[:] = data
        assert bytes(other.view()) == data
        other.view()[size // 2 :] = bytes(size - size // 2)
        assert bytes(seg.view()) == data[: size // 2] + bytes(size - size // 2)


def test_attach_keeps_its_own_descriptor() -> None:
    with HostSegment.create(4096) as seg:
        fd = os.dup(seg.fd)
        other = HostSegment.attach(fd, 4096)
        os.close(fd)  # the caller's copy goes; the mapping and the segment's own fd stay
        seg.view()[:4] = b"mori"
        assert bytes(other.view()[:4]) == b"mori" and os.fstat(other.fd).st_size == 4096
        other.close()
        other.close()  # idempotent
        assert other.closed


def test_size_is_sealed_so_no_peer_can_shrink_the_mapping() -> None:
    with HostSegment.create(8192) as seg:
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 16384)
        assert os.fstat(seg.fd).st_size == 8192


def test_close_with_a_live_view_is_refused_until_it_is_released() -> None:
    seg = HostSegment.create(4096)
    view = seg.view()
    with pytest.raises(BufferError, match="release them first"):
        seg.close()
    assert not seg.closed
    view.release()
    seg.close()
    assert seg.closed
    with pytest.raises(ValueError, match="closed"):
        seg.view()
    with pytest.raises(ValueError, match="closed"):
        _ = seg.addr


def test_bad_sizes_and_descriptors_are_rejected() -> None:
    before = _open_fds()
    for size in (0, -1):
        with pytest.raises(ValueError, match="> 0"):
            HostSegment.create(size)
    with pytest.raises(TypeError):
        HostSegment.create(4096.0)  # type: ignore[arg-type]
    with HostSegment.create(4096) as seg, pytest.raises(ValueError, match="fewer than the 8192 requested"):
        HostSegment.attach(seg.fd, 8192)
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="not a shared-memory file"):
            HostSegment.attach(r, 4096)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(ValueError, match="not an open file descriptor"):
        HostSegment.attach(r, 4096)
    with pytest.raises(ValueError, match="-1 is not a file descriptor"):
        HostSegment.attach(-1, 4096)
    assert _open_fds() == before


def test_send_and_receive_many_descriptors_with_payload() -> None:
    # 600 descriptors: more than the kernel's 253 per message, so batching is exercised.
    segs = [HostSegment.create(4096) for _ in range(3)]
    fds = [segs[i % 3].fd for i in range(600)]
    payload = os.urandom(70_000)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        before = _open_fds()
        # Send from another thread: the socket buffer cannot hold the whole message at once.
        sender = threading.Thread(target=send_fds, args=(a, fds, payload, 10))
        sender.start()
        got_payload, got = recv_fds(b, timeout=10)
        sender.join(timeout=10)
        assert got_payload == payload and len(got) == 600
        for i, fd in enumerate(got):
            assert os.fstat(fd).st_ino == os.fstat(fds[i]).st_ino
            assert not os.get_inheritable(fd)
            os.close(fd)
        send_fds(a, [], b"", timeout=10)
        assert recv_fds(b, timeout=10) == (b"", [])
        assert _open_fds() == before
    finally:
        a.close()
        b.close()
        for s in segs:
            s.close()


def test_recv_fds_times_out_and_reports_hangups_and_garbage() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="recv_fds"):
            recv_fds(b, timeout=0.2)
        assert time.monotonic() - start >= 0.2
        a.sendall(b"GET / HTTP/1.1\r\n")
        with pytest.raises(ValueError, match="not a mori descriptor message"):
            recv_fds(b, timeout=1)
    finally:
        a.close()
    with pytest.raises(ConnectionError, match="closed the connection"):
        recv_fds(b, timeout=1)
    b.close()


def test_send_fds_rejects_bad_input_before_sending() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    os.close(w)
    try:
        with pytest.raises(ValueError, match="not a file descriptor"):
            send_fds(a, [r, -3])
        with pytest.raises(ValueError, match="not an open file descriptor"):
            send_fds(a, [w])
        with pytest.raises(ValueError, match="timeout"):
            send_fds(a, [r], timeout=0)
        with pytest.raises(ValueError, match="payload"):
            send_fds(a, [r], b"x" * ((1 << 20) + 1))
        with pytest.raises(TimeoutError):
            recv_fds(b, timeout=0.1)  # nothing at all was sent
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp, pytest.raises(ValueError, match="AF_UNIX"):
            send_fds(tcp, [r])
    finally:
        os.close(r)
        a.close()
        b.close()


def _connect(name: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(name)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _writer(name: str, data: bytes, readers: int) -> str:
    seg = HostSegment.create(len(data) + 64)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        seg.view()[64:] = data
        listener.bind(name)
        listener.listen(readers)
        listener.settimeout(60)
        for _ in range(readers):
            conn, _ = listener.accept()
            with conn:
                send_fds(conn, [seg.fd], str(seg.size).encode(), timeout=60)
        # Each reader bumps the counter after checking; waiting here proves their writes reach us.
        atomics.wait_until(seg.addr, "eq", readers, timeout=60)
        return hashlib.sha256(bytes(seg.view()[64:])).hexdigest()
    finally:
        listener.close()
        seg.close()


def _reader(name: str, data: bytes) -> bool:
    with _connect(name, 60) as s:
        payload, fds = recv_fds(s, timeout=60)
    seg = HostSegment.attach(fds[0], int(payload))
    os.close(fds[0])
    try:
        same = bytes(seg.view()[64:]) == data
        atomics.fetch_add(seg.addr, 1)
        return same
    finally:
        seg.close()


def test_one_writer_three_readers_over_a_unix_socket() -> None:
    data = os.urandom((8 << 20) + 123)
    name = f"\0mori-test-{secrets.token_hex(8)}"
    results = run_procs(_writer_and_readers, [(name, data, role) for role in range(4)])
    assert results[0] == hashlib.sha256(data).hexdigest()
    assert results[1:] == [True, True, True]


def _writer_and_readers(name: str, data: bytes, role: int) -> str | bool:
    return _writer(name, data, 3) if role == 0 else _reader(name, data)


def _bootstrap(rank: int, world: int) -> Bootstrap:
    """Rank 0 makes the unique id (it listens on it) and the test pool hands it to the others."""
    uid = context().share(bytes(get_unique_id()) if rank == 0 else None)
    return Bootstrap(rank, world, uid, timeout=60)


def _exchange_worker(rank: int, world: int, seed: int) -> list[str]:
    """Each rank shares segments of seeded random bytes; every rank checks every peer's."""
    size = 1 << 16
    with _bootstrap(rank, world) as bs, FdExchange(bs, timeout=60) as ex:
        assert ex.local_ranks == list(range(world))
        mine = []
        for k in range(rank + 1):  # rank r shares r + 1 segments: counts differ between ranks
            seg = HostSegment.create(size)
            seg.view()[:] = np.random.default_rng([seed, rank, k]).bytes(size)
            mine.append(seg)
        checked = []
        for _ in range(3):  # repeated exchanges: ranks may run one exchange ahead of another
            peer_fds = ex.allgather_fds([s.fd for s in mine])
            for peer, fds in enumerate(peer_fds):
                assert len(fds) == peer + 1
                for k, fd in enumerate(fds):
                    with HostSegment.attach(fd, size) as peer_seg:
                        expected = np.random.default_rng([seed, peer, k]).bytes(size)
                        assert bytes(peer_seg.view()) == expected, f"rank {rank}: segment {k} of rank {peer}"
                    os.close(fd)
                    checked.append(f"{peer}.{k}")
        for seg in mine:
            seg.close()
        bs.barrier()
        return checked


@pytest.mark.parametrize("world", [2, 4])
def test_fd_exchange_among_bootstrap_ranks(world: int) -> None:
    seed = secrets.randbits(32)
    results = run_procs(_exchange_worker, [(r, world, seed) for r in range(world)])
    expected = [f"{p}.{k}" for p in range(world) for k in range(p + 1)] * 3
    assert all(sorted(r) == sorted(expected) for r in results)


def _intruder_worker(rank: int, seed: int) -> bool:
    with _bootstrap(rank, 2) as bs, FdExchange(bs, timeout=60) as ex:
        seg = HostSegment.create(4096)
        seg.view()[:] = np.random.default_rng([seed, rank]).bytes(4096)
        if rank == 0:
            # A process that is not a rank (it lacks rank 0's secret) tries to slip a segment in.
            with HostSegment.create(4096) as fake, _connect(ex._peers[1]["name"], 10) as s:
                fake.view()[:] = b"\xff" * 4096
                send_fds(s, [fake.fd], msgpack.packb([0, 0, b"0" * 16]), timeout=10)
        bs.barrier()
        fds = ex.allgather_fds([seg.fd])
        with HostSegment.attach(fds[1 - rank][0], 4096) as peer:
            ok = bytes(peer.view()) == np.random.default_rng([seed, 1 - rank]).bytes(4096)
        for fd in (f for entry in fds for f in entry):
            os.close(fd)
        seg.close()
        return ok


def test_fd_exchange_ignores_messages_without_the_rank_secret() -> None:
    assert run_procs(_intruder_worker, [(r, 7) for r in range(2)]) == [True, True]


def _silent_stranger_worker(rank: int, seed: int) -> bool:
    with _bootstrap(rank, 2) as bs, FdExchange(bs, timeout=10) as ex:
        seg = HostSegment.create(4096)
        seg.view()[:] = np.random.default_rng([seed, rank]).bytes(4096)
        silent = []
        if rank == 0:  # connections that never send a word, queued before rank 0's real message
            silent = [_connect(ex._peers[1]["name"], 10) for _ in range(3)]
        bs.barrier()
        fds = ex.allgather_fds([seg.fd])
        with HostSegment.attach(fds[1 - rank][0], 4096) as peer:
            ok = bytes(peer.view()) == np.random.default_rng([seed, 1 - rank]).bytes(4096)
        for fd in (f for entry in fds for f in entry):
            os.close(fd)
        for s in silent:
            s.close()
        seg.close()
        return ok


def test_fd_exchange_is_not_held_up_by_silent_connections() -> None:
    # Issue 11: each gets half a second, not the exchange's whole deadline.
    assert run_procs(_silent_stranger_worker, [(r, 8) for r in range(2)]) == [True, True]


class _OneRank:
    """A bootstrap of one rank: enough to test FdExchange's own timeouts and argument checks."""

    rank, world = 0, 1

    def allgather(self, data: bytes) -> list[bytes]:
        return [data]


def test_fd_exchange_single_rank_and_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        FdExchange(_OneRank(), timeout=-1)
    with FdExchange(_OneRank(), timeout=5) as ex, HostSegment.create(4096) as seg:
        (fds,) = ex.allgather_fds([seg.fd])
        assert len(fds) == 1 and os.fstat(fds[0]).st_ino == os.fstat(seg.fd).st_ino
        os.close(fds[0])
    with pytest.raises(ValueError, match="closed"):
        ex.allgather_fds([])


def test_cuda_vmm_imports_without_cuda_bindings_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    monkeypatch.setattr(_cuda, "_LOADED", {})  # as in a process that never loaded the bindings
    with pytest.raises(_cuda.CudaUnavailableError, match=r"mori-core\[cuda\]"):
        cuda_vmm.granularity(0)
    with pytest.raises(_cuda.CudaUnavailableError, match=r"mori-core\[cuda\]"):
        cuda_vmm.VmmAllocation.create(1 << 20, 0)


def test_cuda_vmm_rejects_bad_arguments_before_touching_the_driver() -> None:
    with pytest.raises(ValueError, match="device ordinal"):
        cuda_vmm.granularity(-1)
    with pytest.raises(ValueError, match="peer devices"):
        cuda_vmm.VmmAllocation.create(1 << 20, 0, peers=[-2])
    with pytest.raises(ValueError, match="import_fd: -1 is not a file descriptor"):
        cuda_vmm.VmmAllocation.import_fd(-1, 1 << 20, 0)


@pytest.mark.parametrize(
    "size,device,alignment,match",
    [
        (0, 0, 4096, "size must be an int > 0"),
        (4096, 0, 0, "alignment must be an int > 0"),
        (6000, 0, 4096, "not a multiple of its alignment"),
        (4096, -1, 4096, "device ordinals"),
        (4096.0, 0, 4096, "size must be an int"),
    ],
)
def test_vmm_reservation_rejects_bad_arguments_before_any_cuda_call(
    size: object, device: object, alignment: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cuda_vmm.VmmReservation(size, device, alignment)  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(data=st.binary(max_size=4096), start=st.integers(0, 64))
def test_buffer_span_is_the_address_and_size_of_every_buffer_kind(data: bytes, start: int) -> None:
    import array
    import ctypes
    import mmap

    arr = np.frombuffer(data, dtype=np.uint8).copy()
    words = array.array("B", data)
    mm = mmap.mmap(-1, max(1, len(data)))
    mm[: len(data)] = data
    raw = bytearray(data)
    for obj, writable in [
        (data, False),
        (raw, True),
        (memoryview(raw)[start:], True),
        (arr, True),
        (words, True),
        (mm, True),
        (arr[start:], False),
    ]:
        addr, nbytes = buffer_span(obj, writable)
        assert nbytes == memoryview(obj).nbytes
        assert ctypes.string_at(addr, nbytes) == bytes(memoryview(obj).cast("B"))
    assert buffer_span(arr)[0] == arr.ctypes.data
    mm.close()


def test_buffer_span_refuses_what_has_no_usable_buffer_and_names_its_type() -> None:
    read_only = np.zeros(8, dtype=np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="^int has no buffer protocol$"):
        buffer_span(3)
    with pytest.raises(TypeError, match="list has no buffer protocol"):
        buffer_span([1, 2])
    with pytest.raises(ValueError, match="numpy.ndarray buffer is not C-contiguous"):
        buffer_span(np.zeros(8)[::2])
    with pytest.raises(ValueError, match="numpy.ndarray buffer is not C-contiguous"):
        buffer_span(np.zeros((4, 4)).T)
    with pytest.raises(ValueError, match="bytes buffer is read-only"):
        buffer_span(b"abc", writable=True)
    with pytest.raises(ValueError, match="numpy.ndarray buffer is read-only"):
        buffer_span(read_only, writable=True)
    assert buffer_span(read_only)[1] == 8  # reading it is fine
    raw = bytearray(8)
    buffer_span(raw, True)
    raw.extend(b"x" * 8)  # buffer_span holds no export once it returns: the owner may resize
    assert buffer_span(raw)[1] == 16


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "remove", "find"]), st.integers(0, 4096), st.integers(0, 512)), max_size=60
    )
)
def test_live_ranges_match_a_model(steps: list[tuple[str, int, int]]) -> None:
    """LiveRanges against a dict model: add refuses a start already live, remove returns the
    size asked for, find returns the block that holds the range whole (blocks never overlap
    here, as an allocator's do not)."""
    live, model = LiveRanges(), {}
    for op, a, b in steps:
        if op == "add":
            overlaps = any(s < a + b and a < s + n for s, n in model.items()) or a in model
            if overlaps:
                continue  # an allocator never adds an overlapping block
            assert live.add(a, b) is True
            model[a] = b
            assert live.add(a, 1) is False and live.find(a, b) == (a, b)
        elif op == "remove":
            assert live.remove(a) == model.pop(a, None)
        else:
            last = max((s for s in model if s <= a), default=None)  # the only block that can hold a
            want = (last, model[last]) if last is not None and a + b <= last + model[last] else None
            assert live.find(a, b) == want, (a, b, model)
        assert len(live) == len(model)
