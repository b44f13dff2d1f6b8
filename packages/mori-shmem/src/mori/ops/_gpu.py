"""The GPU backend: the kernels (kernels/ep_common.cuh, ep_wire.cuh, ep_internode.cu,
ep_intranode.cu) compiled by NVRTC as one source, loaded with this PE's shmem device state,
launched on the caller's current torch stream. The inter-node kernel types add the kernels between nodes (_internode.py).

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
from mori.shmem._kernels import compile_cubin, load_module

from ._buffers import CONTROL, EpBuffers
from ._config import MAX_WORLD_SIZE
from ._internode import InterNodeBuffers, NodePlan, payload_layout
from ._quant import CombineWire

__all__ = ["EpArgs", "GpuKernels", "compile_kernels", "kernel_source", "make_args", "wire_suffix"]

#: Threads of the one-block signal/wait kernels (one per PE).
_SYNC_THREADS = MAX_WORLD_SIZE


class EpArgs(ctypes.Structure):
    """Mirror of ``struct EpArgs`` in kernels/ep_common.cuh (same order, same types)."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "inp",
            "weights",
            "scales",
            "indices",
            "dispTok",
            "dispWeights",
            "dispScales",
            "dispIndices",
            "dispSrcPos",
            "combInp",
            "combInpWeights",
            "combOut",
            "combOutWeights",
            "control",
            "destMap",
            "expertCount",
            "stage",
            "inbox",
            "retStage",
            "retInbox",
            "retMap",
        )
    ] + [
        (name, ctypes.c_int32)
        for name in (
            "rank",
            "world",
            "numTokens",
            "k",
            "expertsPerRank",
            "rowBytes",
            "scaleBytes",
            "hidden",
            "maxSend",
            "maxRecv",
            "inpRows",
            "weightRows",
            "hasWeights",
            "nodeFirst",
            "nodeSize",
            "myNode",
            "nNodes",
            "lowLatency",
            "tokCap",
            "xferBytes",
            "scaleOff",
            "idxOff",
            "wOff",
            "combXferBytes",
            "combWOff",
            "combRowBytes",
            "combScaleDim",
            "combCodeBytes",
            "replay",
            "fuseDispatch",
            "ownInPlace",
        )
    ]


#: The parts of the CUDA source, in the order they are compiled as one.
_SOURCES = ("ep_common.cuh", "ep_wire.cuh", "ep_internode.cu", "ep_intranode.cu")


def kernel_source() -> str:
    """The CUDA source with the layout constants prepended."""
    parts = [resources.files("mori.ops").joinpath(f"kernels/{name}").read_text() for name in _SOURCES]
    defines = [f"#define EP_MAX_PES {MAX_WORLD_SIZE}"] + [f"#define {k} {v}" for k, v in CONTROL.items()]
    return "\n".join(defines + parts)


_MODULE_NAME = "mori_ops_ep.cu"
#: Combine kernels come in pairs (stage, accumulate) per wire: the input dtype, then the wire's
#: encoding where it differs (fp8 cast, fp8/fp4 blockwise).
_WIRES = ("bf16", "f32", "fp8", "fp8fnuz", "fp4", "bf16_fp8", "bf16_bw8", "bf16_bw4")
_KERNELS = (
    "ep_dispatch_send",
    "ep_dispatch_signal",
    "ep_dispatch_wait",
    "ep_local_expert_count",
    *(f"ep_combine_{step}_{wire}" for step in ("stage", "accum") for wire in _WIRES),
    "ep_combine_barrier_wait",
    "ep_internode_put",
    "ep_internode_put_signal",
    "ep_internode_inbox_wait",
    "ep_internode_forward",
    "ep_internode_return",
    "ep_internode_return_put",
    "ep_internode_return_signal",
    "ep_internode_return_wait",
)


def wire_suffix(wire: CombineWire) -> str:
    """The suffix of the combine kernels of ``wire``."""
    from ._checks import combine_dtype_name

    extra = {"same": "", "fp8_cast": "_fp8", "fp8_blockwise": "_bw8", "fp4_blockwise": "_bw4"}[wire.kind]
    return combine_dtype_name(wire.dtype) + extra


def compile_kernels() -> str:
    """Compiles the module for the current CUDA device into NVRTC's disk cache (no context or
    shmem state needed); returns the architecture, e.g. ``sm_90``."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    compile_cubin(kernel_source(), _MODULE_NAME, arch)
    return arch


class GpuKernels:
    """The loaded module of one op, and the launch sequence of each call. With ``plan`` naming
    several nodes, the kernels between nodes run in it (``forward_grid`` blocks for the data
    kernels between nodes: MORI's ``rdma_block_num``). ``split`` (AsyncLL): every wait of a
    dispatch, the inbox of other nodes' tokens included, is in its receiving half (combine's
    waits are in combine_recv for every kernel type)."""

    def __init__(self, plan: NodePlan | None = None, forward_grid: int = 0, split: bool = False) -> None:
        from mori.core import cuda as cu

        s = _state.current()
        self._ctx = s.ctx
        self._nodes = plan.nodes if plan is not None else 1
        self._forward_grid = forward_grid
        # AsyncLL across nodes: the wait for other nodes' blocks moves to dispatch_recv.
        self._split_between_nodes = split and self._nodes > 1
        # One node: the dispatch data kernel's last block publishes the counts and (unless split:
        # AsyncLL's dispatch_recv waits) waits for the peers'; no one-block kernels between.
        self._fuse_dispatch = 0 if self._nodes > 1 else (1 if split else 2)
        self._threads, self._grid = 0, 0
        self._module = load_module(s.ctx, kernel_source(), _MODULE_NAME)
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

    def _between_nodes(self, grid: int) -> int:
        return self._forward_grid if self._forward_grid > 0 else grid

    def _put_between_nodes(self, put: str, signal: str, grid: int, threads: int, a: EpArgs, stream: int) -> None:
        """Kernel ``put`` moves this PE's block for every other node, spread over the blocks of the
        data kernels between nodes (one SM copies ~1/100 of what the GPU can), then the one-block
        kernel ``signal`` tells each node its block is complete."""
        shares = max(1, self._between_nodes(grid) // max(1, self._nodes - 1))
        self.launch(put, self._nodes * shares, threads, a, stream)
        self.sync_launch(signal, a, stream)

    def dispatch_send(self, a: EpArgs, grid: int, threads: int, stream: int) -> None:
        """This PE's tokens sent (to this node's PEs, and a block per other node to its proxy);
        unless split, the receiving steps between nodes follow (:meth:`_forward`). One node: one
        kernel, whose last block also publishes the counts (and waits for the peers' unless split)."""
        self._threads = threads
        a.fuseDispatch = self._fuse_dispatch
        self.launch("ep_dispatch_send", grid, threads, a, stream)
        self._grid = grid
        if self._fuse_dispatch:
            return
        if self._nodes > 1:
            self._put_between_nodes("ep_internode_put", "ep_internode_put_signal", grid, threads, a, stream)
        if not self._split_between_nodes:
            self._forward(a, grid, stream)

    def _forward(self, a: EpArgs, grid: int, stream: int) -> None:
        """With several nodes, the other nodes' tokens received and forwarded within this node;
        then this node's PEs told how many they got from here."""
        if self._nodes > 1:
            self.sync_launch("ep_internode_inbox_wait", a, stream)
            self.launch("ep_internode_forward", self._between_nodes(grid), self._threads, a, stream)
        self.sync_launch("ep_dispatch_signal", a, stream)

    def dispatch_recv(self, a: EpArgs, count_experts: bool, stream: int) -> None:
        """(Split: the receiving steps between nodes, then) waits for this node's PEs' counts; then
        fills the local expert count if asked."""
        if self._split_between_nodes:
            self._forward(a, self._grid, stream)
        if self._fuse_dispatch != 2:
            self.sync_launch("ep_dispatch_wait", a, stream)
        if count_experts:
            self.launch("ep_local_expert_count", 1, 1024, a, stream)

    def combine_send(
        self, a: EpArgs, suffix: str, grid: int, threads: int, stream: int, own_in_place: bool = False
    ) -> None:
        """Stages this PE's expert outputs and tells this node's PEs (``suffix``: the dtype pair).
        ``own_in_place``: the caller's input stays untouched until the accumulate and its rows go as
        they are, so the rows this PE sent itself may be read from it there rather than staged. That
        is done within one node, not split (AsyncLL's caller may reuse its input before
        combine_recv), and where this PE has a token for every warp of the grid: the stage is then
        bound by its bytes, and the row's source position it reads first costs less than the copy it
        saves (fewer tokens: the stage's time is that chain of loads, not bytes; on 2 H200 decode's
        combine took 0.7 us longer, prefill's 26 us less)."""
        a.ownInPlace = int(own_in_place and self._fuse_dispatch == 2 and a.numTokens >= grid * (threads // 32))
        self.launch("ep_combine_stage_" + suffix, grid, threads, a, stream)

    def combine_recv(self, a: EpArgs, suffix: str, grid: int, threads: int, stream: int) -> None:
        """Waits for this node's expert outputs; with several nodes, sends the rows of the tokens
        forwarded here back to their nodes and waits for theirs; then sums."""
        self.sync_launch("ep_combine_barrier_wait", a, stream)
        if self._nodes > 1:
            self.launch("ep_internode_return", self._between_nodes(grid), threads, a, stream)
            self._put_between_nodes("ep_internode_return_put", "ep_internode_return_signal", grid, threads, a, stream)
            self.sync_launch("ep_internode_return_wait", a, stream)
        self.launch("ep_combine_accum_" + suffix, grid, threads, a, stream)


def make_args(
    bufs: EpBuffers,
    cfg: Any,
    expert_count: Any,
    max_send: int,
    max_recv: int,
    plan: NodePlan | None = None,
    inter: InterNodeBuffers | None = None,
    low_latency: bool = False,
    combine_scale_dim: int = 0,
) -> EpArgs:
    """The per-op part of the kernel arguments (buffers and sizes); calls fill in their tensors.
    Without ``plan`` every PE is in this PE's node (IntraNode)."""
    a = EpArgs()
    for field, tensor in (
        ("dispTok", bufs.disp_tok),
        ("dispWeights", bufs.disp_weights),
        ("dispScales", bufs.disp_scales),
        ("dispIndices", bufs.disp_indices),
        ("dispSrcPos", bufs.disp_src_pos),
        ("combInp", bufs.comb_inp),
        ("combInpWeights", bufs.comb_inp_weights),
        ("combOut", bufs.comb_out),
        ("combOutWeights", bufs.comb_out_weights),
        ("control", bufs.control),
        ("destMap", bufs.dest_map),
        ("expertCount", expert_count),
    ):
        setattr(a, field, int(tensor.data_ptr()))
    a.rank, a.world, a.k = cfg.rank, cfg.world_size, cfg.num_experts_per_token
    a.expertsPerRank, a.maxSend, a.maxRecv = cfg.num_experts_per_rank, max_send, max_recv
    a.nodeFirst, a.nodeSize, a.myNode, a.nNodes = 0, cfg.world_size, 0, 1
    if plan is not None and inter is not None:
        a.nodeFirst, a.nodeSize, a.myNode, a.nNodes = plan.first, plan.size, plan.node, plan.nodes
        for field, tensor in (
            ("stage", inter.stage),
            ("inbox", inter.inbox),
            ("retStage", inter.ret_stage),
            ("retInbox", inter.ret_inbox),
            ("retMap", inter.ret_map),
        ):
            setattr(a, field, int(tensor.data_ptr()))
        lay = payload_layout(cfg, combine_scale_dim)
        a.lowLatency, a.tokCap = int(low_latency), cfg.max_num_inp_token_per_rank
        a.xferBytes, a.scaleOff, a.idxOff, a.wOff = lay.xfer, lay.scale_off, lay.idx_off, lay.w_off
        a.combXferBytes, a.combWOff = lay.comb_xfer, lay.comb_w_off
    return a
