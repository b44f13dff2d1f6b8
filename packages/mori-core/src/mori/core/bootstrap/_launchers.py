"""Bootstraps whose unique id travels through a launcher the job already has: torch.distributed or MPI."""

from __future__ import annotations

from typing import Any

from ._bootstrap import Bootstrap
from ._uid import get_unique_id

__all__ = ["init_from_torch", "init_from_mpi"]


def init_from_torch(group: Any = None, timeout: float | None = None) -> Bootstrap:
    """A :class:`Bootstrap` over the ranks of a ``torch.distributed`` process group (default: the world).

    The group's rank 0 makes the unique id and broadcasts it with ``broadcast_object_list``
    (CPU for gloo, the current device for NCCL); then every rank joins the socket bootstrap with
    its rank in the group.
    """
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError("init_from_torch needs PyTorch: pip install 'mori-core[torch]'") from exc
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_from_torch needs torch.distributed.init_process_group() to have run first")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise RuntimeError("init_from_torch: this process is not a member of the given group")
    box = [get_unique_id() if rank == 0 else None]
    # src is a global rank; get_global_rank works on every torch 2.x (group_src only on newer ones).
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return Bootstrap(rank, world, box[0], timeout)  # type: ignore[arg-type]


def _communicator(mpi: Any, comm: Any) -> Any:
    """``comm`` as an mpi4py communicator: None is ``COMM_WORLD``; an int is a C ``MPI_Comm``
    handle, the form MORI's C API and docs take (mpi4py gives it as ``MPI._handleof(comm)``)."""
    if comm is None:
        return mpi.COMM_WORLD
    if isinstance(comm, mpi.Comm):
        return comm
    if isinstance(comm, int) and not isinstance(comm, bool):
        if comm == mpi._handleof(mpi.COMM_NULL):
            raise ValueError("init_from_mpi: the MPI_Comm handle is MPI_COMM_NULL")
        if not hasattr(mpi.Comm, "fromhandle"):
            raise ImportError(
                "init_from_mpi: an MPI_Comm handle needs mpi4py >= 4.0 (Comm.fromhandle); pass the "
                "mpi4py communicator itself instead"
            )
        return mpi.Comm.fromhandle(comm)
    raise TypeError(
        f"init_from_mpi: comm must be an mpi4py communicator, an MPI_Comm handle (int, as "
        f"MPI._handleof(comm) gives it) or None for MPI.COMM_WORLD, got {type(comm).__name__}"
    )


def init_from_mpi(comm: Any = None, timeout: float | None = None) -> Bootstrap:
    """A :class:`Bootstrap` over the ranks of an MPI communicator: an mpi4py ``Comm``, its C
    ``MPI_Comm`` handle as an int (``MPI._handleof(comm)``: what MORI's C API takes), or None for
    ``MPI.COMM_WORLD``."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("init_from_mpi needs mpi4py and an MPI library: pip install 'mori-core[mpi]'") from exc
    comm = _communicator(MPI, comm)
    rank, world = comm.Get_rank(), comm.Get_size()
    uid = comm.bcast(get_unique_id() if rank == 0 else None, root=0)
    return Bootstrap(rank, world, uid, timeout)
