"""UMBPHostMemAllocator, as SGLang's UMBPHostTensorAllocator calls it."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest

from mori.umbp import UMBPHostBufferBacking, UMBPHostBufferHandle, UMBPHostMemAllocator


def test_alloc_as_sglang_does_and_free() -> None:
    allocator = UMBPHostMemAllocator()
    nbytes = 3 * 4096 + 10
    handle = allocator.alloc(nbytes, UMBPHostBufferBacking.Anonymous, 2 << 20, -1, True)
    assert handle and handle.ptr % mmap.PAGESIZE == 0
    assert (handle.requested_size, handle.mapped_size) == (nbytes, 4 * 4096)
    assert (handle.actual_backing, handle.actual_alignment) == (UMBPHostBufferBacking.Anonymous, mmap.PAGESIZE)
    view = (ctypes.c_byte * nbytes).from_address(handle.ptr)  # SGLang wraps it so, then torch.frombuffer
    array = np.frombuffer(view, dtype=np.uint8)
    array[:] = 7
    assert ctypes.string_at(handle.ptr + nbytes - 3, 3) == b"\x07\x07\x07"
    del array, view
    assert "requested_size=12298" in repr(handle)
    allocator.free(handle)
    assert not handle and handle.ptr == 0
    allocator.free(handle)  # again: nothing


def test_hugetlb_falls_back_to_ordinary_pages_when_there_are_none() -> None:
    handle = UMBPHostMemAllocator().alloc(1 << 20, UMBPHostBufferBacking.AnonymousHugetlb)
    assert handle
    assert handle.actual_backing in (UMBPHostBufferBacking.AnonymousHugetlb, UMBPHostBufferBacking.Anonymous)
    if handle.actual_backing == UMBPHostBufferBacking.AnonymousHugetlb:
        assert handle.mapped_size % (2 << 20) == 0
    UMBPHostMemAllocator().free(handle)


def test_shared_backing_has_an_fd_another_mapping_sees() -> None:
    allocator = UMBPHostMemAllocator()
    handle = allocator.alloc(8192, UMBPHostBufferBacking.AnonymousShm)
    assert handle.actual_backing == UMBPHostBufferBacking.AnonymousShm and handle.fd >= 0
    ctypes.memset(handle.ptr, 0x5A, 8192)
    with mmap.mmap(os.dup(handle.fd), 8192) as other:
        assert other[:4] == b"ZZZZ"
    allocator.free(handle)
    assert handle.fd == -1


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((0,), ValueError),
        ((-1,), ValueError),
        ((4096, 1), TypeError),
        ((4096, UMBPHostBufferBacking.Anonymous, 3000), ValueError),
        ((4096, UMBPHostBufferBacking.Anonymous, 2 << 20, -2), ValueError),
    ],
)
def test_bad_arguments(args, error) -> None:
    with pytest.raises(error):
        UMBPHostMemAllocator().alloc(*args)
    with pytest.raises(TypeError):
        UMBPHostMemAllocator().free("handle")  # type: ignore[arg-type]
    assert not UMBPHostBufferHandle()
