"""The remote transport on mori-core's UCX engine (:mod:`mori.core.ucx`): its setup, and what a
failure says.

Each PE runs one engine and one :class:`mori.core.ucx.UcxHeapWindow` over its heap, which does
the work: it registers the heap, one memory id per chunk (:data:`HEAP_ID` + k for the chunk at
``k * heap.chunk``: the whole heap at once when it is mapped at once; a ``vmm`` GPU heap's chunks
as it grows, each growth ending in a barrier here so that no PE reaches a chunk before its owner
registered it), and the buffers of ``shmem_buffer_register``; it finds the local side of every
transfer (the heap and registered buffers as they are, small host buffers through its staging
area, other memory registered for the call), cuts transfers at the heap's chunks, and checks and
runs every put, get, put with signal and atomic in one native call. A GPU heap is registered as
GPU memory; the engine serves atomics and signal puts on it with device kernels, and stages its
bytes through pinned host memory, in a CUDA context of its own
(:func:`mori.core.ucx_atomic.serve_gpu`; ``MORI_SHMEM_GPU_DIRECT`` leaves them to UCX's CUDA
support instead). At init the PEs hand each other, over the bootstrap, their workers' addresses
and a ticket per remote PE (``admit``), and connect to every PE they reach remotely. Then:

- puts and gets are engine transfers between the caller's buffer and the peer's heap, on the
  engine's checked path (the target checks every block against its registrations). The usual
  put, from the local heap into one live block of a remote PE's, is checked against the
  allocator's live blocks, posted and waited for with no Python step between (a 4 KiB put is
  dominated by Python steps on a fast transport); any other call, and every wrong one, takes the
  checked path of :mod:`._rma` first.
- on a GPU heap, kernels reach remote PEs through the device proxy
  (:class:`mori.core.ucx_proxy.DeviceProxy`) over the same window; host quiet and fence also wait
  for the commands kernels posted.
- atomics are the engine's remote atomics, applied with sequentially consistent atomics, so they
  mix with the target's own.
- a signal put of up to 16 KiB of host memory is one message (the engine's signal put: the target
  writes the bytes, then applies the signal's atomic; a small GPU source is copied to host memory
  first, by the window for the heap's own bytes); a larger one is the put, complete, then the
  signal's atomic. Either way a PE that sees the signal sees the data. Kernels' puts with signal
  through the device proxy take the same one message when they are small and from the heap.

Every host operation is complete when it returns. A peer that died or hangs fails the operation
within ``MORI_SHMEM_TIMEOUT`` with a :class:`ShmemError` naming it.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any, NoReturn

from mori.core.codes import TransferCode
from mori.core.log import get_logger
from mori.core.memory import LiveRanges
from mori.core.ucx import library_info, transports
from mori.core.ucx_atomic import MAX_SIGNAL_PUT_BYTES, OPS

from ._errors import ShmemError
from ._heap import INTERNAL_BYTES, Heap
from ._reach import Reach
from ._remote import RemoteTransport

__all__ = ["HEAP_ID", "UcxTransport", "why_unavailable"]

#: The memory id of the first chunk of every PE's heap in its engine.
HEAP_ID = 1
_IN_PROGRESS = int(TransferCode.IN_PROGRESS)  # an operation that did not finish in time
_SIGNAL_OPS = {False: OPS["store"], True: OPS["fetch_add"]}
_log = get_logger("shmem")


def _warn_without_nic(nics: Sequence[str], described: str) -> None:
    """MORI_SHMEM_GPU_DIRECT=1 where UCX finds no RDMA NIC (``nics``: mori.core.ucx's
    ``rdma_devices``, as mori-io's RDMA backend reads them): said once at init, with why, naming
    the transports of the engine's description ``described``."""
    if not nics:
        found = transports(described)
        _log.warning(
            "MORI_SHMEM_GPU_DIRECT=1 with no RDMA NIC (UCX transports: %s): UCX copies GPU memory with "
            "cuda_copy in the device's primary context, where a copy waits behind a running kernel, so a "
            "kernel that waits for a remote PE's data (a barrier, wait_until) stalls until "
            "MORI_DEVICE_WAIT_TIMEOUT_NS. Host calls are unaffected. Leave it unset here (mori stages "
            "GPU memory in a context of its own); it is meant for NIC hosts with GPUDirect RDMA.",
            ", ".join(found) or "none",
        )


def why_unavailable(heap_kind: str) -> str:
    """Why this process cannot run the UCX transport for a ``heap_kind`` heap ("" when it can)."""
    try:
        from mori.core import ucx

        ucx.load_once()
        if heap_kind == "gpu":
            probe = ucx.make_engine("mori-shmem-probe")
            try:
                cuda = probe.cuda_supported
            finally:
                probe.close()
            if not cuda:
                return (
                    f"the UCX loaded ({ucx.library_info()['path']}) has no CUDA support, which the GPU heap "
                    "needs (install the libucx-cu13 wheel, or point MORI_UCX_LIB at a UCX built with CUDA)"
                )
    except Exception as exc:  # no mori.core.ucx, or no UCX to load: say which
        return f"mori-core's UCX engine cannot start: {type(exc).__name__}: {exc}"
    return ""


def _is_device_memory(addr: int) -> bool:
    """Whether CUDA knows ``addr`` as device memory (memory it does not know is host memory)."""
    from mori.core import cuda

    drv = cuda.driver()
    try:
        kind = cuda.call("cuPointerGetAttribute", drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
    except cuda.CudaError:
        return False
    return int(kind) == int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE)


def _key(pe: int) -> str:
    return f"PE {pe}"


def _pack_contact(addresses: list[bytes], ticket: int, stages_gpu: bool) -> bytes:
    """A PE's worker addresses, the ticket it issued to the receiving PE, and whether its engine
    stages its GPU heap (small staged puts then go to it eager)."""
    return struct.pack("<QIB", ticket, len(addresses), stages_gpu) + b"".join(
        struct.pack("<I", len(a)) + a for a in addresses
    )


def _unpack_contact(data: bytes) -> tuple[list[bytes], int, bool]:
    ticket, count, stages_gpu = struct.unpack_from("<QIB", data)
    pos, addresses = struct.calcsize("<QIB"), []
    for _ in range(count):
        (length,) = struct.unpack_from("<I", data, pos)
        addresses.append(data[pos + 4 : pos + 4 + length])
        pos += 4 + length
    return addresses, ticket, bool(stages_gpu)


class UcxTransport(RemoteTransport):
    """Host RMA to the PEs of ``reach.remote`` through one UCX engine and the heap's window, and
    on a GPU heap the device proxy for kernels (collective construction)."""

    def __init__(self, bootstrap: Any, heap: Heap, reach: Reach, timeout: float, live: LiveRanges) -> None:
        from mori.core import config, ucx

        self.reach, self.heap, self.timeout = reach, heap, timeout
        self._bootstrap = bootstrap
        self._gpu = heap.kind == "gpu"
        # By default as many workers as mori-io's RDMA backend takes: a put of 512 KiB or more is
        # spread over them, every other transfer starts on the first. A PE that led its worker
        # through a put often waits on its memory next (a signal), so the progress thread polls on
        # for the peer's answer (stand_aside=False): put+signal ping-pongs between namespaces on
        # the 2-core VM took 40.3 µs one way with it standing aside, 29.8-33.9 without.
        workers = config.get("MORI_SHMEM_UCX_WORKERS") or ucx.auto_workers()
        # MORI_RDMA_DEVICES picks the NICs, as for mori-io's RDMA backend (multi-NIC EP hosts).
        self._engine = ucx.make_engine(
            f"mori-shmem-pe{reach.rank}",
            ucx.selected_devices(),
            workers=workers,
            round_robin=False,
            stand_aside=False,
            timeout=timeout,
            timeout_setting="MORI_SHMEM_TIMEOUT",
        )
        # Without verbs (tcp between hosts) host-heap messages go eager, as mori-io's RDMA backend's.
        ucx.eager_without_verbs(self._engine)
        self._peers: dict[int, Any] = {}
        self._words: Any = None
        self._proxy: Any = None
        self._window: Any = None
        direct = self._gpu and bool(config.get("MORI_SHMEM_GPU_DIRECT"))
        try:
            if self._gpu:  # first: whether UCX registers the heap depends on it
                from mori.core.ucx_atomic import serve_gpu

                ctx = heap.ctx  # type: ignore[attr-defined]
                if direct:
                    _warn_without_nic(library_info()["rdma_devices"], self._engine.describe())
                self._words = serve_gpu(self._engine, ctx.ctx, ctx.arch, stage=not direct)
            tickets = {pe: self._engine.admit(_key(pe)) for pe in reach.remote}
            addresses = list(self._engine.addresses)
            stages = self._gpu and not direct
            sent = [
                _pack_contact(addresses, tickets[pe], stages) if pe in tickets else b"" for pe in range(reach.world)
            ]
            got = bootstrap.alltoall(sent)
            for pe in reach.remote:
                their_addresses, ticket, they_stage = _unpack_contact(got[pe])
                self._peers[pe] = self._engine.connect(_key(pe), their_addresses, ticket, stages_gpu=they_stage)
            self._window = ucx.UcxHeapWindow(
                self._engine,
                live,
                heap.base,
                heap.size,
                INTERNAL_BYTES,
                heap.chunk,
                HEAP_ID,
                self._gpu,
                [self._peers.get(pe) for pe in range(reach.world)],
                timeout,
            )
            self._window.grow(heap.mapped)
            if self._gpu:
                from mori.core.ucx_proxy import DeviceProxy

                heap.ctx.make_current()  # type: ignore[attr-defined]
                self._proxy = DeviceProxy(self._window)
            heap.on_grow = self._grown
        except BaseException:
            self.close()
            raise

    def _grown(self, end: int) -> None:
        """The heap grew to ``end`` on every PE (collective): registers the new chunks, then waits
        for every PE to have done so before any PE can reach them."""
        self._window.grow(end)
        self._bootstrap.barrier()

    @property
    def device_proxy(self) -> tuple[int, int]:
        """The device proxy's ring and ticket counter (device addresses), or (0, 0)."""
        if self._proxy is None:
            return 0, 0
        return self._proxy.ring_device, self._proxy.tickets_device

    # -- what a failure says ---------------------------------------------------------------------
    def _failed(self, what: str, pe: int, failure: tuple[int, str]) -> NoReturn:
        """Raises the ShmemError of a failed operation (code IN_PROGRESS: no answer in time)."""
        code, message = failure
        if code == _IN_PROGRESS:
            raise ShmemError(f"{what} to PE {pe}: no answer within {self.timeout:g} s (MORI_SHMEM_TIMEOUT)")
        raise ShmemError(f"{what} to PE {pe} failed: {message}")

    # -- operations: the window's --------------------------------------------------------------
    def quick_put(self, dest: int, src: int, nbytes: int, pe: int) -> bool:
        """The plain put in one native call: False, with nothing done, for any other call."""
        done = self._window.quick_put(dest, src, nbytes, pe)
        if done is True:
            return True
        if done is None:
            return False
        self._failed(f"put of {nbytes} bytes", pe, done)

    def put(self, pe: int, offset: int, src: int, nbytes: int, local_gpu: bool = False) -> None:
        """An engine write of ``nbytes`` from ``src`` into PE ``pe``'s heap."""
        failure = self._window.put(pe, offset, src, nbytes, local_gpu)
        if failure is not None:
            self._failed(f"put of {nbytes} bytes", pe, failure)

    def get(self, pe: int, offset: int, dst: int, nbytes: int, local_gpu: bool = False) -> None:
        """An engine read of ``nbytes`` of PE ``pe``'s heap into ``dst``."""
        failure = self._window.get(pe, offset, dst, nbytes, local_gpu)
        if failure is not None:
            self._failed(f"get of {nbytes} bytes", pe, failure)

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
        """The window's put with signal. A small GPU source travels in the signal put's one
        message: the window copies the heap's bytes out itself, other GPU memory is copied to host
        memory here first."""
        host = None
        if local_gpu and self._gpu and self._in_heap(src, nbytes):
            local_gpu = False  # the heap's own memory: the window knows its kind
        elif 0 < nbytes <= MAX_SIGNAL_PUT_BYTES and local_gpu:
            host = ctypes.create_string_buffer(nbytes)
            self.heap.copy(ctypes.addressof(host), src, nbytes)
            src, local_gpu = ctypes.addressof(host), False
        failure = self._window.put_signal(pe, offset, src, nbytes, local_gpu, sig_offset, _SIGNAL_OPS[add], signal)
        if failure is not None:
            self._failed(f"signal put of {nbytes} bytes", pe, failure)

    def _in_heap(self, addr: int, nbytes: int) -> bool:
        return self.heap.base <= addr and addr + nbytes <= self.heap.base + self.heap.size

    def atomic(self, pe: int, op: str, offset: int, value: int, compare: int, width: int) -> int:
        """The engine's remote atomic on PE ``pe``'s heap."""
        old = self._window.atomic(pe, OPS[op], offset, value, compare, width)
        if type(old) is tuple:
            raise ShmemError(f"atomic {op} on PE {pe} failed: {old[1]}")
        return int(old)

    def register_buffer(self, addr: int, nbytes: int) -> None:
        """Registers the buffer with the window for good: as GPU memory where CUDA says it is
        device memory (a GPU heap's PE may register a CUDA tensor or a host one), else as host memory."""
        gpu = False
        if self._gpu:
            self.heap.ctx.make_current()  # type: ignore[attr-defined]  # CUDA answers for a context's pointers
            gpu = _is_device_memory(addr)
        try:
            self._window.register_buffer(addr, nbytes, gpu)
        except (RuntimeError, ValueError) as exc:
            raise ShmemError(f"shmem_buffer_register: {addr:#x}+{nbytes} could not be registered: {exc}") from None

    def deregister_buffer(self, addr: int) -> None:
        """Releases the buffer's registration (waiting, at most the engine's timeout, for UCX to let go)."""
        try:
            self._window.deregister_buffer(addr)
        except RuntimeError as exc:
            raise ShmemError(f"shmem_buffer_deregister: {addr:#x}: {exc}") from None

    def describe(self) -> str:
        """UCX's description of the engine's context: its transports and devices."""
        return str(self._engine.describe())

    @property
    def stores(self) -> Any:
        """The engine (its store log) where it writes remote PEs' signals and atomics into a GPU
        heap; None on a CPU heap."""
        return self._engine if self._words is not None else None

    @property
    def eager_bytes(self) -> int:
        """The engine's ``eager_bytes``: host-heap messages under it go eager (set where UCX has no
        verbs transport; 0, UCX's choice, otherwise)."""
        return int(self._engine.eager_bytes)

    @property
    def stats(self) -> dict[str, int]:
        """The window's counts (:attr:`RemoteTransport.stats`)."""
        return dict(self._window.stats())

    def _wait_proxy(self, what: str) -> None:
        """Waits until every command kernels posted is complete; raises naming the PE a failed one went to."""
        if self._proxy is None:
            return
        idle = self._proxy.wait_idle(self.timeout + 5.0)
        failure = self._proxy.failure()
        if failure:
            raise ShmemError(f"{what}: a device-initiated operation to {failure}")
        if not idle:
            raise ShmemError(
                f"{what}: the device proxy did not complete the commands kernels posted within "
                f"{self.timeout:g} s (MORI_SHMEM_TIMEOUT)"
            )

    def quiet(self) -> None:
        """Host operations are complete when they return; waits for the device proxy's commands."""
        self._wait_proxy("shmem_quiet")

    def fence(self) -> None:
        """As quiet (host operations are complete in order)."""
        self._wait_proxy("shmem_fence")

    def close(self) -> None:
        """Stops the device proxy, releases the window, closes the endpoints and the engine (after
        finalize's barrier: no peer is mid-access), then frees what served GPU atomics."""
        if self._proxy is not None:
            self.heap.ctx.make_current()  # type: ignore[attr-defined]
            self._proxy.close()
            self._proxy = None
        if self._window is not None:
            self._window.close()  # its buffers, and the peers it holds
            self._window = None
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        self._engine.close()
        if self._words is not None:
            self._words.close()
            self._words = None
