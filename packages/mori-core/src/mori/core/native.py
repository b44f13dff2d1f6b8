"""The compiled pieces of mori-core (``csrc/``, one pybind11 module), for mori's other packages.

Typed by ``_native.pyi``.

* :func:`batch_bounds`, :func:`int64_array`: one-pass host work on the ``int64`` offset/size
  arrays of a batch (bounds, list conversion);
* the batch planner, one for every transport (the TCP data plane uses the same C++ functions):
  :func:`gather_rows` (a batch as rows (src, dst, bytes), written into the caller's table, empty
  blocks dropped, runs contiguous on both sides merged), :func:`stripe_rows` and
  :func:`count_pieces` (rows cut into pieces of at most a given size), :func:`deal_rows` (a row
  sequence split into runs of about equal bytes, one per stream or connection),
  :func:`cut_chunks` (a batch cut into staging-buffer chunks with packed offsets). Each checks its
  arguments first: a ``ValueError`` names the one that is wrong;
* :func:`memcpy_batch`: one ``cuMemcpyBatchAsync`` for many copies;
* :class:`GatherLauncher`: a gather table's upload, the launch of the caller's gather kernel and an
  event, in one call;
* :class:`TcpTarget`, :class:`TcpPeer`, :class:`TcpTransfer`: the TCP data plane; its transfers end
  with a :class:`mori.core.codes.TransferCode` value (``TRANSFER_CODES``: the data plane's own
  table of them, which a test compares with that enum).
"""

from ._native import (
    ABI_VERSION,
    TRANSFER_CODES,
    GatherLauncher,
    TcpPeer,
    TcpTarget,
    TcpTransfer,
    batch_bounds,
    count_pieces,
    cut_chunks,
    deal_rows,
    gather_rows,
    int64_array,
    memcpy_batch,
    stripe_rows,
)

__all__ = ["ABI_VERSION", "TRANSFER_CODES", "GatherLauncher", "TcpPeer", "TcpTarget", "TcpTransfer", "batch_bounds", "count_pieces",
           "cut_chunks", "deal_rows", "gather_rows", "int64_array", "memcpy_batch", "stripe_rows"]
