# Copyright © Advanced Micro Devices, Inc. All rights reserved.
#
# MIT License
#
# Permission is hereby granted, free of charge, to any person obtaining a copy
# of this software and associated documentation files (the "Software"), to deal
# in the Software without restriction, including without limitation the rights
# to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
# copies of the Software, and to permit persons to whom the Software is
# furnished to do so, subject to the following conditions:
#
# The above copyright notice and this permission notice shall be included in all
# copies or substantial portions of the Software.
#
# THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
# IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
# FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
# AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
# LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
# OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
# SOFTWARE.
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
