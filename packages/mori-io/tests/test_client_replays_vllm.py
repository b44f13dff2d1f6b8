"""vLLM 0.33's MoRIIO connector in READ mode, replayed call for call on mori: a hybrid model's
cache registered as the connector registers it, reads re-posted while the send queue is full,
every status of a request checked, reads between different tensor-parallel sizes, and the XGMI
backend.

Source replayed: vLLM's ``vllm/distributed/kv_transfer/kv_connector/v1/moriio/`` as published for
vLLM 0.33 (``moriio_connector.py``: ``register_kv_caches``, ``_build_shared_kv_mr``,
``_contiguous_byte_alias``, ``_remote_layer_mr_offset``, ``_get_built_session``,
``_post_read_with_backoff``, ``_is_sq_full_status``, ``get_moriio_remote_tp_rank``;
``moriio_engine.py``: ``MoRIIOWrapper.set_backend_type``, ``read_remote_data``,
``poll_transfer_batch``, ``_wait_all_transfers``; ``moriio_layout.py``:
``iter_layer_registration_regions``, ``compute_block_transfer_offsets``). As in
test_client_replays.py, the side read from is a child process that never registers the reader,
descriptors travel as the bytes the connector sends, every test runs over the clients' RDMA backend
(UCX over tcp) and the TCP backend, and every byte of every cache is compared after each request.
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time

import msgpack
import numpy as np
import pytest
from _kv_clients import TARGET_NETNS, HybridCache, Layout, make_engine, replay_host, serve_vllm_hybrid_target
from _peer import PipeProcess

from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
)

LAYOUT = Layout(layers=3, num_blocks=24)
TARGET_SEED, LOCAL_SEED = 300, 400
LOCAL_PAD, REMOTE_PAD = 0, 3 * 4096  # the layers sit at other offsets of each side's registration
TRANSFER_TIMEOUT = 30.0  # kv_connector_extra_config.transfer_timeout
SQ_BACKOFF_INITIAL, SQ_BACKOFF_MAX = 0.001, 0.05  # the connector's _SQ_FULL_BACKOFF_* (seconds)


class Reader:
    """One decode worker's MoRIIO state towards one prefill engine: the handshake, the sessions
    (one per registered region, in registration order) and the per-layer offsets."""

    def __init__(self, engine: IOEngine, cache: HybridCache, target: PipeProcess) -> None:
        self.engine, self.cache = engine, cache
        agent_bytes, layers_bytes = target.call("handshake")
        self.agent = msgpack.unpackb(agent_bytes)
        engine.register_remote_engine(EngineDesc.unpack(self.agent["agent_metadata"]))
        self.remote_layers: dict[str, list[bytes]] = msgpack.unpackb(layers_bytes)
        self.sessions, self.regions = [], {}
        for name in cache.names:
            local, remote = cache.metadata[name], self.remote_layers[name]
            assert len(local) == len(remote), name
            self.regions[name] = list(range(len(self.sessions), len(self.sessions) + len(local)))
            for lm, rm in zip(local, remote):
                session = engine.create_session(MemoryDesc.unpack(lm), MemoryDesc.unpack(rm))
                assert session is not None, name
                self.sessions.append(session)
        self.sq_full_reposts = 0

    def remote_mr_offset(self, name: str) -> int:
        """The connector's ``_remote_layer_mr_offset``: the layer's first base address there minus
        the data address of its packed registration."""
        index = 2 * self.cache.names.index(name)  # kv_caches_base_addr holds two regions per layer
        return self.agent["kv_caches_base_addr"][index] - MemoryDesc.unpack(self.remote_layers[name][0]).data

    def post(
        self, session_index: int, offsets: tuple[list[int], list[int], list[int]], deadline: float
    ) -> TransferStatus:
        """``_post_read_with_backoff``: ``read_remote_data`` (``session.batch_read``), re-posted while
        the status failed with "SQ full" in its message, with doubling sleeps, until ``deadline``."""
        local, remote, sizes = offsets
        backoff = SQ_BACKOFF_INITIAL
        while True:
            status = self.sessions[session_index].batch_read(local, remote, sizes, self.engine.allocate_transfer_uid())
            if not (status.Failed() and "SQ full" in (status.Message() or "")) or time.monotonic() > deadline:
                return status
            self.sq_full_reposts += 1
            time.sleep(backoff)
            backoff = min(backoff * 2, SQ_BACKOFF_MAX)

    def read_request(
        self, blocks: tuple[list[int], list[int]], slots: list[tuple[int, int]]
    ) -> dict[str, list[TransferStatus]]:
        """``_read_blocks``: every layer's reads, attention through its one session, KDA conv then ssm."""
        deadline = time.monotonic() + TRANSFER_TIMEOUT
        statuses: dict[str, list[TransferStatus]] = {}
        for name in self.cache.names:
            regions = self.regions[name]
            if len(regions) == 1:
                offs = self.cache.attn_offsets(name, *blocks, self.remote_mr_offset(name))
                statuses[name] = [self.post(regions[0], offs, deadline)]
            else:
                local_slot, remote_slot = slots[self.cache.names.index(name) - self.cache.attn_layers]
                statuses[name] = [
                    self.post(regions[state], self.cache.slot_offsets(state, local_slot, remote_slot), deadline)
                    for state in (0, 1)
                ]
        return statuses


def wait_all_transfers(engine: IOEngine, statuses: list[TransferStatus]) -> None:
    """``_wait_all_transfers`` (``wait_for_layer_load``): one bounded ``wait_all``, its code checked
    as the connector checks it."""
    rc = engine.wait_all(statuses, timeout_ms=math.ceil(TRANSFER_TIMEOUT * 1000))
    if rc in (StatusCode.INIT, StatusCode.IN_PROGRESS):
        raise AssertionError(f"reads timed out after {TRANSFER_TIMEOUT} s")
    assert rc == StatusCode.SUCCESS, [s.Message() for s in statuses if s.Failed()]


def poll_transfer_batch(statuses: list[TransferStatus]) -> str:
    """``poll_transfer_batch``: a verdict over every status of a request, not only the last."""
    state = "DONE"
    for status in statuses:
        if status.Failed():
            return "FAILED"
        if not status.Succeeded():
            state = "PENDING"
    return state


def get_moriio_remote_tp_rank(local_rank: int, local_size: int, remote_size: int) -> int:
    """The connector's mapping of a local TP rank onto the remote TP layout (sizes divide)."""
    if remote_size >= local_size:
        return local_rank * (remote_size // local_size)
    return local_rank // (local_size // remote_size)


def _request(rng: random.Random, cache: HybridCache) -> tuple[tuple[list[int], list[int]], list[tuple[int, int]]]:
    n = rng.randint(2, LAYOUT.num_blocks // 2)
    blocks = (rng.sample(range(LAYOUT.num_blocks), n), rng.sample(range(LAYOUT.num_blocks), n))
    return blocks, [(rng.randrange(cache.slots), rng.randrange(cache.slots)) for _ in range(cache.kda_layers)]


def _expect(
    expected: np.ndarray,
    remote: np.ndarray,
    cache: HybridCache,
    blocks: tuple[list[int], list[int]],
    slots: list[tuple[int, int]],
) -> None:
    """What the request's reads bring into ``expected`` from the remote cache bytes."""
    for name in cache.names[: cache.attn_layers]:
        for lb, rb in zip(*blocks):
            for (lo, n), (ro, _) in zip(cache.spans(name, lb), cache.spans(name, rb, REMOTE_PAD)):
                expected[lo : lo + n] = remote[ro : ro + n]
    for name, (ls, rs) in zip(cache.names[cache.attn_layers :], slots):
        for (lo, n), (ro, _) in zip(cache.spans(name, ls), cache.spans(name, rs, REMOTE_PAD)):
            expected[lo : lo + n] = remote[ro : ro + n]


def _target(key: str, backend: str, seed: int = TARGET_SEED, kda_layers: int = 2) -> PipeProcess:
    return PipeProcess(
        serve_vllm_hybrid_target,
        (key, backend, LAYOUT, seed, REMOTE_PAD, kda_layers),
        "vLLM prefill",
        60.0,
        TARGET_NETNS,
    )


def _read_and_check(reader: Reader, remote: np.ndarray, rng: random.Random, requests: int) -> None:
    expected = reader.cache.raw.copy()
    for _ in range(requests):
        blocks, slots = _request(rng, reader.cache)
        statuses = reader.read_request(blocks, slots)
        for layer_statuses in statuses.values():  # the per-layer barrier before each layer's forward
            wait_all_transfers(reader.engine, layer_statuses)
        assert poll_transfer_batch([s for layer in statuses.values() for s in layer]) == "DONE"
        _expect(expected, remote, reader.cache, blocks, slots)
        assert np.array_equal(reader.cache.raw, expected)


def test_vllm_hybrid_model_reads_with_shared_and_aliased_registrations(engine: IOEngine, backend: str) -> None:
    """One registration shared by all attention layers (offsets from ``MemoryDesc.unpack(...).data``
    and ``kv_caches_base_addr``), two uint8 ``set_`` aliases per KDA layer overlapping it, a
    session per region, reads checked with ``wait_all`` per layer and a poll over every status."""
    target = _target("prefill-hybrid", backend)
    try:
        cache = HybridCache(engine, LAYOUT, LOCAL_SEED, LOCAL_PAD)
        assert len({cache.metadata[n][0] for n in cache.names[: cache.attn_layers]}) == 1  # one shared registration
        assert all(len(cache.metadata[n]) == 2 for n in cache.names[cache.attn_layers :])
        reader = Reader(engine, cache, target)
        _read_and_check(reader, np.frombuffer(target.call("cache"), dtype=np.uint8), random.Random(1), 4)
        assert reader.sq_full_reposts == 0
    finally:
        target.close()


def test_vllm_reposts_reads_while_the_send_queue_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that finds the send queue full fails at once with "SQ full" (MORI's ERR_RDMA_OP), and
    the connector re-posts it until it is taken. The prefill process is stopped while one layer's
    read fills the queue (``max_send_wr`` 8, one lane), so the next layer's read must be re-posted;
    once it runs again every read finishes and every byte is checked."""
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    monkeypatch.setenv("MORI_IO_SQ_BACKOFF_TIMEOUT_US", "2000")
    engine = IOEngine("decode-sq", IOEngineConfig(replay_host(), 0))
    engine.create_backend(BackendType.RDMA, RdmaBackendConfig(1, -1, 1, PollCqMode.POLLING, False, max_send_wr=8))
    target = _target("prefill-sq", "rdma")
    try:
        cache = HybridCache(engine, LAYOUT, LOCAL_SEED, LOCAL_PAD)
        reader = Reader(engine, cache, target)
        remote = np.frombuffer(target.call("cache"), dtype=np.uint8)
        rng = random.Random(2)
        _read_and_check(reader, remote, rng, 1)  # connected: no control request waits on the stopped process
        # every thread stopped: a thread polling on a vCPU the hypervisor has descheduled goes on
        # serving until that vCPU runs again, and reads it served then never found the queue full
        target.stop()
        resume = threading.Timer(0.5, target.signal, (signal.SIGCONT,))
        resume.start()
        try:
            _read_and_check(reader, remote, rng, 2)
        finally:
            resume.cancel()
            target.signal(signal.SIGCONT)
        assert reader.sq_full_reposts > 0
    finally:
        target.close()
        engine.close()


def test_vllm_reads_between_different_tp_sizes(engine: IOEngine, backend: str) -> None:
    """Decode TP 2 reading from prefill TP 1 (both decode ranks map to prefill rank 0 and read the
    same blocks at once, heads being replicated), then decode TP 1 reading from prefill TP 2 (rank
    0 maps to prefill rank 0, whose cache differs from rank 1's)."""
    prefill = _target("prefill-tp1", backend, kda_layers=0)
    other = make_engine("initiator-1", backend)
    try:
        remote = np.frombuffer(prefill.call("cache"), dtype=np.uint8)
        assert [get_moriio_remote_tp_rank(r, 2, 1) for r in range(2)] == [0, 0]
        readers = [
            Reader(e, HybridCache(e, LAYOUT, LOCAL_SEED + r, LOCAL_PAD, kda_layers=0), prefill)
            for r, e in enumerate((engine, other))
        ]
        errors: list[BaseException] = []

        def rank(reader: Reader) -> None:
            try:
                _read_and_check(reader, remote, random.Random(3), 3)  # the same requests on both ranks
            except BaseException as err:  # reported below
                errors.append(err)

        threads = [threading.Thread(target=rank, args=(r,)) for r in readers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads), errors
    finally:
        prefill.close()
        other.close()
    prefills = [_target(f"prefill-tp2-r{r}", backend, TARGET_SEED + 10 * r, kda_layers=0) for r in range(2)]
    try:
        chosen = get_moriio_remote_tp_rank(0, 1, 2)
        assert chosen == 0
        remotes = [np.frombuffer(p.call("cache"), dtype=np.uint8) for p in prefills]
        assert not np.array_equal(remotes[0], remotes[1])
        reader = Reader(engine, HybridCache(engine, LAYOUT, LOCAL_SEED + 7, LOCAL_PAD, kda_layers=0), prefills[chosen])
        _read_and_check(reader, remotes[chosen], random.Random(4), 3)
    finally:
        for p in prefills:
            p.close()


def test_vllm_xgmi_backend_call(backend: str) -> None:
    """``set_backend_type(BackendType.XGMI)``: ``create_backend(BackendType.XGMI, XgmiBackendConfig())``.
    Where CUDA sees no GPU it fails naming why and leaves the engine as it was; either way the
    engine's other backend still moves the (host) cache."""
    eng = make_engine("decode-xgmi", backend)
    target = _target("prefill-xgmi", backend, kda_layers=0)
    try:
        try:
            eng.create_backend(BackendType.XGMI, XgmiBackendConfig())
        except (ImportError, RuntimeError) as err:  # no GPU here: cuda-bindings' or our error
            assert any(word in str(err) for word in ("CUDA", "libcuda", "GPU")), err
        reader = Reader(eng, HybridCache(eng, LAYOUT, LOCAL_SEED, LOCAL_PAD, kda_layers=0), target)
        _read_and_check(reader, np.frombuffer(target.call("cache"), dtype=np.uint8), random.Random(5), 2)
    finally:
        target.close()
        eng.close()
