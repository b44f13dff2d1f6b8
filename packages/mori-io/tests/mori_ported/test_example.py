"""Runs MORI's ``examples/io/example.py`` (ported beside this file) as its ``__main__`` would."""

from __future__ import annotations

import runpy
from pathlib import Path


def test_mori_io_example_runs() -> None:
    runpy.run_path(str(Path(__file__).with_name("example.py")), run_name="__main__")
