"""A DLPack capsule for a raw address on an explicit device, so torch wraps it without copying.

``torch.as_tensor`` with ``__cuda_array_interface__`` asks the driver which device owns a pointer
and copies when that is not the device asked for; a peer's heap mapped into this process belongs
to the peer's GPU, yet only this GPU may touch the mapping. DLPack names the device outright.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

__all__ = ["capsule"]

_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

# Each capsule's ctypes objects live here until the consumer calls the deleter.
_alive: dict[int, tuple[Any, ...]] = {}
_lock = threading.Lock()


@_DELETER
def _release(managed: Any) -> None:
    with _lock:
        _alive.pop(ctypes.addressof(managed.contents), None)


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def capsule(ptr: int, nbytes: int, device: int | None) -> Any:
    """A 1-D uint8 DLPack capsule over ``[ptr, ptr + nbytes)`` on CUDA ``device`` (None: host memory).

    The capsule does not own the memory: the heap outlives it until shmem_free/shmem_finalize.
    """
    where = _DLDevice(_KDL_CPU, 0) if device is None else _DLDevice(_KDL_CUDA, device)
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        ptr, where, 1, _DLDataType(_KDL_UINT, 8, 1), ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)), None, 0
    )
    managed.deleter = _release
    with _lock:
        _alive[ctypes.addressof(managed)] = (managed, shape)
    return _new_capsule(ctypes.addressof(managed), b"dltensor", None)
