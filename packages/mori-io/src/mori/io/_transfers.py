"""An engine's transfers: each one checked against both descriptors (so obvious errors fail
fast without touching the network), its blocks built into one :class:`mori.core.batch.Batch`,
routed to a backend, joined to its peer's completion order and started; the status it returns
reads the completion the backend's ``submit`` returned."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

from mori.core.batch import Batch
from mori.core.log import get_logger

from ._order import PeerOrder
from ._registry import InFlight, MemoryRegistry, RemoteEngines
from ._router import Router
from .backends import Backend, Outcome, TransferOp, TransferRequest
from .types import MemoryDesc, StatusCode, TransferStatus, _succeeded

__all__ = ["Transfers"]

_log = get_logger("io")

_IN_PROGRESS = StatusCode.IN_PROGRESS
_IN_PROGRESS_INT = int(_IN_PROGRESS)  # codes up to it (SUCCESS, INIT) are not failures
_SUCCESS = StatusCode.SUCCESS
_U64_END = 1 << 64  # uids, addresses and offsets travel as unsigned 64-bit integers
_MAX_LANES = 1024  # pairs of descriptors whose Lane a Transfers keeps (see __init__)
# A kept lane, read by index in single(): local and remote descriptors, the change counts when it
# was made, its backend, then what single() reads per call: the Lane's start, finished and
# drained, the local region's address and size, the remote one's size and engine key.
_KeptLane = tuple[MemoryDesc, MemoryDesc, int, Backend, Callable[..., Any], Any, bool, int, int, int, str]
# Batch's own names of its columns, as the engine's callers know them.
_COLUMNS = (("src_offsets", "local offsets"), ("dst_offsets", "remote offsets"))


def _int(name: str, value: Any) -> int:
    """``value`` as an int; bools and non-integers raise ``TypeError`` naming ``name``."""
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _named(err: Exception) -> str:
    """A message of :class:`Batch` in the words of the engine's caller (local/remote offsets)."""
    text = str(err).removeprefix("Batch: ")
    for column, name in _COLUMNS:
        text = text.replace(column, name)
    return text


def _batch(base: int, l_offs: Any, r_offs: Any, sizes: Any) -> tuple[Batch, int, int] | str:
    """The rows (``base`` + local offset, remote offset, bytes) of a transfer, built once, with
    where they end in the local region (bytes past ``base``) and in the remote one (0, 0 when no
    bytes move), or why its values cannot be (a negative value, one past 64 bits). ``TypeError``
    for what is not integers, ``ValueError`` for columns of different lengths. One block of plain
    ints (read, write, most small batches) takes the short way."""
    if (
        type(sizes) is list
        and type(l_offs) is list
        and type(r_offs) is list
        and len(sizes) == 1
        and len(l_offs) == len(r_offs) == 1
    ):
        lo, ro, n = l_offs[0], r_offs[0], sizes[0]
        if (
            type(lo) is int
            and type(ro) is int
            and type(n) is int
            and lo >= 0
            and ro >= 0
            and n >= 0
            and base + lo + n <= _U64_END
            and ro + n <= _U64_END
        ):
            return Batch.one(base + lo, ro, n), lo + n if n else 0, ro + n if n else 0
    try:
        batch = Batch(l_offs, r_offs, sizes, base)
    except TypeError as err:
        raise TypeError(_named(err)) from None
    except ValueError as err:  # the columns were read, so they have lengths
        if not len(l_offs) == len(r_offs) == len(sizes):
            raise ValueError(
                f"batch lengths differ: {len(l_offs)} local offsets, {len(r_offs)} remote offsets, {len(sizes)} sizes"
            ) from None
        return _named(err)
    return (batch, batch.src_end - base, batch.dst_end) if len(batch) else (batch, 0, 0)


class Transfers:
    """The transfers of the engine ``key``, over its registries, backends and completion order."""

    def __init__(
        self,
        key: str,
        memory: MemoryRegistry,
        remotes: RemoteEngines,
        backends: Router,
        order: PeerOrder,
        inflight: InFlight,
    ) -> None:
        self._key = key
        self._memory = memory
        self._remotes = remotes
        self._backends = backends
        self._order = order
        self._inflight = inflight
        # The last pair of descriptors that passed reject(), with the registries' and backends'
        # change counts then and the backend preferred for it: a transfer on the same two
        # descriptor objects, nothing registered or removed since, skips those checks and the
        # routing (its own rows are checked every time).
        self._route: tuple[MemoryDesc, MemoryDesc, int, Backend | None] | None = None
        # Per pair of descriptor objects (by identity; the entry holds both, so neither id is
        # reused while it is kept), the preferred backend's Lane with the change counts when it
        # was made and the backend: made by a transfer that took the full way, then a single
        # block on the same pair, nothing changed since, starts through it (single). At most
        # _MAX_LANES pairs; all are dropped when one more comes (a KV cache has one pair a layer
        # and peer, far fewer). The layout is _KeptLane's.
        self._lanes: dict[tuple[int, int], _KeptLane] = {}

    def reject(self, local: MemoryDesc, remote: MemoryDesc) -> tuple[StatusCode, str] | None:
        """Why a transfer between ``local`` and ``remote`` cannot start (code, message), or None."""
        live = self._memory.get(local.id) if local.engine_key == self._key else None
        if live is None:
            return StatusCode.ERR_NOT_FOUND, f"local memory {local.id} is not registered with engine {self._key!r}"
        if live is not local and live != local:
            return StatusCode.ERR_INVALID_ARGS, (
                f"local memory descriptor {local.id} does not match its registration "
                f"with engine {self._key!r} (address, size or location differ: "
                "stale or altered)"
            )
        if self._remotes.get(remote.engine_key) is None:
            return StatusCode.ERR_NOT_FOUND, f"remote engine {remote.engine_key!r} is not registered"
        # Checked before a transfer is queued anywhere: a value a backend cannot encode must fail
        # the transfer, not the call that queued it.
        problem = remote._wire_problem()
        return None if problem is None else (StatusCode.ERR_INVALID_ARGS, f"remote memory descriptor: {problem}")

    def single(
        self,
        op: TransferOp,
        local: Any,
        l_offs: Any,
        remote: Any,
        r_offs: Any,
        sizes: Any,
        uid: Any,
        backend: Backend | None = None,
    ) -> TransferStatus | None:
        """A transfer of one block (lists of one: ``read``, ``write``, a batch of one) started
        through the lane a transfer on the same pair left, when nothing changed since, its
        backend is ``backend`` (when given, as a session's) and its connection has not failed;
        None otherwise, with nothing started (then :meth:`submit` or :meth:`batch`)."""
        key = (id(local), id(remote))
        lane = self._lanes.get(key)  # the pair's own: it holds both objects, so neither id was reused
        if (
            lane is None
            or type(sizes) is not list
            or type(l_offs) is not list
            or type(r_offs) is not list
            or len(sizes) != 1
            or len(l_offs) != 1
            or len(r_offs) != 1
            or (backend is not None and backend is not lane[3])
        ):
            return None
        l_off, r_off, size = l_offs[0], r_offs[0], sizes[0]
        if not (
            type(l_off) is int
            and type(r_off) is int
            and type(size) is int
            and type(uid) is int
            and size > 0
            and 0 <= l_off <= lane[8] - size
            and 0 <= r_off <= lane[9] - size
            and 0 <= uid < _U64_END
            and lane[2] == self._memory.changes + self._remotes.changes + self._backends.changes
        ):
            return None
        # Everything submit() checks holds (both descriptors as they were, the block inside both,
        # a valid uid): what follows is its last part, unless the lane's connection has failed.
        if lane[6]:  # drained: its backend refuses a region deregistered meanwhile itself (see Lane)
            status = None
        else:
            status = TransferStatus(_IN_PROGRESS)
            self._inflight.add(local.id, status, lane[3], lane[10])
            if self._memory.get(local.id) is None:
                status._attach(Outcome(StatusCode.ERR_NOT_FOUND, f"local memory {local.id} was deregistered"))
                return status
        completion = lane[4](op, lane[7] + l_off, r_off, size, uid)
        if completion is None:  # nothing started: submit() reconnects or fails over
            if self._lanes.get(key) is lane:  # and keeps a new lane once its backend has one
                del self._lanes[key]
            if status is not None:
                status._attach(Outcome(StatusCode.ERR_BAD_STATE, "not started (its lane had failed)"))
            return None
        if completion is lane[5]:
            # Finished as it started (a same-host copy): with no earlier transfer to the peer that
            # may still run, no one holds the status yet, so it takes the code itself (no completion
            # to read, no place in the order; what running() tells, without its frames). Else it
            # reports after that one.
            last = self._order.last(lane[10])
            if last is None or not last._running():
                if last is not None:  # the next ones need not ask it
                    self._order.drop_finished(lane[10], last)
                if status is None:
                    return _succeeded()
                status._code = _SUCCESS
                return status
            if status is None:
                status = TransferStatus(_IN_PROGRESS)
            self._order.join(lane[10], status)
        else:
            if status is None:
                status = TransferStatus(_IN_PROGRESS)
            code = completion.code()
            if code == _IN_PROGRESS_INT or (code <= _IN_PROGRESS_INT and self._order.running(lane[10])):
                self._order.join(lane[10], status)
        status._attach(completion)
        return status

    def submit(
        self,
        op: TransferOp,
        local: MemoryDesc,
        l_offs: Any,
        remote: MemoryDesc,
        r_offs: Any,
        sizes: Any,
        uid: int,
        backend: Backend | None = None,
    ) -> TransferStatus:
        """Checks, routes (unless ``backend`` is given) and starts one transfer; its status."""
        if not isinstance(local, MemoryDesc) or not isinstance(remote, MemoryDesc):
            raise TypeError("local and remote memory must be MemoryDesc objects")
        rows = _batch(local.data, l_offs, r_offs, sizes)
        if type(uid) is not int:
            uid = _int("transfer uid", uid)
        changes = self._memory.changes + self._remotes.changes + self._backends.changes  # counts only grow
        route = self._route
        if route is not None and route[0] is local and route[1] is remote and route[2] == changes:
            problem, preferred = None, route[3]
        else:
            problem, preferred = self.reject(local, remote), None
            if problem is None:
                preferred = self._backends.preferred(local, remote)
                self._route = (local, remote, changes, preferred)
        if problem is None and not 0 <= uid < _U64_END:
            problem = StatusCode.ERR_INVALID_ARGS, f"transfer uid {uid} outside 0..2**64-1"
        if problem is None:
            if isinstance(rows, str):
                problem = StatusCode.ERR_INVALID_ARGS, rows
            elif rows[1] > local.size:
                problem = (
                    StatusCode.ERR_INVALID_ARGS,
                    f"a block runs past the end of local memory {local.id} ({local.size} bytes)",
                )
            elif rows[2] > remote.size:
                problem = (
                    StatusCode.ERR_INVALID_ARGS,
                    f"a block runs past the end of remote memory {remote.id} ({remote.size} bytes)",
                )
        if problem is None and backend is None:
            if preferred is not None and preferred.healthy(remote.engine_key):
                backend = preferred  # what choose() returns while it is healthy
            else:
                backend = self._backends.choose(local, remote)
            if backend is None:
                problem = (
                    StatusCode.ERR_BAD_STATE,
                    (
                        f"no backend of engine {self._key!r} can move {local.loc.name} "
                        f"<-> {remote.loc.name} memory (created: "
                        f"{self._backends.names() or 'none'})"
                    ),
                )
        if problem is not None:
            return TransferStatus(*problem)
        assert backend is not None and not isinstance(rows, str)
        # IN_PROGRESS from the start: no one sees the status before the order below publishes it.
        status = TransferStatus(_IN_PROGRESS)
        request = TransferRequest(op, local, remote, rows[0], uid)
        # Known to deregister_memory before it starts; a deregistration that raced ahead fails it here.
        self._inflight.add(local.id, status, backend, remote.engine_key)
        if self._memory.get(local.id) is None:
            status._attach(Outcome(StatusCode.ERR_NOT_FOUND, f"local memory {local.id} was deregistered"))
            return status
        try:
            completion = backend.submit(request)
        except Exception as err:  # admitted above: whatever went wrong must finish the status
            # A backend must not raise (base.py); if one does, the status still ends.
            _log.error(
                "engine %r: %s backend raised while starting transfer %d: %r", self._key, backend.kind.name, uid, err
            )
            completion = Outcome(
                StatusCode.ERR_BAD_STATE, f"the {backend.kind.name} backend failed to start the transfer: {err!r}"
            )
        if completion is None:  # a backend breaking its contract must not leave it running either
            completion = Outcome(StatusCode.ERR_BAD_STATE, f"the {backend.kind.name} backend returned no completion")
        # Joined to the order once the transfer is on its way (its bytes move meanwhile), before
        # the caller holds the status: no one sees it out of order. One refused in the call
        # ("SQ full", rows its transport cannot move) has failed already and holds no one back.
        if completion.code() <= _IN_PROGRESS_INT:
            self._order.join(remote.engine_key, status)
            if backend is preferred:
                self._keep_lane(local, remote, changes, backend)
        status._attach(completion)
        return status

    def _keep_lane(self, local: MemoryDesc, remote: MemoryDesc, changes: int, backend: Backend) -> None:
        """Asks ``backend`` for the pair's lane unless the one kept was made for it as things are
        now. (A lane whose connection failed is dropped by the single() that finds it so: no
        transfer, batches included, asks its health here.)"""
        key = (id(local), id(remote))
        lane = self._lanes.get(key)
        if (
            lane is None
            or lane[0] is not local
            or lane[1] is not remote
            or lane[2] != changes
            or lane[3] is not backend
        ):
            made = backend.lane(local, remote)
            if made is None:
                self._lanes.pop(key, None)
                return
            if len(self._lanes) >= _MAX_LANES:
                self._lanes.clear()
            # What single() reads per call, taken once: the Lane's parts and the descriptors' fields
            # (frozen: they stay as they are while the entry holds them).
            self._lanes[key] = (
                local,
                remote,
                changes,
                backend,
                made.start,
                made.finished,
                made.drained,
                local.data,
                local.size,
                remote.size,
                remote.engine_key,
            )

    def batch(
        self,
        op: TransferOp,
        local_mem: Any,
        local_offsets: Any,
        remote_mem: Any,
        remote_offsets: Any,
        sizes: Any,
        uid: Any,
    ) -> Any:
        """``batch_read``/``batch_write``: one transfer, or MORI's engine-level form (lists of
        descriptor pairs) with one transfer and one status per pair."""
        if not isinstance(local_mem, (list, tuple)):
            return self.submit(op, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid)
        # MORI's engine-level form: one list entry per descriptor pair, one status each.
        columns = {
            "local memory": local_mem,
            "local offsets": local_offsets,
            "remote memory": remote_mem,
            "remote offsets": remote_offsets,
            "sizes": sizes,
            "uids": uid,
        }
        for name, column in columns.items():
            if not isinstance(column, (list, tuple)):
                raise TypeError(
                    f"batch with a list of descriptors: {name} must be a list too, got {type(column).__name__}"
                )
        if len({len(c) for c in columns.values()}) > 1:
            raise ValueError(
                "batch with a list of descriptors: lengths differ ("
                + ", ".join(f"{len(c)} {name}" for name, c in columns.items())
                + ")"
            )
        for lm, rm in zip(local_mem, remote_mem):
            if not isinstance(lm, MemoryDesc) or not isinstance(rm, MemoryDesc):
                raise TypeError("local and remote memory must be MemoryDesc objects")
        return [
            self.submit(op, *pair) for pair in zip(local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid)
        ]
