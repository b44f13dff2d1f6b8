"""Host-initiated RMA for Python callers: put, get, put with signal, atomics, wait-until, quiet, fence.

Every symmetric address is checked against the heap before anything moves (a bad one raises
:class:`ShmemAddressError` and changes nothing). Then each call goes by its target PE's reach
(:mod:`._reach`): a PE whose heap is mapped here through the heap's copies and atomics, any other
PE through the remote transport (:mod:`._remote`), with the same checks and errors. Atomic values are ``width``-bit unsigned words: negative inputs wrap as two's
complement and results come back unsigned.
"""

from __future__ import annotations

from typing import Any

from mori.core.codes import Cmp, SignalOp

from ._allocator import INTERNAL_BYTES, SymmetricAllocator
from ._buffers import as_span
from ._heap import Heap
from ._reach import Reach
from ._remote import RemoteTransport

__all__ = ["Rma", "ShmemAddressError"]


class ShmemAddressError(ValueError):
    """An address (or range) does not lie inside the symmetric heap, or is misaligned."""


class Rma:
    """Bounds-checked remote memory access over one PE's :class:`Heap` and its remote transport."""

    def __init__(
        self, heap: Heap, reach: Reach, remote: RemoteTransport, default_timeout: float, allocator: SymmetricAllocator
    ) -> None:
        self.heap = heap
        self.reach = reach
        self.remote = remote
        self.allocator = allocator
        self.my_pe = reach.rank
        self.npes = reach.world
        self.default_timeout = default_timeout
        # Read on every call: one attribute each, not two (a 4 KiB put feels every step).
        self.base, self.size, self.peer_bases = heap.base, heap.size, heap.peer_bases

    # -- checks ---------------------------------------------------------------------------
    def offset(self, addr: int, nbytes: int, what: str, align: int = 1, write: bool = False) -> int:
        """The heap offset of ``[addr, addr + nbytes)``; raises unless it lies inside the heap and,
        for a write, inside one live ``shmem_malloc`` block (never in the reserved area)."""
        if type(addr) is not int:  # not isinstance: a bool is no address, and this is cheaper
            raise TypeError(f"{what}: address must be an int, got {type(addr).__name__}")
        base, size = self.base, self.size
        if addr < base or addr + nbytes > base + size:
            raise ShmemAddressError(
                f"{what}: range {addr:#x}..{addr + nbytes:#x} ({nbytes} bytes) is outside "
                f"the symmetric heap {base:#x}..{base + size:#x}"
            )
        if addr % align:
            raise ShmemAddressError(f"{what}: address {addr:#x} is not {align}-byte aligned")
        off = addr - base
        if not write:
            return off
        if off < INTERNAL_BYTES:
            raise ShmemAddressError(
                f"{what}: address {addr:#x} is in the heap's first {INTERNAL_BYTES} bytes, "
                "reserved for mori (device barrier, peer table)"
            )
        if self.allocator.block_of(off, nbytes) is None:
            owner = self.allocator.block_of(off, 1)  # the block its first byte is in, if any
            where = (
                f"past the end of the {owner[1]}-byte block at {base + owner[0]:#x}"
                if owner is not None
                else "outside every live shmem_malloc block"
            )
            raise ShmemAddressError(f"{what}: range {addr:#x}..{addr + nbytes:#x} ({nbytes} bytes) runs {where}")
        return off

    def route(self, pe: int) -> int:
        """Checks ``pe``; returns the base of its heap as mapped here, or 0 when ``pe`` is reached
        through the remote transport."""
        if type(pe) is not int or not 0 <= pe < self.npes:
            raise ValueError(f"PE {pe!r} is out of range: there are {self.npes} PEs (0..{self.npes - 1})")
        return self.peer_bases[pe]

    def target(self, pe: int) -> int:
        """Checks ``pe`` and returns the base address of its heap as mapped in this process; raises
        ``ValueError`` for a PE reached remotely (nothing of its heap is mapped here)."""
        base = self.route(pe)
        if base == 0:
            raise ValueError(
                f"PE {pe} is not mapped in PE {self.my_pe} ({self.reach.why_remote(pe)}): it is "
                "reached through the remote transport; use shmem_getmem/shmem_putmem"
            )
        return base

    @staticmethod
    def _word(value: int, width: int, what: str) -> int:
        if width not in (32, 64):
            raise ValueError(f"width must be 32 or 64, got {width!r}")
        if not isinstance(value, int) or not -(1 << (width - 1)) <= value < (1 << width):
            raise ValueError(f"{what}={value!r} does not fit in {width} bits")
        return value & ((1 << width) - 1)

    def _usable(self, span: tuple[int, int, bool], what: str) -> tuple[int, int, bool]:
        """``span`` (address, size, on a GPU), refusing GPU memory beside a CPU heap."""
        if span[2] and self.heap.kind != "gpu":
            raise TypeError(f"{what}: a CUDA tensor cannot be used with the CPU heap")
        return span

    def _put_target(self, dest: int, span: tuple[int, int, bool], pe: int) -> tuple[int, int]:
        """(heap offset of ``dest``, ``pe``'s mapped base or 0) for a put of ``span``, all checked."""
        self._usable(span, "put source")
        return self.offset(dest, span[1], "put destination", write=True), self.route(pe)

    # -- data movement ----------------------------------------------------------------------
    def put(self, dest: int, data: Any, pe: int) -> None:
        """Copies ``data`` to symmetric address ``dest`` on PE ``pe``; complete on return."""
        span = as_span(data, "put source", False)
        # The plain remote put (a source in the heap: the usual one) in one native step; every
        # other call, and every wrong one, takes the checked path below.
        if self.remote.quick_put(dest, span[0], span[1], pe):
            return
        off, base = self._put_target(dest, span, pe)
        addr, nbytes, on_gpu = span
        if not nbytes:
            return
        if base:
            self.heap.copy(base + off, addr, nbytes)
        else:
            self.remote.put(pe, off, addr, nbytes, on_gpu)

    def get_into(self, out: Any, src: int, pe: int) -> None:
        """Fills ``out`` (writable buffer, array or tensor) from ``src`` on PE ``pe``."""
        addr, nbytes, on_gpu = self._usable(as_span(out, "get destination", True), "get destination")
        off = self.offset(src, nbytes, "get source")
        base = self.route(pe)
        if not nbytes:
            return
        if base:
            self.heap.copy(addr, base + off, nbytes)
        else:
            self.remote.get(pe, off, addr, nbytes, on_gpu)

    def get(self, src: int, nbytes: int, pe: int) -> bytes:
        """Returns ``nbytes`` read from ``src`` on PE ``pe``."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        self.offset(src, nbytes, "get source")  # before allocating: a huge nbytes fails here, clearly
        out = bytearray(nbytes)
        self.get_into(out, src, pe)
        return bytes(out)

    def put_signal(self, dest: int, data: Any, sig_addr: int, signal: int, sig_op: int, pe: int) -> None:
        """Puts ``data``, then sets (``SignalOp.SET``) or adds to (``SignalOp.ADD``) the 64-bit signal."""
        op = SignalOp.parse(sig_op)
        sig_off = self.offset(sig_addr, 8, "signal address", align=8, write=True)
        signal = self._word(signal, 64, "signal")
        span = as_span(data, "put source", False)
        off, base = self._put_target(dest, span, pe)
        addr, nbytes, on_gpu = span
        if not base:
            self.remote.put_signal(pe, off, addr, nbytes, sig_off, signal, op is SignalOp.ADD, on_gpu)
            return
        if nbytes:
            self.heap.copy(base + off, addr, nbytes)
        # The data copy is complete before the signal moves: a waiter that sees it sees the data.
        self.heap.atomic("fetch_add" if op is SignalOp.ADD else "store", pe, sig_off, signal, 0, 64)

    def atomic(self, op: str, dest: int, value: int, pe: int, compare: int = 0, width: int = 64) -> int:
        """Runs atomic ``op`` on the ``width``-bit word at ``dest`` on PE ``pe``; returns the old value."""
        value = self._word(value, width, "value")
        compare = self._word(compare, width, "compare")
        off = self.offset(dest, width // 8, "atomic address", align=width // 8, write=True)
        if self.route(pe):
            return self.heap.atomic(op, pe, off, value, compare, width)
        return self.remote.atomic(pe, op, off, value, compare, width)

    def wait_until(self, ivar: int, cmp: int | str, value: int, timeout: float | None, width: int = 64) -> int:
        """Waits until the local word at ``ivar`` compares true against ``value``; returns what it read."""
        code = Cmp.parse(cmp)
        value = self._word(value, width, "value")
        off = self.offset(ivar, width // 8, "wait address", align=width // 8)
        limit = self.default_timeout if timeout is None else timeout
        if not limit > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        return self.heap.wait_until(off, code, value, limit, width, self.remote.stores)

    def quiet(self) -> None:
        """Completes every RMA this PE issued (host calls complete on return already; this also
        drains the device, and the proxy's commands that its kernels posted to remote PEs)."""
        self.heap.synchronize()
        self.remote.quiet()

    def fence(self) -> None:
        """Orders this PE's earlier puts before later ones (host RMA is complete in order, so quiet suffices)."""
        self.heap.synchronize()
        self.remote.fence()
