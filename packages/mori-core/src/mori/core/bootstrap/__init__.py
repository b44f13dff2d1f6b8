"""The bootstrap network: a 128-byte unique id, a TCP rendezvous, and collectives over bytes.

::

    from mori.core.bootstrap import Bootstrap, get_unique_id
    uid = get_unique_id()                      # in any process (rank 0's or a launcher's); send it to the ranks
    with Bootstrap(rank, world, uid) as bs:    # every rank; returns once all have joined
        blobs = bs.allgather(b"my address")    # list indexed by rank
        bs.barrier()

:func:`init_from_torch` and :func:`init_from_mpi` hand out the id through an existing
``torch.distributed`` process group or MPI communicator. :func:`take_listener` gives rank 0 its
listening socket on the id's port, in the id maker's process or in any other.
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
