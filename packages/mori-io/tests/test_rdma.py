"""The RDMA backend on mori-core's UCX engine, two engines in this process over UCX's tcp
transport (loopback). Across real network namespaces: test_rdma_netns.py."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
)
from mori.io.backends.rdma import RdmaBackend, ucx_net_devices

SIZE = 4 << 20


@pytest.fixture(autouse=True)
def _tcp_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    monkeypatch.setenv("MORI_IO_TIMEOUT", "10")


def _pair(config: RdmaBackendConfig | None = None, tcp: bool = False) -> tuple[IOEngine, IOEngine]:
    a, b = IOEngine("init", IOEngineConfig()), IOEngine("targ", IOEngineConfig())
    for e in (a, b):
        e.create_backend(BackendType.RDMA, config)
        if tcp:
            e.create_backend(BackendType.TCP)
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    return a, b


class Pair:
    def __init__(self, config: RdmaBackendConfig | None = None, tcp: bool = False) -> None:
        self.a, self.b = _pair(config, tcp)
        rng = np.random.default_rng(5)
        self.la = rng.integers(0, 256, SIZE, dtype=np.uint8)
        self.rb = rng.integers(0, 256, SIZE, dtype=np.uint8)
        self.ma = self.a.register_memory(int(self.la.ctypes.data), SIZE, -1, MemoryLocationType.CPU)
        mb = self.b.register_memory(int(self.rb.ctypes.data), SIZE, -1, MemoryLocationType.CPU)
        self.mb = MemoryDesc.unpack(mb.pack())  # as a peer receives it

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    mp = pytest.MonkeyPatch()
    mp.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    p = Pair(RdmaBackendConfig(qp_per_transfer=2, num_worker_threads=2))
    mp.undo()
    yield p
    p.close()


def _done(st: object) -> StatusCode:
    assert st.WaitFor(30_000) != StatusCode.IN_PROGRESS, st  # type: ignore[attr-defined]
    return st.Code()  # type: ignore[attr-defined,no-any-return]


def test_write_read_and_notification(pair: Pair) -> None:
    uid = pair.a.allocate_transfer_uid()
    assert _done(pair.a.write(pair.ma, 4096, pair.mb, 8192, 1 << 20, uid)) == StatusCode.SUCCESS
    assert np.array_equal(pair.rb[8192 : 8192 + (1 << 20)], pair.la[4096 : 4096 + (1 << 20)])
    for _ in range(200):
        inbound = pair.b.pop_inbound_transfer_status("init", uid)
        if inbound is not None:
            break
        time.sleep(0.01)
    assert inbound is not None and inbound.Succeeded()
    assert pair.b.pop_inbound_transfer_status("init", uid) is None  # popped once
    uid = pair.a.allocate_transfer_uid()
    assert _done(pair.a.read(pair.ma, 0, pair.mb, SIZE - 100, 100, uid)) == StatusCode.SUCCESS
    assert np.array_equal(pair.la[:100], pair.rb[SIZE - 100 :])


@pytest.mark.parametrize("op", ["read", "write"])
def test_batches_scatter_byte_for_byte(pair: Pair, op: str) -> None:
    block, n = 3000, 500
    local = [i * block for i in range(n)]
    remote = [(n - 1 - i) * block + 17 for i in range(n)]  # reversed, unaligned
    before_l, before_r = pair.la.copy(), pair.rb.copy()
    fn = pair.a.batch_read if op == "read" else pair.a.batch_write
    assert _done(fn(pair.ma, local, pair.mb, remote, [block] * n, pair.a.allocate_transfer_uid())) == StatusCode.SUCCESS
    src, dst = (before_r, pair.la) if op == "read" else (before_l, pair.rb)
    so, do = (remote, local) if op == "read" else (local, remote)
    expect = (before_l if op == "read" else before_r).copy()
    for s, d in zip(so, do):
        expect[d : d + block] = src[s : s + block]
    assert np.array_equal(dst, expect)


def test_numpy_batch_and_contiguous_blocks_merge(pair: Pair) -> None:
    offs = np.arange(0, 1 << 20, 4096, dtype=np.int64)
    sizes = np.full(len(offs), 4096, dtype=np.int64)
    pair.la[: 1 << 20] = 7
    st = pair.a.batch_write(pair.ma, offs, pair.mb, offs + 4096, sizes, pair.a.allocate_transfer_uid())
    assert _done(st) == StatusCode.SUCCESS
    assert (pair.rb[4096 : 4096 + (1 << 20)] == 7).all()


def test_session(pair: Pair) -> None:
    sess = pair.a.create_session(pair.ma, pair.mb)
    assert sess is not None and sess.alive()
    pair.la[:4096] = 42
    assert _done(sess.write(0, 0, 4096, sess.allocate_transfer_uid())) == StatusCode.SUCCESS
    assert (pair.rb[:4096] == 42).all()
    pair.rb[4096:8192] = 9
    assert _done(sess.batch_read([8192], [4096], [4096], sess.allocate_transfer_uid())) == StatusCode.SUCCESS
    assert (pair.la[8192:12288] == 9).all()


def test_bounds_are_checked_and_nothing_moves(pair: Pair) -> None:
    before = pair.rb.copy()
    for args in ((0, 0, SIZE + 1), (-1, 0, 10), (0, SIZE - 10, 11)):
        st = pair.a.write(pair.ma, args[0], pair.mb, args[1], args[2], pair.a.allocate_transfer_uid())
        assert _done(st) == StatusCode.ERR_INVALID_ARGS, st
    assert np.array_equal(pair.rb, before)


def test_descriptor_not_registered_with_rdma_is_not_served_by_it(pair: Pair) -> None:
    bare = MemoryDesc(pair.mb.engine_key, pair.mb.id, pair.mb.data, pair.mb.size, -1, MemoryLocationType.CPU)
    st = pair.a.write(pair.ma, 0, bare, 0, 10, pair.a.allocate_transfer_uid())
    assert _done(st) == StatusCode.ERR_BAD_STATE and "no backend" in st.Message()


def test_config_fields_are_validated() -> None:
    e = IOEngine("cfg", IOEngineConfig())
    try:
        for bad in (
            RdmaBackendConfig(qp_per_transfer=0),
            RdmaBackendConfig(num_worker_threads=65),
            RdmaBackendConfig(num_worker_threads=0),
            RdmaBackendConfig(qp_per_transfer=-1),
            RdmaBackendConfig(post_batch_size=0),
            RdmaBackendConfig(max_send_wr=-1),
        ):
            with pytest.raises(ValueError, match="RdmaBackendConfig"):
                e.create_backend(BackendType.RDMA, bad)
        with pytest.raises(TypeError, match="RdmaBackendConfig"):
            e.create_backend(BackendType.RDMA, object())
    finally:
        e.close()


@pytest.mark.parametrize("mode", [PollCqMode.POLLING, PollCqMode.EVENT])
def test_poll_modes_post_batches_and_no_notification(mode: PollCqMode) -> None:
    # num_worker_threads=-1: MORI's default ("auto"), which raised 'expected an int in 1..64'.
    p = Pair(RdmaBackendConfig(poll_cq_mode=mode, post_batch_size=7, num_worker_threads=-1, enable_notification=False))
    try:
        uid = p.a.allocate_transfer_uid()
        offs = list(range(0, 1 << 20, 8192))
        st = p.a.batch_write(p.ma, offs, p.mb, offs, [4096] * len(offs), uid)
        assert _done(st) == StatusCode.SUCCESS
        for o in offs:
            assert np.array_equal(p.rb[o : o + 4096], p.la[o : o + 4096])
        __import__("time").sleep(0.3)
        assert p.b.pop_inbound_transfer_status("init", uid) is None  # enable_notification=False
    finally:
        p.close()


@pytest.mark.parametrize("cores,threads,workers", [(2, -1, 1), (8, -1, 2), (64, -1, 2), (2, 3, 3)])
def test_worker_count_auto_by_cores_and_transfers_over_them(
    monkeypatch: pytest.MonkeyPatch, cores: int, threads: int, workers: int
) -> None:
    """num_worker_threads=-1: two workers from 8 cores, one below; N: N. Small and large (spread,
    mori-core's test_ucx_spread.py) transfers land byte for byte with their record. (These two
    engines share a process, so they meet on the same-host path; spreading is UCX's.)"""
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    p = Pair(RdmaBackendConfig(num_worker_threads=threads))
    try:
        engine = p.a._backends._by_type[BackendType.RDMA]._engine  # private: this package's own test
        assert len(engine.addresses) == workers  # one UCX worker address each
        for size, uid in ((4096, 1), (3 << 20, 2)):
            st = p.a.batch_write(p.ma, [0], p.mb, [512 << 10], [size], uid)
            assert _done(st) == StatusCode.SUCCESS, st.Message()
            assert np.array_equal(p.rb[512 << 10 : (512 << 10) + size], p.la[:size])
            assert p.b.pop_inbound_transfer_status("init", uid) is not None
    finally:
        p.close()


def test_messages_under_256_kib_go_eager_only_without_verbs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over tcp (no verbs transport) the engine sends host messages under 256 KiB eager, a
    rendezvous handshake shorter; with a verbs transport it leaves the choice to UCX. The
    engine's description says which."""
    from mori.core import ucx

    e = IOEngine("eager", IOEngineConfig())
    try:
        e.create_backend(BackendType.RDMA)
        assert e.describe()["backends"]["RDMA"]["eager_bytes"] == ucx.MAX_EAGER_BYTES == 256 << 10
    finally:
        e.close()
    monkeypatch.setattr(ucx, "verbs_transports", lambda engine: ["rc_mlx5/mlx5_0:1"])
    e = IOEngine("rdma-nic", IOEngineConfig())
    try:
        e.create_backend(BackendType.RDMA)
        assert e.describe()["backends"]["RDMA"]["eager_bytes"] == 0
    finally:
        e.close()


def test_default_refuses_a_host_without_rdma_nic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORI_IO_RDMA_TRANSPORTS")
    e = IOEngine("refuse", IOEngineConfig())
    try:
        with pytest.raises(RuntimeError, match="finds no RDMA NIC.*MORI_IO_RDMA_TRANSPORTS"):
            e.create_backend(BackendType.RDMA)
    finally:
        e.close()


def test_bad_transport_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp;sm")
    e = IOEngine("badtl", IOEngineConfig())
    try:
        with pytest.raises(ValueError, match="MORI_IO_RDMA_TRANSPORTS='tcp;sm'"):
            e.create_backend(BackendType.RDMA)
    finally:
        e.close()


def test_rdma_devices_select_network_devices(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (tmp_path / "mlx5_0" / "ports" / "2").mkdir(parents=True)
    assert ucx_net_devices((False, ("mlx5_0", "mlx5_1:1", "lo")), tmp_path) == "mlx5_0:1,mlx5_0:2,mlx5_1:1,lo"
    assert ucx_net_devices((True, ("mlx5_0",)), tmp_path) == "^mlx5_0:1,mlx5_0:2"
    # Over tcp the setting selects interfaces: a device that does not exist leaves UCX nothing to use.
    monkeypatch.setenv("MORI_RDMA_DEVICES", "nosuchnic0")
    e = IOEngine("nodev", IOEngineConfig())
    try:
        with pytest.raises(RuntimeError, match="no usable transport or device .*NET_DEVICES=nosuchnic0"):
            e.create_backend(BackendType.RDMA)
        monkeypatch.setenv("MORI_RDMA_DEVICES", "lo")  # the loopback interface: tcp over it works
        e.create_backend(BackendType.RDMA)
    finally:
        e.close()


def test_failover_to_tcp_when_rdma_breaks() -> None:
    p = Pair(tcp=True)
    try:
        p.la[:4096] = 1
        assert _done(p.a.write(p.ma, 0, p.mb, 0, 4096, p.a.allocate_transfer_uid())) == StatusCode.SUCCESS
        rdma = p.a._backends[BackendType.RDMA]
        assert rdma.healthy("targ")
        p.b.remove_backend(BackendType.RDMA)  # the target's UCX worker goes away
        codes = []
        for i in range(3):  # RDMA fails (or is already known broken), then TCP carries the bytes
            p.la[:4096] = 10 + i
            codes.append(_done(p.a.write(p.ma, 0, p.mb, 0, 4096, p.a.allocate_transfer_uid())))
            if codes[-1] == StatusCode.SUCCESS:
                assert (p.rb[:4096] == 10 + i).all()
                break
        assert codes[-1] == StatusCode.SUCCESS, codes
        assert not rdma.healthy("targ")
    finally:
        p.close()


def test_deregistered_engine_is_dropped_and_reconnects(pair: Pair) -> None:
    assert _done(pair.a.write(pair.ma, 0, pair.mb, 0, 16, pair.a.allocate_transfer_uid())) == StatusCode.SUCCESS
    pair.a.deregister_remote_engine(pair.b.get_engine_desc())  # closes the initiator's endpoints to it
    st = pair.a.write(pair.ma, 0, pair.mb, 0, 16, pair.a.allocate_transfer_uid())
    assert _done(st) == StatusCode.ERR_NOT_FOUND and "not registered" in st.Message()
    pair.a.register_remote_engine(pair.b.get_engine_desc())
    pair.la[:16] = 99
    assert _done(pair.a.write(pair.ma, 0, pair.mb, 0, 16, pair.a.allocate_transfer_uid())) == StatusCode.SUCCESS
    assert (pair.rb[:16] == 99).all()


def test_unreachable_peers_do_not_delay_others(monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 11, hole 7: while connects to three peers that never answer wait out their timeout,
    # a healthy peer's first transfer goes ahead (each peer is reached on a thread of its own).
    monkeypatch.setenv("MORI_IO_TIMEOUT", "4")
    pair = Pair()
    holes = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]  # accept, never answer
    try:
        stuck = []
        for i, hole in enumerate(holes):
            pair.a.register_remote_engine(EngineDesc(f"stuck{i}", "127.0.0.1", hole.getsockname()[1]))
            region = dataclasses.replace(pair.mb, engine_key=f"stuck{i}")
            stuck.append(pair.a.write(pair.ma, 0, region, 0, 64, 100 + i))
        st = pair.a.write(pair.ma, 0, pair.mb, 0, 4096, 1)
        assert st.WaitFor(10_000) == StatusCode.SUCCESS, st
        assert all(s.InProgress() for s in stuck)  # the healthy peer did not wait for them
        assert np.array_equal(pair.rb[:4096], pair.la[:4096])
        for s in stuck:
            assert s.WaitFor(15_000) not in (StatusCode.SUCCESS, StatusCode.IN_PROGRESS)
    finally:
        for hole in holes:
            hole.close()
        pair.close()


# ---- single blocks through the backend's lane (Backend.lane) ---------------------------------------
class Counted(Pair):
    """A fresh pair whose initiator counts the transfers its RDMA backend's submit started (the
    lane's are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.rdma = self.a._backends[BackendType.RDMA]
        self.full_way = 0
        submit = self.rdma.submit

        def counted(request):  # type: ignore[no-untyped-def]
            self.full_way += 1
            return submit(request)

        self.rdma.submit = counted


@pytest.fixture
def counted() -> Iterator[Counted]:
    p = Counted()
    yield p
    p.close()


def _warm(p: Counted) -> None:
    """The pair's first transfers: the first connects, the second leaves the lane."""
    for _ in range(2):
        assert _done(p.a.write(p.ma, 0, p.mb, 0, 8, p.a.allocate_transfer_uid())) == StatusCode.SUCCESS
    p.full_way = 0


def test_single_blocks_take_the_lane_byte_for_byte(counted: Counted) -> None:
    _warm(counted)
    rng = np.random.default_rng(3)
    sess = counted.a.create_session(counted.ma, counted.mb)
    assert sess is not None
    for i in range(300):
        size = int(rng.integers(1, 20_000))
        lo, ro = int(rng.integers(0, SIZE - size)), int(rng.integers(0, SIZE - size))
        uid = counted.a.allocate_transfer_uid()
        op = ("read", "write")[i % 2]
        before_l, before_r = counted.la.copy(), counted.rb.copy()
        if i % 3 == 0:
            st = getattr(counted.a, op)(counted.ma, lo, counted.mb, ro, size, uid)
        elif i % 3 == 1:
            st = getattr(counted.a, f"batch_{op}")(counted.ma, [lo], counted.mb, [ro], [size], uid)
        else:
            st = getattr(sess, op)(lo, ro, size, uid)
        assert _done(st) == StatusCode.SUCCESS, st
        if op == "read":
            before_l[lo : lo + size] = before_r[ro : ro + size]
        else:
            before_r[ro : ro + size] = before_l[lo : lo + size]
        assert np.array_equal(counted.la, before_l) and np.array_equal(counted.rb, before_r)
    assert counted.full_way == 0
    # The target records the outcome of a lane's transfer as of any other (notification on).
    uid = counted.a.allocate_transfer_uid()
    assert _done(counted.a.write(counted.ma, 0, counted.mb, 0, 64, uid)) == StatusCode.SUCCESS
    deadline = time.monotonic() + 10
    while (inbound := counted.b.pop_inbound_transfer_status("init", uid)) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert inbound is not None and inbound.Succeeded() and counted.full_way == 0
    # What the lane does not take goes the full way: numpy offsets, two blocks, zero bytes.
    for st in (
        counted.a.batch_write(counted.ma, np.array([0]), counted.mb, np.array([0]), np.array([8]), 1),
        counted.a.batch_write(counted.ma, [0, 64], counted.mb, [0, 64], [8, 8], 2),
        counted.a.write(counted.ma, 0, counted.mb, 0, 0, 3),
    ):
        assert _done(st) == StatusCode.SUCCESS
    assert counted.full_way == 3


def test_bad_blocks_and_uids_fail_as_before_and_nothing_moves(counted: Counted) -> None:
    _warm(counted)
    before = counted.rb.copy()
    for lo, ro, size, uid in (
        (0, 0, SIZE + 1, 1),
        (-1, 0, 10, 1),
        (0, SIZE - 10, 11, 1),
        (0, 0, 10, -1),
        (0, 0, 10, 1 << 64),
        (SIZE - 4, 0, 8, 1),
    ):
        st = counted.a.write(counted.ma, lo, counted.mb, ro, size, uid)
        assert _done(st) == StatusCode.ERR_INVALID_ARGS, (lo, ro, size, uid, st)
    assert np.array_equal(counted.rb, before)
    with pytest.raises(TypeError):
        counted.a.write(counted.ma, 0, counted.mb, 0, "8", 1)  # type: ignore[arg-type]


def test_changes_and_failures_leave_the_lane(counted: Counted) -> None:
    _warm(counted)
    # A failed connection: the lane is unhealthy, the full way reconnects.
    counted.rdma.abort("targ")
    counted.la[:64] = 5
    assert _done(counted.a.write(counted.ma, 0, counted.mb, 0, 64, 1)) == StatusCode.SUCCESS
    assert (counted.rb[:64] == 5).all() and counted.full_way == 1
    # A new registration: the counts changed, one transfer goes the full way, then the lane again.
    extra = np.zeros(64, dtype=np.uint8)
    counted.a.register_memory(int(extra.ctypes.data), 64, -1, MemoryLocationType.CPU)
    for _ in range(3):
        assert _done(counted.a.write(counted.ma, 0, counted.mb, 0, 64, 1)) == StatusCode.SUCCESS
    assert counted.full_way == 2
    # The remote engine deregistered, then the local memory: refused with the full way's words.
    counted.a.deregister_remote_engine(counted.b.get_engine_desc())
    st = counted.a.write(counted.ma, 0, counted.mb, 0, 64, 1)
    assert _done(st) == StatusCode.ERR_NOT_FOUND and "not registered" in st.Message()
    counted.a.register_remote_engine(counted.b.get_engine_desc())
    for _ in range(2):
        assert _done(counted.a.write(counted.ma, 0, counted.mb, 0, 64, 1)) == StatusCode.SUCCESS
    counted.a.deregister_memory(counted.ma)
    st = counted.a.write(counted.ma, 0, counted.mb, 0, 64, 1)
    assert _done(st) == StatusCode.ERR_NOT_FOUND and "not registered" in st.Message()


def test_a_single_block_reports_after_the_transfers_before_it(counted: Counted) -> None:
    _warm(counted)
    offs = list(range(0, SIZE, 4096))
    for _ in range(5):
        big = counted.a.batch_write(counted.ma, offs, counted.mb, offs, [4096] * len(offs), 1)
        small = counted.a.read(counted.ma, 0, counted.mb, 0, 8, 2)
        assert _done(small) == StatusCode.SUCCESS
        assert big.Code() == StatusCode.SUCCESS  # done no later than the one started after it
    assert counted.full_way == 5  # the batches; the reads took the lane


def test_deregistering_waits_for_the_lanes_transfers(counted: Counted) -> None:
    _warm(counted)
    statuses = [counted.a.write(counted.ma, i * 8192, counted.mb, i * 8192, 8192, i) for i in range(100)]
    assert counted.full_way == 0
    counted.a.deregister_memory(counted.ma)  # the engine keeps no record of these: the backend waits
    assert all(st.WaitFor(0) == StatusCode.SUCCESS for st in statuses)
    assert np.array_equal(counted.rb[: 100 * 8192], counted.la[: 100 * 8192])
    last = statuses[-1]
    assert last.Succeeded() and last.Message() == "" and "SUCCESS" in repr(last)


def test_pairs_in_turn_each_keep_their_lane(counted: Counted) -> None:
    other = np.zeros(SIZE, dtype=np.uint8)
    m_other = counted.a.register_memory(int(other.ctypes.data), SIZE, -1, MemoryLocationType.CPU)
    pairs = [(counted.ma, counted.la), (m_other, other)]
    for local, _ in pairs * 2:  # the full way: the first connects, then each pair leaves its lane
        assert _done(counted.a.write(local, 0, counted.mb, 0, 8, 1)) == StatusCode.SUCCESS
    counted.full_way = 0
    for i in range(100):
        local, buf = pairs[i % 2]
        buf[:4096] = i
        assert _done(counted.a.write(local, 0, counted.mb, i * 4096, 4096, i)) == StatusCode.SUCCESS
        assert (counted.rb[i * 4096 : (i + 1) * 4096] == i).all()
    assert counted.full_way == 0


class _Recorder:
    """An engine's stand-in that records the worker addresses each connect is given."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.connects: list[list[bytes]] = []

    def connect(self, key: str, workers: list[bytes], *args: object, **kwargs: object) -> object:
        self.connects.append(list(workers))
        self.kwargs = kwargs
        return self._engine.connect(key, workers, *args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


def test_initiators_start_on_the_targets_workers_in_turn() -> None:
    """A target of three workers gives each next initiator the next worker to start on: three
    one-worker initiators connect to its three workers, and write byte for byte."""
    target = IOEngine("targ", IOEngineConfig())
    target.create_backend(BackendType.RDMA, RdmaBackendConfig(num_worker_threads=3))
    data = np.zeros(3 * 4096, dtype=np.uint8)
    mem = MemoryDesc.unpack(
        target.register_memory(int(data.ctypes.data), data.nbytes, -1, MemoryLocationType.CPU).pack()
    )
    addresses = list(target._backends._by_type[BackendType.RDMA]._engine.addresses)  # private: own test
    initiators, firsts = [], []
    try:
        for i in range(3):
            a = IOEngine(f"init{i}", IOEngineConfig())
            initiators.append(a)
            a.create_backend(BackendType.RDMA, RdmaBackendConfig(num_worker_threads=1))
            backend = a._backends._by_type[BackendType.RDMA]
            recorder = backend._engine = _Recorder(backend._engine)
            a.register_remote_engine(target.get_engine_desc())
            target.register_remote_engine(a.get_engine_desc())
            src = np.full(4096, i + 1, dtype=np.uint8)
            local = a.register_memory(int(src.ctypes.data), src.nbytes, -1, MemoryLocationType.CPU)
            st = a.batch_write(local, [0], mem, [i * 4096], [4096], 1)
            assert _done(st) == StatusCode.SUCCESS, st.Message()
            (workers,) = recorder.connects
            assert sorted(workers) == sorted(addresses)
            assert recorder.kwargs == {"stages_gpu": True}  # no GPUDirect here: the target stages
            firsts.append(addresses.index(workers[0]))
        assert firsts == [0, 1, 2]
        assert np.array_equal(data, np.repeat(np.arange(1, 4, dtype=np.uint8), 4096))
    finally:
        for e in [*initiators, target]:
            e.close()


@pytest.mark.parametrize(
    "field, value",
    [("first", 3), ("first", -1), ("first", True), ("first", "0"), ("stages_gpu", 1), ("stages_gpu", "")],
)
def test_a_malformed_connect_reply_is_refused(monkeypatch: pytest.MonkeyPatch, field: str, value: object) -> None:
    """A target whose reply names a starting worker it does not have (or not as an int), or
    says whether it stages GPU memory with anything but a bool, is not connected to: the
    transfer fails naming the malformed reply, and nothing moves."""
    real = RdmaBackend._handle_connect

    def bad_reply(self: RdmaBackend, key: str, body: dict) -> dict:
        return {**real(self, key, body), field: value}

    monkeypatch.setattr(RdmaBackend, "_handle_connect", bad_reply)
    p = Pair()
    try:
        before = p.rb.copy()
        st = p.a.batch_write(p.ma, [0], p.mb, [0], [4096], 1)
        assert _done(st) != StatusCode.SUCCESS
        assert "malformed rdma.connect reply" in st.Message()
        assert np.array_equal(p.rb, before)
    finally:
        p.close()
