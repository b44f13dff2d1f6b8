"""The GPU backend: the intra-node kernels (kernels/ep_intranode.cu) compiled by NVRTC, loaded with
this PE's shmem device state, launched on the caller's current torch stream.

Why NVRTC CUDA C++ rather than Triton: dispatch needs warp votes and shuffles to deduplicate a
top-k row, per-block shared-memory slot counters reserved on a peer with one system-scope atomic,
and acquire/release waits on peers' flags; mori's device headers provide exactly these, while
Triton exposes none of the warp primitives. Nothing here allocates or synchronizes with the host
per call, so a call can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import ctypes
from importlib import resources
from typing import Any

from mori.shmem import _state, shmem_module_init
from mori.shmem._cuda import launch
from mori.shmem._kernels import load_module

from ._buffers import CONTROL, EpBuffers
from ._config import MAX_WORLD_SIZE

__all__ = ["EpArgs", "GpuKernels", "kernel_source"]

#: Threads of the one-block signal/wait kernels (one per PE).
_SYNC_THREADS = MAX_WORLD_SIZE


class EpArgs(ctypes.Structure):
    """Mirror of ``struct EpArgs`` in kernels/ep_intranode.cu (same order, same types)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "inp", "weights", "scales", "indices", "dispTok", "dispWeights", "dispScales", "dispIndices", "dispSrcPos",
        "combInp", "combInpWeights", "combOut", "combOutWeights", "control", "destMap", "expertCount")] + [
        (name, ctypes.c_int32) for name in (
            "rank", "world", "numTokens", "k", "expertsPerRank", "rowBytes", "scaleBytes", "hidden",
            "maxSend", "maxRecv", "inpRows", "weightRows", "hasWeights")]


def kernel_source() -> str:
    """The CUDA source with the layout constants prepended."""
    body = resources.files("mori.ops").joinpath("kernels/ep_intranode.cu").read_text()
    defines = [f"#define EP_MAX_PES {MAX_WORLD_SIZE}"] + [f"#define {k} {v}" for k, v in CONTROL.items()]
    return "\n".join(defines) + "\n" + body


_KERNELS = (
    "ep_dispatch_send", "ep_dispatch_signal", "ep_dispatch_wait", "ep_local_expert_count",
    "ep_combine_stage_bf16", "ep_combine_stage_f32", "ep_combine_stage_fp8", "ep_combine_stage_bf16_fp8",
    "ep_combine_barrier_signal", "ep_combine_barrier_wait",
    "ep_combine_accum_bf16", "ep_combine_accum_f32", "ep_combine_accum_fp8", "ep_combine_accum_bf16_fp8",
)


class GpuKernels:
    """The loaded module of one op, and launches of its kernels."""

    def __init__(self) -> None:
        from mori.core import cuda as cu

        s = _state.current()
        self._ctx = s.ctx
        self._module = load_module(s.ctx, kernel_source(), "mori_ops_ep_intranode.cu")
        shmem_module_init(self._module)
        self._functions = {name: cu.call("cuModuleGetFunction", self._module, name.encode()) for name in _KERNELS}

    def launch(self, name: str, grid: int, threads: int, args: EpArgs, stream: int) -> None:
        """Enqueues kernel ``name`` on ``stream`` (returns at once). A launch error names the kernel
        (the error may stem from an earlier kernel of this context: launches are asynchronous)."""
        try:
            launch(self._functions[name], grid, threads, [args], stream)
        except RuntimeError as exc:
            raise RuntimeError(f"mori.ops: launching {name} (grid {grid}, {threads} threads) failed: {exc}") from exc

    def sync_launch(self, name: str, args: EpArgs, stream: int) -> None:
        """Enqueues a one-block signal/wait kernel."""
        self.launch(name, 1, _SYNC_THREADS, args, stream)


def make_args(bufs: EpBuffers, cfg: Any, expert_count: Any, max_send: int, max_recv: int) -> EpArgs:
    """The per-op part of the kernel arguments (buffers and sizes); calls fill in their tensors."""
    a = EpArgs()
    for field, tensor in (("dispTok", bufs.disp_tok), ("dispWeights", bufs.disp_weights),
                          ("dispScales", bufs.disp_scales), ("dispIndices", bufs.disp_indices),
                          ("dispSrcPos", bufs.disp_src_pos), ("combInp", bufs.comb_inp),
                          ("combInpWeights", bufs.comb_inp_weights), ("combOut", bufs.comb_out),
                          ("combOutWeights", bufs.comb_out_weights), ("control", bufs.control),
                          ("destMap", bufs.dest_map), ("expertCount", expert_count)):
        setattr(a, field, int(tensor.data_ptr()))
    a.rank, a.world, a.k = cfg.rank, cfg.world_size, cfg.num_experts_per_token
    a.expertsPerRank, a.maxSend, a.maxRecv = cfg.num_experts_per_rank, max_send, max_recv
    return a
