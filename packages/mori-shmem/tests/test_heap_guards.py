"""mori.shmem's edges (issue 11, hole 9), between real PE processes on the CPU heap: host writes
(puts, signals, atomics) into the reserved first 64 KiB or past a block's allocation are refused
(reads stay allowed: tools read the peer table), sizes are checked before anything is allocated,
and asymmetric allocation sequences are detected."""

from __future__ import annotations

from pe_pool import PePool, set_env

import mori.shmem as shmem
from mori.shmem._allocator import INTERNAL_BYTES


def pe_guarded_ranges() -> list[str]:
    me = shmem.shmem_mype()
    base = int(shmem.shmem_heap_info()["base"], 16)
    buf = shmem.shmem_malloc(4096)
    shmem.shmem_putmem(buf, b"\x11" * 4096, me)
    shmem.shmem_barrier_all()
    calls = {
        "reserved put": lambda: shmem.shmem_putmem(base + 128, b"x" * 8, me),
        "reserved atomic": lambda: shmem.shmem_atomic_add(base + INTERNAL_BYTES - 8, 1, me),
        "past the block": lambda: shmem.shmem_putmem(buf, b"y" * 5000, me),
        "between blocks": lambda: shmem.shmem_putmem(buf + 4096, b"y" * 8, me),
        "huge get": lambda: shmem.shmem_getmem(buf, 2**40, me),
    }
    out = []
    for name, call in calls.items():
        try:
            call()
            out.append(f"{name}: accepted")
        except shmem.ShmemAddressError as exc:
            out.append(f"{name}: {exc}")
    intact = shmem.shmem_getmem(buf, 4096, me) == b"\x11" * 4096
    shmem.shmem_putmem(buf + 4000, b"z" * 96, me)  # the block's last bytes are still fine
    shmem.shmem_barrier_all()
    shmem.shmem_free(buf)
    return [*out, f"intact: {intact}"]


def test_reserved_area_block_ends_and_sizes(pool: PePool) -> None:
    for result in pool.run(pe_guarded_ranges):
        assert not any(r.endswith("accepted") for r in result), result
        assert "reserved for mori" in result[0] and "reserved for mori" in result[1]
        assert "past the end of the 4096-byte block" in result[2]
        assert "outside every live shmem_malloc block" in result[3]
        assert "huge get" in result[4] and "outside the symmetric heap" in result[4]
        assert result[-1] == "intact: True"


def pe_asymmetric(debug: bool) -> str:
    me = shmem.shmem_mype()
    set_env("MORI_SHMEM_DEBUG", "1" if debug else "0")
    extra = 0
    try:
        extra = shmem.shmem_malloc(512 if me == 0 else 1024)  # PEs disagree
        shmem.shmem_barrier_all()
        return "accepted"
    except shmem.ShmemError as exc:
        return str(exc)
    finally:
        if extra:
            shmem.shmem_free(extra)
        set_env("MORI_SHMEM_DEBUG", "0")
        shmem.shmem_barrier_all()  # symmetric again once the odd blocks are gone


def test_asymmetric_allocation_is_detected(pool: PePool) -> None:
    # At the next barrier by default; at the malloc itself with MORI_SHMEM_DEBUG.
    for debug in (False, True):
        for msg in pool.run(pe_asymmetric, debug):
            assert "asymmetric symmetric-heap allocation" in msg and "PE 1" in msg, msg
            if debug:
                assert "now shmem_malloc_align(256, 1024)" in msg or "now shmem_malloc_align(256, 512)" in msg
