"""MORI names that clients and MORI's own tests call: the tensor helpers, one PE per thread
(SPMT), ``shmem_mpi_init``, and a unique id made by a process that is no PE."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from pe_pool import PePool

import mori.shmem as shmem

CPU = {"MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_HEAP_SIZE": "4M"}


def pe_tensor_helpers() -> list[str]:
    import torch

    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    problems = []
    t = shmem.mori_shmem_create_tensor((4, 8), torch.float32)
    if not (t.__symm_tensor__ and t.shape == (4, 8) and t.dtype == torch.float32 and t.device.type == "cpu"):
        problems.append(f"create_tensor gave {t.shape} {t.dtype} {t.device}")
    t.copy_(torch.arange(32, dtype=torch.float32).view(4, 8) + 100 * me)
    shmem.shmem_barrier_all()
    views = shmem.mori_shmem_create_tensor_list_intra_node((3,), torch.int64, n)
    views[me].fill_(me + 7)
    for pe in range(n):
        peer = shmem.symm_mori_shmem_tensor(t, pe)
        if not torch.equal(peer, torch.arange(32, dtype=torch.float32).view(4, 8) + 100 * pe):
            problems.append(f"peer {pe} view holds {peer.flatten()[:3].tolist()}")
    if shmem.symm_mori_shmem_tensor(t, me) is not t:
        problems.append("own view is not the tensor itself")
    shmem.shmem_barrier_all()
    if [int(v[0]) for v in views] != [pe + 7 for pe in range(n)]:
        problems.append(f"list views hold {[int(v[0]) for v in views]}")
    buf = shmem.MoriShmemBuffer(t.data_ptr(), t.nbytes, t.dtype)
    if hasattr(buf, "__cuda_array_interface__"):
        problems.append("CPU heap memory offered as CUDA memory")
    if not np.array_equal(np.asarray(buf), t.numpy().view(np.uint8).ravel()):
        problems.append("MoriShmemBuffer does not show the tensor's bytes")
    for bad in (torch.zeros(3), t.clone()):
        try:
            shmem.symm_mori_shmem_tensor(bad, (me + 1) % n)
            problems.append("a tensor that is not symmetric was accepted")
        except ValueError as exc:
            if "not a symmetric tensor" not in str(exc):
                problems.append(str(exc))
    shmem.shmem_barrier_all()
    shmem.mori_shmem_free_tensor(views[me])
    shmem.mori_shmem_free_tensor(t)
    return problems


@pytest.mark.parametrize("n", [2, 3])
def test_tensor_helpers(n: int) -> None:
    pool = PePool(n, CPU)
    try:
        assert pool.run(pe_tensor_helpers) == [[]] * n
    finally:
        pool.close()


def test_moris_shmem_buffer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="non-null address"):
        shmem.MoriShmemBuffer(0, 8, None)
    with pytest.raises(ValueError, match="nbytes"):
        shmem.MoriShmemBuffer(4096, -1, None)


def test_one_pe_per_thread_and_a_thread_that_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two PEs as threads of this process (MORI's SPMT mode); the main thread made the id and is
    no PE, so its calls are refused with a message that says why."""
    for key, value in CPU.items():
        monkeypatch.setenv(key, value)
    uid = shmem.shmem_get_unique_id()
    inited, done = threading.Barrier(3, timeout=60), threading.Barrier(3, timeout=60)
    results: list[object] = [None, None]

    def pe(rank: int) -> None:
        try:
            shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, 2, uid)
            inited.wait()
            ptr = shmem.shmem_malloc(8)
            shmem.shmem_putmem(ptr, bytes([rank + 1]) * 8, 1 - rank)
            shmem.shmem_barrier_all()
            results[rank] = (shmem.shmem_mype(), shmem.shmem_getmem(ptr, 8, rank))
            done.wait()
            shmem.shmem_finalize()
        except BaseException as exc:  # reported below
            results[rank] = exc
            inited.abort()
            done.abort()

    threads = [threading.Thread(target=pe, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    try:
        inited.wait()
        assert not shmem.shmem_is_initialized()
        with pytest.raises(shmem.ShmemError, match="none of the 2 PEs of this process"):
            shmem.shmem_mype()
        done.wait()
    finally:
        for t in threads:
            t.join(timeout=60)
    assert results == [(0, bytes([2]) * 8), (1, bytes([1]) * 8)]
    with pytest.raises(shmem.ShmemNotInitializedError):
        shmem.shmem_mype()


MPI_SCRIPT = """
import pytest
from mpi4py import MPI
import mori.shmem as shmem

def ring(how):
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    ptr = shmem.shmem_malloc(16)
    shmem.shmem_putmem(ptr, bytes([me + 1]) * 16, (me + 1) % n)
    shmem.shmem_barrier_all()
    assert shmem.shmem_getmem(ptr, 16, me) == bytes([(me - 1) % n + 1]) * 16, how
    shmem.shmem_finalize()

assert shmem.shmem_mpi_init() == 0
ring("shmem_mpi_init")
rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
dup = MPI.COMM_WORLD.Dup()
# MORI_SHMEM_INIT_WITH_MPI_COMM with the communicator as MORI's docs pass it (its MPI_Comm handle,
# here mpi4py's int for it), and as the mpi4py object.
for how, comm in (("COMM_WORLD handle", MPI._handleof(MPI.COMM_WORLD)), ("Dup handle", MPI._handleof(dup)),
                  ("Dup object", dup)):
    assert shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_MPI_COMM, rank, n, comm) == 0, how
    ring(how)
for bad in (b"x" * 128, "COMM_WORLD"):
    with pytest.raises(TypeError, match="MPI_Comm handle"):
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_MPI_COMM, rank, n, bad)
with pytest.raises(ValueError, match="MPI_COMM_NULL"):
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_MPI_COMM, rank, n, MPI._handleof(MPI.COMM_NULL))
assert not shmem.shmem_is_initialized()
dup.Free()
print(f"mpi pe {rank} of {n} ok", flush=True)
"""


def test_shmem_mpi_init(tmp_path: Path) -> None:
    """``shmem_mpi_init``, then ``shmem_init_attr(MORI_SHMEM_INIT_WITH_MPI_COMM, ...)`` with an
    ``MPI_Comm`` handle (the form MORI's docs and C API take) and with an mpi4py communicator."""
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: ci/setup.sh installs Open MPI (openmpi-bin) and mpi4py"
    script = tmp_path / "pe.py"
    script.write_text(textwrap.dedent(MPI_SCRIPT))
    env = dict(os.environ, **CPU)
    done = subprocess.run(
        [mpirun, "-n", "2", "--oversubscribe", "--allow-run-as-root", sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # mpirun merges the ranks' stdout, so two reports can share a line: find them anywhere.
    assert sorted(re.findall(r"mpi pe \d of 2 ok", done.stdout)) == ["mpi pe 0 of 2 ok", "mpi pe 1 of 2 ok"]


LAUNCHER = """
import multiprocessing as mp, sys
import mori.shmem as shmem

def pe(rank, n, uid, q):
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, n, uid)
    shmem.shmem_barrier_all()
    q.put((rank, shmem.shmem_mype(), shmem.shmem_npes()))
    shmem.shmem_finalize()

if __name__ == "__main__":
    n = int(sys.argv[1])
    uid = shmem.shmem_get_unique_id()  # made here, in a process that is no PE
    q = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=pe, args=(r, n, uid, q)) for r in range(n)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=60) for _ in range(n))
    for p in procs:
        p.join(timeout=30)
    assert got == [(r, r, n) for r in range(n)], got
    assert [p.exitcode for p in procs] == [0] * n
    print("launcher ok")
"""


def test_unique_id_made_by_a_launcher_that_is_no_pe(tmp_path: Path) -> None:
    """As with torch.multiprocessing.spawn or NCCL: the parent makes the id and stays alive; the
    child that is rank 0 listens on the port the parent reserved."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(LAUNCHER))
    done = subprocess.run(
        [sys.executable, str(script), "3"],
        env=dict(os.environ, **CPU, MORI_BOOTSTRAP_TIMEOUT="30"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0 and "launcher ok" in done.stdout, done.stderr[-4000:]
