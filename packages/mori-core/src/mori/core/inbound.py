"""Completion records of inbound transfers (C++ ``csrc/base/inbound.hpp``): :class:`InboundRecords`
keeps the final code (a :class:`mori.core.codes.TransferCode` value) and message of each transfer
another engine ran into this one, by (engine key, uid), until its owner pops it.

One table serves every channel a record arrives on: hand it to the native data planes
(:class:`mori.core.tcp.Target`'s and :class:`mori.core.ucx.UcxEngine`'s ``inbound`` argument),
which write into it without Python, and write into it from Python (:meth:`InboundRecords.record`)
for records that arrive another way. It is bounded in count and age (the oldest go first).
"""

from ._native.inbound import InboundRecords

__all__ = ["InboundRecords"]
