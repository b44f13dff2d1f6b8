"""Many copies on one stream in one driver call, shared by the NVLink copy queues and the TCP
staging copier: ``cuMemcpyBatchAsync`` where the driver offers its CUDA 13 form, else the caller
copies block by block."""

from __future__ import annotations

from typing import Any

from mori.core import _cuda

__all__ = ["BatchMemcpy"]

# Answers that mean "this driver will not take these as a batch", not "the copy is wrong".
_REFUSALS = ("CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_INVALID_VALUE")


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` for one device; create and use with its context current."""

    def __init__(self) -> None:
        self._drv = drv = _cuda.driver()
        attr = drv.CUmemcpyAttributes()
        attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attrs = [attr]
        # cuda-bindings 13 calls the CUDA 13 form of cuMemcpyBatchAsync (no failIdx) and asks the
        # driver for it without checking the driver's version: an older driver would hand back its
        # 12.8 form, called with the wrong arguments. So batch only on a CUDA 13 driver.
        self._usable = hasattr(drv, "cuMemcpyBatchAsync") and int(_cuda.call("cuDriverGetVersion")) >= 13000

    def try_queue(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: Any, detail: str) -> bool:
        """Queues ``sizes[i]`` bytes ``srcs[i]`` -> ``dsts[i]`` on ``stream`` with one call. False
        when there are fewer than two copies or the driver has no usable batch call (then, and
        from then on, the caller copies one by one); any other failure raises."""
        if len(sizes) < 2 or not self._usable:
            return False
        drv = self._drv
        try:
            _cuda.check(drv.cuMemcpyBatchAsync([drv.CUdeviceptr(v) for v in dsts], [drv.CUdeviceptr(v) for v in srcs],
                                               sizes, len(sizes), self._attrs, [0], 1, stream),
                        "cuMemcpyBatchAsync", detail)
            return True
        except (RuntimeError, TypeError) as err:
            # A driver without the call (cuda-bindings raises FunctionNotFoundError, a
            # RuntimeError), bindings of another signature, or a refusal of these copies.
            if isinstance(err, _cuda.CudaError):
                if err.name not in _REFUSALS:
                    raise
            elif not (isinstance(err, TypeError) or type(err).__name__ == "FunctionNotFoundError"):
                raise
            self._usable = False
            return False
