"""A UCX engine with several workers deals a large transfer over them (one child transfer per
worker, a thread of its own at each end, under one parent): between two real processes in two
network namespaces (tcp, both UCXs) and on one host through UCX. Every byte is checked; the
target records one outcome per transfer, after every byte; a refusal, a killed and a hung target
fail the whole transfer, never SUCCESS with bytes missing."""

from __future__ import annotations

import random
import signal
import time

import numpy as np
import pytest
from _ucx_procs import GUARD, SIZE, engine_pair, fill

from mori.core.codes import TransferCode
from mori.core.ucx import READ, WRITE

PARAMS = [("wheel", "netns"), ("debian", "netns"), ("wheel", "host")]
IDS = [f"{lib}-{where}" for lib, where in PARAMS]
WORKERS = 3
TIMEOUT = 6.0
MIB = 1 << 20


@pytest.fixture(scope="module", params=PARAMS, ids=IDS)
def pair(request: pytest.FixtureRequest):
    with engine_pair(*request.param, timeout=TIMEOUT, workers=WORKERS) as p:
        yield p


def _spread(pair) -> int:
    return int(pair.init.call("stats")["spread"])


@pytest.mark.parametrize("op", [WRITE, READ], ids=["write", "read"])
@pytest.mark.parametrize(
    "lofs,rofs,sizes",
    [
        ([0], [5], [3 * MIB + 7]),  # one block, cut over the workers
        ([i * MIB for i in range(6)], [(5 - i) * MIB + 3 for i in range(6)], [MIB] * 6),  # blocks dealt
        ([0, 2 * MIB], [MIB, 0], [MIB - 1, 700 << 10]),  # two uneven blocks
    ],
    ids=["one-block", "six-blocks", "two-uneven"],
)
def test_a_large_transfer_is_spread_and_lands_byte_for_byte_with_one_record(pair, op: int, lofs, rofs, sizes) -> None:
    fill(pair.init.arr, 21 + op)
    fill(pair.target.arr, 31 + op)
    src, dst = (pair.init, pair.target) if op == WRITE else (pair.target, pair.init)
    expect = dst.arr.copy()
    for lo, ro, n in zip(lofs, rofs, sizes):
        s, d = (lo, ro) if op == WRITE else (ro, lo)
        expect[GUARD + d : GUARD + d + n] = src.region[s : s + n]
    before = _spread(pair)
    uid = 1000 + op * 10 + len(sizes)
    code, msg, _ = pair.transfer(op, lofs, rofs, sizes, uid=uid, notify=True)
    assert code == "SUCCESS", msg
    assert _spread(pair) == before + 1
    assert np.array_equal(dst.arr, expect)  # the guard bytes too
    # One record per transfer, however many workers carried it.
    assert pair.target.call("pop", "initiator", uid) == TransferCode.SUCCESS
    assert pair.target.call("pop", "initiator", uid, 0.5) is None


def test_small_transfers_stay_on_one_worker(pair) -> None:
    before = _spread(pair)
    fill(pair.init.arr, 5)
    assert pair.transfer(WRITE, [0], [0], [4096])[0] == "SUCCESS"
    assert (
        pair.transfer(WRITE, [i * 4096 for i in range(64)], [i * 8192 for i in range(64)], [4096] * 64)[0] == "SUCCESS"
    )
    assert pair.transfer(READ, [0], [0], [(2 * 256 << 10) - 1])[0] == "SUCCESS"  # below two shares
    assert _spread(pair) == before


@pytest.mark.parametrize("op", [WRITE, READ], ids=["write", "read"])
def test_a_refused_block_fails_the_spread_transfer_and_its_record(pair, op: int) -> None:
    """One block outside the target's region: the transfer fails as a whole, with the target's
    reason; the record says so once; no byte lands outside the region."""
    fill(pair.init.arr, 7)
    fill(pair.target.arr, 8)
    before_t, before_i = pair.target.arr.copy(), pair.init.arr.copy()
    lofs = [i * MIB for i in range(4)]
    rofs = [0, MIB, 2 * MIB, SIZE - 10]
    code, msg, _ = pair.transfer(op, lofs, rofs, [MIB] * 4, uid=77 + op, notify=True)
    assert code == "ERR_INVALID_ARGS" and "out of range" in msg, (code, msg)
    assert pair.target.call("pop", "initiator", 77 + op) == TransferCode.ERR_INVALID_ARGS
    assert pair.target.call("pop", "initiator", 77 + op, 0.5) is None
    assert np.array_equal(pair.target.arr[:GUARD], before_t[:GUARD])
    assert np.array_equal(pair.target.arr[GUARD + SIZE :], before_t[GUARD + SIZE :])
    if op == READ:
        assert np.array_equal(pair.init.arr[:GUARD], before_i[:GUARD])


@pytest.mark.parametrize("lib,where", PARAMS[:2], ids=IDS[:2])
@pytest.mark.parametrize("op", [READ, WRITE], ids=["read", "write"])
def test_a_killed_target_fails_a_spread_transfer_never_success_with_missing_bytes(
    lib: str, where: str, op: int
) -> None:
    rng = random.Random(f"spread{lib}{op}")
    for _ in range(3):
        with engine_pair(lib, where, timeout=TIMEOUT, workers=WORKERS) as pair:
            fill(pair.init.arr, 1)
            fill(pair.target.arr, 2)
            src = (pair.init if op == WRITE else pair.target).region.copy()
            offs = [i * MIB for i in range(SIZE // MIB)]
            tid = pair.init.call("start", "target", op, offs, offs, [MIB] * len(offs))
            time.sleep(rng.uniform(0.0, 0.02))
            pair.target.kill()
            code, msg, secs = pair.init.call("finish", tid, 30.0)
            dst = (pair.target if op == WRITE else pair.init).region
            if code == "SUCCESS":
                assert np.array_equal(dst, src)
            else:
                assert code == "ERR_TRANSPORT" and "'target'" in msg, (code, msg)
            assert secs < TIMEOUT + 5, (secs, msg)
            assert pair.init.call("stats")["spread"] == 1


def test_a_hung_target_fails_a_spread_transfer_at_the_deadline() -> None:
    with engine_pair("wheel", "netns", timeout=TIMEOUT, workers=WORKERS) as pair:
        assert pair.transfer(READ, [0], [0], [4096])[0] == "SUCCESS"  # connected
        pair.target.stop()
        try:
            offs = [i * MIB for i in range(6)]
            code, msg, secs = pair.transfer(READ, offs, offs, [MIB] * 6)
            assert code == "ERR_TRANSPORT", (code, msg)
            assert "no completion from engine 'target' within 6 s (timeout)" in msg, msg
            assert TIMEOUT - 0.5 < secs < TIMEOUT + 5, secs
            after = pair.init.arr.copy()
        finally:
            pair.target.signal(signal.SIGCONT)
        time.sleep(1.0)  # whatever the target still sends must not land
        assert np.array_equal(pair.init.arr, after)
        assert pair.init.call("stats")["spread"] == 1


def test_with_round_robin_off_large_transfers_still_spread() -> None:
    """round_robin=False (mori-io's "auto" workers): every transfer starts on the first worker,
    and one of 512 KiB or more is still spread over all of them."""
    with engine_pair("wheel", "netns", timeout=TIMEOUT, workers=2, round_robin=False) as pair:
        fill(pair.init.arr, 41)
        for _ in range(3):
            assert pair.transfer(WRITE, [0], [0], [4096])[0] == "SUCCESS"
        assert pair.init.call("stats")["spread"] == 0
        code, msg, _ = pair.transfer(WRITE, [0], [0], [2 * MIB])
        assert code == "SUCCESS", msg
        assert pair.init.call("stats")["spread"] == 1
        assert np.array_equal(pair.target.region[: 2 * MIB], pair.init.region[: 2 * MIB])
