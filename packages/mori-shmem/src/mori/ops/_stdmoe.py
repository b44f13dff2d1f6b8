"""MORI's standard-MoE layout (DeepEP's low-latency layout): received tokens grouped by local expert.

``convert_dispatch_output`` copies each received token once for every top-k entry naming one of
this rank's experts into ``packed_recv_x[local_expert, i]`` and records its source position in
``packed_recv_src_info`` (``src_rank * max_num_tokens_to_send + src_token``);
``convert_combine_input`` sums, per received token, the expert outputs of those copies times the
token's dispatched top-k weight (1 where dispatch carried none) in float32 in top-k order, rounds
once, and writes the row into the op's registered combine input, which combine then reads in place.
A token's place within its expert is given in received-row order here (MORI's is set by atomics).

PyTorch operations on the op's buffers, the same on the CPU and GPU heaps: the received count stays
on the device, nothing synchronizes with the host, so the calls can be captured in a CUDA graph.
``launch_local_expert_count`` is MORI's free function on raw pointers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StandardMoeLayout", "launch_local_expert_count"]


class StandardMoeLayout:
    """The per-op state of the layout: the packed counts and, per received (token, top-k entry),
    its packed row (``local_expert * max_tokens_per_expert + i``, -1 where the entry names no
    local expert)."""

    def __init__(self, num_local_experts: int, max_tokens_per_expert: int, max_recv: int, k: int, device: Any) -> None:
        import torch

        self.experts, self.per_expert, self.k = num_local_experts, max_tokens_per_expert, k
        self.count = torch.zeros(num_local_experts, dtype=torch.int32, device=device)
        self.slot_map = torch.full((max_recv * k,), -1, dtype=torch.int64, device=device)

    def pack(self, x: Any, topk_idx: Any, total: Any, src_pos: Any, rank: int) -> tuple[Any, Any, Any, Any]:
        """``x`` ``[R, H]`` and ``topk_idx`` ``[R, k]`` (dispatch outputs; the first ``total`` rows
        hold tokens) -> ``(packed_recv_x [E, M, H], packed_recv_count [E] int32,
        packed_recv_src_info [E, M] int32, packed_recv_layout_range [0] int64)``."""
        import torch

        rows, k, experts, per = x.shape[0], self.k, self.experts, self.per_expert
        device = x.device
        live = torch.arange(rows, device=device) < total.to(device)  # [R]; total stays on the device
        local = topk_idx[:rows].to(torch.int64) - rank * experts
        take = live[:, None] & (local >= 0) & (local < experts)  # [R, k]
        local = torch.where(take, local, torch.zeros_like(local)).flatten()
        take = take.flatten()
        # Place of each entry among its expert's entries, in received-row then top-k order.
        # (one_hot would check its input on the host: a synchronization on the GPU)
        one_hot = ((local[:, None] == torch.arange(experts, device=device)) & take[:, None]).long()
        place = (one_hot.cumsum(0) - 1).gather(1, local[:, None]).squeeze(1)
        counts = one_hot.sum(0)
        trash = experts * per  # one spare row takes the writes of entries that go nowhere
        flat = torch.where(take, local * per + place, torch.full_like(local, trash))
        packed_x = torch.empty((trash + 1, x.shape[1]), dtype=x.dtype, device=device)
        packed_src = torch.empty((trash + 1,), dtype=torch.int32, device=device)
        token = torch.arange(rows * k, device=device) // k
        packed_x.index_put_((flat,), x[token])
        packed_src.index_put_((flat,), src_pos[:rows].to(torch.int32)[token])
        self.count.copy_(counts.to(torch.int32))
        self.slot_map[: rows * k].copy_(torch.where(take, flat, torch.full_like(flat, -1)))
        return (
            packed_x[:trash].view(experts, per, x.shape[1]),
            self.count,
            packed_src[:trash].view(experts, per),
            torch.empty(0, dtype=torch.int64, device=device),
        )

    def unpack(self, packed_x: Any, weights: Any, total: Any, out: Any) -> Any:
        """Expert outputs ``packed_x`` ``[E, M, H]`` -> ``out`` ``[R, H]`` (the registered combine
        input): row ``s`` is the sum over its entries of ``packed_x[slot] * weight``, float32, in
        top-k order, rounded once; rows past ``total`` are zeros. Resets the packed counts."""
        import torch

        rows, k = out.shape[0], self.k
        flat_x = packed_x.reshape(-1, packed_x.shape[-1])
        slots = self.slot_map[: rows * k].view(rows, k)
        live = torch.arange(rows, device=out.device) < total.to(out.device)
        acc = torch.zeros((rows, packed_x.shape[-1]), dtype=torch.float32, device=out.device)
        for j in range(k):
            take = (slots[:, j] >= 0) & live
            row = flat_x[slots[:, j].clamp(min=0)].to(torch.float32)
            w = weights[:rows, j] if weights is not None else torch.ones(rows, device=out.device)
            acc = acc + torch.where(take[:, None], row * w[:, None], torch.zeros_like(row))
        out.copy_(acc.to(out.dtype))
        self.count.zero_()
        return out


def launch_local_expert_count(
    config: Any,
    indices_ptr: int,
    total_recv_token_num_ptr: int,
    local_expert_count_ptr: int,
    block_num: int = -1,
    warp_per_block: int = -1,
    stream: int = 0,
) -> None:
    """MORI's free function: counts, over the ``*total`` received rows of the int32 top-k ids at
    ``indices_ptr`` (``[rows, num_experts_per_token]``), the entries naming each of rank
    ``config.rank``'s experts into the int32 array at ``local_expert_count_ptr`` (zeroed first).
    Pointers are addresses of this PE's heap kind (device memory on the GPU heap, host memory on
    the CPU heap); ``stream`` (a CUDA stream handle, 0: the current one) orders it on the GPU.
    ``block_num``/``warp_per_block`` are checked as MORI does (the count is one PyTorch pass, after
    reading the received count on the host)."""
    import contextlib
    import ctypes

    import torch

    from mori.shmem import shmem_heap_info
    from mori.shmem.tensor_utils import MoriShmemBuffer

    wpb = config.warp_num_per_block if warp_per_block <= 0 else warp_per_block
    bn = config.block_num if block_num <= 0 else block_num
    if wpb <= 0 or bn <= 0:
        raise RuntimeError("LaunchLocalExpertCount requires positive block and warp settings")
    for name, ptr in (
        ("indices_ptr", indices_ptr),
        ("total_recv_token_num_ptr", total_recv_token_num_ptr),
        ("local_expert_count_ptr", local_expert_count_ptr),
    ):
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"launch_local_expert_count: {name} must be a non-null address, got {ptr!r}")
    gpu = shmem_heap_info()["kind"] == "gpu"
    ctx = torch.cuda.stream(torch.cuda.ExternalStream(stream)) if gpu and stream else contextlib.nullcontext()
    experts, k = config.num_experts_per_rank, config.num_experts_per_token

    def at(ptr: int, n: int) -> Any:
        """``n`` int32 at address ``ptr`` (device memory on the GPU heap, host memory on the CPU heap)."""
        if gpu:
            return torch.as_tensor(MoriShmemBuffer(ptr, 4 * n, torch.int32), device="cuda").view(torch.int32)
        return torch.frombuffer((ctypes.c_int32 * n).from_address(ptr), dtype=torch.int32)

    with ctx:
        # The count of rows is read on the host (a device synchronization on the GPU heap): rows
        # past it may lie beyond the caller's allocation.
        rows = int(at(total_recv_token_num_ptr, 1).item())
        if rows < 0:
            raise ValueError(f"launch_local_expert_count: *total_recv_token_num_ptr is {rows}")
        ids = (
            at(indices_ptr, rows * k).view(rows, k).to(torch.int64)
            if rows
            else torch.zeros((0, k), dtype=torch.int64, device="cuda" if gpu else "cpu")
        )
        local = ids - config.rank * experts
        take = (local >= 0) & (local < experts)
        counts = torch.zeros(experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, torch.where(take, local, torch.zeros_like(local)).flatten(), take.flatten().long())
        at(local_expert_count_ptr, experts).copy_(counts.to(torch.int32))
