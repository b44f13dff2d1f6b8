"""mori.core.inbound.InboundRecords: one completion-record table that the native TCP data plane
writes in-band (no Python per record) and Python writes beside it, read in one place; bounded in
count and age, with codes checked."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mori.core import tcp
from mori.core.batch import Batch
from mori.core.codes import TransferCode, TransferOp
from mori.core.inbound import InboundRecords


def test_records_pop_once_with_their_message():
    table = InboundRecords(8, 60.0)
    assert table.record("a", 1, int(TransferCode.ERR_NOT_FOUND), "gone") == 0
    table.record("a", 2, int(TransferCode.SUCCESS))
    table.record("a", 2, int(TransferCode.ERR_BAD_STATE), "again")  # a repeated uid replaces its record
    assert len(table) == 2
    assert table.pop("b", 1) is None  # keyed by engine key and uid
    assert table.pop("a", 1) == (int(TransferCode.ERR_NOT_FOUND), "gone")
    assert table.pop("a", 1) is None
    assert table.pop("a", 2) == (int(TransferCode.ERR_BAD_STATE), "again")
    assert len(table) == 0


def test_bounded_in_count_and_age_and_codes_checked():
    table = InboundRecords(3, 0.3, "MAX, TTL")
    dropped = [table.record("k", uid, 0) for uid in range(5)]
    assert dropped == [0, 0, 0, 1, 1] and table.dropped == 2 and len(table) == 3
    assert table.pop("k", 0) is None and table.pop("k", 4) == (0, "")  # the oldest went first
    time.sleep(0.4)
    assert len(table) == 0 and table.dropped == 4  # aged out
    for code in (int(TransferCode.NOT_STARTED), int(TransferCode.IN_PROGRESS), 99, -1):
        with pytest.raises(ValueError, match="not a final TransferCode"):
            table.record("k", 1, code)
    assert len(table) == 0
    for bounds in ((0, 1.0), (1, 0.0), (1, -1.0)):
        with pytest.raises(ValueError, match="must be positive"):
            InboundRecords(*bounds)


def test_records_popped_out_of_order_behind_an_old_one_keep_the_table_exact():
    """Many keys, records popped and replaced out of order behind one that is never popped (the
    table then packs what it buried): the count, every pop and the oldest-first drop stay exact,
    checked against a plain model of the table."""
    table = InboundRecords(5000, 60.0)
    model: dict[tuple[str, int], int] = {}
    table.record("old", 0, 0)
    model["old", 0] = 0
    for uid in range(1, 20_000):
        key = f"engine-{uid % 7}"
        code = int(TransferCode.ERR_NOT_FOUND) if uid % 3 else 0
        table.record(key, uid, code)
        model[key, uid] = code
        if uid % 5:  # most are popped, newest first within each group of five
            for back in range(min(uid % 5, uid)):
                k = (f"engine-{(uid - back) % 7}", uid - back)
                got = table.pop(*k)
                assert (got[0] if got else None) == model.pop(k, None)
        if uid % 11 == 0:  # a repeated uid replaces its record
            table.record(key, uid, 0)
            model[key, uid] = 0
    assert len(table) == len(model) < 5000
    for k, code in model.items():
        assert table.pop(*k) == (code, "")
    assert len(table) == 0 and table.dropped == 0
    for uid in range(6000):  # over the bound: the oldest go first
        table.record("k", uid, 0)
    assert len(table) == 5000 and table.dropped == 1000
    assert table.pop("k", 999) is None and table.pop("k", 1000) == (0, "")


def test_native_target_writes_into_the_table_it_was_given():
    table = InboundRecords(16, 60.0)
    target = tcp.Target("127.0.0.1", 0, "tok", 5.0, inbound=table)
    region = np.zeros(4096, dtype=np.uint8)
    src = np.arange(4096, dtype=np.uint8)
    target.register_region(1, int(region.ctypes.data), region.nbytes)
    target.issue_ticket("init", "ticket")
    peer = tcp.Peer("target", "127.0.0.1", target.port, 1, "init", "tok", "ticket", 5.0)
    try:
        table.record("other", 7, int(TransferCode.ERR_TRANSPORT), "from Python")
        t = peer.submit(int(TransferOp.WRITE), Batch([0], [0], [4096], int(src.ctypes.data)), 1, 42, True, 1 << 20)
        assert t.wait(10) and t.code() == int(TransferCode.SUCCESS)
        assert np.array_equal(region, src)
        assert len(table) == 2 == target.inbound_count()  # one table: the target's counts are its counts
        assert table.pop("init", 42) == (int(TransferCode.SUCCESS), "")  # written natively, in-band
        assert target.pop_inbound("other", 7) == int(TransferCode.ERR_TRANSPORT)  # and read either way
        assert len(table) == 0
    finally:
        peer.close()
        target.close()
