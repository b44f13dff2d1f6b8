"""mori-core's UCX engine: one native engine for every transport built on UCX (mori-io's RDMA
backend, mori.shmem's remote transport).

UCX is opened at run time (:func:`load`), never linked: mori-core builds and imports with no UCX
present. Which UCX: ``MORI_UCX_LIB`` (a ``libucp.so`` or its folder) when set; otherwise a system
UCX that has verbs transports (its ``ucx/`` module folder holds ``libuct_ib``), then the
``libucx`` wheel, then a system UCX without verbs. :func:`library_info` says which one was loaded,
its version, components and transports.

:class:`UcxEngine` holds a UCX context, its workers (each driven by a native progress thread, and
by callers waiting on their transfers) and registered memory. A target engine hands each peer
engine a ticket (:meth:`UcxEngine.admit`) over its own authenticated channel; the peer connects
with the target's worker addresses and that ticket (:meth:`UcxEngine.connect`) and gets a
:class:`UcxPeer`, whose :meth:`~UcxPeer.submit` posts a whole batch of blocks in one call (GIL
released) and returns a :class:`UcxTransfer`, a completion slot read with ``code()`` and
``wait()`` as :class:`mori.core.tcp.Transfer`. By default blocks travel as active messages
that the target checks against its registrations before touching memory (safe on every UCX
transport); ``rma=True`` uses one-sided puts and gets, for transports whose hardware enforces
remote keys (InfiniBand/RoCE), and only between engines that both have it: a checked target
refuses one-sided access. Between engines of one host, host memory takes the same-host
path instead (``connect(..., same_host=target.same_host_address)``: the initiator copies small
transfers itself with ``process_vm_readv``/``writev``, checked against the registrations the
target publishes in shared memory; the target's thread checks and copies the others). :class:`UcxHeapWindow` is the remote side of
one symmetric heap over such peers (mori.shmem's remote transport, and the device proxy's): it
registers the heap's chunks as it grows and buffers registered for good, finds the local side of
every transfer (the heap, a registered buffer, its staging area, or memory registered for the
call), cuts transfers at the chunks, and checks and runs every put, get, put with signal and
atomic on a remote PE's heap. See docs/core-ucx.md.

The C++ is three folders of ``csrc/``, built from the kit in ``csrc/base/`` as the TCP data plane
is: ``ucx/`` (the engine), ``same_host/`` (its same-host path) and ``proxy/`` (the device proxy).
Every block a target serves is checked once, by the kit's region table.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import config
from ._native.ucx import (
    MAX_EAGER_BYTES,
    UcxEngine,
    UcxHeapWindow,
    UcxLoadError,
    UcxPeer,
    UcxTransfer,
    ucx_components,
    ucx_finished,
    ucx_library,
    ucx_load,
    ucx_stage_gpu,
    ucx_stop_serving_gpu,
)
from .codes import TransferOp

__all__ = [
    "FINISHED",
    "MAX_EAGER_BYTES",
    "READ",
    "WRITE",
    "UcxEngine",
    "UcxHeapWindow",
    "UcxLoadError",
    "UcxPeer",
    "UcxTransfer",
    "auto_workers",
    "candidates",
    "eager_without_verbs",
    "gpudirect_transports",
    "has_verbs",
    "library_info",
    "load",
    "make_engine",
    "net_devices",
    "selected_devices",
    "stage_gpu",
    "stop_staging_gpu",
    "transports",
    "verbs_transports",
]

READ, WRITE = TransferOp.READ, TransferOp.WRITE  # UcxPeer.submit's op: the codes' values
# What UcxPeer.submit and UcxLane.start return for every transfer that finished successfully as it
# started (a same-host direct copy): one object, so a caller tells it by identity, reading no code.
FINISHED: UcxTransfer = ucx_finished()

# Workers that auto_workers gives a machine of at least AUTO_CORES cores.
AUTO_WORKERS, AUTO_CORES = 2, 8


def auto_workers() -> int:
    """Workers of an engine whose user left it to mori (mori-io's ``num_worker_threads=-1``,
    mori.shmem's engine): 2 on a machine of 8 cores or more, else 1. Over TCP one worker moves
    3-4 GB/s whatever the transfer (its thread at each end does the copies); with two, a transfer
    of 512 KiB or more is spread over both, a thread of its own at each end. Build the engine with
    ``round_robin=False`` so that every other transfer starts on the first worker and a small one
    costs what it costs on one."""
    return AUTO_WORKERS if (os.cpu_count() or 1) >= AUTO_CORES else 1


# UCX components whose devices are RDMA NICs driven through verbs (InfiniBand, RoCE).
VERBS_COMPONENTS = ("ib",)
_LIBUCP = "libucp.so.0"
_load_lock = threading.Lock()


def has_verbs(folder: str | Path) -> bool:
    """Whether the UCX in ``folder`` (the one holding ``libucp.so.0``) was built with verbs:
    its module folder ``ucx/`` holds ``libuct_ib``."""
    return any((Path(folder) / "ucx").glob("libuct_ib.so*"))


def _system_folders() -> list[Path]:
    """Folders of the dynamic loader that hold a ``libucp.so.0``, in search order."""
    found: list[Path] = []
    names = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    names += [f"/usr/lib/{multiarch}" if multiarch else "", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/opt/ucx/lib"]
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if ldconfig is not None:
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        names += [str(Path(m).parent) for m in re.findall(r"libucp\.so\.0 .*=> (\S+)", out)]
    for name in names:
        folder = Path(name)
        if name and (folder / _LIBUCP).exists() and folder.resolve() not in [f.resolve() for f in found]:
            found.append(folder)
    return found


def _wheel_folder() -> Path | None:
    """The ``lib`` folder of the ``libucx`` wheel, without importing it (its import loads UCX)."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return folder if (folder / _LIBUCP).exists() or (folder / "libucp.so").exists() else None


def candidates() -> list[tuple[str, str]]:
    """The UCX libraries :func:`load` tries, in order: ``(libucp path, where it came from)``."""
    setting = config.get("MORI_UCX_LIB")
    if setting is not None:
        path = Path(setting)
        if path.is_dir() or ".so" not in path.name:  # a folder (or what would be one)
            path = path / ("libucp.so" if (path / "libucp.so").exists() and not (path / _LIBUCP).exists() else _LIBUCP)
        return [(str(path), "MORI_UCX_LIB")]
    system = _system_folders()
    out = [(str(f / _LIBUCP), "system UCX with verbs") for f in system if has_verbs(f)]
    wheel = _wheel_folder()
    if wheel is not None:
        out.append((str(wheel / (_LIBUCP if (wheel / _LIBUCP).exists() else "libucp.so")), "libucx wheel"))
    out += [(str(f / _LIBUCP), "system UCX without verbs") for f in system if not has_verbs(f)]
    return out


def load() -> dict[str, Any]:
    """Loads UCX once per process (see the module docstring) and returns :func:`library_info`.
    Raises :class:`UcxLoadError` naming every library tried and how to install one."""
    with _load_lock:
        ucx_load(candidates())
    return library_info()


def transports(description: str) -> list[str]:
    """The ``transport/device`` pairs in UCX's description of a context or endpoint."""
    found = re.findall(r"\b([a-z][a-z0-9_]*/[A-Za-z0-9_.:\-]+)", description)
    return sorted({t for t in found if not t.startswith(("md/", "component/"))})


def library_info() -> dict[str, Any]:
    """The loaded UCX: ``path``, ``source`` (why it was chosen), ``version`` (a tuple),
    ``components`` (UCX's components and the devices each found, e.g. ``{"ib": [], "tcp": [...]}``),
    ``verbs`` (whether a verbs component is built in), ``rdma_devices`` (the NICs it found) and
    ``transports`` (what a context opened with UCX's defaults can use, as ``transport/device``)."""
    info = dict(ucx_library())
    comps = {name: list(devices) for name, devices in ucx_components()}
    info["components"] = comps
    info["verbs"] = any(c in comps for c in VERBS_COMPONENTS)
    info["rdma_devices"] = sorted({d for c in VERBS_COMPONENTS for d in comps.get(c, [])})
    probe = UcxEngine("mori-probe", workers=1)
    try:
        info["transports"] = transports(probe.describe())
    finally:
        probe.close()
    return info


def make_engine(name: str = "mori", settings: Mapping[str, str] | None = None, **options: Any) -> UcxEngine:
    """Loads UCX if needed, then builds a :class:`UcxEngine` (``options`` as its constructor's)."""
    load_once()
    return UcxEngine(name, list((settings or {}).items()), **options)


def load_once() -> None:
    """:func:`load` without the report: a no-op once UCX is loaded."""
    try:
        ucx_library()
    except UcxLoadError:
        with _load_lock:
            ucx_load(candidates())


# UCX transports that move CUDA memory zero-copy over a NIC where UCX has CUDA support (GPUDirect
# RDMA through nvidia-peermem or dma-buf): its verbs transports. tcp, sm (posix, sysv, cma) and
# the like reach host memory only; UCX's cuda_copy would pipeline GPU memory through host memory
# on them, slower than mori's staging.
GPUDIRECT_TRANSPORTS = ("rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "rc_x", "dc_x", "ud_x")


def verbs_transports(engine: UcxEngine) -> list[str]:
    """The transports of ``engine``'s context (``transport/device``) that are verbs (an RDMA NIC).
    Empty means UCX moves every byte through the kernel (tcp) or shared memory: there a message of
    a few KiB goes by a rendezvous handshake unless it is sent eager (:attr:`UcxEngine.eager_bytes`)."""
    return [t for t in transports(engine.describe()) if t.split("/")[0] in GPUDIRECT_TRANSPORTS]


def eager_without_verbs(engine: UcxEngine) -> int:
    """Sets ``engine``'s :attr:`UcxEngine.eager_bytes` to :data:`MAX_EAGER_BYTES` where it has no
    verbs transport (:func:`verbs_transports`: tcp between hosts, where UCX would move a host
    message of a few KiB or more by a rendezvous handshake, one round trip more); over verbs UCX's
    choice (RDMA zero-copy) stays. Returns the engine's ``eager_bytes`` after it."""
    if not verbs_transports(engine):
        engine.eager_bytes = MAX_EAGER_BYTES
    return int(engine.eager_bytes)


def gpudirect_transports(engine: UcxEngine) -> list[str]:
    """The transports of ``engine``'s context (``transport/device``) that move GPU memory
    zero-copy: verbs transports, where the engine's UCX has CUDA support. Empty means GPU memory
    must be staged (:func:`stage_gpu`)."""
    return verbs_transports(engine) if engine.cuda_supported else []


def stage_gpu(engine: UcxEngine, stager: Any) -> None:
    """Makes ``engine`` stage every transfer of its GPU memory through ``stager`` (a
    :class:`mori.core.staging.Stager`, shared with the caller's other data planes): UCX then sees
    host memory only. Call it before registering GPU memory; atomics and signal puts on GPU
    memory stay refused (:func:`mori.core.ucx_atomic.serve_gpu` serves those)."""
    ucx_stage_gpu(engine, stager)


def stop_staging_gpu(engine: UcxEngine) -> None:
    """Undoes :func:`stage_gpu` (waiting, at most the engine's timeout, for transfers still using
    the staging); the stager stays open, its owner's to close."""
    ucx_stop_serving_gpu(engine)


def net_devices(selection: tuple[bool, tuple[str, ...]], sysfs: Path = Path("/sys/class/infiniband")) -> str:
    """``MORI_RDMA_DEVICES`` (parsed: ``(exclude, names)``) as UCX's ``NET_DEVICES``: an RDMA device
    name becomes each of its ports (``mlx5_0`` -> ``mlx5_0:1``); other names (``mlx5_0:2``, a
    network interface for the tcp transport) pass as they are; ``^`` excludes."""
    exclude, names = selection
    out: list[str] = []
    for name in names:
        ports = sorted(p.name for p in (sysfs / name / "ports").glob("*")) if ":" not in name else []
        out += [f"{name}:{p}" for p in ports] or [name]
    return ("^" if exclude else "") + ",".join(out)


def selected_devices() -> dict[str, str]:
    """The UCX settings ``MORI_RDMA_DEVICES`` asks for (``{"NET_DEVICES": ...}``), or none when it is
    unset: the NICs MORI's engines use, for every engine mori makes (mori-io's RDMA backend,
    mori.shmem's remote transport)."""
    devices = config.get("MORI_RDMA_DEVICES")
    return {} if devices is None else {"NET_DEVICES": net_devices(devices)}
