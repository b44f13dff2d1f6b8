"""The CPU backend: the same buffers and routing rule on a host-memory heap (no GPU).

Each PE writes the tokens it sends straight into its peers' buffers (views of their heap segments)
after reserving slots with a host atomic on the receiver's counter, exactly as the GPU kernels do;
host barriers stand in for the device signals. It makes the whole op run, and be tested, with
real processes on a CPU-only machine.
"""

from __future__ import annotations

from typing import Any

from mori.shmem import shmem_atomic_fetch_add, shmem_barrier_all, shmem_peer_tensor

from ._buffers import CONTROL, EpBuffers, view_rows
from ._config import EpDispatchCombineConfig
from ._layout import accumulate_rows, plan_routing

__all__ = ["CpuBackend"]


class CpuBackend:
    """Dispatch and combine with host loads and stores on the CPU heap."""

    def __init__(self, cfg: EpDispatchCombineConfig, bufs: EpBuffers, max_send: int, max_recv: int) -> None:
        self.cfg, self.bufs, self.max_send, self.max_recv = cfg, bufs, max_send, max_recv

    def _peer(self, name: str, pe: int) -> Any:
        t = getattr(self.bufs, name)
        return t if pe == self.cfg.rank else shmem_peer_tensor(t, pe)

    def dispatch(self, inp: Any, weights: Any, scales: Any, indices: Any) -> None:
        import torch

        cfg, bufs, k = self.cfg, self.bufs, self.cfg.num_experts_per_token
        dest = plan_routing(indices, cfg.num_experts_per_rank, cfg.world_size)
        dest_map = bufs.dest_map[: dest.numel()].view(dest.shape)
        dest_map.fill_(-1)
        row_bytes = inp.shape[1] * inp.element_size()
        overflow = []
        for pe in range(cfg.world_size):
            tokens, slots = (dest == pe).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            base = shmem_atomic_fetch_add(bufs.control_address("EP_RECV_OFFSET"), tokens.numel(), pe, width=32)
            if base + tokens.numel() > self.max_recv:
                overflow.append(pe)  # nothing written there; every PE still joins the barriers below
                continue
            rows = slice(base, base + tokens.numel())
            view_rows(self._peer("disp_tok", pe), self.max_recv, row_bytes, torch.uint8)[rows] = \
                inp.view(torch.uint8).view(inp.shape[0], row_bytes)[tokens]
            view_rows(self._peer("disp_indices", pe), self.max_recv, k, torch.int32)[rows] = indices[tokens]
            if weights is not None:
                view_rows(self._peer("disp_weights", pe), self.max_recv, k, torch.float32)[rows] = weights[tokens]
            if scales is not None:
                sb = scales.shape[1] * scales.element_size()
                view_rows(self._peer("disp_scales", pe), self.max_recv, sb, torch.uint8)[rows] = \
                    scales.view(torch.uint8).view(scales.shape[0], sb)[tokens]
            self._peer("disp_src_pos", pe)[rows] = (cfg.rank * self.max_send + tokens).to(torch.int32)
            dest_map[tokens, slots] = (pe * self.max_send + torch.arange(base, base + tokens.numel())).to(torch.int32)
        shmem_barrier_all()  # every PE's tokens and slot reservations are in
        control = bufs.control
        received = int(control[CONTROL["EP_RECV_OFFSET"]])
        control[CONTROL["EP_TOTAL_RECV"]] = received if received <= self.max_recv else 0
        control[CONTROL["EP_RECV_OFFSET"]] = 0
        # Every counter is cleared before any PE leaves: a PE that went on to its next dispatch
        # first would otherwise reserve slots that a slower receiver's clear then wipes.
        shmem_barrier_all()
        if overflow or received > self.max_recv:
            raise RuntimeError(f"dispatch: PE {overflow[0] if overflow else cfg.rank} would receive more than "
                               f"max_num_tokens_to_recv={self.max_recv} tokens (raise max_total_recv_tokens or "
                               "leave it 0); this dispatch delivered nothing there")

    def count_experts(self, out: Any) -> None:
        cfg = self.cfg
        total = int(self.bufs.control[CONTROL["EP_TOTAL_RECV"]])
        ids = self.bufs.disp_indices[: total * cfg.num_experts_per_token].to(int)
        mine = ids[(ids >= 0) & (ids // cfg.num_experts_per_rank == cfg.rank)] % cfg.num_experts_per_rank
        out.copy_(mine.bincount(minlength=cfg.num_experts_per_rank).to(out.dtype))

    def combine_stage(self, inp: Any, weights: Any, wire: Any) -> None:
        import torch

        total = int(self.bufs.control[CONTROL["EP_TOTAL_RECV"]])
        k = self.cfg.num_experts_per_token
        staged = view_rows(self.bufs.comb_inp, self.max_recv, inp.shape[1], wire)
        if staged.data_ptr() != inp.data_ptr():
            n = min(total, inp.shape[0])
            staged[:n] = inp[:n].to(wire)
            staged[n:total] = 0
        if weights is not None:
            w = view_rows(self.bufs.comb_inp_weights, self.max_recv, k, torch.float32)
            n = min(total, weights.shape[0])
            w[:n] = weights[:n]
            w[n:total] = 0
        shmem_barrier_all()  # every PE's expert outputs are staged

    def combine_accumulate(self, inp: Any, weights: Any, num_tokens: int, wire: Any) -> None:
        import torch

        cfg, k, hidden = self.cfg, self.cfg.num_experts_per_token, inp.shape[1]
        dest = self.bufs.dest_map[: num_tokens * k].view(num_tokens, k).tolist()
        out = view_rows(self.bufs.comb_out, cfg.max_num_inp_token_per_rank, hidden, inp.dtype)
        out_w = view_rows(self.bufs.comb_out_weights, cfg.max_num_inp_token_per_rank, k, torch.float32)
        staged = [view_rows(self._peer("comb_inp", pe), self.max_recv, hidden, wire) for pe in range(cfg.world_size)]
        staged_w = [view_rows(self._peer("comb_inp_weights", pe), self.max_recv, k, torch.float32)
                    for pe in range(cfg.world_size)]
        for t, row in enumerate(dest):
            places = [(d // self.max_send, d % self.max_send) for d in row if d >= 0]
            out[t] = accumulate_rows([staged[pe][s] for pe, s in places], out[t])
            if weights is not None:
                out_w[t] = accumulate_rows([staged_w[pe][s] for pe, s in places], out_w[t])
