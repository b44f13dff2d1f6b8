"""Remote atomics on mori-core's UCX engine (:mod:`mori.core.ucx`): what symmetric-memory callers
(mori.shmem's remote transport) need beyond bulk puts and gets.

:func:`atomic` applies fetch-add, compare-swap, swap or store to a 32- or 64-bit word of a peer
engine's registered host memory and returns the word's old value. It travels on the engine's
checked path: the target checks the word against its live registrations (inside the region,
aligned to its width, host memory) before touching it, applies the operation with a sequentially
consistent atomic, and answers with the old value or why it refused. The calling thread waits
(GIL released) for the answer, progressing the engine's worker itself first.
"""

from __future__ import annotations

from typing import SupportsFloat

from ._native.ucx import UcxEngine, UcxPeer, ucx_atomic

__all__ = ["OPS", "atomic"]

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
