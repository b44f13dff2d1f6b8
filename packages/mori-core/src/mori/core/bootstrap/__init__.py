"""The bootstrap network: a 128-byte unique id, a TCP rendezvous, and collectives over bytes.

::

    from mori.core.bootstrap import Bootstrap, get_unique_id
    uid = get_unique_id()                      # in rank 0's process; send the bytes to the others
    with Bootstrap(rank, world, uid) as bs:    # every rank; returns once all have joined
        blobs = bs.allgather(b"my address")    # list indexed by rank
        bs.barrier()

:func:`init_from_torch` and :func:`init_from_mpi` hand out the id through an existing
``torch.distributed`` process group or MPI communicator. :func:`take_listener` hands rank 0's
listening socket to a launcher whose rank 0 is another process.
"""

from ._bootstrap import Bootstrap
from ._errors import BootstrapError, BootstrapTimeout
from ._launchers import init_from_mpi, init_from_torch
from ._uid import UNIQUE_ID_BYTES, UniqueId, get_unique_id, take_listener

__all__ = [
    "UNIQUE_ID_BYTES",
    "Bootstrap",
    "BootstrapError",
    "BootstrapTimeout",
    "UniqueId",
    "get_unique_id",
    "init_from_mpi",
    "init_from_torch",
    "take_listener",
]
