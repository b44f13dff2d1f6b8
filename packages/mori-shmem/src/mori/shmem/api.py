"""The mori.shmem host API: MORI's names and behaviour (``shmem-guide.md``), plus host-initiated RMA.

Every function except the init functions and :func:`shmem_get_unique_id` needs an initialized PE
and raises :class:`ShmemNotInitializedError` otherwise. Allocation and free are collective in
effect: every PE must make the same sequence of calls, which is what keeps addresses symmetric.
"""

from __future__ import annotations

import os
from typing import Any

from mori.core import bootstrap as _bootstrap
from mori.core import config
from mori.core.codes import Cmp, SignalOp

from . import _state
from ._allocator import MIN_ALIGNMENT

__all__ = [
    "MORI_SHMEM_INIT_WITH_MPI_COMM",
    "MORI_SHMEM_INIT_WITH_UNIQUEID",
    "SHMEM_CMP_EQ",
    "SHMEM_CMP_NE",
    "SHMEM_CMP_GT",
    "SHMEM_CMP_GE",
    "SHMEM_CMP_LT",
    "SHMEM_CMP_LE",
    "SHMEM_SIGNAL_SET",
    "SHMEM_SIGNAL_ADD",
    "shmem_torch_process_group_init",
    "shmem_mpi_init",
    "shmem_get_unique_id",
    "shmem_init_attr",
    "shmem_init_from_env",
    "shmem_finalize",
    "shmem_is_initialized",
    "shmem_mype",
    "shmem_npes",
    "shmem_num_qp_per_pe",
    "shmem_malloc",
    "shmem_malloc_align",
    "shmem_ext_malloc_with_flags",
    "shmem_free",
    "shmem_buffer_register",
    "shmem_buffer_deregister",
    "shmem_ptr_p2p",
    "shmem_barrier_all",
    "shmem_barrier_on_stream",
    "shmem_module_init",
    "shmem_load_module",
    "shmem_putmem",
    "shmem_getmem",
    "shmem_getmem_into",
    "shmem_putmem_signal",
    "shmem_atomic_fetch_add",
    "shmem_atomic_add",
    "shmem_atomic_compare_swap",
    "shmem_atomic_swap",
    "shmem_atomic_set",
    "shmem_atomic_fetch",
    "shmem_wait_until",
    "shmem_quiet",
    "shmem_fence",
    "get_gpu_states_bytes",
    "shmem_heap_info",
]

#: ``shmem_init_attr`` flag: bootstrap through an MPI communicator (mpi4py).
MORI_SHMEM_INIT_WITH_MPI_COMM = 0
#: ``shmem_init_attr`` flag: bootstrap through a unique id from :func:`shmem_get_unique_id`.
MORI_SHMEM_INIT_WITH_UNIQUEID = 1
#: Comparison codes of :func:`shmem_wait_until` (:class:`mori.core.codes.Cmp`).
SHMEM_CMP_EQ, SHMEM_CMP_NE, SHMEM_CMP_GT, SHMEM_CMP_GE, SHMEM_CMP_LT, SHMEM_CMP_LE = Cmp
#: Signal updates of :func:`shmem_putmem_signal` (:class:`mori.core.codes.SignalOp`: MORI's 9 and 10).
SHMEM_SIGNAL_SET, SHMEM_SIGNAL_ADD = SignalOp
#: Environment variables :func:`shmem_init_from_env` reads (set by ``python -m mori.shmem.run``).
ENV_RANK, ENV_WORLD, ENV_UID = "MORI_SHMEM_RANK", "MORI_SHMEM_WORLD", "MORI_SHMEM_UNIQUE_ID"


# -- initialization ---------------------------------------------------------------------------
def shmem_get_unique_id() -> bytes:
    """A 128-byte unique id; any process makes it (rank 0, or a launcher or main thread that is no
    PE) and shares it with the PEs by any means. The maker must outlive rank 0's init."""
    return bytes(_bootstrap.get_unique_id())


def _check_rank(rank: int, world: int) -> None:
    for name, value in (("rank", rank), ("nranks", world)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world}) (nranks={world})")


def shmem_init_attr(flags: int, rank: int, nranks: int, unique_id: Any = None) -> int:
    """Initializes this PE (collective over all ``nranks`` PEs). Returns 0.

    ``flags`` = :data:`MORI_SHMEM_INIT_WITH_UNIQUEID`: ``unique_id`` is the 128-byte id of
    :func:`shmem_get_unique_id`. ``flags`` = :data:`MORI_SHMEM_INIT_WITH_MPI_COMM`: ``unique_id``
    is the communicator: its ``MPI_Comm`` handle as an int (what MORI's C API takes; mpi4py's
    ``MPI._handleof(comm)``), an mpi4py communicator, or None for ``MPI.COMM_WORLD``; its rank and
    size must equal ``rank`` and ``nranks``.
    """
    _check_rank(rank, nranks)
    if flags == MORI_SHMEM_INIT_WITH_UNIQUEID:
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != 128:
            raise ValueError(
                "unique_id must be the 128 bytes returned by shmem_get_unique_id(), got "
                f"{type(unique_id).__name__} of length {len(unique_id) if hasattr(unique_id, '__len__') else '?'}"
            )
        _state.ensure_uninitialized()
        bs = _bootstrap.Bootstrap(rank, nranks, bytes(unique_id))
    elif flags == MORI_SHMEM_INIT_WITH_MPI_COMM:
        _state.ensure_uninitialized()
        bs = _bootstrap.init_from_mpi(unique_id)
        if (bs.rank, bs.world) != (rank, nranks):
            bs.close()
            raise ValueError(
                f"rank/nranks ({rank}, {nranks}) differ from the MPI communicator's ({bs.rank}, {bs.world})"
            )
    else:
        raise ValueError(
            f"flags={flags!r}: expected MORI_SHMEM_INIT_WITH_UNIQUEID ({MORI_SHMEM_INIT_WITH_UNIQUEID}) "
            f"or MORI_SHMEM_INIT_WITH_MPI_COMM ({MORI_SHMEM_INIT_WITH_MPI_COMM})"
        )
    _state.initialize(bs, owns_bootstrap=True)
    return 0


def shmem_torch_process_group_init(group_name: str) -> int:
    """Initializes from a torch.distributed process group registered under ``group_name``. Returns 0.

    ``"default"`` works as in MORI once the world group is registered under that name
    (``torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)``);
    an unregistered ``"default"`` falls back to the world group.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise _state.ShmemError("torch.distributed is not initialized: call dist.init_process_group first")
    _state.ensure_uninitialized()
    group: Any
    try:
        group = torch._C._distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
    except Exception:
        if group_name not in ("default", "WORLD", "world"):
            raise ValueError(f"no torch process group is registered under {group_name!r}") from None
        group = dist.group.WORLD
    _state.initialize(_bootstrap.init_from_torch(group), owns_bootstrap=True)
    return 0


def shmem_mpi_init() -> int:
    """Initializes every rank of ``MPI.COMM_WORLD`` as a PE (mpi4py; collective). Returns 0."""
    _state.ensure_uninitialized()
    _state.initialize(_bootstrap.init_from_mpi(None), owns_bootstrap=True)
    return 0


def shmem_init_from_env() -> int:
    """Initializes from ``MORI_SHMEM_RANK``/``MORI_SHMEM_WORLD``/``MORI_SHMEM_UNIQUE_ID`` (hex).

    ``python -m mori.shmem.run -n N script.py`` sets these for each PE it starts. Returns 0.
    """
    missing = [v for v in (ENV_RANK, ENV_WORLD, ENV_UID) if v not in os.environ]
    if missing:
        raise _state.ShmemError(
            f"shmem_init_from_env: {', '.join(missing)} not set (start the script with python -m mori.shmem.run -n N)"
        )
    try:
        uid = bytes.fromhex(os.environ[ENV_UID])
        rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    except ValueError as exc:
        raise _state.ShmemError(f"shmem_init_from_env: malformed launcher variables: {exc}") from None
    return shmem_init_attr(MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world, uid)


def shmem_finalize() -> int:
    """Collective: waits for every PE, then unmaps and frees the heap. Init may follow again. Returns 0."""
    _state.finalize()
    return 0


def shmem_is_initialized() -> bool:
    """Whether this process is an initialized PE."""
    return _state.is_initialized()


# -- queries ----------------------------------------------------------------------------------
def shmem_mype() -> int:
    """This PE's number, 0..npes-1."""
    return _state.current().rank


def shmem_npes() -> int:
    """The number of PEs."""
    return _state.current().world


def shmem_num_qp_per_pe() -> int:
    """RDMA queue pairs per PE (``MORI_NUM_QP_PER_PE``; P2P peers use none)."""
    _state.current()
    return int(config.get("MORI_NUM_QP_PER_PE"))


def shmem_heap_info() -> dict[str, Any]:
    """The heap's kind (gpu/cpu), mode, base, size, bytes in use, largest alignment, the PEs whose
    heaps are mapped here (``reachable``) and those reached through the remote transport
    (``remote``), and how the remote transport moved the local side of its transfers so far
    (``remote_stats``: ``staged`` through its staging area, ``registered_for_call``, and the
    ``registered_buffers`` it holds for good: those of :func:`shmem_buffer_register`, and on a GPU
    heap the device proxy's bounce area)."""
    s = _state.current()
    info = s.heap.describe()
    info.update(
        mode=getattr(s.heap, "mode", "static"),
        in_use=s.allocator.in_use,
        remote=list(s.rma.reach.remote),
        max_alignment=s.allocator.max_alignment,
        remote_stats=s.rma.remote.stats,
        device=s.ctx.device if s.ctx is not None else None,
    )
    return info


def get_gpu_states_bytes() -> bytes:
    """The 64 bytes ``shmem_module_init`` writes into ``globalGpuStates`` (for tests and tools)."""
    return _state.current().states


# -- memory -----------------------------------------------------------------------------------
def shmem_malloc_align(alignment: int, size: int) -> int:
    """Allocates ``size`` symmetric bytes aligned to ``alignment`` (a power of two); returns the address.

    ``alignment`` may be at most ``shmem_heap_info()["max_alignment"]`` (the alignment of every
    PE's heap base: 2 MiB on GPU heaps, the page size or more on CPU heaps). Size 0 returns 0 (as OpenSHMEM). Raises :class:`ShmemOutOfMemoryError` stating heap size,
    bytes in use and the request when the heap is full.
    """
    s = _state.current()
    if size == 0 and isinstance(size, int):
        return 0
    if config.get("MORI_SHMEM_DEBUG"):
        _state.check_symmetric(s, f"shmem_malloc_align({alignment}, {size})")
    offset = s.allocator.malloc(size, alignment)
    try:
        s.heap.ensure_mapped(offset + size)
    except BaseException:
        s.allocator.free(offset)
        raise
    return s.heap.base + offset


def shmem_malloc(size: int) -> int:
    """Allocates ``size`` symmetric bytes (256-byte aligned); returns the address as an int."""
    return shmem_malloc_align(MIN_ALIGNMENT, size)


def shmem_ext_malloc_with_flags(size: int, flags: int) -> int:
    """Allocates like :func:`shmem_malloc`; ``flags`` (MORI's hipExtMallocWithFlags bits) must be >= 0.

    Heap memory is already coherent for peers' loads and stores over NVLink, so the flags
    change nothing here; they are accepted for MORI compatibility.
    """
    if not isinstance(flags, int) or flags < 0:
        raise ValueError(f"flags must be a non-negative int, got {flags!r}")
    return shmem_malloc(size)


def shmem_free(ptr: int) -> None:
    """Frees a block from :func:`shmem_malloc` (0 is ignored). Every PE must free the same blocks."""
    s = _state.current()
    if ptr == 0:
        return
    if not isinstance(ptr, int) or not s.heap.base <= ptr < s.heap.base + s.heap.size:
        raise ValueError(f"shmem_free: {ptr!r} is not an address in the symmetric heap")
    if config.get("MORI_SHMEM_DEBUG"):
        _state.check_symmetric(s, f"shmem_free(heap offset {ptr - s.heap.base:#x})")
    s.allocator.free(ptr - s.heap.base)


def _in_heap(s: _state.Shmem, ptr: int, size: int) -> bool:
    return s.heap.base <= ptr and ptr + size <= s.heap.base + s.heap.size


def shmem_buffer_register(ptr: int, size: int) -> int:
    """Registers an existing buffer for RDMA; returns 0. Later RMA between it and PEs reached
    through the remote transport moves it as is, with no staging and no registration per call
    (P2P peers need no registration). A buffer inside the heap needs none either."""
    s = _state.current()
    if not isinstance(ptr, int) or ptr <= 0 or not isinstance(size, int) or size <= 0:
        raise ValueError(f"shmem_buffer_register: need a non-null address and a positive size, got {ptr!r}, {size!r}")
    for start, length in s.registered.items():
        if ptr < start + length and start < ptr + size:
            raise ValueError(f"shmem_buffer_register: {ptr:#x}+{size} overlaps the registered {start:#x}+{length}")
    if not _in_heap(s, ptr, size):  # the heap is registered already
        s.rma.remote.register_buffer(ptr, size)
    s.registered[ptr] = size
    return 0


def shmem_buffer_deregister(ptr: int, size: int) -> int:
    """Deregisters a buffer registered with the same address and size; returns 0."""
    s = _state.current()
    if s.registered.get(ptr) != size:
        raise ValueError(f"shmem_buffer_deregister: {ptr!r}+{size!r} was not registered")
    del s.registered[ptr]
    if not _in_heap(s, ptr, size):
        s.rma.remote.deregister_buffer(ptr)
    return 0


def shmem_ptr_p2p(dest_ptr: int, my_pe: int, dest_pe: int) -> int:
    """The address at which this process reaches ``dest_pe``'s copy of ``dest_ptr``; 0 when it cannot.

    0 for a PE reached through the remote transport (another host, or ``MORI_DISABLE_P2P``), and
    for an address outside the heap or a PE out of range, as in MORI.
    """
    s = _state.current()
    if not isinstance(dest_ptr, int) or not s.heap.base <= dest_ptr < s.heap.base + s.heap.size:
        return 0
    if my_pe != s.rank or not isinstance(dest_pe, int) or not 0 <= dest_pe < s.world:
        return 0
    peer = s.heap.peer_bases[dest_pe]
    return peer + (dest_ptr - s.heap.base) if peer else 0


# -- synchronization --------------------------------------------------------------------------
def shmem_barrier_all() -> None:
    """Completes this PE's outstanding operations, then waits for every PE.

    The barrier also compares every PE's live ``shmem_malloc`` blocks and raises
    :class:`ShmemError` on every PE when they differ (an asymmetric allocation sequence); with
    ``MORI_SHMEM_DEBUG`` set each allocation call is checked as it is made.
    """
    s = _state.current()
    s.rma.quiet()
    _state.check_symmetric(s, "")  # an allgather: it waits for every PE as a barrier does


def shmem_barrier_on_stream(stream: Any = None) -> None:
    """Enqueues a device barrier over all PEs on a CUDA ``stream`` (None: the default stream).

    On a GPU heap this launches the device ``ShmemBarrierAllBlock`` kernel and returns at once;
    on the CPU heap (no streams) it is :func:`shmem_barrier_all`.
    """
    s = _state.current()
    if s.ops is None:
        shmem_barrier_all()
        return
    from ._cuda import stream_handle

    s.ops.barrier(stream_handle(stream))


def shmem_module_init(module: Any) -> int:
    """Writes the device state into ``globalGpuStates`` of a loaded CUDA module (Triton's or yours).

    ``module``: a ``CUmodule`` or its int handle. A module without that symbol is left alone.
    Returns 0.
    """
    s = _state.current()
    if s.ops is None:
        raise _state.ShmemError("shmem_module_init needs a GPU heap; this PE's heap is in host memory")
    s.ops.module_init(module)
    return 0


def shmem_load_module(source: str, name: str = "module.cu") -> Any:
    """Compiles and loads a CUDA module written against mori's device API, ready to launch.

    ``source`` is CUDA C++ that includes ``<mori/device/shmem.cuh>`` (with
    ``MORI_DEVICE_DEFINE_STATE`` in it); ``name`` names it in compiler errors. NVRTC compiles it
    for this PE's GPU (cached on disk, :mod:`mori.core.nvrtc`), the module is loaded into this PE's
    CUDA context, and :func:`shmem_module_init` gives it this PE's state. Returns the
    ``cuda.bindings.driver.CUmodule``: get a kernel with ``cuModuleGetFunction`` and launch it
    with ``cuLaunchKernel``. Raises :class:`ShmemError` on a CPU heap and
    :class:`mori.core.nvrtc.NvrtcError` with the compiler's log when ``source`` does not compile.
    """
    s = _state.current()
    if s.ops is None:
        raise _state.ShmemError("shmem_load_module needs a GPU heap; this PE's heap is in host memory")
    from ._kernels import load_module

    module = load_module(s.ctx, source, name)
    s.ops.module_init(module)
    return module


# -- host-initiated RMA -----------------------------------------------------------------------
def shmem_putmem(dest: Any, data: Any, pe: int) -> None:
    """Copies ``data`` (bytes-like, numpy array or tensor) to symmetric ``dest`` on PE ``pe``.

    ``dest`` is a symmetric address or a tensor on the heap. Complete when it returns.
    """
    _state.current().rma.put(_addr(dest), data, pe)


def shmem_getmem(src: Any, nbytes: int, pe: int) -> bytes:
    """Reads ``nbytes`` at symmetric ``src`` on PE ``pe``."""
    return _state.current().rma.get(_addr(src), nbytes, pe)


def shmem_getmem_into(out: Any, src: Any, pe: int) -> None:
    """Fills ``out`` (bytearray, numpy array, tensor) from symmetric ``src`` on PE ``pe``."""
    _state.current().rma.get_into(out, _addr(src), pe)


def shmem_putmem_signal(dest: Any, data: Any, sig_addr: Any, signal: int, sig_op: int, pe: int) -> None:
    """Puts ``data`` then updates the 64-bit ``sig_addr`` on ``pe`` (SHMEM_SIGNAL_SET or _ADD).

    A PE that sees the signal change sees the data.
    """
    _state.current().rma.put_signal(_addr(dest), data, _addr(sig_addr), signal, sig_op, pe)


def shmem_atomic_fetch_add(dest: Any, value: int, pe: int, width: int = 64) -> int:
    """Atomically adds ``value`` to the word at ``dest`` on ``pe``; returns the old value."""
    return _state.current().rma.atomic("fetch_add", _addr(dest), value, pe, width=width)


def shmem_atomic_add(dest: Any, value: int, pe: int, width: int = 64) -> None:
    """Atomically adds ``value`` to the word at ``dest`` on ``pe``."""
    _state.current().rma.atomic("fetch_add", _addr(dest), value, pe, width=width)


def shmem_atomic_compare_swap(dest: Any, cond: int, value: int, pe: int, width: int = 64) -> int:
    """Writes ``value`` at ``dest`` on ``pe`` if it holds ``cond``; returns the old value."""
    return _state.current().rma.atomic("compare_swap", _addr(dest), value, pe, compare=cond, width=width)


def shmem_atomic_swap(dest: Any, value: int, pe: int, width: int = 64) -> int:
    """Writes ``value`` at ``dest`` on ``pe``; returns the old value."""
    return _state.current().rma.atomic("swap", _addr(dest), value, pe, width=width)


def shmem_atomic_set(dest: Any, value: int, pe: int, width: int = 64) -> None:
    """Atomically writes ``value`` at ``dest`` on ``pe``."""
    _state.current().rma.atomic("store", _addr(dest), value, pe, width=width)


def shmem_atomic_fetch(dest: Any, pe: int, width: int = 64) -> int:
    """Atomically reads the word at ``dest`` on ``pe``."""
    return _state.current().rma.atomic("fetch_add", _addr(dest), 0, pe, width=width)


def shmem_wait_until(ivar: Any, cmp: int | str, value: int, timeout: float | None = None, width: int = 64) -> int:
    """Waits until this PE's word at ``ivar`` satisfies ``cmp`` (SHMEM_CMP_* or 'eq'...'le') against ``value``.

    Returns the value seen. Raises TimeoutError after ``timeout`` seconds (default
    ``MORI_SHMEM_TIMEOUT``) naming the address, the condition and the last value seen.
    """
    return _state.current().rma.wait_until(_addr(ivar), cmp, value, timeout, width)


def shmem_quiet() -> None:
    """Completes every RMA this PE issued."""
    _state.current().rma.quiet()


def shmem_fence() -> None:
    """Orders this PE's earlier RMA before its later RMA to each PE."""
    _state.current().rma.fence()


def _addr(obj: Any) -> int:
    """A symmetric address from an int or a tensor/array on the heap."""
    if type(obj) is int:  # the usual case first, in one test (a bool is no address)
        return obj
    if hasattr(obj, "data_ptr"):
        return int(obj.data_ptr())
    if hasattr(obj, "ctypes"):
        return int(obj.ctypes.data)
    raise TypeError(f"expected a symmetric address (int) or a tensor on the heap, got {type(obj).__name__}")
