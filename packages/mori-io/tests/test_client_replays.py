"""vLLM's MoRIIO connector and SGLang's MORI backend, replayed call for call on mori.

Each test runs the two sides as two processes: the side that transfers (here) and the side
whose memory is read or written (a child process that registers its caches as that client does
and never registers the other engine, as neither client does on that side). Descriptors travel
as the bytes the clients send (``EngineDesc.pack()``, ``MemoryDesc.pack()`` inside msgpack). The
clients' RDMA backend runs on UCX's tcp transport (there is no RDMA NIC here), and every test runs
again with the TCP backend instead; test_rdma_netns.py runs the RDMA cases once more with the two
sides in two network namespaces. Requests pick random block
subsets of paged, multi-layer caches, and after each request every byte of every cache is
compared with what it must hold.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import torch
from _kv_clients import (
    TARGET_NETNS,
    Layout,
    fill,
    group_contiguous,
    merge_contiguous,
    serve_sglang_target,
    serve_vllm_target,
)
from _peer import PipeProcess

from mori.cpp import TransferStatus
from mori.io import EngineDesc, IOEngine, MemoryDesc, MemoryLocationType, StatusCode

LAYOUT = Layout()
TARGET_SEED, LOCAL_SEED = 100, 200
REQUESTS = 6
DEADLINE_S = 60.0


def _layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.layers)]


def _vllm_caches(seed: int) -> dict[str, torch.Tensor]:
    return {
        name: torch.from_numpy(fill(seed + i, LAYOUT.layer_bytes))
        .view(torch.float16)
        .reshape(2, LAYOUT.num_blocks, LAYOUT.block_size, LAYOUT.kv_heads, LAYOUT.head_dim)
        for i, name in enumerate(_layer_names())
    }


def _blocks(t: np.ndarray) -> np.ndarray:
    """A layer's bytes as [K/V, block, block bytes]."""
    return t.reshape(2, LAYOUT.num_blocks, LAYOUT.block_bytes)


def _vllm_offsets(local_ids: list[int], remote_ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """vLLM's per-layer plan: K and V of each block pair, merged where contiguous on both sides."""
    bl, half = LAYOUT.block_bytes, LAYOUT.num_blocks * LAYOUT.block_bytes
    local, remote = [], []
    for kv in (0, 1):
        local += [kv * half + b * bl for b in local_ids]
        remote += [kv * half + b * bl for b in remote_ids]
    return merge_contiguous(local, remote, [bl] * len(local))


def _vllm_handshake(engine: IOEngine, target: PipeProcess) -> dict[str, MemoryDesc]:
    """The dialing side of vLLM's handshake: register the remote engine, unpack its layers."""
    agent_bytes, layers_bytes = target.call("handshake")
    agent = msgpack.unpackb(agent_bytes)
    engine.register_remote_engine(EngineDesc.unpack(agent["agent_metadata"]))
    return {name: MemoryDesc.unpack(packed[0]) for name, packed in msgpack.unpackb(layers_bytes).items()}


def _requests(seed: int) -> Iterator[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    for _ in range(REQUESTS):
        n = rng.randint(1, LAYOUT.num_blocks // 2)
        yield rng.sample(range(LAYOUT.num_blocks), n), rng.sample(range(LAYOUT.num_blocks), n)


def test_vllm_read_mode_decode_reads_from_prefill(engine: IOEngine, backend: str) -> None:
    """READ mode: decode reads each layer through its own session and, as vLLM does, polls only
    the request's last status; prefill never registers decode."""
    target = PipeProcess(
        serve_vllm_target, ("prefill-0", backend, LAYOUT, TARGET_SEED), "vLLM prefill", 60.0, TARGET_NETNS
    )
    try:
        remote_layers = _vllm_handshake(engine, target)
        caches = _vllm_caches(LOCAL_SEED)
        local_meta = {name: [engine.register_torch_tensor(t).pack()] for name, t in caches.items()}
        sessions = [
            engine.create_session(MemoryDesc.unpack(local_meta[n][0]), remote_layers[n]) for n in _layer_names()
        ]
        assert all(s is not None for s in sessions)
        expected = {n: t.view(torch.uint8).numpy().copy() for n, t in caches.items()}
        remote = {n: fill(TARGET_SEED + i, LAYOUT.layer_bytes) for i, n in enumerate(_layer_names())}
        for local_ids, remote_ids in _requests(1):
            statuses: list[TransferStatus] = []
            for idx, name in enumerate(_layer_names()):
                l_offs, r_offs, sizes = _vllm_offsets(local_ids, remote_ids)
                statuses.append(sessions[idx].batch_read(l_offs, r_offs, sizes, engine.allocate_transfer_uid()))
                _blocks(expected[name])[:, local_ids] = _blocks(remote[name])[:, remote_ids]
            last, deadline = statuses[-1], time.monotonic() + DEADLINE_S
            while not last.Succeeded():
                assert not last.Failed(), last.Message()
                assert time.monotonic() < deadline, "the request's last read did not finish"
                time.sleep(0.001)
            # The last status stands for the request (in-order completion per remote engine).
            assert all(s.Succeeded() for s in statuses)
            for name, t in caches.items():
                assert np.array_equal(t.view(torch.uint8).numpy(), expected[name]), name
        assert target.call("pop_inbound", engine.key, 1, 0.0) is None  # notifications were off
    finally:
        target.close()


def test_vllm_write_mode_prefill_writes_to_decode(engine: IOEngine, backend: str) -> None:
    """WRITE mode: prefill writes each layer through its session, waits for every status as
    vLLM's writer does, then notifies decode (which never registered prefill)."""
    target = PipeProcess(
        serve_vllm_target, ("decode-0", backend, LAYOUT, TARGET_SEED), "vLLM decode", 60.0, TARGET_NETNS
    )
    try:
        remote_layers = _vllm_handshake(engine, target)
        caches = _vllm_caches(LOCAL_SEED)
        sessions = [
            engine.create_session(engine.register_torch_tensor(caches[n]), remote_layers[n]) for n in _layer_names()
        ]
        expected = {n: fill(TARGET_SEED + i, LAYOUT.layer_bytes) for i, n in enumerate(_layer_names())}
        for local_ids, remote_ids in _requests(2):
            statuses = []
            for idx, name in enumerate(_layer_names()):
                l_offs, r_offs, sizes = _vllm_offsets(local_ids, remote_ids)
                statuses.append(sessions[idx].batch_write(l_offs, r_offs, sizes, engine.allocate_transfer_uid()))
                local = caches[name].view(torch.uint8).numpy()
                _blocks(expected[name])[:, remote_ids] = _blocks(local)[:, local_ids]
            remaining, deadline = list(statuses), time.monotonic() + DEADLINE_S
            while remaining:
                assert not any(s.Failed() for s in remaining), [s.Message() for s in remaining]
                remaining = [s for s in remaining if not s.Succeeded()]
                assert time.monotonic() < deadline, "writes did not finish"
                time.sleep(0.001)
            got = np.frombuffer(target.call("cache"), dtype=np.uint8)  # decode, after "write_done"
            assert np.array_equal(got, np.concatenate(list(expected.values())))
    finally:
        target.close()


def test_sglang_prefill_writes_with_engine_level_batches(engine: IOEngine, backend: str) -> None:
    """SGLang: per layer one engine-level ``batch_write([src], [offs], [dst], [offs], [sizes], [uid])``
    for K and one for V, the aux buffers in one multi-descriptor call, then ``wait_all`` polled
    with a short timeout until it is no longer IN_PROGRESS."""
    aux_lens = [64, 24]
    target = PipeProcess(
        serve_sglang_target, ("decode-sg", backend, LAYOUT, TARGET_SEED, aux_lens), "SGLang decode", 60.0, TARGET_NETNS
    )
    try:
        desc_bytes, kv_blob, aux_blob = target.call("handshake")
        engine.register_remote_engine(EngineDesc.unpack(desc_bytes))
        dst_kv = [MemoryDesc.unpack(b) for b in msgpack.unpackb(kv_blob)]
        dst_aux = [MemoryDesc.unpack(b) for b in msgpack.unpackb(aux_blob)]
        half = LAYOUT.layer_bytes // 2
        src_kv_bufs = [fill(LOCAL_SEED + i, half) for i in range(2 * LAYOUT.layers)]
        src_aux_bufs = [fill(LOCAL_SEED + 1000 + i, n * 8) for i, n in enumerate(aux_lens)]
        src_kv = [engine.register_memory(int(a.ctypes.data), a.size, -1, MemoryLocationType.CPU) for a in src_kv_bufs]
        src_aux = [engine.register_memory(int(a.ctypes.data), a.size, -1, MemoryLocationType.CPU) for a in src_aux_bufs]
        expected_kv = [fill(TARGET_SEED + i, half) for i in range(2 * LAYOUT.layers)]
        expected_aux = [fill(TARGET_SEED + 1000 + i, n * 8) for i, n in enumerate(aux_lens)]
        item = LAYOUT.block_bytes
        for r, (prefill_idx, dst_idx) in enumerate(_requests(3)):
            src_groups, dst_groups = group_contiguous(prefill_idx, dst_idx)
            l_offs = [g[0] * item for g in src_groups]
            r_offs = [g[0] * item for g in dst_groups]
            sizes = [len(g) * item for g in src_groups]
            statuses: list[TransferStatus] = []
            for buf in range(2 * LAYOUT.layers):  # K of each layer, then V
                uid = engine.allocate_transfer_uid()
                out = engine.batch_write([src_kv[buf]], [l_offs], [dst_kv[buf]], [r_offs], [sizes], [uid])
                assert isinstance(out, list) and len(out) == 1
                statuses.extend(out)
                for s, d in zip(prefill_idx, dst_idx):
                    expected_kv[buf][d * item : (d + 1) * item] = src_kv_bufs[buf][s * item : (s + 1) * item]
            p_aux, d_aux = r % 8, (r * 3 + 1) % 8
            uids = [engine.allocate_transfer_uid() for _ in aux_lens]
            statuses.extend(
                engine.batch_write(
                    src_aux,
                    [[p_aux * n] for n in aux_lens],
                    dst_aux,
                    [[d_aux * n] for n in aux_lens],
                    [[n] for n in aux_lens],
                    uids,
                )
            )
            for i, n in enumerate(aux_lens):
                expected_aux[i][d_aux * n : (d_aux + 1) * n] = src_aux_bufs[i][p_aux * n : (p_aux + 1) * n]
            deadline = time.monotonic() + DEADLINE_S
            while (rc := engine.wait_all(statuses, timeout_ms=5)) == StatusCode.IN_PROGRESS:
                assert time.monotonic() < deadline, "wait_all never left IN_PROGRESS"
            assert rc == StatusCode.SUCCESS, [s.Message() for s in statuses if s.Failed()]
            got = target.call("buffers")
            for buf, want in zip(got, expected_kv + expected_aux):
                assert np.array_equal(np.frombuffer(buf, dtype=np.uint8), want)
    finally:
        target.close()


def test_sglang_batch_errors_fail_their_own_status(engine: IOEngine, backend: str) -> None:
    """A bad pair in an engine-level batch fails its own status; ``wait_all`` reports it."""
    target = PipeProcess(
        serve_sglang_target, ("decode-bad", backend, LAYOUT, TARGET_SEED, [8]), "SGLang decode", 60.0, TARGET_NETNS
    )
    try:
        desc_bytes, kv_blob, _ = target.call("handshake")
        engine.register_remote_engine(EngineDesc.unpack(desc_bytes))
        dst = [MemoryDesc.unpack(b) for b in msgpack.unpackb(kv_blob)]
        src_buf = fill(7, LAYOUT.layer_bytes // 2)
        src = engine.register_memory(int(src_buf.ctypes.data), src_buf.size, -1, MemoryLocationType.CPU)
        statuses = engine.batch_write(
            [src, src],
            [[0], [0]],
            [dst[0], dst[1]],
            [[0], [dst[1].size]],
            [[64], [64]],
            [engine.allocate_transfer_uid(), engine.allocate_transfer_uid()],
        )
        assert engine.wait_all(statuses, timeout_ms=30_000) == StatusCode.ERR_INVALID_ARGS
        assert statuses[0].Succeeded() and statuses[1].Code() == StatusCode.ERR_INVALID_ARGS
        with pytest.raises(ValueError, match="lengths differ"):
            engine.batch_write([src], [[0], [0]], [dst[0]], [[0]], [[64]], [1])
        with pytest.raises(TypeError, match="must be a list too"):
            engine.batch_write([src], [[0]], dst[0], [[0]], [[64]], [1])
        assert engine.wait_all([]) == StatusCode.SUCCESS
    finally:
        target.close()
