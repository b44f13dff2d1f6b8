"""The compiled pieces of mori-core (``csrc/``, one pybind11 module), for mori's other packages.

Typed by ``_native.pyi``.

* :func:`batch_bounds`, :func:`gather_rows`, :func:`int64_array`: one-pass host work on the
  ``int64`` offset/size arrays of a batch (bounds, a gather table's rows, list conversion);
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
    gather_rows,
    int64_array,
    memcpy_batch,
)

__all__ = ["ABI_VERSION", "TRANSFER_CODES", "GatherLauncher", "TcpPeer", "TcpTarget", "TcpTransfer", "batch_bounds", "gather_rows",
           "int64_array", "memcpy_batch"]
