"""Bootstraps launched through torch.distributed (gloo, CPU) and MPI (mpirun), checked against them.

Run as a script under mpirun, this file is also the MPI program of ``test_init_from_mpi``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from mori.core.bootstrap import Bootstrap, init_from_mpi, init_from_torch
from mori.core.testing import ProcPool


def _exercise(bs: Bootstrap, gather, seed: int) -> None:
    """Runs every collective on random bytes and checks it against the launcher's own allgather."""
    rng = random.Random(seed * 100 + bs.rank)
    mine = rng.randbytes(rng.randrange(0, 200_000))
    assert bs.allgather(mine) == gather(mine)
    chunks = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(bs.world)]
    got = bs.alltoall(chunks)
    everyone = gather(chunks)
    assert got == [everyone[i][bs.rank] for i in range(bs.world)]
    root = bs.world - 1
    assert bs.broadcast(mine if bs.rank == root else None, root=root) == gather(mine)[root]
    bs.barrier()


def _torch_rank(rank: int, world: int, store: str, seed: int) -> list[int]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:

        def gather(obj, group=None):
            out = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, obj, group=group)
            return out

        with init_from_torch(timeout=30) as bs:
            assert (bs.rank, bs.world) == (rank, world)
            _exercise(bs, gather, seed)
        # A subgroup of two, with its own ranks 0 and 1: world ranks 2 and 0.
        pair = dist.new_group([0, 2])
        if rank in (0, 2):
            with init_from_torch(pair, timeout=30) as sub:
                assert (sub.rank, sub.world) == (dist.get_rank(pair), 2)
                _exercise(sub, lambda obj: gather(obj, pair), seed + 1)
                return [sub.rank, sub.world]
        return []
    finally:
        dist.destroy_process_group()


def test_init_from_torch_with_gloo():
    with tempfile.TemporaryDirectory() as tmp, ProcPool(3, timeout=120) as pool:
        store = os.path.join(tmp, "store")
        got = pool.map(_torch_rank, [(r, 3, store, 11) for r in range(3)])
    assert got == [[0, 2], [], [1, 2]]


def test_init_from_torch_needs_an_initialised_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        init_from_torch()


def test_launchers_name_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError, match=r"mori-core\[mpi\]"):
        init_from_mpi()
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(ImportError, match=r"mori-core\[torch\]"):
        init_from_torch()


def test_init_from_mpi():
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: ci/setup.sh installs Open MPI (openmpi-bin) and mpi4py"
    cmd = [mpirun, "-n", "2", "--oversubscribe", "--allow-run-as-root", sys.executable, __file__]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # mpirun merges both ranks' stdout, so two reports can share a line: find them anywhere.
    assert sorted(re.findall(r"mpi rank \d+ of \d+: ok", proc.stdout)) == ["mpi rank 0 of 2: ok", "mpi rank 1 of 2: ok"]


def _mpi_main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    with init_from_mpi(timeout=30) as bs:
        assert (bs.rank, bs.world) == (comm.Get_rank(), comm.Get_size())
        _exercise(bs, comm.allgather, 5)
    # The communicator's MPI_Comm handle (what MORI's C API takes), here of a duplicate.
    dup = comm.Dup()
    with init_from_mpi(MPI._handleof(dup), timeout=30) as bs:
        assert (bs.rank, bs.world) == (dup.Get_rank(), dup.Get_size())
        _exercise(bs, dup.allgather, 6)
        print(f"mpi rank {bs.rank} of {bs.world}: ok", flush=True)
    dup.Free()


if __name__ == "__main__":
    _mpi_main()
