"""What ranks see when the job goes wrong: missing ranks, foreign ids, dead peers, mixed-up calls.

Every case runs real processes; every rank reports the exception it got (type and message) and
the test checks that the message names the rank that was at fault.
"""

from __future__ import annotations

import os
import time

from mori.core.bootstrap import Bootstrap, BootstrapError, BootstrapTimeout, UniqueId, get_unique_id
from mori.core.bootstrap._rendezvous import connect
from mori.core.bootstrap._wire import Deadline, Kind, pack_header
from mori.core.testing import Died, ProcPool, context

SHORT = 1.0


def _outcome(fn, *args) -> tuple[str, str]:
    """Runs fn and returns ("ok", repr(result)) or (exception type name, message)."""
    try:
        return "ok", repr(fn(*args))
    except BootstrapError as exc:
        return type(exc).__name__, str(exc)


def _share_uid() -> bytes:
    ctx = context()
    return ctx.share(get_unique_id() if ctx.index == 0 else None)


def _join_unless(absent: int, timeout: float) -> tuple[str, str]:
    """Every rank but ``absent`` joins; ``absent`` returns at once, its process alive and silent."""
    ctx = context()
    uid = _share_uid()
    if ctx.index == absent:
        return "absent", ""
    return _outcome(lambda: Bootstrap(ctx.index, ctx.size, uid, timeout=timeout).close())


def _join_as(rank: int, world: int, foreign_nonce: bool, timeout: float) -> tuple[str, str]:
    """Joins claiming ``rank`` of ``world``, with this job's id or one whose nonce is another job's."""
    uid = UniqueId.from_bytes(_share_uid())
    if foreign_nonce:
        uid = UniqueId(uid.host, uid.port, bytes(16))
    return _outcome(lambda: Bootstrap(rank, world, uid, timeout=timeout).close())


def _bootstrap(timeout: float) -> Bootstrap:
    ctx = context()
    uid = _share_uid()
    bs = ctx.state["bs"] = Bootstrap(ctx.index, ctx.size, uid, timeout=timeout)
    return bs


def _skip_one_allgather(absent: int) -> tuple[str, str]:
    bs = _bootstrap(SHORT)
    if bs.rank == absent:
        return "absent", ""  # its bootstrap stays open in the worker: alive, but not calling
    return _outcome(bs.allgather, os.urandom(100))


def _die_after_first_allgather(victim: int) -> tuple[str, str]:
    bs = _bootstrap(60.0)
    bs.allgather(os.urandom(1000))
    if bs.rank == victim:
        os._exit(3)
    return _outcome(bs.allgather, os.urandom(1000))


def _mixed_up_calls() -> tuple[str, str]:
    bs = _bootstrap(SHORT)
    if bs.rank == 0:
        return _outcome(bs.barrier)
    return _outcome(bs.allgather, b"rank 1")


def test_rank_that_never_arrives_is_named_by_every_rank():
    with ProcPool(4) as pool:
        got = pool.run(_join_unless, 3, SHORT)
    assert got[3] == ("absent", "")
    for kind, message in got[:3]:
        assert kind == "BootstrapTimeout"
        assert f"ranks [3] did not join within {SHORT:g} s" in message


def test_rank_0_that_never_arrives_is_named():
    with ProcPool(3) as pool:
        got = pool.run(_join_unless, 0, SHORT)
    for kind, message in got[1:]:
        assert kind == "BootstrapTimeout"
        assert "ranks [0]" in message


def test_rank_with_another_jobs_id_is_rejected_and_named():
    with ProcPool(3) as pool:
        got = pool.map(_join_as, [(0, 3, False, SHORT), (1, 3, False, SHORT), (2, 3, True, SHORT)])
    kind, message = got[2]
    assert kind == "BootstrapError"
    assert "rejected rank 2" in message and "another job" in message
    for kind, message in got[:2]:
        assert kind == "BootstrapTimeout"
        assert "ranks [2] did not join" in message and "rejected: rank 2" in message


def test_world_mismatch_and_duplicate_rank_are_rejected():
    with ProcPool(4) as pool:
        got = pool.map(
            _join_as, [(0, 3, False, SHORT), (1, 3, False, SHORT), (1, 3, False, SHORT), (2, 5, False, SHORT)]
        )
    assert got[3][0] == "BootstrapError" and "world=5 but rank 0 has world=3" in got[3][1]
    ones = sorted([got[1], got[2]])
    assert ones[0][0] == "BootstrapError" and "duplicate" in ones[0][1]
    assert ones[1][0] == "BootstrapTimeout" and "ranks [2] did not join" in ones[1][1]
    assert got[0][0] == "BootstrapTimeout" and "ranks [2] did not join" in got[0][1]
    assert "duplicate" in got[0][1] and "world=5" in got[0][1]


def test_rank_missing_from_a_collective_is_named():
    with ProcPool(4) as pool:
        got = pool.run(_skip_one_allgather, 2)
    for rank in (0, 1, 3):
        kind, message = got[rank]
        assert kind == "BootstrapTimeout"
        assert f"allgather #0: ranks [2] did not arrive within {SHORT:g} s" in message


def test_peer_that_dies_mid_job_is_named_without_waiting_for_the_timeout():
    with ProcPool(4) as pool:
        got = pool.map(_die_after_first_allgather, [(1,)] * 4, may_die={1})
    assert got[1] == Died(3)
    for rank in (0, 2, 3):
        kind, message = got[rank]
        # A plain BootstrapError, not a timeout: the death itself was seen (the timeout is 60 s).
        assert kind == "BootstrapError", message
        assert "allgather #1" in message and "rank 1 (pid" in message


def test_ranks_calling_different_collectives_are_told():
    with ProcPool(2) as pool:
        got = pool.run(_mixed_up_calls)
    assert got[0][0] == "BootstrapError" and "sent allgather #0 instead" in got[0][1]
    assert got[1][0] == "BootstrapError" and "sent barrier #0 instead" in got[1][1]
    assert "same collectives in the same order" in got[0][1]


def _fail_then_reuse() -> list[tuple[str, str]]:
    bs = _bootstrap(SHORT)
    if bs.rank == 1:
        return []
    return [_outcome(bs.barrier), _outcome(bs.barrier)]


def test_failed_bootstrap_refuses_further_use():
    with ProcPool(2) as pool:
        first, second = pool.run(_fail_then_reuse)[0]
    assert first[0] == "BootstrapTimeout" and "barrier #0: ranks [1] did not arrive" in first[1]
    assert second[0] == "BootstrapError"
    assert "closed after an earlier failure" in second[1] and "ranks [1] did not arrive" in second[1]


def test_timeout_is_per_call_not_per_job():
    """Collectives spread over longer than the timeout in total still succeed."""
    with ProcPool(2) as pool:
        got = pool.run(_slow_but_steady, 1.0, 4)
    assert got == [list(range(4))] * 2


def _slow_but_steady(timeout: float, calls: int) -> list[int]:
    bs = _bootstrap(timeout)
    done = []
    for k in range(calls):
        time.sleep(timeout * 0.4)
        bs.barrier()
        done.append(k)
    return done


def test_timeout_error_is_also_a_python_timeout():
    assert issubclass(BootstrapTimeout, TimeoutError) and issubclass(BootstrapTimeout, BootstrapError)


def _with_strangers() -> list[bytes]:
    """While rank 0 waits for the others, strangers connect to its port: one speaks HTTP, one sends
    a bad hello. Rank 1 sends them (retrying until rank 0 listens) before it joins itself."""
    ctx = context()
    strangers = []
    uid_bytes = ctx.share(get_unique_id() if ctx.index == 0 else None)
    if ctx.index == 1:
        uid = UniqueId.from_bytes(uid_bytes)
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", pack_header(Kind.HELLO, 3) + b"\x93\x01\x02"):
            s = connect(uid.host, uid.port, Deadline(10), retry_refused=True)
            s.sendall(junk)
            strangers.append(s)
    with Bootstrap(ctx.index, ctx.size, uid_bytes, timeout=10) as bs:
        got = bs.allgather(bytes([bs.rank]) * 1000)
    for s in strangers:
        s.close()
    return got


def test_strangers_on_rank_0s_port_are_turned_away():
    with ProcPool(3) as pool:
        got = pool.run(_with_strangers)
    assert got == [[bytes([r]) * 1000 for r in range(3)]] * 3


def _with_crowd() -> list[bytes]:
    """While rank 0 waits for rank 1, 150 silent connections and a hello claiming 512 GiB hit its
    port. Rank 1 makes them (retrying until rank 0 listens) before it joins itself."""
    ctx = context()
    strangers = []
    uid_bytes = ctx.share(get_unique_id() if ctx.index == 0 else None)
    if ctx.index == 1:
        uid = UniqueId.from_bytes(uid_bytes)
        huge = connect(uid.host, uid.port, Deadline(10), retry_refused=True)
        huge.sendall(pack_header(Kind.HELLO, 1 << 39) + b"\x00" * 1024)
        strangers.append(huge)
        strangers += [connect(uid.host, uid.port, Deadline(5), retry_refused=False) for _ in range(150)]
    with Bootstrap(ctx.index, ctx.size, uid_bytes, timeout=20) as bs:
        got = bs.allgather(bytes([bs.rank]) * 100)
    for s in strangers:
        s.close()
    return got


def test_a_crowd_of_strangers_costs_little_and_blocks_nothing():
    # Issue 11: a stranger's hello is read up to 64 KiB (a 512 GiB claim is refused before any
    # buffer is made) and at most 64 strangers wait for theirs (the oldest is dropped).
    with ProcPool(2) as pool:
        got = pool.run(_with_crowd)
    assert got == [[bytes([r]) * 100 for r in range(2)]] * 2
