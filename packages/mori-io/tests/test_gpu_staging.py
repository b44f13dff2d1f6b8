"""GPU memory over the TCP and RDMA backends without a GPU: mori-core's native staging (its
``Stager``) runs on its host stand-in (``mori.core.testing.standin_stager``), so that host memory
registered as GPU memory goes through every step a GPU region takes (the target's staged reads
and writes, the initiator's, notifications, region checks, copy failures, deregistration while
copies run) between two engines on loopback. The same backends on real GPUs: test_tcp_gpu.py and
ci/device/rdma_gpu.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.core import testing
from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryLocationType,
    StatusCode,
    TcpBackendConfig,
)
from mori.io.backends import _gpu_staging

MiB = 1 << 20


def test_gpu_registration_without_cuda_is_refused() -> None:
    with IOEngine("nogpu", IOEngineConfig(host="127.0.0.1", port=0)) as eng:
        eng.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=1))
        with pytest.raises(RuntimeError, match="cuda-bindings and a CUDA GPU"):
            eng.register_memory(1 << 40, 4096, 0, MemoryLocationType.GPU)


@pytest.fixture
def host_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Every GPU registration of the backends gets the stand-in's stager (one per device, as
    device_stager gives); yields the stagers by device."""
    testing.standin_knobs()
    stagers: dict[int, Any] = {}

    def device_stager(device: int, **settings: Any) -> Any:
        if device not in stagers:
            stagers[device] = testing.standin_stager(settings["timeout"], settings["cache_bytes"])
        return stagers[device]

    monkeypatch.setattr(_gpu_staging, "device_stager", device_stager)
    yield stagers
    testing.standin_knobs()
    for s in stagers.values():
        assert s.stats()["lent"] == 0, "staged memory still lent after the transfers ended"


def _pair(**config: Any) -> tuple[IOEngine, IOEngine]:
    a = IOEngine("ini", IOEngineConfig(host="127.0.0.1", port=0))
    b = IOEngine("tgt", IOEngineConfig(host="127.0.0.1", port=0))
    for e in (a, b):
        e.create_backend(BackendType.TCP, TcpBackendConfig(**{"num_connections": 2, "stripe_bytes": 1 * MiB, **config}))
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    return a, b


def _done(status: Any) -> Any:
    assert status.WaitFor(30_000) != StatusCode.IN_PROGRESS, "the transfer did not finish"
    return status


def _record(engine: IOEngine, key: str, uid: int) -> Any:
    deadline = time.monotonic() + 10
    while (rec := engine.pop_inbound_transfer_status(key, uid)) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return rec


N = 9 * MiB + 77


def _moved(src: Any, dst: Any, sofs: list[int], dofs: list[int], sizes: list[int]) -> Any:
    """What ``dst`` should hold once each block of ``src`` at ``sofs`` has landed at ``dofs``."""
    want = dst.copy()
    for s, d, n in zip(sofs, dofs, sizes):
        want[d : d + n] = src[s : s + n]
    return want


@pytest.mark.parametrize("local_loc,remote_loc", [("GPU", "GPU"), ("GPU", "CPU"), ("CPU", "GPU")])
@pytest.mark.parametrize("write", [True, False])
def test_staged_transfers_byte_for_byte(host_gpu: Any, local_loc: str, remote_loc: str, write: bool) -> None:
    a, b = _pair()
    rng = np.random.default_rng(7)
    mine, theirs = rng.integers(0, 256, N, dtype=np.uint8), rng.integers(0, 256, N, dtype=np.uint8)
    try:
        # Sub-regions at odd offsets of larger arrays, as sub-allocated tensors.
        ld = a.register_memory(mine.ctypes.data + 3, N - 3, 0, MemoryLocationType[local_loc])
        rd = b.register_memory(theirs.ctypes.data + 5, N - 5, 0, MemoryLocationType[remote_loc])
        op = a.batch_write if write else a.batch_read
        cases = [
            ([0], [0], [1]),
            ([0], [0], [4096]),
            ([7], [11], [64 << 10]),
            ([1], [2], [N - 8]),  # one block of many staging pieces
            # several blocks of several pieces each: the copies run ahead across blocks
            ([0, 2 * MiB + 1, 4 * MiB + 2], [5 * MiB, 3 * MiB, 17], [MiB + 5, 2 * MiB - 1, 700_000]),
            (list(range(0, 4096 * 300, 4096)), list(range(4096 * 299, -1, -4096)), [4096] * 300),
            (
                list(rng.permutation(64)[:64] * (64 << 10)),
                list(range(0, 64 * (64 << 10), 64 << 10)),
                [64 << 10] * 64,
            ),  # KV pages
            (list(rng.permutation(2000)[:500] * 1000), list(rng.permutation(2000)[:500] * 1000), [999] * 500),
        ]
        for i, (lo, ro, sz) in enumerate(cases):
            src, dst = (mine, theirs) if write else (theirs, mine)
            sbase, dbase = (3, 5) if write else (5, 3)
            sofs, dofs = (lo, ro) if write else (ro, lo)
            want = _moved(src, dst, [sbase + s for s in sofs], [dbase + d for d in dofs], sz)
            st_ = _done(op(ld, lo, rd, ro, sz, 100 + i))
            assert st_.Succeeded(), st_.Message()
            assert np.array_equal(dst, want), f"case {i}"
            rec = _record(b, "ini", 100 + i)
            assert rec is not None and rec.Succeeded()
        sess = a.create_session(ld, rd)
        assert sess is not None
        st_ = _done((sess.write if write else sess.read)(100, 200, 300_000, 999))
        assert st_.Succeeded(), st_.Message()
        s, d = (mine[103:300_103], theirs[205:300_205]) if write else (theirs[205:300_205], mine[103:300_103])
        assert np.array_equal(s, d)
    finally:
        a.close()
        b.close()


# Block sizes around the staging's piece sizes (256 KiB first pieces, 1 MiB pieces, 64 KiB pool
# capacities) and odd ones.
_SIZES = st.one_of(
    st.integers(1, 5000),
    st.sampled_from([4096, 64 << 10, (256 << 10) - 1, (256 << 10) + 1, MiB, MiB + 3, 3 * MiB - 5]),
)


def _layout(data: Any, sizes: list[int], region: int) -> list[int]:
    """Offsets of blocks of these sizes that do not overlap, in a random order, some of them
    back to back (as KV pages allocated in turn), all inside ``region`` bytes."""
    gaps = [data.draw(st.sampled_from([0, 0, 1, 4096, 12_345]), label="gap") for _ in sizes]
    order = data.draw(st.permutations(range(len(sizes))), label="order")
    offsets, at = [0] * len(sizes), 0
    for i in order:
        offsets[i] = at + gaps[i]
        at = offsets[i] + sizes[i]
    assert at <= region
    return offsets


@pytest.mark.parametrize("local_loc,remote_loc", [("GPU", "GPU"), ("GPU", "CPU"), ("CPU", "GPU")])
def test_random_staged_batches_byte_for_byte(host_gpu: Any, local_loc: str, remote_loc: str) -> None:
    """Batches of random blocks at random places (hypothesis), read and written through the
    staging at one end or both, over two connections: every byte lands where it should, and no
    other byte changes."""
    region = 12 * MiB
    a, b = _pair()
    rng = np.random.default_rng(11)
    mine, theirs = rng.integers(0, 256, region, dtype=np.uint8), rng.integers(0, 256, region, dtype=np.uint8)
    uids = iter(range(1000, 100_000))
    try:
        ld = a.register_memory(mine.ctypes.data, region, 0, MemoryLocationType[local_loc])
        rd = b.register_memory(theirs.ctypes.data, region, 0, MemoryLocationType[remote_loc])

        @settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
        @given(data=st.data())
        def one_batch(data: Any) -> None:
            sizes = data.draw(st.lists(_SIZES, min_size=1, max_size=10).filter(lambda s: sum(s) <= 9 * MiB))
            write = data.draw(st.booleans(), label="write")
            lo, ro = _layout(data, sizes, region), _layout(data, sizes, region)
            src, dst = (mine, theirs) if write else (theirs, mine)
            sofs, dofs = (lo, ro) if write else (ro, lo)
            src[:] = rng.integers(0, 256, region, dtype=np.uint8)
            want = _moved(src, dst, sofs, dofs, sizes)
            st_ = _done((a.batch_write if write else a.batch_read)(ld, lo, rd, ro, sizes, next(uids)))
            assert st_.Succeeded(), st_.Message()
            assert np.array_equal(dst, want)

        one_batch()
    finally:
        a.close()
        b.close()


def test_forged_offsets_into_a_gpu_region_are_refused_and_nothing_lands(host_gpu: Any) -> None:
    a, b = _pair()
    mine = np.random.default_rng(1).integers(0, 256, MiB, dtype=np.uint8)
    theirs = np.zeros(2 * MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.GPU)
        rd = b.register_memory(theirs.ctypes.data, 4096, 0, MemoryLocationType.GPU)
        forged = dataclasses.replace(rd, size=2 * MiB)  # claims more than the target registered
        for uid, (off, size) in enumerate([(0, 8192), (4000, 200), (1 << 20, 4096)], 1):
            for op in (a.write, a.read):
                st_ = _done(op(ld, 0, forged, off, size, uid))
                assert st_.Code() == StatusCode.ERR_INVALID_ARGS, st_.Message()
        st_ = _done(a.write(ld, 0, dataclasses.replace(rd, id=rd.id + 77), 0, 100, 9))
        assert st_.Code() == StatusCode.ERR_NOT_FOUND, st_.Message()
        assert not theirs.any(), "bytes landed in or beyond the region before the check"
        rec = _record(b, "ini", 1)
        assert rec is not None and rec.Code() == StatusCode.ERR_INVALID_ARGS
        b.deregister_memory(rd)
        st_ = _done(a.read(ld, 0, rd, 0, 100, 10))
        assert st_.Code() == StatusCode.ERR_NOT_FOUND, st_.Message()
    finally:
        a.close()
        b.close()


def test_a_refused_block_among_staged_reads_served_ahead(host_gpu: Any) -> None:
    """The target serves a batch's staged reads from one source, their regions acquired as their
    requests arrive: a block it refuses in the middle gets its refusal and nothing of it lands,
    the blocks around it are served, and the connection goes on."""
    a, b = _pair(num_connections=1)
    theirs = np.random.default_rng(3).integers(0, 256, MiB, dtype=np.uint8)
    mine = np.zeros(MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.CPU)
        rd = b.register_memory(theirs.ctypes.data, theirs.size, 0, MemoryLocationType.GPU)
        forged = dataclasses.replace(rd, size=2 * MiB)
        size, bad = 16 << 10, 20
        ro = [i * size for i in range(40)]  # back to back: they share the target's copies
        ro[bad] = MiB + 4096  # past the registration
        lo = [i * size for i in range(40)]
        (stager,) = host_gpu.values()
        copies = stager.stats()["to_host"]
        st_ = _done(a.batch_read(ld, lo, forged, ro, [size] * 40, 1))
        assert st_.Code() == StatusCode.ERR_INVALID_ARGS, st_.Message()
        assert stager.stats()["to_host"] - copies < 39, "the 39 blocks served were not copied out together"
        for i in range(40):
            got = mine[lo[i] : lo[i] + size]
            if i == bad:
                assert not got.any(), "bytes of a refused block landed"
            else:
                assert np.array_equal(got, theirs[ro[i] : ro[i] + size]), f"block {i}"
        mine[:] = 0
        assert _done(a.batch_read(ld, lo[:bad], rd, ro[:bad], [size] * bad, 2)).Succeeded()
        assert np.array_equal(mine[: bad * size], theirs[: bad * size])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("refuse_batch", [False, True], ids=["batch-call", "one-call-each"])
@pytest.mark.parametrize("layout", ["back-to-back", "scattered"])
@pytest.mark.parametrize("write", [True, False])
def test_small_staged_blocks_share_their_copies(host_gpu: Any, write: bool, layout: str, refuse_batch: bool) -> None:
    """Small blocks received one after another into GPU memory land together and go to the device
    in shared copies (the target's for a write, the initiator's for a read), wherever they land:
    back to back (with a gap halfway) or scattered, as KV pages are; the blocks they leave are
    copied out of the GPU together too. With a driver that refuses the batch call the copies go
    one call each. Every byte checked."""
    a, b = _pair(num_connections=1)
    rng = np.random.default_rng(5)
    mine, theirs = rng.integers(0, 256, 4 * MiB, dtype=np.uint8), rng.integers(0, 256, 4 * MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.GPU)
        rd = b.register_memory(theirs.ctypes.data, theirs.size, 0, MemoryLocationType.GPU)
        size, n = 16 << 10, 48
        # In reverse order where they leave (so that the batch cannot merge them into larger blocks).
        sofs = [(n - 1 - i) * size for i in range(n)]
        if layout == "back-to-back":
            dofs = [i * size + (12_345 if i >= n // 2 else 0) for i in range(n)]
        else:
            dofs = [int(slot) * size for slot in rng.permutation(4 * MiB // size)[:n]]
        src, dst = (mine, theirs) if write else (theirs, mine)
        lo, ro = (sofs, dofs) if write else (dofs, sofs)
        want = _moved(src, dst, sofs, dofs, [size] * n)
        (stager,) = host_gpu.values()
        before, batches = stager.stats(), testing.standin_counters()["batches"]
        testing.standin_knobs(refuse_batch=refuse_batch)
        st_ = _done((a.batch_write if write else a.batch_read)(ld, lo, rd, ro, [size] * n, 1))
        assert st_.Succeeded(), st_.Message()
        assert np.array_equal(dst, want)
        # How many blocks share a copy depends on how they arrive (a run ends whenever the socket
        # has nothing more for the moment: 2-5 copies on an idle machine, a dozen under load).
        after = stager.stats()
        assert after["to_device"] - before["to_device"] < n, "every block went to the device in a copy of its own"
        assert after["to_host"] - before["to_host"] < n, "every block left the GPU in a copy of its own"
        made = testing.standin_counters()["batches"] - batches
        assert made == 0 if refuse_batch else made > 0, f"{made} batch calls"
    finally:
        testing.standin_knobs()
        a.close()
        b.close()


@pytest.mark.parametrize("backend", ["tcp", "rdma"])
@pytest.mark.parametrize("write", [True, False])
def test_blocks_landing_on_the_same_bytes_land_in_order(
    host_gpu: Any, monkeypatch: pytest.MonkeyPatch, write: bool, backend: str
) -> None:
    """Small blocks share a scattered copy (TCP: received in a row; RDMA: grouped in a message),
    whose copies run in no set order: a block that lands on bytes an earlier block of the run or
    group landed on goes in a later copy, so that, as in host memory, the later block wins (on
    RDMA, among the blocks of one lane: a single-lane pair here). Every byte checked."""
    a, b = _pair(num_connections=1) if backend == "tcp" else _rdma_pair(monkeypatch)
    rng = np.random.default_rng(13)
    mine, theirs = rng.integers(0, 256, MiB, dtype=np.uint8), rng.integers(0, 256, MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, MiB, 0, MemoryLocationType.GPU)
        rd = b.register_memory(theirs.ctypes.data, MiB, 0, MemoryLocationType.GPU)
        size = 16 << 10
        sofs = [i * size for i in range(12)][::-1]
        dofs = [9, 3, 5, 3, 20, 7, 9, 30, 5, 1, 3, 11]  # slots 3, 5 and 9 written again later
        dofs = [d * size + (4096 if i == 6 else 0) for i, d in enumerate(dofs)]  # one overlaps in part
        src, dst = (mine, theirs) if write else (theirs, mine)
        lo, ro = (sofs, dofs) if write else (dofs, sofs)
        want = _moved(src, dst, sofs, dofs, [size] * 12)
        st_ = _done((a.batch_write if write else a.batch_read)(ld, lo, rd, ro, [size] * 12, 1))
        assert st_.Succeeded(), st_.Message()
        assert np.array_equal(dst, want)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("write", [True, False])
def test_one_shared_copy_takes_at_most_256_blocks(host_gpu: Any, write: bool) -> None:
    """600 blocks of 64 bytes, scattered at both ends, fit in one landing's bytes: no copy takes
    more than 256 of them (a peer's tiny blocks cannot make one copy of a million). Every byte
    checked."""
    a, b = _pair(num_connections=1)
    rng = np.random.default_rng(9)
    mine, theirs = rng.integers(0, 256, MiB, dtype=np.uint8), rng.integers(0, 256, MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.GPU)
        rd = b.register_memory(theirs.ctypes.data, theirs.size, 0, MemoryLocationType.GPU)
        size, n = 64, 600
        sofs, dofs = ([int(s) * size for s in rng.permutation(MiB // size)[:n]] for _ in range(2))
        src, dst = (mine, theirs) if write else (theirs, mine)
        lo, ro = (sofs, dofs) if write else (dofs, sofs)
        want = _moved(src, dst, sofs, dofs, [size] * n)
        st_ = _done((a.batch_write if write else a.batch_read)(ld, lo, rd, ro, [size] * n, 1))
        assert st_.Succeeded(), st_.Message()
        assert np.array_equal(dst, want)
        assert 0 < testing.standin_counters()["largest_batch"] <= 256
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("write", [True, False])
def test_a_failed_shared_copy_fails_every_block_in_it(host_gpu: Any, write: bool) -> None:
    """Eight small blocks from host memory land back to back in GPU memory, sharing landings and
    their copies (the only copies of the transfer): when the first such copy fails, the transfer
    never reports success, and the next one succeeds."""
    a, b = _pair(num_connections=1)
    host, gpu = np.full(MiB, 3, dtype=np.uint8), np.zeros(MiB, dtype=np.uint8)
    try:
        local, remote = (host, gpu) if write else (gpu, host)
        kinds = (MemoryLocationType.CPU, MemoryLocationType.GPU)
        ld = a.register_memory(local.ctypes.data, MiB, 0, kinds[not write])
        rd = b.register_memory(remote.ctypes.data, MiB, 0, kinds[write])
        ascending = [i * (16 << 10) for i in range(8)]
        lo, ro = (ascending[::-1], ascending) if write else (ascending, ascending[::-1])
        op = a.batch_write if write else a.batch_read
        testing.standin_knobs(fail_copy_in=0)
        st_ = _done(op(ld, lo, rd, ro, [16 << 10] * 8, 2))
        testing.standin_knobs()
        assert not st_.Succeeded(), "SUCCESS although the blocks' copy to the device failed"
        assert st_.Code() in (StatusCode.ERR_GPU_OP, StatusCode.ERR_BAD_STATE), st_.Message()
        st_ = _done(op(ld, lo, rd, ro, [16 << 10] * 8, 3))
        assert st_.Succeeded(), st_.Message()
        assert (gpu[: 8 << 14] == 3).all()
    finally:
        testing.standin_knobs()
        a.close()
        b.close()


def test_deregistration_waits_for_staged_reads_served_ahead(host_gpu: Any) -> None:
    """Deregistering a GPU region while the target's copies out of it for a batch read still run
    waits for them; the read then either succeeded with every byte or failed."""
    a, b = _pair(num_connections=1)
    theirs, mine = np.full(MiB, 5, dtype=np.uint8), np.zeros(MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.CPU)
        rd = b.register_memory(theirs.ctypes.data, theirs.size, 0, MemoryLocationType.GPU)
        assert _done(a.read(ld, 0, rd, 0, 4096, 1)).Succeeded()
        testing.standin_knobs(delay=0.3)  # each copy out of the target's "GPU" ends 0.3 s after it starts
        offsets = [i * (64 << 10) for i in range(12)]
        # Reversed at this end, so that the batch keeps 12 blocks rather than merging them into one.
        st_ = a.batch_read(ld, offsets[::-1], rd, offsets, [64 << 10] * 12, 2)
        time.sleep(0.1)  # the requests are in, the first copies running
        started = time.monotonic()
        done = threading.Event()
        threading.Thread(target=lambda: (b.deregister_memory(rd), done.set()), daemon=True).start()
        assert done.wait(20)
        assert time.monotonic() - started >= 0.15, "deregistration did not wait for the staged copies"
        st_ = _done(st_)
        if st_.Succeeded():
            assert np.array_equal(mine[: 12 << 16], theirs[: 12 << 16])
    finally:
        testing.standin_knobs()
        a.close()
        b.close()


@pytest.mark.parametrize("write", [True, False])
@pytest.mark.parametrize("size", [4096, 3 * MiB])
def test_a_failed_copy_at_either_end_never_reports_success(host_gpu: Any, write: bool, size: int) -> None:
    a, b = _pair(num_connections=1)
    mine, theirs = np.ones(4 * MiB, dtype=np.uint8), np.zeros(4 * MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.GPU)
        rd = b.register_memory(theirs.ctypes.data, theirs.size, 0, MemoryLocationType.GPU)
        assert _done(a.write(ld, 0, rd, 0, size, 1)).Succeeded()  # connections up, one staged copy at each end
        for uid, fail_in in enumerate([0, 1, 2], 2):  # the first, second or third copy from now fails
            testing.standin_knobs(fail_copy_in=fail_in)
            st_ = _done((a.write if write else a.read)(ld, 0, rd, 0, size, uid))
            testing.standin_knobs()
            if fail_in < 2 or size > MiB:  # a transfer makes 2 copies per MiB piece: one of them failed
                assert not st_.Succeeded(), f"SUCCESS although copy {fail_in} failed"
                assert st_.Code() in (StatusCode.ERR_GPU_OP, StatusCode.ERR_BAD_STATE), st_.Message()
                assert "GPU" in st_.Message() or "copy" in st_.Message(), st_.Message()
            st_ = _done(a.write(ld, 0, rd, 0, size, 100 + uid))  # and the backend carries on
            assert st_.Succeeded(), st_.Message()
            assert np.array_equal(theirs[:size], mine[:size])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("backend", ["tcp", "rdma"])
def test_deregistration_waits_for_staged_copies_in_flight(
    host_gpu: Any, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    a, b = _pair(num_connections=1) if backend == "tcp" else _rdma_pair(monkeypatch)
    mine, theirs = np.full(MiB, 9, dtype=np.uint8), np.zeros(MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.CPU)
        rd = b.register_memory(theirs.ctypes.data, theirs.size, 0, MemoryLocationType.GPU)
        assert _done(a.write(ld, 0, rd, 0, 4096, 1)).Succeeded()
        testing.standin_knobs(delay=0.5)  # the target's copy to its "GPU" ends 0.5 s after it starts
        st_ = a.write(ld, 0, rd, 0, MiB, 2)
        time.sleep(0.1)  # the bytes are in, their copy running
        started = time.monotonic()
        done = threading.Event()
        threading.Thread(target=lambda: (b.deregister_memory(rd), done.set()), daemon=True).start()
        assert done.wait(10)
        assert time.monotonic() - started >= 0.2, "deregistration did not wait for the staged copy"
        assert _done(st_).Succeeded(), st_.Message()
        assert np.array_equal(theirs, mine)
    finally:
        testing.standin_knobs()
        a.close()
        b.close()


def test_the_engine_says_how_gpu_memory_travels(host_gpu: Any) -> None:
    a, b = _pair()
    try:
        tcp = a.describe()["backends"]["TCP"]
        assert "staged" in tcp["gpu_memory"] and tcp["port"] > 0
    finally:
        a.close()
        b.close()


# ---- the RDMA backend over UCX tcp: GPU memory staged by the UCX engine through the same Stager --
def _rdma_pair(monkeypatch: pytest.MonkeyPatch) -> tuple[IOEngine, IOEngine]:
    from mori.io import RdmaBackendConfig

    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    a = IOEngine("ini", IOEngineConfig(host="127.0.0.1", port=0))
    b = IOEngine("tgt", IOEngineConfig(host="127.0.0.1", port=0))
    for e in (a, b):
        e.create_backend(BackendType.RDMA, RdmaBackendConfig(num_worker_threads=1))
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    return a, b


@pytest.mark.parametrize("local_loc,remote_loc", [("GPU", "GPU"), ("GPU", "CPU"), ("CPU", "GPU")])
def test_rdma_backend_stages_gpu_memory_over_ucx_tcp(
    host_gpu: Any, monkeypatch: pytest.MonkeyPatch, local_loc: str, remote_loc: str
) -> None:
    a, b = _rdma_pair(monkeypatch)
    rng = np.random.default_rng(3)
    mine, theirs = rng.integers(0, 256, N, dtype=np.uint8), rng.integers(0, 256, N, dtype=np.uint8)
    try:
        rdma = a.describe()["backends"]["RDMA"]
        assert rdma["gpu_memory"].startswith("staged through pinned host memory (no transport with GPUDirect: tcp")
        ld = a.register_memory(mine.ctypes.data, N, 0, MemoryLocationType[local_loc])
        rd = b.register_memory(theirs.ctypes.data, N, 0, MemoryLocationType[remote_loc])
        for i, (lo, ro, sz) in enumerate(
            [
                ([0], [0], [4096]),
                ([5], [9], [N - 20]),
                (list(range(0, 64 << 16, 1 << 16)), list(range(0, 64 << 16, 1 << 16))[::-1], [1 << 16] * 64),
                # Small blocks, scattered at both ends: they travel grouped.
                (
                    list(range(0, 300 * 5000, 5000)),
                    [int(x) * 4000 for x in rng.permutation(N // 4000)[:300]],
                    [3000] * 300,
                ),
            ]
        ):
            for write in (True, False):
                src, dst = (mine, theirs) if write else (theirs, mine)
                sofs, dofs = (lo, ro) if write else (ro, lo)
                if not write:
                    theirs[:] = rng.integers(0, 256, N, dtype=np.uint8)
                want = dst.copy()
                for s, d, n in zip(sofs, dofs, sz):
                    want[d : d + n] = src[s : s + n]
                st_ = _done((a.batch_write if write else a.batch_read)(ld, lo, rd, ro, sz, 10 * i + write))
                assert st_.Succeeded(), st_.Message()
                assert np.array_equal(dst, want), (i, write)
        assert sum(s.stats()["pinned"] for s in host_gpu.values()) > 0, "nothing went through the staging"
        forged = dataclasses.replace(rd, size=N + MiB)
        before = theirs.copy()
        st_ = _done(a.write(ld, 0, forged, N - 4096, 8192, 99))
        assert st_.Code() == StatusCode.ERR_INVALID_ARGS and np.array_equal(theirs, before), st_.Message()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("refuse_batch", [False, True], ids=["batch-call", "one-call-each"])
@pytest.mark.parametrize("write", [True, False])
def test_rdma_small_staged_blocks_travel_grouped_and_a_failed_copy_fails_the_transfer(
    host_gpu: Any, monkeypatch: pytest.MonkeyPatch, write: bool, refuse_batch: bool
) -> None:
    """A batch of small blocks between GPU regions over UCX tcp travels grouped, as host memory's
    does: one message of up to 256 KiB, its blocks gathered out of the GPU by one copy and
    scattered into it by one copy, which go to the worker's progress loop. With copies that end
    late every byte still lands before the transfer succeeds; when the last copy in fails, the
    transfer never reports success. With a driver that refuses the batch call, one call per
    block."""
    a, b = _rdma_pair(monkeypatch)
    rng = np.random.default_rng(11)
    mine, theirs = rng.integers(0, 256, MiB, dtype=np.uint8), rng.integers(0, 256, MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, MiB, 0, MemoryLocationType.GPU)
        rd = b.register_memory(theirs.ctypes.data, MiB, 0, MemoryLocationType.GPU)
        size, n = 4096, 32
        sofs, dofs = ([int(s) * size for s in rng.permutation(MiB // size)[:n]] for _ in range(2))
        src, dst = (mine, theirs) if write else (theirs, mine)
        lo, ro = (sofs, dofs) if write else (dofs, sofs)
        op = a.batch_write if write else a.batch_read
        want = _moved(src, dst, sofs, dofs, [size] * n)
        (stager,) = host_gpu.values()
        before, calls = stager.stats(), testing.standin_counters()["copies"]
        testing.standin_knobs(delay=0.002, refuse_batch=refuse_batch)
        st_ = _done(op(ld, lo, rd, ro, [size] * n, 1))
        assert st_.Succeeded(), st_.Message()
        assert np.array_equal(dst, want)
        after, calls = stager.stats(), testing.standin_counters()["copies"] - calls
        # Both engines share the one stand-in stager: one copy out and one in per group of 128 KiB.
        assert after["to_host"] - before["to_host"] == 1 and after["to_device"] - before["to_device"] == 1
        assert calls == (2 * n if refuse_batch else 2), f"{calls} driver calls"
        # The last driver call is the copy in (the target's for a write, this engine's for a read).
        testing.standin_knobs(fail_copy_in=calls - 1, refuse_batch=refuse_batch)
        st_ = _done(op(ld, lo, rd, ro, [size] * n, 2))
        testing.standin_knobs()
        assert not st_.Succeeded(), "SUCCESS although a block's staged copy failed"
        assert _done(op(ld, lo, rd, ro, [size] * n, 3)).Succeeded()
    finally:
        testing.standin_knobs()
        a.close()
        b.close()


def test_a_group_into_gpu_memory_hidden_by_its_descriptor(host_gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An initiator that takes the target's GPU region for host memory (a descriptor saying CPU)
    groups small blocks as for host memory: the target scatters them into the GPU by one copy,
    every byte in place; a group whose blocks land on the same bytes, which one copy cannot
    order, is refused (ERR_INVALID_ARGS, naming remote_gpu) and nothing of it lands. (UCX's
    path: the same-host path, which such a transfer would take, refuses GPU memory outright.)"""
    monkeypatch.setenv("MORI_IO_RDMA_SAME_HOST", "0")
    a, b = _rdma_pair(monkeypatch)
    rng = np.random.default_rng(17)
    mine, theirs = rng.integers(0, 256, MiB, dtype=np.uint8), rng.integers(0, 256, MiB, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, MiB, 0, MemoryLocationType.CPU)
        rd = b.register_memory(theirs.ctypes.data, MiB, 0, MemoryLocationType.GPU)
        hidden = dataclasses.replace(rd, loc=MemoryLocationType.CPU)
        size = 4096
        sofs = [i * size for i in range(16)]
        dofs = [int(s) * size for s in rng.permutation(MiB // size)[:16]]
        want = _moved(mine, theirs, sofs, dofs, [size] * 16)
        st_ = _done(a.batch_write(ld, sofs, hidden, dofs, [size] * 16, 1))
        assert st_.Succeeded(), st_.Message()
        assert np.array_equal(theirs, want)
        before = theirs.copy()
        st_ = _done(a.batch_write(ld, sofs[:3], hidden, [0, 8192, 4096 + 100], [size] * 3, 2))
        assert st_.Code() == StatusCode.ERR_INVALID_ARGS and "remote_gpu" in st_.Message(), st_.Message()
        assert np.array_equal(theirs, before)
    finally:
        a.close()
        b.close()
