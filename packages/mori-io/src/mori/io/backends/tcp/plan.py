"""The TCP backend's plan over a batch: GPU memory travels through pinned host buffers of a fixed
size (a *chunk*), and :func:`plan_chunks` cuts a transfer into chunks with mori-core's planner
(:meth:`mori.core.batch.Batch.cut_chunks`, no Python per block). Host memory needs no plan: the
native data plane takes the batch itself (cut at the stripe size and dealt over the connections in
C++). No CUDA here, so it is tested on any machine."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mori.core.batch import Batch

__all__ = ["MAX_PIECES", "Chunk", "plan_chunks"]

# Pieces per chunk: bounds the control frame that carries their offsets (16 bytes a piece).
MAX_PIECES = 16384


@dataclass(frozen=True)
class Chunk:
    """Pieces that fit one staging buffer: piece i moves ``sizes[i]`` bytes between local address
    ``local[i]`` and remote offset ``remote[i]`` and sits at ``packed[i]`` in the buffer."""

    local: np.ndarray
    remote: np.ndarray
    sizes: np.ndarray
    packed: np.ndarray
    nbytes: int


def plan_chunks(batch: Batch, chunk_bytes: int, max_pieces: int = MAX_PIECES) -> list[Chunk]:
    """Cuts a transfer's rows (local address, remote offset, bytes) into chunks of at most
    ``chunk_bytes`` bytes and ``max_pieces`` pieces (mori-core's planner,
    :meth:`mori.core.batch.Batch.cut_chunks`).

    The rows are laid end to end and cut at every multiple of ``chunk_bytes`` (a row that crosses
    a boundary becomes two pieces). Buffer positions restart at 0 in every chunk.
    """
    chunks = []
    for c in batch.cut_chunks(chunk_bytes, max_pieces):
        local, remote, sizes = np.asarray(c).T  # the pieces' columns (uint64 views of the chunk's rows)
        chunks.append(Chunk(local, remote, sizes, np.cumsum(sizes) - sizes, c.total_bytes))
    return chunks
