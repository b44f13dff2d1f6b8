"""The argument checks of the host side of GPU batch copies, ``mori.core.gpu.GatherLauncher`` and
the native ``memcpy_batch``, which need no GPU. The Batch value and its planner: test_batch.py."""

from __future__ import annotations

import numpy as np
import pytest

from mori.core import gpu
from mori.core._native.gpu import memcpy_batch


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
