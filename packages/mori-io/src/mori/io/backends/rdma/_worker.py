"""One UCX worker and the thread that drives it: endpoints to peers, one-sided puts and gets, the
flushes that complete a transfer, notifications (active messages) and deadlines.

Calls on a worker are serialized by its lock (``UCS_THREAD_MODE_SERIALIZED``): a caller whose
worker is free posts its transfer itself (no thread hand-off on the latency path), otherwise it
queues the transfer for the worker's thread; that thread progresses the worker, completes
transfers and sleeps on the worker's event fd and a wake-up pipe when there is nothing to do. Requests are posted without callbacks and freed at
once (UCX releases them when they complete); a transfer completes when the flush of each endpoint
it used completes, which UCX reports only after every earlier operation on that endpoint finished.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes as C
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...types import StatusCode, TransferStatus
from . import _ucx as U

__all__ = ["PeerRoute", "Job", "UcxWorker", "NOTIFY_AM_ID", "NOTE"]

NOTIFY_AM_ID = 0x4D4F  # active-message id of a completion notification
NOTE = struct.Struct("<QQi")  # connection id, transfer uid, status code
_CLOSE_WAIT = 5.0  # seconds a forced endpoint close may take to cancel what was in flight
_MAX_RKEYS = 4096  # unpacked remote keys kept per peer and lane set


@dataclass(frozen=True)
class PeerRoute:
    """How to reach a remote engine: its workers' addresses and the id under which it accepts our
    notifications (handed out by its control plane to us alone)."""

    key: str
    addresses: tuple[bytes, ...]
    conn_id: int


@dataclass
class Job:
    """One transfer for a worker: blocks are (local offset, remote offset, bytes)."""

    status: TransferStatus
    uid: int
    route: PeerRoute
    write: bool
    blocks: list[tuple[int, int, int]]
    local_addr: int
    memh: int
    remote_addr: int
    rkey: bytes
    notify: bool
    deadline: float
    flushes: list[int] = field(default_factory=list)
    error: str = ""
    expired: bool = False
    on_success: Callable[[], None] | None = None


class _Peer:
    """Endpoints (lanes) of one worker to one remote engine, and the remote keys unpacked on them."""

    def __init__(self, eps: list[int]) -> None:
        self.eps = eps
        self.rkeys: dict[tuple[int, bytes], int] = {}
        self.failed = ""


class UcxWorker:
    """A UCX worker with its progress thread. ``on_failure(key, why)`` is told when the endpoints
    to an engine break or time out; ``on_note(conn_id, uid, code)`` receives inbound notifications."""

    def __init__(self, ucx: U.Ucx, context: int, index: int, lanes: int, polling: bool, post_batch: int, name: str,
                 on_failure: Callable[[str, str], None], on_note: Callable[[int, int, int], None]) -> None:
        self._ucx, self._ucp, self._context, self._index = ucx, ucx.ucp, context, index
        self._lanes, self._polling, self._post_batch = lanes, polling, post_batch
        self._on_failure, self._on_note = on_failure, on_note
        self._jobs: collections.deque[Job | Callable[[], None]] = collections.deque()
        self._active: list[Job] = []
        self._peers: dict[str, _Peer] = {}
        self._ep_owner: dict[int, str] = {}
        self._broken: set[str] = set()
        self._stop = False
        self._dead = False  # set under _lock once the worker is destroyed
        self._lock = threading.Lock()  # serializes every call on the UCX worker
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # ctypes callbacks must outlive the worker: kept on the instance.
        self._err_cb = U.ERR_HANDLER(self._ep_error)
        self._am_cb = U.AM_RECV(self._am_recv)
        self._worker = C.c_void_p()
        self._efd = -1
        self.address = b""
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"mori-io-ucx:{name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("UCX worker did not start in 60 s")
        if self._start_error is not None:
            raise self._start_error

    # ---- other threads -------------------------------------------------------------------------
    def post(self, item: Job | Callable[[], None]) -> None:
        """Hands a transfer (or a call to run on the worker thread) to the worker."""
        if self._stop:
            if isinstance(item, Job):
                item.status._set(StatusCode.ERR_BAD_STATE, "RDMA backend is closed")
            return
        if isinstance(item, Job) and not self._jobs and self._lock.acquire(blocking=False):
            try:  # the worker is free: post here, the worker's thread completes it
                if self._dead:
                    item.status._set(StatusCode.ERR_BAD_STATE, "RDMA backend is closed")
                    return
                self._start(item)
            finally:
                self._lock.release()
        else:
            self._jobs.append(item)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def forget(self, key: str) -> None:
        """Closes the endpoints to engine ``key`` (on the worker thread)."""
        self.post(lambda: self._close_peer(key, "the engine was deregistered"))

    def close(self) -> None:
        """Stops the thread: transfers still running are cancelled and fail; idempotent."""
        if not self._stop:
            self._stop = True
            self._wake()
            self._thread.join(timeout=_CLOSE_WAIT + 30)
            os.close(self._wake_r)
            os.close(self._wake_w)

    # ---- the worker thread ---------------------------------------------------------------------
    def _create(self) -> None:
        params = U.UcpWorkerParams(field_mask=U.UCP_WORKER_PARAM_FIELD_THREAD_MODE | U.UCP_WORKER_PARAM_FIELD_EVENTS,
                                   thread_mode=U.UCS_THREAD_MODE_SERIALIZED,
                                   events=U.UCP_WAKEUP_RMA | U.UCP_WAKEUP_TX | U.UCP_WAKEUP_RX)
        self._ucx.check("ucp_worker_create", self._ucp.ucp_worker_create(self._context, C.byref(params),
                                                                           C.byref(self._worker)))
        addr, length = C.c_void_p(), C.c_size_t()
        self._ucx.check("ucp_worker_get_address", self._ucp.ucp_worker_get_address(self._worker, C.byref(addr),
                                                                                     C.byref(length)))
        self.address = C.string_at(addr, length.value)
        self._ucp.ucp_worker_release_address(self._worker, addr)
        efd = C.c_int()
        self._ucx.check("ucp_worker_get_efd", self._ucp.ucp_worker_get_efd(self._worker, C.byref(efd)))
        self._efd = efd.value
        am = U.UcpAmHandlerParam(field_mask=U.UCP_AM_HANDLER_PARAM_FIELD_ID | U.UCP_AM_HANDLER_PARAM_FIELD_CB,
                                 id=NOTIFY_AM_ID, cb=self._am_cb)
        self._ucx.check("ucp_worker_set_am_recv_handler",
                        self._ucp.ucp_worker_set_am_recv_handler(self._worker, C.byref(am)))

    def _run(self) -> None:
        try:
            self._create()
        except BaseException as err:  # reported to the constructor
            self._start_error = err
            if self._worker:
                self._ucp.ucp_worker_destroy(self._worker)
            self._ready.set()
            return
        self._ready.set()
        progress = self._ucp.ucp_worker_progress
        try:
            while not self._stop:
                with self._lock:
                    while self._jobs:
                        item = self._jobs.popleft()
                        if isinstance(item, Job):
                            self._start(item)
                        else:
                            item()
                    busy = progress(self._worker)
                    if self._active or self._broken:
                        self._reap()
                    active = bool(self._active)
                if busy or (self._polling and active):
                    continue
                self._wait()
        finally:
            with self._lock:
                self._teardown()
                self._dead = True

    def _wait(self) -> None:
        """Sleeps until UCX or another thread has something for us (or the next deadline)."""
        with self._lock:
            if self._jobs:
                return
            status = self._ucp.ucp_worker_arm(self._worker)
            if status == U.UCS_ERR_BUSY:
                return  # events arrived meanwhile: progress again
            timeout = 1.0
            if self._active:
                timeout = max(0.0, min(timeout, min(j.deadline for j in self._active) - time.monotonic()))
        ready, _, _ = select.select([self._efd, self._wake_r], [], [], timeout)
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):
                    pass

    def _peer(self, route: PeerRoute) -> _Peer:
        peer = self._peers.get(route.key)
        if peer is not None:
            return peer
        # Our worker i talks to the remote worker i modulo theirs: the remote threads share the load.
        remote = route.addresses[self._index % len(route.addresses)]
        eps: list[int] = []
        try:
            for _ in range(self._lanes):
                addr = C.create_string_buffer(remote, len(remote))
                params = U.UcpEpParams(field_mask=U.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                                       | U.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | U.UCP_EP_PARAM_FIELD_ERR_HANDLER,
                                       address=C.cast(addr, C.c_void_p), err_mode=U.UCP_ERR_HANDLING_MODE_PEER,
                                       err_handler_cb=self._err_cb)
                ep = C.c_void_p()
                self._ucx.check("ucp_ep_create", self._ucp.ucp_ep_create(self._worker, C.byref(params), C.byref(ep)))
                eps.append(int(ep.value or 0))
                self._ep_owner[eps[-1]] = route.key
        except U.UcxError:
            self._close_eps(eps)
            raise
        peer = self._peers[route.key] = _Peer(eps)
        return peer

    def _rkey(self, key: str, peer: _Peer, lane: int, packed: bytes) -> int:
        rkey = peer.rkeys.get((lane, packed))
        if rkey is None:
            if len(peer.rkeys) >= _MAX_RKEYS and not any(j.route.key == key for j in self._active):
                self._drop_rkeys(peer)  # a peer that registered many regions over time: start afresh
            handle = C.c_void_p()
            self._ucx.check("ucp_ep_rkey_unpack", self._ucp.ucp_ep_rkey_unpack(
                peer.eps[lane], C.create_string_buffer(packed, len(packed)), C.byref(handle)))
            rkey = peer.rkeys[(lane, packed)] = int(handle.value or 0)
        return rkey

    def _start(self, job: Job) -> None:
        if not job.blocks:
            self._finish(job)
            return
        try:
            peer = self._peer(job.route)
            lanes = min(len(peer.eps), len(job.blocks))
            rkeys = [self._rkey(job.route.key, peer, lane, job.rkey) for lane in range(lanes)]
        except U.UcxError as err:
            job.status._set(StatusCode.ERR_RDMA_OP, f"RDMA backend: {err}")
            self._close_peer(job.route.key, str(err))
            return
        param = U.UcpRequestParam(op_attr_mask=U.UCP_OP_ATTR_FIELD_MEMH, memh=job.memh)
        ref = C.byref(param)
        op = self._ucp.ucp_put_nbx if job.write else self._ucp.ucp_get_nbx
        free, progress = self._ucp.ucp_request_free, self._ucp.ucp_worker_progress
        eps, local, remote, batch = peer.eps, job.local_addr, job.remote_addr, self._post_batch
        for i, (l_off, r_off, size) in enumerate(job.blocks):
            lane = i % lanes
            status, req = U.status_ptr(op(eps[lane], local + l_off, size, remote + r_off, rkeys[lane], ref))
            if req is not None:
                free(req)  # released by UCX when it completes; the flush below waits for it
            elif status < 0:
                job.error = f"{'put' if job.write else 'get'} failed: {self._ucx.status_text(status)}"
                break  # what was posted still drains through the flushes before the job ends
            if batch > 0 and (i + 1) % batch == 0:
                progress(self._worker)
        empty = U.UcpRequestParam()
        for lane in range(lanes):
            status, req = U.status_ptr(self._ucp.ucp_ep_flush_nbx(eps[lane], C.byref(empty)))
            if req is not None:
                job.flushes.append(req)
            elif status < 0 and not job.error:
                job.error = f"flush failed: {self._ucx.status_text(status)}"
        self._active.append(job)

    def _reap(self) -> None:
        """Finishes transfers whose flushes completed; breaks peers that failed or timed out."""
        for key in list(self._broken):
            self._close_peer(key, self._peers[key].failed if key in self._peers else "endpoint failed")
        self._broken.clear()
        now = time.monotonic()
        check, free = self._ucp.ucp_request_check_status, self._ucp.ucp_request_free
        still: list[Job] = []
        for job in self._active:
            pending = []
            for req in job.flushes:
                status = check(req)
                if status == U.UCS_INPROGRESS:
                    pending.append(req)
                    continue
                free(req)
                if status < 0 and not job.error:
                    job.error = f"transfer failed: {self._ucx.status_text(status)}"
            job.flushes = pending
            if pending and now < job.deadline:
                still.append(job)
            elif pending and not job.expired:
                job.expired = True
                job.error = "transfer did not complete within MORI_IO_TIMEOUT"
                still.append(job)  # the close below cancels its requests; finished on the next pass
                self._close_peer(job.route.key, job.error)
            else:
                for req in pending:  # cancelled by the close and still not released: UCX frees them later
                    free(req)
                self._finish(job)
        self._active = still

    def _finish(self, job: Job) -> None:
        if job.error:
            job.status._set(StatusCode.ERR_RDMA_OP, f"RDMA backend: {job.error}")
            self._on_failure(job.route.key, job.error)
            return
        if job.notify:
            self._notify(job)
        if job.on_success is not None:
            job.on_success()
        job.status._set(StatusCode.SUCCESS)

    def _notify(self, job: Job) -> None:
        """Tells the target that ``job`` finished: an active message after the flushes, so it
        arrives after every byte of the transfer. Failures to notify are logged by the target's
        absence of a record, never by failing a transfer whose data did arrive."""
        peer = self._peers.get(job.route.key)
        if peer is None:
            return
        header = NOTE.pack(job.route.conn_id, job.uid, int(StatusCode.SUCCESS))
        param = U.UcpRequestParam(op_attr_mask=U.UCP_OP_ATTR_FIELD_FLAGS,
                                  flags=U.UCP_AM_SEND_FLAG_COPY_HEADER | U.UCP_AM_SEND_FLAG_EAGER)
        _, req = U.status_ptr(self._ucp.ucp_am_send_nbx(peer.eps[0], NOTIFY_AM_ID, header, len(header), None, 0,
                                                        C.byref(param)))
        if req is not None:
            self._ucp.ucp_request_free(req)

    def _ep_error(self, arg: int | None, ep: int | None, status: int) -> None:
        key = self._ep_owner.get(int(ep or 0))
        if key is not None and key in self._peers:
            self._peers[key].failed = f"connection to engine {key!r} failed: {self._ucx.status_text(status)}"
            self._broken.add(key)

    def _am_recv(self, arg: Any, header: int | None, header_len: int, data: Any, length: int, param: Any) -> int:
        if header and header_len == NOTE.size:
            conn_id, uid, code = NOTE.unpack(C.string_at(header, header_len))
            self._on_note(conn_id, uid, code)
        return U.UCS_OK

    def _close_eps(self, eps: list[int]) -> None:
        """Force-closes endpoints: whatever was in flight on them is cancelled, and this returns
        once UCX confirmed it (or after _CLOSE_WAIT), so no late byte lands in a buffer."""
        param = U.UcpRequestParam(op_attr_mask=U.UCP_OP_ATTR_FIELD_FLAGS, flags=U.UCP_EP_CLOSE_FLAG_FORCE)
        reqs = []
        for ep in eps:
            self._ep_owner.pop(ep, None)
            _, req = U.status_ptr(self._ucp.ucp_ep_close_nbx(ep, C.byref(param)))
            if req is not None:
                reqs.append(req)
        deadline = time.monotonic() + _CLOSE_WAIT
        while reqs and time.monotonic() < deadline:
            self._ucp.ucp_worker_progress(self._worker)
            pending = []
            for r in reqs:
                if self._ucp.ucp_request_check_status(r) == U.UCS_INPROGRESS:
                    pending.append(r)
                else:
                    self._ucp.ucp_request_free(r)
            reqs = pending
        for r in reqs:
            self._ucp.ucp_request_free(r)

    def _close_peer(self, key: str, why: str) -> None:
        peer = self._peers.pop(key, None)
        if peer is None:
            return
        self._close_eps(peer.eps)
        self._drop_rkeys(peer)
        self._on_failure(key, why)

    def _drop_rkeys(self, peer: _Peer) -> None:
        for rkey in peer.rkeys.values():
            self._ucp.ucp_rkey_destroy(rkey)
        peer.rkeys.clear()

    def _teardown(self) -> None:
        for key in list(self._peers):
            self._close_peer(key, "RDMA backend closed")
        for job in self._active:
            for req in job.flushes:
                self._ucp.ucp_request_free(req)
            job.status._set(StatusCode.ERR_BAD_STATE, "RDMA backend was closed during the transfer")
        self._active = []
        while self._jobs:
            item = self._jobs.popleft()
            if isinstance(item, Job):
                item.status._set(StatusCode.ERR_BAD_STATE, "RDMA backend was closed before the transfer started")
        self._ucp.ucp_worker_destroy(self._worker)
