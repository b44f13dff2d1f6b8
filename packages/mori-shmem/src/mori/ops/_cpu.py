"""The CPU backend: the same buffers and routing rule on a host-memory heap (no GPU).

Each PE writes the tokens it sends into its peers' buffers after reserving slots with an atomic
on the receiver's counter, exactly as the GPU kernels do; host barriers stand in for the device
signals. A peer whose heap is mapped here is written and read through views of its segment; any
other (another node, or ``MORI_DISABLE_P2P``: the inter-node kernel types) through mori.shmem's
host RMA, the same rows as contiguous puts and gets, so both give the same bytes. It makes the
whole op run, and be tested, with real processes on CPU-only machines.
"""

from __future__ import annotations

from typing import Any

from mori.shmem import (
    shmem_atomic_fetch_add,
    shmem_barrier_all,
    shmem_getmem_into,
    shmem_mype,
    shmem_peer_tensor,
    shmem_ptr_p2p,
    shmem_putmem,
)

from ._buffers import CONTROL, EpBuffers, view_rows
from ._config import EpDispatchCombineConfig
from ._layout import accumulate_rows, plan_routing
from ._quant import CombineWire

__all__ = ["CpuBackend"]


class CpuBackend:
    """Dispatch and combine with host loads and stores on the CPU heap."""

    def __init__(self, cfg: EpDispatchCombineConfig, bufs: EpBuffers, max_send: int, max_recv: int) -> None:
        self.cfg, self.bufs, self.max_send, self.max_recv = cfg, bufs, max_send, max_recv

    def _mapped(self, pe: int) -> bool:
        t = self.bufs.disp_tok
        return pe == self.cfg.rank or shmem_ptr_p2p(int(t.data_ptr()), shmem_mype(), pe) != 0

    def _peer(self, name: str, pe: int) -> Any:
        t = getattr(self.bufs, name)
        return t if pe == self.cfg.rank else shmem_peer_tensor(t, pe)

    def _write_rows(self, name: str, pe: int, start: int, rows: Any, cols: int, dtype: Any) -> None:
        """Rows ``[start, start + len(rows))`` of buffer ``name`` (seen as ``[max_recv, cols]`` of
        ``dtype``) on PE ``pe`` become ``rows``."""
        if self._mapped(pe):
            view_rows(self._peer(name, pe), self.max_recv, cols, dtype)[start : start + rows.shape[0]] = rows
            return
        local = view_rows(getattr(self.bufs, name), self.max_recv, cols, dtype)  # the symmetric address
        shmem_putmem(int(local[start].data_ptr()), rows.to(dtype).contiguous(), pe)

    def _read_rows(self, name: str, pe: int, count: int, cols: int, dtype: Any) -> Any:
        """The first ``count`` rows of buffer ``name`` on PE ``pe`` (a view where it is mapped)."""
        import torch

        if self._mapped(pe):
            return view_rows(self._peer(name, pe), self.max_recv, cols, dtype)
        out = torch.empty((count, cols), dtype=dtype)
        if count:
            shmem_getmem_into(out, getattr(self.bufs, name).data_ptr(), pe)
        return out

    def dispatch(
        self, inp: Any, weights: Any, scales: Any, indices: Any, replay: Any = None, routed: bool = False
    ) -> None:
        """Sends this PE's tokens. ``replay`` (a routing handle's ``(dest_map [n * k], total [1])``,
        whose routing the op checked against ``indices``): to the slots it names, reserving none;
        the receivers take their totals from their handles.
        ``routed`` (a dispatch that keeps a routing handle, which may follow another dispatch with no
        combine between): every PE is done with its last dispatch's outputs before any writes."""
        import torch

        if routed:
            shmem_barrier_all()

        cfg, bufs, k = self.cfg, self.bufs, self.cfg.num_experts_per_token
        dest = plan_routing(indices, cfg.num_experts_per_rank, cfg.world_size)
        dest_map = bufs.dest_map[: dest.numel()].view(dest.shape)
        if replay is not None:
            dest_map.copy_(replay[0][: dest.numel()].view(dest.shape))
        else:
            dest_map.fill_(-1)
        row_bytes = inp.shape[1] * inp.element_size()
        overflow = []
        for pe in range(cfg.world_size):
            tokens, slots = (dest == pe).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            if replay is not None:
                base = _replayed_base(dest_map[tokens, slots], pe, self.max_send)
            else:
                base = shmem_atomic_fetch_add(bufs.control_address("EP_RECV_OFFSET"), tokens.numel(), pe, width=32)
            if base + tokens.numel() > self.max_recv:
                overflow.append(pe)  # nothing written there; every PE still joins the barriers below
                continue
            self._write_rows(
                "disp_tok",
                pe,
                base,
                inp.view(torch.uint8).view(inp.shape[0], row_bytes)[tokens],
                row_bytes,
                torch.uint8,
            )
            self._write_rows("disp_indices", pe, base, indices[tokens], k, torch.int32)
            if weights is not None:
                self._write_rows("disp_weights", pe, base, weights[tokens], k, torch.float32)
            if scales is not None:
                sb = scales.shape[1] * scales.element_size()
                self._write_rows(
                    "disp_scales", pe, base, scales.view(torch.uint8).view(scales.shape[0], sb)[tokens], sb, torch.uint8
                )
            self._write_rows(
                "disp_src_pos", pe, base, (cfg.rank * self.max_send + tokens).to(torch.int32)[:, None], 1, torch.int32
            )
            dest_map[tokens, slots] = (pe * self.max_send + torch.arange(base, base + tokens.numel())).to(torch.int32)
        shmem_barrier_all()  # every PE's tokens and slot reservations are in
        control = bufs.control
        received = int(control[CONTROL["EP_RECV_OFFSET"]]) if replay is None else int(replay[1][0])
        control[CONTROL["EP_TOTAL_RECV"]] = received if received <= self.max_recv else 0
        control[CONTROL["EP_RECV_OFFSET"]] = 0
        # Every counter is cleared before any PE leaves: a PE that went on to its next dispatch
        # first would otherwise reserve slots that a slower receiver's clear then wipes.
        shmem_barrier_all()
        if overflow or received > self.max_recv:
            raise RuntimeError(
                f"dispatch: PE {overflow[0] if overflow else cfg.rank} would receive more than "
                f"max_num_tokens_to_recv={self.max_recv} tokens (raise max_total_recv_tokens or "
                "leave it 0); this dispatch delivered nothing there"
            )

    def count_experts(self, out: Any) -> None:
        cfg = self.cfg
        total = int(self.bufs.control[CONTROL["EP_TOTAL_RECV"]])
        ids = self.bufs.disp_indices[: total * cfg.num_experts_per_token].to(int)
        mine = ids[(ids >= 0) & (ids // cfg.num_experts_per_rank == cfg.rank)] % cfg.num_experts_per_rank
        out.copy_(mine.bincount(minlength=cfg.num_experts_per_rank).to(out.dtype))

    def combine_stage(self, inp: Any, weights: Any, wire: CombineWire, total: int, routed: bool = False) -> None:
        """Stages this PE's ``total`` expert output rows (encoded for the wire) and their weights;
        rows past the input's count as zeros. ``routed`` (a combine along a routing handle, which may
        follow another combine with no dispatch between): every PE is done reading first."""
        import torch

        if routed:
            shmem_barrier_all()

        k = self.cfg.num_experts_per_token
        staged = view_rows(self.bufs.comb_inp, self.max_recv, wire.row_bytes, torch.uint8)
        if staged.data_ptr() != inp.data_ptr():
            n = min(total, inp.shape[0])
            staged[:n] = wire.encode(inp[:n])
            if total > n:
                zeros = torch.zeros((total - n, inp.shape[1] * inp.element_size()), dtype=torch.uint8)
                staged[n:total] = wire.encode(zeros.view(inp.dtype))
        if weights is not None:
            w = view_rows(self.bufs.comb_inp_weights, self.max_recv, k, torch.float32)
            n = min(total, weights.shape[0])
            w[:n] = weights[:n]
            w[n:total] = 0
        shmem_barrier_all()  # every PE's expert outputs are staged

    def combine_accumulate(self, with_weights: bool, dest_map: Any, num_tokens: int, wire: CombineWire) -> None:
        """Sums, for each of this PE's ``num_tokens`` tokens, the rows its destinations staged (where
        ``dest_map`` ``[num_tokens * k]`` says), decoded from the wire, in float32 in top-k order."""
        import torch

        cfg, k = self.cfg, self.cfg.num_experts_per_token
        dest = dest_map[: num_tokens * k].view(num_tokens, k).tolist()
        out = view_rows(
            self.bufs.comb_out, cfg.max_num_inp_token_per_rank, wire.hidden * wire.dtype.itemsize, torch.uint8
        )
        out_w = view_rows(self.bufs.comb_out_weights, cfg.max_num_inp_token_per_rank, k, torch.float32)
        # Rows needed from each PE: up to the highest slot this PE's tokens were given there.
        need = [0] * cfg.world_size
        for row in dest:
            for d in row:
                if d >= 0:
                    need[d // self.max_send] = max(need[d // self.max_send], d % self.max_send + 1)
        staged = [
            wire.terms(self._read_rows("comb_inp", pe, need[pe], wire.row_bytes, torch.uint8)[: need[pe]])
            for pe in range(cfg.world_size)
        ]
        staged_w = [
            self._read_rows("comb_inp_weights", pe, need[pe], k, torch.float32) if with_weights else None
            for pe in range(cfg.world_size)
        ]
        for t, row in enumerate(dest):
            places = [(d // self.max_send, d % self.max_send) for d in row if d >= 0]
            acc = torch.zeros(staged[0].shape[1] if staged else 0, dtype=torch.float32)
            for pe, s in places:
                acc = acc + staged[pe][s]
            out[t] = wire.finish(acc)
            if with_weights:
                out_w[t] = accumulate_rows([staged_w[pe][s] for pe, s in places], out_w[t])  # type: ignore[index]


def _replayed_base(slots: Any, pe: int, max_send: int) -> int:
    """The first receive slot of a replayed routing's tokens for ``pe``, which a dispatch reserved as
    one contiguous range; raises ValueError for a handle that names anything else."""
    import torch

    got = slots.to(torch.int64)
    base = int(got[0]) - pe * max_send
    if not torch.equal(got, pe * max_send + base + torch.arange(got.numel())):
        raise ValueError(
            f"routing handle: the slots it gives PE {pe} are not one dispatch's reservation "
            "(a handle from another op, or modified?)"
        )
    return base
