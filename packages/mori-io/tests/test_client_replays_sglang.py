"""SGLang 0.5.23's MORI backend on the prefill side, replayed call for call on mori: an engine
built in its own thread after ``MORI_RDMA_DEVICES`` is set, ``RdmaBackendConfig(4, -1, 4,
POLLING, False)``, eight shard threads that call ``engine.batch_write`` on that one engine at once
for KV, state and aux buffers and wait with ``wait_all``, and a teardown that deregisters every
buffer while writes may still be in flight.

Source replayed: SGLang's ``python/sglang/srt/disaggregation/mori/conn.py`` as published for
0.5.23 (``MoriKVManager``: ``_init_engine``, ``_register_local_buffers``, ``_transfer_worker`` per
shard, ``send_kvcache`` on the MLA path, ``_submit_batch_transfer_plan`` (a write cut where it
crosses the decode side's host registration chunks), ``send_state`` (``_send_swa_dsa_state``,
``_send_mamba_state``), ``send_aux_rdma``; ``MoriKVSender._wait_chunk``). The decode side is a
child process (:func:`_sglang_clients.serve_sglang_decode`) that never registers prefill; every
byte of every decode buffer is compared with what it must hold.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from _kv_clients import TARGET_NETNS, group_contiguous
from _peer import PipeProcess
from _sglang_clients import SglangBuffers, SglangLayout, serve_sglang_decode, sglang_engine

from mori.io import EngineDesc, IOEngine, MemoryDesc, StatusCode, TransferStatus

LAYOUT = SglangLayout()
PREFILL_SEED, DECODE_SEED = 500, 600
SHARDS = 8  # SGLANG_MORI_TRANSFER_SHARDS
ROOMS = 16
WAIT_POLL_MS = 5  # SGLANG_MORI_WAIT_POLL_MS
HOST_CHUNK = 16 << 10  # SGLANG_MORI_HOST_REGISTRATION_CHUNK_BYTES, small so KV writes cross chunks
DEADLINE_S = 60.0

Plan = tuple[list[int], list[int], list[int]]  # local offsets, remote offsets, sizes


def submit_batch_transfer_plan(
    engine: IOEngine, src: list[MemoryDesc], dst: list[MemoryDesc], plan: Plan
) -> list[TransferStatus]:
    """``_submit_batch_transfer_plan``: one engine-level ``batch_write`` per (source chunk,
    destination chunk) pair, each block cut where it crosses a registration boundary."""
    if not plan[2]:
        return []

    def submit_one(s: MemoryDesc, d: MemoryDesc, part: Plan) -> list[TransferStatus]:
        return engine.batch_write([s], [part[0]], [d], [part[1]], [part[2]], [engine.allocate_transfer_uid()])

    if len(src) == 1 and len(dst) == 1:
        return submit_one(src[0], dst[0], plan)

    def spans(group: list[MemoryDesc]) -> list[tuple[int, int]]:
        out, at = [], 0
        for desc in group:
            out.append((at, at + desc.size))
            at += desc.size
        return out

    def locate(offset: int, group_spans: list[tuple[int, int]]) -> int:
        return next(i for i, (lo, hi) in enumerate(group_spans) if lo <= offset < hi)

    src_spans, dst_spans = spans(src), spans(dst)
    parts: dict[tuple[int, int], Plan] = {}
    for local, remote, size in zip(*plan):
        while size:
            si, di = locate(local, src_spans), locate(remote, dst_spans)
            n = min(size, src_spans[si][1] - local, dst_spans[di][1] - remote)
            lo, ro, sz = parts.setdefault((si, di), ([], [], []))
            lo.append(local - src_spans[si][0])
            ro.append(remote - dst_spans[di][0])
            sz.append(n)
            local, remote, size = local + n, remote + n, size - n
    return [st for (si, di), part in parts.items() for st in submit_one(src[si], dst[di], part)]


def grouped_plan(src: list[int], dst: list[int], item_len: int) -> Plan:
    """``GroupedIndexPlan.from_groups(*group_concurrent_contiguous(...)).materialize(item_len)``."""
    src_groups, dst_groups = group_contiguous(src, dst)
    return (
        [g[0] * item_len for g in src_groups],
        [g[0] * item_len for g in dst_groups],
        [len(g) * item_len for g in src_groups],
    )


@dataclass
class Room:
    """One request (bootstrap room): the prefill pages it sends and the decode pages, state slots
    and aux slot it goes to (decode allocates them apart from every other room's)."""

    number: int
    src_pages: list[int]
    dst_pages: list[int]
    swa: tuple[list[int], list[int]]
    mamba: tuple[int, int]
    aux: tuple[int, int]


def make_rooms(rng: random.Random, first: int, count: int) -> list[Room]:
    per = LAYOUT.pages // count
    dst_pages = rng.sample(range(LAYOUT.pages), LAYOUT.pages)
    swa_slots = rng.sample(range(LAYOUT.swa_slots), LAYOUT.swa_slots)
    rooms = []
    for i in range(count):
        mine = dst_pages[i * per : (i + 1) * per]
        swa = swa_slots[i * 2 : (i + 1) * 2]
        rooms.append(
            Room(
                first + i,
                rng.sample(range(LAYOUT.pages), len(mine)),
                mine,
                (rng.sample(range(LAYOUT.swa_slots), len(swa)), swa),
                (rng.randrange(LAYOUT.mamba_slots), i % LAYOUT.mamba_slots),
                (rng.randrange(LAYOUT.aux_slots), i % LAYOUT.aux_slots),
            )
        )
    return rooms


class Prefill:
    """``MoriKVManager`` in PREFILL mode towards one decode peer, with its shard threads."""

    def __init__(self, engine: IOEngine, buffers: SglangBuffers, decode: PipeProcess) -> None:
        self.engine, self.buffers = engine, buffers
        self.peer(decode.desc, decode.call("handshake"))
        self.queues: list[queue.Queue[tuple[Room, int, bool] | None]] = [queue.Queue() for _ in range(SHARDS)]
        self.results: dict[int, list[StatusCode]] = {}
        self.statuses: list[TransferStatus] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._transfer_worker, args=(q,), name=f"mori-xfer-s{i}", daemon=True)
            for i, q in enumerate(self.queues)
        ]
        for t in self.threads:
            t.start()

    def peer(self, desc: EngineDesc, message: bytes) -> None:
        """``_add_remote_peer``: register the decode engine and keep its descriptors."""
        self.engine.register_remote_engine(desc)
        self.dst_kv, self.dst_aux, self.dst_state = SglangBuffers.unpack(message)

    def send(self, room: Room) -> None:
        """``MoriKVSender.send`` in two chunks; ``enqueue_transfer`` picks the shard by room."""
        half = len(room.src_pages) // 2
        for chunk, last in ((slice(0, half), False), (slice(half, None), True)):
            self.queues[room.number % SHARDS].put((room, chunk, last))

    def _transfer_worker(self, q: queue.Queue[tuple[Room, slice, bool] | None]) -> None:
        while (task := q.get()) is not None:
            room, chunk, last = task
            statuses = self.add_transfer_request(room, chunk, last)
            with self.lock:
                self.statuses += statuses
            rc = self._wait_chunk(statuses)
            with self.lock:
                self.results.setdefault(room.number, []).append(rc)

    def add_transfer_request(self, room: Room, chunk: slice, last: bool) -> list[TransferStatus]:
        b, out = self.buffers, []
        plan = grouped_plan(room.src_pages[chunk], room.dst_pages[chunk], LAYOUT.item_len)
        for layer in range(LAYOUT.layers):  # send_kvcache, MLA: one buffer per layer
            out += submit_batch_transfer_plan(self.engine, b.kv_groups[layer], self.dst_kv[layer], plan)
        if last:  # send_state: swa (paged) then mamba (one slot per request), each tensor its own writes
            for i, n in enumerate(LAYOUT.swa_lens):
                out += submit_batch_transfer_plan(
                    self.engine, [b.state_descs[0][i]], [self.dst_state[0][i]], grouped_plan(*room.swa, n)
                )
            for i, n in enumerate(LAYOUT.mamba_lens):
                out += self.engine.batch_write(
                    [b.state_descs[1][i]],
                    [[room.mamba[0] * n]],
                    [self.dst_state[1][i]],
                    [[room.mamba[1] * n]],
                    [[n]],
                    [self.engine.allocate_transfer_uid()],
                )
            p, d = room.aux  # send_aux_rdma: every aux buffer in one multi-descriptor batch_write
            out += self.engine.batch_write(
                b.aux_descs,
                [[p * n] for n in LAYOUT.aux_lens],
                self.dst_aux,
                [[d * n] for n in LAYOUT.aux_lens],
                [[n] for n in LAYOUT.aux_lens],
                [self.engine.allocate_transfer_uid() for _ in LAYOUT.aux_lens],
            )
        return out

    def _wait_chunk(self, statuses: list[TransferStatus]) -> StatusCode:
        deadline = time.monotonic() + DEADLINE_S
        while (rc := self.engine.wait_all(statuses, timeout_ms=WAIT_POLL_MS)) == StatusCode.IN_PROGRESS:
            if time.monotonic() > deadline:
                return rc
        return rc

    def teardown(self) -> None:
        """SGLang's teardown: stop the shard threads (each joined for at most 3 s), then deregister
        every kv, aux and state buffer whether or not a write still uses it."""
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join(timeout=3.0)
        for desc in self.buffers.descs():
            self.engine.deregister_memory(desc)


def expect(rooms: list[Room], src: SglangBuffers, dst: list[np.ndarray]) -> None:
    """What the rooms' writes leave in the decode buffers ``dst`` (KV layers, aux, swa, mamba)."""
    kv, aux = dst[: LAYOUT.layers], dst[LAYOUT.layers : LAYOUT.layers + len(LAYOUT.aux_lens)]
    swa = dst[LAYOUT.layers + len(LAYOUT.aux_lens) :][: len(LAYOUT.swa_lens)]
    mamba = dst[LAYOUT.layers + len(LAYOUT.aux_lens) + len(LAYOUT.swa_lens) :]
    n = LAYOUT.item_len
    for room in rooms:
        for layer in range(LAYOUT.layers):
            for s, d in zip(room.src_pages, room.dst_pages):
                kv[layer][d * n : (d + 1) * n] = src.kv[layer][s * n : (s + 1) * n]
        for i, size in enumerate(LAYOUT.swa_lens):
            for s, d in zip(*room.swa):
                swa[i][d * size : (d + 1) * size] = src.state[0][i][s * size : (s + 1) * size]
        for i, size in enumerate(LAYOUT.mamba_lens):
            s, d = room.mamba
            mamba[i][d * size : (d + 1) * size] = src.state[1][i][s * size : (s + 1) * size]
        for i, size in enumerate(LAYOUT.aux_lens):
            s, d = room.aux
            aux[i][d * size : (d + 1) * size] = src.aux[i][s * size : (s + 1) * size]


def _decode_buffers(decode: PipeProcess) -> list[np.ndarray]:
    return [np.frombuffer(b, dtype=np.uint8).copy() for b in decode.call("buffers")]


def _send_and_check(prefill: Prefill, decode: PipeProcess, rooms: list[Room], expected: list[np.ndarray]) -> None:
    """Sends every room (two chunks each), waits until each chunk's ``wait_all`` returned
    ``SUCCESS``, then compares every decode buffer, byte for byte, with ``expected`` after them."""
    for room in rooms:
        prefill.send(room)
    deadline = time.monotonic() + DEADLINE_S
    while len(prefill.results) < len(rooms) or any(len(r) < 2 for r in prefill.results.values()):
        assert time.monotonic() < deadline, f"{len(prefill.results)} of {len(rooms)} rooms finished"
        time.sleep(0.01)
    assert all(rc == [StatusCode.SUCCESS] * 2 for rc in prefill.results.values()), prefill.results
    expect(rooms, prefill.buffers, expected)
    for got, want in zip(_decode_buffers(decode), expected):
        assert np.array_equal(got, want)


def test_sglang_shards_write_kv_state_and_aux_on_one_engine(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixteen rooms sent in two chunks each through eight shard threads at once, on an engine
    built in another thread; then SGLang's teardown while a second round is still being written,
    after which both sides register fresh buffers and a new round moves every byte."""
    # sglang_engine sets MORI_RDMA_DEVICES process-wide, as SGLang does. setenv records the value
    # this test found, so teardown restores it (delenv of an absent name records nothing, and the
    # interface list leaked into later tests' processes: in another namespace it names no device).
    monkeypatch.setenv("MORI_RDMA_DEVICES", "")
    monkeypatch.setenv("MORI_IO_TIMEOUT", "10")  # bounds the teardown's waits (the decode inherits it)
    decode = PipeProcess(
        serve_sglang_decode,
        ("decode-sg", backend, LAYOUT, DECODE_SEED, HOST_CHUNK),
        "SGLang decode",
        90.0,
        TARGET_NETNS,
    )
    engine = sglang_engine("prefill-sg", backend)
    try:
        assert engine.get_engine_desc().port > 0
        buffers = SglangBuffers(engine, LAYOUT, PREFILL_SEED)
        prefill = Prefill(engine, buffers, decode)
        assert all(len(g) == LAYOUT.pages * LAYOUT.item_len // HOST_CHUNK for g in prefill.dst_kv)  # chunked
        rng = random.Random(7)
        expected = _decode_buffers(decode)
        rooms = make_rooms(rng, 0, ROOMS)
        _send_and_check(prefill, decode, rooms, expected)

        # Teardown while a second round is in the shards' hands: every registration goes, every
        # status ends, in bounded time; nothing is left wedged for what comes after.
        for room in make_rooms(rng, ROOMS, ROOMS):
            prefill.send(room)
        t0 = time.monotonic()
        prefill.teardown()
        decode.call("deregister_all")
        # A hang check, not a timing: every wait of the teardown is bounded (3 s joins, MORI_IO_TIMEOUT).
        assert time.monotonic() - t0 < 90
        for t in prefill.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in prefill.threads)
        assert all(st.Code() not in (StatusCode.INIT, StatusCode.IN_PROGRESS) for st in prefill.statuses)

        decode.call("fresh", DECODE_SEED + 1)  # both sides start over on the same engines
        buffers = SglangBuffers(engine, LAYOUT, PREFILL_SEED + 1)
        prefill = Prefill(engine, buffers, decode)
        expected = _decode_buffers(decode)
        rooms = make_rooms(rng, 2 * ROOMS, ROOMS)
        _send_and_check(prefill, decode, rooms, expected)
        prefill.teardown()
    finally:
        decode.close()
        engine.close()
