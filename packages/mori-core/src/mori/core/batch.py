"""A batch of copies as one value, and the planner that cuts it (C++ ``csrc/batch/batch.hpp`` and
``csrc/batch/plan.hpp``; the TCP data plane uses the same C++ in-process).

:class:`Batch` is built once from the caller's columns, ``Batch(src_offsets, dst_offsets, sizes,
src_base=0, dst_base=0)``: each column a sequence of ints or any 1-d integer buffer (a numpy
array, ``array.array``, a ``memoryview``; numpy is not needed). Its rows are ``(src_base +
src_offsets[i], dst_base + dst_offsets[i], sizes[i])`` as uint64, with empty blocks dropped and a
block that continues the previous row on both sides merged into it. Every column is checked first
(``TypeError`` for what is not integers; ``ValueError`` naming the column and index for a negative
value or one past 64 bits, for a block that runs past 2^64, or for columns of different lengths).
``Batch.one(src, dst, bytes)`` is the batch of one block, the cheapest to build.

A batch is immutable. ``len(batch)`` rows, ``batch[i]`` is the tuple ``(src, dst, bytes)``,
``batch[a:b]`` a Batch (a view of the same rows); ``largest`` and ``smallest`` (row sizes),
``src_end`` and ``dst_end`` (the largest ``src + bytes`` and ``dst + bytes``) are kept from the
build, ``total_bytes`` is counted when asked; the rows read in place through the buffer protocol
as an ``(n, 3)`` uint64 array (``numpy.asarray(batch)``, ``memoryview(batch)``).
``Batch(..., out=table)`` writes the rows into a caller's writable ``(>= n, 3)`` uint64 array (a
pinned table a kernel reads, say) and reads them there.

Lists and tuples of ints are read straight into the rows; integer buffers of 64-bit items are read
in place (strided views included), other widths converted first.

The planner's verbs are its methods and return Batch values: :meth:`Batch.rebased` (the same
copies moved by a base on each side, or run the other way: a kernel's table from a transfer's
rows, one pass), :meth:`Batch.stripe` (rows cut into pieces of at most a size),
:meth:`Batch.count_pieces`, :meth:`Batch.deal` (contiguous runs of about equal bytes, one per
stream or connection) and :meth:`Batch.cut_chunks` (staging-buffer chunks; a chunk's pieces are
packed from offset 0 of a buffer in order).
"""

from ._native.batch import Batch

__all__ = ["Batch"]
