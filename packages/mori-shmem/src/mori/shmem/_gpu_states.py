"""Host mirror of the device-side ``mori::device::GpuStates`` (``mori/device/shmem.cuh``).

The 64-byte structure is what ``shmem_module_init`` copies into a module's ``globalGpuStates``
symbol; its layout is fixed by the device header (which static_asserts it) and by this file.
"""

from __future__ import annotations

import ctypes

__all__ = ["FLAG_P2P_DISABLED", "GPU_STATES_SIZE", "MAX_PES", "GpuStates", "pack_gpu_states"]

#: Most PEs the device state describes (``kMaxPes``).
MAX_PES = 64
#: ``GpuStates.flags`` bit 0: peers are not mapped (``MORI_DISABLE_P2P``).
FLAG_P2P_DISABLED = 1
GPU_STATES_SIZE = 64


class GpuStates(ctypes.Structure):
    """``struct GpuStates`` field for field (natural alignment, 64 bytes)."""

    _fields_ = [
        ("rank", ctypes.c_int32),
        ("worldSize", ctypes.c_int32),
        ("heapBase", ctypes.c_uint64),
        ("heapSize", ctypes.c_uint64),
        ("peerHeapBases", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 3),
    ]


assert ctypes.sizeof(GpuStates) == GPU_STATES_SIZE, "GpuStates must stay 64 bytes (device header static_asserts it)"


def pack_gpu_states(
    rank: int, world: int, heap_base: int, heap_size: int, peer_bases_addr: int, p2p_disabled: bool
) -> bytes:
    """The 64 bytes of a ``GpuStates`` with these values (``peer_bases_addr``: device array address)."""
    states = GpuStates(
        rank=rank,
        worldSize=world,
        heapBase=heap_base,
        heapSize=heap_size,
        peerHeapBases=peer_bases_addr,
        flags=FLAG_P2P_DISABLED if p2p_disabled else 0,
    )
    return bytes(states)
