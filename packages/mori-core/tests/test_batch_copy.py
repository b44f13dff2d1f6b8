"""The native batch helpers of GPU transfers (``batch_bounds``, ``int64_array``, and the checks
of ``GatherLauncher`` and ``memcpy_batch``), against plain-Python references on random batches.
The batch planner (``gather_rows`` and the rest): test_batch_plan.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core import _native

batches = st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(0, 1 << 20)),
                   min_size=1, max_size=300)


def _arrays(batch):
    return tuple(np.array(col, dtype=np.int64) for col in zip(*batch))


@settings(max_examples=200, deadline=None)
@given(batch=batches)
def test_batch_bounds_matches_python(batch):
    loc, rem, siz = _arrays(batch)
    expect = (min(min(loc), min(rem), min(siz)), max(int(a) + int(b) for a, b in zip(loc, siz)),
              max(int(a) + int(b) for a, b in zip(rem, siz)))
    assert _native.batch_bounds(loc, rem, siz) == expect
    # Non-contiguous views give the same answer (pybind11 makes them contiguous).
    assert _native.batch_bounds(loc[::-1], rem[::-1], siz[::-1]) == expect


def test_batch_bounds_rejects_bad_input():
    a = np.zeros(3, dtype=np.int64)
    with pytest.raises(ValueError, match="non-empty"):
        _native.batch_bounds(a[:0], a[:0], a[:0])
    with pytest.raises(ValueError, match="3 elements"):
        _native.batch_bounds(a[:2], a, a)
    big = np.array([2**62], dtype=np.int64)
    low, l_end, r_end = _native.batch_bounds(big, big, big)  # ends overflow int64: reported as past anything
    assert low == 2**62 and l_end == r_end == 2**63 - 1


def test_gather_launcher_refuses_null_entry_points():
    with pytest.raises(ValueError, match="null"):
        _native.GatherLauncher(0, 1, 1, 1, 512, 264)
    with pytest.raises(ValueError, match="block shape"):
        _native.GatherLauncher(1, 1, 1, 1, 100, 264)
    launcher = _native.GatherLauncher(1, 1, 1, 1, 512, 264)  # never called: addresses are placeholders
    assert launcher.grid(1) == 1 and launcher.grid(16) == 1 and launcher.grid(17) == 2
    assert launcher.grid(10**9) == 264


def test_memcpy_batch_checks_its_arguments_before_any_call():
    a = np.arange(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="null entry point"):
        _native.memcpy_batch(0, a, a, a, 0)
    with pytest.raises(ValueError, match="one non-zero length"):
        _native.memcpy_batch(1, a[:3], a, a, 0)  # never called: the lengths are checked first
    with pytest.raises(ValueError, match="one non-zero length"):
        _native.memcpy_batch(1, a[:0], a[:0], a[:0], 0)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=500))
def test_int64_array_takes_ints_as_operator_index_does(values):
    out = _native.int64_array(values, "sizes")
    assert out.dtype == np.int64 and out.tolist() == values
    assert _native.int64_array(tuple(values), "sizes").tolist() == values


def test_int64_array_names_what_is_wrong():
    assert _native.int64_array([1, np.int32(-5), np.uint8(7)], "x").tolist() == [1, -5, 7]
    with pytest.raises(TypeError, match="offsets must be ints, got bool at index 1"):  # issue 11
        _native.int64_array([0, True], "offsets")
    with pytest.raises(TypeError, match=r"local offsets must be a sequence of ints, got float at index 1"):
        _native.int64_array([1, 2.0], "local offsets")
    with pytest.raises(TypeError, match="got str at index 0"):
        _native.int64_array(["1"], "sizes")
    with pytest.raises(ValueError, match=r"sizes\[2\] does not fit in 64 bits"):
        _native.int64_array([0, 1, 2**63], "sizes")
    with pytest.raises(TypeError):
        _native.int64_array(5, "sizes")
