"""The compiled pieces of mori-core (``csrc/``, one pybind11 module), for mori's other packages.

Typed by ``_native.pyi``.

* :func:`batch_bounds`, :func:`gather_rows`, :func:`int64_array`: one-pass host work on the
  ``int64`` offset/size arrays of a batch (bounds, the gather kernel's rows, list conversion);
* :func:`memcpy_batch`: one ``cuMemcpyBatchAsync`` for many copies;
* :class:`GatherLauncher`: the gather kernel's table upload, launch and event in one call;
* :class:`TcpTarget`, :class:`TcpPeer`, :class:`TcpTransfer`: the TCP data plane.
"""

from ._native import (
    ABI_VERSION,
    GatherLauncher,
    TcpPeer,
    TcpTarget,
    TcpTransfer,
    batch_bounds,
    gather_rows,
    int64_array,
    memcpy_batch,
)

__all__ = ["ABI_VERSION", "GatherLauncher", "TcpPeer", "TcpTarget", "TcpTransfer", "batch_bounds", "gather_rows",
           "int64_array", "memcpy_batch"]
