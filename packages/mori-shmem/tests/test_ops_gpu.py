"""mori.ops GPU tests: torchrun starts the PEs running ops_gpu_worker.py.

Marked ``gpu``: CPU CI deselects them; ``ci/device/ep.sh`` runs them. The PE counts come from
``MORI_TEST_PES`` (default "2 4 8"); PEs beyond the GPU count share GPUs (ci/device/gpu_world.py).
"""

from __future__ import annotations

import os

import pytest
from test_gpu import _torchrun

PES = [int(n) for n in os.environ.get("MORI_TEST_PES", "2 4 8").split()]
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nproc", PES)
def test_dispatch_combine(nproc: int) -> None:
    out = _torchrun("ops_gpu_worker.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "1G"})
    assert f"ok  all mori.ops checks with {nproc} PEs" in out
