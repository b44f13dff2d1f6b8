"""The remote transport: how host calls reach a PE whose heap is not mapped here (:mod:`._reach`).

:class:`RemoteTransport` is the one interface the host API routes remote PEs through (:mod:`._rma`
checks every address and argument first, exactly as for mapped PEs, and passes heap offsets).
Each operation is complete when it returns, as host RMA to mapped PEs is: a put's bytes are in
the target's heap, an atomic has been applied there.

:func:`._remote_setup.open_remote` (collective, at init) sets it up on every PE. Where it cannot
run, PEs on several hosts are refused at init, and with ``MORI_DISABLE_P2P`` on one host every
call to a peer raises :class:`ShmemError` saying why.
"""

from __future__ import annotations

import abc
from typing import Any

from ._errors import ShmemError
from ._reach import Reach

__all__ = ["RemoteTransport", "Unavailable"]


class RemoteTransport(abc.ABC):
    """Host-initiated RMA on the heaps of remote PEs. Offsets are heap offsets (the heap is
    symmetric), local buffers host addresses; the caller has checked both."""

    @abc.abstractmethod
    def put(self, pe: int, offset: int, src: int, nbytes: int, local_gpu: bool = False) -> None:
        """Writes ``nbytes`` from local ``src`` (GPU memory when ``local_gpu``) at ``offset`` of PE ``pe``'s heap."""

    @abc.abstractmethod
    def get(self, pe: int, offset: int, dst: int, nbytes: int, local_gpu: bool = False) -> None:
        """Reads ``nbytes`` at ``offset`` of PE ``pe``'s heap into local ``dst`` (GPU memory when ``local_gpu``)."""

    @abc.abstractmethod
    def put_signal(
        self,
        pe: int,
        offset: int,
        src: int,
        nbytes: int,
        sig_offset: int,
        signal: int,
        add: bool,
        local_gpu: bool = False,
    ) -> None:
        """A put, then the 64-bit word at ``sig_offset`` set to (or increased by) ``signal``: a PE
        that sees the signal sees the data."""

    @abc.abstractmethod
    def atomic(self, pe: int, op: str, offset: int, value: int, compare: int, width: int) -> int:
        """Applies ``op`` (``fetch_add``, ``compare_swap``, ``swap`` or ``store``) to the ``width``-bit word at ``offset``; returns the old value."""

    def quick_put(self, dest: int, src: int, nbytes: int, pe: int) -> bool:
        """A put in one native step when it is the plain case (``dest`` inside one live block of
        the heap, ``src`` inside the local heap or a buffer of ``shmem_buffer_register``, ``pe``
        remote): True once done, complete. False, with nothing done, for any other call (the
        caller's checked path)."""
        return False

    def register_buffer(self, addr: int, nbytes: int) -> None:  # noqa: B027 - nothing to register without a transport
        """Registers ``[addr, addr + nbytes)`` (outside the heap, checked by the caller) with the
        transport for good: later RMA from or into it moves it as is, with no staging and no
        registration per call (``shmem_buffer_register``)."""

    def deregister_buffer(self, addr: int) -> None:  # noqa: B027 - nothing was registered
        """Releases the registration of the buffer at ``addr`` (``shmem_buffer_deregister``)."""

    def describe(self) -> str:
        """What carries the transfers (UCX's description of its context), "" without a transport."""
        return ""

    @property
    def stats(self) -> dict[str, int]:
        """How the local side of remote transfers was moved: ``staged`` (copied through the
        staging area), ``registered_for_call`` (registered for one call, then released) and
        ``registered_buffers`` (buffers registered for good now: :meth:`register_buffer`'s, and
        on a GPU heap the device proxy's bounce area)."""
        return {"staged": 0, "registered_for_call": 0, "registered_buffers": 0}

    @property
    def stores(self) -> Any:
        """What tells the writes this transport makes into the local heap's words for remote PEs
        (their signals and atomics), as they become visible: an object with mori-core's
        ``UcxEngine.store_mark``/``next_store``, or None where the heap's own wait sees them as
        fast (host memory) or there is no transport."""
        return None

    @property
    def device_proxy(self) -> tuple[int, int]:
        """Where kernels post to remote PEs: the device addresses of the proxy's ring and ticket
        counter (``GpuStates.proxyRing``/``proxyTickets``), or (0, 0) without a proxy."""
        return 0, 0

    @abc.abstractmethod
    def quiet(self) -> None:
        """Completes every operation this PE issued to remote PEs (kernels' included)."""

    @abc.abstractmethod
    def fence(self) -> None:
        """Orders this PE's earlier operations to each remote PE before its later ones."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the transport (collective, at finalize)."""


class Unavailable(RemoteTransport):
    """No remote transport: every operation on a remote PE raises :class:`ShmemError` saying why."""

    def __init__(self, reach: Reach, reason: str) -> None:
        self.reach, self.reason = reach, reason

    def _refuse(self, pe: int) -> ShmemError:
        return ShmemError(
            f"PE {pe} is reached through mori.shmem's remote transport ({self.reach.why_remote(pe)}), "
            f"which is not available: {self.reason}"
        )

    def put(self, pe: int, offset: int, src: int, nbytes: int, local_gpu: bool = False) -> None:
        """Raises :class:`ShmemError`."""
        raise self._refuse(pe)

    def get(self, pe: int, offset: int, dst: int, nbytes: int, local_gpu: bool = False) -> None:
        """Raises :class:`ShmemError`."""
        raise self._refuse(pe)

    def put_signal(
        self,
        pe: int,
        offset: int,
        src: int,
        nbytes: int,
        sig_offset: int,
        signal: int,
        add: bool,
        local_gpu: bool = False,
    ) -> None:
        """Raises :class:`ShmemError`."""
        raise self._refuse(pe)

    def atomic(self, pe: int, op: str, offset: int, value: int, compare: int, width: int) -> int:
        """Raises :class:`ShmemError`."""
        raise self._refuse(pe)

    def quiet(self) -> None:
        """Nothing was issued."""

    def fence(self) -> None:
        """Nothing was issued."""

    def close(self) -> None:
        """Nothing to release."""
