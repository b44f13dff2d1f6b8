"""The module-init hook chains with others' hooks; the jit wrapper fills in extern_libs."""

from __future__ import annotations

import triton
import triton.language as tl

from mori.triton import (
    MoriKernel,
    _runtime,
    find_bitcode,
    get_extern_libs,
    install_hook,
    jit,
    shmem,
    uninstall_hook,
)


@triton.jit
def _tiny(out):
    tl.store(out, shmem.my_pe())


def test_extern_libs_names_the_bitcode():
    assert get_extern_libs() == {shmem.LIB_NAME: find_bitcode()}


def test_hook_chains_and_uninstalls_only_itself():
    chain = triton.knobs.runtime.kernel_load_end_hook
    seen = []

    def other(*args, **kwargs):
        seen.append(args)

    chain.add(other)
    try:
        install_hook()
        install_hook()  # idempotent
        assert chain.calls.count(_runtime._on_kernel_load) == 1 and other in chain.calls
        chain(None, None, "k", {}, "hash")  # a load without a module (start-hook shape) is ignored
        assert seen == [(None, None, "k", {}, "hash")]
        uninstall_hook()
        assert _runtime._on_kernel_load not in chain.calls and other in chain.calls
    finally:
        chain.remove(other)
        uninstall_hook()


def test_jit_wraps_and_fills_extern_libs():
    kernel = jit(_tiny)
    assert isinstance(kernel, MoriKernel) and jit(kernel) is kernel
    assert kernel.fn is _tiny and kernel.arg_names == ["out"]  # other attributes pass through
    kwargs = kernel._kwargs({"num_warps": 2, "extern_libs": {"mine": "/x.bc"}})
    assert kwargs["extern_libs"] == {"mine": "/x.bc", shmem.LIB_NAME: find_bitcode()} and kwargs["num_warps"] == 2
    uninstall_hook()

    @jit(do_not_specialize=["n"])
    def plain(out, n):
        tl.store(out, n)

    assert isinstance(plain, MoriKernel) and plain.fn.do_not_specialize == ["n"]
