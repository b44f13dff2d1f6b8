"""SGLang 0.5.23's MORI backend (``python/sglang/srt/disaggregation/mori/conn.py``): its engine,
built in a thread of its own after ``MORI_RDMA_DEVICES`` is set; its buffers (one KV buffer per
layer of an MLA model, aux buffers, state buffers per component), registered as
``_register_local_buffers`` registers them, host KV in chunks aligned to the item length; and the
decode side that prefill writes into, as a process that never registers prefill.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from dataclasses import dataclass

import msgpack
import numpy as np
from _kv_clients import fill, make_engine
from _peer import engine_commands, serve_commands

from mori.io import IOEngine, MemoryDesc, MemoryLocationType

__all__ = ["SglangLayout", "SglangBuffers", "sglang_engine", "serve_sglang_decode"]

HOST_REGISTRATION_ALIGNMENT = 4096  # conn.py's alignment of host registration chunks


@dataclass(frozen=True)
class SglangLayout:
    """Sizes of the buffers: KV pages of ``item_len`` bytes per layer; aux slots; state slots of
    paged ("swa") and per-request ("mamba") components, each component a list of tensors."""

    layers: int = 2
    pages: int = 64
    item_len: int = 2048
    aux_lens: tuple[int, ...] = (64, 24)
    aux_slots: int = 32
    swa_lens: tuple[int, ...] = (512, 256)
    swa_slots: int = 64
    mamba_lens: tuple[int, ...] = (1024, 384)
    mamba_slots: int = 16


def sglang_engine(key: str, backend: str, target: bool = False) -> IOEngine:
    """``MoriKVManager._init_engine``, run as SGLang runs it: ``MORI_RDMA_DEVICES`` set from the
    device list first (here every interface, as UCX's tcp transport names devices), then the
    engine and ``RdmaBackendConfig(4, -1, 4, POLLING, False)`` built in another thread."""
    os.environ["MORI_RDMA_DEVICES"] = ",".join(name for _, name in socket.if_nameindex())
    built: list[IOEngine] = []
    errors: list[BaseException] = []

    def init() -> None:
        try:
            built.append(make_engine(key, backend, target))
        except BaseException as err:  # re-raised below, in the caller
            errors.append(err)

    thread = threading.Thread(target=init, name=f"mori-init-{key}")
    thread.start()
    thread.join(timeout=60)
    if errors:
        raise errors[0]
    assert built and not thread.is_alive(), f"engine {key} was not built in 60 s"
    return built[0]


class SglangBuffers:
    """One side's buffers, filled with bytes from ``seed``, registered with ``engine`` as SGLang
    does: ``register_memory(ptr, length, device, loc)`` per buffer, host KV split into chunks of
    ``host_chunk`` bytes (rounded down to ``lcm(4096, item_len)``; None: one registration)."""

    def __init__(self, engine: IOEngine, layout: SglangLayout, seed: int, host_chunk: int | None = None) -> None:
        self.layout = layout
        self.kv = [fill(seed + i, layout.pages * layout.item_len) for i in range(layout.layers)]
        self.aux = [fill(seed + 100 + i, n * layout.aux_slots) for i, n in enumerate(layout.aux_lens)]
        self.state = [
            [fill(seed + 200 + i, n * layout.swa_slots) for i, n in enumerate(layout.swa_lens)],
            [fill(seed + 300 + i, n * layout.mamba_slots) for i, n in enumerate(layout.mamba_lens)],
        ]
        alignment = math.lcm(HOST_REGISTRATION_ALIGNMENT, layout.item_len)
        chunk = None if host_chunk is None else host_chunk // alignment * alignment

        def register(a: np.ndarray, offset: int = 0, length: int | None = None) -> MemoryDesc:
            return engine.register_memory(
                int(a.ctypes.data) + offset, a.size - offset if length is None else length, -1, MemoryLocationType.CPU
            )

        self.kv_groups = [
            [register(a, at, min(chunk, a.size - at)) for at in range(0, a.size, chunk)] if chunk else [register(a)]
            for a in self.kv
        ]
        self.aux_descs = [register(a) for a in self.aux]
        self.state_descs = [[register(a) for a in component] for component in self.state]

    def descs(self) -> list[MemoryDesc]:
        """Every registration (what SGLang's teardown deregisters)."""
        return [d for g in self.kv_groups for d in g] + self.aux_descs + [d for c in self.state_descs for d in c]

    def arrays(self) -> list[np.ndarray]:
        return self.kv + self.aux + [a for c in self.state for a in c]

    def packed(self) -> bytes:
        """The registration message's descriptor lists (SGLang's msgspec lists of packed descs)."""
        return msgpack.packb(
            [
                [[d.pack() for d in g] for g in self.kv_groups],
                [d.pack() for d in self.aux_descs],
                [[d.pack() for d in c] for c in self.state_descs],
            ]
        )

    @staticmethod
    def unpack(blob: bytes) -> tuple[list[list[MemoryDesc]], list[MemoryDesc], list[list[MemoryDesc]]]:
        kv, aux, state = msgpack.unpackb(blob)
        return (
            [[MemoryDesc.unpack(b) for b in g] for g in kv],
            [MemoryDesc.unpack(b) for b in aux],
            [[MemoryDesc.unpack(b) for b in c] for c in state],
        )


def serve_sglang_decode(key: str, backend: str, layout: SglangLayout, seed: int, host_chunk: int) -> bytes:
    """SGLang's decode side: its engine and buffers (host KV in chunks); ``deregister_all`` is its
    teardown, ``fresh`` registers new buffers (a restarted cache) and hands out their message."""
    engine = sglang_engine(key, backend, target=True)
    side = [SglangBuffers(engine, layout, seed, host_chunk)]

    def deregister_all() -> None:
        for d in side[-1].descs():
            engine.deregister_memory(d)

    def fresh(new_seed: int) -> bytes:
        side.append(SglangBuffers(engine, layout, new_seed, host_chunk))
        return side[-1].packed()

    return serve_commands(
        engine,
        {
            **engine_commands(engine, {}),
            "handshake": lambda: side[-1].packed(),
            "buffers": lambda: [a.tobytes() for a in side[-1].arrays()],
            "deregister_all": deregister_all,
            "fresh": fresh,
        },
        side,
    )
