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

import mmap
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

__all__ = [
    "Layout",
    "fill",
    "merge_contiguous",
    "group_contiguous",
    "serve_vllm_target",
    "serve_sglang_target",
    "TARGET_NETNS",
    "make_engine",
    "replay_host",
    "HybridCache",
    "serve_vllm_hybrid_target",
]


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


def replay_host(target: bool = False) -> str:
    """The address a replay engine listens on: loopback, or the one test_rdma_netns.py gives it."""
    return os.environ.get("MORI_TEST_REPLAY_TARGET_HOST" if target else "MORI_TEST_REPLAY_HOST", "127.0.0.1")


def make_engine(key: str, backend: str, target: bool = False) -> IOEngine:
    """An engine built as both clients build theirs: ``IOEngineConfig`` and ``RdmaBackendConfig``
    positional, notifications off (both pass ``False``). ``backend`` "rdma" then creates the RDMA
    backend exactly as they do (UCX, over its tcp transport here: ``MORI_IO_RDMA_TRANSPORTS``);
    "tcp" creates the TCP backend instead, with the same notification choice and three
    connections, so that transfers can overtake each other."""
    engine = IOEngine(key, IOEngineConfig(replay_host(target), 0))
    rdma_cfg = RdmaBackendConfig(4, -1, 4, PollCqMode.POLLING, False)
    assert not rdma_cfg.enable_notification and rdma_cfg.poll_cq_mode.name == "POLLING"
    if backend == "rdma":
        engine.create_backend(BackendType.RDMA, rdma_cfg)
    else:
        engine.create_backend(
            BackendType.TCP, TcpBackendConfig(num_connections=3, enable_notification=rdma_cfg.enable_notification)
        )
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
        tensor = (
            torch.from_numpy(raw)
            .view(torch.float16)
            .reshape(2, layout.num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
        )
        caches[name] = tensor
        metadata[name] = [engine.register_torch_tensor(tensor).pack()]

    def handshake() -> tuple[bytes, bytes]:
        # What vLLM's handshake listener sends: the agent metadata (the packed EngineDesc
        # inside), then msgpack of {layer name: [packed MemoryDesc]}.
        agent = msgpack.packb(
            {
                "engine_id": key,
                "agent_metadata": engine.get_engine_desc().pack(),
                "num_blocks": layout.num_blocks,
                "block_len": layout.block_bytes,
            }
        )
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
        return [
            engine.get_engine_desc().pack(),
            msgpack.packb([d.pack() for d in kv_descs]),
            msgpack.packb([d.pack() for d in aux_descs]),
        ]

    def buffers() -> list[bytes]:
        return [a.tobytes() for a in kv + aux]

    descs: dict[int, MemoryDesc] = {}
    return serve_commands(engine, {**engine_commands(engine, descs), "handshake": handshake, "buffers": buffers})


class HybridCache:
    """The KV cache of a hybrid model as vLLM 0.33's MoRIIO connector registers it
    (``moriio_connector.py``, ``register_kv_caches``, ``_build_shared_kv_mr``,
    ``_contiguous_byte_alias``): every layer lives in one page-aligned backing buffer, from byte
    ``pad`` on; attention layers are ``[2, num_blocks, block_size, kv_heads, head_dim]`` fp16 (K and
    V: two regions per layer) and KDA layers a packed page per slot, ``conv`` then ``ssm``.

    Registration, as there: one ``register_torch_tensor`` of a uint8 ``as_strided`` view from the
    backing's start, rounded up to a page, shared by all attention layers (``mr_offset`` per layer:
    its address minus the registration's); per KDA layer, conv and ssm each registered through a
    uint8 alias made with ``torch.empty(0, dtype=torch.uint8).set_(storage, offset, (extent,),
    (1,))`` (overlapping the shared registration). ``metadata`` is vLLM's handshake map {layer:
    [packed MemoryDesc, ...]} and ``base_addrs`` its ``kv_caches_base_addr`` (two per layer).
    ``kda_layers=0`` is an attention-only model (vLLM refuses KDA between different TP sizes).
    """

    attn_layers, slots = 3, 6
    conv_elems, ssm_elems = 96, 160  # fp16 elements of a slot's conv and ssm state

    def __init__(self, engine: IOEngine, layout: Layout, seed: int, pad: int, kda_layers: int = 2) -> None:
        self.layout, self.pad, self.kda_layers = layout, pad, kda_layers
        self.page_bytes = 2 * (self.conv_elems + self.ssm_elems)
        total = pad + self.attn_layers * layout.layer_bytes + self.kda_layers * self.slots * self.page_bytes
        # Page-aligned like a CUDA allocation, so vLLM's page rounding adds no slack at the front.
        self._map = mmap.mmap(-1, total + mmap.PAGESIZE)
        self.raw = np.frombuffer(self._map, dtype=np.uint8)
        self.raw[:] = fill(seed, self.raw.size)
        storage = torch.from_numpy(self.raw)
        self.attn = [
            storage[pad + i * layout.layer_bytes : pad + (i + 1) * layout.layer_bytes]
            .view(torch.float16)
            .reshape(2, layout.num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
            for i in range(self.attn_layers)
        ]
        kda_at = pad + self.attn_layers * layout.layer_bytes
        pages = [
            storage[kda_at + i * self.slots * self.page_bytes : kda_at + (i + 1) * self.slots * self.page_bytes]
            .view(torch.float16)
            .reshape(self.slots, self.conv_elems + self.ssm_elems)
            for i in range(self.kda_layers)
        ]
        self.kda = [(page[:, : self.conv_elems], page[:, self.conv_elems :]) for page in pages]  # slot-strided views
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(self.attn_layers)] + [
            f"model.layers.{self.attn_layers + i}.linear_attn" for i in range(self.kda_layers)
        ]
        self.metadata: dict[str, list[bytes]] = {}
        self.base_addrs: list[int] = []
        self.mr_offset: dict[str, int] = {}
        self.descs: list[MemoryDesc] = []
        self._register(engine)

    @staticmethod
    def _byte_alias(t: torch.Tensor) -> torch.Tensor:
        """vLLM's ``_contiguous_byte_alias``: a flat uint8 tensor over a slot-strided view's bytes."""
        esz, storage = t.element_size(), t.untyped_storage()
        extent = min(t.shape[0] * t.stride(0) * esz, storage.nbytes() - t.storage_offset() * esz)
        alias = torch.empty(0, dtype=torch.uint8, device=t.device)
        alias.set_(storage, t.storage_offset() * esz, (extent,), (1,))
        return alias

    def _register(self, engine: IOEngine) -> None:
        page = 4096
        base = torch.as_strided(self.attn[0].view(torch.uint8), (self.attn[0].untyped_storage().nbytes(),), (1,), 0)
        ptr = base.data_ptr()
        slack = ptr % page
        end = max(t.data_ptr() - ptr + self.layout.layer_bytes for t in self.attn)
        reg = torch.as_strided(base, (((slack + end + page - 1) // page) * page,), (1,), 0)
        shared = engine.register_torch_tensor(reg)
        self.descs.append(shared)
        for name, t in zip(self.names, self.attn):
            self.mr_offset[name] = t.data_ptr() - reg.data_ptr()
            self.base_addrs += [t[0].data_ptr(), t[1].data_ptr()]  # K and V regions
            self.metadata[name] = [shared.pack()]
        for name, (conv, ssm) in zip(self.names[self.attn_layers :], self.kda):
            descs = [engine.register_torch_tensor(self._byte_alias(t)) for t in (conv, ssm)]
            self.descs += descs
            self.base_addrs += [conv.data_ptr(), ssm.data_ptr()]
            self.metadata[name] = [d.pack() for d in descs]

    def attn_offsets(
        self, name: str, local_ids: list[int], remote_ids: list[int], remote_base: int
    ) -> tuple[list[int], list[int], list[int]]:
        """vLLM's ``compute_block_transfer_offsets`` for a split K/V layer, moved by the layer's
        offset in the shared registration on each side (the remote one from ``remote_base``:
        its K address minus ``MemoryDesc.unpack(packed).data``)."""
        bl, half = self.layout.block_bytes, self.layout.num_blocks * self.layout.block_bytes
        local, remote = [], []
        for lb, rb in zip(local_ids, remote_ids):
            local += [lb * bl, half + lb * bl]
            remote += [rb * bl, half + rb * bl]
        local = [x + self.mr_offset[name] for x in local]
        remote = [x + remote_base for x in remote]
        return merge_contiguous(local, remote, [bl] * len(local))

    def slot_offsets(self, state: int, local_slot: int, remote_slot: int) -> tuple[list[int], list[int], list[int]]:
        """Offsets of one slot's conv (``state`` 0) or ssm (1) state in its own registration."""
        stride = self.page_bytes
        size = 2 * (self.ssm_elems if state else self.conv_elems)
        return [local_slot * stride], [remote_slot * stride], [size]

    def spans(self, name: str, unit: int, pad: int | None = None) -> list[tuple[int, int]]:
        """(byte offset in the backing, length) of block ``unit`` of an attention layer (K, V) or
        of slot ``unit`` of a KDA layer (conv, ssm), in this cache or, with ``pad``, in a peer's."""
        pad = self.pad if pad is None else pad
        i, bl = self.names.index(name), self.layout.block_bytes
        if i < self.attn_layers:
            at = pad + i * self.layout.layer_bytes + unit * bl
            return [(at, bl), (at + self.layout.num_blocks * bl, bl)]
        at = (
            pad
            + self.attn_layers * self.layout.layer_bytes
            + ((i - self.attn_layers) * self.slots + unit) * self.page_bytes
        )
        return [(at, 2 * self.conv_elems), (at + 2 * self.conv_elems, 2 * self.ssm_elems)]


def serve_vllm_hybrid_target(key: str, backend: str, layout: Layout, seed: int, pad: int, kda_layers: int = 2) -> bytes:
    """vLLM 0.33's prefill side (READ mode) of a hybrid model: :class:`HybridCache` registered as
    the connector does; its handshake sends the agent metadata (packed ``EngineDesc``,
    ``kv_caches_base_addr``, ``num_blocks``, ``block_len``) and the layer map."""
    engine = make_engine(key, backend, target=True)
    cache = HybridCache(engine, layout, seed, pad, kda_layers)

    def handshake() -> tuple[bytes, bytes]:
        agent = msgpack.packb(
            {
                "engine_id": key,
                "agent_metadata": engine.get_engine_desc().pack(),
                "kv_caches_base_addr": cache.base_addrs,
                "num_blocks": layout.num_blocks,
                "block_len": layout.block_bytes,
            }
        )
        return agent, msgpack.packb(cache.metadata)

    def deregister_all() -> None:
        for d in cache.descs:
            engine.deregister_memory(d)

    return serve_commands(
        engine,
        {
            **engine_commands(engine, {}),
            "handshake": handshake,
            "cache": lambda: cache.raw.tobytes(),
            "deregister_all": deregister_all,
        },
        cache,
    )
