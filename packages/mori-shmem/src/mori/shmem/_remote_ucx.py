"""The remote transport on mori-core's UCX engine (:mod:`mori.core.ucx`).

Each PE runs one engine and registers its heap with it, one memory id per chunk of the heap
(:data:`HEAP_ID` + k for the chunk at ``k * heap.chunk``: the whole heap at once when it is
mapped at once; a ``vmm`` GPU heap's chunks as it grows, each growth ending in a barrier so that
no PE reaches a chunk before its owner registered it). A GPU heap is registered as GPU memory;
the engine serves atomics and signal puts on it with device kernels, and stages its bytes
through pinned host memory, in a CUDA context of its own (:func:`mori.core.ucx_atomic.serve_gpu`;
``MORI_SHMEM_GPU_DIRECT`` leaves them to UCX's CUDA support instead). At init the PEs hand each other, over the
bootstrap, their workers' addresses and a ticket per remote PE (``admit``), and connect to every PE
they reach remotely. Then:

- puts and gets are engine transfers between the caller's buffer and the peer's heap, on the
  engine's checked path (the target checks every block against its registrations). A buffer
  inside the local heap goes as is; a small one elsewhere is staged through mori's part of the
  heap (:data:`STAGING_OFFSET`, one call at a time); a larger one is registered for the call and
  released after (which waits for UCX to let go of it). A transfer is one batch of one row per
  heap chunk it touches (one row unless it crosses a ``vmm`` chunk), posted and waited for in
  as few Python steps as possible: a 4 KiB put is dominated by them on a fast transport. The
  usual put, from the local heap into one live block of a remote PE's (one chunk each), is one
  native call that checks, posts and waits (:class:`mori.core.ucx.UcxWindow` over the
  allocator's live blocks); any other call, and every wrong one, takes the checked path.
- on a GPU heap, kernels reach remote PEs through the device proxy
  (:class:`mori.core.ucx_proxy.DeviceProxy`) on the same engine and endpoints; host quiet and
  fence also wait for the commands kernels posted.
- atomics are the engine's remote atomics (:mod:`mori.core.ucx_atomic`), checked the same way
  and applied with sequentially consistent atomics, so they mix with the target's own.
- a signal put of up to 16 KiB is one message (the engine's signal put: the target writes the
  bytes, then applies the signal's atomic); a larger one is the put, complete (the target has
  written the bytes when it answers), then the signal's atomic. Either way a PE that sees the
  signal sees the data.

Every host operation is complete when it returns. A peer that died or hangs fails the operation
within ``MORI_SHMEM_TIMEOUT`` with a :class:`ShmemError` naming it.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import struct
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from mori.core.batch import Batch
from mori.core.codes import TransferCode
from mori.core.log import get_logger
from mori.core.memory import LiveRanges
from mori.core.ucx import READ, WRITE, library_info, transports

from ._errors import ShmemError
from ._heap import INTERNAL_BYTES, STAGING_OFFSET, Heap
from ._reach import Reach
from ._remote import RemoteTransport

__all__ = ["HEAP_ID", "UcxTransport", "why_unavailable"]

#: The memory id of every PE's heap in its engine.
HEAP_ID = 1
_FIRST_BUFFER_ID = 1 << 32  # ids of buffers registered for one call
_BOUNCE_ID = 1 << 40  # the device proxy's bounce area
_STAGING_BYTES = INTERNAL_BYTES - STAGING_OFFSET
_IN_PROGRESS = int(TransferCode.IN_PROGRESS)  # a transfer that did not finish in time
_log = get_logger("shmem")


def _warn_without_nic(nics: Sequence[str], described: str) -> None:
    """MORI_SHMEM_GPU_DIRECT=1 where UCX finds no RDMA NIC (``nics``: mori.core.ucx's
    ``rdma_devices``, as mori-io's RDMA backend reads them): said once at init, with why, naming
    the transports of the engine's description ``described``."""
    if not nics:
        found = transports(described)
        _log.warning("MORI_SHMEM_GPU_DIRECT=1 with no RDMA NIC (UCX transports: %s): UCX copies GPU memory with "
                     "cuda_copy in the device's primary context, where a copy waits behind a running kernel, so a "
                     "kernel that waits for a remote PE's data (a barrier, wait_until) stalls until "
                     "MORI_DEVICE_WAIT_TIMEOUT_NS. Host calls are unaffected. Leave it unset here (mori stages "
                     "GPU memory in a context of its own); it is meant for NIC hosts with GPUDirect RDMA.",
                     ", ".join(found) or "none")


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
                return (f"the UCX loaded ({ucx.library_info()['path']}) has no CUDA support, which the GPU heap "
                        "needs (install the libucx-cu13 wheel, or point MORI_UCX_LIB at a UCX built with CUDA)")
    except Exception as exc:  # no mori.core.ucx, or no UCX to load: say which
        return f"mori-core's UCX engine cannot start: {type(exc).__name__}: {exc}"
    return ""


def _key(pe: int) -> str:
    return f"PE {pe}"


def _pack_contact(addresses: list[bytes], ticket: int, stages_gpu: bool) -> bytes:
    """A PE's worker addresses, the ticket it issued to the receiving PE, and whether its engine
    stages its GPU heap (small staged puts then go to it eager)."""
    return struct.pack("<QIB", ticket, len(addresses), stages_gpu) + b"".join(
        struct.pack("<I", len(a)) + a for a in addresses)


def _unpack_contact(data: bytes) -> tuple[list[bytes], int, bool]:
    ticket, count, stages_gpu = struct.unpack_from("<QIB", data)
    pos, addresses = struct.calcsize("<QIB"), []
    for _ in range(count):
        (length,) = struct.unpack_from("<I", data, pos)
        addresses.append(data[pos + 4:pos + 4 + length])
        pos += 4 + length
    return addresses, ticket, bool(stages_gpu)


class UcxTransport(RemoteTransport):
    """Host RMA to the PEs of ``reach.remote`` through one UCX engine, and on a GPU heap the
    device proxy for kernels (collective construction)."""

    def __init__(self, bootstrap: Any, heap: Heap, reach: Reach, timeout: float, live: LiveRanges) -> None:
        from mori.core import ucx

        self.reach, self.heap, self.timeout = reach, heap, timeout
        # How long a caller waits for a transfer: the engine fails one at its own deadline
        # (MORI_SHMEM_TIMEOUT), and the margin lets its message, which names what was missing, arrive first.
        self._wait_for = timeout + 5.0
        self._base, self._size, self._chunk = heap.base, heap.size, heap.chunk  # read by every call
        self._bootstrap = bootstrap
        self._gpu = heap.kind == "gpu"
        self._ids = itertools.count(_FIRST_BUFFER_ID)
        self._staging = threading.Lock()
        # shmem_buffer_register's buffers: start -> (size, memory id), and the starts in order.
        self._buffers: dict[int, tuple[int, int]] = {}
        self._starts: list[int] = []
        self._staged = self._for_call = 0  # counts read by stats
        from mori.core import config

        # By default as many workers as mori-io's RDMA backend takes: a put of 512 KiB or more is
        # spread over them, every other transfer starts on the first. A PE that led its worker
        # through a put often waits on its memory next (a signal), so the progress thread polls on
        # for the peer's answer (stand_aside=False): put+signal ping-pongs between namespaces on
        # the 2-core VM took 40.3 µs one way with it standing aside, 29.8-33.9 without.
        workers = config.get("MORI_SHMEM_UCX_WORKERS") or ucx.auto_workers()
        # MORI_RDMA_DEVICES picks the NICs, as for mori-io's RDMA backend (multi-NIC EP hosts).
        self._engine = ucx.make_engine(f"mori-shmem-pe{reach.rank}", ucx.selected_devices(), workers=workers,
                                       round_robin=False, stand_aside=False, timeout=timeout,
                                       timeout_setting="MORI_SHMEM_TIMEOUT")
        self._peers: dict[int, Any] = {}
        self._registered = 0  # heap bytes registered, from offset 0
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
            self._register(heap.mapped)
            tickets = {pe: self._engine.admit(_key(pe)) for pe in reach.remote}
            addresses = list(self._engine.addresses)
            stages = self._gpu and not direct
            sent = [_pack_contact(addresses, tickets[pe], stages) if pe in tickets else b""
                    for pe in range(reach.world)]
            got = bootstrap.alltoall(sent)
            for pe in reach.remote:
                their_addresses, ticket, they_stage = _unpack_contact(got[pe])
                self._peers[pe] = self._engine.connect(_key(pe), their_addresses, ticket, stages_gpu=they_stage)
            if self._gpu:
                from mori.core.ucx_proxy import DeviceProxy

                heap.ctx.make_current()  # type: ignore[attr-defined]
                self._proxy = DeviceProxy(self._engine, [self._peers.get(pe) for pe in range(reach.world)],
                                          heap_id=HEAP_ID, heap_base=heap.base, heap_size=heap.size, chunk=heap.chunk,
                                          heap_gpu=True, bounce_id=_BOUNCE_ID, timeout=timeout,
                                          timeout_setting="MORI_SHMEM_TIMEOUT")
            self._window = ucx.UcxWindow(live, heap.base, heap.size, INTERNAL_BYTES, heap.chunk, HEAP_ID, self._gpu,
                                         [self._peers.get(pe) for pe in range(reach.world)], self._wait_for)
            heap.on_grow = self._grown
        except BaseException:
            self.close()
            raise

    # -- the heap's registration ---------------------------------------------------------------
    def _register(self, end: int) -> None:
        """Registers the heap's chunks in ``[self._registered, end)``, one memory id each."""
        heap = self.heap
        while self._registered < end:
            offset = self._registered
            self._engine.register_memory(HEAP_ID + offset // heap.chunk, heap.base + offset, heap.chunk, gpu=self._gpu)
            self._registered = offset + heap.chunk

    def _grown(self, end: int) -> None:
        """The heap grew to ``end`` on every PE (collective): registers the new chunks, then waits
        for every PE to have done so before any PE can reach them."""
        self._register(end)
        self._bootstrap.barrier()

    @property
    def device_proxy(self) -> tuple[int, int]:
        """The device proxy's ring and ticket counter (device addresses), or (0, 0)."""
        if self._proxy is None:
            return 0, 0
        return self._proxy.ring_device, self._proxy.tickets_device

    def _pieces(self, mem_id: int | None, local_off: int, offset: int,
                nbytes: int) -> list[tuple[int, int, list[int], list[int], list[int]]]:
        """The blocks of a transfer, grouped by (local id, remote id): none crossing a heap chunk
        (local when ``mem_id`` is None, i.e. the local heap)."""
        chunk = self.heap.chunk
        groups: list[tuple[int, int, list[int], list[int], list[int]]] = []
        done = 0
        while done < nbytes:
            r_in = (offset + done) % chunk
            r_id = HEAP_ID + (offset + done) // chunk
            if mem_id is None:
                l_in = (local_off + done) % chunk
                l_id, l_left = HEAP_ID + (local_off + done) // chunk, chunk - l_in
            else:
                l_id, l_in, l_left = mem_id, local_off + done, nbytes
            n = min(nbytes - done, chunk - r_in, l_left)
            if groups and groups[-1][0] == l_id and groups[-1][1] == r_id:
                groups[-1][2].append(l_in)
                groups[-1][3].append(r_in)
                groups[-1][4].append(n)
            else:
                groups.append((l_id, r_id, [l_in], [r_in], [n]))
            done += n
        return groups

    # -- data movement -------------------------------------------------------------------------
    def _run(self, op: int, what: str, pe: int, offset: int, mem_id: int | None, local_off: int, nbytes: int,
             local_base: int = 0) -> None:
        """One transfer between local memory (``mem_id`` registered at ``local_base``, or the local
        heap when None) and PE ``pe``'s heap, waited for."""
        peer, chunk = self._peers[pe], self._chunk
        r_id, r_in = divmod(offset, chunk)
        if mem_id is None:
            l_id, l_in = divmod(local_off, chunk)
            one = r_in + nbytes <= chunk and l_in + nbytes <= chunk
            l_id, l_base = HEAP_ID + l_id, self._base + l_id * chunk
        else:
            l_id, l_in, l_base = mem_id, local_off, local_base
            one = r_in + nbytes <= chunk
        if one:  # the usual case: one row, posted and waited for in one native call
            code, message = peer.run_one(op, l_id, l_base + l_in, r_in, nbytes, HEAP_ID + r_id, self._gpu,
                                         self._wait_for)
            if code:
                self._failed(what, pe, nbytes, code, message)
            return
        done = []
        for l_id, r_id, l_offs, r_offs, sizes in self._pieces(mem_id, local_off, offset, nbytes):
            base = self._base + (l_id - HEAP_ID) * chunk if mem_id is None else local_base
            done.append(peer.submit(op, l_id, Batch(l_offs, r_offs, sizes, src_base=base), r_id, 0, False, self._gpu))
        # Every part is waited for before any failure is raised: none may still read the staging
        # area or a buffer registered for this call once it returns.
        outcomes = [(t.code() if t.wait(self._wait_for) else _IN_PROGRESS, t) for t in done]
        for code, t in outcomes:
            if code:
                self._failed(what, pe, nbytes, code, t.message())

    def _failed(self, what: str, pe: int, nbytes: int, code: int, message: str) -> NoReturn:
        """Raises the ShmemError of a failed transfer (code IN_PROGRESS: no answer in time)."""
        if code == _IN_PROGRESS:
            raise ShmemError(f"{what} of {nbytes} bytes to PE {pe}: no answer within {self.timeout:g} s "
                             "(MORI_SHMEM_TIMEOUT)")
        raise ShmemError(f"{what} of {nbytes} bytes to PE {pe} failed: {message}")

    def _in_heap(self, addr: int, nbytes: int) -> bool:
        return self._base <= addr and addr + nbytes <= self._base + self._size

    def _buffer(self, addr: int, nbytes: int) -> tuple[int, int] | None:
        """(memory id, start) of the registered buffer holding ``[addr, addr + nbytes)``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start = self._starts[i]
        size, mem_id = self._buffers[start]
        return (mem_id, start) if addr + nbytes <= start + size else None

    def _transfer(self, op: int, what: str, pe: int, offset: int, addr: int, nbytes: int, local_gpu: bool) -> None:
        heap = self.heap
        if self._in_heap(addr, nbytes):  # inside the local heap: goes as is
            self._run(op, what, pe, offset, None, addr - self._base, nbytes)
            return
        registered = self._buffer(addr, nbytes) if self._starts else None
        if registered is not None:  # inside a buffer of shmem_buffer_register: goes as is too
            mem_id, start = registered
            self._run(op, what, pe, offset, mem_id, addr - start, nbytes, start)
        elif nbytes <= _STAGING_BYTES:
            stage = heap.base + STAGING_OFFSET
            with self._staging:
                self._staged += 1
                if op == WRITE:
                    heap.copy(stage, addr, nbytes)
                self._run(op, what, pe, offset, None, STAGING_OFFSET, nbytes)
                if op != WRITE:
                    heap.copy(addr, stage, nbytes)
        else:
            mem_id = next(self._ids)
            self._engine.register_memory(mem_id, addr, nbytes, gpu=local_gpu)
            self._for_call += 1
            try:
                self._run(op, what, pe, offset, mem_id, 0, nbytes, addr)
            finally:
                self._engine.deregister_memory(mem_id)

    def register_buffer(self, addr: int, nbytes: int) -> None:
        """Registers the buffer with the engine for good, as GPU memory on a GPU heap when UCX
        takes it as such, else as host memory (what a kernel's buffer or a host tensor is)."""
        mem_id = next(self._ids)
        try:
            self._engine.register_memory(mem_id, addr, nbytes, gpu=self._gpu)
        except (RuntimeError, ValueError) as first:
            if not self._gpu:
                raise ShmemError(f"shmem_buffer_register: UCX refused {addr:#x}+{nbytes}: {first}") from None
            try:
                self._engine.register_memory(mem_id, addr, nbytes, gpu=False)
            except (RuntimeError, ValueError) as exc:
                raise ShmemError(f"shmem_buffer_register: UCX refused {addr:#x}+{nbytes} as GPU memory ({first}) "
                                 f"and as host memory ({exc})") from None
        self._buffers[addr] = (nbytes, mem_id)
        bisect.insort(self._starts, addr)

    def deregister_buffer(self, addr: int) -> None:
        """Releases the buffer's registration (waiting, at most the engine's timeout, for UCX to let go)."""
        _, mem_id = self._buffers.pop(addr)
        self._starts.remove(addr)
        self._engine.deregister_memory(mem_id)

    def describe(self) -> str:
        """UCX's description of the engine's context: its transports and devices."""
        return str(self._engine.describe())

    @property
    def stats(self) -> dict[str, int]:
        """The counts of :attr:`RemoteTransport.stats`."""
        return {"staged": self._staged, "registered_for_call": self._for_call,
                "registered_buffers": len(self._buffers)}

    def quick_put(self, dest: int, src: int, nbytes: int, pe: int) -> bool:
        """The plain put in one native call (:class:`mori.core.ucx.UcxWindow`: checks, posts and
        waits with no Python step between); False, with nothing done, for any other call."""
        done = self._window.put(dest, src, nbytes, pe)
        if done is None:
            return False
        if done[0]:
            self._failed("put", pe, nbytes, done[0], done[1])
        return True

    def put(self, pe: int, offset: int, src: int, nbytes: int, local_gpu: bool = False) -> None:
        """An engine write of ``nbytes`` from ``src`` into PE ``pe``'s heap."""
        self._transfer(WRITE, "put", pe, offset, src, nbytes, local_gpu)

    def get(self, pe: int, offset: int, dst: int, nbytes: int, local_gpu: bool = False) -> None:
        """An engine read of ``nbytes`` of PE ``pe``'s heap into ``dst``."""
        self._transfer(READ, "get", pe, offset, dst, nbytes, local_gpu)

    def put_signal(self, pe: int, offset: int, src: int, nbytes: int, sig_offset: int, signal: int,
                   add: bool, local_gpu: bool = False) -> None:
        """Up to the engine's signal-put size, one message (the target writes the bytes, then
        applies the signal's atomic); beyond it, the put, complete, then the signal's atomic."""
        from mori.core.ucx_atomic import MAX_SIGNAL_PUT_BYTES, signal_put

        op = "fetch_add" if add else "store"
        if nbytes > MAX_SIGNAL_PUT_BYTES:
            self.put(pe, offset, src, nbytes, local_gpu)
            self.atomic(pe, op, sig_offset, signal, 0, 64)
            return
        host = None
        if nbytes and (local_gpu or (self._gpu and self._in_heap(src, nbytes))):
            # The message carries host bytes: GPU memory is copied out first.
            host = ctypes.create_string_buffer(nbytes)
            self.heap.copy(ctypes.addressof(host), src, nbytes)
            src = ctypes.addressof(host)
        try:
            signal_put(self._engine, self._peers[pe], HEAP_ID + offset // self.heap.chunk, offset % self.heap.chunk,
                       src, nbytes, HEAP_ID + sig_offset // self.heap.chunk, sig_offset % self.heap.chunk, op, signal,
                       self.timeout)
        except (RuntimeError, ValueError) as exc:
            raise ShmemError(f"signal put of {nbytes} bytes to PE {pe} failed: {exc}") from None

    def atomic(self, pe: int, op: str, offset: int, value: int, compare: int, width: int) -> int:
        """The engine's remote atomic on PE ``pe``'s heap."""
        from mori.core.ucx_atomic import atomic

        chunk = self.heap.chunk
        try:
            return atomic(self._engine, self._peers[pe], op, HEAP_ID + offset // chunk, offset % chunk, value,
                          compare, width, self.timeout)
        except (RuntimeError, ValueError) as exc:
            raise ShmemError(f"atomic {op} on PE {pe} failed: {exc}") from None

    def _wait_proxy(self, what: str) -> None:
        """Waits until every command kernels posted is complete; raises naming the PE a failed one went to."""
        if self._proxy is None:
            return
        idle = self._proxy.wait_idle(self._wait_for)
        failure = self._proxy.failure()
        if failure:
            raise ShmemError(f"{what}: a device-initiated operation to {failure}")
        if not idle:
            raise ShmemError(f"{what}: the device proxy did not complete the commands kernels posted within "
                             f"{self.timeout:g} s (MORI_SHMEM_TIMEOUT)")

    def quiet(self) -> None:
        """Host operations are complete when they return; waits for the device proxy's commands."""
        self._wait_proxy("shmem_quiet")

    def fence(self) -> None:
        """As quiet (host operations are complete in order)."""
        self._wait_proxy("shmem_fence")

    def close(self) -> None:
        """Stops the device proxy, closes the endpoints and the engine (after finalize's barrier:
        no peer is mid-access), then frees what served GPU atomics."""
        if self._proxy is not None:
            self.heap.ctx.make_current()  # type: ignore[attr-defined]
            self._proxy.close()
            self._proxy = None
        self._window = None  # it holds the peers: let them go with the engine
        for _, mem_id in self._buffers.values():
            self._engine.deregister_memory(mem_id)
        self._buffers.clear()
        self._starts.clear()
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
        self._engine.close()
        if self._words is not None:
            self._words.close()
            self._words = None
