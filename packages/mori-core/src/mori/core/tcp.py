"""The native TCP data plane (C++ ``csrc/tcp/``): a :class:`Target` serves registered host memory
to authenticated peers; a :class:`Peer` holds several connections to one target and moves a
:class:`mori.core.batch.Batch` with one call, :meth:`Peer.submit` (rows cut at a stripe size
and dealt over the connections, the GIL released); a :class:`Transfer` is its completion, whose
code is a :class:`mori.core.codes.TransferCode` value; :meth:`Peer.submit` takes
:class:`mori.core.codes.TransferOp`'s values.

Every limit on what peers may consume is a :class:`Target` argument; timeout messages name the
caller's setting for the I/O timeout (``timeout_setting``).
"""

from ._native.tcp import Peer, Target, Transfer

__all__ = ["Peer", "Target", "Transfer"]
