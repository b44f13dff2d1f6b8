"""Host mirrors of the device-side ``mori::device::GpuStates`` and ``GpuFastStates``
(``mori/device/state.cuh``).

``shmem_module_init`` copies the 64-byte ``GpuStates`` into a module's ``globalGpuStates`` and the
544-byte ``GpuFastStates`` (the same state and the peer-base table, in constant memory, for the
hot paths) into its ``globalGpuStatesFast``; the layouts are fixed by the device header (which
static_asserts them) and by this file.
"""

from __future__ import annotations

import ctypes

__all__ = [
    "FLAG_P2P_DISABLED",
    "FLAG_PROXY",
    "GPU_FAST_STATES_SIZE",
    "GPU_STATES_SIZE",
    "MAX_PES",
    "GpuFastStates",
    "GpuStates",
    "pack_fast_states",
    "pack_gpu_states",
]

#: Most PEs the device state describes (``kMaxPes``).
MAX_PES = 64
#: ``GpuStates.flags`` bit 0: peers are not mapped (``MORI_DISABLE_P2P``).
FLAG_P2P_DISABLED = 1
#: ``GpuStates.flags`` bit 1: a proxy serves the PEs that are not mapped (``proxyRing`` is set).
FLAG_PROXY = 2
GPU_STATES_SIZE = 64
GPU_FAST_STATES_SIZE = 32 + 8 * MAX_PES


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
        ("proxyRing", ctypes.c_uint64),
        ("proxyTickets", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64),
    ]


assert ctypes.sizeof(GpuStates) == GPU_STATES_SIZE, "GpuStates must stay 64 bytes (device header static_asserts it)"


class GpuFastStates(ctypes.Structure):
    """``struct GpuFastStates`` field for field (natural alignment, 544 bytes)."""

    _fields_ = [
        ("heapBase", ctypes.c_uint64),
        ("heapSize", ctypes.c_uint64),
        ("rank", ctypes.c_int32),
        ("worldSize", ctypes.c_int32),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("peerBases", ctypes.c_uint64 * MAX_PES),
    ]


assert ctypes.sizeof(GpuFastStates) == GPU_FAST_STATES_SIZE, "GpuFastStates must match the device header"


def _flags(p2p_disabled: bool, proxy: bool) -> int:
    return (FLAG_P2P_DISABLED if p2p_disabled else 0) | (FLAG_PROXY if proxy else 0)


def pack_gpu_states(
    rank: int,
    world: int,
    heap_base: int,
    heap_size: int,
    peer_bases_addr: int,
    p2p_disabled: bool,
    proxy_ring: int = 0,
    proxy_tickets: int = 0,
) -> bytes:
    """The 64 bytes of a ``GpuStates`` with these values (``peer_bases_addr``: device array address;
    ``proxy_ring``/``proxy_tickets``: the device proxy's ring and ticket counter, 0 without one)."""
    states = GpuStates(
        rank=rank,
        worldSize=world,
        heapBase=heap_base,
        heapSize=heap_size,
        peerHeapBases=peer_bases_addr,
        flags=_flags(p2p_disabled, proxy_ring != 0),
        proxyRing=proxy_ring,
        proxyTickets=proxy_tickets,
    )
    return bytes(states)


def pack_fast_states(
    rank: int,
    world: int,
    heap_base: int,
    heap_size: int,
    peer_bases: list[int],
    p2p_disabled: bool,
    proxy: bool = False,
) -> bytes:
    """The 544 bytes of a ``GpuFastStates`` (``peer_bases[p]``: PE p's heap as mapped here, 0 if
    not reachable; at most ``MAX_PES`` entries; ``proxy``: a device proxy serves the others)."""
    if len(peer_bases) > MAX_PES:
        raise ValueError(f"{len(peer_bases)} PEs: the device state describes at most {MAX_PES}")
    fast = GpuFastStates(
        heapBase=heap_base, heapSize=heap_size, rank=rank, worldSize=world, flags=_flags(p2p_disabled, proxy)
    )
    fast.peerBases[: len(peer_bases)] = peer_bases
    return bytes(fast)
