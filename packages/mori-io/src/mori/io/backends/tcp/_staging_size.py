"""Sizes of the TCP backend's GPU staging buffers (no numpy here: the TCP backend checks them when
it is created, also on hosts that move only host memory)."""

from __future__ import annotations

__all__ = ["CHUNK_BYTES", "MIN_CHUNK", "chunk_bytes_for"]

CHUNK_BYTES = 4 << 20  # one staging buffer; big enough to amortise a control round trip per chunk
MIN_CHUNK = 64 << 10


def chunk_bytes_for(pool_bytes: int) -> int:
    """The buffer size for a pool of ``pool_bytes``: 4 MiB, less when the pool is too small to
    hold two buffers (two let a transfer copy one chunk while the other is on the wire)."""
    size = min(CHUNK_BYTES, pool_bytes // 2)
    if size < MIN_CHUNK:
        raise ValueError(f"MORI_IO_TCP_STAGING_SIZE={pool_bytes} is too small: GPU staging needs at least "
                         f"{2 * MIN_CHUNK} bytes (two buffers of {MIN_CHUNK})")
    return size
