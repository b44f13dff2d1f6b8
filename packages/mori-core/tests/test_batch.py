"""mori.core.batch.Batch (csrc/batch/batch.hpp, batch/plan.hpp, batch/bindings.cpp) against
plain-Python references on random batches: built from lists, tuples, numpy arrays of every integer
width (strided views too) and other buffers, merged; every verb (rebased, stripe, count_pieces,
deal, cut_chunks); rows read
in place; every bad input refused with an error naming it; the TCP data plane's use of it."""

from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core import tcp
from mori.core.batch import Batch

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
    return [rows[a:b] for a, b in zip(bounds, bounds[1:])]


def _chunks(local, remote, sizes, chunk_bytes, max_pieces):
    """Chunks as lists of [local, remote, size], cut, merged and split as documented."""
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
        out[-1].append([lo, ro, n])
    return out


def _rows(batch: Batch) -> list[list[int]]:
    return [list(r) for r in batch]


# Each column given in one of the forms a caller may have.
FORMS = {
    "list": list,
    "tuple": tuple,
    "int64": lambda v: np.array(v, dtype=np.int64),
    "uint64": lambda v: np.array(v, dtype=np.uint64),
    "int32": lambda v: np.array(v, dtype=np.int32),
    "uint16": lambda v: np.array(v, dtype=np.uint16),
    "strided": lambda v: np.repeat(np.array(v, dtype=np.int64), 2)[::2],  # a view, not contiguous
    "reversed": lambda v: np.array(v[::-1], dtype=np.uint64)[::-1],  # a negative stride
    "row column": lambda v: np.stack([v, v, v], axis=1).astype(np.int64)[:, 1],  # a column of (n, 3) rows
    "array.array": lambda v: array.array("q", v),
    "memoryview": lambda v: memoryview(array.array("Q", v)),
}


def _fits(form: str, values: list[int]) -> bool:
    top = max(values, default=0)
    return top < {"int32": 2**31, "uint16": 2**16}.get(form, 2**63)


def _blocks(rng: np.random.Generator, n: int, contiguous: float, small: bool):
    """Blocks that often continue the previous one on both sides, sometimes on one side only."""
    scale = 1 << 12 if small else 1 << 30
    sz = (rng.integers(0, 5, n) * rng.choice([1, 7, 4096], n)).tolist()
    so, do = [0] * n, [0] * n
    for i in range(1, n):
        joined = rng.random() < contiguous
        so[i] = so[i - 1] + sz[i - 1] if joined else int(rng.integers(0, scale))
        do[i] = do[i - 1] + sz[i - 1] if joined and rng.random() < 0.9 else int(rng.integers(0, scale))
    return so, do, sz


# ---- building -----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(0, 120),
    contiguous=st.floats(0, 1),
    small=st.booleans(),
    bases=st.tuples(st.integers(0, 1 << 48), st.integers(0, 1 << 48)) | st.just((0, 0)),
)
def test_built_from_any_column_form_matches_python(data, n, contiguous, small, bases):
    so, do, sz = _blocks(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), n, contiguous, small)
    columns = []
    for values in (so, do, sz):
        form = data.draw(st.sampled_from([f for f in FORMS if _fits(f, values)]))
        columns.append(FORMS[form](values))
    b = Batch(*columns, *bases)
    expect = _merged(*bases, so, do, sz)
    assert _rows(b) == expect and len(b) == len(expect)
    sizes = [r[2] for r in expect]
    assert b.total_bytes == sum(sizes)
    assert (b.largest, b.smallest) == ((max(sizes), min(sizes)) if sizes else (0, 0))
    assert b.src_end == max((s + k for s, _, k in expect), default=0)
    assert b.dst_end == max((d + k for _, d, k in expect), default=0)
    assert b == Batch(so, do, sz, *bases)  # every form gives the same value


def test_rows_read_in_place():
    b = Batch([0, 100, 4096], [8, 108, 0], [100, 28, 1])  # the first two merge
    assert list(b) == [(0, 8, 128), (4096, 0, 1)] and b[0] == (0, 8, 128) and b[-1] == (4096, 0, 1)
    with pytest.raises(IndexError):
        b[2]
    rows = np.asarray(b)
    assert rows.dtype == np.uint64 and rows.shape == (2, 3) and rows.tolist() == [[0, 8, 128], [4096, 0, 1]]
    assert not rows.flags.writeable and np.shares_memory(rows, np.asarray(b))  # a view, read-only
    with pytest.raises(ValueError):
        rows[0, 0] = 1
    view = memoryview(b)
    assert view.readonly and view.format == "Q" and view.shape == (2, 3) and view.tolist() == rows.tolist()
    assert b[1:] == Batch([4096], [0], [1]) and b[:0] == Batch([], [], []) and len(b[5:]) == 0
    with pytest.raises(ValueError, match="step 1"):
        b[::2]
    assert repr(b) == "Batch(2 rows, 129 bytes)" and repr(b[:1]) == "Batch(1 row, 128 bytes: src 0, dst 8)"
    empty = Batch((), (), ())
    assert len(empty) == 0 and np.asarray(empty).shape == (0, 3) and empty.total_bytes == empty.largest == 0
    assert b != empty and b != [(0, 8, 128), (4096, 0, 1)]


def test_built_into_a_callers_table():
    # The rows land in out (a pinned table, say) and the batch reads them there, keeping it alive.
    table = np.full((8, 3), 7, dtype=np.uint64)
    b = Batch([0, 10, 50], [0, 10, 90], [10, 5, 5], 100, 200, table)
    assert list(b) == [(100, 200, 15), (150, 290, 5)] and table[:2].tolist() == [[100, 200, 15], [150, 290, 5]]
    assert np.shares_memory(np.asarray(b), table) and (table[2:] == 7).all()  # nothing past the rows
    del table
    assert b[1] == (150, 290, 5)
    # Any writable buffer of uint64 rows will do, numpy or not.
    raw = array.array("Q", [0] * 12)
    assert list(Batch([0, 4], [8, 0], [4, 4], 0, 0, memoryview(raw).cast("B").cast("Q", [4, 3]))) == [
        (0, 8, 4),
        (4, 0, 4),
    ]
    assert raw.tolist()[:6] == [0, 8, 4, 4, 0, 4]
    frozen = np.zeros((8, 3), dtype=np.uint64)
    frozen.flags.writeable = False
    for out in (
        np.zeros((2, 3), dtype=np.uint64),
        np.zeros((8, 3), dtype=np.int64),
        np.zeros((8, 2), dtype=np.uint64),
        np.asfortranarray(np.zeros((8, 3), dtype=np.uint64)),
        np.zeros((16, 3), dtype=np.uint64)[::2],
        frozen,
        np.zeros(24, dtype=np.uint64),
        bytearray(200),
        memoryview(raw),
        "table",
    ):
        with pytest.raises(
            ValueError, match=r"^Batch: out must be a writable C-contiguous uint64 array of \(>= 3, 3\)"
        ):
            Batch([0, 10, 50], [0, 10, 90], [10, 5, 5], 0, 0, out)


def test_one_block_forms_agree():
    assert Batch.one(1 << 40, 4096, 4096) == Batch([0], [4096], [4096], 1 << 40) == Batch([1 << 40], [4096], [4096])
    assert len(Batch.one(5, 5, 0)) == 0 and len(Batch([5], [5], [0])) == 0
    assert Batch.one(U64_MAX - 10, 0, 10)[0] == (U64_MAX - 10, 0, 10)  # the last byte below 2^64 - 1
    assert Batch([2**63], [0], [2**62]) == Batch.one(2**63, 0, 2**62)  # values past int64 in lists
    assert Batch(range(0, 300, 100), range(3), [100, 100, 100])[0] == (0, 0, 100)  # any sequence


class _Shrinking:
    """An int whose __index__ empties a list (the batch's own column, say) when called."""

    def __init__(self, value: int, victim: list[int]) -> None:
        self.value, self.victim = value, victim

    def __index__(self) -> int:
        self.victim.clear()
        return self.value


def test_lists_of_any_ints_are_read_as_rows():
    # Ints past 2^62 and objects with __index__ (numpy scalars) take the slow path, in lists too.
    big = 2**63 + 5
    assert list(Batch([np.int64(4), big], [0, np.uint64(8)], (np.int32(4), 3))) == [(4, 0, 4), (big, 8, 3)]
    # A column that an __index__ method changes while the batch is read: refused, never read past.
    for column in range(3):
        cols: list[list] = [[0, 8, 16], [0, 8, 16], [8, 8, 8]]
        cols[column][1] = _Shrinking(8, cols[(column + 1) % 3])
        with pytest.raises(ValueError, match=r"changed length while it was read"):
            Batch(*cols)
    mixed = [0, _Shrinking(8, []), 16]
    assert list(Batch(mixed, mixed, [8, 8, 8])) == [(0, 0, 24)]


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(0, 60),
    reverse=st.booleans(),
    into=st.booleans(),
    by=st.tuples(st.integers(0, 1 << 48), st.integers(0, 1 << 48)),
)
def test_rebased_matches_python(data, n, reverse, into, by):
    so, do, sz = _blocks(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), n, 0.5, small=True)
    b = Batch(so, do, sz, 4096, 0)
    table = np.full((n + 2, 3), 7, dtype=np.uint64)
    moved = b.rebased(*by, reverse, table if into else None)
    expect = [[(d if reverse else s) + by[0], (s if reverse else d) + by[1], k] for s, d, k in _rows(b)]
    assert _rows(moved) == expect and _rows(b) == _merged(4096, 0, so, do, sz)  # b unchanged
    assert (moved.largest, moved.smallest, moved.total_bytes) == (b.largest, b.smallest, b.total_bytes)
    assert moved.src_end == max((s + k for s, _, k in expect), default=0)
    assert moved.dst_end == max((d + k for _, d, k in expect), default=0)
    if into:  # written into the table, read there; nothing past the rows
        assert np.shares_memory(np.asarray(moved), table) or not expect
        assert table[: len(expect)].tolist() == expect and (table[len(expect) :] == 7).all()
    assert moved == Batch([r[0] for r in expect], [r[1] for r in expect], [r[2] for r in expect])


def test_rebased_refuses_rows_past_2_64():
    b = Batch([0, 100], [50, 0], [10, 20])
    assert b.rebased(U64_MAX - 120, U64_MAX - 60)[1] == (U64_MAX - 20, U64_MAX - 60, 20)  # ends at 2^64 - 1
    for args in ((U64_MAX - 119, 0), (0, U64_MAX - 59), (U64_MAX - 59, 0, True)):
        with pytest.raises(ValueError, match="^Batch.rebased: the rows, rebased, run past the 64-bit address space$"):
            b.rebased(*args)
    with pytest.raises(ValueError, match=r"^Batch: out must be a writable C-contiguous uint64 array of \(>= 2, 3\)"):
        b.rebased(1, 1, False, np.zeros((1, 3), dtype=np.uint64))
    with pytest.raises(TypeError):
        b.rebased(-1)
    assert Batch([], [], []).rebased(U64_MAX, U64_MAX, True) == Batch([], [], [])


def test_large_batch_is_planned_like_a_small_one():
    # 20000 rows: merged without the GIL (from 16384 rows), the same rows as the reference.
    rng = np.random.default_rng(5)
    so, do, sz = _blocks(rng, 20000, 0.3, small=False)
    b = Batch(np.array(so), np.array(do), np.array(sz))
    assert _rows(b) == _merged(0, 0, so, do, sz) and b == Batch(so, do, sz)
    assert b.rebased(1, 2, True) == Batch(do, so, sz, 1, 2)
    assert b.stripe(4096).count_pieces(4096) == len(b.stripe(4096)) == b.count_pieces(4096)


# ---- the verbs ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(data=st.data(), piece=st.integers(1, 1 << 21) | st.sampled_from([1, 7, 4096]))
def test_stripe_and_count_pieces_match_python(data, piece):
    # Rows of up to 40 pieces (or a few bytes), anywhere below 2^50.
    blocks = data.draw(
        st.lists(
            st.tuples(st.integers(0, 1 << 50), st.integers(0, 1 << 50), st.integers(0, 3) | st.integers(0, 40 * piece)),
            max_size=80,
        )
    )
    b = Batch(*zip(*blocks)) if blocks else Batch([], [], [])
    rows = _rows(b)
    cut = b.stripe(piece)
    assert _rows(cut) == _striped(rows, piece) and cut.total_bytes == b.total_bytes
    assert b.count_pieces(piece) == len(cut)
    if all(n <= piece for _, _, n in rows):
        assert cut is b  # nothing to cut: the batch itself


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5) | st.integers(1, 1 << 30), max_size=100),
    runs=st.integers(1, 70),
    min_run_bytes=st.integers(1, 4) | st.integers(1, 1 << 31),
)
def test_deal_matches_python(sizes, runs, min_run_bytes):
    b = Batch([i << 32 for i in range(len(sizes))], list(range(len(sizes))), sizes)  # no two rows merge
    rows = _rows(b)
    dealt = b.deal(runs, min_run_bytes)
    assert all(isinstance(r, Batch) for r in dealt)
    assert [_rows(r) for r in dealt] == _dealt(rows, runs, min_run_bytes)
    # Contiguous, non-empty runs covering every row; each holds at most a fair share plus one row.
    assert sum((_rows(r) for r in dealt), []) == rows and all(len(r) for r in dealt) and len(dealt) <= runs
    total = sum(sizes)
    used = max(1, min(runs, -(-total // min_run_bytes)))
    assert all(r.total_bytes <= total / used + max(sizes) for r in dealt)


def test_deal_balances_equal_pieces_exactly():
    b = Batch([i << 24 for i in range(32)], [i << 24 for i in range(32)][::-1], [8 << 20] * 32)
    assert [len(r) for r in b.deal(8)] == [4] * 8
    assert [len(r) for r in b.deal(8, 128 << 20)] == [16, 16]  # at least 128 MiB a run
    assert [len(r) for r in b[:3].deal(8)] == [1, 1, 1]  # no more runs than rows
    assert b[:0].deal(8) == []


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.integers(0, 700)), max_size=40),
    chunk=st.integers(1, 1024),
    max_pieces=st.integers(1, 8),
    contiguous=st.booleans(),
)
def test_cut_chunks_matches_python(blocks, chunk, max_pieces, contiguous):
    if contiguous:  # runs that continue on both sides, so that merging is exercised
        starts = np.cumsum([0] + [n for _, _, n in blocks])[:-1].tolist()
        blocks = [(s, s, n) for s, (_, _, n) in zip(starts, blocks)]
    local, remote, sizes = ([b[i] for b in blocks] for i in range(3))
    chunks = Batch(local, remote, sizes).cut_chunks(chunk, max_pieces)
    assert [_rows(c) for c in chunks] == _chunks(local, remote, sizes, chunk, max_pieces)
    assert all(0 < c.total_bytes <= chunk and 0 < len(c) <= max_pieces for c in chunks)


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("column", ["src_offsets", "dst_offsets", "sizes"])
def test_every_bad_column_is_named(column):
    def build(bad, n=2, **kw):
        cols = {"src_offsets": [0, 8192][:n], "dst_offsets": [0, 8192][:n], "sizes": [4096, 4096][:n]}
        cols[column] = bad
        return Batch(cols["src_offsets"], cols["dst_offsets"], cols["sizes"], **kw)

    at = column.replace("[", r"\[")
    for bad in ([0, -5], (0, -5), np.array([0, -5]), np.array([0, -5], dtype=np.int8), array.array("i", [0, -5])):
        with pytest.raises(ValueError, match=rf"^Batch: {at}\[1\] is negative \(-5\)$"):
            build(bad)
    with pytest.raises(ValueError, match=rf"^Batch: {at}\[1\] = 18446744073709551616 does not fit in 64 bits$"):
        build([0, 2**64])
    with pytest.raises(ValueError, match=r"^Batch: lengths differ: "):
        build([0, 1, 2])
    with pytest.raises(ValueError, match=rf"^Batch: {at} must be 1-d, got 2 dimensions$"):
        build(np.zeros((2, 1), dtype=np.int64))
    for bad, what in (
        ([0, 1.5], "got float at index 1"),
        ([0, True], "got bool at index 1"),
        ([0, "1"], "got str at index 1"),
        ([None, 0], "got NoneType at index 0"),
        ({0, 1}, "or an integer array, got set"),
        ("01", "or an integer array, got str"),
        (5, "or an integer array, got int"),
        (np.zeros(2), "must hold integers, got buffer format 'd'"),
        (np.zeros(2, dtype=bool), "must hold integers, got buffer format '?'"),
        (np.zeros(2, dtype=">i8"), "byte order"),
    ):
        with pytest.raises(TypeError, match=rf"^Batch: {at}.*{what}"):
            build(bad)


def test_blocks_past_2_64_and_overfull_batches_are_refused():
    with pytest.raises(
        ValueError, match=r"block 0 \(src_base \+ src_offsets\[0\] \+ sizes\[0\]\) runs past the 64-bit"
    ):
        Batch([10], [0], [1], U64_MAX - 10)
    with pytest.raises(ValueError, match=r"block 1 \(dst_base \+ dst_offsets\[1\] \+ sizes\[1\]\) runs past"):
        Batch([0, 0], [0, U64_MAX - 3], [1, 4])
    with pytest.raises(ValueError, match=r"block 0 \(src_base"):
        Batch(np.array([2**63], dtype=np.uint64), [0], [2**63])  # uint64 values: no wrap either
    with pytest.raises(ValueError, match=r"block 0 \(dst_base"):
        Batch([0], [2], [1], 0, U64_MAX - 1)
    with pytest.raises(ValueError, match="the rows hold more than 2\\^64 - 1 bytes"):
        Batch([0, 0], [0, 0], [2**63, 2**63])  # two rows over the same bytes
    with pytest.raises(ValueError, match="Batch.one: the block runs past the 64-bit address space"):
        Batch.one(U64_MAX, 0, 1)
    with pytest.raises(TypeError):
        Batch.one(-1, 0, 1)


def test_verbs_name_what_is_wrong():
    b = Batch([0], [0], [1 << 40])
    for verb, args, text in (
        (b.stripe, (0,), "Batch.stripe: piece must be > 0, got 0"),
        (b.count_pieces, (-1,), "Batch.count_pieces: piece must be > 0, got -1"),
        (b.deal, (0,), "Batch.deal: runs must be > 0, got 0"),
        (b.deal, (2, 0), "Batch.deal: min_run_bytes must be > 0, got 0"),
        (b.cut_chunks, (0, 16), "Batch.cut_chunks: chunk_bytes must be > 0, got 0"),
        (b.cut_chunks, (4096, -1), "Batch.cut_chunks: max_pieces must be > 0, got -1"),
    ):
        with pytest.raises(ValueError, match=f"^{text}$"):
            verb(*args)
    # An absurd piece count is refused before anything is allocated.
    with pytest.raises(ValueError, match="^Batch.stripe: cutting .* more than 134217728 pieces$"):
        b.stripe(1)
    with pytest.raises(ValueError, match="^Batch.count_pieces: .*more than 134217728 pieces$"):
        b.count_pieces(4096)
    with pytest.raises(ValueError, match="^Batch.cut_chunks: .*more than 134217728 pieces$"):
        b.cut_chunks(1, 16)
    assert len(b) == 1 and b[0] == (0, 0, 1 << 40)  # nothing changed


def test_a_batch_is_immutable():
    b = Batch([0], [0], [10])
    for name in ("total_bytes", "largest", "src_end"):
        with pytest.raises(AttributeError):
            setattr(b, name, 1)
    with pytest.raises(TypeError):
        b[0] = (1, 2, 3)  # type: ignore[index]
    assert b[0] == (0, 0, 10)


# ---- the TCP data plane takes a Batch -----------------------------------------------------------


def test_tcp_submit_stripes_and_deals_a_batch():
    ticket = "t" * 32
    remote = np.zeros(1 << 20, dtype=np.uint8)
    local = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    target = tcp.Target("127.0.0.1", 0, "tok", 5.0)
    try:
        target.register_region(1, int(remote.ctypes.data), remote.nbytes)
        target.issue_ticket("init", ticket)
        peer = tcp.Peer("target", "127.0.0.1", target.port, 3, "init", "tok", ticket, 5.0)
        try:
            # Blocks cut at 4 KiB and dealt over 3 connections: every byte lands once.
            offs = [0, 70_000, 300_001, 600_000]
            sizes = [65_536, 200_000, 1, 400_000]
            t = peer.submit(2, Batch(offs, offs, sizes, int(local.ctypes.data)), 1, 7, False, 4096)
            assert t.wait(10) and t.code() == 0, t.message()
            for o, n in zip(offs, sizes):
                assert np.array_equal(remote[o : o + n], local[o : o + n])
            assert not remote[65_536:70_000].any()  # nothing between the blocks
            # An empty batch finishes at once; an absurd piece count is refused before any send.
            t = peer.submit(2, Batch([], [], []), 1, 8, False, 4096)
            assert t.wait(0) and t.code() == 0
            with pytest.raises(ValueError, match="more than 134217728 pieces"):
                peer.submit(2, Batch([0], [0], [1 << 40]), 1, 9, False, 4096)
            with pytest.raises(ValueError, match="op must be read"):
                peer.submit(3, Batch([0], [0], [1]), 1, 9, False, 4096)
            assert peer.healthy()
        finally:
            peer.close()
    finally:
        target.close()
