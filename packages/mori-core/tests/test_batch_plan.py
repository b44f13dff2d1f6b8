"""The batch planner of mori.core.native (``gather_rows``, ``stripe_rows``, ``count_pieces``,
``deal_rows``, ``cut_chunks``; csrc/batch_plan.hpp) against plain-Python references on random
batches, its argument checks, and the TCP data plane's use of it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core import native

U64_MAX, I64_MAX = 2**64 - 1, 2**63 - 1


# ---- references ---------------------------------------------------------------------------------

def _merged(src_base, dst_base, so, do, sz):
    rows: list[list[int]] = []
    for s, d, n in zip(so, do, sz):
        if n <= 0:
            continue
        s, d = src_base + int(s), dst_base + int(d)
        if rows and rows[-1][0] + rows[-1][2] == s and rows[-1][1] + rows[-1][2] == d:
            rows[-1][2] += int(n)
        else:
            rows.append([s, d, int(n)])
    return rows


def _striped(rows, piece):
    return [[s + k, d + k, min(piece, n - k)] for s, d, n in rows for k in range(0, n, piece)]


def _dealt(rows, runs, min_run_bytes):
    """Run r takes its first row, then each next row whose middle is at or before (r + 1) / runs
    of the bytes; the last run takes the rest; no more runs than ceil(total / min_run_bytes)."""
    sizes = [n for _, _, n in rows]
    total = sum(sizes)
    runs = max(1, min(runs, -(-total // min_run_bytes)))
    bounds, before, i = [0], 0, 0
    for r in range(runs):
        if i == len(rows):
            break
        if r == runs - 1:
            i = len(rows)
        else:
            before, i = before + sizes[i], i + 1
            while i < len(rows) and (before + sizes[i] / 2) * runs <= total * (r + 1):
                before, i = before + sizes[i], i + 1
        bounds.append(i)
    return bounds


def _chunks(local, remote, sizes, chunk_bytes, max_pieces):
    """Chunks as lists of [local, remote, size, packed], cut, merged and split as documented."""
    pieces, pos = [], 0  # [chunk, local, remote, size]
    for lo, ro, n in zip(local, remote, sizes):
        done = 0
        while done < n:
            c = pos // chunk_bytes
            k = min(n - done, (c + 1) * chunk_bytes - pos)
            p = pieces[-1] if pieces else None
            if p and p[0] == c and p[1] + p[3] == lo + done and p[2] + p[3] == ro + done:
                p[3] += k
            else:
                pieces.append([c, lo + done, ro + done, k])
            pos, done = pos + k, done + k
    out: list[list[list[int]]] = []
    for i, (c, lo, ro, n) in enumerate(pieces):
        if not out or pieces[i - 1][0] != c or len(out[-1]) == max_pieces:
            out.append([])
        packed = out[-1][-1][3] + out[-1][-1][2] if out[-1] else 0
        out[-1].append([lo, ro, n, packed])
    return out


def _rows(values) -> np.ndarray:
    return np.array(values, dtype=np.uint64).reshape(-1, 3)




# ---- against the references ---------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 200), contiguous=st.floats(0, 1))
def test_gather_rows_matches_python(data, n, contiguous):
    # Blocks that often continue the previous one on both sides, sometimes on one side only.
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    sz = rng.integers(0, 5, n).astype(np.int64) * rng.choice([1, 4096], n)
    so, do = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        joined = rng.random() < contiguous
        so[i] = so[i - 1] + sz[i - 1] if joined else rng.integers(0, 1 << 30)
        do[i] = do[i - 1] + sz[i - 1] if joined and rng.random() < 0.9 else rng.integers(0, 1 << 30)
    out = np.full((n + 3, 3), 7, dtype=np.uint64)
    k, largest, smallest = native.gather_rows(1 << 40, 2 << 40, so, do, sz, out)
    expect = _merged(1 << 40, 2 << 40, so, do, sz)
    assert k == len(expect)
    assert out[:k].tolist() == expect
    assert (out[k:] == 7).all()  # nothing written past the rows
    sizes = [r[2] for r in expect]
    assert (largest, smallest) == ((max(sizes), min(sizes)) if sizes else (0, 0))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), piece=st.integers(1, 1 << 21) | st.sampled_from([1, 7, 4096]))
def test_stripe_rows_and_count_pieces_match_python(data, piece):
    # Rows of up to 40 pieces (or a few bytes), anywhere below 2^50.
    rows = data.draw(st.lists(st.tuples(st.integers(0, 1 << 50), st.integers(0, 1 << 50),
                                        st.integers(0, 3) | st.integers(0, 40 * piece)), max_size=80))
    table = _rows(rows)
    expect = _striped(rows, piece)
    got = native.stripe_rows(table, piece)
    assert got.dtype == np.uint64 and got.shape == (len(expect), 3) and got.tolist() == expect
    assert native.count_pieces(table, piece) == len(expect)
    if all(0 < n <= piece for _, _, n in rows):
        assert got is table  # nothing to cut: the rows themselves, no copy


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 5) | st.integers(1, 1 << 30), max_size=100), runs=st.integers(1, 70),
       min_run_bytes=st.integers(1, 4) | st.integers(1, 1 << 31))
def test_deal_rows_matches_python(sizes, runs, min_run_bytes):
    rows = [[i, i, n] for i, n in enumerate(sizes)]
    bounds = native.deal_rows(_rows(rows), runs, min_run_bytes)
    assert bounds.dtype == np.int64 and bounds.tolist() == _dealt(rows, runs, min_run_bytes)
    # Contiguous, non-empty runs covering every row; each holds at most a fair share plus one row.
    b = bounds.tolist()
    assert b[0] == 0 and b[-1] == len(rows) and all(x < y for x, y in zip(b, b[1:]))
    assert len(b) - 1 <= runs
    total = sum(sizes)
    used = max(1, min(runs, -(-total // min_run_bytes)))
    for x, y in zip(b, b[1:]):
        assert sum(sizes[x:y]) <= total / used + max(sizes)


def test_deal_rows_balances_equal_pieces_exactly():
    rows = _rows([[i << 23, i << 23, 8 << 20] for i in range(32)])
    assert native.deal_rows(rows, 8).tolist() == list(range(0, 33, 4))
    assert native.deal_rows(rows, 8, 128 << 20).tolist() == [0, 16, 32]  # at least 128 MiB a run
    assert native.deal_rows(rows[:3], 8).tolist() == [0, 1, 2, 3]  # no more runs than rows
    assert native.deal_rows(rows[:0], 8).tolist() == [0]


@settings(max_examples=300, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.integers(0, 700)), max_size=40),
       chunk=st.integers(1, 1024), max_pieces=st.integers(1, 8), contiguous=st.booleans())
def test_cut_chunks_matches_python(blocks, chunk, max_pieces, contiguous):
    if contiguous:  # runs that continue on both sides, so that merging is exercised
        starts = np.cumsum([0] + [n for _, _, n in blocks])[:-1].tolist()
        blocks = [(s, s, n) for s, (_, _, n) in zip(starts, blocks)]
    local, remote, sizes = ([b[i] for b in blocks] for i in range(3))
    lo, ro, sz, packed, bounds = native.cut_chunks(local, remote, sizes, chunk, max_pieces)
    got = [[[int(lo[i]), int(ro[i]), int(sz[i]), int(packed[i])] for i in range(a, b)]
           for a, b in zip(bounds.tolist(), bounds.tolist()[1:])]
    assert got == _chunks(local, remote, sizes, chunk, max_pieces)
    assert all(arr.dtype == np.int64 for arr in (lo, ro, sz, packed, bounds))


# ---- bad input ----------------------------------------------------------------------------------

def test_gather_rows_names_what_is_wrong():
    a = np.arange(4, dtype=np.int64)
    table = np.zeros((4, 3), dtype=np.uint64)
    for out in (np.zeros((3, 3), dtype=np.uint64), np.zeros((4, 2), dtype=np.uint64), table.astype(np.int64),
                np.asfortranarray(np.zeros((4, 3), dtype=np.uint64)), [[0, 0, 0]] * 4):
        with pytest.raises(ValueError, match=r"gather_rows: out must be a writable C-contiguous \(capacity >= 4"):
            native.gather_rows(0, 0, a, a, a, out)
    frozen = table.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writable"):
        native.gather_rows(0, 0, a, a, a, frozen)
    with pytest.raises(ValueError, match="src_offsets must be a 1-d int64 array of 4 elements"):
        native.gather_rows(0, 0, a[:3], a, a, table)
    with pytest.raises(ValueError, match="dst_offsets must be a 1-d int64 array"):
        native.gather_rows(0, 0, a, a.astype(np.float64), a, table)
    with pytest.raises(ValueError, match="sizes must be a 1-d int64 array"):
        native.gather_rows(0, 0, a, a, a.reshape(2, 2), table)
    with pytest.raises(ValueError, match=r"must be >= 0 \(block 2\)"):
        native.gather_rows(0, 0, a, np.array([0, 1, -2, 3]), a, table)
    with pytest.raises(ValueError, match="block 2 runs past the 64-bit address space"):
        native.gather_rows(U64_MAX - 2, 0, a, a, a, table)  # base + offset + size wraps at block 2
    with pytest.raises(ValueError, match="block 0 runs past"):
        native.gather_rows(0, U64_MAX - 1, [0], [0], [I64_MAX], table)


@pytest.mark.parametrize("fn", [native.stripe_rows, native.count_pieces, native.deal_rows])
def test_row_functions_name_what_is_wrong(fn):
    name = fn.__name__
    good = _rows([[0, 0, 10]])
    for rows in (np.zeros((2, 2), dtype=np.uint64), np.zeros(3, dtype=np.uint64), good.astype(np.int64),
                 good.astype(np.float64), "rows"):
        with pytest.raises(ValueError, match=rf"{name}: rows must be an \(n, 3\) uint64 array"):
            fn(rows, 4)
    for bad in (0, -5):
        with pytest.raises(ValueError, match=rf"{name}: {'runs' if fn is native.deal_rows else 'piece'} must be > 0"):
            fn(good, bad)
    with pytest.raises(ValueError, match="row 0 runs past the 64-bit address space" if fn is not native.deal_rows
                       else "more than 2\\^64 bytes"):
        fn(_rows([[U64_MAX - 5, 0, 10], [0, U64_MAX - 5, U64_MAX - 3]]), 4)


def test_stripe_rows_refuses_an_absurd_piece_count_before_allocating():
    huge = _rows([[0, 0, 1 << 40]])
    with pytest.raises(ValueError, match="more than 134217728 pieces"):
        native.stripe_rows(huge, 1)
    with pytest.raises(ValueError, match="more than 134217728 pieces"):
        native.count_pieces(huge, 4096)
    with pytest.raises(ValueError, match="deal_rows: min_run_bytes must be > 0, got 0"):
        native.deal_rows(huge, 2, 0)


def test_cut_chunks_names_what_is_wrong():
    a = [0, 10]
    with pytest.raises(ValueError, match="cut_chunks: batch lengths differ: 2, 1, 2"):
        native.cut_chunks(a, [0], a, 4096, 16)
    with pytest.raises(ValueError, match="cut_chunks: local_offsets must be a 1-d int64 array"):
        native.cut_chunks([0.5, 1.5], a, a, 4096, 16)
    with pytest.raises(ValueError, match="cut_chunks: sizes must be a 1-d int64 array"):
        native.cut_chunks(a, a, [[1, 2]], 4096, 16)
    with pytest.raises(ValueError, match="chunk_bytes must be > 0, got 0"):
        native.cut_chunks(a, a, a, 0, 16)
    with pytest.raises(ValueError, match="max_pieces must be > 0, got -1"):
        native.cut_chunks(a, a, a, 4096, -1)
    with pytest.raises(ValueError, match=r"offsets and sizes must be >= 0 \(block 1\)"):
        native.cut_chunks(a, [0, -10], a, 4096, 16)
    with pytest.raises(ValueError, match="block 0 ends past 2\\^63 bytes"):
        native.cut_chunks([I64_MAX - 3], [0], [4], 4096, 16)
    with pytest.raises(ValueError, match="the blocks hold more than 2\\^63 bytes"):
        native.cut_chunks([0, 0], [0, 0], [I64_MAX, 1], 1 << 62, 16)
    with pytest.raises(ValueError, match="more than 134217728 pieces"):
        native.cut_chunks([0], [0], [1 << 40], 1, 16)
    empty = native.cut_chunks([0, 5], [0, 9], [0, 0], 4096, 16)
    assert [len(x) for x in empty] == [0, 0, 0, 0, 1]


# ---- the TCP data plane deals with the same planner ---------------------------------------------

def test_tcp_submit_stripes_deals_and_checks_with_the_planner():
    ticket = "t" * 32
    remote = np.zeros(1 << 20, dtype=np.uint8)
    local = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    target = native.TcpTarget("127.0.0.1", 0, "tok", 5.0)
    try:
        target.register_region(1, int(remote.ctypes.data), remote.nbytes)
        target.issue_ticket("init", ticket)
        peer = native.TcpPeer("target", "127.0.0.1", target.port, 3, "init", "tok", ticket, 5.0)
        try:
            # Blocks cut at 4 KiB and dealt over 3 connections: every byte lands once.
            offs = [0, 70_000, 300_001, 600_000]
            sizes = [65_536, 200_000, 1, 400_000]
            t = peer.submit(2, int(local.ctypes.data), offs, 1, offs, sizes, 7, False, 4096)
            assert t.wait(10.0) and t.code() == 0, t.message()
            for o, n in zip(offs, sizes):
                assert np.array_equal(remote[o:o + n], local[o:o + n])
            # A local address that wraps, or an absurd piece count, is refused before any send.
            with pytest.raises(ValueError, match="local address past 2\\^64"):
                peer.submit(2, U64_MAX - 10, [20], 1, [0], [1], 8, False, 4096)
            with pytest.raises(ValueError, match="row 0 runs past the 64-bit address space"):
                peer.submit(2, U64_MAX - 10, [0], 1, [0], [20], 8, False, 4096)
            with pytest.raises(ValueError, match="more than 134217728 pieces"):
                peer.submit(2, 0, [0], 1, [0], [1 << 40], 8, False, 4096)
            assert peer.healthy()
        finally:
            peer.close()
    finally:
        target.close()
