"""``python -m mori.umbp.bench`` runs (mori alone, small): its roles in two namespaces, its
checks of every byte, and its table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_benchmark_runs(tmp_path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "mori.umbp.bench", "--sizes", "16K,64K", "--pages", "8",
                           "--iters", "2", "--exists", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "batch_exists of 64 keys" in proc.stdout and "get that hits SSD, 64K page" in proc.stdout
    (mori,) = json.loads(out.read_text())
    assert mori["engine"] == "mori" and [p["size"] for p in mori["points"]] == [16 << 10, 64 << 10]
    assert all(p["put_ms"] > 0 and p["get_ms"] > 0 for p in mori["points"]) and mori["exists_ms"] > 0
