"""The symmetric allocator: properties under random malloc/free sequences, and symmetry across PEs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.shmem._allocator import INTERNAL_BYTES, MIN_ALIGNMENT, ShmemOutOfMemoryError, SymmetricAllocator

HEAP = 1 << 20

# A program: ("malloc", size, log2 alignment) or ("free", index into the live blocks).
_op = st.one_of(
    st.tuples(st.just("malloc"), st.integers(1, 96 * 1024), st.integers(0, 16)),
    st.tuples(st.just("free"), st.integers(0, 1 << 30), st.just(0)),
)
programs = st.lists(_op, max_size=60)


def run_program(alloc: SymmetricAllocator, program: list[tuple[str, int, int]]) -> list[object]:
    """Applies a program; returns what each step gave (offset, freed size or the OOM marker)."""
    live: list[tuple[int, int, int]] = []  # (offset, size, alignment)
    trace: list[object] = []
    for kind, a, b in program:
        if kind == "malloc":
            try:
                off = alloc.malloc(a, 1 << b)
            except ShmemOutOfMemoryError:
                trace.append("oom")
                continue
            live.append((off, a, 1 << b))
            trace.append(off)
        elif live:
            off, _, _ = live.pop(a % len(live))
            trace.append(("free", alloc.free(off)))
        check_invariants(alloc, live)
    return trace


def check_invariants(alloc: SymmetricAllocator, live: list[tuple[int, int, int]]) -> None:
    blocks = alloc.blocks()
    assert sorted(blocks) == sorted(off for off, _, _ in live)
    for off, size, align in live:
        assert off % max(align, MIN_ALIGNMENT) == 0, "alignment honoured"
        assert off >= INTERNAL_BYTES, "internal area never handed out"
        assert blocks[off] - off >= size
        assert blocks[off] <= HEAP
    spans = sorted(list(blocks.items()) + alloc.free_ranges())
    # Blocks and free ranges tile [INTERNAL_BYTES, HEAP) modulo alignment padding, never overlapping.
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1, f"overlap: {s0:#x}..{e0:#x} and {s1:#x}"
    free = alloc.free_ranges()
    for (_, e0), (s1, _) in zip(free, free[1:]):
        assert e0 < s1, "adjacent free ranges are coalesced"
    assert alloc.in_use == sum(e - s for s, e in blocks.items())


@settings(max_examples=300, deadline=None)
@given(programs)
def test_random_programs_keep_invariants(program: list[tuple[str, int, int]]) -> None:
    run_program(SymmetricAllocator(HEAP), program)


@settings(max_examples=100, deadline=None)
@given(programs)
def test_same_program_same_offsets(program: list[tuple[str, int, int]]) -> None:
    # Determinism is what makes addresses symmetric: two PEs running one program agree.
    assert run_program(SymmetricAllocator(HEAP), program) == run_program(SymmetricAllocator(HEAP), program)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 64 * 1024), min_size=1, max_size=40))
def test_free_everything_restores_one_range(sizes: list[int]) -> None:
    alloc = SymmetricAllocator(HEAP)
    offs = []
    for size in sizes:
        try:
            offs.append(alloc.malloc(size))
        except ShmemOutOfMemoryError:
            break
    for off in offs[::2] + offs[1::2]:  # free out of order: coalescing must still heal it
        alloc.free(off)
    assert alloc.free_ranges() == [(INTERNAL_BYTES, HEAP)]
    assert alloc.in_use == 0


def test_reuse_after_free() -> None:
    alloc = SymmetricAllocator(HEAP)
    a = alloc.malloc(4096)
    alloc.malloc(4096)
    alloc.free(a)
    assert alloc.malloc(1000) == a


def test_exhaustion_error_states_sizes() -> None:
    alloc = SymmetricAllocator(HEAP)
    alloc.malloc(HEAP // 2)
    with pytest.raises(ShmemOutOfMemoryError) as info:
        alloc.malloc(HEAP // 2)
    text = str(info.value)
    assert f"heap size {HEAP} bytes" in text
    assert f"in use {HEAP // 2} bytes" in text
    assert f"requested {HEAP // 2} bytes" in text
    assert alloc.in_use == HEAP // 2, "a failed malloc changes nothing"


@pytest.mark.parametrize("size,align", [(0, 256), (-1, 256), (10, 3), (10, 0), (1.5, 256)])
def test_bad_requests(size: object, align: int) -> None:
    alloc = SymmetricAllocator(HEAP)
    with pytest.raises(ValueError):
        alloc.malloc(size, align)  # type: ignore[arg-type]
    assert alloc.in_use == 0


def test_free_of_unknown_offset() -> None:
    alloc = SymmetricAllocator(HEAP)
    off = alloc.malloc(512)
    with pytest.raises(ValueError, match="not the start"):
        alloc.free(off + 256)
    alloc.free(off)
    with pytest.raises(ValueError):
        alloc.free(off)


def test_alignment_beyond_base_refused() -> None:
    alloc = SymmetricAllocator(HEAP, max_alignment=4096)
    assert alloc.malloc(10, 4096) % 4096 == 0
    with pytest.raises(ValueError, match="exceeds 4096"):
        alloc.malloc(10, 8192)


def test_high_water_tracks_live_blocks() -> None:
    alloc = SymmetricAllocator(HEAP)
    assert alloc.high_water == INTERNAL_BYTES
    a = alloc.malloc(1000)
    b = alloc.malloc(1000)
    assert alloc.high_water == b + 1024
    alloc.free(b)
    assert alloc.high_water == a + 1024
