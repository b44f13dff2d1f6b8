"""cuda_vmm.export_allocation_fd's driver calls, scripted (no GPU): the handle it retains is the
one it exports and is released after the export, failed or not."""

from __future__ import annotations

import os
from typing import Any

import pytest

from mori.core import cuda as _cuda
from mori.core.memory import cuda_vmm


class _Driver:
    """Answers the three calls by name and records them; ``fail_export`` makes the export fail."""

    def __init__(self, fail_export: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_export = fail_export

    def __call__(self, function: str, *args: Any, detail: str = "") -> Any:
        self.calls.append((function, *args))
        if function == "cuMemRetainAllocationHandle":
            return "handle-of-0x1000"
        if function == "cuMemExportToShareableHandle":
            if self.fail_export:
                raise _cuda.CudaError(function, 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", detail)
            return os.open(os.devnull, os.O_RDONLY)
        if function == "cuMemRelease":
            return None
        raise AssertionError(f"unexpected driver call {function}")


def test_export_retains_exports_and_releases_the_same_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _Driver()
    monkeypatch.setattr(_cuda, "call", driver)
    fd = cuda_vmm.export_allocation_fd(0x1000)
    try:
        assert not os.get_inheritable(fd)
        posix = _cuda.driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        assert driver.calls == [
            ("cuMemRetainAllocationHandle", 0x1000),
            ("cuMemExportToShareableHandle", "handle-of-0x1000", posix, 0),
            ("cuMemRelease", "handle-of-0x1000"),
        ]
    finally:
        os.close(fd)


def test_a_failed_export_still_releases_the_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _Driver(fail_export=True)
    monkeypatch.setattr(_cuda, "call", driver)
    with pytest.raises(_cuda.CudaError, match="cuMemExportToShareableHandle failed: CUDA_ERROR_INVALID_VALUE"):
        cuda_vmm.export_allocation_fd(0x1000)
    assert driver.calls[-1] == ("cuMemRelease", "handle-of-0x1000")
