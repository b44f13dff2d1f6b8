"""mori.core.gpu and mori.core.memory.PinnedPool on a real GPU (device 0; one GPU is enough):
bytes through pinned blocks and device memory with batched and single copies, checked byte for
byte; streams reused while idle and added while busy; events recorded, waited and reused; the
caller's context restored. Scripted versions without a GPU: test_gpu_calls.py, test_pinned_pool.py."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from typing import Any

import pytest

from mori.core import cuda, gpu
from mori.core.memory import PinnedPool

pytestmark = pytest.mark.gpu
DEVICE = 0


@pytest.fixture(scope="module")
def ctx() -> Iterator[Any]:
    try:
        context = cuda.init_device(DEVICE)
    except (ImportError, cuda.CudaError, ValueError) as err:
        pytest.fail(f"these tests need a CUDA GPU: {err}")
    yield context


@pytest.fixture
def device_memory(ctx: Any) -> Iterator[Any]:
    allocated: list[int] = []

    def alloc(n: int) -> int:
        allocated.append(int(cuda.call("cuMemAlloc", n)))
        return allocated[-1]

    yield alloc
    for addr in allocated:
        cuda.call("cuMemFree", addr)


def test_bytes_round_trip_through_pinned_blocks_and_device_memory(ctx: Any, device_memory: Any) -> None:
    pool = PinnedPool(64 << 20, max_idle=4, name="round trip")
    streams, events, batch = gpu.StreamPool(DEVICE, 4), gpu.EventPool(DEVICE, 8), gpu.BatchMemcpy()
    n = 1 << 20
    src, back = pool.acquire(n, 1.0), pool.acquire(n, 1.0)
    data = os.urandom(n)
    ctypes.memmove(src, data, n)
    ctypes.memset(back, 0, n)
    dev = device_memory(n)
    # 1000 blocks of uneven sizes scattered over the MiB (the batch path), then one block.
    sizes = [(i * 37) % 997 + 1 for i in range(1000)]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    perm = list(reversed(offs))
    psizes = list(reversed(sizes))
    stream = streams.take()[0]
    batch.copy([dev + o for o in offs], [src + o for o in offs], sizes, stream, "to device")
    batch.copy([back + o for o in perm], [dev + o for o in perm], psizes, stream, "back")
    tail = offs[-1] + sizes[-1]
    batch.copy([dev + tail], [src + tail], [n - tail], stream, "one block")
    batch.copy([back + tail], [dev + tail], [n - tail], stream, "one block back")
    done = events.completion([events.record(stream)], "round trip")
    assert done.wait(30.0) and done.done
    assert ctypes.string_at(back, n) == data
    events.give(done.events)
    pool.release(src)
    pool.release(back)
    assert pool.held_bytes == 2 * n and pool.close() and pool.held_bytes == 0
    streams.close()
    events.close()


def test_streams_are_reused_while_idle_and_added_while_busy(ctx: Any, device_memory: Any) -> None:
    streams, events = gpu.StreamPool(DEVICE, 4), gpu.EventPool(DEVICE, 4)
    first = streams.take()[0]
    assert streams.take()[0] is first and len(streams) == 1
    n = 256 << 20
    pool = PinnedPool(name="busy")
    host = pool.acquire(n, 1.0)
    dev = device_memory(n)
    # Long enough (~10 ms device to host) that the stream is still busy when asked next.
    batch = gpu.BatchMemcpy()
    batch.copy([host], [dev], [n], first)
    busy = events.completion([events.record(first)], "long copy")
    second = streams.take()[0]
    if busy.poll():
        pytest.skip("the 256 MiB copy ended before the next take(): cannot observe a busy stream")
    assert second is not first and len(streams) == 2
    assert busy.wait(30.0)
    events.give(busy.events)
    assert len(streams.take(4)) == 4 and len(streams) <= 4
    pool.release(host)
    assert pool.close()
    streams.close()
    events.close()


def test_events_are_recorded_waited_and_reused(ctx: Any) -> None:
    streams, events = gpu.StreamPool(DEVICE, 2), gpu.EventPool(DEVICE, 2)
    stream = streams.take()[0]
    recorded = [events.record(stream) for _ in range(3)]
    done = events.completion(recorded)
    assert done.wait(10.0) and done.fired == 3
    events.give(recorded)
    assert events.idle == 2  # the third destroyed
    again = events.take()
    assert any(again is e for e in recorded[:2])
    events.give([again])
    events.close()
    streams.close()


def test_on_device_and_primary_context(ctx: Any) -> None:
    cuda.call("cuCtxSetCurrent", cuda.driver().CUcontext(0))
    with gpu.on_device(DEVICE) as current:
        assert int(cuda.call("cuCtxGetCurrent")) == int(current) == int(ctx)
    assert not int(cuda.call("cuCtxGetCurrent"))  # the thread had none: none again
    primary = gpu.PrimaryContext(DEVICE)
    cuda.call("cuCtxSetCurrent", cuda.driver().CUcontext(0))
    primary.make_current()
    assert int(cuda.call("cuCtxGetCurrent")) == int(ctx)


@pytest.mark.parametrize("size", [1, 4096, 3 << 20])
def test_device_stager_moves_bytes_between_the_gpu_and_pinned_memory(ctx: Any, device_memory: Any, size: int) -> None:
    from mori.core import staging

    stager = staging.device_stager(DEVICE)
    assert staging.device_stager(DEVICE) is stager  # one per device and settings
    src, dst = device_memory(size), device_memory(size)
    data = os.urandom(size)
    cuda.call("cuMemcpyHtoD", src, data, size)
    out = stager.to_host(src, size, wait=False)
    out.wait()
    assert out.pinned and ctypes.string_at(out.address, size) == data
    landing = stager.landing(size)
    ctypes.memmove(landing.address, out.address, size)
    stager.to_device(dst, landing)
    back = ctypes.create_string_buffer(size)
    cuda.call("cuMemcpyDtoH", back, dst, size)
    assert back.raw == data
    stager.check_device_memory(src, size)
    with pytest.raises(ValueError, match="is not CUDA device memory"):
        stager.check_device_memory(ctypes.addressof(back), size)


def test_device_stager_gathers_and_scatters_pages_in_one_batch_call(ctx: Any, device_memory: Any) -> None:
    """Pages scattered in device memory go out gathered back to back in pinned memory, and back
    scattered, each way one copy; on a CUDA 13 driver in one cuMemcpyBatchAsync (the Stager stays
    batched: the driver took it)."""
    from mori.core import gpu, staging

    stager = staging.device_stager(DEVICE)
    page, slots = 16 << 10, 24
    order = [17, 3, 4, 5, 22, 0, 9, 11, 10]  # 3, 4, 5 follow one another
    src, dst = device_memory(slots * page), device_memory(slots * page)
    data = os.urandom(slots * page)
    cuda.call("cuMemcpyHtoD", src, data, slots * page)
    cuda.call("cuMemsetD8", dst, 0, slots * page)
    before = stager.stats()
    out = stager.gather_to_host([(src + i * page, page) for i in order], wait=False)
    out.wait()
    assert ctypes.string_at(out.address, out.size) == b"".join(data[i * page : (i + 1) * page] for i in order)
    stager.scatter_to_device([(dst + i * page, page) for i in order], out)
    back = ctypes.create_string_buffer(slots * page)
    cuda.call("cuMemcpyDtoH", back, dst, slots * page)
    for i in range(slots):
        want = data[i * page : (i + 1) * page] if i in order else bytes(page)
        assert back.raw[i * page : (i + 1) * page] == want, f"page {i}"
    after = stager.stats()
    assert after["to_host"] - before["to_host"] == 1 and after["to_device"] - before["to_device"] == 1
    assert stager.batched == bool(gpu.batch_entry_point())
