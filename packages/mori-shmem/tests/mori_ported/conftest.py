"""Port of ROCm/mori ``tests/python/shmem/conftest.py``.

What the port changed: the heap is forced into host memory (``MORI_SHMEM_BACKEND=cpu``: the
GPU->CPU substitution), and the ports' folder is put on ``sys.path`` so that ``utils`` imports
as MORI's ``tests.python.utils`` does there. The 4 GB heap size is MORI's, unchanged.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def set_shmem_heap_size():
    # Limit shmem heap size for shmem/ tests to 4 GB.
    prev = {k: os.environ.get(k) for k in ("MORI_SHMEM_HEAP_SIZE", "MORI_SHMEM_BACKEND")}
    os.environ["MORI_SHMEM_HEAP_SIZE"] = "4G"
    os.environ["MORI_SHMEM_BACKEND"] = "cpu"
    yield
    for key, value in prev.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
