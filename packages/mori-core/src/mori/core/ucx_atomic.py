"""Remote atomics and signal puts on mori-core's UCX engine (:mod:`mori.core.ucx`): what
symmetric-memory callers (mori.shmem's remote transport) need beyond bulk puts and gets.

:func:`atomic` applies fetch-add, compare-swap, swap or store to a 32- or 64-bit word of a peer
engine's registered host memory and returns the word's old value. It travels on the engine's
checked path: the target checks the word against its live registrations (inside the region,
aligned to its width, host memory) before touching it, applies the operation with a sequentially
consistent atomic, and answers with the old value or why it refused. The calling thread waits
(GIL released) for the answer, progressing the engine's worker itself first.

:func:`signal_put` writes up to :data:`MAX_SIGNAL_PUT_BYTES` and then sets or adds to a 64-bit
signal word, in one message: the target checks both places, writes the bytes, then applies the
signal's atomic, so whoever sees the signal sees the data.
"""

from __future__ import annotations

from typing import SupportsFloat

from ._native.ucx import UCX_MAX_SIGNAL_PUT_BYTES, UcxEngine, UcxPeer, ucx_atomic, ucx_signal_put

__all__ = ["MAX_SIGNAL_PUT_BYTES", "OPS", "atomic", "signal_put"]

#: Most bytes one :func:`signal_put` carries (they travel in its message).
MAX_SIGNAL_PUT_BYTES = UCX_MAX_SIGNAL_PUT_BYTES

#: The operations :func:`atomic` applies, by name (the codes the engine's messages carry).
OPS = {"fetch_add": 1, "compare_swap": 2, "swap": 3, "store": 4}


def atomic(engine: UcxEngine, peer: UcxPeer, op: str, mem_id: int, offset: int, value: int, compare: int = 0,
           width: int = 64, timeout: SupportsFloat = 30.0) -> int:
    """Applies ``op`` (a key of :data:`OPS`; ``compare_swap`` writes ``value`` where the word holds
    ``compare``) to the ``width``-bit word at ``offset`` of ``peer``'s memory ``mem_id``; returns
    its old value (unsigned).

    ``peer`` must come from ``engine.connect``. Raises ``ValueError`` for a bad argument or when
    the target refused (the message says why), ``RuntimeError`` when the peer failed or did not
    answer within ``timeout`` seconds.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return ucx_atomic(engine, peer, OPS[op], mem_id, offset, value, compare, width, timeout)


def signal_put(engine: UcxEngine, peer: UcxPeer, mem_id: int, offset: int, src: int, size: int, sig_mem_id: int,
               sig_offset: int, op: str, value: int, timeout: SupportsFloat = 30.0) -> None:
    """Writes ``size`` bytes from host address ``src`` (kept alive by the caller during the call) at
    ``offset`` of ``peer``'s memory ``mem_id``, then applies ``op`` (``store`` or ``fetch_add``)
    with ``value`` to the 64-bit word at ``sig_offset`` of its memory ``sig_mem_id``, in one
    message; nothing is written when the target refuses either place. Errors as :func:`atomic`'s;
    ``size`` is at most :data:`MAX_SIGNAL_PUT_BYTES`.
    """
    if op not in ("store", "fetch_add"):
        raise ValueError(f"a signal put's op is store or fetch_add, got {op!r}")
    ucx_signal_put(engine, peer, mem_id, offset, src, size, sig_mem_id, sig_offset, OPS[op], value, timeout)
