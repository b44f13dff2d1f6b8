"""torch tensors on the symmetric heap (torch optional: imported only here, only when called)."""

from __future__ import annotations

import math
from typing import Any

from . import _state
from ._dlpack import capsule
from .api import shmem_malloc

__all__ = ["shmem_peer_tensor", "shmem_tensor"]


def _wrap(ptr: int, nbytes: int, shape: Any, dtype: Any, device: int | None) -> Any:

    from torch.utils.dlpack import from_dlpack

    raw = from_dlpack(capsule(ptr, nbytes, device))
    return raw.view(dtype).view(shape)


def shmem_tensor(shape: Any, dtype: Any) -> Any:
    """A new tensor of ``shape``/``dtype`` on the symmetric heap (collective, like shmem_malloc).

    On a GPU heap it lives on this PE's GPU, on the CPU heap in host memory. Its contents start
    undefined; free it with ``shmem_free(t.data_ptr())`` on every PE.
    """
    import torch

    s = _state.current()
    shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    ptr = shmem_malloc(max(nbytes, 1))
    return _wrap(ptr, nbytes, shape, dtype, s.ctx.device if s.ctx is not None else None)


def shmem_peer_tensor(tensor: Any, pe: int) -> Any:
    """A view of PE ``pe``'s copy of a symmetric ``tensor`` (same shape and dtype, no copy).

    Reads and writes through it go straight to the peer's heap. Raises ShmemAddressError when
    ``tensor`` is not on the heap and ValueError when ``pe``'s heap is not mapped here (another
    host, or ``MORI_DISABLE_P2P``).
    """
    s = _state.current()
    if not tensor.is_contiguous():
        raise ValueError("shmem_peer_tensor: the tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    offset = s.rma.offset(int(tensor.data_ptr()), nbytes, "shmem_peer_tensor")
    peer = s.rma.target(pe) + offset
    return _wrap(peer, nbytes, tensor.shape, tensor.dtype, s.ctx.device if s.ctx is not None else None)
