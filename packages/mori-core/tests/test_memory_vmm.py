"""CUDA VMM allocations on real GPUs (run by ci/device/core.sh; the cross-process check is
ci/device/core_vmm_check.py). Every test here needs at least one GPU, some two."""

from __future__ import annotations

import ctypes
import os

import pytest

from mori.core import cuda as _cuda
from mori.core.memory import HostSegment, cuda_vmm

pytestmark = pytest.mark.gpu


def _device_count() -> int:
    _cuda.call("cuInit", 0)
    return int(_cuda.call("cuDeviceGetCount"))


def test_granularity_is_a_power_of_two() -> None:
    gran = cuda_vmm.granularity(0)
    assert gran >= 4096 and gran & (gran - 1) == 0


def test_write_read_round_trip_and_rounding() -> None:
    gran = cuda_vmm.granularity(0)
    with cuda_vmm.VmmAllocation.create(gran + 1, 0) as alloc:
        assert alloc.size == 2 * gran and alloc.ptr % gran == 0 and not alloc.imported
        data = os.urandom(alloc.size)
        alloc.write(data)
        assert alloc.read(alloc.size) == data
        alloc.write(b"\x00" * 100, offset=gran - 50)
        assert (
            alloc.read(200, offset=gran - 100)
            == data[gran - 100 : gran - 50] + b"\x00" * 100 + data[gran + 50 : gran + 100]
        )
        with pytest.raises(ValueError, match="outside"):
            alloc.read(2, offset=alloc.size - 1)
        with pytest.raises(ValueError, match="outside"):
            alloc.write(b"xx", offset=-1)
    with pytest.raises(ValueError, match="freed"):
        alloc.read(1)
    alloc.free()  # idempotent


def test_export_and_import_in_one_process_alias_the_same_memory() -> None:
    with cuda_vmm.VmmAllocation.create(1 << 20, 0) as alloc:
        fd = alloc.export_fd()
        try:
            with cuda_vmm.VmmAllocation.import_fd(fd, alloc.size, 0) as alias:
                assert alias.imported and alias.ptr != alloc.ptr and alias.size == alloc.size
                data = os.urandom(alloc.size)
                alloc.write(data)
                assert alias.read(alias.size) == data
                alias.write(b"mori", offset=8)
                assert alloc.read(12) == data[:8] + b"mori"
        finally:
            os.close(fd)


def test_import_on_a_second_gpu_reads_over_peer_access() -> None:
    if _device_count() < 2:
        pytest.fail("this test needs 2 GPUs; ci/device/core.sh runs on a 4-GPU machine")
    with cuda_vmm.VmmAllocation.create(4 << 20, 0, peers=[1]) as alloc:
        data = os.urandom(alloc.size)
        alloc.write(data)
        fd = alloc.export_fd()
        try:
            with cuda_vmm.VmmAllocation.import_fd(fd, alloc.size, 1) as remote:
                assert remote.read(remote.size) == data
                remote.set_access([0, 1])
                remote.write(data[::-1])
                assert alloc.read(alloc.size) == data[::-1]
        finally:
            os.close(fd)


def test_errors_name_the_failing_call() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        cuda_vmm.granularity(_device_count() + 3)
    with HostSegment.create(1 << 21) as seg, pytest.raises(_cuda.CudaError, match="cuMemImportFromShareableHandle"):
        cuda_vmm.VmmAllocation.import_fd(seg.fd, 1 << 21, 0)  # a memfd is not a CUDA allocation
    with pytest.raises(_cuda.CudaError, match="cuMemCreate failed: CUDA_ERROR_"):
        cuda_vmm.VmmAllocation.create(1 << 50, 0)


def test_reservation_grows_by_chunks_and_imports_a_peer_chunk_at_the_same_offset() -> None:
    gran = cuda_vmm.granularity(0, recommended=True)
    assert gran % cuda_vmm.granularity(0) == 0
    with cuda_vmm.VmmReservation(4 * gran, 0, gran) as own, cuda_vmm.VmmReservation(4 * gran, 0, gran) as peer:
        base = own.base
        own.create_chunk(0, gran)
        own.create_chunk(2 * gran, 2 * gran)  # a hole at [gran, 2 gran) is allowed
        assert own.base == base and own.mapped == [(0, gran), (2 * gran, 2 * gran)]
        data = os.urandom(2 * gran)
        src = (ctypes.c_char * len(data)).from_buffer_copy(data)
        _cuda.call("cuMemcpyHtoD", own.base + 2 * gran, ctypes.addressof(src), len(data))
        fd = own.export_chunk(2 * gran)
        try:
            peer.import_chunk(2 * gran, 2 * gran, fd)
        finally:
            os.close(fd)
        out = (ctypes.c_char * len(data))()
        _cuda.call("cuMemcpyDtoH", ctypes.addressof(out), peer.base + 2 * gran, len(data))
        assert out.raw == data  # the peer's mapping aliases the owner's chunk
        for args, match in (
            ((0, gran), "overlaps"),
            ((3 * gran, gran), "overlaps"),
            ((gran + 1, gran), "multiple"),
            ((gran, 0), "empty"),
            ((3 * gran, 2 * gran), "past"),
        ):
            with pytest.raises(ValueError, match=match):
                own.create_chunk(*args)
        with pytest.raises(ValueError, match="no chunk"):
            own.export_chunk(gran)
    assert own.base == 0 and own.mapped == []
    with pytest.raises(ValueError, match="freed"):
        own.create_chunk(0, gran)
