"""Several PEs' proxies at once, each PE a process of its own with its engine, CPU "heap", ring and
proxy, and a thread of each playing the kernels of mori.ops' inter-node rounds (a dispatch, then a
combine, as ep_internode_put / ep_internode_return_put post them): every PE sends one
put-with-signal of a block to every other PE concurrently (sizes from 0 bytes to blocks that cross
the heap's chunks and the proxy's 1 MiB pieces, from the heap and from memory outside it), quiets,
then waits for every other PE's signal and checks the bytes it got, byte for byte. The proxies
wait on each other's workers (each target serves the others' bytes and signals while its own proxy
waits for a signal's answer). A put of no bytes from memory outside the heap once failed its
command and lost its signal (UCX refuses to register an empty range). The ring protocol is
test_ucx_proxy.py's; on GPUs mori.ops' InterNodeV1 runs the same pattern (ci/device/ep.sh --proxy)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import random
import time
import traceback
from typing import Any

import pytest

HEAP = 16 << 20
CHUNK = 2 << 20  # eight chunks: ids 1..8, as a vmm heap registers them
PUT, SIGNAL, STORE = 1, 4, 4
ROUNDS = 4  # dispatch, combine, dispatch, combine
AREA = 3 << 19  # each sender's block of a PE's inbox (from offset 100), each target's of its outbox
OUTBOX = 8 << 20
SIG_BASE = HEAP - 4096  # a signal word per sender


def _size(rnd: int, src: int, dst: int, world: int) -> int:
    """The block PE src sends PE dst in round rnd: some empty, some small, some past 1 MiB."""
    r = random.Random(rnd * 1000 + src * world + dst)
    return r.choice([0, 0, 7, 16, 17, 4096, 70_000, (5 << 18) + 3])


def _payload(rnd: int, src: int, dst: int, n: int) -> bytes:
    return random.Random(rnd * 7919 + src * 131 + dst).randbytes(n)


def _pe(rank: int, world: int, conn: Any, outside: bool) -> None:
    from test_ucx_proxy import Header, Slot

    from mori.core import ucx
    from mori.core._native.ucx import PROXY_HEADER_BYTES, PROXY_SLOT_BYTES, PROXY_SLOTS, UcxProxy
    from mori.core.memory import LiveRanges

    engine = ucx.make_engine(f"mesh-{rank}", timeout=20.0)
    heap = ctypes.create_string_buffer(HEAP)
    base = ctypes.addressof(heap)
    tickets = {pe: engine.admit(f"mesh-{pe}") for pe in range(world) if pe != rank}
    conn.send((list(engine.addresses), tickets))
    contacts = conn.recv()
    peers: list[Any] = [None] * world
    for pe in range(world):
        if pe != rank:
            addresses, their = contacts[pe]
            peers[pe] = engine.connect(f"mesh-{pe}", addresses, their[rank])
    window = ucx.UcxHeapWindow(engine, LiveRanges(), base, HEAP, 0, CHUNK, 1, False, peers, 20.0)
    window.grow(HEAP)  # before any PE goes on: no PE reaches a chunk before it is registered
    conn.send("connected")
    conn.recv()
    ring = ctypes.create_string_buffer(PROXY_HEADER_BYTES + PROXY_SLOTS * PROXY_SLOT_BYTES)
    bounce = ctypes.create_string_buffer(PROXY_SLOTS * 16)
    header = Header.from_address(ctypes.addressof(ring))
    proxy = UcxProxy(window, ctypes.addressof(ring), ctypes.addressof(bounce))
    ticket = 0

    def post(pe: int, remote: int, local: int, nbytes: int, value: int, sig: int) -> None:
        nonlocal ticket
        t, ticket = ticket, ticket + 1
        s = Slot.from_address(ctypes.addressof(ring) + PROXY_HEADER_BYTES + (t % PROXY_SLOTS) * PROXY_SLOT_BYTES)
        while s.seq != 4 * t:
            time.sleep(1e-5)
        s.command, s.pe, s.remote, s.local, s.bytes = PUT, pe, remote, local, nbytes
        s.value, s.compare, s.op, s.width, s.flags = value, sig, STORE, 64, SIGNAL
        s.seq = 4 * t + 1

    outboxes = []
    try:
        for rnd in range(1, ROUNDS + 1):
            for dst in random.Random(rnd + rank).sample(range(world), world):
                if dst == rank:
                    continue
                n = _size(rnd, rank, dst, world)
                data = _payload(rnd, rank, dst, n)
                if outside and dst % 2 == 1:  # a source outside the heap: registered per command
                    buf = ctypes.create_string_buffer(data, max(n, 1))
                    outboxes.append(buf)
                    local = ctypes.addressof(buf)
                else:
                    local = base + OUTBOX + dst * AREA + 8
                    ctypes.memmove(local, data, n)
                post(dst, 100 + rank * AREA, local, n, rnd << 32 | n, SIG_BASE + 8 * rank)
            # quiet: every command of this round complete at its target
            deadline = time.monotonic() + 60
            while header.completed < ticket:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"PE {rank} round {rnd}: quiet stuck at {header.completed} of {ticket}; "
                        f"failure: {proxy.failure()!r}"
                    )
                time.sleep(1e-4)
            assert header.failed == 0, proxy.failure()
            # wait for every other PE's signal of this round, then check its bytes
            for src in range(world):
                if src == rank:
                    continue
                word = ctypes.c_uint64.from_address(base + SIG_BASE + 8 * src)
                n = _size(rnd, src, rank, world)
                while word.value != (rnd << 32 | n):
                    if time.monotonic() > deadline:
                        raise AssertionError(f"PE {rank} round {rnd}: no signal from PE {src} (word {word.value:#x})")
                    time.sleep(1e-4)
                got = ctypes.string_at(base + 100 + src * AREA, n)
                assert got == _payload(rnd, src, rank, n), f"PE {rank} round {rnd}: PE {src}'s bytes differ"
            conn.send(("round", rnd))
            conn.recv()  # every PE read this round's inbox before the next overwrites it
        conn.send(("ok", proxy.executed()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        proxy.stop()
        window.close()
        for p in peers:
            if p is not None:
                p.close()
        engine.close()


@pytest.mark.parametrize("world,outside", [(2, False), (4, True)])
def test_every_pe_puts_with_signal_to_every_other_at_once(world: int, outside: bool) -> None:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(world)]
    procs = [ctx.Process(target=_pe, args=(r, world, pipes[r][1], outside), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        parents = [p[0] for p in pipes]
        contacts = [c.recv() for c in parents]
        for c in parents:
            c.send(contacts)
        assert [c.recv() for c in parents] == ["connected"] * world
        for c in parents:
            c.send("go")
        for rnd in range(1, ROUNDS + 1):
            got = []
            for c in parents:
                assert c.poll(120), f"a PE said nothing in round {rnd}"
                got.append(c.recv())
            errors = [g[1] for g in got if g[0] == "error"]
            assert not errors, "\n".join(errors)
            assert got == [("round", rnd)] * world
            for c in parents:
                c.send("next")
        final = [c.recv() for c in parents]
        assert all(f[0] == "ok" for f in final), final
        assert all(f[1] == ROUNDS * (world - 1) for f in final), final
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
