"""GPU tests: torchrun starts one PE per GPU running gpu_worker.py / gpu_quickref.py.

Marked ``gpu``: CPU CI deselects them; ``ci/device/shmem.sh`` runs them on the 4-GPU machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torchrun(script: str, nproc: int, env: dict[str, str], timeout: float = 90) -> str:
    if _gpus() < nproc:
        pytest.skip(f"needs {nproc} GPUs, this machine has {_gpus()}")
    full_env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                    NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / script)]
    # A session of its own, so that a timeout kills torchrun and every PE it started.
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{script} on {nproc} GPUs timed out after {timeout} s:\n{out}\n{err[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(out)
    assert proc.returncode == 0, f"{script} on {nproc} GPUs failed:\n{out}\n{err[-6000:]}"
    return out


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("mode", ["static", "vmm"])
def test_device_api_and_host_api(nproc: int, mode: str) -> None:
    out = _torchrun("gpu_worker.py", nproc, {"MORI_SHMEM_MODE": mode, "MORI_SHMEM_HEAP_SIZE": "512M",
                                             "MORI_SHMEM_VMM_CHUNK_SIZE": "4M"})
    assert "ok  finalize, then init again" in out


@pytest.mark.parametrize("nproc", [2, 4])
def test_quick_reference_as_written(nproc: int) -> None:
    out = _torchrun("gpu_quickref.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "256M"})
    assert out.count("quick reference ok") == nproc
