"""Shared fixtures: pools of real PE processes on the CPU heap, started once per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pe_pool import PePool

#: Small heaps keep memfd and page-table work cheap; the CPU backend is forced even where a GPU exists.
CPU_ENV = {"MORI_SHMEM_HEAP_SIZE": "8M", "MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_TIMEOUT": "30"}


@pytest.fixture(scope="module", params=[2, 4], ids=["2pe", "4pe"])
def pool(request: pytest.FixtureRequest) -> Iterator[PePool]:
    """An initialized pool of 2 and of 4 PEs."""
    p = PePool(request.param, CPU_ENV)
    try:
        yield p
    finally:
        p.close()
