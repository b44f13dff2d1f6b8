"""Routing handles (MORI's ``EpDispatchRoutingHandle``): one dispatch's routing, kept by the caller.

``dispatch(..., return_routing=True)`` returns a handle with where each of this rank's tokens went
and what this rank received; ``combine(..., routing=handle)`` brings the expert outputs back along
that routing (so a combine may follow a later dispatch, as with two micro-batches in flight), and
``dispatch(..., routing=handle)`` replays it: the same tokens to the same receive slots, with new
payloads (backward passes, repeated layers), without reserving slots again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EpDispatchRoutingHandle"]


@dataclass
class EpDispatchRoutingHandle:
    """One dispatch's routing (MORI's field names; the tensors live where the op's buffers do).

    Args:
        disp_dest_tok_id_map: int32 ``[max_num_inp_token_per_rank * num_experts_per_token]``: for
            top-k entry ``(t, j)`` of this rank's token ``t``, ``pe * max_num_tokens_to_send() +
            slot`` where it was received (-1: the entry sent nothing).
        inter_node_disp_dest_tok_id_map: int32; on the GPU heap across nodes ``[nodes *
            max_num_inp_token_per_rank * gpu_per_node]``: for each source node and combine row this
            rank, as that node's proxy, sends back, ``pe * max_num_tokens_to_recv() + slot`` where it
            forwarded the token (-1: none). Empty otherwise (the CPU heap reaches every receive slot
            itself: ``disp_dest_tok_id_map`` carries all).
        inter_node_disp_send_map: int32; on the GPU heap across nodes ``[nodes]``: the combine rows
            this rank sends back to each source node. Empty otherwise.
        total_recv_token_num: int32 ``[1]``: tokens this rank received.
        disp_tok_id_to_src_tok_id_local: int32 ``[max_num_tokens_to_recv()]``: per received row,
            ``src_rank * max_num_tokens_to_send() + src_token`` (as ``get_dispatch_src_token_pos``).
        cur_rank_num_token: tokens this rank dispatched.
    """

    disp_dest_tok_id_map: Any
    inter_node_disp_dest_tok_id_map: Any
    inter_node_disp_send_map: Any
    total_recv_token_num: Any
    disp_tok_id_to_src_tok_id_local: Any
    cur_rank_num_token: int = 0

    def tensors(self) -> tuple[Any, ...]:
        """The five tensors, in MORI's order (for :meth:`from_tensors`)."""
        return (
            self.disp_dest_tok_id_map,
            self.inter_node_disp_dest_tok_id_map,
            self.inter_node_disp_send_map,
            self.total_recv_token_num,
            self.disp_tok_id_to_src_tok_id_local,
        )

    @classmethod
    def from_tensors(cls, tensors: Any, cur_rank_num_token: int = 0) -> EpDispatchRoutingHandle:
        """A handle from :meth:`tensors` of another (MORI's signature)."""
        dest, inter_dest, inter_send, total, src = tensors
        return cls(dest, inter_dest, inter_send, total, src, cur_rank_num_token=cur_rank_num_token)

    @classmethod
    def allocate(
        cls, max_tokens: int, k: int, max_recv: int, device: Any, inter_node: tuple[int, int] = (0, 0)
    ) -> EpDispatchRoutingHandle:
        """A handle for a dispatch to fill; ``inter_node``: the sizes of the two inter-node maps."""
        import torch

        def ints(n: int) -> Any:
            return torch.zeros(n, dtype=torch.int32, device=device)

        return cls(
            disp_dest_tok_id_map=ints(max_tokens * k),
            inter_node_disp_dest_tok_id_map=ints(inter_node[0]),
            inter_node_disp_send_map=ints(inter_node[1]),
            total_recv_token_num=ints(1),
            disp_tok_id_to_src_tok_id_local=ints(max_recv),
        )

    def source_token_count(self) -> int:
        """``cur_rank_num_token``, checked (MORI's message). A handle a dispatch of no tokens filled
        has 0, which is valid (MORI refuses it, and so any rank without tokens)."""
        n = int(self.cur_rank_num_token)
        if n < 0 or (n == 0 and not getattr(self, "filled_by_dispatch", False)):
            raise ValueError(
                "routing handle has cur_rank_num_token <= 0; use a handle from "
                "dispatch(..., return_routing=True) or pass a positive cur_rank_num_token to "
                "EpDispatchRoutingHandle.from_tensors(...)"
            )
        return n

    def check_fits(self, max_tokens: int, k: int, max_recv: int, inter_node: tuple[int, int] = (0, 0)) -> None:
        """Raises ValueError when the handle's tensors are not this op's shapes and dtype
        (``inter_node``: the inter-node maps' sizes, on the GPU heap across nodes)."""
        import torch

        for name, t, n in (
            ("disp_dest_tok_id_map", self.disp_dest_tok_id_map, max_tokens * k),
            ("total_recv_token_num", self.total_recv_token_num, 1),
            ("disp_tok_id_to_src_tok_id_local", self.disp_tok_id_to_src_tok_id_local, max_recv),
            ("inter_node_disp_dest_tok_id_map", self.inter_node_disp_dest_tok_id_map, inter_node[0]),
            ("inter_node_disp_send_map", self.inter_node_disp_send_map, inter_node[1]),
        ):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.numel() < n:
                raise ValueError(
                    f"routing.{name} must be an int32 tensor of at least {n} elements (a handle "
                    "from this op's dispatch(..., return_routing=True))"
                )
        if self.source_token_count() > max_tokens:
            raise ValueError(
                f"routing.cur_rank_num_token={self.cur_rank_num_token} exceeds max_num_inp_token_per_rank={max_tokens}"
            )

    def check_replay(self, indices: Any, num_experts_per_rank: int, world_size: int, max_send: int) -> None:
        """Raises ValueError when ``indices`` do not route as the handle's dispatch did (every top-k
        entry to the same rank, or to none): a replay takes the same indices, with new payloads.
        Reads the handle on the host (a device synchronization on the GPU heap)."""
        import torch

        from ._layout import plan_routing

        dest = plan_routing(indices, num_experts_per_rank, world_size)
        had = self.disp_dest_tok_id_map[: dest.numel()].view(dest.shape).to(torch.int64)
        had_pe = torch.where(had >= 0, torch.div(had, max_send, rounding_mode="floor"), torch.full_like(had, -1))
        if not torch.equal(had_pe, dest):
            raise ValueError(
                "replay dispatch: indices route differently from the routing handle's dispatch "
                "(a replay takes the same indices, with new payloads)"
            )
