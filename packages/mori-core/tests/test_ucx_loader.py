"""Which UCX mori.core.ucx loads: Debian's verbs-enabled UCX by default (ci/setup.sh installs
it), the one MORI_UCX_LIB names, or a clear error naming what was tried. Each case runs in a fresh
process: a process holds one UCX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _ucx_procs import DEBIAN_UCX, wheel_ucx

from mori.core import ucx

REPORT = """
import json
from mori.core import ucx
info = ucx.load()
print(json.dumps(info))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("MORI_UCX", "UCX_"))}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=full)


def _report(**env: str) -> dict:
    proc = _run(REPORT, **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_debian_ucx_is_installed_with_verbs() -> None:
    assert (Path(DEBIAN_UCX) / "libucp.so.0").exists(), "ci/setup.sh installs Debian's libucx0"
    assert ucx.has_verbs(DEBIAN_UCX)
    assert not ucx.has_verbs(wheel_ucx()), "PyPI's libucx is built without verbs"


def test_candidates_prefer_a_system_ucx_with_verbs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORI_UCX_LIB", raising=False)
    found = ucx.candidates()
    assert found[0] == (f"{DEBIAN_UCX}/libucp.so.0", "system UCX with verbs")
    assert [src for _, src in found].index("libucx wheel") == 1
    monkeypatch.setenv("MORI_UCX_LIB", "/opt/elsewhere/lib")
    assert ucx.candidates() == [("/opt/elsewhere/lib/libucp.so.0", "MORI_UCX_LIB")]
    monkeypatch.setenv("MORI_UCX_LIB", "/opt/elsewhere/lib/libucp.so")
    assert ucx.candidates() == [("/opt/elsewhere/lib/libucp.so", "MORI_UCX_LIB")]


def test_default_loads_debian_ucx_and_reports_its_verbs_components() -> None:
    info = _report()
    assert info["path"] == f"{DEBIAN_UCX}/libucp.so.0" and info["source"] == "system UCX with verbs"
    assert info["version"][:2] == [1, 13]
    assert info["verbs"] is True and "ib" in info["components"]
    assert info["rdma_devices"] == []  # no NIC on this machine: verbs built in, no device
    assert any(t.startswith("tcp/") for t in info["transports"]), info["transports"]


@pytest.mark.parametrize("as_file", [False, True])
def test_mori_ucx_lib_is_honoured(as_file: bool) -> None:
    folder = wheel_ucx()
    info = _report(MORI_UCX_LIB=f"{folder}/libucp.so.0" if as_file else folder)
    assert Path(info["path"]).resolve() == (Path(folder) / "libucp.so.0").resolve()
    assert info["source"] == "MORI_UCX_LIB"
    assert tuple(info["version"][:2]) >= (1, 19)
    assert info["verbs"] is False and info["rdma_devices"] == []


def test_no_ucx_found_is_a_clear_error() -> None:
    proc = _run(REPORT, MORI_UCX_LIB="/nonexistent/ucx")
    assert proc.returncode != 0
    err = proc.stderr
    assert "UcxLoadError" in err and "/nonexistent/ucx/libucp.so" in err and "MORI_UCX_LIB" in err, err
    assert "apt-get install libucx0" in err and "pip install libucx" in err, err
    proc = _run("from mori.core._native import ucx\nucx.ucx_load([])")
    assert "no usable UCX found (no candidate)" in proc.stderr, proc.stderr


def test_a_second_ucx_in_one_process_is_refused() -> None:
    code = f"""
from mori.core import ucx
from mori.core._native import ucx as native_ucx
ucx.load()
try:
    native_ucx.ucx_load([({wheel_ucx()!r} + "/libucp.so.0", "MORI_UCX_LIB")])
except native_ucx.UcxLoadError as e:
    print("refused:", e)
"""
    proc = _run(code)
    assert "refused:" in proc.stdout and "a process holds one UCX" in proc.stdout, proc.stdout + proc.stderr


def test_engine_needs_a_loaded_ucx() -> None:
    proc = _run("from mori.core import ucx\nucx.UcxEngine('x')")
    assert "UCX is not loaded" in proc.stderr, proc.stderr


SETTINGS = """
import json
from mori.core import ucx
ucx.load()
engine = ucx.make_engine("x", {"TLS": "tcp"})
print(json.dumps(engine.settings))
engine.close()
"""


@pytest.mark.parametrize("lib", ["wheel", "debian"])
def test_engine_reports_its_settings_and_closes_tcp_puts_where_ucx_takes_it(lib: str) -> None:
    folder = wheel_ucx() if lib == "wheel" else DEBIAN_UCX
    proc = _run(SETTINGS, MORI_UCX_LIB=folder)
    assert proc.returncode == 0 and "WARN" not in proc.stderr, proc.stderr  # UCX 1.13 warns on tcp's settings
    settings = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert list(settings)[0] == "TLS" and settings["TLS"] == "tcp"  # the caller's first
    assert "MM_ERROR_HANDLING" not in settings  # shared memory only, and TLS has none
    assert settings.get("TCP_PUT_ENABLE") == ("n" if lib == "wheel" else None)
    assert "TCP_RX_SEG_SIZE" not in settings  # both ends must agree on it: UCX's default, or the user's
    # The environment wins over a default, as a setting does.
    proc = _run(SETTINGS, MORI_UCX_LIB=folder, UCX_TCP_PUT_ENABLE="y", UCX_KEEPALIVE_INTERVAL="5s")
    settings = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "TCP_PUT_ENABLE" not in settings and "KEEPALIVE_INTERVAL" not in settings, settings


@pytest.mark.parametrize(("cores", "workers"), [(None, 1), (1, 1), (2, 1), (7, 1), (8, 2), (16, 2), (128, 2)])
def test_auto_workers_is_two_from_eight_cores(monkeypatch: pytest.MonkeyPatch, cores: int | None, workers: int) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    assert ucx.auto_workers() == workers


def test_mori_rdma_devices_become_ucx_net_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """MORI_RDMA_DEVICES as UCX's NET_DEVICES, for every engine mori makes: an RDMA device becomes
    each of its ports, other names pass as they are, ``^`` excludes; unset, no setting."""
    for port in ("1", "2"):
        (tmp_path / "mlx5_0" / "ports" / port).mkdir(parents=True)
    assert ucx.net_devices((False, ("mlx5_0", "mlx5_1:1", "eth0")), tmp_path) == "mlx5_0:1,mlx5_0:2,mlx5_1:1,eth0"
    assert ucx.net_devices((True, ("mlx5_0",)), tmp_path) == "^mlx5_0:1,mlx5_0:2"
    monkeypatch.delenv("MORI_RDMA_DEVICES", raising=False)
    assert ucx.selected_devices() == {}
    monkeypatch.setenv("MORI_RDMA_DEVICES", "lo")  # the loopback interface, for UCX's tcp transport
    assert ucx.selected_devices() == {"NET_DEVICES": "lo"}
    engine = ucx.make_engine("net-devices", ucx.selected_devices())
    try:
        assert ("NET_DEVICES", "lo") in engine.settings
    finally:
        engine.close()
