"""Routing handles on the op's buffers: a dispatch's routing copied into a new handle, and a
handle's routing put back where the GPU kernels read it (a replay, a combine along a handle).

A handle holds where this rank's top-k entries went (``disp_dest_tok_id_map``), what it received
and, on the GPU heap across nodes, this rank's proxy side of the round (kernels/ep_internode.cu):
for each source node and combine row, where it forwarded the token (the op's ``ret_map``), and the
rows it sends back to each source node (the ``EP_RETURN_ROWS`` control words). With both, a
combine along an older handle returns that round's rows, and a replay forwards each token to the
receive slots it had, reserving none. Everything is copied on the stream: no host synchronization.
"""

from __future__ import annotations

from typing import Any

from ._buffers import CONTROL, EpBuffers
from ._config import EpDispatchCombineConfig
from ._internode import InterNodeBuffers, NodePlan, return_map_size
from ._routing import EpDispatchRoutingHandle

__all__ = ["HandleRouting"]


class HandleRouting:
    """The routing-handle side of one op: its config, buffers and (GPU heap across nodes) its
    inter-node buffers and node plan; ``max_recv`` rows a rank receives at most."""

    def __init__(
        self,
        config: EpDispatchCombineConfig,
        bufs: EpBuffers,
        max_recv: int,
        device: Any,
        inter: InterNodeBuffers | None = None,
        plan: NodePlan | None = None,
    ) -> None:
        self.config, self.bufs, self.max_recv, self.device = config, bufs, max_recv, device
        self.inter, self.plan = inter, plan
        # The sizes of a handle's two inter-node maps (none but on the GPU heap across nodes).
        self.map_sizes = (return_map_size(config, plan), plan.nodes) if inter is not None and plan else (0, 0)

    def check(self, handle: EpDispatchRoutingHandle) -> int:
        """Raises ValueError for a handle that is not of this op's shapes; its source token count."""
        cfg = self.config
        handle.check_fits(cfg.max_num_inp_token_per_rank, cfg.num_experts_per_token, self.max_recv, self.map_sizes)
        return handle.source_token_count()

    def allocate(self) -> EpDispatchRoutingHandle:
        """An empty handle for a dispatch to fill (:meth:`snapshot`)."""
        cfg = self.config
        return EpDispatchRoutingHandle.allocate(
            cfg.max_num_inp_token_per_rank, cfg.num_experts_per_token, self.max_recv, self.device, self.map_sizes
        )

    def _return_rows(self) -> Any:
        assert self.plan is not None, "only across nodes"
        at = CONTROL["EP_RETURN_ROWS"]
        return self.bufs.control[at : at + self.plan.nodes]

    def snapshot(self, handle: EpDispatchRoutingHandle, n: int, total: Any) -> None:
        """Copies the routing of the dispatch that just ran (``n`` tokens; ``total``: its received
        count) into ``handle``."""
        k = self.config.num_experts_per_token
        handle.disp_dest_tok_id_map.fill_(-1)
        handle.disp_dest_tok_id_map[: n * k].copy_(self.bufs.dest_map[: n * k])
        handle.total_recv_token_num.copy_(total)
        handle.disp_tok_id_to_src_tok_id_local.copy_(self.bufs.disp_src_pos[: self.max_recv])
        if self.inter is not None:
            handle.inter_node_disp_dest_tok_id_map.copy_(self.inter.ret_map)
            handle.inter_node_disp_send_map.copy_(self._return_rows())
        handle.cur_rank_num_token = n
        handle.filled_by_dispatch = True  # type: ignore[attr-defined]

    def restore(self, handle: EpDispatchRoutingHandle | None) -> None:
        """GPU: the kernels' routing becomes ``handle``'s (where this rank's entries went, and across
        nodes its proxy side of that round); None (a dispatch that makes a new handle): across
        nodes, the proxy side starts afresh, whatever a dispatch not yet combined left there."""
        if handle is not None:
            n = handle.cur_rank_num_token * self.config.num_experts_per_token
            self.bufs.dest_map[:n].copy_(handle.disp_dest_tok_id_map[:n])
        if self.inter is None:
            return
        if handle is not None:
            self.inter.ret_map.copy_(handle.inter_node_disp_dest_tok_id_map)
            self._return_rows().copy_(handle.inter_node_disp_send_map)
        else:
            self.inter.ret_map.fill_(-1)
            self._return_rows().zero_()
