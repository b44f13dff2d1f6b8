"""The engine's native helpers over a batch's columns (``mori.core.batch.batch_bounds``,
``int64_array``) against plain-Python references on random batches, and the argument checks of
``mori.core.gpu.GatherLauncher`` and the native ``memcpy_batch``. The Batch value and its
planner: test_batch.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core import batch, gpu
from mori.core._native.gpu import memcpy_batch

batches = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(0, 1 << 20)),
                   min_size=1, max_size=300)


def _arrays(blocks):
    return tuple(np.array(col, dtype=np.int64) for col in zip(*blocks))


@settings(max_examples=200, deadline=None)
@given(blocks=batches)
def test_batch_bounds_matches_python(blocks):
    loc, rem, siz = _arrays(blocks)
    expect = (min(min(loc), min(rem), min(siz)), max(int(a) + int(b) for a, b in zip(loc, siz)),
              max(int(a) + int(b) for a, b in zip(rem, siz)))
    assert batch.batch_bounds(loc, rem, siz) == expect
    # Non-contiguous views give the same answer (pybind11 makes them contiguous).
    assert batch.batch_bounds(loc[::-1], rem[::-1], siz[::-1]) == expect


def test_batch_bounds_rejects_bad_input():
    a = np.zeros(3, dtype=np.int64)
    with pytest.raises(ValueError, match="non-empty"):
        batch.batch_bounds(a[:0], a[:0], a[:0])
    with pytest.raises(ValueError, match="3 elements"):
        batch.batch_bounds(a[:2], a, a)
    big = np.array([2**62], dtype=np.int64)
    low, l_end, r_end = batch.batch_bounds(big, big, big)  # ends overflow int64: reported as past anything
    assert low == 2**62 and l_end == r_end == 2**63 - 1


def test_gather_launcher_refuses_null_entry_points():
    with pytest.raises(ValueError, match="null"):
        gpu.GatherLauncher(0, 1, 1, 1, 512, 264)
    with pytest.raises(ValueError, match="block shape"):
        gpu.GatherLauncher(1, 1, 1, 1, 100, 264)
    launcher = gpu.GatherLauncher(1, 1, 1, 1, 512, 264)  # never called: addresses are placeholders
    assert launcher.grid(1) == 1 and launcher.grid(16) == 1 and launcher.grid(17) == 2
    assert launcher.grid(10**9) == 264


def test_memcpy_batch_checks_its_arguments_before_any_call():
    a = np.arange(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="null entry point"):
        memcpy_batch(0, a, a, a, 0)
    with pytest.raises(ValueError, match="one non-zero length"):
        memcpy_batch(1, a[:3], a, a, 0)  # never called: the lengths are checked first
    with pytest.raises(ValueError, match="one non-zero length"):
        memcpy_batch(1, a[:0], a[:0], a[:0], 0)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=500))
def test_int64_array_takes_ints_as_operator_index_does(values):
    out = batch.int64_array(values, "sizes")
    assert out.dtype == np.int64 and out.tolist() == values
    assert batch.int64_array(tuple(values), "sizes").tolist() == values


def test_int64_array_names_what_is_wrong():
    assert batch.int64_array([1, np.int32(-5), np.uint8(7)], "x").tolist() == [1, -5, 7]
    with pytest.raises(TypeError, match="offsets must be ints, got bool at index 1"):  # issue 11
        batch.int64_array([0, True], "offsets")
    with pytest.raises(TypeError, match=r"local offsets must be a sequence of ints, got float at index 1"):
        batch.int64_array([1, 2.0], "local offsets")
    with pytest.raises(TypeError, match="got str at index 0"):
        batch.int64_array(["1"], "sizes")
    with pytest.raises(ValueError, match=r"sizes\[2\] does not fit in 64 bits"):
        batch.int64_array([0, 1, 2**63], "sizes")
    with pytest.raises(TypeError):
        batch.int64_array(5, "sizes")
