"""What ``IOEngine.register_memory`` and ``register_torch_tensor`` check and add to a region's
descriptor before its backends and the registry see it."""

from __future__ import annotations

from typing import Any

from .types import MemoryDesc, MemoryLocationType

__all__ = ["checked_region", "device_bus_id", "merge_extra", "tensor_region"]


def checked_region(ptr: Any, size: Any, device_id: Any, mem_loc: Any) -> MemoryLocationType:
    """The location of a region to register; ``TypeError``/``ValueError`` naming what is wrong."""
    for name, v in (("ptr", ptr), ("size", size), ("device_id", device_id)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"register_memory: {name} must be an int, got {type(v).__name__}")
    if ptr <= 0 or size <= 0 or ptr + size > 1 << 64:
        raise ValueError(f"register_memory: invalid region ptr={ptr:#x} size={size}")
    loc = MemoryLocationType(mem_loc)
    if loc == MemoryLocationType.Unknown:
        raise ValueError("register_memory: mem_loc must be CPU or GPU")
    return loc


def tensor_region(tensor: Any) -> tuple[int, int, int, MemoryLocationType]:
    """(address, bytes, device id, location) of a contiguous torch tensor's storage (CPU or CUDA)."""
    if not tensor.is_contiguous():
        raise ValueError("register_torch_tensor: the tensor must be contiguous")
    kind = tensor.device.type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"register_torch_tensor: unsupported device {tensor.device}")
    loc = MemoryLocationType.GPU if kind == "cuda" else MemoryLocationType.CPU
    index = tensor.device.index
    return tensor.data_ptr(), tensor.numel() * tensor.element_size(), -1 if index is None else index, loc


def merge_extra(desc: MemoryDesc, from_backend: MemoryDesc | None) -> MemoryDesc:
    """``desc`` with the backend data a backend's ``register_memory`` returned in ``extra``."""
    if from_backend is not None and from_backend.extra:
        desc.extra.update(from_backend.extra)
    return desc


def device_bus_id(device_id: int) -> str:
    """The PCI bus id of CUDA device ``device_id``, or "" where CUDA cannot tell (no driver here:
    the region was registered by no backend that needs CUDA)."""
    from mori.core import cuda as _cuda  # cuda-bindings itself is imported at the first call

    try:
        _cuda.call("cuInit", 0)  # idempotent; a TCP-only engine may not have initialised CUDA yet
        raw = _cuda.call("cuDeviceGetPCIBusId", 32, _cuda.call("cuDeviceGet", device_id))
    except (ImportError, _cuda.CudaError):  # CudaUnavailableError is an ImportError
        return ""
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).rstrip("\x00")
