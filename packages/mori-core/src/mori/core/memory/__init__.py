"""Memory that several processes share.

* :func:`buffer_span` — the address and size of a Python object's memory (buffer protocol);
* :class:`LiveRanges` — the live blocks of a symmetric heap by offset (an allocator's, which
  :class:`mori.core.ucx.UcxHeapWindow` checks a put against in the call that moves it);
* :class:`HostSegment` — host shared memory (``memfd``) that peer processes on this host map;
* :func:`send_fds` / :func:`recv_fds` — file descriptors over Unix sockets, with timeouts;
* :class:`FdExchange` — an all-gather of descriptors among the local ranks of a bootstrap;
* :class:`PinnedPool` — page-locked host memory for GPU copies, in reused blocks
  (:func:`pinned_alloc` / :func:`pinned_free` underneath; needs the ``mori-core[cuda]`` extra when used);
* :mod:`~mori.core.memory.cuda_vmm` — GPU memory through CUDA VMM, exported and imported as
  POSIX fds (needs the ``mori-core[cuda]`` extra when used, not when imported).
"""

from . import cuda_vmm
from ._buffer import LiveRanges, buffer_span
from ._fdpass import FdExchange, recv_fds, send_fds
from ._host import HostSegment
from ._pinned import PinnedPool, pinned_alloc, pinned_free

__all__ = [
    "FdExchange",
    "HostSegment",
    "LiveRanges",
    "buffer_span",
    "PinnedPool",
    "cuda_vmm",
    "pinned_alloc",
    "pinned_free",
    "recv_fds",
    "send_fds",
]
