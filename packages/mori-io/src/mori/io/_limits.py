"""What an engine lets its peers consume, read once from the ``MORI_IO_*`` settings.

One :class:`Limits` per engine bounds both of its listening planes (the control server here,
the TCP backend's native data plane) and its completion records; ``docs/io.md`` ("Limits and
hardening") lists each with its default.
"""

from __future__ import annotations

from dataclasses import dataclass

from mori.core import config as mori_config

__all__ = ["Limits", "io_timeout"]


def io_timeout() -> float:
    """Seconds before an unanswered transfer or control request fails (``MORI_IO_TIMEOUT``)."""
    return float(mori_config.get("MORI_IO_TIMEOUT"))


@dataclass(frozen=True)
class Limits:
    """Resource bounds of one engine (see ``docs/io.md``, "Limits and hardening")."""

    io_timeout: float  # MORI_IO_TIMEOUT: also the time a peer has to send one frame
    max_connections: int  # per plane
    max_handshakes: int  # per plane; the oldest is dropped for a new one
    hello_timeout: float
    idle_timeout: float  # authenticated control connections
    control_buffer: int  # bytes of control frames being received, over all connections
    max_inbound: int  # completion records kept (the engine's one table, every channel together)
    inbound_ttl: float

    @classmethod
    def from_config(cls) -> Limits:
        """The limits the environment sets now (defaults where unset)."""
        get = mori_config.get
        return cls(
            float(get("MORI_IO_TIMEOUT")),
            int(get("MORI_IO_MAX_CONNECTIONS")),
            int(get("MORI_IO_MAX_HANDSHAKES")),
            float(get("MORI_IO_HELLO_TIMEOUT")),
            float(get("MORI_IO_IDLE_TIMEOUT")),
            int(get("MORI_IO_CONTROL_BUFFER")),
            int(get("MORI_IO_MAX_INBOUND_RECORDS")),
            float(get("MORI_IO_INBOUND_RECORD_TTL")),
        )
