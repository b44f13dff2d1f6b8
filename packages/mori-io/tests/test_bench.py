"""The benchmark CLI end to end (two processes over loopback), with tiny sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mori.core import testing
from mori.io.bench import main, parse_args


def test_bench_json_plot_and_table(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(
        [
            "--op",
            "read",
            "--session",
            "--sizes",
            "4K,64K",
            "--batch-sizes",
            "1,8",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--num-connections",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["size"], r["batch"]) for r in rows} == {(4096, 1), (65536, 1), (4096, 8), (65536, 8)}
    for r in rows:
        assert r["engine"] == "mori" and r["op"] == "read" and r["iters"] == 3
        assert r["max_bw_gbs"] >= r["avg_bw_gbs"] > 0 and r["avg_lat_us"] >= r["min_lat_us"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "MaxBW GB/s" in table and "AvgLat us" in table


def test_bench_rdma_backend_takes_mori_s_qp_and_worker_arguments(tmp_path, monkeypatch):
    """``--num-qp-per-transfer`` and ``--num-worker-threads`` reach the RDMA backend of both
    processes (MORI's benchmark's names); 1 MiB reads spread over two workers, over UCX's tcp."""
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    out = tmp_path / "b.json"
    rc = main(
        [
            "--backend",
            "rdma",
            "--op",
            "read",
            "--sizes",
            "1M",
            "--batch-sizes",
            "1,3",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--num-qp-per-transfer",
            "2",
            "--num-worker-threads",
            "2",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["args"]["num_qp_per_transfer"] == 2 and report["args"]["num_worker_threads"] == 2
    assert {(r["engine"], r["size"], r["batch"]) for r in report["rows"]} == {
        ("mori-rdma", 1 << 20, 1),
        ("mori-rdma", 1 << 20, 3),
    }
    with pytest.raises(SystemExit):
        parse_args(["--num-worker-threads", "x"])


def test_bench_without_tqdm_reports_skipped_points_and_typed_json(tmp_path, capsys, monkeypatch):
    """A plain mori-io install: no tqdm (``--no-progress`` must not need it); points over
    ``--max-bytes`` are named; the JSON keeps numbers as numbers."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    out = tmp_path / "b.json"
    rc = main(
        [
            "--sizes",
            "4K,64K",
            "--batch-sizes",
            "1,4",
            "--max-bytes",
            "64K",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "note: skipped (size x batch over --max-bytes 65536): 65536x4" in printed
    report = json.loads(out.read_text())
    assert {(r["size"], r["batch"]) for r in report["rows"]} == {(4096, 1), (65536, 1), (4096, 4)}
    assert report["args"]["sizes"] == [4096, 65536] and report["args"]["iters"] == 2
    assert report["args"]["no_progress"] is True and report["args"]["json"] == str(out)
    assert any("65536x4" in n for n in report["notes"])
    # Progress wanted but tqdm missing: the run goes on without a bar and says why.
    assert main(["--sizes", "4K", "--iters", "1", "--warmup", "0"]) == 0
    assert "tqdm is not installed" in capsys.readouterr().err


def test_bench_reports_a_peer_that_cannot_run(tmp_path, capsys):
    # An interpreter without the peer installed: the row is missing and a note says why.
    rc = main(
        [
            "--sizes",
            "4K",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--peers",
            "mooncake",
            "--peer-python",
            "/bin/false",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "note: mooncake" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--sizes", "0"], ["--sizes", "big"], ["--batch-sizes", "x"], ["--peers", "ucx"], ["--iters", "0"]]
)
def test_bench_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_targets_pin_themselves_to_mori_bench_target_cpus():
    # In a child process, as a target runs: pinned to the listed CPU; without the setting, untouched.
    import os
    import subprocess

    cpu = max(os.sched_getaffinity(0))
    probe = (
        "import os; from mori.io.bench._measure import pin_target; pin_target(); print(sorted(os.sched_getaffinity(0)))"
    )
    pinned = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "MORI_BENCH_TARGET_CPUS": str(cpu)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert pinned.stdout.strip() == f"[{cpu}]"
    env = {k: v for k, v in os.environ.items() if k != "MORI_BENCH_TARGET_CPUS"}
    free = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert free.stdout.strip() == str(sorted(os.sched_getaffinity(0)))


def test_bench_gpu_memory_without_a_gpu_says_so_before_starting_anything(monkeypatch):
    """``--mem-type gpu`` (MORI's flag) where torch sees no GPU, or is missing: one clear message,
    before any process starts."""
    import importlib.util

    argv = ["--mem-type", "gpu", "--sizes", "4K", "--iters", "1", "--no-progress"]
    if importlib.util.find_spec("torch") is not None:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(SystemExit, match="--mem-type gpu: torch sees no CUDA GPU"):
            main(argv)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(SystemExit, match="--mem-type gpu needs torch"):
        main(argv)
    assert parse_args(["--mem-type", "gpu"]).mem_type == "gpu" and parse_args([]).mem_type == "cpu"
    with pytest.raises(SystemExit):
        parse_args(["--mem-type", "hbm"])


def test_fan_in_measures_one_and_many_initiators_per_backend(tmp_path, monkeypatch, capsys):
    """``--fan-in 2``: per backend (TCP, and the RDMA backend kept on UCX's tcp), one target with
    one initiator and with two at once, their aggregate GB/s and ratio in the table and JSON."""
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    out = tmp_path / "f.json"
    rc = main(
        [
            "--fan-in",
            "2",
            "--backend",
            "tcp,rdma-ucx",
            "--sizes",
            "4K",
            "--batch-sizes",
            "4",
            "--iters",
            "5",
            "--warmup",
            "1",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["initiators"], r["size"], r["batch"]) for r in rows] == [
        ("mori", 2, 4096, 4),
        ("mori-rdma-ucx", 2, 4096, 4),
    ]
    for r in rows:
        assert r["one_gbs"] > 0 and r["fan_in_gbs"] > 0 and r["ratio"] == pytest.approx(r["fan_in_gbs"] / r["one_gbs"])
    assert "2 init GB/s" in capsys.readouterr().out
    assert parse_args(["--fan-in", "3"]).fan_in == 3
    with pytest.raises(SystemExit):
        parse_args(["--fan-in", "2", "--peers", "nixl"])


def test_fan_in_with_the_target_in_another_namespace(tmp_path):
    """``--fan-in 2 --target-netns``: the target serves from a second network namespace on its own
    address, the initiators reach it over the veth pair, as from another host."""
    out = tmp_path / "f.json"
    with testing.network_namespaces() as (a, b):
        cmd = ["ip", "netns", "exec", a.name, sys.executable, "-m", "mori.io.bench", "--fan-in", "2"]
        cmd += ["--backend", "tcp,rdma", "--sizes", "4K", "--batch-sizes", "4", "--iters", "5", "--warmup", "1"]
        cmd += ["--host", a.address, "--target-host", b.address, "--target-netns", b.name]
        cmd += ["--json", str(out), "--no-progress"]
        run = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "MORI_IO_RDMA_TRANSPORTS": "tcp"}
        )
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["initiators"]) for r in rows] == [("mori", 2), ("mori-rdma", 2)]
    assert all(r["one_gbs"] > 0 and r["fan_in_gbs"] > 0 for r in rows)
