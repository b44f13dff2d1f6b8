"""Linking and initialising Triton kernels that call mori's device API.

- :func:`get_extern_libs` gives the ``extern_libs=`` argument that links the device bitcode;
- :func:`install_hook` makes Triton call ``mori.shmem.shmem_module_init`` on every kernel module
  it loads that defines ``globalGpuStates`` (the device state each module carries a copy of);
- :func:`jit` wraps a ``@triton.jit`` kernel so it launches with both, without ``extern_libs``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import triton
from mori.core.log import get_logger

from ._bitcode import find_bitcode
from .shmem import LIB_NAME

__all__ = [
    "get_extern_libs",
    "install_hook",
    "uninstall_hook",
    "init_loaded_modules",
    "loaded_modules",
    "jit",
    "MoriKernel",
]

_log = get_logger("shmem")
# A module that uses mori's device API has at least one of them (the second is the constant-memory
# mirror the hot paths read).
_STATE_SYMBOLS = (b"globalGpuStates", b"globalGpuStatesFast")
_lock = threading.Lock()
_installed: dict[str, Any] = {}
_modules: list[tuple[int, int]] = []  # (CUmodule handle, device) of every mori module initialised


def get_extern_libs() -> dict[str, str]:
    """``{"libmori_shmem_device": path}``: pass as ``extern_libs=`` when launching a kernel."""
    return {LIB_NAME: find_bitcode()}


def _has_state(module: int) -> bool:
    from cuda.bindings import driver

    handle = driver.CUmodule(module)
    return any(driver.cuModuleGetGlobal(handle, s)[0] == driver.CUresult.CUDA_SUCCESS for s in _STATE_SYMBOLS)


def _current_device() -> int:
    from triton.runtime import driver

    return int(driver.active.get_current_device())


def _init_module(module: int) -> None:
    if not module or not _has_state(module):
        return  # not a mori kernel: leave it alone (and work before shmem is initialised)
    import mori.shmem

    mori.shmem.shmem_module_init(module)
    entry = (int(module), _current_device())
    with _lock:
        if entry not in _modules:
            _modules.append(entry)
    _log.debug("initialised globalGpuStates of module %#x on device %d", *entry)


def _on_kernel_load(module: Any, function: Any, name: str, metadata_group: Any, hash: str) -> None:
    _init_module(int(module) if module is not None else 0)


def _load_end_hooks() -> Any:
    """Triton's chain of kernel-load hooks (``knobs.runtime.kernel_load_end_hook``, Triton 3.5 and later)."""
    chain = getattr(triton.knobs.runtime, "kernel_load_end_hook", None)
    if chain is None or not hasattr(chain, "add"):
        raise RuntimeError(
            f"Triton {triton.__version__} has no knobs.runtime.kernel_load_end_hook chain "
            "to initialise mori's kernel modules from (mori-triton needs Triton 3.6 or later)"
        )
    return chain


def install_hook() -> None:
    """Initialise ``globalGpuStates`` in every kernel module Triton loads from now on (idempotent).

    Chains with hooks others installed; never replaces them. Modules without ``globalGpuStates``
    are skipped, so ordinary kernels are unaffected.
    """
    with _lock:
        if _installed:
            return
        _load_end_hooks().add(_on_kernel_load)
        _installed["load_end"] = _on_kernel_load


def uninstall_hook() -> None:
    """Removes what :func:`install_hook` added, leaving other hooks in place."""
    with _lock:
        if "load_end" in _installed:
            _load_end_hooks().remove(_installed.pop("load_end"))


def loaded_modules() -> list[tuple[int, int]]:
    """``(module handle, device)`` of every mori kernel module initialised so far."""
    with _lock:
        return list(_modules)


def init_loaded_modules() -> int:
    """Re-writes the device state into every module initialised so far (after a shmem re-init).

    Only modules of the current device are written; returns how many.
    """
    device = _current_device()
    count = 0
    for module, dev in loaded_modules():
        if dev == device:
            _init_module(module)
            count += 1
    return count


class MoriKernel:
    """A ``@triton.jit`` kernel that launches with mori's bitcode linked and its module initialised.

    ``kernel[grid](*args, **kwargs)`` and ``kernel.warmup(...)`` behave as Triton's, with
    ``extern_libs`` filled in; every other attribute is the wrapped kernel's.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def _kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        install_hook()
        libs = dict(kwargs.get("extern_libs") or {})
        libs.setdefault(LIB_NAME, find_bitcode())
        return {**kwargs, "extern_libs": libs}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launcher = self.fn[grid]
        return lambda *args, **kwargs: launcher(*args, **self._kwargs(kwargs))

    def warmup(self, *args: Any, **kwargs: Any) -> Any:
        """Compiles (without launching) with the bitcode linked; returns Triton's compiled kernel."""
        return self.fn.warmup(*args, **self._kwargs(kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)


def jit(fn: Any = None, **triton_kwargs: Any) -> Any:
    """Decorator: ``@mori.triton.jit`` (or ``@mori.triton.jit(num_warps=...)`` passing Triton's options).

    Accepts a plain function (compiled with ``triton.jit``) or an existing ``JITFunction``.
    """

    def wrap(f: Any) -> MoriKernel:
        if isinstance(f, MoriKernel):
            return f
        if not isinstance(f, triton.runtime.jit.JITFunction):
            f = triton.jit(f, **triton_kwargs)
        return MoriKernel(f)

    return wrap if fn is None else wrap(fn)
