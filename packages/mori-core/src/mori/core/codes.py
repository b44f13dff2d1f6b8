"""The numeric codes every mori layer shares, defined once.

* :class:`Cmp`: the comparison of wait-until and test, ``EQ=0 NE=1 GT=2 GE=3 LT=4 LE=5``. The host
  atomics, both shmem heaps, the device headers (``kCmpEq`` ... in ``sync.cuh``) and the Triton
  externs take these values. They are not NVSHMEM's numbering (there ``EQ`` is 0 but the order
  of the others differs): pass the names, not literals.
* :class:`SignalOp`: the signal update of put-with-signal, MORI's ``SIGNAL_SET=9`` and
  ``SIGNAL_ADD=10`` (its ``atomicType`` values), so kernels written for MORI pass the same
  constants. The device headers (``kSignalSet``/``kSignalAdd`` in ``rma.cuh``) use the same values;
  a test compiles the headers against this module.
* :class:`TransferCode`: the outcome of a transfer on a transport built from mori-core (every
  native plane reports these values). The values are MORI-IO's ``StatusCode`` numbers (``SUCCESS=0 INIT=1 IN_PROGRESS=2``,
  errors from 11), so a code compared with a literal means the same as in MORI; transports name
  them their own way (mori.io's ``StatusCode`` is MORI's names).
* :class:`TransferOp`: the direction of a one-sided transfer, ``READ=1 WRITE=2``, the values the
  native planes carry on their wires; mori.io's backends take them as they are.
* :class:`AtomicOp`: the remote atomics of the UCX engine (``FETCH_ADD=1`` ... ``FETCH_XOR=7``), the
  codes its messages and the device proxy's ring carry.

The native planes define these codes once in C++ (``csrc/base/``: ``transfer.hpp``, ``ops.hpp``,
the device constants checked against them at compile time) and export them as
``mori.core._native.codes``; a test compares every enum here with that table.
"""

from __future__ import annotations

import enum

__all__ = ["AtomicOp", "Cmp", "SignalOp", "TransferCode", "TransferOp"]


class Cmp(enum.IntEnum):
    """Comparison code of wait-until/test: ``seen <op> value``."""

    EQ = 0
    NE = 1
    GT = 2
    GE = 3
    LT = 4
    LE = 5

    @classmethod
    def parse(cls, cmp: int | str) -> Cmp:
        """The comparison named by a code (``Cmp.GE``, ``3``) or a name (``"ge"``, any case).

        Raises :class:`ValueError` naming the accepted spellings for anything else (bools included).
        """
        if isinstance(cmp, str) and cmp.upper() in cls.__members__:
            return cls[cmp.upper()]
        if isinstance(cmp, int) and not isinstance(cmp, bool) and cmp in cls._value2member_map_:
            return cls(cmp)
        names = ", ".join(m.name.lower() for m in cls)
        raise ValueError(f"comparison {cmp!r} is not one of {names} (or their codes 0..{len(cls) - 1})")

    def holds(self, seen: int, value: int) -> bool:
        """Whether ``seen`` compares true against ``value``."""
        if self is Cmp.EQ:
            return seen == value
        if self is Cmp.NE:
            return seen != value
        if self is Cmp.GT:
            return seen > value
        if self is Cmp.GE:
            return seen >= value
        if self is Cmp.LT:
            return seen < value
        return seen <= value


class SignalOp(enum.IntEnum):
    """How put-with-signal updates the 64-bit signal word (MORI's ``atomicType`` values)."""

    SET = 9
    ADD = 10

    @classmethod
    def parse(cls, op: int) -> SignalOp:
        """The operation for a code; :class:`ValueError` naming both codes for anything else."""
        if isinstance(op, int) and not isinstance(op, bool) and op in cls._value2member_map_:
            return cls(op)
        raise ValueError(f"signal op {op!r} is not SIGNAL_SET ({cls.SET.value}) or SIGNAL_ADD ({cls.ADD.value})")


class TransferCode(enum.IntEnum):
    """Outcome of a transfer: success, not started, in progress, or why it failed (errors are
    the values above 10, as in MORI-IO)."""

    SUCCESS = 0  #: every byte moved
    NOT_STARTED = 1  #: not submitted yet
    IN_PROGRESS = 2  #: running
    ERR_INVALID_ARGS = 11  #: an offset or size outside a region, or a bad argument
    ERR_NOT_FOUND = 12  #: the memory (or the peer) is not registered
    ERR_TRANSPORT = 13  #: the transport's own library reported an error
    ERR_BAD_STATE = 14  #: peer unreachable or lost, timeout, credentials refused
    ERR_DEVICE = 15  #: a GPU operation failed


class TransferOp(enum.IntEnum):
    """Direction of a one-sided transfer, seen from the initiator."""

    READ = 1  #: remote -> local
    WRITE = 2  #: local -> remote


class AtomicOp(enum.IntEnum):
    """A remote atomic on a 32- or 64-bit word (each returns the word's old value)."""

    FETCH_ADD = 1
    COMPARE_SWAP = 2  #: writes ``value`` where the word holds ``compare``
    SWAP = 3
    STORE = 4
    FETCH_AND = 5
    FETCH_OR = 6
    FETCH_XOR = 7
