"""The proxy of device-initiated RMA on mori-core's UCX engine: kernels post commands, a native
thread executes them.

A GPU has no NIC queue of its own here (no IBGDA), so a kernel that puts to, gets from or applies
an atomic on a PE whose heap it cannot map (another host, or ``MORI_DISABLE_P2P``) writes a
64-byte command into a ring in host-mapped memory (``mori/device/proxy_ring.cuh``); the proxy, a
C++ thread free of the GIL, takes the commands in order and executes them on the UCX engine
(transfers between the local and the remote heap, GPU memory moved by UCX's CUDA support;
atomics by the engine's checked path, applied on the target's GPU by :func:`mori.core.ucx_atomic.serve_gpu`),
all through the heap's :class:`mori.core.ucx.UcxHeapWindow`, which host calls use too,
and publishes in the ring's header how far they are complete, which the device's quiet, fence
and barrier wait on. This is NVSHMEM's proxy design; on hosts with a NIC a GPU-initiated provider
(IBGDA) could take the ring's place behind the same device API.

:class:`DeviceProxy` owns the ring (pinned, device-mapped host memory), the ticket counter the
kernels draw from (GPU memory), the bounce area of inline puts and gets (registered host memory)
and the thread. Its :attr:`~DeviceProxy.ring_device` and :attr:`~DeviceProxy.tickets_device` go
into the device state (``GpuStates``) of every module that uses the device API.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ._native.ucx import PROXY_HEADER_BYTES, PROXY_SLOT_BYTES, PROXY_SLOTS, UcxHeapWindow, UcxProxy
from .ucx_atomic import HOST_MAPPED

__all__ = ["BOUNCE_BYTES", "DeviceProxy", "PROXY_HEADER_BYTES", "PROXY_SLOTS", "PROXY_SLOT_BYTES", "RING_BYTES"]

#: Bytes of a ring: its header and :data:`PROXY_SLOTS` slots.
RING_BYTES = PROXY_HEADER_BYTES + PROXY_SLOTS * PROXY_SLOT_BYTES
#: Bytes of the bounce area (16 per slot: the bytes of an inline put or get).
BOUNCE_BYTES = PROXY_SLOTS * 16


class DeviceProxy:
    """The ring, its ticket counter and the proxy thread for one heap (see the module docs).

    ``window`` is the heap's :class:`mori.core.ucx.UcxHeapWindow`: its peers are the PEs kernels
    reach through the proxy, and it registers the bounce area for good. The CUDA context the
    kernels run in must be current.
    """

    def __init__(self, window: UcxHeapWindow) -> None:
        from . import cuda

        self.ring = self.tickets_device = 0
        self._bounce = ctypes.create_string_buffer(BOUNCE_BYTES)
        self._native: Any = None
        try:
            self.ring = int(cuda.call("cuMemHostAlloc", RING_BYTES, HOST_MAPPED))
            self.ring_device = int(cuda.call("cuMemHostGetDevicePointer", self.ring, 0))
            self.tickets_device = int(cuda.call("cuMemAlloc", 8))
            cuda.call("cuMemsetD8", self.tickets_device, 0, 8)
            self._native = UcxProxy(window, self.ring, ctypes.addressof(self._bounce))
        except BaseException:
            self.close()
            raise

    @property
    def native(self) -> Any:
        """The native proxy (``wait_idle``, ``failure``, ``executed``)."""
        return self._native

    def wait_idle(self, timeout: float) -> bool:
        """True once every command posted so far is complete (call after the posting kernels
        ended); False after ``timeout`` seconds."""
        return self._native is not None and bool(self._native.wait_idle(timeout))

    def failure(self) -> str:
        """Why the first failed command failed, naming its PE ("" when none did)."""
        return "" if self._native is None else str(self._native.failure())

    def close(self) -> None:
        """Stops the thread (after the commands already posted), then frees the ring, the counter
        and the bounce area. The context must be current."""
        from . import cuda

        if self._native is not None:
            self._native.stop()  # (and releases the bounce area's registration)
            self._native = None
        if self.tickets_device:
            cuda.call("cuMemFree", self.tickets_device)
            self.tickets_device = 0
        if self.ring:
            cuda.call("cuMemFreeHost", self.ring)
            self.ring = 0
