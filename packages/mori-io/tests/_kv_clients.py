"""Paged KV caches laid out as vLLM's MoRIIO connector and SGLang's MORI backend lay them out, and
the target side of each (a process that registers its caches the way that client does, hands out
its descriptors as bytes, and never registers the engine that will transfer).

vLLM keeps one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]`` (K then V),
registered with ``register_torch_tensor``. SGLang keeps one buffer per layer for K and one for V
(``num_blocks * item_len`` bytes each) plus auxiliary buffers, registered with
``register_memory(ptr, length, device, loc)``. Every cache is filled with bytes derived from a
seed, so either side can say what any byte must be.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
from _peer import engine_commands, serve_commands

from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    TcpBackendConfig,
)

__all__ = ["Layout", "fill", "merge_contiguous", "group_contiguous", "serve_vllm_target", "serve_sglang_target", "TARGET_NETNS",
           "make_engine"]


@dataclass(frozen=True)
class Layout:
    """A paged KV cache: ``layers`` layers of ``num_blocks`` blocks of ``block_bytes`` bytes, for K and V."""

    layers: int = 4
    num_blocks: int = 48
    block_size: int = 16  # tokens per block
    kv_heads: int = 2
    head_dim: int = 32  # fp16

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_heads * self.head_dim * 2

    @property
    def layer_bytes(self) -> int:
        """One vLLM layer tensor (K and V), or one SGLang K (or V) buffer times two."""
        return 2 * self.num_blocks * self.block_bytes


def fill(seed: int, nbytes: int) -> np.ndarray:
    """The content a cache of ``nbytes`` made with ``seed`` starts with."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def merge_contiguous(local: list[int], remote: list[int], sizes: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Sorts blocks by local offset and joins runs contiguous on both sides (as vLLM does)."""
    order = sorted(range(len(local)), key=local.__getitem__)
    out_l: list[int] = []
    out_r: list[int] = []
    out_s: list[int] = []
    for i in order:
        if out_l and out_l[-1] + out_s[-1] == local[i] and out_r[-1] + out_s[-1] == remote[i]:
            out_s[-1] += sizes[i]
        else:
            out_l.append(local[i])
            out_r.append(remote[i])
            out_s.append(sizes[i])
    return out_l, out_r, out_s


def group_contiguous(src: list[int], dst: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Splits paired block indices into runs consecutive on both sides (SGLang's grouping)."""
    src_groups: list[list[int]] = []
    dst_groups: list[list[int]] = []
    for s, d in zip(src, dst):
        if src_groups and src_groups[-1][-1] + 1 == s and dst_groups[-1][-1] + 1 == d:
            src_groups[-1].append(s)
            dst_groups[-1].append(d)
        else:
            src_groups.append([s])
            dst_groups.append([d])
    return src_groups, dst_groups


# Where the two sides listen: loopback, unless test_rdma_netns.py puts the transferring side and
# the targets on their own addresses in two network namespaces.
TARGET_NETNS = os.environ.get("MORI_TEST_REPLAY_TARGET_NETNS") or None


def make_engine(key: str, backend: str, target: bool = False) -> IOEngine:
    """An engine built as both clients build theirs: ``IOEngineConfig`` and ``RdmaBackendConfig``
    positional, notifications off (both pass ``False``). ``backend`` "rdma" then creates the RDMA
    backend exactly as they do (UCX, over its tcp transport here: ``MORI_IO_RDMA_TRANSPORTS``);
    "tcp" creates the TCP backend instead, with the same notification choice and three
    connections, so that transfers can overtake each other."""
    host = os.environ.get("MORI_TEST_REPLAY_TARGET_HOST" if target else "MORI_TEST_REPLAY_HOST", "127.0.0.1")
    engine = IOEngine(key, IOEngineConfig(host, 0))
    rdma_cfg = RdmaBackendConfig(4, -1, 4, PollCqMode.POLLING, False)
    assert not rdma_cfg.enable_notification and rdma_cfg.poll_cq_mode.name == "POLLING"
    if backend == "rdma":
        engine.create_backend(BackendType.RDMA, rdma_cfg)
    else:
        engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=3,
                                                                enable_notification=rdma_cfg.enable_notification))
    assert engine.get_engine_desc().port > 0
    return engine


def serve_vllm_target(key: str, backend: str, layout: Layout, seed: int) -> bytes:
    """vLLM's side that is read from (prefill, READ mode) or written to (decode, WRITE mode)."""
    engine = make_engine(key, backend, target=True)
    caches = {}
    metadata: dict[str, list[bytes]] = {}
    for layer in range(layout.layers):
        name = f"model.layers.{layer}.self_attn.attn"
        raw = fill(seed + layer, layout.layer_bytes)
        tensor = torch.from_numpy(raw).view(torch.float16).reshape(
            2, layout.num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
        caches[name] = tensor
        metadata[name] = [engine.register_torch_tensor(tensor).pack()]

    def handshake() -> tuple[bytes, bytes]:
        # What vLLM's handshake listener sends: the agent metadata (the packed EngineDesc
        # inside), then msgpack of {layer name: [packed MemoryDesc]}.
        agent = msgpack.packb({"engine_id": key, "agent_metadata": engine.get_engine_desc().pack(),
                               "num_blocks": layout.num_blocks, "block_len": layout.block_bytes})
        return agent, msgpack.packb(metadata)

    def cache_bytes() -> bytes:
        return b"".join(t.view(torch.uint8).numpy().tobytes() for t in caches.values())

    return serve_commands(engine, {**engine_commands(engine, {}), "handshake": handshake, "cache": cache_bytes})


def serve_sglang_target(key: str, backend: str, layout: Layout, seed: int, aux_lens: list[int]) -> bytes:
    """SGLang's decode side: K and V buffers per layer and aux buffers, written by prefill."""
    engine = make_engine(key, backend, target=True)
    half = layout.layer_bytes // 2
    kv = [fill(seed + i, half) for i in range(2 * layout.layers)]  # K of every layer, then V
    aux = [fill(seed + 1000 + i, n * 8) for i, n in enumerate(aux_lens)]  # 8 slots each
    kv_descs = [engine.register_memory(int(a.ctypes.data), a.size, -1, MemoryLocationType.CPU) for a in kv]
    aux_descs = [engine.register_memory(int(a.ctypes.data), a.size, -1, MemoryLocationType.CPU) for a in aux]

    def handshake() -> list[bytes]:
        # SGLang's registration message: the packed EngineDesc, then msgpack lists of packed
        # MemoryDescs (KV, aux).
        return [engine.get_engine_desc().pack(), msgpack.packb([d.pack() for d in kv_descs]),
                msgpack.packb([d.pack() for d in aux_descs])]

    def buffers() -> list[bytes]:
        return [a.tobytes() for a in kv + aux]

    descs: dict[int, MemoryDesc] = {}
    return serve_commands(engine, {**engine_commands(engine, descs), "handshake": handshake, "buffers": buffers})
