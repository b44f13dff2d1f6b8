"""MORI's tensor helpers (``mori.shmem.tensor_utils``): torch tensors on the symmetric heap.

The names, arguments and results of MORI's module, on mori's heap: on a GPU heap the tensors are
CUDA tensors of this PE's device, on the CPU heap (no GPU) CPU tensors. torch is imported only
when a helper is called. A tensor these helpers make carries ``__symm_tensor__ = True``, as in
MORI; the peer and free helpers accept only such tensors.
"""

from __future__ import annotations

from typing import Any

from . import _state
from ._tensor import shmem_peer_tensor, shmem_tensor
from .api import shmem_free, shmem_mype

__all__ = [
    "MoriShmemBuffer",
    "mori_shmem_create_tensor",
    "mori_shmem_create_tensor_list_intra_node",
    "mori_shmem_free_tensor",
    "symm_mori_shmem_tensor",
]


def _on_gpu_heap() -> bool:
    return _state.is_initialized() and _state.current().ops is not None


def _synchronize() -> None:
    """MORI synchronizes the device around heap allocation and free; on the CPU heap there is none."""
    if _on_gpu_heap():
        import torch

        torch.cuda.synchronize()


class MoriShmemBuffer:
    """``nbytes`` bytes at address ``ptr`` as an array-interface object (``torch.as_tensor`` takes it).

    It exposes ``__cuda_array_interface__`` (version 3, ``uint8``), as MORI's does, unless this
    PE's heap is in host memory: then ``__array_interface__`` instead, so that the CPU heap's
    memory is never handed out as device memory. ``dtype`` is kept for the caller's view.
    """

    def __init__(self, ptr: int, nbytes: int, dtype: Any) -> None:
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"MoriShmemBuffer: ptr must be a non-null address, got {ptr!r}")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"MoriShmemBuffer: nbytes must be a non-negative int, got {nbytes!r}")
        self.ptr, self.nbytes, self.dtype = ptr, nbytes, dtype
        interface = {"data": (ptr, False), "shape": (nbytes,), "typestr": "<u1", "strides": None, "version": 3}
        if _state.is_initialized() and not _on_gpu_heap():
            self.__array_interface__ = interface
        else:
            self.__cuda_array_interface__ = interface


def _check_symmetric(tensor: Any, what: str) -> None:
    if not getattr(tensor, "__symm_tensor__", False):
        raise ValueError(f"{what}: the tensor is not a symmetric tensor (make it with mori_shmem_create_tensor)")


def mori_shmem_create_tensor(shape: Any, dtype: Any) -> Any:
    """A new tensor of ``shape``/``dtype`` on the symmetric heap, marked ``__symm_tensor__``.

    Collective, like ``shmem_malloc``: every PE makes the same calls in the same order. Free it
    with :func:`mori_shmem_free_tensor` on every PE.
    """
    _synchronize()
    tensor = shmem_tensor(tuple(shape) if not isinstance(shape, int) else (shape,), dtype)
    _synchronize()
    tensor.__symm_tensor__ = True
    return tensor


def symm_mori_shmem_tensor(tensor: Any, peer: int) -> Any:
    """PE ``peer``'s copy of a symmetric ``tensor`` (the tensor itself for this PE), no copy."""
    _check_symmetric(tensor, "symm_mori_shmem_tensor")
    if peer == shmem_mype():
        return tensor
    return shmem_peer_tensor(tensor, peer)


def mori_shmem_free_tensor(tensor: Any) -> None:
    """Frees a tensor made by :func:`mori_shmem_create_tensor` (collective, like ``shmem_free``)."""
    _check_symmetric(tensor, "mori_shmem_free_tensor")
    _synchronize()
    shmem_free(int(tensor.data_ptr()))
    _synchronize()


def mori_shmem_create_tensor_list_intra_node(shape: Any, dtype: Any, num_ranks: int) -> list[Any]:
    """One new symmetric tensor, as seen from this PE at each of PEs ``0..num_ranks-1``."""
    tensor = mori_shmem_create_tensor(shape, dtype)
    return [symm_mori_shmem_tensor(tensor, pe) for pe in range(num_ranks)]
