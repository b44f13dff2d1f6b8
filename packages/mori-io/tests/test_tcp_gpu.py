"""GPU memory over the TCP backend (staged natively through pinned host memory), two processes: the
target engine (GPU 0) in a spawned process, the initiator (GPU 1 when there is one) here. Both
engines have only the TCP backend, so GPU pairs that NVLink could serve go over TCP. Random
bytes, both whole regions compared byte for byte (a byte written outside the blocks fails too);
regions are sub-tensors at odd offsets of larger allocations."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from _peer import PipeProcess, engine_commands, serve_commands  # noqa: E402

from mori.io import (  # noqa: E402
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    StatusCode,
    TcpBackendConfig,
)

REGION = 16 << 20
SKEW = 1001  # the registered view starts this far into its allocation
TARGET_GPU = 0


def _tensors(device: str) -> dict[str, Any]:
    big = torch.zeros(REGION + 2 * SKEW, dtype=torch.uint8, device=device)
    return {
        "GPU": big[SKEW : SKEW + REGION],
        "CPU": torch.zeros(REGION + SKEW, dtype=torch.uint8)[SKEW:],
        "GPU_ALLOCATION": big,
    }


def _put(t: Any, data: bytes) -> None:
    t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(t.device))
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _get(t: Any) -> np.ndarray:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return t.cpu().numpy()


def _serve(key: str) -> bytes:
    """The target process: a TCP-only engine with a GPU and a CPU region, driven by PipeProcess.call."""
    torch.cuda.set_device(TARGET_GPU)
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))
    tensors = _tensors(f"cuda:{TARGET_GPU}")
    descs = {k: engine.register_torch_tensor(t).pack() for k, t in tensors.items() if k != "GPU_ALLOCATION"}
    return serve_commands(
        engine,
        {
            **engine_commands(engine, {}),
            "descs": lambda: descs,
            "put": lambda name, data: _put(tensors[name], data),
            "get": lambda name: _get(tensors[name]).tobytes(),
        },
    )


class _Target(PipeProcess):
    """The target process; every wait has a timeout and the process is always reaped."""

    def __init__(self, key: str = "target") -> None:
        super().__init__(_serve, (key,), key, 120.0)
        self.mems = {k: MemoryDesc.unpack(v) for k, v in self.call("descs").items()}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[IOEngine, _Target, dict[str, Any], dict[str, MemoryDesc]]]:
    local_gpu = 1 if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(local_gpu)
    engine = IOEngine("initiator", IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))
    target = _Target()
    try:
        target.call("register_engine", engine.get_engine_desc().pack())
        engine.register_remote_engine(target.desc)
        tensors = _tensors(f"cuda:{local_gpu}")
        descs = {k: engine.register_torch_tensor(t) for k, t in tensors.items() if k != "GPU_ALLOCATION"}
        # MORI's MemoryDesc fields for GPU memory: the device's PCI bus id, no NUMA node (host memory has
        # no bus id).
        assert descs["GPU"].device_bus_id.count(":") == 2 and descs["GPU"].numa_node == -1, descs["GPU"]
        assert descs["CPU"].device_bus_id == "", descs["CPU"]
        yield engine, target, tensors, descs
    finally:
        engine.close()
        target.close()


PAIRS = [("GPU", "GPU"), ("GPU", "CPU"), ("CPU", "GPU")]
CASES = [(1, 1), (4096, 64), (4096, 4096), (8 << 20, 1), (100_000, 37)]


@pytest.mark.parametrize("local,remote", PAIRS)
@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("size,batch", CASES)
def test_batches_byte_for_byte(pair: Any, local: str, remote: str, op: str, size: int, batch: int) -> None:
    engine, target, tensors, descs = pair
    rng = np.random.default_rng(size * 7 + batch)
    mine, theirs = rng.integers(0, 256, REGION, dtype=np.uint8), rng.integers(0, 256, REGION, dtype=np.uint8)
    _put(tensors[local], mine.tobytes())
    target.call("put", remote, theirs.tobytes())
    slots = REGION // size
    l_offs = rng.choice(slots, batch, replace=False).astype(np.int64) * size
    r_offs = rng.choice(slots, batch, replace=False).astype(np.int64) * size
    sizes = np.full(batch, size, dtype=np.int64)
    src, dst, s_offs, d_offs = (mine, theirs, l_offs, r_offs) if op == "write" else (theirs, mine, r_offs, l_offs)
    want = dst.copy()
    for s, d in zip(s_offs.tolist(), d_offs.tolist()):
        want[d : d + size] = src[s : s + size]
    uid = engine.allocate_transfer_uid()
    lists = batch < 64  # lists for small batches, numpy arrays for the others (both are accepted)
    args = [v.tolist() if lists else v for v in (l_offs, r_offs, sizes)]
    fn = engine.batch_write if op == "write" else engine.batch_read
    st = fn(descs[local], args[0], target.mems[remote], args[1], args[2], uid)
    assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st.Message()
    got = np.frombuffer(target.call("get", remote), dtype=np.uint8) if op == "write" else _get(tensors[local])
    assert np.array_equal(got, want)
    untouched = _get(tensors[local]) if op == "write" else np.frombuffer(target.call("get", remote), dtype=np.uint8)
    assert np.array_equal(untouched, mine if op == "write" else theirs)
    assert target.call("pop_inbound", "initiator", uid, 0) == 0  # inbound record, sent after the last device copy


@pytest.mark.parametrize("local,remote", PAIRS)
def test_session_read_and_write(pair: Any, local: str, remote: str) -> None:
    engine, target, tensors, descs = pair
    rng = np.random.default_rng(5)
    mine, theirs = rng.integers(0, 256, REGION, dtype=np.uint8), rng.integers(0, 256, REGION, dtype=np.uint8)
    _put(tensors[local], mine.tobytes())
    target.call("put", remote, theirs.tobytes())
    sess = engine.create_session(descs[local], target.mems[remote])
    assert sess is not None
    st = sess.write(3, 5_000_001, 6_000_007, sess.allocate_transfer_uid())  # odd offsets and size
    assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st.Message()
    theirs[5_000_001:11_000_008] = mine[3:6_000_010]
    st = sess.read(10_000_000, 1, 4_999_999, sess.allocate_transfer_uid())
    assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st.Message()
    mine[10_000_000:14_999_999] = theirs[1:5_000_000]
    assert np.array_equal(np.frombuffer(target.call("get", remote), dtype=np.uint8), theirs)
    assert np.array_equal(_get(tensors[local]), mine)


def test_out_of_range_gpu_block_is_rejected_at_the_target(pair: Any) -> None:
    engine, target, tensors, descs = pair
    theirs = np.random.default_rng(9).integers(0, 256, REGION, dtype=np.uint8)
    target.call("put", "GPU", theirs.tobytes())
    forged = dataclasses.replace(target.mems["GPU"], size=REGION * 2)  # more than the target registered
    st = engine.write(descs["GPU"], 0, forged, REGION - 4096, 8192, engine.allocate_transfer_uid())
    assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS and st.Code() == StatusCode.ERR_INVALID_ARGS, st.Message()
    assert "out of range" in st.Message(), st.Message()
    for offset in (REGION - 4095, REGION, REGION + 7):  # past the end: refused, and nothing lands beyond it
        st = engine.write(descs["GPU"], 0, forged, offset, 4096, engine.allocate_transfer_uid())
        assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS and st.Code() == StatusCode.ERR_INVALID_ARGS, st.Message()
    allocation = np.frombuffer(target.call("get", "GPU_ALLOCATION"), dtype=np.uint8)
    assert np.array_equal(allocation[SKEW : SKEW + REGION], theirs)
    outside = np.concatenate([allocation[:SKEW], allocation[SKEW + REGION :]])
    assert not outside.any(), "bytes outside the registration changed"


def test_a_killed_target_never_leaves_success_with_bytes_missing(pair: Any) -> None:
    """Reads of a target's GPU memory in flight when the target process is killed: each ends, and
    one that says SUCCESS has every byte of its block in local GPU memory. 256 reads of 1 MiB take
    tens of milliseconds; the target dies after the first eight."""
    engine, _, tensors, descs = pair
    doomed = _Target("doomed")  # an engine key of its own: transfers go to it, not to the pair's target
    try:
        doomed.call("register_engine", engine.get_engine_desc().pack())
        engine.register_remote_engine(doomed.desc)
        theirs = np.random.default_rng(11).integers(0, 256, REGION, dtype=np.uint8)
        doomed.call("put", "GPU", theirs.tobytes())
        tensors["GPU"].zero_()
        torch.cuda.synchronize()
        block, slots = 1 << 20, REGION >> 20
        statuses, slot_of = [], []
        for i in range(16 * slots):  # every read of a slot carries the same bytes
            slot = i % slots
            statuses.append(
                engine.read(
                    descs["GPU"], slot * block, doomed.mems["GPU"], slot * block, block, engine.allocate_transfer_uid()
                )
            )
            slot_of.append(slot)
            if i == 7:
                assert statuses[0].WaitFor(60_000) == StatusCode.SUCCESS, statuses[0].Message()
                doomed.kill()
        ended = [st.WaitFor(60_000) for st in statuses]
        assert StatusCode.IN_PROGRESS not in ended, "a read never ended after its target died"
        assert StatusCode.SUCCESS in ended and any(code != StatusCode.SUCCESS for code in ended), ended
        mine = _get(tensors["GPU"])
        for st, slot in zip(statuses, slot_of):
            if st.Succeeded():
                got, want = mine[slot * block : (slot + 1) * block], theirs[slot * block : (slot + 1) * block]
                assert np.array_equal(got, want), f"SUCCESS with bytes missing in slot {slot}"
            else:
                assert st.Code() in (StatusCode.ERR_BAD_STATE, StatusCode.ERR_GPU_OP), st.Message()
    finally:
        engine.deregister_remote_engine(doomed.desc)
        doomed.kill()
