"""The shmem instances of a process: init, finalize, and access for the public API.

A process is usually one PE. MORI's single-process-multi-thread mode (SPMT: one PE per thread,
each thread initializing with its own rank) works too: an instance belongs to the thread that
initialized it. A call from any thread reaches that thread's PE, else the process's only PE;
in a process of several PEs a thread that is none of them gets an error saying so.

Init agrees on the heap settings with every PE (a mismatch fails on every PE with the same
message), builds the heap (GPU or CPU), publishes the device state, and ends with a barrier, so
when ``shmem_init_*`` returns every PE can already reach every other PE's heap.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from mori.core import config, get_logger
from mori.core.host import HostIdentity, this_host

from ._allocator import INTERNAL_BYTES, MIN_ALIGNMENT, SymmetricAllocator
from ._errors import ShmemError, ShmemNotInitializedError
from ._gpu_states import MAX_PES, pack_fast_states, pack_gpu_states
from ._heap import PEER_BASES_OFFSET, Heap
from ._reach import Reach
from ._remote import RemoteTransport
from ._remote_setup import open_remote
from ._rma import Rma

__all__ = [
    "ShmemError",
    "ShmemNotInitializedError",
    "Shmem",
    "current",
    "ensure_uninitialized",
    "finalize",
    "initialize",
    "is_initialized",
]

log = get_logger("shmem")


@dataclass
class Shmem:
    """Everything an initialized PE holds."""

    bootstrap: Any
    owns_bootstrap: bool
    heap: Heap
    allocator: SymmetricAllocator
    rma: Rma
    states: bytes
    ctx: Any = None
    ops: Any = None  # HostOps kernels on a GPU heap
    registered: dict[int, int] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.bootstrap.rank)

    @property
    def world(self) -> int:
        return int(self.bootstrap.world)


class _ThreadPe(threading.local):
    instance: Shmem | None = None


_mine = _ThreadPe()  # the PE the calling thread initialized
_all: list[Shmem] = []  # every PE of this process, in order of init
_all_lock = threading.Lock()


def _find() -> Shmem | None:
    if _mine.instance is not None:
        return _mine.instance
    with _all_lock:
        if len(_all) > 1:
            ranks = ", ".join(str(s.rank) for s in _all)
            raise ShmemError(
                f"this thread is none of the {len(_all)} PEs of this process (PEs {ranks}, one per "
                "thread): call mori.shmem from the thread that initialized the PE"
            )
        return _all[0] if _all else None


def current() -> Shmem:
    """The calling thread's PE, else the process's only PE; raises :class:`ShmemNotInitializedError`
    when there is none (and :class:`ShmemError` from a thread that is none of several PEs)."""
    instance = _mine.instance or _find()  # the first: a put's every call asks
    if instance is None:
        raise ShmemNotInitializedError(
            "mori.shmem is not initialized: call shmem_init_attr(...), shmem_torch_process_group_init(name) "
            "or shmem_init_from_env() first"
        )
    return instance


def is_initialized() -> bool:
    """Whether a call from this thread reaches an initialized PE."""
    try:
        return _find() is not None
    except ShmemError:
        return False


def _agree(bootstrap: Any, what: str, mine: str) -> None:
    """Fails on every PE, with one message, unless all PEs hold the same ``mine``."""
    values = [v.decode() for v in bootstrap.allgather(mine.encode())]
    if len(set(values)) != 1:
        listing = "; ".join(f"PE {pe}: {v}" for pe, v in enumerate(values))
        raise ShmemError(f"PEs disagree on {what}: {listing}")


def check_symmetric(s: Shmem, call: str) -> None:
    """Collective: fails on every PE, naming what each holds, unless all PEs hold the same live
    symmetric blocks and (when ``call`` is given) are making the same call now. Without this, an
    asymmetric ``shmem_malloc``/``shmem_free`` sequence gives PEs different addresses for "the
    same" buffer, and puts land in the wrong place."""
    mine = f"{s.allocator.layout()}" + (f"; now {call}" if call else "")
    values = [v.decode() for v in s.bootstrap.allgather(mine.encode())]
    if len(set(values)) != 1:
        listing = "; ".join(f"PE {pe}: {v}" for pe, v in enumerate(values))
        raise ShmemError(
            f"asymmetric symmetric-heap allocation ({listing}): every PE must allocate and free "
            "the same sizes in the same order"
        )


def _resolve_backend() -> str:
    from ._cuda import cuda_device_count

    backend = config.get("MORI_SHMEM_BACKEND")
    if backend == "cpu":
        return "cpu"
    count = cuda_device_count()
    if backend == "gpu" and count == 0:
        raise ShmemError("MORI_SHMEM_BACKEND=gpu but no CUDA device is visible (driver missing or no GPU)")
    return "gpu" if count else "cpu"


def ensure_uninitialized() -> None:
    """Raises :class:`ShmemError` when the calling thread already initialized a PE."""
    mine = _mine.instance
    if mine is not None:
        raise ShmemError(
            f"mori.shmem is already initialized (PE {mine.rank} of {mine.world}); "
            "call shmem_finalize() before initializing again"
        )


def initialize(bootstrap: Any, owns_bootstrap: bool) -> Shmem:
    """Builds the heap over ``bootstrap`` and makes it the calling thread's PE (collective)."""
    try:
        ensure_uninitialized()
    except ShmemError:
        if owns_bootstrap:
            bootstrap.close()
        raise
    heap: Heap | None = None
    remote: RemoteTransport | None = None
    try:
        if bootstrap.world > MAX_PES:
            raise ShmemError(f"{bootstrap.world} PEs exceed the device state's limit of {MAX_PES}")
        size = config.get("MORI_SHMEM_HEAP_SIZE")
        if size < INTERNAL_BYTES + MIN_ALIGNMENT:
            raise ShmemError(
                f"MORI_SHMEM_HEAP_SIZE={size} bytes is too small: the first {INTERNAL_BYTES} "
                "bytes are mori's internal area"
            )
        kind, mode, p2p_off = _resolve_backend(), config.get("MORI_SHMEM_MODE"), config.get("MORI_DISABLE_P2P")
        chunk = config.get("MORI_SHMEM_VMM_CHUNK_SIZE")
        _agree(
            bootstrap,
            "the heap settings (backend, MORI_SHMEM_HEAP_SIZE, MORI_SHMEM_MODE, chunk, P2P)",
            f"{kind} {size} {mode} {chunk} p2p={'off' if p2p_off else 'on'}",
        )
        hosts = [HostIdentity.from_key(k.decode()) for k in bootstrap.allgather(this_host().key.encode())]
        reach = Reach.of(bootstrap.rank, hosts, p2p_off)
        ctx = ops = None
        if kind == "gpu":
            from ._cuda import Context
            from ._heap_gpu import GpuHeap

            ctx = Context(bootstrap.rank)
            heap = GpuHeap(bootstrap, ctx, size, mode, chunk, reach, initial=INTERNAL_BYTES)
        else:
            from ._heap_cpu import CpuHeap

            heap = CpuHeap(bootstrap, size, reach)
        # The largest power of two dividing every PE's heap base bounds symmetric alignment.
        base_align = min(int(b) for b in bootstrap.allgather(str(heap.base & -heap.base).encode()))
        allocator = SymmetricAllocator(heap.size, max_alignment=base_align)
        remote = open_remote(bootstrap, heap, reach, config.get("MORI_SHMEM_TIMEOUT"), allocator.live)
        heap.publish_peer_bases()
        ring, tickets = remote.device_proxy  # kernels reach remote PEs through it (0, 0: none)
        states = pack_gpu_states(
            bootstrap.rank, bootstrap.world, heap.base, heap.size, heap.base + PEER_BASES_OFFSET, p2p_off, ring, tickets
        )
        if ctx is not None:
            from ._kernels import HostOps

            fast = pack_fast_states(
                bootstrap.rank, bootstrap.world, heap.base, heap.size, list(heap.peer_bases), p2p_off, proxy=ring != 0
            )
            ops = HostOps(ctx, heap, states, fast)
            heap.ops = ops  # type: ignore[union-attr]
        rma = Rma(heap, reach, remote, config.get("MORI_SHMEM_TIMEOUT"), allocator)
        instance = Shmem(bootstrap, owns_bootstrap, heap, allocator, rma, states, ctx, ops)
        bootstrap.barrier()
    except BaseException:
        if remote is not None:
            remote.close()
        if heap is not None:
            heap.close()
        if owns_bootstrap:
            bootstrap.close()
        raise
    _mine.instance = instance
    with _all_lock:
        _all.append(instance)
    log.info("PE %d/%d initialized: %s", instance.rank, instance.world, heap.describe())
    return instance


def finalize() -> None:
    """Tears the instance down after a barrier (no PE unmaps while a peer may still write). A
    failed device-initiated operation found while draining is raised after the teardown: this PE
    still joins the barrier, so its peers do not wait for it."""
    instance = current()
    failed: ShmemError | None = None
    try:
        try:
            instance.rma.quiet()  # the device, and the proxy's commands to remote PEs, drained first
        except ShmemError as exc:
            failed = exc
        instance.bootstrap.barrier()
    finally:
        if _mine.instance is instance:
            _mine.instance = None
        with _all_lock:
            _all.remove(instance)
        try:
            if instance.ops is not None:
                instance.ops.close()
            instance.rma.remote.close()
            instance.heap.close()
        finally:
            if instance.owns_bootstrap:
                instance.bootstrap.close()
    if failed is not None:
        raise failed
