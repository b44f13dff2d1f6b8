"""The inter-node kernel types on the GPU heap: which PEs form this PE's node, and the extra buffers.

MORI's InterNodeV1 design (kernels/ep_internode.cu): ranks ``[n * g, (n + 1) * g)`` form node
``n`` (``g = gpu_per_node``); a token goes to ranks of its own node by P2P stores, as IntraNode
does, and once to each other node it names, to that node's *proxy* (the rank with the sender's
local index there): tokens for one node are staged in one contiguous block and that block moves
with mori.shmem's device puts, a share a block of the kernel, then a put-with-signal (the remote
transport when the node is on another host). The proxy forwards each token to the ranks of its
node by P2P. Combine runs it backwards: the proxy gathers the expert outputs of its node's ranks for the tokens it forwarded,
row by row, and puts them back to the sender in one block per node; the sender sums every row in
top-k order, so the result is IntraNode's byte for byte. ``InterNodeV1LL`` stages every token once
at its own index and puts that block to every other node (no counting; the proxy picks what names
its node), as MORI's low-latency variant does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._config import EpDispatchCombineConfig, combine_row_bytes

__all__ = ["InterNodeBuffers", "NodePlan", "PayloadLayout", "node_plan", "payload_layout", "return_map_size"]


def _align(n: int, to: int = 16) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class NodePlan:
    """This PE's node: ``nodes`` nodes of ``size`` PEs; this PE is in node ``node``, whose first PE is ``first``."""

    size: int
    node: int
    nodes: int

    @property
    def first(self) -> int:
        return self.node * self.size


def node_plan(config: EpDispatchCombineConfig, reachable: list[int] | set[int]) -> NodePlan:
    """The node layout of ``config`` (``gpu_per_node`` PEs a node, capped at the world size); raises
    ValueError naming the field when the world does not split into whole nodes, or the PEs that
    share this PE's node but are not P2P-mapped here (the proxy reaches its node by loads and stores)."""
    g = config.gpu_per_node
    if g < 1:
        raise ValueError(f"EpDispatchCombineConfig.gpu_per_node={g}: the inter-node kernel types need >= 1")
    g = min(g, config.world_size)
    if config.world_size % g:
        raise ValueError(
            f"EpDispatchCombineConfig.gpu_per_node={config.gpu_per_node}: world_size="
            f"{config.world_size} is not a whole number of nodes"
        )
    plan = NodePlan(size=g, node=config.rank // g, nodes=config.world_size // g)
    unmapped = sorted(set(range(plan.first, plan.first + g)) - set(reachable))
    if unmapped:
        raise ValueError(
            f"PEs {unmapped} share PE {config.rank}'s node (gpu_per_node={config.gpu_per_node}) but "
            "their heaps are not mapped here (another host, or MORI_DISABLE_P2P): set gpu_per_node to "
            "the PEs that reach each other by P2P (1 under MORI_DISABLE_P2P)"
        )
    return plan


@dataclass(frozen=True)
class PayloadLayout:
    """Byte offsets of a staged token (``xfer`` bytes: a 32-byte header of int32 ``src_pos,
    row_base, row_bytes, scale_bytes, has_weights``, then the row, scales, top-k ids, weights) and of
    a combine row sent back (``comb_xfer`` bytes: the row, then its ``k`` float32 weights; 32-byte
    aligned, as the combine kernels' widest vector load of a row needs)."""

    row_max: int
    scale_off: int
    idx_off: int
    w_off: int
    xfer: int
    comb_w_off: int
    comb_xfer: int


def payload_layout(config: EpDispatchCombineConfig, combine_scale_dim: int) -> PayloadLayout:
    row_max = config.hidden_dim * config.max_token_type_size
    scale_off = _align(32 + row_max)
    idx_off = _align(scale_off + config.scale_dim * config.scale_type_size)
    w_off = idx_off + 4 * config.num_experts_per_token
    comb_w_off = _align(combine_row_bytes(config, combine_scale_dim))
    return PayloadLayout(
        row_max=row_max,
        scale_off=scale_off,
        idx_off=idx_off,
        w_off=w_off,
        xfer=_align(w_off + 4 * config.num_experts_per_token),
        comb_w_off=comb_w_off,
        comb_xfer=_align(comb_w_off + 4 * config.num_experts_per_token, 32),
    )


@dataclass
class InterNodeBuffers:
    """The symmetric buffers of the inter-node path: ``stage`` (tokens for each node; one block
    for the low-latency variant), ``inbox`` (tokens from each node), ``ret_stage`` / ``ret_inbox``
    (combine rows for / from each node, ``size`` rows a token) and ``ret_map`` (per source node and
    combine row, where this PE as that node's proxy forwarded the token: ``pe * max_recv + slot``,
    -1 for none; a routing handle keeps a copy)."""

    stage: Any
    inbox: Any
    ret_stage: Any
    ret_inbox: Any
    ret_map: Any

    @classmethod
    def allocate(
        cls, config: EpDispatchCombineConfig, plan: NodePlan, low_latency: bool, combine_scale_dim: int
    ) -> InterNodeBuffers:
        """Allocates them (collective, same order on every PE): zeroed, ``ret_map`` all -1."""
        import torch

        from mori.shmem import shmem_tensor

        lay, tokens = payload_layout(config, combine_scale_dim), config.max_num_inp_token_per_rank
        per_node_rows = tokens * plan.size
        sizes = {
            "stage": (1 if low_latency else plan.nodes) * tokens * lay.xfer,
            "inbox": plan.nodes * tokens * lay.xfer,
            "ret_stage": plan.nodes * per_node_rows * lay.comb_xfer,
            "ret_inbox": plan.nodes * per_node_rows * lay.comb_xfer,
        }
        tensors = {name: shmem_tensor((n,), torch.uint8) for name, n in sizes.items()}
        for t in tensors.values():
            t.zero_()
        tensors["ret_map"] = shmem_tensor((return_map_size(config, plan),), torch.int32).fill_(-1)
        return cls(**tensors)


def return_map_size(config: EpDispatchCombineConfig, plan: NodePlan) -> int:
    """Entries of ``InterNodeBuffers.ret_map`` (and of a routing handle's copy): a row per token and
    PE of the node, for every source node."""
    return plan.nodes * config.max_num_inp_token_per_rank * plan.size
