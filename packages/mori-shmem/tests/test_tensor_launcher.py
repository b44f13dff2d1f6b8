"""Tensors on the heap, the device-state bytes, and the ``python -m mori.shmem.run`` launcher."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pe_pool import PePool

import mori.shmem as shmem
from mori.shmem._gpu_states import (
    FLAG_P2P_DISABLED,
    FLAG_PROXY,
    GPU_FAST_STATES_SIZE,
    GPU_STATES_SIZE,
    MAX_PES,
    GpuFastStates,
    GpuStates,
    pack_fast_states,
    pack_gpu_states,
)


def pe_tensors(seed: int) -> list[bool]:
    import torch

    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    gen = torch.Generator().manual_seed(seed + me)
    t = shmem.shmem_tensor((3, 5, 7), torch.float32)
    t.copy_(torch.rand((3, 5, 7), generator=gen))
    b = shmem.shmem_tensor(33, torch.bfloat16)
    b.copy_(torch.randn(33, generator=gen).to(torch.bfloat16))
    shmem.shmem_barrier_all()
    checks = []
    for pe in range(n):
        peer = shmem.shmem_peer_tensor(t, pe)
        expect = torch.rand((3, 5, 7), generator=torch.Generator().manual_seed(seed + pe))
        checks.append(peer.shape == t.shape and bool(torch.equal(peer, expect)))
    # Writing through the right neighbour's view lands in its tensor.
    right = shmem.shmem_peer_tensor(b, (me + 1) % n)
    right.fill_(float(me))
    # A tensor as the source of a put and a destination of a get.
    src = torch.arange(10, dtype=torch.int64) * (me + 1)
    words = shmem.shmem_tensor(10, torch.int64)
    shmem.shmem_putmem(words, src, (me + 1) % n)
    shmem.shmem_barrier_all()
    checks.append(bool(torch.all(b == float((me - 1) % n))))
    out = torch.empty(10, dtype=torch.int64)
    shmem.shmem_getmem_into(out, words, me)
    checks.append(bool(torch.equal(out, torch.arange(10) * (((me - 1) % n) + 1))))
    try:
        shmem.shmem_peer_tensor(torch.zeros(4), 0)
        checks.append(False)
    except shmem.ShmemAddressError:
        checks.append(True)
    shmem.shmem_barrier_all()
    for x in (t, b, words):
        shmem.shmem_free(x.data_ptr())
    return checks


def test_tensors_on_heap(pool: PePool) -> None:
    for checks in pool.run(pe_tensors, 1234):
        assert all(checks), checks


def pe_states() -> tuple[bytes, str, list[int]]:
    info = shmem.shmem_heap_info()
    states = shmem.get_gpu_states_bytes()
    parsed = GpuStates.from_buffer_copy(states)
    bases = struct.unpack(
        f"<{parsed.worldSize}Q", shmem.shmem_getmem(parsed.peerHeapBases, 8 * parsed.worldSize, shmem.shmem_mype())
    )
    return states, info["base"], list(bases)


def test_gpu_states_layout(pool: PePool) -> None:
    for rank, (states, base, bases) in enumerate(pool.run(pe_states)):
        assert len(states) == GPU_STATES_SIZE
        parsed = GpuStates.from_buffer_copy(states)
        assert (parsed.rank, parsed.worldSize, parsed.heapSize, parsed.flags) == (rank, pool.n, 8 << 20, 0)
        assert parsed.heapBase == int(base, 16) and bases[rank] == parsed.heapBase
        assert all(bases), "every peer is mapped"


def test_fast_states_layout() -> None:
    """The constant-memory mirror: field offsets of the device header's GpuFastStates, the
    peer-base table padded to MAX_PES, and a clear error past MAX_PES PEs."""
    bases = [0x7F0000000000 + (i << 32) for i in range(3)]
    data = pack_fast_states(1, 3, bases[1], 8 << 20, bases, True)
    assert len(data) == GPU_FAST_STATES_SIZE == 32 + 8 * MAX_PES
    assert struct.unpack_from("<QQiiII", data) == (bases[1], 8 << 20, 1, 3, 1, 0)
    assert list(struct.unpack_from(f"<{MAX_PES}Q", data, 32)) == bases + [0] * (MAX_PES - 3)
    assert GpuFastStates.from_buffer_copy(data).peerBases[2] == bases[2]
    with pytest.raises(ValueError, match="at most 64"):
        pack_fast_states(0, MAX_PES + 1, 0, 0, [1] * (MAX_PES + 1), False)


def test_proxy_fields() -> None:
    """The device proxy's ring and ticket counter at offsets 40 and 48 of GpuStates, and flag bit 1
    (kFlagProxy) in both states; without a proxy they are 0 and the bit is clear."""
    ring, tickets = 0x7F12_0000_1000, 0x7F34_0000_2000
    data = pack_gpu_states(0, 2, 1 << 40, 8 << 20, (1 << 40) + 8192, True, ring, tickets)
    assert struct.unpack_from("<IIQQQ", data, 32) == (FLAG_P2P_DISABLED | FLAG_PROXY, 0, ring, tickets, 0)
    parsed = GpuStates.from_buffer_copy(data)
    assert (parsed.proxyRing, parsed.proxyTickets, parsed.flags) == (ring, tickets, 3)
    assert struct.unpack_from("<IIQQQ", pack_gpu_states(0, 2, 1 << 40, 8 << 20, 0, False), 32) == (0, 0, 0, 0, 0)
    fast = pack_fast_states(0, 2, 1 << 40, 8 << 20, [1 << 40, 0], True, proxy=True)
    assert struct.unpack_from("<I", fast, 24) == (FLAG_P2P_DISABLED | FLAG_PROXY,)


def test_p2p_disabled() -> None:
    pool = PePool(2, {"MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_HEAP_SIZE": "1M", "MORI_DISABLE_P2P": "1"})
    try:
        for rank, (states, _, bases) in enumerate(pool.run(pe_states)):
            parsed = GpuStates.from_buffer_copy(states)
            assert parsed.flags == 1 and parsed.proxyRing == parsed.proxyTickets == 0  # no device proxy on CPU
            assert [b != 0 for b in bases] == [pe == rank for pe in range(2)]
    finally:
        pool.close()


SCRIPT = """
import os, sys
import mori.shmem as shmem
shmem.shmem_init_from_env()
me, n = shmem.shmem_mype(), shmem.shmem_npes()
buf = shmem.shmem_malloc(64)
shmem.shmem_putmem(buf, bytes([me + 1]) * 64, (me + 1) % n)
shmem.shmem_barrier_all()
got = shmem.shmem_getmem(buf, 64, me)
assert got == bytes([(me - 1) % n + 1]) * 64, got
print(f"PE {me}/{n} ok", flush=True)
print("a line written in parts " * 200, end="", flush=True)  # long and unterminated: still whole
shmem.shmem_finalize()
if me == int(sys.argv[1]):
    sys.exit(3)
"""


def _run_launcher(tmp_path: Path, n: int, fail_rank: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "pe.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, MORI_SHMEM_BACKEND="cpu", MORI_SHMEM_HEAP_SIZE="1M")
    return subprocess.run(
        [sys.executable, "-m", "mori.shmem.run", "-n", str(n), "--timeout", "60", str(script), str(fail_rank)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_launcher_runs_pes(tmp_path: Path) -> None:
    done = _run_launcher(tmp_path, 3, -1)
    assert done.returncode == 0, done.stderr
    # Every line comes out whole, prefixed with the rank that wrote it.
    lines = done.stdout.splitlines()
    assert sorted(line for line in lines if line.endswith(" ok")) == [f"[PE {r}] PE {r}/3 ok" for r in range(3)]
    parts = "a line written in parts " * 200
    assert sorted(line for line in lines if "parts" in line) == [f"[PE {r}] {parts}" for r in range(3)]
    assert len(lines) == 6


def test_launcher_names_the_pe_that_failed(tmp_path: Path) -> None:
    done = _run_launcher(tmp_path, 2, 1)
    assert done.returncode == 3
    assert re.search(r"mori.shmem.run: PE 1 \(pid \d+\) exited with status 3", done.stderr), done.stderr


HANG_SCRIPT = """
import os, sys, time
import mori.shmem as shmem
shmem.shmem_init_from_env()
me = shmem.shmem_mype()
with open(os.path.join(sys.argv[1], f"pid.{me}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(sys.argv[1], f"pid.{me}.tmp"), os.path.join(sys.argv[1], f"pid.{me}"))
time.sleep(600)  # busy with its own work: only the launcher can stop it
"""


@pytest.mark.parametrize("victim", range(4))
def test_launcher_stops_the_job_when_any_pe_dies(tmp_path: Path, victim: int) -> None:
    # Issue 23: the wait loop polled PEs through any(), which stops at the first PE still
    # running, so a PE other than 0 that died went unseen until every PE before it ended.
    n = 4
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(HANG_SCRIPT))
    env = dict(os.environ, MORI_SHMEM_BACKEND="cpu", MORI_SHMEM_HEAP_SIZE="1M")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mori.shmem.run", "-n", str(n), "--timeout", "300", str(script), str(tmp_path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"pid.{r}").exists() for r in range(n)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the PEs did not start"
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(n)]
        os.kill(pids[victim], signal.SIGKILL)
        try:
            _, err = launcher.communicate(timeout=60)  # generous: the launcher polls every 50 ms
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still waits after PE {victim} was killed")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == -signal.SIGKILL % 256, err
    others = [r for r in range(n) if r != victim]
    assert f"PE {victim} (pid {pids[victim]}) exited with status -9; stopping PEs {others}" in err, err
    for r in others:  # stopped and reaped by the launcher, not left waiting
        with pytest.raises(ProcessLookupError):
            os.kill(pids[r], 0)


def test_init_from_env_without_launcher() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MORI_SHMEM_")}
    done = subprocess.run(
        [sys.executable, "-c", "import mori.shmem as s; s.shmem_init_from_env()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "MORI_SHMEM_RANK" in done.stderr and "mori.shmem.run" in done.stderr
