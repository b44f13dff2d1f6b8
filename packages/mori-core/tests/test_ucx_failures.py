"""The UCX engine when its peer dies or hangs mid-transfer: the transfer fails within the
deadline, naming the peer, and never reports SUCCESS with bytes missing; no byte lands after it
failed. Two real processes, on one host and between two network namespaces, with both UCXs."""

from __future__ import annotations

import random
import signal
import time

import numpy as np
import pytest
from _ucx_procs import GUARD, SIZE, engine_pair, fill

from mori.core.ucx import READ, WRITE

PARAMS = [(lib, where) for lib in ("debian", "wheel") for where in ("host", "netns")]
IDS = [f"{lib}-{where}" for lib, where in PARAMS]
TIMEOUT = 3.0
BLOCK = 1 << 20


@pytest.mark.parametrize("lib,where", PARAMS, ids=IDS)
@pytest.mark.parametrize("op", [READ, WRITE], ids=["read", "write"])
def test_killed_target_fails_transfers_never_success_with_missing_bytes(lib: str, where: str, op: int) -> None:
    rng = random.Random(f"{lib}{where}{op}")
    for _ in range(3):
        with engine_pair(lib, where, timeout=TIMEOUT) as pair:
            fill(pair.init.arr, 1)
            fill(pair.target.arr, 2)
            src = (pair.init if op == WRITE else pair.target).region.copy()
            n = SIZE // BLOCK
            offs = [i * BLOCK for i in range(n)]
            tid = pair.init.call("start", "target", op, offs, offs, [BLOCK] * n)
            time.sleep(rng.uniform(0.0, 0.02))
            pair.target.signal(signal.SIGKILL)
            code, msg, secs = pair.init.call("finish", tid, 30.0)
            dst = (pair.target if op == WRITE else pair.init).region
            if code == "SUCCESS":  # finished before the kill: then every byte is there
                assert np.array_equal(dst, src)
            else:
                assert code == "ERR_TRANSPORT" and "'target'" in msg, (code, msg)
            assert secs < TIMEOUT + 5, (secs, msg)
            assert not pair.init.call("healthy", "target") or code == "SUCCESS", msg


@pytest.mark.parametrize("lib,where", PARAMS, ids=IDS)
def test_hung_target_fails_at_the_deadline_and_no_byte_lands_after(lib: str, where: str) -> None:
    with engine_pair(lib, where, timeout=TIMEOUT) as pair:
        fill(pair.init.arr, 3)
        fill(pair.target.arr, 4)
        assert pair.transfer(READ, [0], [0], [4096])[0] == "SUCCESS"  # connected
        pair.target.signal(signal.SIGSTOP)
        try:
            n = 8
            offs = [i * BLOCK for i in range(n)]
            code, msg, secs = pair.transfer(READ, offs, offs, [BLOCK] * n)
            assert code == "ERR_TRANSPORT", (code, msg)
            assert "no completion from engine 'target' within 3 s (timeout)" in msg, msg
            assert TIMEOUT - 0.5 < secs < TIMEOUT + 5, secs
            after = pair.init.arr.copy()
        finally:
            pair.target.signal(signal.SIGCONT)
        time.sleep(1.0)  # the target runs again: whatever it still sends must not land
        assert np.array_equal(pair.init.arr, after)
        assert not pair.init.call("healthy", "target")
        assert np.array_equal(pair.init.arr[:GUARD], after[:GUARD])
