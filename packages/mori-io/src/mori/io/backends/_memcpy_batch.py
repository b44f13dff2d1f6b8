"""Many copies on one stream in one driver call, shared by the NVLink copy queues and the TCP
staging copier: ``cuMemcpyBatchAsync`` (its CUDA 13 form, called natively by
``mori.core.native.memcpy_batch``) where the driver has it, else the caller copies block by
block."""

from __future__ import annotations

from typing import Any

import numpy as np

from mori.core import cuda as _cuda
from mori.core import native as _native

__all__ = ["BatchMemcpy"]

# Answers that mean "this driver will not take these as a batch", not "the copy is wrong":
# CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED.
_REFUSALS = (1, 801)


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` for one device; create and use with its context current."""

    def __init__(self) -> None:
        self._result = _cuda.driver().CUresult
        self._entry = 0
        # The CUDA 13 form (no failIdx) exists only on a CUDA 13 driver.
        if int(_cuda.call("cuDriverGetVersion")) >= 13000:
            try:
                self._entry = _cuda.entry_point("cuMemcpyBatchAsync", 13000)
            except _cuda.CudaError:
                self._entry = 0

    def try_queue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: Any, detail: str) -> bool:
        """Queues ``sizes[i]`` bytes ``srcs[i]`` -> ``dsts[i]`` (uint64 arrays) on ``stream`` with
        one call. False when there are fewer than two copies or the driver has no usable batch
        call (then, and from then on, the caller copies one by one); any other failure raises."""
        if len(sizes) < 2 or not self._entry:
            return False
        code = _native.memcpy_batch(self._entry, dsts, srcs, sizes, int(stream))
        if code == 0:
            return True
        if code in _REFUSALS:
            self._entry = 0
            return False
        _cuda.check((self._result(code),), "cuMemcpyBatchAsync", detail)
        return False  # not reached: check raised
