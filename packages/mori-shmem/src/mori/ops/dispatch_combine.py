"""``EpDispatchCombineOp``: MORI-EP's dispatch and combine, as vLLM and SGLang call them.

After ``mori.shmem`` is initialized on every rank of the expert-parallel group (usually
``shmem_torch_process_group_init``), each rank builds the op from the same config (collective:
its buffers are allocated on the symmetric heap) and calls::

    out, out_w, out_s, out_idx, n = op.dispatch(x, topk_weights, scales, topk_ids)
    y = experts(out[:n.item()], ...)               # any expert computation, row for row
    combined, combined_w = op.combine(y, out_w, topk_ids)

Results are views of op-owned buffers (as in MORI): dispatch's hold this round's tokens until
this rank calls combine (peers' next dispatch writes into them after that), combine's until the
next combine. Every dispatch must be followed by one combine on every rank (routing handles
relax this). ``AsyncLL`` splits each into ``*_send`` and ``*_recv``.
"""

from __future__ import annotations

from typing import Any

from . import _checks
from ._buffers import CONTROL, EpBuffers, view_rows
from ._config import (
    INTER_NODE_KERNEL_TYPES,
    EpDispatchCombineConfig,
    EpDispatchCombineKernelType,
    EpDispatchCombineQuantType,
    capacities,
    ep_settings,
    normalize_quant_type,
    validate_config,
)
from ._handles import HandleRouting
from ._quant import CombineWire
from ._routing import EpDispatchRoutingHandle

__all__ = ["EpDispatchCombineOp", "warmup_jit_kernels"]

#: Kernel types whose ops take routing handles (MORI's set).
_ROUTING_KERNEL_TYPES = (EpDispatchCombineKernelType.IntraNode, EpDispatchCombineKernelType.InterNodeV1)
#: Kernel types that need every PE's heap mapped (AsyncLL reaches other nodes as InterNodeV1 does).
_ALL_MAPPED_KERNEL_TYPES = (EpDispatchCombineKernelType.IntraNode, EpDispatchCombineKernelType.IntraNodeLL)
#: The wire of each quant type (_quant.py).
_WIRE_KIND = {
    EpDispatchCombineQuantType.None_: "same",
    EpDispatchCombineQuantType.Fp8DirectCast: "fp8_cast",
    EpDispatchCombineQuantType.Fp8BlockwiseQuant: "fp8_blockwise",
    EpDispatchCombineQuantType.Fp4BlockwiseQuant: "fp4_blockwise",
}


def warmup_jit_kernels(kernel_type: Any) -> str | None:
    """Compiles mori.ops' kernels ahead of the first op (MORI's function): call it in the main
    process before spawning PEs so they find the compiled module in NVRTC's disk cache (one module
    serves every kernel type). Returns the architecture compiled for (``sm_90`` ...), or None where
    no GPU is visible (the CPU heap compiles nothing). Needs no mori.shmem initialization; raises
    ValueError for what is not a kernel type."""
    import torch

    from ._config import _kernel_type

    _kernel_type(kernel_type)
    if not torch.cuda.is_available():
        return None
    from ._gpu import compile_kernels

    return compile_kernels()


class EpDispatchCombineOp:
    """MoE token dispatch/combine between PEs (MORI's ``EpDispatchCombineOp``): of one node with
    ``IntraNode``/``IntraNodeLL``, across nodes with ``InterNode``/``InterNodeV1``/``InterNodeV1LL``
    and ``AsyncLL``.

    Construction is collective (every rank of ``config.world_size``, same config except ``rank``)
    and raises before allocating anything when the config is invalid or does not match the
    initialized mori.shmem (rank, world size; for the intra-node types every peer mapped, for the
    inter-node types on GPUs every PE of this rank's ``gpu_per_node`` node mapped).
    """

    def __init__(self, config: EpDispatchCombineConfig) -> None:
        import torch

        from mori.shmem import shmem_barrier_all, shmem_heap_info, shmem_mype, shmem_npes

        self.kernel_type = validate_config(config)
        self.settings = ep_settings(self.kernel_type)
        self.config = config
        info = shmem_heap_info()  # raises ShmemNotInitializedError before init
        if (shmem_mype(), shmem_npes()) != (config.rank, config.world_size):
            raise ValueError(
                f"config says rank {config.rank} of {config.world_size}, but mori.shmem is PE "
                f"{shmem_mype()} of {shmem_npes()}: build the op with the shmem PE numbering"
            )
        unreachable = sorted(set(range(config.world_size)) - set(info["reachable"]))
        if unreachable and self.kernel_type in _ALL_MAPPED_KERNEL_TYPES:
            raise ValueError(
                f"PEs {unreachable} are not mapped in PE {config.rank} (another host, or "
                f"MORI_DISABLE_P2P): {self.kernel_type.name} needs every PE's heap mapped; "
                "InterNodeV1, InterNodeV1LL or AsyncLL reach them"
            )
        self._gpu = info["kind"] == "gpu"
        plan = None
        if self._gpu and (
            self.kernel_type in INTER_NODE_KERNEL_TYPES or self.kernel_type == EpDispatchCombineKernelType.AsyncLL
        ):
            from ._internode import node_plan

            plan = node_plan(config, info["reachable"])
            plan = plan if plan.nodes > 1 else None  # one node: the IntraNode kernels alone
        self._plan = plan
        self._quant = normalize_quant_type(config.quant_type)
        self._cap = capacities(config)
        self._device = torch.device("cuda", info["device"]) if self._gpu else torch.device("cpu")
        self.local_expert_count = torch.zeros(config.num_experts_per_rank, dtype=torch.int32, device=self._device)
        scale_dim = self.settings.combine_scale_dim
        self._bufs = EpBuffers.allocate(config, scale_dim)
        max_send, max_recv = self._cap["max_num_tokens_to_send"], self._cap["max_num_tokens_to_recv"]
        if self._gpu:
            from ._gpu import GpuKernels, make_args
            from ._internode import InterNodeBuffers

            low_latency = self.kernel_type == EpDispatchCombineKernelType.InterNodeV1LL
            inter = InterNodeBuffers.allocate(config, plan, low_latency, scale_dim) if plan is not None else None
            self._handles = HandleRouting(config, self._bufs, max_recv, self._device, inter, plan)
            split = self.kernel_type == EpDispatchCombineKernelType.AsyncLL
            self._kernels = GpuKernels(plan, self.get_launch_config()[1], split)
            self._base_args = make_args(
                self._bufs, config, self.local_expert_count, max_send, max_recv, plan, inter, low_latency, scale_dim
            )
            torch.cuda.synchronize(self._device)
        else:
            from ._cpu import CpuBackend

            self._cpu = CpuBackend(config, self._bufs, max_send, max_recv)
            self._handles = HandleRouting(config, self._bufs, max_recv, self._device)
        from ._stdmoe import StandardMoeLayout

        self._stdmoe = StandardMoeLayout(
            config.num_experts_per_rank, max_send, max_recv, config.num_experts_per_token, self._device
        )
        # Buffers are zeroed before any peer may write into them (a peer's first dispatch).
        shmem_barrier_all()
        self._dispatched: int | None = None  # tokens of the dispatch awaiting its combine
        self._pending: str | None = None  # "dispatch" / "combine" between an AsyncLL send and recv
        self._last_routing: EpDispatchRoutingHandle | None = None  # the handle of the pending dispatch
        self._dispatch_weights = False  # whether the pending dispatch carried top-k weights
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

    def get_launch_config(
        self, is_dispatch: bool = True, block_num: int = -1, rdma_block_num: int = -1, warp_per_block: int = -1
    ) -> tuple[int, int, int]:
        """``(block_num, rdma_block_num, warp_per_block)`` a call with these overrides would use:
        with ``MORI_EP_LAUNCH_CONFIG_MODE=AUTO``, MORI's geometry for the kernel type (over the call's
        values, as MORI); otherwise the call's values where > 0, else the config's."""
        if self.settings.auto_launch is not None:
            return self.settings.auto_launch
        cfg = self.config
        return (
            block_num if block_num > 0 else cfg.block_num,
            rdma_block_num if rdma_block_num > 0 else cfg.rdma_block_num,
            warp_per_block if warp_per_block > 0 else cfg.warp_num_per_block,
        )

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
            total = self._views[("total",)] = self._bufs.control[at : at + 1]
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
        """The caller's current stream on this op's GPU."""
        import torch

        return int(torch.cuda.current_stream(self._device).cuda_stream)

    def _expect(self, pending: str | None, what: str) -> None:
        if self._pending != pending:
            have = f"a {self._pending}_send without its {self._pending}_recv" if self._pending else "no send"
            raise RuntimeError(f"{what}: called after {have}")

    def _check_routing_kernel(self, what: str) -> None:
        if self.kernel_type not in _ROUTING_KERNEL_TYPES:
            raise NotImplementedError(
                f"routing handle path not supported for kernel_type={self.kernel_type}; only "
                f"IntraNode and InterNodeV1 {what}"
            )

    def dispatch(
        self,
        input: Any,
        weights: Any,
        scales: Any,
        indices: Any,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        call_local_expert_count: bool = False,
        *,
        routing: EpDispatchRoutingHandle | None = None,
        return_routing: bool = False,
    ) -> tuple[Any, ...]:
        """Sends each token to every distinct rank among its top-k experts.

        ``input`` ``[n, hidden]`` (any 1/2/4-byte dtype that fits the config: bf16, fp8 e4m3 ...),
        ``weights`` ``[n, k]`` float32 or None, ``scales`` ``[n, scale_dim]`` or None, ``indices``
        ``[n, k]`` int32 expert ids (ids < 0 or past the last rank are dropped). Returns views
        ``(tokens [R, hidden], weights [R, k] float32, scales [R, scale_dim] or None, indices
        [R, k] int32, recv_count [1] int32)`` with ``R = max_num_tokens_to_recv()``; the first
        ``recv_count`` rows are this rank's tokens, each with its sender's full top-k row.
        ``call_local_expert_count`` also fills :attr:`local_expert_count`.

        ``return_routing=True`` appends an :class:`EpDispatchRoutingHandle` of this dispatch (its
        ``recv_count`` is then the handle's; such dispatches may be in flight together, each combined
        with its handle); ``routing=handle`` replays a handle's routing (same ``indices``, new
        payloads) into the same receive slots, reserving none (``indices`` are checked against the
        handle on the host: a device synchronization on the GPU heap). IntraNode and InterNodeV1.
        """
        if routing is not None and return_routing:
            raise ValueError("pass either `routing=` (replay) or `return_routing=True` (new layout), not both")
        handle = None
        if routing is not None or return_routing:
            self._check_routing_kernel("expose cache/replay routing dispatch.")
            cfg = self.config
            if routing is not None:
                n = self._handles.check(routing)
                if input.shape[0] != n or indices.shape[0] != n:
                    raise ValueError(
                        f"replay dispatch input has {input.shape[0]} tokens and indices "
                        f"{indices.shape[0]} rows but routing.cur_rank_num_token={n}"
                    )
                _checks.check_dispatch(self.config, self._device, input, weights, scales, indices)
                routing.check_replay(indices, cfg.num_experts_per_rank, cfg.world_size, self.max_num_tokens_to_send())
            else:
                handle = self._handles.allocate()
        stream = self._stream() if self._gpu else None  # once for both halves: a lookup costs microseconds
        views = self._dispatch_send(
            input,
            weights,
            scales,
            indices,
            block_num,
            warp_per_block,
            routing,
            routed=routing is not None or return_routing,
            stream=stream,
        )
        self._dispatch_recv(call_local_expert_count, stream)
        if handle is None:
            return views
        self._handles.snapshot(handle, input.shape[0], self._total())
        self._last_routing = handle
        return (*views[:4], handle.total_recv_token_num, handle)

    def dispatch_send(
        self,
        input: Any,
        weights: Any,
        scales: Any,
        indices: Any,
        block_num: int = -1,
        warp_per_block: int = -1,
        call_local_expert_count: bool = False,
    ) -> tuple[Any, ...]:
        """AsyncLL: sends this rank's tokens and returns the dispatch views, which hold the received
        tokens once :meth:`dispatch_recv` ran. Other kernel types: :meth:`dispatch` (as MORI)."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            return self.dispatch(
                input,
                weights,
                scales,
                indices,
                block_num=block_num,
                warp_per_block=warp_per_block,
                call_local_expert_count=call_local_expert_count,
            )
        return self._dispatch_send(input, weights, scales, indices, block_num, warp_per_block)

    def dispatch_recv(
        self, block_num: int = -1, warp_per_block: int = -1, call_local_expert_count: bool = False
    ) -> None:
        """AsyncLL: waits (on the stream) for every rank's tokens; fills :attr:`local_expert_count` if asked."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            raise ValueError(f"dispatch_recv only supports AsyncLL, got kernel_type={self.kernel_type.name}")
        self._dispatch_recv(call_local_expert_count)

    def _dispatch_send(
        self,
        inp: Any,
        weights: Any,
        scales: Any,
        indices: Any,
        block_num: int,
        warp_per_block: int,
        replay: EpDispatchRoutingHandle | None = None,
        routed: bool = False,
        stream: int | None = None,
    ) -> tuple[Any, ...]:
        import torch

        self._expect(None, "dispatch")
        # A dispatch that keeps its routing in a handle may follow another before that one's combine
        # (the caller combines each with its handle, as in MORI).
        if self._dispatched is not None and not routed:
            raise RuntimeError(
                "dispatch called twice without a combine in between: every dispatch must be "
                "followed by one combine on every rank"
            )
        has_scales = _checks.check_dispatch(self.config, self._device, inp, weights, scales, indices)
        grid, threads = self._launch_params(block_num, warp_per_block)
        scales = scales if has_scales else None
        if self._gpu:
            from ._gpu import EpArgs

            if routed:
                self._routed_prologue(0, replay)

            a = EpArgs.from_buffer_copy(self._base_args)
            a.replay = int(replay is not None)
            a.inp, a.indices = int(inp.data_ptr()), int(indices.data_ptr())
            a.weights = int(weights.data_ptr()) if weights is not None else 0
            a.scales = int(scales.data_ptr()) if scales is not None else 0
            a.numTokens, a.rowBytes = inp.shape[0], inp.shape[1] * inp.element_size()
            a.scaleBytes = scales.shape[1] * scales.element_size() if scales is not None else 0
            self._kernels.dispatch_send(a, grid, threads, self._stream() if stream is None else stream)
            self._args = a
        else:
            self._cpu.dispatch(
                inp,
                weights,
                scales,
                indices,
                None if replay is None else (replay.disp_dest_tok_id_map, replay.total_recv_token_num),
                routed,
            )
        self._dispatched, self._dispatch_weights = inp.shape[0], weights is not None
        self._last_routing = replay
        self._pending = "dispatch"
        recv, cfg = self.max_num_tokens_to_recv(), self.config
        out_scales = self._view("disp_scales", recv, cfg.scale_dim, scales.dtype) if scales is not None else None
        return (
            self._view("disp_tok", recv, inp.shape[1], inp.dtype),
            self._view("disp_weights", recv, cfg.num_experts_per_token, torch.float32),
            out_scales,
            self._view("disp_indices", recv, cfg.num_experts_per_token, torch.int32),
            self._total(),
        )

    def _routed_prologue(self, phase: int, handle: EpDispatchRoutingHandle | None) -> None:
        """GPU: a routed call may follow a dispatch (or combine) with no combine (dispatch) between.
        A device barrier on the stream first lets every PE's earlier kernels finish (slot counters
        cleared, staged rows read) before any PE writes to a peer, as the pairing otherwise
        guarantees; then the device's pairing flag is set as the kernels expect (0 before a
        dispatch, 1 before a combine), and the kernels' routing becomes ``handle``'s (a replay, a
        combine along a handle; None: a dispatch that makes a new handle)."""
        import torch

        from mori.shmem import shmem_barrier_on_stream

        shmem_barrier_on_stream(torch.cuda.current_stream(self._device))
        at = CONTROL["EP_PHASE"]
        self._bufs.control[at : at + 1].fill_(phase)
        self._handles.restore(handle)

    def _dispatch_recv(self, count: bool, stream: int | None = None) -> None:
        self._expect("dispatch", "dispatch_recv")
        if self._gpu:
            self._kernels.dispatch_recv(self._args, count, self._stream() if stream is None else stream)
        elif count:
            self._cpu.count_experts(self.local_expert_count)
        self._pending = None

    # -- combine --------------------------------------------------------------------------------
    def combine(
        self,
        input: Any,
        weights: Any,
        indices: Any,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        use_external_inp_buf: int = -1,
        call_reset: bool = False,
        *,
        routing: EpDispatchRoutingHandle | None = None,
    ) -> tuple[Any, Any]:
        """Returns each of this rank's tokens summed over the ranks it was dispatched to.

        ``input`` ``[rows, hidden]`` (bf16, float32, fp8 e4m3 / e4m3fnuz, or packed fp4
        ``float4_e2m1fn_x2``): row ``s`` answers dispatch output row ``s`` (rows past ``rows`` count
        as zeros). ``weights`` ``[rows, k]`` float32 or None. ``indices``: this rank's own top-k ids,
        the tensor given to dispatch. Returns views ``(out [max_num_inp_token_per_rank, hidden] of
        input's dtype, weights [.., k] or None)``; the first ``n`` rows (n = tokens dispatched) hold,
        per token, the float32 sum of the rows its destinations sent back (decoded from the
        ``quant_type`` wire), in top-k order, rounded once (weights likewise). ``routing``: combine
        along that handle's dispatch (its rows in ``input``) rather than the last dispatch's.
        """
        stream = self._stream() if self._gpu else None  # once for both halves
        self._combine_send(
            input, weights, indices, block_num, warp_per_block, use_external_inp_buf, routing, stream, whole=True
        )
        return self._combine_recv(stream)

    def combine_send(
        self, input: Any, weights: Any, indices: Any, block_num: int = -1, warp_per_block: int = -1
    ) -> tuple[Any, Any]:
        """AsyncLL: stages this rank's expert outputs for its peers and returns the combine views,
        filled once :meth:`combine_recv` ran. Other kernel types: :meth:`combine` (as MORI)."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            return self.combine(input, weights, indices, block_num=block_num, warp_per_block=warp_per_block)
        return self._combine_send(input, weights, indices, block_num, warp_per_block, -1, None)

    def combine_recv(self, block_num: int = -1, warp_per_block: int = -1) -> None:
        """AsyncLL: waits for every rank's expert outputs and sums them into the combine views."""
        if self.kernel_type != EpDispatchCombineKernelType.AsyncLL:
            raise ValueError(f"combine_recv only supports AsyncLL, got kernel_type={self.kernel_type.name}")
        self._combine_recv()

    def _wire(self, inp: Any, registered: Any) -> CombineWire:
        """The wire of a combine of ``inp`` under this op's quant type (raises for what it cannot take)."""
        import torch

        _checks.combine_dtype_name(inp.dtype)
        kind = _WIRE_KIND[self._quant]
        if kind != "same":
            if inp.dtype != torch.bfloat16:
                raise TypeError(f"quant_type={self.config.quant_type!r} combines bfloat16 input, got {inp.dtype}")
            if inp.data_ptr() == registered.data_ptr():
                raise ValueError(
                    f"quant_type={self.config.quant_type!r} cannot combine from the registered "
                    "buffer itself (the rows are re-encoded into it)"
                )
        scale_dim = self.settings.combine_scale_dim if kind.endswith("blockwise") else 0
        return CombineWire(kind, inp.dtype, inp.shape[1], scale_dim)

    def _combine_send(
        self,
        inp: Any,
        weights: Any,
        indices: Any,
        block_num: int,
        warp_per_block: int,
        use_external_inp_buf: int,
        routing: EpDispatchRoutingHandle | None,
        stream: int | None = None,
        whole: bool = False,
    ) -> tuple[Any, Any]:
        """``whole``: the accumulate is enqueued right after the stage (combine(), not AsyncLL's
        combine_send), so the kernels may read the input in place until then."""
        self._expect(None, "combine")
        if routing is not None:
            self._check_routing_kernel("currently consume routing handles in combine.")
            dispatched = self._handles.check(routing)
        elif self._dispatched is None:
            raise RuntimeError("combine called without a preceding dispatch")
        else:
            dispatched = self._dispatched
        _checks.check_combine(self.config, self._device, inp, weights, indices, dispatched)
        external = bool(self.config.use_external_inp_buf if use_external_inp_buf < 0 else use_external_inp_buf)
        registered = self.get_registered_combine_input_buffer(inp.dtype, inp.shape[1])
        if not external and inp.data_ptr() != registered.data_ptr():
            raise ValueError(
                "zero-copy combine (use_external_inp_buf=False) needs its input in "
                "get_registered_combine_input_buffer(dtype, hidden_dim)"
            )
        wire = self._wire(inp, registered)
        grid, threads = self._launch_params(block_num, warp_per_block)
        if routing is not None:
            dest = routing.disp_dest_tok_id_map
            total = routing.total_recv_token_num
        else:
            dest = self._bufs.dest_map
            total = self._total()
        self._call = {
            "inp": inp,
            "weights": weights,
            "wire": wire,
            "grid": grid,
            "threads": threads,
            "dest": dest,
            "tokens": dispatched,
            "routing": routing,
        }
        if self._gpu:
            from ._gpu import EpArgs, wire_suffix

            if routing is not None:  # the handle's routing, in the buffers the kernels read
                self._routed_prologue(1, routing)
                self._total().copy_(total)
            a = EpArgs.from_buffer_copy(self._args)
            a.inp, a.indices = int(inp.data_ptr()), int(indices.data_ptr())
            # Whether weights are combined is said apart from their pointer: a tensor with no rows
            # (a rank that received no tokens) may have data_ptr() 0 and must still be combined.
            a.weights = int(weights.data_ptr()) if weights is not None else 0
            a.hasWeights = int(weights is not None)
            a.numTokens, a.hidden = dispatched, inp.shape[1]
            a.inpRows, a.weightRows = inp.shape[0], weights.shape[0] if weights is not None else 0
            a.combRowBytes, a.combScaleDim, a.combCodeBytes = (
                wire.row_bytes,
                wire.scale_dim,
                wire.code_bytes if wire.blockwise else 0,
            )
            self._call["suffix"] = wire_suffix(wire)
            # Rows this rank sent itself are summed from the input in place where it goes unencoded
            # and aligned, and stays the routing the kernels' receive buffers hold (no handle).
            own_in_place = (
                whole
                and routing is None
                and wire.kind == "same"
                and inp.data_ptr() != registered.data_ptr()
                and inp.data_ptr() % 16 == 0
            )
            self._kernels.combine_send(
                a, self._call["suffix"], grid, threads, self._stream() if stream is None else stream, own_in_place
            )
            self._args = a
        else:
            self._cpu.combine_stage(inp, weights, wire, int(total[0]), routing is not None)
        self._pending = "combine"
        return self._combine_views(inp, weights)

    def _combine_views(self, inp: Any, weights: Any) -> tuple[Any, Any]:
        import torch

        rows, k = self.config.max_num_inp_token_per_rank, self.config.num_experts_per_token
        out = self._view("comb_out", rows, inp.shape[1], inp.dtype)
        out_w = self._view("comb_out_weights", rows, k, torch.float32) if weights is not None else None
        return out, out_w

    def _combine_recv(self, stream: int | None = None) -> tuple[Any, Any]:
        self._expect("combine", "combine_recv")
        c = self._call
        if self._gpu:
            stream = self._stream() if stream is None else stream
            self._kernels.combine_recv(self._args, c["suffix"], c["grid"], c["threads"], stream)
        else:
            self._cpu.combine_accumulate(c["weights"] is not None, c["dest"], c["tokens"], c["wire"])
        self._pending = None
        # A combine along a handle ends the pending dispatch only when it is that dispatch's handle.
        if c["routing"] is None or c["routing"] is self._last_routing:
            self._dispatched, self._last_routing = None, None
        return self._combine_views(c["inp"], c["weights"])

    # -- the standard-MoE layout (MORI's) ---------------------------------------------------------
    def dispatch_standard_moe(
        self,
        input: Any,
        weights: Any,
        scales: Any,
        indices: Any,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
    ) -> tuple[Any, Any, Any, Any]:
        """:meth:`dispatch`, then :meth:`convert_dispatch_output`: the received tokens grouped by local
        expert, ``(packed_recv_x [E, M, hidden], packed_recv_count [E] int32, packed_recv_src_info
        [E, M] int32, packed_recv_layout_range [0] int64)`` with ``E = num_experts_per_rank`` and ``M =
        world_size * max_num_inp_token_per_rank``. Not AsyncLL (its dispatch is split)."""
        if self.kernel_type == EpDispatchCombineKernelType.AsyncLL:
            raise ValueError(
                "dispatch_standard_moe does not support AsyncLL (use dispatch_send/dispatch_recv, "
                "then convert_dispatch_output)"
            )
        out, _, _, out_idx, _ = self.dispatch(
            input, weights, scales, indices, block_num, rdma_block_num, warp_per_block
        )
        return self.convert_dispatch_output(out, out_idx, block_num, warp_per_block)

    def combine_standard_moe(
        self,
        input: Any,
        weights: Any,
        indices: Any,
        block_num: int = -1,
        rdma_block_num: int = -1,
        warp_per_block: int = -1,
        call_reset: bool = False,
    ) -> tuple[Any, None]:
        """:meth:`convert_combine_input` of the expert outputs ``input`` ``[E, M, hidden]``, then
        :meth:`combine` of the result; returns ``(out, None)`` as MORI."""
        rows = self.convert_combine_input(input, None, None, block_num, warp_per_block)
        out, _ = self.combine(rows, weights, indices, block_num, rdma_block_num, warp_per_block)
        return out, None

    def convert_dispatch_output(
        self, dispatch_out_x: Any, dispatch_out_topk_idx: Any, block_num: int = -1, warp_per_block: int = -1
    ) -> tuple[Any, Any, Any, Any]:
        """The last dispatch's outputs (``dispatch_out_x``, ``dispatch_out_topk_idx``: its views)
        grouped by local expert (see :meth:`dispatch_standard_moe`). ``packed_recv_count`` is an
        op-owned view, reset by :meth:`convert_combine_input`."""
        if self._dispatched is None:
            raise RuntimeError("convert_dispatch_output needs a dispatch awaiting its combine")
        _checks.check_packed_inputs(
            self.config, self._device, dispatch_out_x, dispatch_out_topk_idx, self.max_num_tokens_to_recv()
        )
        return self._stdmoe.pack(
            dispatch_out_x, dispatch_out_topk_idx, self._total(), self._bufs.disp_src_pos, self.config.rank
        )

    def convert_combine_input(
        self,
        packed_recv_x: Any,
        packed_recv_src_info: Any,
        packed_recv_layout_range: Any,
        block_num: int = -1,
        warp_per_block: int = -1,
    ) -> Any:
        """Expert outputs in the packed layout ``[E, M, hidden]`` -> the registered combine input
        ``[max_num_tokens_to_recv, hidden]`` (pass it to :meth:`combine`): per received token, its
        packed rows times its dispatched top-k weights (1 without weights), summed in float32 in
        top-k order and rounded once. ``packed_recv_src_info`` and the layout range are accepted
        for MORI's signature (the op keeps where each packed row came from)."""
        import torch

        if self._dispatched is None:
            raise RuntimeError("convert_combine_input needs a dispatch awaiting its combine")
        cfg, recv = self.config, self.max_num_tokens_to_recv()
        if (
            not isinstance(packed_recv_x, torch.Tensor)
            or packed_recv_x.dim() != 3
            or tuple(packed_recv_x.shape[:2]) != (cfg.num_experts_per_rank, self.max_num_tokens_to_send())
        ):
            raise ValueError(
                f"packed_recv_x must be [num_experts_per_rank={cfg.num_experts_per_rank}, "
                f"{self.max_num_tokens_to_send()}, hidden], got "
                f"{list(getattr(packed_recv_x, 'shape', []))}"
            )
        _checks.combine_dtype_name(packed_recv_x.dtype)
        if packed_recv_x.device != self._device:
            raise ValueError(f"packed_recv_x is on {packed_recv_x.device}, but this PE's heap is on {self._device}")
        out = self.get_registered_combine_input_buffer(packed_recv_x.dtype, packed_recv_x.shape[2])
        weights = (
            self._view("disp_weights", recv, cfg.num_experts_per_token, torch.float32)
            if self._dispatch_weights
            else None
        )
        return self._stdmoe.unpack(packed_recv_x, weights, self._total(), out)

    def reset(self) -> None:
        """Kept for MORI compatibility: the kernels leave their counters ready for the next round,
        so there is nothing to reset (MORI's reset is a no-op as well)."""
