"""export_region's choice of handle, with the driver scripted (no GPU): VMM memory is exported
through mori.core's cuda_vmm.export_allocation_fd, and memory that is neither legacy-IPC capable
nor exportable is refused with a ValueError that says what to allocate with."""

from __future__ import annotations

import os
from typing import Any

import pytest

from mori.core import cuda as _cuda
from mori.io.backends.nvlink import _peer_memory

BASE, SIZE = 0x7000_0000, 1 << 21


class _Driver:
    def __init__(self, exportable: bool) -> None:
        self.exportable = exportable
        self.calls: list[str] = []

    def __call__(self, function: str, *args: Any, detail: str = "") -> Any:
        self.calls.append(function)
        drv = _cuda.driver()
        if function == "cuPointerGetAttribute":
            if args[0] == drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
                return int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE)
            return 0  # not legacy-IPC capable: a VMM allocation
        if function == "cuMemGetAddressRange":
            return BASE, SIZE
        if function == "cuMemRetainAllocationHandle":
            return "handle"
        if function == "cuMemExportToShareableHandle":
            if not self.exportable:
                raise _cuda.CudaError(function, 101, "CUDA_ERROR_INVALID_DEVICE", "not exportable", detail)
            return os.open(os.devnull, os.O_RDONLY)
        if function == "cuMemRelease":
            return None
        raise AssertionError(f"unexpected driver call {function}")


@pytest.fixture()
def driver(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> _Driver:
    fake = _Driver(exportable=request.param)
    monkeypatch.setattr(_cuda, "call", fake)
    monkeypatch.setattr(_cuda, "init_device", lambda device: None)
    return fake


@pytest.mark.parametrize("driver", [True], indirect=True)
def test_vmm_memory_is_exported_as_an_fd(driver: _Driver) -> None:
    region = _peer_memory.export_region(BASE + 4096, 8192, 0)
    try:
        assert region.info["kind"] == "vmm" and region.info["offset"] == 4096 and region.info["base_size"] == SIZE
        assert region.fd >= 0 and not os.get_inheritable(region.fd)
        assert driver.calls[-3:] == ["cuMemRetainAllocationHandle", "cuMemExportToShareableHandle", "cuMemRelease"]
    finally:
        region.close()
    assert region.fd == -1


@pytest.mark.parametrize("driver", [False], indirect=True)
def test_memory_neither_ipc_nor_exportable_is_refused(driver: _Driver) -> None:
    with pytest.raises(ValueError, match="neither cudaMalloc memory .* nor a VMM allocation .*INVALID_DEVICE"):
        _peer_memory.export_region(BASE, 4096, 0)
    assert driver.calls[-1] == "cuMemRelease"
