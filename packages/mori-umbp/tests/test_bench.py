"""``mori-umbp-bench`` at tiny sizes, mori alone (CI has no Mooncake): three network namespaces,
every point run (two rounds), or the SSD gets alone, and its bytes checked by the benchmark
itself, so it does not rot.
Needs root and iproute2, as CI has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _bench(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    """Runs mori-umbp-bench on mori alone at tiny sizes; its JSON and its stdout."""
    script = Path(sys.executable).with_name("mori-umbp-bench")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            str(script),
            "--pages",
            "4",
            "--exists-keys",
            "10",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--peers",
            "",
            "--ssd-dir",
            str(tmp_path),
            "--json",
            str(out),
            "--logs",
            str(tmp_path / "logs"),
            "--timeout",
            "120",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_bench_runs_every_point_for_mori(tmp_path: Path) -> None:
    result, stdout = _bench(tmp_path, "--sizes", "4K,16K", "--rounds", "2")
    rows = {row["point"]: row for row in result["results"]["mori"]}
    expected = [f"{op} 4 × {size}" for size in ("4 KiB", "16 KiB") for op in ("put", "get")]
    expected += [f"SSD get {n} × {size}" for size in ("4 KiB", "16 KiB") for n in (1, 4)]
    expected.append("batch_exists 10 keys")
    assert sorted(rows) == sorted(expected) and len(result["rounds"]) == 2
    for row in rows.values():
        assert row["iters"] == 2 and row["median_us"] > 0 and len(row["round_medians_us"]) == 2
    assert rows["get 4 × 16 KiB"]["gbps"] > 0 and rows["batch_exists 10 keys"]["gbps"] is None
    assert "| get 4 × 16 KiB |" in stdout and "Mooncake" not in stdout


@pytest.mark.slow
def test_bench_runs_the_ssd_points_alone(tmp_path: Path) -> None:
    result, stdout = _bench(tmp_path, "--sizes", "16K", "--points", "ssd")
    points = [row["point"] for row in result["results"]["mori"]]
    assert points == ["SSD get 1 × 16 KiB", "SSD get 4 × 16 KiB"] and result["plan"]["groups"] == ["ssd"]
    assert "| SSD get 4 × 16 KiB |" in stdout and "| get 4 × 16 KiB |" not in stdout
