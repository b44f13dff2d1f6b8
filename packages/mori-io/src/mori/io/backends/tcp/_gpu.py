"""GPU memory over the TCP backend: the native data plane moves pinned host buffers, CUDA copies
move the bytes between those buffers and GPU memory, on both sides.

Initiator: a transfer runs on a worker thread chunk by chunk (``plan.plan_chunks``). A
write copies chunk k+1 GPU -> pinned while chunk k is on the wire; a read copies chunk k pinned
-> GPU while chunk k+1 is received. Target: the native server only serves host memory, so GPU
regions are reached through control requests:

* ``tcp.gpu_read`` — the target checks the pieces against its GPU region, copies them into a
  pinned buffer, waits for the copy, then lends the buffer (a random id the data plane serves)
  and the initiator reads it natively; the next request (or ``tcp.gpu_return``) returns it;
* ``tcp.gpu_lend`` lends an empty buffer the initiator writes natively; ``tcp.gpu_commit``
  withdraws it from the data plane (waiting for writes in flight), checks the pieces against the
  region, copies the buffer to the GPU and waits for the copy before it answers, so a byte
  reaches the region only after the check, and the completion (and the inbound notification,
  sent after the last commit) only after the device copy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from mori.core import cuda as _cuda
from mori.core.batch import Batch
from mori.core.gpu import BatchMemcpy, Completion, EventPool, StreamPool, on_device
from mori.core.memory import pinned_alloc, pinned_free

from ...types import MemoryDesc, MemoryLocationType, StatusCode
from ..base import BackendContext, ControlError, Deferred, Outcome, TransferOp, TransferRequest
from ._staging import SlotLeases, StagingPool, check_pieces, pack_array, unpack_array
from .plan import Chunk, plan_chunks

__all__ = ["DeviceCopies", "GpuStaging", "TransferFailed"]

# Per device: streams for the copies in flight at once (4 transfer workers with 2 buffers each,
# and target requests), and idle events kept.
_MAX_STREAMS = 8
_IDLE_EVENTS = 16


class TransferFailed(Exception):
    """A chunk failed in the data plane; ``code`` is its StatusCode."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DeviceCopies:
    """The staging copies of one device, on mori-core's pieces: each batch of copies goes on a
    stream of a :class:`~mori.core.gpu.StreamPool` (blocking streams: work queued earlier on the
    legacy default stream, where PyTorch runs, finishes first; copies that overlap get streams of
    their own) and ends with an event of an :class:`~mori.core.gpu.EventPool`. Use with the
    device's context current."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.streams = StreamPool(device, _MAX_STREAMS)
        self.events = EventPool(device, _IDLE_EVENTS)
        self._batch = BatchMemcpy()
        self._what = f"staging copy on device {device}"

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> Completion:
        """Queues ``sizes[i]`` bytes ``srcs[i]`` -> ``dsts[i]`` (absolute addresses, GPU or pinned
        host memory); the completion to :meth:`wait` for."""
        stream = self.streams.take(1)[0]
        u64 = np.uint64  # the batch call takes uint64 arrays; chunks are planned in int64
        self._batch.copy(dsts.astype(u64), srcs.astype(u64), sizes.astype(u64), stream, self._what)
        return self.events.completion([self.events.record(stream)], self._what)

    def wait(self, done: Completion, timeout: float) -> None:
        """Waits for the copies of ``done``; ``TimeoutError`` after ``timeout`` seconds,
        :class:`CudaError` when a copy failed (its event is then not reused)."""
        # 0.2 ms of polls with a yield between them, then one every 50 us.
        if not done.wait(timeout, spin=2e-4, pause=5e-5, max_pause=5e-5, yield_while_spinning=True):
            raise TimeoutError(f"{self._what} not done after {timeout:.1f} s")
        self.events.give(done.events)

    def close(self) -> None:
        """Destroys the streams and idle events (the driver frees them once queued work is done)."""
        self.streams.close()
        self.events.close()


def gpu_region_check(desc: MemoryDesc) -> None:
    """Raises (clearly) unless ``desc`` is CUDA device memory that this process can copy from.

    Only the memory type is checked, not the device ordinal: on the H200 machines the driver
    reports ordinal 0 for memory of every GPU (seen for torch and VMM allocations alike).
    """
    try:
        drv = _cuda.driver()
        attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
        with on_device(desc.device_id):
            mem_type = int(_cuda.call("cuPointerGetAttribute", attr, desc.data, detail=f"pointer 0x{desc.data:x}"))
    except (ImportError, _cuda.CudaError, ValueError) as err:
        raise RuntimeError(f"TCP backend: GPU memory (device {desc.device_id}) is staged through pinned host "
                           f"buffers, which needs cuda-bindings and a CUDA GPU: {err}") from None
    if mem_type != int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE):
        raise ValueError(f"TCP backend: memory at 0x{desc.data:x} registered as GPU memory of device "
                         f"{desc.device_id} is not CUDA device memory (memory type {mem_type})")


class GpuStaging:
    """Both sides of GPU staging for one TCP backend; pools of ``pool_bytes`` per side."""

    def __init__(self, ctx: BackendContext, pool_bytes: int, expose: Callable[[int, int, int], None],
                 hide: Callable[[int], object], stripe: int, notify: bool) -> None:
        self.ctx = ctx
        self._stripe = stripe
        self._notify = notify
        self.pool = StagingPool(pool_bytes, pinned_alloc, pinned_free)
        self.chunk_bytes = self.pool.chunk_bytes
        self.leases = SlotLeases(StagingPool(pool_bytes, pinned_alloc, pinned_free), 2 * ctx.io_timeout(),
                                 expose, hide)
        self._regions: dict[int, MemoryDesc] = {}
        self._busy: dict[int, int] = {}  # region id -> target copies in flight
        self._cond = threading.Condition()
        self._copies: dict[int, DeviceCopies] = {}
        self._workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mori-io-tcp-gpu")
        self._first_device: int | None = None  # of the first region: pinned memory is freed in its context
        self.closed = False

    # ---- regions (target side) -----------------------------------------------------------------
    def add_region(self, desc: MemoryDesc) -> None:
        """Serves GPU region ``desc`` to peers through staging."""
        gpu_region_check(desc)
        with self._cond:
            self._regions[desc.id] = desc
            if self._first_device is None:
                self._first_device = desc.device_id

    def remove_region(self, mem_id: int) -> None:
        """Stops serving a region; waits (up to twice MORI_IO_TIMEOUT) for its copies in flight."""
        with self._cond:
            self._regions.pop(mem_id, None)
            if not self._cond.wait_for(lambda: not self._busy.get(mem_id), 2 * self.ctx.io_timeout()):
                self.ctx.log.warning("TCP: GPU region %d deregistered with staging copies still running", mem_id)

    def _device(self, device: int) -> DeviceCopies:
        """The device's copies, with its context made current in this thread."""
        _cuda.init_device(device)
        with self._cond:
            copies = self._copies.get(device)
            if copies is None:
                copies = self._copies[device] = DeviceCopies(device)
        return copies

    def _target_copy(self, key: str, body: dict[str, Any], addr: int, to_host: bool) -> None:
        """Checks ``body``'s pieces against its region and copies them (buffer at ``addr``)."""
        mem_id = int(body.get("mem", -1))
        try:
            offs, sizes = unpack_array(body.get("offs"), "offs"), unpack_array(body.get("sizes"), "sizes")
        except ValueError as err:
            raise ControlError(StatusCode.ERR_INVALID_ARGS, str(err)) from None
        with self._cond:
            region = self._regions.get(mem_id)
            if region is None:
                raise ControlError(StatusCode.ERR_NOT_FOUND, f"GPU memory {mem_id} is not registered with "
                                                             f"{self.ctx.engine_key!r}")
            why = check_pieces(offs, sizes, region.size, self.leases.pool.chunk_bytes)
            if why:
                raise ControlError(StatusCode.ERR_INVALID_ARGS, f"GPU memory {mem_id}: {why}")
            self._busy[mem_id] = self._busy.get(mem_id, 0) + 1
        try:
            packed = addr + np.cumsum(sizes) - sizes
            gpu = region.data + offs
            copies = self._device(region.device_id)
            copies.wait(copies.copy(packed if to_host else gpu, gpu if to_host else packed, sizes),
                        self.ctx.io_timeout())
        except (_cuda.CudaError, TimeoutError) as err:
            raise ControlError(StatusCode.ERR_GPU_OP, f"staging copy for engine {key!r} failed: {err}") from None
        finally:
            with self._cond:
                self._busy[mem_id] -= 1
                self._cond.notify_all()

    def _return(self, key: str, slots: object) -> None:
        for slot in slots if isinstance(slots, list) else []:
            with contextlib.suppress(KeyError):  # expired or returned already
                self.leases.return_buffer(self.leases.take_back(key, int(slot)))

    # ---- control handlers (target side) ----------------------------------------------------------
    def handle_read(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``tcp.gpu_read``: copy pieces of a GPU region into a buffer and lend it."""
        self._return(key, body.get("release"))
        addr = self._buffer_for(body)
        if addr is None:
            return {"slot": None}
        try:
            self._target_copy(key, body, addr, to_host=True)
        except BaseException:
            self.leases.return_buffer(addr)
            raise
        return {"slot": self.leases.lend(key, addr)}

    def _buffer_for(self, body: dict[str, Any]) -> int | None:
        """A free target buffer for the GPU region named in ``body`` (None when all are lent);
        its device's context is made current first (the pool is allocated on first use)."""
        mem_id = int(body.get("mem", -1))
        with self._cond:
            region = self._regions.get(mem_id)
        if region is None:
            raise ControlError(StatusCode.ERR_NOT_FOUND, f"GPU memory {mem_id} is not registered with "
                                                         f"{self.ctx.engine_key!r}")
        _cuda.init_device(region.device_id)
        return self.leases.take_buffer()

    def handle_lend(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``tcp.gpu_lend``: lend an empty buffer for a write to the GPU region ``body["mem"]``."""
        addr = self._buffer_for(body)
        return {"slot": None if addr is None else self.leases.lend(key, addr)}

    def handle_commit(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``tcp.gpu_commit``: withdraw a lent buffer, check and copy it into the GPU region."""
        try:
            addr = self.leases.take_back(key, int(body.get("slot", -1)))
        except KeyError as err:
            raise ControlError(StatusCode.ERR_BAD_STATE, str(err)) from None
        try:
            self._target_copy(key, body, addr, to_host=False)
        finally:
            self.leases.return_buffer(addr)
        return self.handle_lend(key, body) if body.get("next") else {"slot": None}

    def handle_return(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``tcp.gpu_return``: give back lent buffers."""
        self._return(key, body.get("slots"))
        return {}

    # ---- transfers (initiator side) --------------------------------------------------------------
    def submit(self, peer: Any, request: TransferRequest, remote_chunk: int) -> Outcome | Deferred:
        """Runs ``request`` (one side or both on a GPU) on a worker thread; its completion."""
        if self.closed:
            return Outcome(StatusCode.ERR_BAD_STATE, "TCP backend was closed before the transfer started")
        completion = Deferred()
        self._workers.submit(self._run, peer, request, remote_chunk, completion)
        return completion

    def _run(self, peer: Any, req: TransferRequest, remote_chunk: int, completion: Deferred) -> None:
        code, msg = StatusCode.SUCCESS, ""
        try:
            self._move(peer, req, remote_chunk)
        except (ControlError, TransferFailed) as err:
            code, msg = err.code, f"TCP (GPU staging): {err}"
        except _cuda.CudaError as err:
            code, msg = StatusCode.ERR_GPU_OP, f"TCP (GPU staging): {err}"
        except Exception as err:  # timeouts, a lost control connection, a closed pool
            code, msg = StatusCode.ERR_BAD_STATE, f"TCP (GPU staging): {err!r}"
        if req.notify and self._notify:
            self.ctx.send_completions(req.remote.engine_key, [(req.uid, code, msg)])
        completion.finish(code, msg)

    def _move(self, peer: Any, req: TransferRequest, remote_chunk: int) -> None:
        local_gpu = req.local.loc == MemoryLocationType.GPU
        remote_gpu = req.remote.loc == MemoryLocationType.GPU
        size = min(self.chunk_bytes if local_gpu else remote_chunk, remote_chunk if remote_gpu else self.chunk_bytes)
        chunks = plan_chunks(req.batch, size)
        if not chunks:
            return
        timeout = self.ctx.io_timeout()
        bufs: list[int] = []
        copies = None
        if local_gpu:
            copies = self._device(req.local.device_id)
            bufs.append(self.pool.acquire(timeout))
            extra = self.pool.try_acquire() if len(chunks) > 1 else None
            bufs += [] if extra is None else [extra]
        run = _Run(self, peer, req, chunks, bufs, copies, timeout)
        try:
            if req.op == TransferOp.WRITE:
                run.write()
            else:
                run.read()
        finally:
            run.cleanup()

    def control(self, req: TransferRequest, op: str, body: dict[str, Any], timeout: float) -> int:
        """Sends a slot request, retrying while the target has no free buffer; the slot id."""
        deadline = time.monotonic() + timeout
        pause = 1e-4
        while True:
            slot = self.ctx.control_request(req.remote.engine_key, op, body).get("slot")
            if slot is not None:
                return int(slot)
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {req.remote.engine_key!r} had no free staging buffer for {timeout:.1f} s")
            body = {k: v for k, v in body.items() if k != "release"}  # released by the first try
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def native(self, peer: Any, req: TransferRequest, c: Chunk, buf: int | None, slot: int | None,
               timeout: float) -> None:
        """Moves chunk ``c`` with the data plane (local side: ``buf`` or the region; remote side:
        a lent ``slot`` or the region) and waits for it."""
        base, lofs = (0, c.local) if buf is None else (buf, c.packed)
        mem, rofs = (req.remote.id, c.remote) if slot is None else (slot, c.packed)
        t = peer.submit(req.op, Batch(lofs, rofs, c.sizes, base), mem, req.uid, False, self._stripe)
        if not t.wait(2 * timeout):
            raise TimeoutError(f"a {c.nbytes}-byte chunk got no answer in {2 * timeout:.1f} s")
        if t.code() != StatusCode.SUCCESS:
            raise TransferFailed(StatusCode(t.code()), t.message())

    def close(self) -> None:
        """Finishes running transfers, ends leases, frees pinned memory and CUDA objects."""
        self.closed = True
        self._workers.shutdown(wait=True)
        self.leases.close()
        if self._first_device is None:  # no region was ever registered: nothing was allocated
            return
        with on_device(self._first_device):  # cuMemFreeHost needs a context current on this (any) thread
            for pool in (self.pool, self.leases.pool):
                if not pool.close():
                    self.ctx.log.warning("TCP: staging buffers still in use at close; not freed")
        for copies in self._copies.values():
            try:
                with on_device(copies.device):
                    copies.close()
            except Exception as err:  # closing is best effort; the process may be going away
                self.ctx.log.debug("TCP: staging copies on device %d: %s", copies.device, err)


class _Run:
    """One staged transfer: its chunks, its local buffers (0, 1 or 2) and its remote slot."""

    def __init__(self, st: GpuStaging, peer: Any, req: TransferRequest, chunks: list[Chunk], bufs: list[int],
                 copies: DeviceCopies | None, timeout: float) -> None:
        self.st, self.peer, self.req, self.chunks, self.bufs = st, peer, req, chunks, bufs
        self.copies, self.timeout = copies, timeout
        self.remote_gpu = req.remote.loc == MemoryLocationType.GPU
        self.slot: int | None = None
        self.pending: list[Completion | None] = [None] * len(bufs)  # a lane's copies in flight

    def _buf(self, k: int) -> int | None:
        return self.bufs[k % len(self.bufs)] if self.bufs else None

    def _copy(self, k: int, to_host: bool) -> None:
        c, lane, buf = self.chunks[k], k % len(self.bufs), self._buf(k)
        assert self.copies is not None and buf is not None
        gpu, host = c.local, buf + c.packed
        self.pending[lane] = self.copies.copy(host if to_host else gpu, gpu if to_host else host, c.sizes)

    def _settle(self, lane: int) -> None:
        done = self.pending[lane]
        if done is not None:
            assert self.copies is not None
            self.copies.wait(done, self.timeout)
            self.pending[lane] = None

    def _remote_body(self, c: Chunk) -> dict[str, Any]:
        return {"mem": self.req.remote.id, "offs": pack_array(c.remote), "sizes": pack_array(c.sizes)}

    def write(self) -> None:
        n, lanes = len(self.chunks), len(self.bufs)
        if lanes:
            self._copy(0, to_host=True)
        for k, c in enumerate(self.chunks):
            if lanes:
                self._settle(k % lanes)
            if self.remote_gpu and self.slot is None:
                self.slot = self.st.control(self.req, "tcp.gpu_lend", {"mem": self.req.remote.id}, self.timeout)
            if lanes > 1 and k + 1 < n:
                self._copy(k + 1, to_host=True)  # into the other buffer: overlaps the send below
            self.st.native(self.peer, self.req, c, self._buf(k), self.slot, self.timeout)
            if lanes == 1 and k + 1 < n:
                self._copy(k + 1, to_host=True)  # one buffer: it is free again only now
            if self.remote_gpu:
                body = {**self._remote_body(c), "slot": self.slot, "next": k + 1 < n}
                self.slot = None  # the commit took it back, whatever its outcome
                got = self.st.ctx.control_request(self.req.remote.engine_key, "tcp.gpu_commit", body).get("slot")
                self.slot = None if got is None else int(got)

    def read(self) -> None:
        lanes = len(self.bufs)
        for k, c in enumerate(self.chunks):
            if lanes:
                self._settle(k % lanes)  # the buffer's previous chunk is on the GPU
            if self.remote_gpu:
                release = [] if self.slot is None else [self.slot]
                self.slot = self.st.control(self.req, "tcp.gpu_read", {**self._remote_body(c), "release": release},
                                            self.timeout)
            self.st.native(self.peer, self.req, c, self._buf(k), self.slot, self.timeout)
            if lanes:
                self._copy(k, to_host=False)  # overlaps the next chunk's receive
        for lane in range(lanes):
            self._settle(lane)

    def cleanup(self) -> None:
        """Waits for queued copies before the buffers go back; returns a slot still held."""
        for lane in range(len(self.bufs)):
            try:
                self._settle(lane)
            except Exception as err:  # already failing; the buffer may still be written, so keep it
                self.st.ctx.log.warning("TCP: staging copy did not settle (%s); buffer withheld", err)
                self.bufs[lane] = 0
        for buf in self.bufs:
            if buf:
                self.st.pool.release(buf)
        if self.slot is not None:
            try:
                self.st.ctx.control_request(self.req.remote.engine_key, "tcp.gpu_return", {"slots": [self.slot]})
            except Exception as err:  # the target reclaims it when the lease expires
                self.st.ctx.log.debug("TCP: returning staging slot: %s", err)
