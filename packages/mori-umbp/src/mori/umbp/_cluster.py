"""A node of a cluster: the client's puts and gets routed by the master, served by this node's
store or a peer's, with pages moved by mori-io.

At start the node brings up its mori-io engine (its DRAM buffer registered), its peer service,
and registers with the master (its peer service's address and engine in the record); the
heartbeat ships its store's events. A put asks the master where each key goes (``BatchRoutePut``):
a key routed here is stored locally, one routed to a peer is allocated there, written there by
mori-io and committed. A get reads keys this node holds locally first, then asks the master
where the rest are (``BatchRouteGet``) and reads them from their peers under read leases,
released after the get returns when the read ended well within them. A peer that fails (no
answer within the deadline, a failed transfer, a lease that did not hold) fails its keys: False,
never other bytes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mori.core.log import get_logger

from ._config import UMBPConfig
from ._enums import CacheRemoteAdmission, UMBPDeploymentMode, UMBPTierType
from ._env import runtime_int
from ._external import UMBPExternalKvHitCountEntry, UMBPExternalKvMatch
from ._heartbeat import Heartbeat
from ._master._proto import umbp_peer_pb2 as pb
from ._master_client import MasterClient, MasterError, RoutePutOutcome
from ._peer import PeerServer, PeerService, serve
from ._releases import LeaseReleaser
from ._store import LocalStore
from ._transport import Move, Peer, PeerUnavailableError, Transport

_log = get_logger("umbp")
#: Keys this node remembers putting on peers.
MAX_PLACED = 65536
#: Peers a batch talks to at once.
PEER_FANOUT = 8
#: The part of a read lease within which a finished read is trusted without asking the owner
#: (the rest covers the clocks' drift and the time the answer took to come back).
LEASE_TRUST = 0.8
#: A batch from one owner of more bytes than this is read in parts (see ``_read_in_parts``).
PIPELINE_BYTES = 8 << 20
#: The parts such a batch is read in, at most, and the fewest bytes in one.
PIPELINE_PARTS = 8
PIPELINE_PART_BYTES = 4 << 20
#: How many bytes of pages on SSD only a resolve asks to have in its answer by default, over TCP
#: (``UMBP_PEER_INLINE_MAX_BYTES``): one round trip instead of a resolve and a mori-io read. Over
#: RDMA the read costs less than moving the bytes through the owner's gRPC connection: 0.
INLINE_MAX_BYTES_TCP = 64 << 10


@dataclasses.dataclass(frozen=True)
class _Resolved:
    """An owner's answer to a resolve: ``started`` when it was asked (monotonic seconds)."""

    peer: Peer
    answer: Any
    started: float


def _copy_inline(resolved: Any, ptrs: list[int], sizes: list[int]) -> list[bool]:
    """The pages of an answer that carried their bytes (``inline_pages``, in key order) copied to
    ``ptrs``: those of the size asked for, when the bytes add up to the sizes answered."""
    data: bytes = resolved.inline_pages
    answered = list(resolved.size)
    if len(answered) != len(ptrs) or not all(resolved.found) or sum(answered) != len(data):
        _log.warning("an inline answer of %d bytes for %d pages does not add up: ignored", len(data), len(ptrs))
        return [False] * len(ptrs)
    base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    results, at = [], 0
    for ptr, size, want in zip(ptrs, answered, sizes):
        if size == want:
            ctypes.memmove(ptr, base + at, size)
        results.append(size == want)
        at += size
    return results


def _parts(sizes: list[int], part_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` in order, in parts of at least one page and about ``part_bytes``."""
    parts: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        if parts[-1] and held + size > part_bytes:
            parts.append([])
            held = 0
        parts[-1].append(i)
        held += size
    return parts


class ClusterNode:
    """This process's node of a cluster (see the module's docstring)."""

    def __init__(self, cfg: UMBPConfig, store: LocalStore, max_value_size: int) -> None:
        dist = cfg.distributed
        assert dist is not None
        mc = dist.master_config
        self.node_id, self._store, self._ssd = mc.node_id, store, cfg.ssd.enabled
        admit = CacheRemoteAdmission.NEVER if not dist.cache_remote_fetches else dist.cache_remote_admission
        #: The largest page read from a peer that is kept here too (0: none; MORI's admission).
        self._cache_limit = {CacheRemoteAdmission.NEVER: 0, CacheRemoteAdmission.ALWAYS: 1 << 62}.get(
            admit, dist.admission_max_block_bytes or 1 << 62
        )
        host = dist.io_engine.host or mc.node_address
        # The engine's key names this incarnation of the node: a node that restarts under the same
        # id is another engine to its peers, whose old one they forget when it fails them.
        self.transport = Transport(
            f"umbp-{mc.node_id}-{os.getpid()}-{secrets.token_hex(4)}",
            host,
            dist.io_engine.port,
            store.buffer_address,
            store.registered_size,
            dist.staging_buffer_size,
        )
        # Where this node put keys on peers lately: its own reads of them go straight there, before
        # the owner's heartbeat has told the master.
        self._placed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._placed_lock = threading.Lock()
        self._fanout = concurrent.futures.ThreadPoolExecutor(PEER_FANOUT, thread_name_prefix="umbp-fanout")
        self._releaser = LeaseReleaser()
        #: The resolve of a batch's next part, while this part is read (see ``_read_in_parts``).
        self._resolver = concurrent.futures.ThreadPoolExecutor(PEER_FANOUT, thread_name_prefix="umbp-resolve")
        self._service = PeerService(
            store, self.transport.engine_desc, self.transport.buffer.pack(), max_value_size, on_commit=self._committed
        )
        self._inline_max = runtime_int(
            "UMBP_PEER_INLINE_MAX_BYTES", INLINE_MAX_BYTES_TCP if self.transport.backend == "tcp" else 0, 0
        )
        self._server: PeerServer | None = None
        self._heartbeat: Heartbeat | None = None
        try:
            self._server = serve(self._service, "0.0.0.0", dist.peer_service_port)
            self.peer_address = f"{mc.node_address}:{self._server.port}"
            self.master = MasterClient(
                mc.master_address,
                mc.node_id,
                mc.node_address,
                peer_address=self.peer_address,
                engine_desc=self.transport.engine_desc,
                tags=mc.tags,
            )
            self._heartbeat = Heartbeat(self.master, store, self._capacities, mc.auto_heartbeat)
        except BaseException:
            self._shutdown_services()
            raise

    def _committed(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.wake()

    def _capacities(self) -> dict[UMBPTierType, tuple[int, int]]:
        """What the master routes by. With an SSD tier: DRAM's free bytes and SSD's (a put routed
        to either lands in DRAM, and older pages move on). Without: all of DRAM, a cache that
        drops its oldest pages for new ones."""
        stats = self._store.stats()
        total = stats["dram_capacity"]
        if not self._ssd:
            return {UMBPTierType.DRAM: (total, total)}
        return {
            UMBPTierType.DRAM: (total, max(0, total - stats["dram_used"])),
            UMBPTierType.SSD: (stats["ssd_capacity"], max(0, stats["ssd_capacity"] - stats["ssd_used"])),
        }

    # -- puts ---------------------------------------------------------------------------------

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int], depths: list[int]) -> list[bool]:
        try:
            routes = self.master.batch_route_put(keys, sizes)
        except MasterError as exc:
            _log.warning("routing %d puts failed (%s): stored on this node", len(keys), exc)
            routes = []
        results = [False] * len(keys)
        remote: dict[str, list[int]] = collections.defaultdict(list)
        local: list[int] = []
        for i in range(len(keys)):
            route = routes[i] if routes else None
            if route is None or (route.outcome == RoutePutOutcome.ROUTED and route.node_id == self.node_id):
                local.append(i)
            elif route.outcome == RoutePutOutcome.ALREADY_EXISTS:
                results[i] = True
            elif route.outcome == RoutePutOutcome.ROUTED and route.peer_address:
                remote[route.peer_address].append(i)
        for i in local:
            results[i] = self._store.write(keys[i], ptrs[i], sizes[i], depths[i])

        def put_on(address: str) -> list[bool]:
            indices = remote[address]
            return self._put_remote(
                address,
                [keys[i] for i in indices],
                [ptrs[i] for i in indices],
                [sizes[i] for i in indices],
                [depths[i] for i in indices],
            )

        for address, ok in zip(remote, self._each_peer(put_on, list(remote))):
            indices = remote[address]
            for i, done in zip(indices, ok):
                results[i] = done
            with self._placed_lock:
                for i, done in zip(indices, ok):
                    if done:
                        self._placed[keys[i]] = address
                        self._placed.move_to_end(keys[i])
                while len(self._placed) > MAX_PLACED:
                    self._placed.popitem(last=False)
        if local and self._heartbeat is not None:
            self._heartbeat.wake()
        return results

    def _put_remote(
        self, address: str, keys: list[str], ptrs: list[int], sizes: list[int], depths: list[int]
    ) -> list[bool]:
        try:
            peer = self.transport.peer(address)
            request = pb.BatchAllocateSlotsRequest()
            for key, size, depth in zip(keys, sizes, depths):
                request.entries.add(key=key, size=size, tier=int(UMBPTierType.DRAM), depth=depth)  # type: ignore[arg-type]
            slots = peer.call("BatchAllocateSlots", request).entries
        except PeerUnavailableError as exc:
            _log.warning("put of %d keys to %s: %s", len(keys), address, exc)
            return [False] * len(keys)
        results = [slot.outcome == pb.ALLOCATE_SLOT_OUTCOME_SUCCESS_ALREADY_EXISTS for slot in slots]
        todo = [i for i, slot in enumerate(slots) if slot.outcome == pb.ALLOCATE_SLOT_OUTCOME_SUCCESS_ALLOCATED]
        if not todo:
            return results
        written = self.transport.write(peer, [Move(ptrs[i], sizes[i], slots[i].offset) for i in todo])
        commit = [i for i, ok in zip(todo, written) if ok]
        abort = [slots[i].slot_id for i, ok in zip(todo, written) if not ok]
        try:
            if abort:
                peer.call("BatchAbortSlots", pb.BatchAbortSlotsRequest(slot_ids=abort))
            if commit:
                request = pb.BatchCommitSlotsRequest()
                for i in commit:
                    request.entries.add(slot_id=slots[i].slot_id, key=keys[i])
                done = peer.call("BatchCommitSlots", request).success
                for i, ok in zip(commit, done):
                    results[i] = bool(ok)
        except PeerUnavailableError as exc:  # the peer reaps what it did not get to commit
            _log.warning("committing %d keys on %s: %s", len(commit), address, exc)
        return results

    # -- gets ---------------------------------------------------------------------------------

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        results = [False] * len(keys)
        missing = [i for i, hit in enumerate(self._store.contains_many(keys)) if not hit]
        absent = set(missing)
        held = [i for i in range(len(keys)) if i not in absent]
        if held:
            for i, ok in zip(
                held, self._store.read([keys[i] for i in held], [ptrs[i] for i in held], [sizes[i] for i in held])
            ):
                results[i] = ok
        missing += [i for i in held if not results[i]]  # gone meanwhile: another node may have it
        if missing:
            self._get_remote_keys(missing, keys, ptrs, sizes, results)
            self._keep(missing, keys, ptrs, sizes, results)
        return results

    def _get_remote_keys(
        self, missing: list[int], keys: list[str], ptrs: list[int], sizes: list[int], results: list[bool]
    ) -> None:
        """Reads keys from peers: those this node put on a peer from there, the rest from where
        the master says."""
        with self._placed_lock:
            known = {i: self._placed[keys[i]] for i in missing if keys[i] in self._placed}
        by_peer: dict[str, list[int]] = collections.defaultdict(list)
        for i, address in known.items():
            by_peer[address].append(i)
        self._read_from(by_peer, keys, ptrs, sizes, results)
        missing = [i for i in missing if not results[i]]
        if not missing:
            return
        try:
            where = self.master.batch_route_get([keys[i] for i in missing], exclude_nodes=[self.node_id])
        except MasterError as exc:
            _log.warning("routing %d gets failed: %s", len(missing), exc)
            return
        by_peer = collections.defaultdict(list)
        for i, loc in zip(missing, where):
            if loc is not None and loc.peer_address and loc.size == sizes[i]:
                by_peer[loc.peer_address].append(i)
        self._read_from(by_peer, keys, ptrs, sizes, results)

    def _keep(
        self, fetched: list[int], keys: list[str], ptrs: list[int], sizes: list[int], results: list[bool]
    ) -> None:
        """MORI's ``cache_remote_fetches``: pages just read from peers are kept here too, those of
        at most the admission size, while DRAM stays under its low watermark (nothing is evicted
        for them)."""
        kept = [i for i in fetched if results[i] and sizes[i] <= self._cache_limit]
        for i in kept:
            self._store.write(keys[i], ptrs[i], sizes[i], make_room=False)
        if kept and self._heartbeat is not None:
            self._heartbeat.wake()

    def _read_from(
        self, by_peer: dict[str, list[int]], keys: list[str], ptrs: list[int], sizes: list[int], results: list[bool]
    ) -> None:
        def read_from(address: str) -> list[bool]:
            indices = by_peer[address]
            return self._get_remote(
                address, [keys[i] for i in indices], [ptrs[i] for i in indices], [sizes[i] for i in indices]
            )

        for address, got in zip(by_peer, self._each_peer(read_from, list(by_peer))):
            for i, ok in zip(by_peer[address], got):
                results[i] = ok

    def _each_peer(self, fn: Callable[[str], list[bool]], addresses: list[str]) -> list[list[bool]]:
        """``fn(address)`` for each peer, at once when there are several (each call is bounded by
        its deadlines)."""
        if len(addresses) <= 1:
            return [fn(a) for a in addresses]
        return list(self._fanout.map(fn, addresses))

    def _get_remote(self, address: str, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Reads keys from their owner, in rounds: an owner stages SSD pages into its DRAM for
        the reader, as many as its DRAM takes at once; the rest come in the next round, after
        this one's leases are released (those released in the background too). Stops when a
        round reads nothing (see below). A batch of more than :data:`PIPELINE_BYTES` is read in
        parts first, the owner staging the next part while this one's pages move
        (:meth:`_read_in_parts`)."""
        results = [False] * len(keys)
        todo = list(range(len(keys)))
        if sum(sizes) > PIPELINE_BYTES:
            if not self._read_in_parts(address, keys, ptrs, sizes, results):
                return results
            todo = [i for i in todo if not results[i]]
        retried = False
        while todo:
            # DRAM the owner has no room in may be held by this reader's own leases, released in
            # the background: a round after reads, or after one that read nothing while some were
            # on their way, waits until those releases are sent; the latter is asked again once.
            if retried or any(results):
                self._releaser.settle(address, self.transport.rpc_timeout_s)
            releasing = self._releaser.pending(address)
            done = self._read_round(address, [keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo])
            for i, ok in zip(todo, done):
                results[i] = ok
            todo = [i for i, ok in zip(todo, done) if not ok]
            if any(done):
                retried = False
            elif retried or not releasing:
                break
            else:
                retried = True
        return results

    def _read_in_parts(
        self, address: str, keys: list[str], ptrs: list[int], sizes: list[int], results: list[bool]
    ) -> bool:
        """One round in parts of about 1/:data:`PIPELINE_PARTS` of the bytes (at least
        :data:`PIPELINE_PART_BYTES`): the next part's resolve (the owner reading its SSD pages)
        runs on another thread while this part is read, one part ahead. Whether anything was read."""
        parts = _parts(sizes, max(PIPELINE_PART_BYTES, sum(sizes) // PIPELINE_PARTS))

        def resolve(n: int) -> concurrent.futures.Future[_Resolved | None]:
            return self._resolver.submit(self._resolve, address, [keys[i] for i in parts[n]])

        read_any = False
        ahead = resolve(0)
        for n, part in enumerate(parts):
            try:
                got = ahead.result(2 * self.transport.rpc_timeout_s)  # the call's deadline ends it first
            except concurrent.futures.TimeoutError:
                got = None
            if n + 1 < len(parts):
                ahead = resolve(n + 1)
            if got is None:
                continue
            done = self._read_resolved(got, [keys[i] for i in part], [ptrs[i] for i in part], [sizes[i] for i in part])
            for i, ok in zip(part, done):
                results[i] = ok
            read_any = read_any or any(done)
        return read_any

    def _read_round(self, address: str, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        got = self._resolve(address, keys)
        return [False] * len(keys) if got is None else self._read_resolved(got, keys, ptrs, sizes)

    def _resolve(self, address: str, keys: list[str]) -> _Resolved | None:
        """``keys`` resolved on their owner under read leases (None when it did not answer)."""
        started = time.monotonic()
        try:
            peer: Peer = self.transport.peer(address)
            request = pb.BatchResolveKeysRequest(keys=keys, inline_max_bytes=self._inline_max)
            return _Resolved(peer, peer.call("BatchResolveKeys", request), started)
        except PeerUnavailableError as exc:
            _log.warning("get of %d keys from %s: %s", len(keys), address, exc)
            return None

    def _read_resolved(self, got: _Resolved, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Reads the resolved keys with mori-io and releases their leases. A read that ended
        within its lease (with a margin) has the value's bytes: its leases are released in the
        background, unless the owner could not stage every key (then at once, so that the next
        round has their DRAM). A later read asks the owner whether its leases held."""
        results = [False] * len(keys)
        peer, resolved, started = got.peer, got.answer, got.started
        if resolved.inline_pages:
            return _copy_inline(resolved, ptrs, sizes)
        found = [i for i in range(len(keys)) if resolved.found[i] and resolved.size[i] == sizes[i]]
        if not found:
            return results
        read = self.transport.read(peer, [Move(ptrs[i], sizes[i], resolved.offset[i]) for i in found])
        leased = [keys[i] for i in found]
        lease_ids = [resolved.lease_id[i] for i in found]
        lease_end = started + resolved.lease_ms / 1000
        if len(found) == len(keys) and time.monotonic() < started + LEASE_TRUST * resolved.lease_ms / 1000:
            self._releaser.release(peer, leased, lease_ids, lease_end)
            for i, ok in zip(found, read):
                results[i] = ok
            return results
        try:
            held = peer.call("BatchReleaseKeys", pb.BatchReleaseKeysRequest(keys=leased, lease_id=lease_ids)).held
        except PeerUnavailableError as exc:
            _log.warning("releasing %d keys on %s: %s", len(found), peer.address, exc)
            return results
        for i, ok, kept in zip(found, read, held):
            results[i] = bool(ok and kept)
        return results

    # -- the rest -----------------------------------------------------------------------------

    def exists(self, keys: list[str]) -> list[bool]:
        found = self._store.contains_many(keys)
        if all(found):
            return found
        missing = keys if not any(found) else [key for key, hit in zip(keys, found) if not hit]
        try:
            answers = self.master.batch_lookup(missing)
        except MasterError as exc:
            _log.warning("lookup of %d keys failed: %s", len(missing), exc)
            return found
        if missing is keys:
            return answers
        remote = iter(answers)
        return [hit or next(remote) for hit in found]

    def flush(self) -> bool:
        """Pages on their way to SSD are there, and the master has every event so far."""
        flushed = self._store.flush()
        return (self._heartbeat.send() if self._heartbeat is not None else True) and flushed

    def clear(self) -> bool:
        """Removes this node's keys (the master learns it from their REMOVE events)."""
        self._store.clear()
        return True

    def register(self, ptr: int, size: int) -> bool:
        self.transport.register_region(ptr, size)
        return True

    def deregister(self, ptr: int) -> None:
        self.transport.deregister_region(ptr)

    def backend_mode(self) -> UMBPDeploymentMode:
        return UMBPDeploymentMode.Distributed

    def report_external(self, hashes: Sequence[str], tier: UMBPTierType, revoke: bool) -> bool:
        try:
            if revoke:
                self.master.revoke_external_kv_blocks(self.node_id, list(hashes), tier)
            else:
                self.master.report_external_kv_blocks(self.node_id, list(hashes), tier)
            return True
        except MasterError as exc:
            _log.warning("external KV %s of %d hashes failed: %s", "revoke" if revoke else "report", len(hashes), exc)
            return False

    def revoke_all_external(self, tier: UMBPTierType) -> bool:
        try:
            self.master.revoke_all_external_kv_blocks_at_tier(self.node_id, tier)
            return True
        except MasterError as exc:
            _log.warning("external KV revoke of tier %s failed: %s", tier.name, exc)
            return False

    def match_external(self, hashes: list[str], count_as_hit: bool) -> list[UMBPExternalKvMatch]:
        try:
            return self.master.match_external_kv(hashes, count_as_hit)
        except MasterError as exc:
            _log.warning("external KV match failed: %s", exc)
            return []

    def external_hit_counts(self, hashes: list[str]) -> list[UMBPExternalKvHitCountEntry]:
        try:
            return self.master.get_external_kv_hit_counts(hashes)
        except MasterError as exc:
            _log.warning("external KV hit counts failed: %s", exc)
            return []

    def _shutdown_services(self) -> None:
        self._fanout.shutdown(wait=True)
        self._resolver.shutdown(wait=True)
        self._releaser.close()
        if self._server is not None:
            self._server.stop(1.0)
        self._service.close()
        self.transport.close()

    def close(self) -> None:
        """Leaves the cluster (a last heartbeat, unregisters, stops the services and engine),
        then releases the store."""
        try:
            if self._heartbeat is not None:
                self._heartbeat.close()
            try:
                self.master.unregister_self()
            except MasterError as exc:
                _log.warning("unregistering %s: %s", self.node_id, exc)
            self.master.close()
            self._shutdown_services()
        finally:
            self._store.close()
