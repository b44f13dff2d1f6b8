"""PEs reached through the remote transport (mori-core's UCX engine): on another host (two network
namespaces joined by a veth pair stand in for two hosts), or every peer with ``MORI_DISABLE_P2P``.

Every host RMA op to and from every PE with every byte checked (remote_suite.py), launched with
the unique id and with a torch process group across the namespaces, the seed guide's Quick
Reference, 1,000 barriers in a row, a PE killed mid-run; and, where UCX cannot start, the clear
refusals.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from pe_pool import PeError, PePool
from remote_suite import (
    pe_barriers,
    pe_die_or_reach,
    pe_reach_hung,
    pe_ready,
    pe_registered_buffer,
    pe_remote_eager_bytes,
    pe_remote_transports,
    pe_rma_everywhere,
    pe_threads_put,
)

import mori.shmem as shmem
from mori.core.host import HostIdentity
from mori.core.testing import Died, network_namespaces, stop_process
from mori.core.ucx import MAX_EAGER_BYTES
from mori.shmem._reach import Reach
from mori.shmem._remote_ucx import _warn_without_nic

CPU_ENV = {"MORI_SHMEM_HEAP_SIZE": "16M", "MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_TIMEOUT": "30"}
#: A UCX that cannot be loaded: the remote transport is unavailable.
NO_UCX = {"MORI_UCX_LIB": "/nonexistent/libucp.so.0"}


def test_gpu_direct_without_a_nic_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """MORI_SHMEM_GPU_DIRECT=1 where UCX finds no RDMA NIC: one warning saying why kernels
    that wait on remote PEs stall (seen on the H200, 2026-11-28 08:35 UTC); none with a NIC."""
    with caplog.at_level("WARNING", logger="mori.shmem"):
        _warn_without_nic([], "# lane[0]: 0:tcp/veth0.0 md[0]  3:cuda_copy/cuda.0")
        assert len(caplog.records) == 1
        text = caplog.records[0].getMessage()
        assert "no RDMA NIC (UCX transports: cuda_copy/cuda.0, tcp/veth0.0)" in text and "stalls" in text, text
        caplog.clear()
        _warn_without_nic(["mlx5_0:1"], "rc_mlx5/mlx5_0:1 dc_mlx5/mlx5_0:1 cuda_copy/cuda tcp/eth0")
        assert not caplog.records


def test_reach_by_host_and_p2p_setting() -> None:
    a, b = HostIdentity("m", 1), HostIdentity("m", 2)
    reach = Reach.of(1, [a, a, b, b], p2p_disabled=False)
    assert reach.mapped == (0, 1) and reach.remote == (2, 3) and reach.any_remote
    assert reach.why_remote(3) == "PE 3 runs on another host (m/2)"
    assert "2 network namespaces" in (reach.hosts_problem() or "")
    one = Reach.of(0, [a, a], p2p_disabled=True)
    assert one.mapped == (0,) and one.remote == (1,) and one.any_remote and one.hosts_problem() is None
    assert one.why_remote(1) == "MORI_DISABLE_P2P is set"
    alone = Reach.of(0, [a], p2p_disabled=True)
    assert alone.remote == () and not alone.any_remote
    assert not Reach.of(2, [a, a, a], p2p_disabled=False).any_remote


#: Two namespaces of one machine still share SysV/POSIX shared memory, which UCX would use between
#: them; real hosts share none, so UCX is held to what crosses hosts here.
HOSTS_UCX = {"UCX_TLS": "tcp,self"}


def _across(n_per_host: int, env: dict[str, str], init: bool = True, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    """(namespaces context, pool of 2 * n_per_host PEs, the first half in namespace A; UCX on tcp)."""
    spaces = network_namespaces()
    a, b = spaces.__enter__()
    try:
        pool = PePool(
            2 * n_per_host,
            {**CPU_ENV, **HOSTS_UCX, "MORI_BOOTSTRAP_HOST": a.address, **env},
            init=init,
            timeout=timeout,
            netns=[a.name] * n_per_host + [b.name] * n_per_host,
        )
    except BaseException:
        spaces.__exit__(None, None, None)
        raise
    return spaces, (a, b), pool


def _remote_of(pe: int, hosts: list[int]) -> list[int]:
    return [q for q in range(len(hosts)) if hosts[q] != hosts[pe]]


@pytest.mark.parametrize("workers", ["auto", "2"])
def test_two_hosts_every_op_every_pe_unique_id(workers: str) -> None:
    """2 + 2 CPU PEs in two namespaces, launched with the unique id (MORI_BOOTSTRAP_HOST set):
    every op to and from every PE, bytes checked; 1,000 barriers in a row. With two UCX workers
    too (MORI_SHMEM_UCX_WORKERS; "auto" is one on a machine of fewer than 8 cores, as CI's), so
    that the 1 MiB + 3 puts and gets are spread over both."""
    spaces, _, pool = _across(2, {} if workers == "auto" else {"MORI_SHMEM_UCX_WORKERS": workers})
    try:
        hosts = [0, 0, 1, 1]
        results = pool.run_each(pe_rma_everywhere, [(_remote_of(pe, hosts),) for pe in range(4)])
        for pe, seen in enumerate(results):
            assert seen["p2p"] == [hosts[q] == hosts[pe] for q in range(4)]
        # The fetch-adds of all PEs on each target gave distinct old values summing right.
        for target in range(4):
            olds = sorted(r["olds"][target] for r in results)  # type: ignore[index]
            assert len(set(olds)) == 4 and max(olds) <= 10
        assert pool.run(pe_barriers, 1000) == [10] * 4
    finally:
        pool.close()
        spaces.__exit__(None, None, None)


def test_disable_p2p_on_one_host_every_op_every_pe() -> None:
    """MORI_DISABLE_P2P (ON, 1, true) on one host: every peer goes through the remote transport;
    with MORI_RDMA_DEVICES naming the loopback interface, the remote transport's UCX uses it (as a
    multi-NIC host names its NICs)."""
    for n, value, devices in ((2, "ON", {}), (4, "1", {}), (2, "true", {"MORI_RDMA_DEVICES": "lo"})):
        pool = PePool(n, {**CPU_ENV, "MORI_DISABLE_P2P": value, **devices}, timeout=120)
        try:
            results = pool.run_each(pe_rma_everywhere, [([q for q in range(n) if q != pe],) for pe in range(n)])
            assert [r["p2p"] for r in results] == [[q == pe for q in range(n)] for pe in range(n)]
            if value == "ON":
                assert pool.run(pe_barriers, 1000) == [10] * n
                pool.run(pe_threads_put, 4)
            if devices:  # the engine's UCX context has tcp on the loopback interface alone
                for found in pool.run(pe_remote_transports):
                    assert [t for t in found if t.startswith("tcp/")] == ["tcp/lo"], found
                # No verbs transport: host-heap messages of up to 256 KiB go eager.
                assert pool.run(pe_remote_eager_bytes) == [MAX_EAGER_BYTES] * n
        finally:
            pool.close()


def test_a_registered_buffer_moves_without_staging_or_registration_per_call() -> None:
    """shmem_buffer_register registers a buffer outside the heap with the remote transport: puts
    from it and gets into it then neither stage (a page) nor register for the call (1 MiB + 3);
    before it, and after shmem_buffer_deregister, each does. Every byte checked."""
    pool = PePool(2, {**CPU_ENV, "MORI_DISABLE_P2P": "ON"}, timeout=120)
    try:
        for seen in pool.run(pe_registered_buffer, (4096, (1 << 20) + 3)):

            def moved(stage: str, since: str, seen: dict = seen) -> tuple[int, int]:  # type: ignore[type-arg]
                now, then = seen[stage], seen[since]
                return now["staged"] - then["staged"], now["registered_for_call"] - then["registered_for_call"]

            assert moved("unregistered", "before") == (2, 2), seen  # the page's put and get; the large one's
            assert seen["registering"]["registered_buffers"] == 1, seen
            assert moved("registered", "registering") == (0, 0), seen
            assert seen["registered"]["registered_buffers"] == 1, seen
            assert moved("deregistered", "registered") == (2, 2), seen
            assert seen["deregistered"]["registered_buffers"] == 0, seen
    finally:
        pool.close()


def pe_quick_reference(rank: int, world: int, init_method: str, ifname: str, remote: list[int]) -> list[int]:
    """The seed guide's Quick Reference, on a CPU tensor and a gloo group across the namespaces,
    with the RMA suite before the cleanup; returns shmem_ptr_p2p towards every PE."""
    import torch
    import torch.distributed as dist

    import mori

    os.environ["GLOO_SOCKET_IFNAME"] = ifname  # the namespace's end of the veth pair
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    world_group = dist.group.WORLD
    torch._C._distributed_c10d._register_process_group("default", world_group)  # type: ignore[attr-defined]
    mori.shmem.shmem_torch_process_group_init("default")
    my_rank = mori.shmem.shmem_mype()
    num_ranks = mori.shmem.shmem_npes()
    assert (my_rank, num_ranks) == (rank, world)
    size_in_bytes = 1 << 16
    ptr = mori.shmem.shmem_malloc(size_in_bytes)
    tensor = torch.zeros(1024, 16, dtype=torch.bfloat16)
    mori.shmem.shmem_buffer_register(tensor.data_ptr(), tensor.nbytes)
    my_pe = my_rank
    remote_ptrs = [mori.shmem.shmem_ptr_p2p(ptr, my_pe, dest_pe) for dest_pe in range(num_ranks)]
    mori.shmem.shmem_barrier_all()
    pe_rma_everywhere(remote)
    mori.shmem.shmem_buffer_deregister(tensor.data_ptr(), tensor.nbytes)
    mori.shmem.shmem_free(ptr)
    mori.shmem.shmem_finalize()
    dist.destroy_process_group()
    return remote_ptrs


def test_two_hosts_torch_process_group_quick_reference() -> None:
    spaces, (a, b), pool = _across(2, {}, init=False)
    try:
        init_method = f"tcp://{a.address}:{29500 + os.getpid() % 1000}"
        hosts = [0, 0, 1, 1]
        args = [(pe, 4, init_method, (a if hosts[pe] == 0 else b).device, _remote_of(pe, hosts)) for pe in range(4)]
        for pe, ptrs in enumerate(pool.run_each(pe_quick_reference, args)):
            assert [p != 0 for p in ptrs] == [hosts[q] == hosts[pe] for q in range(4)], (pe, ptrs)
    finally:
        pool.close()
        spaces.__exit__(None, None, None)


def test_a_dead_pe_is_named_within_the_timeout() -> None:
    """PE 3 exits mid-run: every survivor's barrier fails naming rank 3, and the PEs of the other
    host then fail their put/atomic to it naming PE 3, well within MORI_SHMEM_TIMEOUT."""
    spaces, _, pool = _across(2, {"MORI_SHMEM_TIMEOUT": "10", "MORI_BOOTSTRAP_TIMEOUT": "10"})
    try:
        start = time.monotonic()
        results = pool.map(pe_die_or_reach, [(3,)] * 4, may_die=[3])
        elapsed = time.monotonic() - start
    finally:
        pool.close()
        spaces.__exit__(None, None, None)
    assert isinstance(results[3], Died) and results[3].exitcode == 7
    for pe in (0, 1, 2):
        barrier, rma = results[pe].split(" | ")
        assert barrier.startswith("barrier: BootstrapError: ") and "rank 3" in barrier, results[pe]
        if pe in (0, 1):  # PE 2 shares PE 3's host: its copy into the mapped heap still works
            assert rma.startswith("rma: ") and "PE 3" in rma, results[pe]
    assert elapsed < 10 + 15, elapsed


def test_a_hung_pe_is_named_within_the_timeout() -> None:
    """PE 3 stopped (SIGSTOP): a put to it from the other host fails after MORI_SHMEM_TIMEOUT (3 s
    here) naming PE 3 and the setting, never hangs; the engine then holds PE 3 failed, so the
    atomic that follows fails at once with the same reason. A put is complete when it returns
    (the target answers once its bytes are written), so it waits for PE 3: the put starts only
    once every thread of PE 3 is stopped, since a stop lands asynchronously and PE 3's polling
    progress thread would otherwise serve it (the one CI failure: the put "returned")."""
    spaces, _, pool = _across(2, {"MORI_SHMEM_TIMEOUT": "3"})
    try:
        buf = pool.run(pe_ready, 3)[0]
        pid = pool.pids[3]
        assert pid is not None
        stop_process(pid)
        try:
            report, seconds = pool.run_on(0, pe_reach_hung, buf, 3, timeout=60)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        pool.kill()
        spaces.__exit__(None, None, None)
    put, atomic = report.split(" | ")
    assert put.startswith("put of 4096 bytes to PE 3 failed: ") and "MORI_SHMEM_TIMEOUT" in put, put
    assert atomic.startswith("atomic fetch_add on PE 3 failed: ") and "MORI_SHMEM_TIMEOUT" in atomic, atomic
    assert 3 <= seconds < 3 + 10, seconds


# -- where the remote transport cannot run ------------------------------------------------------
def _refusal(fn: object, *args: object) -> str:
    try:
        fn(*args)  # type: ignore[operator]
    except shmem.ShmemError as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not refuse")


def pe_calls_to_peer() -> list[str]:
    """Every host RMA call to the other PE: the address checks first, then the remote refusal;
    the PE's own heap still works and nothing was written anywhere."""
    import torch

    me = shmem.shmem_mype()
    other = 1 - me
    buf, sig = shmem.shmem_malloc(4096), shmem.shmem_malloc(8)
    try:
        shmem.shmem_putmem(buf, b"\0" * 4096, me)
        shmem.shmem_barrier_all()
        with pytest.raises(shmem.ShmemAddressError):
            shmem.shmem_putmem(buf, b"x" * 5000, other)  # past its block: refused before routing
        with pytest.raises(ValueError, match="out of range"):
            shmem.shmem_putmem(buf, b"x", 7)
        out = bytearray(16)
        messages = [
            _refusal(shmem.shmem_putmem, buf, b"x" * 64, other),
            _refusal(shmem.shmem_getmem, buf, 64, other),
            _refusal(shmem.shmem_getmem_into, out, buf, other),
            _refusal(shmem.shmem_putmem_signal, buf, b"x", sig, 1, shmem.SHMEM_SIGNAL_SET, other),
            _refusal(shmem.shmem_atomic_fetch_add, sig, 1, other),
            _refusal(shmem.shmem_atomic_add, sig, 1, other),
            _refusal(shmem.shmem_atomic_compare_swap, sig, 0, 1, other),
            _refusal(shmem.shmem_atomic_swap, sig, 1, other),
            _refusal(shmem.shmem_atomic_set, sig, 1, other),
            _refusal(shmem.shmem_atomic_fetch, sig, other),
        ]
        tensor = shmem.shmem_tensor((16,), torch.uint8)
        with pytest.raises(
            ValueError,
            match=f"PE {other} is not mapped in PE {me} .MORI_DISABLE_P2P is set.: "
            "it is reached through the remote transport",
        ):
            shmem.shmem_peer_tensor(tensor, other)
        shmem.shmem_free(tensor.data_ptr())
        shmem.shmem_putmem(buf, b"mine", me)
        assert shmem.shmem_getmem(buf, 4, me) == b"mine" and out == bytearray(16)
        assert shmem.shmem_atomic_fetch_add(sig, 5, me) == 0 and shmem.shmem_atomic_fetch(sig, me) == 5
        shmem.shmem_quiet()
        shmem.shmem_fence()
        shmem.shmem_barrier_all()
        return messages
    finally:
        shmem.shmem_free(buf)
        shmem.shmem_free(sig)


def test_without_ucx_disable_p2p_refuses_calls_to_peers_clearly() -> None:
    # Before: every call raised ValueError "PE 1 is not reachable from PE 0 (P2P disabled or another host)".
    pool = PePool(2, {**CPU_ENV, **NO_UCX, "MORI_DISABLE_P2P": "ON"})
    try:
        for pe, messages in enumerate(pool.run(pe_calls_to_peer)):
            assert len(messages) == 10
            for msg in messages:
                assert msg.startswith(
                    f"PE {1 - pe} is reached through mori.shmem's remote transport "
                    "(MORI_DISABLE_P2P is set), which is not available: mori-core's UCX engine "
                    "cannot start: UcxLoadError: "
                ), msg
                assert "(PEs 0, 1)" in msg, msg
    finally:
        pool.close()


class _OnePeBootstrap:
    """What open_remote asks of a bootstrap, for one PE whose peer answers the same."""

    def __init__(self, world: int) -> None:
        self.world = world

    def allgather(self, data: bytes) -> list[bytes]:
        return [data] * self.world


def test_a_gpu_heap_with_disable_p2p_and_a_ucx_without_cuda_is_refused_at_init() -> None:
    """This machine's UCX has no CUDA support (no GPU here; on the GPU machine, its system UCX 1.16
    has none either): a GPU heap whose peers go through the remote transport (MORI_DISABLE_P2P on one
    host) fails at init naming the UCX, what it lacks and what to install, where it used to
    initialize and stop its kernels at their first put to a peer."""
    from types import SimpleNamespace

    from mori.core import ucx
    from mori.core.memory import LiveRanges
    from mori.shmem._remote_setup import open_remote
    from mori.shmem._remote_ucx import why_unavailable

    me = HostIdentity("m", 1)
    reach = Reach.of(0, [me, me], p2p_disabled=True)
    gpu_heap = SimpleNamespace(kind="gpu")
    with pytest.raises(shmem.ShmemError) as info:
        open_remote(_OnePeBootstrap(2), gpu_heap, reach, 5.0, LiveRanges())  # type: ignore[arg-type]
    text = str(info.value)
    path = ucx.library_info()["path"]
    assert f"the UCX loaded ({path}) has no CUDA support" in text, text
    assert "install the libucx-cu13 wheel" in text and "(PEs 0, 1)" in text and "MORI_DISABLE_P2P" in text, text
    assert why_unavailable("cpu") == ""  # a CPU heap needs no CUDA (test_disable_p2p_on_one_host_... runs it)


def test_without_ucx_pes_on_two_hosts_are_refused_at_init_on_every_pe() -> None:
    spaces, _, pool = _across(2, NO_UCX, init=False)
    try:
        with pytest.raises(PeError) as info:
            pool.init()
    finally:
        pool.close()
        spaces.__exit__(None, None, None)
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2, 3]
    for text in failures.values():
        assert (
            "ShmemError: mori.shmem reaches PEs on other hosts through its remote transport, which is not "
            "available (mori-core's UCX engine cannot start: UcxLoadError: " in text
        ), text
        assert (
            "one machine but in 2 network namespaces" in text and "PEs 0, 1 on " in text and "PEs 2, 3 on " in text
        ), text
