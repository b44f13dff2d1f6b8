"""Collectives between 1, 2, 4 and 8 real processes, with random contents checked byte for byte.

One pool of rank processes per world size serves every hypothesis example: the ranks bootstrap
once, then each example tells them a seed and the sizes, every rank makes its own random data
from (seed, rank, ...), runs the collective, and compares what it received with what each sender
must have made.
"""

from __future__ import annotations

import os
import random
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.core.bootstrap import Bootstrap, get_unique_id
from mori.core.testing import ProcPool, context

WORLDS = [1, 2, 4, 8]
MAX_BYTES = 4 << 20


def _sizes(limit: int) -> st.SearchStrategy[int]:
    """Sizes 0..limit spread evenly over the powers of two (hypothesis alone favours small ones)."""
    return st.integers(0, limit.bit_length()).flatmap(lambda bits: st.integers(0, min(1 << bits, limit)))


sizes = _sizes(MAX_BYTES)
seeds = st.integers(0, 2**32 - 1)
EXAMPLES = {1: 20, 2: 20, 4: 15, 8: 10}


def _data(seed: int, *key: int, size: int) -> bytes:
    return np.random.default_rng([seed, *key]).bytes(size)


def _join(timeout: float) -> tuple[int, int]:
    ctx = context()
    uid = ctx.share(get_unique_id() if ctx.index == 0 else None)
    ctx.state["bs"] = Bootstrap(ctx.index, ctx.size, uid, timeout=timeout)
    return ctx.index, ctx.size


def _bs() -> Bootstrap:
    return context().state["bs"]


def _mismatches(got: list[bytes], want: list[bytes]) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want)) if g != w] + ([-1] if len(got) != len(want) else [])


def _allgather(seed: int, sizes: list[int]) -> list[int]:
    bs = _bs()
    got = bs.allgather(_data(seed, bs.rank, size=sizes[bs.rank]))
    return _mismatches(got, [_data(seed, r, size=sizes[r]) for r in range(bs.world)])


def _broadcast(seed: int, root: int, size: int) -> list[int]:
    bs = _bs()
    data = _data(seed, root, size=size)
    got = bs.broadcast(data if bs.rank == root else None, root=root)
    return _mismatches([got], [data])


def _alltoall(seed: int, sizes: list[list[int]]) -> list[int]:
    bs = _bs()
    me = bs.rank
    got = bs.alltoall([_data(seed, me, j, size=sizes[me][j]) for j in range(bs.world)])
    return _mismatches(got, [_data(seed, i, me, size=sizes[i][me]) for i in range(bs.world)])


def _barrier_rounds(path: str, rounds: int, seed: int) -> list[tuple[int, float, float]]:
    """Each round: sleep a random while, append one byte to a shared file, barrier, count the bytes.

    After round k's barrier every rank must see at least (k + 1) * world bytes: nobody leaves
    before all have arrived. Arrival and departure times on the shared monotonic clock come back
    for a second, clock-based check.
    """
    bs = _bs()
    rng = random.Random(seed * 1000 + bs.rank)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    seen = []
    try:
        for _ in range(rounds):
            time.sleep(rng.uniform(0, 0.01))
            os.write(fd, b"x")
            arrived = time.monotonic()
            bs.barrier()
            left = time.monotonic()
            seen.append((os.stat(path).st_size, arrived, left))
    finally:
        os.close(fd)
    return seen


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def pool(request):
    world = request.param
    with ProcPool(world, timeout=120) as pool:
        assert pool.run(_join, 60.0) == [(r, world) for r in range(world)]
        yield pool


def _settings(world: int):
    return settings(max_examples=EXAMPLES[world], deadline=None, suppress_health_check=list(HealthCheck))


def test_allgather_random_bytes(pool):
    world = pool.size

    @_settings(world)
    @given(seeds, st.lists(sizes, min_size=world, max_size=world))
    def check(seed, per_rank):
        assert pool.run(_allgather, seed, per_rank) == [[]] * world

    check()


def test_broadcast_random_bytes_from_every_root(pool):
    world = pool.size

    @_settings(world)
    @given(seeds, st.integers(0, world - 1), sizes)
    def check(seed, root, size):
        assert pool.run(_broadcast, seed, root, size) == [[]] * world

    check()


def test_alltoall_random_bytes(pool):
    world = pool.size
    # Every rank sends world chunks: keep each rank's total at most 4 MiB.
    chunk = _sizes(MAX_BYTES // world)
    matrix = st.lists(st.lists(chunk, min_size=world, max_size=world), min_size=world, max_size=world)

    @_settings(world)
    @given(seeds, matrix)
    def check(seed, sizes):
        assert pool.run(_alltoall, seed, sizes) == [[]] * world

    check()


def test_largest_messages(pool):
    """Exactly 4 MiB and a byte over from every rank at once, plus the empty message."""
    world = pool.size
    for seed, size in [(1, MAX_BYTES), (2, MAX_BYTES + 1), (3, 0)]:
        assert pool.run(_allgather, seed, [size] * world) == [[]] * world
        assert pool.run(_broadcast, seed, world - 1, size) == [[]] * world


def test_barrier_lets_nobody_leave_before_everyone_arrived(pool):
    world = pool.size
    rounds = 20
    with tempfile.NamedTemporaryFile(prefix="mori-barrier-") as f:
        per_rank = pool.run(_barrier_rounds, f.name, rounds, 7)
        assert os.stat(f.name).st_size == rounds * world
    for k in range(rounds):
        counts = [per_rank[r][k][0] for r in range(world)]
        assert min(counts) >= (k + 1) * world, f"round {k}: a rank left the barrier having seen only {counts}"
        last_arrival = max(per_rank[r][k][1] for r in range(world))
        first_departure = min(per_rank[r][k][2] for r in range(world))
        assert first_departure >= last_arrival, f"round {k}: a rank left before the last one arrived"
