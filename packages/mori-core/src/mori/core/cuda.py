"""Shared access to ``cuda-bindings``: lazy imports and result checking.

Every mori module that talks to the CUDA driver or NVRTC goes through here, so that

* importing mori works without ``cuda-bindings`` (the ``mori-core[cuda]`` extra): the import
  happens on first use and a missing package is reported with the command that installs it;
* every failed call raises :class:`CudaError` naming the call, the error code's name and the
  driver's (or NVRTC's) own description, instead of a bare enum value in a tuple.

Usage::

    drv = cuda.driver()
    ptr = cuda.check(drv.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = [
    "CudaError",
    "CudaUnavailableError",
    "call",
    "check",
    "describe",
    "driver",
    "entry_point",
    "init_device",
    "nvrtc",
    "poll",
]

_INSTALL_HINT = "install the CUDA extra: pip install 'mori-core[cuda]' (cuda-bindings and NVRTC)"


class CudaUnavailableError(ImportError):
    """``cuda-bindings`` is not installed, or the CUDA driver library cannot be loaded."""


class CudaError(RuntimeError):
    """A CUDA driver or NVRTC call failed.

    Attributes: ``call`` (the function that failed), ``code`` (the numeric result),
    ``name`` (e.g. ``CUDA_ERROR_OUT_OF_MEMORY``) and ``description`` (the library's text).
    """

    def __init__(self, call: str, code: int, name: str, description: str, detail: str = ""):
        self.call, self.code, self.name, self.description = call, code, name, description
        message = f"{call} failed: {name} ({code}): {description}"
        super().__init__(message + (f"; {detail}" if detail else ""))


#: The binding modules once imported: every launch asks for the driver module, and an import
#: lookup, even of a module already loaded, costs microseconds that an eager decode step feels.
_LOADED: dict[str, ModuleType] = {}


def _load(module: str) -> ModuleType:
    loaded = _LOADED.get(module)
    if loaded is not None:
        return loaded
    try:
        loaded = _LOADED[module] = importlib.import_module(f"cuda.bindings.{module}")
    except ImportError as err:
        raise CudaUnavailableError(f"mori needs cuda.bindings.{module} here ({err}); {_INSTALL_HINT}") from None
    return loaded


def driver() -> ModuleType:
    """The ``cuda.bindings.driver`` module (raises :class:`CudaUnavailableError` when missing)."""
    return _load("driver")


def nvrtc() -> ModuleType:
    """The ``cuda.bindings.nvrtc`` module (raises :class:`CudaUnavailableError` when missing)."""
    return _load("nvrtc")


def describe(result: Any) -> tuple[str, str]:
    """(name, description) of a CUresult or nvrtcResult, without ever raising."""
    name = getattr(result, "name", str(result))
    try:
        if type(result).__name__ == "nvrtcResult":
            err, text = nvrtc().nvrtcGetErrorString(result)
        else:
            err, text = driver().cuGetErrorString(result)
        if int(err) == 0 and text:
            return name, text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # the description is a courtesy; the name alone still identifies the error
        pass
    return name, "no description available"


def check(returned: Any, call: str, detail: str = "") -> Any:
    """Checks the result tuple of a ``cuda-bindings`` call and unwraps its outputs.

    ``returned`` is what the binding returned: ``(result,)``, ``(result, value)`` or
    ``(result, v1, v2, ...)``. Returns ``None``, ``value`` or the tuple of values respectively;
    raises :class:`CudaError` (with ``detail`` appended) when the result is not success.
    """
    result, *values = returned
    if int(result) != 0:
        name, description = describe(result)
        raise CudaError(call, int(result), name, description, detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(function: str, *args: Any, detail: str = "") -> Any:
    """Calls ``cuda.bindings.driver.<function>(*args)`` and checks it (see :func:`check`).

    A missing driver library (no NVIDIA driver on this machine) becomes
    :class:`CudaUnavailableError` naming the call.
    """
    fn = getattr(driver(), function)
    try:
        returned = fn(*args)
    except (OSError, RuntimeError) as err:
        # cuda-bindings loads libcuda on the first call; without a driver that raises here
        # (cuda.pathfinder's DynamicLibNotFoundError, a RuntimeError).
        if isinstance(err, OSError) or "DynamicLib" in type(err).__name__:
            raise CudaUnavailableError(
                f"{function}: the CUDA driver library (libcuda) could not be loaded: {err}"
            ) from None
        raise
    return check(returned, function, detail)


def entry_point(function: str, version: int = 12000) -> int:
    """The address of driver function ``function`` in its form of CUDA ``version`` (e.g. 12000
    for 12.0; ``cuGetProcAddress``), for native code that calls the driver without linking it;
    raises :class:`CudaError` when the driver lacks it."""
    drv = driver()
    flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    address, _ = check(drv.cuGetProcAddress(function.encode(), version, flags), "cuGetProcAddress", function)
    if not address:
        raise CudaError("cuGetProcAddress", 500, "CUDA_ERROR_NOT_FOUND", f"the driver has no {function}", "")
    return int(address)


_contexts: dict[int, Any] = {}


def init_device(device: int) -> Any:
    """Initialises the driver, retains ``device``'s primary context and makes it current.

    The primary context is the one the CUDA runtime (and so PyTorch and Triton) uses, so
    memory mori maps is visible to their kernels. Retained once per process and kept until
    exit, as the runtime does. Returns the ``CUcontext``.
    """
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise ValueError(f"device must be a CUDA device ordinal >= 0, got {device!r}")
    ctx = _contexts.get(device)
    if ctx is None:
        call("cuInit", 0)
        count = call("cuDeviceGetCount")
        if device >= count:
            raise ValueError(f"device {device} does not exist: this process sees {count} CUDA device(s)")
        dev = call("cuDeviceGet", device)
        ctx = call("cuDevicePrimaryCtxRetain", dev, detail=f"device {device}")
        _contexts[device] = ctx
    call("cuCtxSetCurrent", ctx, detail=f"device {device}")
    return ctx


def create_context(device: Any) -> Any:
    """A new CUDA context of its own on ``device`` (a ``CUdevice``), not the primary one, for
    native threads that must never wait for the primary context's lock (see ``csrc/ucx/gpu.hpp``).
    It becomes current on the calling thread; destroy it with ``cuCtxDestroy``. cuda-bindings 13
    takes creation parameters first, 12 does not."""
    try:
        return call("cuCtxCreate", None, 0, device)
    except TypeError:
        return call("cuCtxCreate", 0, device)


def poll(
    ready: Callable[[], bool],
    timeout: float,
    *,
    spin: float,
    pause: float,
    max_pause: float,
    yield_while_spinning: bool = False,
) -> bool:
    """The one completion wait of mori's GPU code: calls ``ready()`` until it returns True.

    ``ready`` is a non-blocking check (``cuEventQuery`` releases the GIL while it runs). For the
    first ``spin`` seconds the calls follow each other without sleeping (with ``time.sleep(0)``
    between them when ``yield_while_spinning``): a short copy ends in less than Linux's ~50 us
    oversleep. Then they are ``pause`` seconds apart, doubling up to ``max_pause``. Returns True
    once ready, False when ``timeout`` seconds passed first (it never sleeps past the timeout).
    """
    start = time.monotonic()
    end = start + timeout
    while not ready():
        now = time.monotonic()
        if now >= end:
            return False
        if now - start < spin:
            if yield_while_spinning:
                time.sleep(0)
        else:
            time.sleep(min(pause, end - now))
            pause = min(pause * 2, max_pause)
    return True
