"""``EpDispatchCombineOp``: MORI-EP's dispatch and combine, as vLLM and SGLang call them.

After ``mori.shmem`` is initialized on every rank of the expert-parallel group (usually
``shmem_torch_process_group_init``), each rank builds the op from the same config (collective:
its buffers are allocated on the symmetric heap) and calls::

    out, out_w, out_s, out_idx, n = op.dispatch(x, topk_weights, scales, topk_ids)
    y = experts(out[:n.item()], ...)               # any expert computation, row for row
    combined, combined_w = op.combine(y, out_w, topk_ids)

Results are views of op-owned buffers (as in MORI): dispatch's hold this round's tokens until
this rank calls combine (peers' next dispatch writes into them after that), combine's until the
next combine. Every dispatch must be followed by one combine on every rank. ``AsyncLL`` splits each into ``*_send`` and ``*_recv``.
"""

from __future__ import annotations

from typing import Any

from . import _checks
from ._buffers import CONTROL, EpBuffers, view_rows
from ._config import (
    INTER_NODE_KERNEL_TYPES,
    INTRA_NODE_KERNEL_TYPES,
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineQuantType,
    capacities,
    normalize_quant_type,
    validate_config,
)

__all__ = ["EpDispatchCombineOp"]

class EpDispatchCombineOp:
    """MoE token dispatch/combine between PEs (MORI's ``EpDispatchCombineOp``): of one node with
    the intra-node kernel types, across nodes with ``InterNode``/``InterNodeV1``/``InterNodeV1LL``.

    Construction is collective (every rank of ``config.world_size``, same config except ``rank``)
    and raises before allocating anything when the config is invalid or does not match the
    initialized mori.shmem (rank, world size; for the intra-node types every peer mapped, for the
    inter-node types on GPUs every PE of this rank's ``gpu_per_node`` node mapped).
    """

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        import torch

        from mori.shmem import shmem_barrier_all, shmem_heap_info, shmem_mype, shmem_npes

        self.kernel_type = validate_config(config)
        self.config = config
        info = shmem_heap_info()  # raises ShmemNotInitializedError before init
        if (shmem_mype(), shmem_npes()) != (config.rank, config.world_size):
            raise ValueError(f"config says rank {config.rank} of {config.world_size}, but mori.shmem is PE "
                             f"{shmem_mype()} of {shmem_npes()}: build the op with the shmem PE numbering")
        unreachable = sorted(set(range(config.world_size)) - set(info["reachable"]))
        if unreachable and self.kernel_type in INTRA_NODE_KERNEL_TYPES:
            raise ValueError(f"PEs {unreachable} are not mapped in PE {config.rank} (another host, or "
                             f"MORI_DISABLE_P2P): {self.kernel_type.name} needs every PE's heap mapped; "
                             "InterNodeV1 or InterNodeV1LL reach them")
        self._gpu = info["kind"] == "gpu"
        plan = None
        if self._gpu and self.kernel_type in INTER_NODE_KERNEL_TYPES:
            from ._internode import node_plan

            plan = node_plan(config, info["reachable"])
            plan = plan if plan.nodes > 1 else None  # one node: the IntraNode kernels alone
        self._quant = normalize_quant_type(config.quant_type)
        self._cap = capacities(config)
        self._device = torch.device("cuda", info["device"]) if self._gpu else torch.device("cpu")
        self.local_expert_count = torch.zeros(config.num_experts_per_rank, dtype=torch.int32, device=self._device)
        self._bufs = EpBuffers.allocate(config)
        max_send, max_recv = self._cap["max_num_tokens_to_send"], self._cap["max_num_tokens_to_recv"]
        if self._gpu:
            from ._gpu import GpuKernels, make_args
            from ._internode import InterNodeBuffers

            low_latency = self.kernel_type == EpDispatchCombineKernelType.InterNodeV1LL
            inter = InterNodeBuffers.allocate(config, plan, low_latency) if plan is not None else None
            self._kernels = GpuKernels(plan, config.rdma_block_num)
            self._base_args = make_args(self._bufs, config, self.local_expert_count, max_send, max_recv, plan,
                                        inter, low_latency)
            torch.cuda.synchronize(self._device)
        else:
            from ._cpu import CpuBackend

            self._cpu = CpuBackend(config, self._bufs, max_send, max_recv)
        # Buffers are zeroed before any peer may write into them (a peer's first dispatch).
        shmem_barrier_all()
        self._dispatched: int | None = None  # tokens of the dispatch awaiting its combine
        self._pending: str | None = None  # "dispatch" / "combine" between an AsyncLL send and recv
        self._args: Any = None
        self._call: dict[str, Any] = {}
        self._views: dict[tuple[Any, ...], Any] = {}

    # -- capacity queries (MORI's) --------------------------------------------------------------
    def max_num_tokens_to_recv(self) -> int:
        """Rows of the dispatch outputs: tokens this rank can receive in one dispatch."""
        return self._cap["max_num_tokens_to_recv"]

    def max_num_tokens_to_recv_per_rank(self) -> int:
        """Tokens one source rank may send here (``max_total_recv_tokens`` / world, capped)."""
        return self._cap["max_num_tokens_to_recv_per_rank"]

    def max_num_tokens_to_send(self) -> int:
        """``world_size * max_num_inp_token_per_rank``: the stride of flat token positions."""
        return self._cap["max_num_tokens_to_send"]

    def max_num_tokens_to_send_per_rank(self) -> int:
        """``max_num_inp_token_per_rank``."""
        return self._cap["max_num_tokens_to_send_per_rank"]

    def decode_send_flat_idx(self, flat_idx: int) -> tuple[int, int]:
        """A flat position from :meth:`get_dispatch_src_token_pos` as ``(rank, token)``."""
        stride = self.max_num_tokens_to_send()
        return int(flat_idx) // stride, int(flat_idx) % stride

    def get_launch_config(self, is_dispatch: bool = True, block_num: int = -1, rdma_block_num: int = -1,
                          warp_per_block: int = -1) -> tuple[int, int, int]:
        """``(block_num, rdma_block_num, warp_per_block)`` a call with these overrides would use."""
        cfg = self.config
        return (block_num if block_num > 0 else cfg.block_num,
                rdma_block_num if rdma_block_num > 0 else cfg.rdma_block_num,
                warp_per_block if warp_per_block > 0 else cfg.warp_num_per_block)

    # -- views ----------------------------------------------------------------------------------
    def _view(self, name: str, rows: int, cols: int, dtype: Any) -> Any:
        """``[rows, cols]`` view of buffer ``name``; made once per shape (a view costs ~20 us of
        Python, which a decode step would feel), then handed out again."""
        key = (name, rows, cols, dtype)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = view_rows(getattr(self._bufs, name), rows, cols, dtype)
        return view

    def _total(self) -> Any:
        total = self._views.get(("total",))
        if total is None:
            at = CONTROL["EP_TOTAL_RECV"]
            total = self._views[("total",)] = self._bufs.control[at: at + 1]
        return total

    def get_registered_combine_input_buffer(self, dtype: Any, hidden_dim: int = -1) -> Any:
        """The registered combine input ``[max_num_tokens_to_recv, hidden]`` of ``dtype``: write expert
        outputs here and pass it to ``combine`` to skip combine's copy (``use_external_inp_buf=False``)."""
        hidden = self.config.hidden_dim if hidden_dim is None or hidden_dim <= 0 else hidden_dim
        return self._view("comb_inp", self.max_num_tokens_to_recv(), hidden, dtype)

    def get_dispatch_src_token_pos(self) -> Any:
        """For each received token (dispatch output row), where it came from: ``src_rank *
        max_num_tokens_to_send() + src_token`` (int32; decode with :meth:`decode_send_flat_idx`).
        Synchronizes the device, as MORI does."""
        import torch

        if self._gpu:
            torch.cuda.synchronize(self._device)
        return self._bufs.disp_src_pos[: int(self._total().item())]

    # -- dispatch -------------------------------------------------------------------------------
    def _launch_params(self, block_num: int, warp_per_block: int) -> tuple[int, int]:
        bn, _, wpb = self.get_launch_config(True, block_num, -1, warp_per_block)
        if not 1 <= wpb <= 32:
            raise ValueError(f"warp_per_block={wpb}: must be in [1, 32]")
        return bn, 32 * wpb

    def _stream(self) -> int:
        import torch

        return int(torch.cuda.current_stream(self._device).cuda_stream)

    def _expect(self, pending: str | None, what: str) -> None:
        if self._pending != pending:
            have = f"a {self._pending}_send without its {self._pending}_recv" if self._pending else "no send"
            raise RuntimeError(f"{what}: called after {have}")

    @staticmethod
    def _no_routing(routing: Any, return_routing: bool = False) -> None:
        if routing is not None or return_routing:
            raise NotImplementedError("routing handles (cached/replayed routing) are not implemented in mori.ops")

    def dispatch(self, input: Any, weights: Any, scales: Any, indices: Any, block_num: int = -1,
                 rdma_block_num: int = -1, warp_per_block: int = -1, call_local_expert_count: bool = False, *,
                 routing: Any = None, return_routing: bool = False) -> tuple[Any, Any, Any, Any, Any]:
        """Sends each token to every distinct rank among its top-k experts.

        ``input`` ``[n, hidden]`` (any 1/2/4-byte dtype that fits the config: bf16, fp8 e4m3 ...),
        ``weights`` ``[n, k]`` float32 or None, ``scales`` ``[n, scale_dim]`` or None, ``indices``
        ``[n, k]`` int32 expert ids (ids < 0 or past the last rank are dropped). Returns views
        ``(tokens [R, hidden], weights [R, k] float32, scales [R, scale_dim] or None, indices
        [R, k] int32, recv_count [1] int32)`` with ``R = max_num_tokens_to_recv()``; the first
        ``recv_count`` rows are this rank's tokens, each with its sender's full top-k row.
        ``call_local_expert_count`` also fills :attr:`local_expert_count`.
        """
        self._no_routing(routing, return_routing)
        views = self._dispatch_send(input, weights, scales, indices, block_num, warp_per_block)
        self._dispatch_recv(call_local_expert_count)
        return views

    def dispatch_send(self, input: Any, weights: Any, scales: Any, indices: Any, block_num: int = -1,
                      warp_per_block: int = -1, call_local_expert_count: bool = False) -> tuple[Any, ...]:
        """AsyncLL: sends this rank's tokens and returns the dispatch views, which hold the received
        tokens once :meth:`dispatch_recv` ran. Other kernel types: :meth:`dispatch` (as MORI)."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            return self.dispatch(input, weights, scales, indices, block_num=block_num, warp_per_block=warp_per_block,
                                 call_local_expert_count=call_local_expert_count)
        return self._dispatch_send(input, weights, scales, indices, block_num, warp_per_block)

    def dispatch_recv(self, block_num: int = -1, warp_per_block: int = -1,
                      call_local_expert_count: bool = False) -> None:
        """AsyncLL: waits (on the stream) for every rank's tokens; fills :attr:`local_expert_count` if asked."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            raise ValueError(f"dispatch_recv only supports AsyncLL, got kernel_type={self.kernel_type.name}")
        self._dispatch_recv(call_local_expert_count)

    def _dispatch_send(self, inp: Any, weights: Any, scales: Any, indices: Any, block_num: int,
                       warp_per_block: int) -> tuple[Any, ...]:
        import torch

        self._expect(None, "dispatch")
        if self._dispatched is not None:
            raise RuntimeError("dispatch called twice without a combine in between: every dispatch must be "
                               "followed by one combine on every rank")
        has_scales = _checks.check_dispatch(self.config, self._device, inp, weights, scales, indices)
        grid, threads = self._launch_params(block_num, warp_per_block)
        scales = scales if has_scales else None
        if self._gpu:
            from ._gpu import EpArgs

            a = EpArgs.from_buffer_copy(self._base_args)
            a.inp, a.indices = int(inp.data_ptr()), int(indices.data_ptr())
            a.weights = int(weights.data_ptr()) if weights is not None else 0
            a.scales = int(scales.data_ptr()) if scales is not None else 0
            a.numTokens, a.rowBytes = inp.shape[0], inp.shape[1] * inp.element_size()
            a.scaleBytes = scales.shape[1] * scales.element_size() if scales is not None else 0
            self._kernels.dispatch_send(a, grid, threads, self._stream())
            self._args = a
        else:
            self._cpu.dispatch(inp, weights, scales, indices)
        self._dispatched = inp.shape[0]
        self._pending = "dispatch"
        recv, cfg = self.max_num_tokens_to_recv(), self.config
        out_scales = self._view("disp_scales", recv, cfg.scale_dim, scales.dtype) if scales is not None else None
        return (self._view("disp_tok", recv, inp.shape[1], inp.dtype),
                self._view("disp_weights", recv, cfg.num_experts_per_token, torch.float32), out_scales,
                self._view("disp_indices", recv, cfg.num_experts_per_token, torch.int32), self._total())

    def _dispatch_recv(self, count: bool) -> None:
        self._expect("dispatch", "dispatch_recv")
        if self._gpu:
            self._kernels.dispatch_recv(self._args, count, self._stream())
        elif count:
            self._cpu.count_experts(self.local_expert_count)
        self._pending = None

    # -- combine --------------------------------------------------------------------------------
    def combine(self, input: Any, weights: Any, indices: Any, block_num: int = -1, rdma_block_num: int = -1,
                warp_per_block: int = -1, use_external_inp_buf: int = -1, call_reset: bool = False, *,
                routing: Any = None) -> tuple[Any, Any]:
        """Returns each of this rank's tokens summed over the ranks it was dispatched to.

        ``input`` ``[rows, hidden]`` (bf16, float32 or fp8 e4m3): row ``s`` answers dispatch output
        row ``s`` (rows past ``rows`` count as zeros). ``weights`` ``[rows, k]`` float32 or None.
        ``indices``: this rank's own top-k ids, the tensor given to dispatch. Returns views
        ``(out [max_num_inp_token_per_rank, hidden] of input's dtype, weights [.., k] or None)``;
        the first ``n`` rows (n = tokens dispatched) hold, per token, the float32 sum of the rows
        its destinations sent back, in top-k order, rounded once (weights likewise).
        """
        self._no_routing(routing)
        self._combine_send(input, weights, indices, block_num, warp_per_block, use_external_inp_buf)
        return self._combine_recv()

    def combine_send(self, input: Any, weights: Any, indices: Any, block_num: int = -1,
                     warp_per_block: int = -1) -> tuple[Any, Any]:
        """AsyncLL: stages this rank's expert outputs for its peers and returns the combine views,
        filled once :meth:`combine_recv` ran. Other kernel types: :meth:`combine` (as MORI)."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            return self.combine(input, weights, indices, block_num=block_num, warp_per_block=warp_per_block)
        return self._combine_send(input, weights, indices, block_num, warp_per_block, -1)

    def combine_recv(self, block_num: int = -1, warp_per_block: int = -1) -> None:
        """AsyncLL: waits for every rank's expert outputs and sums them into the combine views."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            raise ValueError(f"combine_recv only supports AsyncLL, got kernel_type={self.kernel_type.name}")
        self._combine_recv()

    def _combine_send(self, inp: Any, weights: Any, indices: Any, block_num: int, warp_per_block: int,
                      use_external_inp_buf: int) -> tuple[Any, Any]:
        import torch

        self._expect(None, "combine")
        if self._dispatched is None:
            raise RuntimeError("combine called without a preceding dispatch")
        _checks.check_combine(self.config, self._device, inp, weights, indices, self._dispatched)
        external = bool(self.config.use_external_inp_buf if use_external_inp_buf < 0 else use_external_inp_buf)
        registered = self.get_registered_combine_input_buffer(inp.dtype, inp.shape[1])
        if not external and inp.data_ptr() != registered.data_ptr():
            raise ValueError("zero-copy combine (use_external_inp_buf=False) needs its input in "
                             "get_registered_combine_input_buffer(dtype, hidden_dim)")
        fp8_wire = self._quant == EpDispatchCombineQuantType.Fp8DirectCast
        kind = _checks.combine_dtype_name(inp.dtype)
        if fp8_wire and kind != "bf16":
            raise TypeError(f"quant_type='fp8_direct_cast' combines bfloat16 input, got {inp.dtype}")
        if fp8_wire and inp.data_ptr() == registered.data_ptr():
            raise ValueError("quant_type='fp8_direct_cast' cannot combine from the registered buffer itself")
        wire = torch.float8_e4m3fn if fp8_wire else inp.dtype
        grid, threads = self._launch_params(block_num, warp_per_block)
        self._call = {"inp": inp, "weights": weights, "wire": wire, "grid": grid, "threads": threads,
                      "suffix": kind + ("_fp8" if fp8_wire else "")}
        if self._gpu:
            from ._gpu import EpArgs

            a = EpArgs.from_buffer_copy(self._args)
            a.inp, a.indices = int(inp.data_ptr()), int(indices.data_ptr())
            # Whether weights are combined is said apart from their pointer: a tensor with no rows
            # (a rank that received no tokens) may have data_ptr() 0 and must still be combined.
            a.weights = int(weights.data_ptr()) if weights is not None else 0
            a.hasWeights = int(weights is not None)
            a.numTokens, a.hidden = self._dispatched, inp.shape[1]
            a.inpRows, a.weightRows = inp.shape[0], weights.shape[0] if weights is not None else 0
            a.combRowBytes = inp.shape[1] * wire.itemsize
            self._kernels.combine_send(a, self._call["suffix"], grid, threads, self._stream())
            self._args = a
        else:
            self._cpu.combine_stage(inp, weights, wire)
        self._pending = "combine"
        return self._combine_views(inp, weights)

    def _combine_views(self, inp: Any, weights: Any) -> tuple[Any, Any]:
        import torch

        rows, k = self.config.max_num_inp_token_per_rank, self.config.num_experts_per_token
        out = self._view("comb_out", rows, inp.shape[1], inp.dtype)
        out_w = self._view("comb_out_weights", rows, k, torch.float32) if weights is not None else None
        return out, out_w

    def _combine_recv(self) -> tuple[Any, Any]:
        self._expect("combine", "combine_recv")
        c = self._call
        if self._gpu:
            self._kernels.combine_recv(self._args, c["suffix"], c["grid"], c["threads"], self._stream())
        else:
            self._cpu.combine_accumulate(c["inp"], c["weights"], self._dispatched or 0, c["wire"])
        self._pending, self._dispatched = None, None
        return self._combine_views(c["inp"], c["weights"])

    def reset(self) -> None:
        """Kept for MORI compatibility: the kernels leave their counters ready for the next round,
        so there is nothing to reset (MORI's reset is a no-op as well)."""
