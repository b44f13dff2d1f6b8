"""GPU staging of the TCP backend without a GPU: chunk planning (replayed on host memory), the
pinned-buffer pool, target slot leases, the error paths, and the whole staged pipeline (control
ops, leases, chunk loop, notifications) between two engines with the device copies done on host
memory. The same pipeline on real GPUs: test_tcp_gpu.py."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core.batch import Batch
from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryLocationType,
    StatusCode,
    TcpBackendConfig,
)
from mori.io.backends.tcp import _gpu as _tcp_gpu
from mori.io.backends.tcp._staging import SlotLeases, StagingPool, check_pieces, chunk_bytes_for
from mori.io.backends.tcp.plan import plan_chunks


def _replay(src: np.ndarray, dst: np.ndarray, l_offs: list[int], r_offs: list[int], sizes: list[int],
            chunk: int, max_pieces: int) -> None:
    """A write (local src -> remote dst) through one staging buffer per chunk, as the backend does."""
    buf = np.zeros(chunk, dtype=np.uint8)
    for c in plan_chunks(Batch(l_offs, r_offs, sizes), chunk, max_pieces):
        assert 0 < c.nbytes <= chunk and 0 < len(c.sizes) <= max_pieces
        assert (c.packed == np.cumsum(c.sizes) - c.sizes).all() and (c.sizes > 0).all()
        buf[:] = 0
        for lo, pk, n in zip(c.local.tolist(), c.packed.tolist(), c.sizes.tolist()):
            buf[pk:pk + n] = src[lo:lo + n]
        for ro, pk, n in zip(c.remote.tolist(), c.packed.tolist(), c.sizes.tolist()):
            dst[ro:ro + n] = buf[pk:pk + n]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.integers(0, 700)), max_size=40),
       st.integers(1, 1024), st.integers(1, 8), st.integers(0, 2**32))
def test_plan_moves_every_byte_once(blocks: list[tuple[int, int, int]], chunk: int, max_pieces: int, seed: int) -> None:
    # Disjoint destinations (a KV batch never writes a byte twice): keep blocks whose remote
    # span does not overlap an earlier one.
    kept, taken = [], np.zeros(4000, dtype=bool)
    for lo, ro, n in blocks:
        if not taken[ro:ro + n].any():
            taken[ro:ro + n] = True
            kept.append((lo, ro, n))
    l_offs, r_offs, sizes = ([b[i] for b in kept] for i in range(3))
    src = np.random.default_rng(seed).integers(0, 256, 4000, dtype=np.uint8)
    want, got = np.zeros(4000, dtype=np.uint8), np.zeros(4000, dtype=np.uint8)
    for lo, ro, n in kept:
        want[ro:ro + n] = src[lo:lo + n]
    _replay(src, got, l_offs, r_offs, sizes, chunk, max_pieces)
    assert np.array_equal(got, want)


def test_plan_merges_contiguous_blocks_and_cuts_big_ones() -> None:
    chunks = plan_chunks(Batch(np.arange(1000) * 4096, np.arange(1000) * 4096, np.full(1000, 4096)), 1 << 20)
    assert [len(c.sizes) for c in chunks] == [1, 1, 1, 1] and [c.nbytes for c in chunks] == [1 << 20] * 3 + [
        4096 * 1000 - 3 * (1 << 20)]
    assert plan_chunks(Batch([0, 5], [0, 9], [0, 0]), 4096) == []


def test_check_pieces_names_the_problem() -> None:
    a = np.array
    assert check_pieces(a([0, 100]), a([100, 50]), 150, 4096) == ""
    assert "past the end" in check_pieces(a([0, 100]), a([100, 51]), 150, 4096)
    assert "past the end" in check_pieces(a([2**62]), a([2**62]), 150, 4096)  # no overflow
    assert "exceed a staging buffer" in check_pieces(a([0]), a([5000]), 1 << 20, 4096)
    assert "sizes > 0" in check_pieces(a([0]), a([0]), 10, 4096)
    assert "expected 1.." in check_pieces(a([0]), a([1, 2]), 10, 4096)


class _HostMemory:
    """alloc/free over ctypes buffers, recording what is live."""

    def __init__(self) -> None:
        self.live: dict[int, Any] = {}

    def alloc(self, n: int) -> int:
        buf = ctypes.create_string_buffer(n)
        self.live[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, addr: int) -> None:
        del self.live[addr]


def test_pool_is_bounded_allocated_once_and_checked() -> None:
    mem = _HostMemory()
    pool = StagingPool(10 << 20, mem.alloc, mem.free)
    assert (pool.chunk_bytes, pool.count, mem.live) == (4 << 20, 2, {})  # nothing until first use
    a = pool.acquire(1.0)
    b = pool.try_acquire()
    assert b is not None and a != b and sorted(mem.live) == sorted([a, b])  # one pinned block each
    assert pool.try_acquire() is None
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="MORI_IO_TCP_STAGING_SIZE"):
        pool.acquire(0.2)
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.1, pool.release, (a,)).start()
    assert pool.acquire(5.0) == a  # a waiter gets a returned buffer
    with pytest.raises(ValueError, match="not a staging buffer in use"):
        pool.release(a + 1)
    assert not pool.close() and len(mem.live) == 2  # still in use: not freed
    pool.release(a)
    pool.release(b)  # returned after close: freed then
    with pytest.raises(ValueError):
        pool.release(b)
    assert pool.close() and mem.live == {}
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1.0)
    assert chunk_bytes_for(256 << 10) == 128 << 10
    with pytest.raises(ValueError, match="MORI_IO_TCP_STAGING_SIZE=131071 is too small"):
        chunk_bytes_for(131071)


def test_leases_are_per_engine_and_expire() -> None:
    mem = _HostMemory()
    exposed: dict[int, tuple[int, int]] = {}
    leases = SlotLeases(StagingPool(256 << 10, mem.alloc, mem.free), 0.3,
                        lambda i, addr, n: exposed.__setitem__(i, (addr, n)), exposed.pop)
    a = leases.take_buffer()
    assert a is not None
    slot = leases.lend("x", a)
    assert slot >= 1 << 62 and exposed[slot] == (a, 128 << 10)
    with pytest.raises(KeyError, match="'y'"):
        leases.take_back("y", slot)  # another engine cannot use it
    assert leases.take_back("x", slot) == a and slot not in exposed
    leases.return_buffer(a)
    slots = [leases.lend("x", leases.take_buffer()) for _ in range(2)]  # type: ignore[arg-type]
    assert leases.take_buffer() is None  # both lent
    time.sleep(0.35)
    b = leases.take_buffer()  # the expired leases are reclaimed
    assert b is not None and not set(slots) & set(exposed)
    leases.lend("z", b)
    leases.release_engine("z")
    assert exposed == {} and leases.pool.in_use == 0


def test_gpu_registration_without_cuda_is_refused() -> None:
    with IOEngine("nogpu", IOEngineConfig(host="127.0.0.1", port=0)) as eng:
        eng.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=1))
        with pytest.raises(RuntimeError, match="cuda-bindings and a CUDA GPU"):
            eng.register_memory(1 << 40, 4096, 0, MemoryLocationType.GPU)


def test_bad_staging_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_IO_TCP_STAGING_SIZE", "64K")
    with IOEngine("small", IOEngineConfig(host="127.0.0.1", port=0)) as eng, \
            pytest.raises(ValueError, match="MORI_IO_TCP_STAGING_SIZE=65536 is too small"):
        eng.create_backend(BackendType.TCP)
    monkeypatch.setenv("MORI_IO_TCP_STAGING_SIZE", "lots")
    with IOEngine("bad", IOEngineConfig(host="127.0.0.1", port=0)) as eng, \
            pytest.raises(ValueError, match="MORI_IO_TCP_STAGING_SIZE"):
        eng.create_backend(BackendType.TCP)


# ---- the staged pipeline, device copies on host memory ------------------------------------------
class _HostCopies:
    """Stands in for a device's CUDA copies: the same calls, done at once with memmove."""

    def __init__(self, device: int) -> None:
        self.device = device

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> object:
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)
        return object()

    def wait(self, done: object, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def host_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    mem = _HostMemory()
    monkeypatch.setenv("MORI_IO_TCP_STAGING_SIZE", "256K")  # 2 buffers of 128 KiB: many chunks, contention
    monkeypatch.setattr(_tcp_gpu, "DeviceCopies", _HostCopies)
    monkeypatch.setattr(_tcp_gpu, "pinned_alloc", mem.alloc)
    monkeypatch.setattr(_tcp_gpu, "pinned_free", mem.free)
    monkeypatch.setattr(_tcp_gpu, "gpu_region_check", lambda desc: None)
    monkeypatch.setattr(_tcp_gpu, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_tcp_gpu, "_cuda", types.SimpleNamespace(init_device=lambda d: None,
                                                                 CudaError=_tcp_gpu._cuda.CudaError))
    yield
    assert mem.live == {}, "pinned staging memory not freed at close"


def _pair() -> tuple[IOEngine, IOEngine]:
    a = IOEngine("ini", IOEngineConfig(host="127.0.0.1", port=0))
    b = IOEngine("tgt", IOEngineConfig(host="127.0.0.1", port=0))
    for e in (a, b):
        e.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2, stripe_bytes=64 << 10))
    a.register_remote_engine(b.get_engine_desc())
    b.register_remote_engine(a.get_engine_desc())
    return a, b


N = 3 << 20


@pytest.mark.parametrize("local_loc,remote_loc", [("GPU", "GPU"), ("GPU", "CPU"), ("CPU", "GPU")])
@pytest.mark.parametrize("write", [True, False])
def test_staged_pipeline_byte_for_byte(host_gpu: None, local_loc: str, remote_loc: str, write: bool) -> None:
    a, b = _pair()
    rng = np.random.default_rng(7)
    mine, theirs = rng.integers(0, 256, N, dtype=np.uint8), rng.integers(0, 256, N, dtype=np.uint8)
    try:
        # Sub-regions at odd offsets of larger arrays, as sub-allocated tensors.
        ld = a.register_memory(mine.ctypes.data + 3, N - 3, 0, MemoryLocationType[local_loc])
        rd = b.register_memory(theirs.ctypes.data + 5, N - 5, 0, MemoryLocationType[remote_loc])
        op = a.batch_write if write else a.batch_read
        cases = [([0], [0], [1]), ([7], [11], [1 << 20]),  # one block over many chunks
                 (list(range(0, 4096 * 300, 4096)), list(range(4096 * 299, -1, -4096)), [4096] * 300),
                 (rng.permutation(2000)[:500] * 1000, rng.permutation(2000)[:500] * 1000, [999] * 500)]
        for i, (lo, ro, sz) in enumerate(cases):
            src, dst = (mine, theirs) if write else (theirs, mine)
            sbase, dbase = (3, 5) if write else (5, 3)
            sofs, dofs = (lo, ro) if write else (ro, lo)
            want = dst.copy()
            for s, d, n in zip(sofs, dofs, sz):
                want[dbase + d:dbase + d + n] = src[sbase + s:sbase + s + n]
            st_ = op(ld, lo, rd, ro, sz, 100 + i)
            assert st_.WaitFor(30_000) != StatusCode.IN_PROGRESS and st_.Succeeded(), st_.Message()
            assert np.array_equal(dst, want), f"case {i}"
            deadline = time.monotonic() + 10
            while (rec := b.pop_inbound_transfer_status("ini", 100 + i)) is None and time.monotonic() < deadline:
                time.sleep(0.005)
            assert rec is not None and rec.Succeeded()
        sess = a.create_session(ld, rd)
        assert sess is not None
        st_ = (sess.write if write else sess.read)(100, 200, 300_000, 999)
        assert st_.WaitFor(30_000) != StatusCode.IN_PROGRESS and st_.Succeeded(), st_.Message()
        s, d = (mine[103:300_103], theirs[205:300_205]) if write else (theirs[205:300_205], mine[103:300_103])
        assert np.array_equal(s, d)
    finally:
        a.close()
        b.close()


def test_target_checks_gpu_pieces_before_any_byte_lands(host_gpu: None) -> None:
    a, b = _pair()
    mine = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    theirs = np.zeros(1 << 20, dtype=np.uint8)
    try:
        ld = a.register_memory(mine.ctypes.data, mine.size, 0, MemoryLocationType.GPU)
        rd = b.register_memory(theirs.ctypes.data, 4096, 0, MemoryLocationType.GPU)
        forged = dataclasses.replace(rd, size=1 << 20)  # claims more than the target registered
        st_ = a.write(ld, 0, forged, 0, 8192, 1)
        assert st_.WaitFor(30_000) != StatusCode.IN_PROGRESS and st_.Code() == StatusCode.ERR_INVALID_ARGS, st_
        st_ = a.write(ld, 0, dataclasses.replace(rd, id=rd.id + 77), 0, 100, 2)
        assert st_.WaitFor(30_000) != StatusCode.IN_PROGRESS and st_.Code() == StatusCode.ERR_NOT_FOUND, st_
        assert not theirs.any()
        rec = None
        deadline = time.monotonic() + 10
        while rec is None and time.monotonic() < deadline:
            rec = b.pop_inbound_transfer_status("ini", 1)
        assert rec is not None and rec.Code() == StatusCode.ERR_INVALID_ARGS
        b.deregister_memory(rd)
        st_ = a.read(ld, 0, rd, 0, 100, 3)
        assert st_.WaitFor(30_000) != StatusCode.IN_PROGRESS and st_.Code() == StatusCode.ERR_NOT_FOUND, st_
    finally:
        a.close()
        b.close()
