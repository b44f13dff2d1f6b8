"""The CUDA side of a PE: which device and context it works in, stream handles, kernel launches.

Driver calls go through ``mori.core.cuda`` (lazy ``cuda-bindings`` import, errors that name the
call), so CPU-only machines import ``mori.shmem`` without a driver.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from mori.core import cuda as cu

__all__ = ["Context", "cuda_device_count", "launch", "stream_handle"]


def cuda_device_count() -> int:
    """Number of CUDA devices the driver sees; 0 when there is no driver or no device."""
    try:
        cu.call("cuInit", 0)
        return int(cu.call("cuDeviceGetCount"))
    except (cu.CudaUnavailableError, cu.CudaError):
        return 0


class Context:
    """The CUDA context a PE works in: the current one if a framework made one, else a primary one.

    With no current context (nobody called ``torch.cuda.set_device``) the PE takes device
    ``LOCAL_RANK`` (torchrun), ``OMPI_COMM_WORLD_LOCAL_RANK`` (Open MPI) or ``rank``, modulo the
    device count: one GPU per local PE.
    """

    def __init__(self, rank: int) -> None:
        cu.call("cuInit", 0)
        current = cu.call("cuCtxGetCurrent")
        if current is not None and int(current) != 0:
            self.ctx = current
            self.device = int(cu.call("cuCtxGetDevice"))
        else:
            count = int(cu.call("cuDeviceGetCount"))
            local = os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"))
            self.device = (int(local) if local is not None else rank) % count
            self.ctx = cu.init_device(self.device)
        self.make_current()
        attr = cu.driver().CUdevice_attribute
        dev = cu.call("cuDeviceGet", self.device)
        major = cu.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        minor = cu.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        self.arch = f"sm_{major}{minor}"

    def make_current(self) -> None:
        """Binds the context to the calling thread (driver calls act on the thread's context)."""
        cu.call("cuCtxSetCurrent", self.ctx)

    def synchronize(self) -> None:
        """Waits for all work on the device."""
        self.make_current()
        cu.call("cuCtxSynchronize")


def stream_handle(stream: Any) -> int:
    """An int ``CUstream`` from None (the default stream), an int, a torch stream or a ``CUstream``."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if isinstance(handle, int):
        return handle
    try:
        return int(stream)  # cuda.bindings CUstream
    except (TypeError, ValueError):
        raise TypeError(
            f"cannot use {type(stream).__name__} as a CUDA stream; pass an int handle, "
            "a torch.cuda.Stream or a cuda.bindings CUstream"
        ) from None


def launch(function: Any, grid: int, block: int, args: list[Any], stream: int = 0) -> None:
    """Launches ``function`` with ctypes-typed arguments on ``stream`` (does not wait)."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    drv = cu.driver()
    cu.call("cuLaunchKernel", function, grid, 1, 1, block, 1, 1, 0, drv.CUstream(stream), ctypes.addressof(params), 0)
