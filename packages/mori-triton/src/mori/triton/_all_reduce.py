"""``mori.triton.all_reduce``: sum a tensor over every PE of the initialised mori.shmem world.

An :class:`AllReduce` owns persistent symmetric buffers (allocated once with ``shmem_malloc``,
reached through peers' NVLink mappings) and launches one Triton kernel per call: one-shot for
small tensors, two-shot (reduce-scatter + all-gather) above ``one_shot_max_bytes``. The input may
live anywhere on the GPU; it is read once and pushed straight into peers' buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mori.core import config

from ._all_reduce_kernels import all_reduce_kernel

__all__ = ["AllReduce", "AllReduceConfig", "all_reduce"]

MAX_WORLD = 8
_MAXB = 256  # flag slots per (phase, source PE): the most blocks a launch may use
_ALIGN = 64  # slice lengths are multiples of 64 elements: 16-byte vectors everywhere
_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
    """How one call runs: algorithm, elements per block iteration, warps, and the block cap."""

    one_shot: bool
    block: int
    num_warps: int
    max_blocks: int


def default_config(nbytes: int, world: int) -> AllReduceConfig:
    """The configuration used for ``nbytes`` on ``world`` PEs.

    From the sweep of ``ci/device/bench_allreduce.py`` on 4x H200 (NVLink): one-shot wins up to
    512 KiB, two-shot above; block shapes within a size differ by about 1 us.
    """
    if nbytes <= 256 << 10:
        return AllReduceConfig(True, 2048, 8, 64)
    if nbytes <= 512 << 10:
        return AllReduceConfig(True, 1024, 4, 64)
    return AllReduceConfig(False, 4096, 8, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _DevicePointer:
    """A raw device address Triton accepts as a pointer argument (``data_ptr`` + ``dtype``)."""

    def __init__(self, addr: int, dtype: Any) -> None:
        self.addr, self.dtype = addr, dtype

    def data_ptr(self) -> int:
        return self.addr


class AllReduce:
    """Persistent state of the all-reduce for this PE: buffers, flags and per-block epochs.

    Collective: every PE of the mori.shmem world constructs it (``shmem_malloc`` is collective)
    and calls it with tensors of the same shape and dtype, in the same order.
    """

    def __init__(self, max_bytes: int = 64 << 20, one_shot_max_bytes: int = 512 << 10) -> None:
        import mori.shmem as shmem

        self.rank, self.world = int(shmem.shmem_mype()), int(shmem.shmem_npes())
        if not 1 <= self.world <= MAX_WORLD:
            raise ValueError(f"all_reduce supports 1..{MAX_WORLD} PEs, the world has {self.world}")
        if max_bytes <= 0 or one_shot_max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes} and one_shot_max_bytes={one_shot_max_bytes} must be positive")
        self.max_bytes, self.one_shot_max_bytes = int(max_bytes), int(one_shot_max_bytes)
        # two-shot: recv + gather slots (W slices each, a slice rounded up by < _ALIGN elements of
        # <= 4 bytes); one-shot: 2 slot sets of W whole inputs.
        padded = self.max_bytes + 4 * self.world * _ALIGN
        data_bytes = max(2 * padded, 2 * self.world * _cdiv(self.one_shot_max_bytes, 256) * 256)
        flag_bytes = (2 * self.world + 1) * _MAXB * 4  # flags [2][W][MAXB] then epochs [MAXB]
        self._shmem = shmem
        self._data = int(shmem.shmem_malloc_align(256, data_bytes))
        self._flags = int(shmem.shmem_malloc_align(256, flag_bytes))
        self._zero(self._flags, flag_bytes)
        self._peers = [self._peer(self._data, j) for j in range(self.world)]
        self._peer_flags = [self._peer(self._flags, j) for j in range(self.world)]
        shmem.shmem_barrier_all()  # every PE's flags are zero before anyone signals
        self._timeout_ns = int(config.get("MORI_SHMEM_TIMEOUT") * 1e9)
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._closed = False

    def _peer(self, addr: int, pe: int) -> int:
        remote = int(self._shmem.shmem_ptr_p2p(addr, self.rank, pe))
        if remote == 0:
            raise RuntimeError(f"all_reduce needs NVLink/P2P access to every PE; PE {pe} is not reachable "
                               "(MORI_DISABLE_P2P set, or a PE on another host)")
        return remote

    @staticmethod
    def _zero(addr: int, nbytes: int) -> None:
        from cuda.bindings import driver

        (err,) = driver.cuMemsetD8(addr, 0, nbytes)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemsetD8 of the all_reduce flags failed: {err}")
        (err,) = driver.cuCtxSynchronize()
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuCtxSynchronize failed: {err}")

    def __call__(self, tensor: Any, out: Any = None, cfg: AllReduceConfig | None = None) -> Any:
        """Sums ``tensor`` over all PEs into ``out`` (default: in place); returns the result tensor."""
        import torch

        if self._closed:
            raise RuntimeError("this AllReduce is closed")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            raise TypeError(f"all_reduce needs a CUDA torch.Tensor, got {type(tensor).__name__}"
                            f"{' on ' + str(tensor.device) if isinstance(tensor, torch.Tensor) else ''}")
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if dtype_name not in _DTYPES:
            raise TypeError(f"all_reduce supports {', '.join(_DTYPES)}; got {dtype_name}")
        if not tensor.is_contiguous():
            raise ValueError("all_reduce needs a contiguous tensor (call .contiguous() first)")
        out = tensor if out is None else out
        if not isinstance(out, torch.Tensor) or out.shape != tensor.shape or out.dtype != tensor.dtype \
                or out.device != tensor.device or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor of the input's shape, dtype and device")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_bytes:
            raise ValueError(f"tensor of {nbytes} bytes exceeds this AllReduce's max_bytes={self.max_bytes}")
        if tensor.numel() == 0 or self.world == 1:
            if out.data_ptr() != tensor.data_ptr():
                out.copy_(tensor)
            return out
        cfg = cfg or default_config(nbytes, self.world)
        one_shot = cfg.one_shot and nbytes <= self.one_shot_max_bytes
        self._launch(tensor, out, cfg, one_shot)
        return out

    def _launch(self, tensor: Any, out: Any, cfg: AllReduceConfig, one_shot: bool) -> None:
        import torch

        n = tensor.numel()
        chunk = _cdiv(_cdiv(n, self.world), _ALIGN) * _ALIGN
        span = n if one_shot else chunk
        grid = (max(1, min(cfg.max_blocks, _MAXB, _cdiv(span, cfg.block))),)
        bufs = tuple(_DevicePointer(p, tensor.dtype) for p in self._peers)
        flags = tuple(_DevicePointer(p, torch.uint32) for p in self._peer_flags)
        epochs = _DevicePointer(self._flags + 2 * self.world * _MAXB * 4, torch.uint32)
        args = (tensor, out, bufs, flags, bufs[self.rank], flags[self.rank], epochs, self.rank, n, chunk,
                self._timeout_ns)
        # Triton's JIT dispatch costs tens of microseconds of Python per launch; once compiled, launch
        # the cached kernel directly. The key holds everything Triton specialises on that can vary
        # between calls (dtype, 16-byte alignment of the two tensors, n % 16 and n == 1).
        key = (tensor.dtype, one_shot, cfg, grid, tensor.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0,
               n % 16 == 0, n == 1)
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = all_reduce_kernel[grid](*args, W=self.world, MAXB=_MAXB, BLOCK=cfg.block,
                                                          ONE_SHOT=one_shot, num_warps=cfg.num_warps)
        else:
            compiled[(grid[0], 1, 1)](*args, self.world, _MAXB, cfg.block, one_shot)

    def close(self) -> None:
        """Frees the symmetric buffers (collective: every PE calls it)."""
        if self._closed:
            return
        self._closed = True
        self._shmem.shmem_barrier_all()
        self._shmem.shmem_free(self._flags)
        self._shmem.shmem_free(self._data)


_default: AllReduce | None = None


def all_reduce(tensor: Any, out: Any = None) -> Any:
    """Sums ``tensor`` (bf16/fp16/fp32, CUDA, contiguous, <= 64 MiB) over every PE, in place by default.

    Uses a process-wide :class:`AllReduce` created on first use (collectively: every PE must call).
    """
    global _default
    if _default is None or _default._closed:
        _default = AllReduce()
    return _default(tensor, out)

