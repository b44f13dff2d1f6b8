"""Every host API call of the MORI guide, on real PE processes (2 and 4) sharing the CPU heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pe_pool import PeError, PePool, make_uid, set_env

import mori.shmem as shmem
from mori import shmem as shmem_from


def pe_queries() -> tuple[int, int, int, bool]:
    return shmem.shmem_mype(), shmem.shmem_npes(), shmem.shmem_num_qp_per_pe(), shmem.shmem_is_initialized()


def test_imports_are_one_module() -> None:
    assert shmem_from is shmem
    assert shmem.MORI_SHMEM_INIT_WITH_MPI_COMM == 0 and shmem.MORI_SHMEM_INIT_WITH_UNIQUEID == 1


def test_queries(pool: PePool) -> None:
    assert pool.run(pe_queries) == [(r, pool.n, 1, True) for r in range(pool.n)]


def pe_malloc_program(program: list[tuple[str, int, int]]) -> list[object]:
    """Runs a malloc/free program; returns heap offsets so PEs can be compared."""
    info = shmem.shmem_heap_info()
    base, max_align = int(info["base"], 16), info["max_alignment"]
    live: list[int] = []
    trace: list[object] = []
    try:
        for kind, a, b in program:
            if kind == "malloc":
                try:
                    ptr = shmem.shmem_malloc_align(1 << b, a) if b else shmem.shmem_malloc(a)
                except shmem.ShmemOutOfMemoryError:
                    trace.append("oom")
                    continue
                except ValueError:
                    assert 1 << b > max_align, "only alignments beyond the heap base's are refused"
                    trace.append("too aligned")
                    continue
                assert ptr % (1 << b) == 0
                live.append(ptr)
                trace.append(ptr - base)
            elif live:
                shmem.shmem_free(live.pop(a % len(live)))
    finally:
        for ptr in live:
            shmem.shmem_free(ptr)
    return trace


_op = st.one_of(
    st.tuples(st.just("malloc"), st.integers(1, 1 << 20), st.integers(0, 14)),
    st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
)


@settings(max_examples=15, deadline=None)
@given(st.lists(_op, max_size=30))
def test_malloc_offsets_symmetric(pool: PePool, program: list[tuple[str, int, int]]) -> None:
    traces = pool.run(pe_malloc_program, program)
    assert all(t == traces[0] for t in traces), "every PE got the same offsets"


def pe_exhaust() -> str:
    size = shmem.shmem_heap_info()["size"]
    ptr = shmem.shmem_malloc(size // 2)
    try:
        shmem.shmem_malloc(size // 2)
    except shmem.ShmemOutOfMemoryError as exc:
        return str(exc)
    finally:
        shmem.shmem_free(ptr)
    return "no error"


def test_exhaustion_error(pool: PePool) -> None:
    size = 8 << 20
    for text in pool.run(pe_exhaust):
        assert f"heap size {size} bytes" in text and f"requested {size // 2} bytes" in text
        assert f"in use {size // 2} bytes" in text


def pe_ext_malloc_and_zero_size() -> tuple[int, int, str]:
    ptr = shmem.shmem_ext_malloc_with_flags(300, 1)
    aligned = shmem.shmem_malloc_align(4096, 10)
    zero = shmem.shmem_malloc(0)
    try:
        shmem.shmem_ext_malloc_with_flags(16, -1)
        err = ""
    except ValueError as exc:
        err = str(exc)
    shmem.shmem_free(zero)
    out = (ptr % 256, aligned % 4096, err)
    shmem.shmem_free(ptr)
    shmem.shmem_free(aligned)
    return out


def test_malloc_variants(pool: PePool) -> None:
    for rem, rem4k, err in pool.run(pe_ext_malloc_and_zero_size):
        assert (rem, rem4k) == (0, 0)
        assert "flags" in err


def pe_ptr_p2p() -> list[object]:
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    ptr = shmem.shmem_malloc(4096)
    mine = os.urandom(4096)
    import ctypes

    ctypes.memmove(ptr, mine, 4096)
    shmem.shmem_barrier_all()
    seen = []
    for pe in range(n):
        remote = shmem.shmem_ptr_p2p(ptr, me, pe)
        seen.append(ctypes.string_at(remote, 4096))
    assert shmem.shmem_ptr_p2p(ptr, me, me) == ptr
    bad = [shmem.shmem_ptr_p2p(12345, me, 0), shmem.shmem_ptr_p2p(ptr, me, n), shmem.shmem_ptr_p2p(ptr, me, -1)]
    shmem.shmem_barrier_all()
    shmem.shmem_free(ptr)
    return [mine, seen, bad]


def test_ptr_p2p_reads_peer_memory(pool: PePool) -> None:
    results = pool.run(pe_ptr_p2p)
    mine = [r[0] for r in results]
    for _, seen, bad in results:
        assert seen == mine, "reading through shmem_ptr_p2p shows each peer's bytes"
        assert bad == [0, 0, 0]


def pe_register() -> list[object]:
    buf = bytearray(1 << 16)
    import ctypes

    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    out: list[object] = [shmem.shmem_buffer_register(addr, len(buf))]
    for args in ((addr + 100, 10), (0, 10), (addr, 0)):
        try:
            shmem.shmem_buffer_register(*args)
            out.append("accepted")
        except ValueError:
            out.append("rejected")
    out.append(shmem.shmem_buffer_deregister(addr, len(buf)))
    try:
        shmem.shmem_buffer_deregister(addr, len(buf))
        out.append("accepted")
    except ValueError:
        out.append("rejected")
    return out


def test_buffer_register(pool: PePool) -> None:
    assert pool.run(pe_register) == [[0, "rejected", "rejected", "rejected", 0, "rejected"]] * pool.n


def pe_barrier_order(rounds: int) -> list[int]:
    """Each round every PE bumps a counter on PE 0, then barriers: after round k PE 0 sees k*n."""
    me = shmem.shmem_mype()
    counter = shmem.shmem_malloc(8)
    shmem.shmem_atomic_set(counter, 0, me)
    shmem.shmem_barrier_all()
    seen = []
    for _ in range(rounds):
        shmem.shmem_atomic_add(counter, 1, 0)
        shmem.shmem_barrier_all()
        seen.append(shmem.shmem_atomic_fetch(counter, 0))
        shmem.shmem_barrier_all()
    shmem.shmem_free(counter)
    return seen


def test_barrier_ordering(pool: PePool) -> None:
    for seen in pool.run(pe_barrier_order, 20):
        assert seen == [pool.n * (k + 1) for k in range(20)]


def pe_barrier_on_stream_and_module_init() -> tuple[list[str], int]:
    shmem.shmem_barrier_on_stream(None)  # CPU heap: a host barrier
    refusals = []
    for call in (lambda: shmem.shmem_module_init(1), lambda: shmem.shmem_load_module("", "empty.cu")):
        try:
            call()
            refusals.append("accepted")
        except shmem.ShmemError as exc:
            refusals.append(str(exc))
    return refusals, len(shmem.get_gpu_states_bytes())


def test_stream_barrier_and_module_init_on_cpu(pool: PePool) -> None:
    for refusals, nstates in pool.run(pe_barrier_on_stream_and_module_init):
        assert nstates == 64
        assert refusals[0].startswith("shmem_module_init needs a GPU heap"), refusals
        assert refusals[1].startswith("shmem_load_module needs a GPU heap"), refusals


def pe_double_init() -> str:
    try:
        shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, bytes(128))
    except shmem.ShmemError as exc:
        return str(exc)
    return "accepted"


def test_double_init_rejected(pool: PePool) -> None:
    assert all("already initialized" in m for m in pool.run(pe_double_init))


def pe_finalize() -> tuple[str, bool]:
    shmem.shmem_finalize()
    try:
        shmem.shmem_malloc(16)
    except shmem.ShmemNotInitializedError as exc:
        return str(exc), shmem.shmem_is_initialized()
    return "accepted", True


def pe_reinit_check() -> tuple[int, int]:
    ptr = shmem.shmem_malloc(64)
    me = shmem.shmem_mype()
    shmem.shmem_putmem(ptr, me.to_bytes(8, "little"), (me + 1) % shmem.shmem_npes())
    shmem.shmem_barrier_all()
    got = int.from_bytes(shmem.shmem_getmem(ptr, 8, me), "little")
    shmem.shmem_free(ptr)
    return me, got


def test_finalize_then_reinit(pool: PePool) -> None:
    for msg, initialized in pool.run(pe_finalize):
        assert "not initialized" in msg and not initialized
    pool.init()
    n = pool.n
    assert pool.run(pe_reinit_check) == [(r, (r - 1) % n) for r in range(n)]


def pe_bad_init_args() -> list[str]:
    out = []
    for args in ((7, 0, 1, bytes(128)), (1, 0, 1, b"short"), (1, 3, 2, bytes(128)), (1, 0, 0, bytes(128))):
        try:
            shmem.shmem_init_attr(*args)
            out.append("accepted")
        except (ValueError, TypeError) as exc:
            out.append(type(exc).__name__)
    return out


def test_calls_before_init_and_bad_init() -> None:
    pool = PePool(1, {"MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_HEAP_SIZE": "1M"}, init=False)
    try:
        with pytest.raises(PeError, match="not initialized"):
            pool.run(pe_queries)
        assert pool.run(pe_bad_init_args) == [["ValueError"] * 4]
        pool.init()
        assert pool.run(pe_queries) == [(0, 1, 1, True)]
    finally:
        pool.close()


def test_settings_mismatch_fails_on_every_pe() -> None:
    # PEs with different heap sizes cannot be symmetric: init must fail everywhere, not hang.
    pool = PePool(2, {"MORI_SHMEM_BACKEND": "cpu"}, init=False, timeout=60)
    try:
        pool.run_each(set_env, [("MORI_SHMEM_HEAP_SIZE", "1M"), ("MORI_SHMEM_HEAP_SIZE", "2M")])
        with pytest.raises(PeError) as info:
            pool.init()
        for rank in (0, 1):
            assert f"PE {rank}: ShmemError: PEs disagree on the heap settings" in str(info.value)
        assert "cpu 1048576 static" in str(info.value) and "cpu 2097152 static" in str(info.value)
    finally:
        pool.close()


def pe_init_in_own_netns(rank: int, world: int, uid: bytes, move: bool) -> str:
    """Joins the bootstrap, then (``move``) enters a network namespace of its own, then inits shmem.

    The bootstrap's TCP connections were made before the move and keep working (a socket stays in
    the namespace it was made in), as between containers that reach each other over a bridge.
    """
    import ctypes

    from mori.core import Bootstrap
    from mori.shmem import _state

    bootstrap = Bootstrap(rank, world, uid)
    if move:
        clone_newuser, clone_newnet = 0x10000000, 0x40000000
        flags = clone_newnet if os.geteuid() == 0 else clone_newnet | clone_newuser
        if ctypes.CDLL(None, use_errno=True).unshare(flags) != 0:
            bootstrap.close()
            return f"unshare: {os.strerror(ctypes.get_errno())}"
    try:
        _state.initialize(bootstrap, owns_bootstrap=True)
    except shmem.ShmemError as exc:
        return str(exc)
    return "initialized"


def test_pes_in_two_network_namespaces_without_ucx_fail_at_init_on_every_pe() -> None:
    # Before: init passed (same boot id) and the CPU heap crashed with IndexError mapping peers.
    # With UCX, PEs of two namespaces reach each other through the remote transport (test_remote.py).
    pool = PePool(
        2,
        {"MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_HEAP_SIZE": "1M", "MORI_UCX_LIB": "/nonexistent/libucp.so.0"},
        init=False,
        timeout=60,
    )
    try:
        uid = pool.run_on(0, make_uid)
        results = pool.run_each(pe_init_in_own_netns, [(0, 2, uid, False), (1, 2, uid, True)])
    finally:
        pool.close()
    if results[1].startswith("unshare:"):
        pytest.skip(f"this kernel refuses a network namespace to this user ({results[1]})")
    for msg in results:
        assert "one machine but in 2 network namespaces" in msg, msg
        assert "PEs 0 on " in msg and "PEs 1 on " in msg and "host networking" in msg, msg


def test_import_mori_then_attribute() -> None:
    # MORI's idiom: `import mori` and then `mori.shmem.…`, with nothing else imported first.
    code = (
        "import mori\n"
        "try:\n    mori.shmem.shmem_mype()\nexcept mori.shmem.ShmemNotInitializedError:\n    print('ok')\n"
        "try:\n    mori.nothing\nexcept AttributeError:\n    print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["ok", "ok"], done.stderr
