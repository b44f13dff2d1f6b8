"""The :class:`Bootstrap`: rank 0's rendezvous, then collectives over bytes between all ranks."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from types import TracebackType

from .. import config, log
from ._errors import BootstrapError
from ._mesh import Mesh
from ._rendezvous import join, serve
from ._uid import UniqueId, take_listener
from ._wire import Deadline, Op

__all__ = ["Bootstrap", "BytesLike"]

BytesLike = bytes | bytearray | memoryview
_log = log.get_logger("core.bootstrap")


def _view(data: object, what: str) -> memoryview:
    """A flat byte view of ``data`` (no copy), or a TypeError naming ``what``."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{what} must be bytes-like (bytes, bytearray, memoryview), got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise TypeError(f"{what} must be a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _frozen(data: object, view: memoryview) -> bytes:
    """``data`` as bytes: itself when it already is (immutable, so safe to share), else a copy."""
    return data if type(data) is bytes else bytes(view)


class Bootstrap:
    """A job's bootstrap network: ``world`` processes, each with its ``rank``, joined by one unique id.

    Rank 0 must run in the process that called :func:`get_unique_id` (it adopts the listening
    socket opened there). The constructor returns once every rank has joined. Collectives must
    be called by every rank in the same order; each waits at most ``timeout`` seconds (default
    ``MORI_BOOTSTRAP_TIMEOUT``) and then raises :class:`BootstrapTimeout` naming the ranks that
    did not arrive. A failed collective leaves the bootstrap closed: peers see this rank leave
    instead of waiting out their own timeouts.
    """

    def __init__(self, rank: int, world: int, uid: UniqueId | BytesLike, timeout: float | None = None) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in 0..{world - 1}, got {rank!r}")
        if timeout is None:
            timeout = float(config.get("MORI_BOOTSTRAP_TIMEOUT"))
        elif isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        parsed = UniqueId.coerce(uid)
        self.rank = rank
        self.world = world
        self.timeout = float(timeout)
        self._seq = 0
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._closed = False
        if rank == 0:
            listener = take_listener(parsed)
            try:
                table, inc = serve(parsed, listener, world, self.timeout)
            except BaseException:
                listener.close()
                raise
            self._mesh = Mesh(rank, world, parsed.nonce, listener, table, {}, inc)
        else:
            table, to_root, listener = join(parsed, rank, world, self.timeout)
            self._mesh = Mesh(rank, world, parsed.nonce, listener, table, {0: to_root}, {})
        _log.debug("bootstrap: rank %d of %d joined via %s:%d", rank, world, parsed.host, parsed.port)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._failure else "open"
        return f"Bootstrap(rank={self.rank}, world={self.world}, {state})"

    def __enter__(self) -> Bootstrap:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Closes every connection of this rank. Safe to call more than once."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._mesh.close()

    def _run(self, op: Op, sends: Mapping[int, memoryview], recv_from: Sequence[int]) -> dict[int, bytes | bytearray]:
        with self._lock:
            if self._closed:
                raise BootstrapError(
                    f"rank {self.rank}: this bootstrap is closed"
                    + (f" after an earlier failure: {self._failure}" if self._failure else "")
                )
            seq = self._seq
            self._seq += 1
            try:
                return self._mesh.exchange(op, seq, sends, recv_from, Deadline(self.timeout))
            except BaseException as exc:
                # The streams may now be out of step; no later collective could be trusted.
                self._failure = f"{type(exc).__name__}: {exc}"
                self._closed = True
                self._mesh.close()
                raise

    def _others(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]

    def allgather(self, data: BytesLike) -> list[bytes]:
        """Every rank's ``data``, indexed by rank. Sizes may differ between ranks."""
        view = _view(data, "allgather data")
        others = self._others()
        got = self._run(Op.ALLGATHER, {r: view for r in others}, others)
        return [_frozen(data, view) if r == self.rank else bytes(got[r]) for r in range(self.world)]

    def broadcast(self, data: BytesLike | None, root: int = 0) -> bytes:
        """``root``'s ``data`` on every rank (other ranks may pass ``None``)."""
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world:
            raise ValueError(f"broadcast root must be an int in 0..{self.world - 1}, got {root!r}")
        if self.rank == root:
            if data is None:
                raise ValueError(f"broadcast root {root} must pass data, got None")
            view = _view(data, "broadcast data")
            self._run(Op.BROADCAST, {r: view for r in self._others()}, ())
            return _frozen(data, view)
        return bytes(self._run(Op.BROADCAST, {}, (root,))[root])

    def alltoall(self, chunks: Sequence[BytesLike]) -> list[bytes]:
        """Sends ``chunks[j]`` to rank j; returns what each rank sent here, indexed by sender."""
        if isinstance(chunks, (bytes, bytearray, memoryview, str)) or not isinstance(chunks, Sequence):
            raise TypeError(f"alltoall takes a sequence of {self.world} bytes-like chunks, got {type(chunks).__name__}")
        if len(chunks) != self.world:
            raise ValueError(f"alltoall needs one chunk per rank: {self.world}, got {len(chunks)}")
        views = [_view(c, f"alltoall chunk {j}") for j, c in enumerate(chunks)]
        others = self._others()
        got = self._run(Op.ALLTOALL, {r: views[r] for r in others}, others)
        return [_frozen(chunks[r], views[r]) if r == self.rank else bytes(got[r]) for r in range(self.world)]

    def barrier(self) -> None:
        """Returns only after every rank has entered the barrier."""
        others = self._others()
        empty = memoryview(b"")
        self._run(Op.BARRIER, {r: empty for r in others}, others)
