"""PEs reached through the remote transport: on another host (two network namespaces joined by a
veth pair stand in for two hosts), or every peer with ``MORI_DISABLE_P2P``.

Until the transport runs on mori-core's UCX engine it is unavailable: PEs on several hosts are
refused at init on every PE, naming the hosts; ``MORI_DISABLE_P2P`` on one host initializes and
every call to a peer raises ``ShmemError`` saying why, after the same address checks as always.
"""

from __future__ import annotations

import pytest
import torch
from pe_pool import PeError, PePool

import mori.shmem as shmem
from mori.core.host import HostIdentity
from mori.core.testing import network_namespaces
from mori.shmem._reach import Reach

CPU_ENV = {"MORI_SHMEM_HEAP_SIZE": "1M", "MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_TIMEOUT": "30"}


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


def pe_view() -> dict[str, object]:
    """What this PE maps and reaches remotely, and shmem_ptr_p2p towards every PE."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    buf = shmem.shmem_malloc(256)
    try:
        info = shmem.shmem_heap_info()
        ptrs = [shmem.shmem_ptr_p2p(buf, me, pe) for pe in range(n)]
        return {"reachable": info["reachable"], "remote": info["remote"], "p2p": [p != 0 for p in ptrs],
                "own": ptrs[me] == buf}
    finally:
        shmem.shmem_free(buf)


def _refusal(fn: object, *args: object) -> str:
    try:
        fn(*args)  # type: ignore[operator]
    except shmem.ShmemError as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not refuse")


def pe_calls_to_peer() -> list[str]:
    """Every host RMA call to the other PE: the address checks first, then the remote refusal;
    the PE's own heap still works and nothing was written anywhere."""
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
        with pytest.raises(ValueError, match=f"PE {other} is not mapped in PE {me} .MORI_DISABLE_P2P is set.: "
                                             "it is reached through the remote transport"):
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


def test_disable_p2p_on_one_host_refuses_calls_to_peers_clearly() -> None:
    # Before: every call raised ValueError "PE 1 is not reachable from PE 0 (P2P disabled or another host)".
    for value in ("ON", "1", "true"):
        pool = PePool(2, {**CPU_ENV, "MORI_DISABLE_P2P": value})
        try:
            views = pool.run(pe_view)
            assert views == [{"reachable": [pe], "remote": [1 - pe], "p2p": [pe == 0, pe == 1], "own": True}
                             for pe in range(2)]
            for pe, messages in enumerate(pool.run(pe_calls_to_peer)):
                assert len(messages) == 10
                for msg in messages:
                    assert msg.startswith(f"PE {1 - pe} is reached through mori.shmem's remote transport "
                                          "(MORI_DISABLE_P2P is set), which is not available: "), msg
        finally:
            pool.close()


def test_pes_on_two_hosts_are_refused_at_init_on_every_pe() -> None:
    """2 + 2 PEs in two network namespaces, the unique id advertising host A: every PE's init
    raises ShmemError naming the unavailable transport and the PEs of each host."""
    with network_namespaces() as (a, b):
        env = {**CPU_ENV, "MORI_BOOTSTRAP_HOST": a.address}
        pool = PePool(4, env, init=False, netns=[a.name, a.name, b.name, b.name])
        try:
            with pytest.raises(PeError) as info:
                pool.init()
        finally:
            pool.close()
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2, 3]
    for text in failures.values():
        assert "ShmemError: mori.shmem reaches PEs on other hosts through its remote transport, which is not " \
               "available" in text, text
        assert "one machine but in 2 network namespaces" in text and "PEs 0, 1 on " in text \
               and "PEs 2, 3 on " in text, text
