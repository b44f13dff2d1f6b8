"""GPU tests: torchrun starts the PEs running gpu_worker.py / gpu_quickref.py.

Marked ``gpu``: CPU CI deselects them; ``ci/device/shmem.sh`` runs them. The PE counts come from
``MORI_TEST_PES`` (default "2 4"); PEs beyond the GPU count share GPUs (ci/device/gpu_world.py).
With ``MORI_TEST_NETNS=1`` the tests that reach peers through the remote transport start half of
their PEs in each of two network namespaces, as on two hosts (ci/device/netns_torchrun.py;
ci/device/netns_gpu.sh runs them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CI_DEVICE = HERE.parents[2] / "ci" / "device"  # gpu_world.py: which GPU each PE uses
PES = [int(n) for n in os.environ.get("MORI_TEST_PES", "2 4").split()]
pytestmark = pytest.mark.gpu


#: Whether the remote-transport tests run across two network namespaces (see the module docstring).
TWO_HOSTS = os.environ.get("MORI_TEST_NETNS") == "1"
if TWO_HOSTS:
    sys.path.insert(0, str(CI_DEVICE))  # netns_torchrun.py


def _torchrun(script: str, nproc: int, env: dict[str, str], two_hosts: bool = False) -> str:
    """Runs ``script`` as ``nproc`` PEs under torchrun; ``two_hosts``: half in each of two network
    namespaces (netns_torchrun.py). Its stdout, or an assertion with its stderr."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # PEs that share a GPU take turns on it: allow them more time.
    timeout = 60 + 15 * nproc * max(1, -(-nproc // torch.cuda.device_count()))
    path = os.pathsep.join(p for p in (str(CI_DEVICE), os.environ.get("PYTHONPATH")) if p)
    full_env = dict(
        os.environ,
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=path,
        **env,
    )
    if two_hosts:
        from netns_torchrun import torchrun_two_hosts

        rc, out, err = torchrun_two_hosts([str(HERE / script)], nproc, full_env, str(HERE), timeout)
        print(out)
        assert rc == 0, f"{script} with {nproc} PEs on two hosts failed (status {rc}):\n{out}\n{err[-8000:]}"
        return out
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(HERE / script),
    ]
    # A session of its own, so that a timeout kills torchrun and every PE it started.
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{script} with {nproc} PEs timed out after {timeout} s:\n{out}\n{err[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(out)
    assert proc.returncode == 0, f"{script} with {nproc} PEs failed:\n{out}\n{err[-6000:]}"
    return out


@pytest.mark.parametrize("nproc", PES)
@pytest.mark.parametrize("mode", ["static", "vmm"])
def test_device_api_and_host_api(nproc: int, mode: str) -> None:
    out = _torchrun(
        "gpu_worker.py",
        nproc,
        {"MORI_SHMEM_MODE": mode, "MORI_SHMEM_HEAP_SIZE": "512M", "MORI_SHMEM_VMM_CHUNK_SIZE": "4M"},
    )
    assert "ok  finalize, then init again" in out


@pytest.mark.parametrize("nproc", PES)
@pytest.mark.parametrize("mode", ["static", "vmm"])
def test_every_peer_through_the_proxy(nproc: int, mode: str) -> None:
    """The same checks with MORI_DISABLE_P2P=ON: kernels reach every peer through the device proxy,
    host calls through the UCX engine (TCP and UCX's CUDA copies, as between hosts)."""
    out = _torchrun(
        "gpu_worker.py",
        nproc,
        {
            "MORI_SHMEM_MODE": mode,
            "MORI_SHMEM_HEAP_SIZE": "512M",
            "MORI_SHMEM_VMM_CHUNK_SIZE": "4M",
            "MORI_DISABLE_P2P": "ON",
            "UCX_TLS": "tcp,cuda_copy,self",
            "MORI_SHMEM_TIMEOUT": "30",
        },
        two_hosts=TWO_HOSTS,
    )
    assert "ok  finalize, then init again" in out and "all through the proxy" in out


def test_proxy_reports_a_dead_pe() -> None:
    """PE 1 dies: PE 0's host quiet raises naming it, and a kernel waiting on the proxy fails its
    launch with a device report naming it (no hang)."""
    out = _torchrun(
        "gpu_proxy_failure.py",
        2,
        {
            "MORI_DISABLE_P2P": "ON",
            "UCX_TLS": "tcp,cuda_copy,self",
            "MORI_SHMEM_TIMEOUT": "10",
            "MORI_SHMEM_HEAP_SIZE": "64M",
        },
        two_hosts=TWO_HOSTS,
    )
    assert "ok  host shmem_quiet names the dead PE" in out and "ok  a kernel's quiet failed its launch" in out
    assert "the proxy's operation to PE 1 failed" in out


def test_a_ucx_without_cuda_is_refused_at_init_not_in_a_kernel() -> None:
    """The machine's system UCX (the H200 machine's 1.16 has no CUDA), MORI_DISABLE_P2P: init
    fails on every PE naming that UCX and what to install (it used to initialize and stop both
    PEs' kernels with "unspecified launch failure")."""
    import glob

    systems = [p for p in glob.glob("/usr/lib*/**/libucp.so.0", recursive=True) if "site-packages" not in p]
    if not systems:
        pytest.skip("no system UCX on this machine")
    probe = "from mori.shmem._remote_ucx import why_unavailable; print(why_unavailable('gpu'))"
    why = subprocess.run(
        [sys.executable, "-c", probe], env=dict(os.environ, MORI_UCX_LIB=systems[0]), capture_output=True, text=True
    ).stdout
    if "has no CUDA support" not in why:
        pytest.skip(f"the system UCX {systems[0]} has CUDA support here: {why.strip()}")
    out = _torchrun(
        "gpu_no_cuda_ucx.py",
        2,
        {"MORI_DISABLE_P2P": "ON", "MORI_UCX_LIB": systems[0], "MORI_SHMEM_HEAP_SIZE": "64M"},
    )
    lines = [line for line in out.splitlines() if line.startswith("ok  init refused")]
    assert len(lines) == 2, out
    for line in lines:
        assert f"the UCX loaded ({systems[0]}) has no CUDA support" in line and "libucx-cu13" in line, line


@pytest.mark.parametrize("nproc", PES)
def test_quick_reference_as_written(nproc: int) -> None:
    out = _torchrun("gpu_quickref.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "256M"})
    assert out.count("quick reference ok") == nproc
