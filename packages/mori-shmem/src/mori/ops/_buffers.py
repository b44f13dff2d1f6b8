"""The op's buffers on the symmetric heap, allocated in the same order on every PE.

Token buffers are flat bytes sized for ``hidden_dim * max_token_type_size`` per row; each call
views them with its own dtype and row width, as MORI's ``from_gpu_ptr`` views do. ``control``
holds the counters and flags the kernels and the CPU backend share; its layout (``CONTROL``) is
the one definition the CUDA source gets as ``EP_*`` constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._config import MAX_WORLD_SIZE, EpDispatchCombineConfig, capacities, combine_row_bytes

__all__ = ["CONTROL", "CONTROL_WORDS", "EpBuffers", "view_rows"]

#: int32 word offsets in the control block (each per-PE array has MAX_WORLD_SIZE words).
CONTROL = {
    "EP_RECV_OFFSET": 0,  # next free receive slot here (peers add to it)
    "EP_TOTAL_RECV": 1,  # tokens received by the last dispatch
    "EP_EPOCH": 2,  # combine rounds done (barrier epoch)
    "EP_PHASE": 3,  # GPU: 1 from a dispatch until its combine, else 0 (the kernels refuse a second dispatch)
    "EP_SEND_DONE": 6,  # GPU, one node: blocks of the dispatch data kernel done (its last clears it)
    "EP_STAGE_DONE": 7,  # GPU: blocks of the combine stage kernel done (its last clears it)
    "EP_RECV_SIGNAL": 64,  # [src PE] tokens src sent here + 1; 0 once consumed
    "EP_SENT_COUNT": 128,  # [dest PE] tokens this PE sent there this round
    "EP_BARRIER": 192,  # [src PE] last combine epoch whose input src had staged
    # Inter-node kernel types (GPU; see _internode.py):
    "EP_ROUND": 4,  # dispatches done (tags the tokens' signals between nodes)
    "EP_COMBINES": 5,  # combines done (tags the combine rows' signals between nodes)
    "EP_NODE_TOKENS": 256,  # [dest node] tokens staged for that node this round
    "EP_NODE_ROWS": 320,  # [dest node] combine rows that node will send back
    "EP_INBOX_COUNT": 384,  # [src node] tokens in the inbox from that node this round
    "EP_RETURN_ROWS": 448,  # [src node] combine rows to send back to that node
    "EP_INBOX_SIGNAL": 512,  # [src node] uint64: round << 32 | tokens put into the inbox
    "EP_RETURN_SIGNAL": 640,  # [src node] uint64: round << 32 | combine rows put back
}
CONTROL_WORDS = 768
#: Control arrays of uint64 words (two int32 words per entry, 8-byte aligned).
CONTROL_WIDE = ("EP_INBOX_SIGNAL", "EP_RETURN_SIGNAL")
assert all(CONTROL[k] % 2 == 0 for k in CONTROL_WIDE)
assert max(v + (2 if k in CONTROL_WIDE else 1) * MAX_WORLD_SIZE for k, v in CONTROL.items() if v >= 64) <= CONTROL_WORDS


def view_rows(flat: Any, rows: int, cols: int, dtype: Any) -> Any:
    """``flat`` (uint8 or any dtype, contiguous) seen as a ``[rows, cols]`` tensor of ``dtype``."""
    import torch

    raw = flat.view(torch.uint8)
    nbytes = rows * cols * torch.empty((), dtype=dtype).element_size()
    if nbytes > raw.numel():
        raise ValueError(f"a [{rows}, {cols}] {dtype} view needs {nbytes} bytes; the buffer has {raw.numel()}")
    return raw[:nbytes].view(dtype).view(rows, cols)


@dataclass
class EpBuffers:
    """Every tensor the op owns (``shmem_tensor``: symmetric, same offsets on every PE)."""

    disp_tok: Any
    disp_weights: Any
    disp_scales: Any
    disp_indices: Any
    disp_src_pos: Any
    comb_inp: Any
    comb_inp_weights: Any
    comb_out: Any
    comb_out_weights: Any
    dest_map: Any
    control: Any

    @classmethod
    def allocate(cls, config: EpDispatchCombineConfig, combine_scale_dim: int) -> EpBuffers:
        """Allocates (collective) and zeroes them; the caller must sync and barrier before use.
        ``combine_scale_dim`` sizes the staged combine rows of the blockwise quantizations."""
        import torch

        from mori.shmem import shmem_tensor

        cap = capacities(config)
        recv, inp = cap["max_num_tokens_to_recv"], config.max_num_inp_token_per_rank
        row, k = config.hidden_dim * config.max_token_type_size, config.num_experts_per_token
        scale = max(config.scale_dim * config.scale_type_size, 1)
        shapes = {
            "disp_tok": (recv * row, torch.uint8),
            "disp_weights": (recv * k, torch.float32),
            "disp_scales": (recv * scale, torch.uint8),
            "disp_indices": (recv * k, torch.int32),
            "disp_src_pos": (recv, torch.int32),
            "comb_inp": (recv * combine_row_bytes(config, combine_scale_dim), torch.uint8),
            "comb_inp_weights": (recv * k, torch.float32),
            "comb_out": (inp * row, torch.uint8),
            "comb_out_weights": (inp * k, torch.float32),
            "dest_map": (inp * k, torch.int32),
            "control": (CONTROL_WORDS, torch.int32),
        }
        tensors = {}
        for name, (n, dtype) in shapes.items():
            tensors[name] = shmem_tensor((n,), dtype)
            tensors[name].zero_()
        return cls(**tensors)

    def free(self) -> None:
        """Gives every buffer back to the heap (collective, like allocate)."""
        from mori.shmem import shmem_free

        for t in vars(self).values():
            shmem_free(int(t.data_ptr()))

    def control_address(self, name: str) -> int:
        """Symmetric address of the control word ``name`` (for host atomics on the CPU heap)."""
        return int(self.control.data_ptr()) + 4 * CONTROL[name]
