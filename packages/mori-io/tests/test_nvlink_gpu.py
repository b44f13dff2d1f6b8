"""The NVLink backend between two processes: the target engine (GPU 0) runs in a spawned process,
the initiator here, on GPU 1 when there are two GPUs. Random bytes, checked byte for byte (the
target's side through SHA-256 of the whole region, so a byte written outside the blocks fails too).

On a machine with ONE GPU both processes use GPU 0: the initiator still imports the target's
memory across processes (CUDA IPC handles, VMM file descriptors) and runs the backend's whole
path (copy engines, gather kernel, events, notifications), but the bytes move within one GPU's
memory, not over NVLink: those runs check correctness, not NVLink."""

from __future__ import annotations

import dataclasses
import hashlib
import time
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
    MemoryLocationType,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
)

# Two GPUs: target on 0, initiator on 1 (NVLink). One GPU: both on 0 (same-device copies).
TARGET_GPU = 0
LOCAL_GPU = 1 if torch.cuda.device_count() >= 2 else 0
SIZES = [1, 8, 4096, 1 << 20, 64 << 20]
BATCHES = [1, 64, 4096]
CASES = [(s, b) for s in SIZES for b in BATCHES if s * b <= 64 << 20]
SKEW = 3
POOL = (64 << 20) + (1 << 20)  # the target's one big tensor; regions are slices of it


def _random(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _fill(t: Any, offset: int, n: int, seed: int) -> None:
    t[offset : offset + n].copy_(torch.from_numpy(_random(seed, n)))
    torch.cuda.synchronize(t.device)


def _bytes(t: Any, offset: int, n: int) -> np.ndarray:
    torch.cuda.synchronize(t.device)
    return t[offset : offset + n].cpu().numpy()


def _serve() -> bytes:
    """The target process: an engine with the NVLink backend on GPU 0, driven by PipeProcess.call."""
    from mori.core.memory import cuda_vmm

    torch.cuda.set_device(TARGET_GPU)
    engine = IOEngine("target", IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(BackendType.XGMI, XgmiBackendConfig())
    tensors: dict[str, Any] = {}
    vmms: dict[str, Any] = {}
    descs: dict[int, MemoryDesc] = {}

    def alloc(name: str, n: int) -> None:
        tensors[name] = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{TARGET_GPU}")

    def register(name: str, offset: int, n: int, as_view: bool) -> bytes:
        t = tensors[name]
        if as_view:  # a sub-allocated tensor: MORI's bug #415
            desc = engine.register_torch_tensor(t[offset : offset + n])
        else:
            desc = engine.register_memory(t.data_ptr() + offset, n, TARGET_GPU, MemoryLocationType.GPU)
        descs[desc.id] = desc
        return desc.pack()

    def vmm(name: str, n: int, seed: int) -> bytes:
        a = cuda_vmm.VmmAllocation.create(n, TARGET_GPU)
        a.write(_random(seed, n).tobytes())
        vmms[name] = a
        desc = engine.register_memory(a.ptr, n, TARGET_GPU, MemoryLocationType.GPU)
        descs[desc.id] = desc
        return desc.pack()

    def digest(name: str, offset: int, n: int) -> str:
        if name in vmms:
            return hashlib.sha256(vmms[name].read(n, offset)).hexdigest()
        return hashlib.sha256(_bytes(tensors[name], offset, n).tobytes()).hexdigest()

    return serve_commands(
        engine,
        {
            **engine_commands(engine, descs),
            "alloc": alloc,
            "register": register,
            "vmm": vmm,
            "digest": digest,
            "fill": lambda name, offset, n, seed: _fill(tensors[name], offset, n, seed),
        },
    )


class Target(PipeProcess):
    """The target process; every wait has a timeout and the process is always reaped."""

    def __init__(self, timeout: float = 120.0) -> None:
        super().__init__(_serve, (), "target", timeout)


@pytest.fixture(scope="module")
def initiator() -> Iterator[IOEngine]:
    if torch.cuda.device_count() < 1:
        pytest.fail("the NVLink tests need a CUDA GPU")
    torch.cuda.set_device(LOCAL_GPU)
    engine = IOEngine("initiator", IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(BackendType.XGMI)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def target(initiator: IOEngine) -> Iterator[Target]:
    t = Target()
    try:
        t.call("register_engine", initiator.get_engine_desc().pack())
        initiator.register_remote_engine(t.desc)
        t.call("alloc", "pool", POOL)
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def local_pool() -> Any:
    return torch.zeros(POOL, dtype=torch.uint8, device=f"cuda:{LOCAL_GPU}")


def _register_local(engine: IOEngine, pool: Any, offset: int, n: int) -> MemoryDesc:
    return engine.register_memory(pool.data_ptr() + offset, n, LOCAL_GPU, MemoryLocationType.GPU)


def _wait(st: TransferStatus) -> TransferStatus:
    assert st.WaitFor(60_000) != StatusCode.IN_PROGRESS, "transfer did not finish in 60 s"
    return st


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def _check_transfer(
    initiator: IOEngine,
    target: Target,
    local_pool: Any,
    op: str,
    api: str,
    l_offs: list[int],
    r_offs: list[int],
    sizes: list[int],
    r_off0: int,
    l_off0: int,
    region: int,
    seed: int,
    as_view: bool = False,
) -> None:
    """Registers a remote region at pool offset ``r_off0`` and a local one at ``l_off0`` (both
    ``region`` bytes), fills both with random bytes, moves the blocks and checks every byte."""
    target.call("fill", "pool", r_off0, region, seed)
    _fill(local_pool, l_off0, region, seed + 1)
    remote_before, local_before = _random(seed, region), _random(seed + 1, region)
    rdesc = MemoryDesc.unpack(target.call("register", "pool", r_off0, region, as_view))
    ldesc = _register_local(initiator, local_pool, l_off0, region)
    try:
        expect_remote, expect_local = remote_before.copy(), local_before.copy()
        for lo, ro, n in zip(l_offs, r_offs, sizes):
            if op == "write":
                expect_remote[ro : ro + n] = local_before[lo : lo + n]
            else:
                expect_local[lo : lo + n] = remote_before[ro : ro + n]
        if api == "session":
            sess = initiator.create_session(ldesc, rdesc)
            assert sess is not None and sess.alive()
            uid = sess.allocate_transfer_uid()
            st = (
                getattr(sess, op)(l_offs[0], r_offs[0], sizes[0], uid)
                if len(sizes) == 1
                else getattr(sess, f"batch_{op}")(l_offs, r_offs, sizes, uid)
            )
        else:
            uid = initiator.allocate_transfer_uid()
            st = (
                getattr(initiator, op)(ldesc, l_offs[0], rdesc, r_offs[0], sizes[0], uid)
                if len(sizes) == 1
                else getattr(initiator, f"batch_{op}")(ldesc, l_offs, rdesc, r_offs, sizes, uid)
            )
        assert _wait(st).Succeeded(), st.Message()
        assert st.Code() == StatusCode.SUCCESS and not st.InProgress() and not st.Failed()
        got_local = _bytes(local_pool, l_off0, region)
        assert np.array_equal(got_local, expect_local), "local region differs"
        assert target.call("digest", "pool", r_off0, region) == _sha(expect_remote), "remote region differs"
        assert target.call("pop_inbound", initiator.key, uid, 10.0) == StatusCode.SUCCESS
        assert target.call("pop_inbound", initiator.key, uid, 0.0) is None
    finally:
        initiator.deregister_memory(ldesc)
        target.call("deregister", rdesc.id)


@pytest.mark.parametrize("size,batch", CASES, ids=[f"{s}Bx{b}" for s, b in CASES])
@pytest.mark.parametrize("api", ["engine", "session"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_transfer_matrix(initiator, target, local_pool, op, api, size, batch):
    rng = np.random.default_rng(size * 31 + batch)
    slots = rng.permutation(batch)
    l_offs = [SKEW + i * size for i in range(batch)]
    r_offs = [SKEW + int(j) * size for j in slots]
    region = SKEW + size * batch + 61
    # Odd offsets inside the big allocations: both regions are sub-allocations.
    _check_transfer(
        initiator,
        target,
        local_pool,
        op,
        api,
        l_offs,
        r_offs,
        [size] * batch,
        4096 + 5,
        8192 + 9,
        region,
        seed=size + batch,
    )


@pytest.mark.parametrize("kernel_max", ["0", "1G", None], ids=["engines", "kernel", "auto"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_mixed_batches_on_each_path(target, local_pool, op, kernel_max, monkeypatch):
    """Random sizes (1 B .. 1 MiB) at random unaligned places, all through the copy engines, all
    through the gather kernel, and split between them."""
    if kernel_max is not None:
        monkeypatch.setenv("MORI_IO_NVLINK_KERNEL_MAX", kernel_max)
    with IOEngine(f"mixed-{op}-{kernel_max}", IOEngineConfig(host="127.0.0.1", port=0)) as engine:
        engine.create_backend(BackendType.XGMI, XgmiBackendConfig(num_streams=4, num_events=4))
        target.call("register_engine", engine.get_engine_desc().pack())
        engine.register_remote_engine(target.desc)
        try:
            for seed in range(3):
                rng = np.random.default_rng(seed)
                slot = [
                    int(x)
                    for x in rng.choice(
                        [1, 7, 100, 4096, 4099, 65536, 200_000, 1 << 20],
                        200,
                        p=[0.15, 0.15, 0.15, 0.15, 0.15, 0.1, 0.1, 0.05],
                    )
                ]
                starts = [int(x) for x in np.cumsum([0] + [n + int(rng.integers(0, 40)) for n in slot])]
                region = starts[-1] + 64
                assert region < POOL - (2 << 20)
                perm = [int(p) for p in rng.permutation(len(slot))]
                # Block i: remote slot i to local slot perm[i], as long as the smaller of the two.
                sizes = [min(slot[i], slot[p]) for i, p in enumerate(perm)]
                _check_transfer(
                    engine,
                    target,
                    local_pool,
                    op,
                    "engine",
                    [starts[p] for p in perm],
                    starts[:-1],
                    sizes,
                    (1 << 20) + 1,
                    (1 << 20) + 3,
                    region,
                    seed=100 + seed,
                )
        finally:
            target.call("deregister_engine", engine.get_engine_desc().pack())


def test_sub_tensors_at_odd_offsets(initiator, target, local_pool):
    """Views of one big tensor registered with register_torch_tensor (MORI's #415)."""
    for i, (offset, n) in enumerate([(1, 4096), (4097, 1 << 20), (12345, 777), ((3 << 20) + 11, 5 << 20)]):
        _check_transfer(
            initiator,
            target,
            local_pool,
            "write" if i % 2 else "read",
            "engine",
            [0, n - n // 2],
            [n // 2, 0],
            [n - n // 2, n // 2],
            offset,
            offset + 7,
            n,
            seed=200 + i,
            as_view=True,
        )


@pytest.mark.parametrize("op", ["write", "read"])
def test_lone_blocks_cut_by_the_kernel(initiator, target, local_pool, op):
    """A lone block below the kernel limit is passed by value and cut into 4 KiB pieces by the
    kernel itself: sizes around the piece size, at unaligned places."""
    for i, n in enumerate([4095, 4097, 65536 + 3, (1 << 20) - 1]):
        _check_transfer(
            initiator,
            target,
            local_pool,
            op,
            "engine",
            [3 + i],
            [10 + 2 * i],
            [n],
            4096 + 1,
            8192 + 6 + i,
            n + 64,
            seed=300 + i,
        )


@pytest.mark.parametrize("op", ["write", "read"])
def test_numpy_offsets(initiator, target, local_pool, op):
    """Offsets and sizes as numpy int64 arrays (the fast path of large batches), scattered."""
    n, size = 1024, 4096
    l_offs = np.arange(n, dtype=np.int64) * size
    r_offs = np.random.default_rng(7).permutation(n).astype(np.int64) * size
    _check_transfer(
        initiator,
        target,
        local_pool,
        op,
        "engine",
        l_offs,
        r_offs,
        np.full(n, size, dtype=np.int64),
        4096 + 16,
        8192 + 32,
        n * size,
        seed=400,
    )


def test_vmm_memory(initiator, target, local_pool):
    n = 3 << 20
    rdesc = MemoryDesc.unpack(target.call("vmm", "vmm", n, 300))
    _fill(local_pool, 0, n, 301)
    ldesc = _register_local(initiator, local_pool, 0, n)
    try:
        remote, local = _random(300, n), _random(301, n)
        uid = initiator.allocate_transfer_uid()
        assert _wait(initiator.batch_read(ldesc, [0, 5000], rdesc, [1, 2 << 20], [4096, 1 << 20], uid)).Succeeded()
        local[0:4096] = remote[1:4097]
        local[5000 : 5000 + (1 << 20)] = remote[2 << 20 : (3 << 20)]
        assert np.array_equal(_bytes(local_pool, 0, n), local)
        uid = initiator.allocate_transfer_uid()
        assert _wait(initiator.write(ldesc, 17, rdesc, 33, 2 << 20, uid)).Succeeded()
        remote[33 : 33 + (2 << 20)] = local[17 : 17 + (2 << 20)]
        assert target.call("digest", "vmm", 0, n) == _sha(remote)
        assert target.call("pop_inbound", "initiator", uid, 10.0) == StatusCode.SUCCESS
    finally:
        initiator.deregister_memory(ldesc)
        target.call("deregister", rdesc.id)


def _unchanged(target: Target, offset: int, n: int, fn) -> None:
    target.call("fill", "pool", offset, n, 999)
    before = target.call("digest", "pool", offset, n)
    fn()
    assert target.call("digest", "pool", offset, n) == before, "the target region was modified"


def test_errors_change_nothing(initiator, target, local_pool):
    n = 1 << 16
    rdesc = MemoryDesc.unpack(target.call("register", "pool", 0, n, False))
    ldesc = _register_local(initiator, local_pool, 0, n)
    try:

        def attempt():
            st = _wait(initiator.write(ldesc, 0, rdesc, n - 10, 11, initiator.allocate_transfer_uid()))
            assert st.Code() == StatusCode.ERR_INVALID_ARGS, st
            forged = dataclasses.replace(rdesc, size=n * 2)
            st = _wait(
                initiator.batch_write(ldesc, [0, 0], forged, [n - 8, n], [16, 16], initiator.allocate_transfer_uid())
            )
            assert st.Code() == StatusCode.ERR_INVALID_ARGS and "out of range" in st.Message(), st
            st = _wait(
                initiator.write(
                    ldesc, 0, dataclasses.replace(rdesc, id=987654), 0, 64, initiator.allocate_transfer_uid()
                )
            )
            assert st.Code() == StatusCode.ERR_NOT_FOUND and "not registered" in st.Message(), st

        _unchanged(target, 0, n, attempt)
        # Used once (so mapped here), then the target deregisters it: later transfers fail.
        assert _wait(initiator.write(ldesc, 0, rdesc, 0, 64, initiator.allocate_transfer_uid())).Succeeded()
        target.call("deregister", rdesc.id)
        _unchanged(target, 0, n, lambda: _expect_not_found(initiator.write(ldesc, 0, rdesc, 0, 64, 1)))
        # Engine deregistered by the target: its mappings are revoked, and (a target serves
        # engines it has not registered, as in MORI) its next transfer opens the region again.
        rdesc = MemoryDesc.unpack(target.call("register", "pool", 0, n, False))
        assert _wait(initiator.write(ldesc, 0, rdesc, 0, 64, initiator.allocate_transfer_uid())).Succeeded()
        target.call("deregister_engine", initiator.get_engine_desc().pack())
        try:
            assert _wait(initiator.read(ldesc, 0, rdesc, 0, 64, 2)).Succeeded()
        finally:
            target.call("register_engine", initiator.get_engine_desc().pack())
        assert _wait(initiator.write(ldesc, 0, rdesc, 0, 64, initiator.allocate_transfer_uid())).Succeeded()
        host = np.zeros(64, dtype=np.uint8)
        with pytest.raises(ValueError, match="not GPU memory"):
            initiator.register_memory(int(host.ctypes.data), 64, LOCAL_GPU, MemoryLocationType.GPU)
        with pytest.raises(ValueError, match="runs past the end"):
            initiator.register_memory(local_pool.data_ptr() + POOL - 8, 1 << 30, LOCAL_GPU, MemoryLocationType.GPU)
    finally:
        initiator.deregister_memory(ldesc)
        target.call("deregister", rdesc.id)


def _expect_not_found(st: TransferStatus) -> None:
    assert _wait(st).Code() == StatusCode.ERR_NOT_FOUND, st


def test_many_concurrent_transfers(initiator, target, local_pool):
    n = 1 << 20
    target.call("fill", "pool", 0, n, 5)
    _fill(local_pool, 0, n, 6)
    rdesc = MemoryDesc.unpack(target.call("register", "pool", 0, n, False))
    ldesc = _register_local(initiator, local_pool, 0, n)
    try:
        statuses = []
        for i in range(256):
            uid = initiator.allocate_transfer_uid()
            statuses.append((uid, initiator.write(ldesc, i * 4096, rdesc, i * 4096, 4096, uid)))
        for _, st in statuses:
            assert _wait(st).Succeeded(), st.Message()
        assert target.call("digest", "pool", 0, n) == _sha(_random(6, n))
        for uid, _ in statuses:
            assert target.call("pop_inbound", "initiator", uid, 10.0) == StatusCode.SUCCESS
    finally:
        initiator.deregister_memory(ldesc)
        target.call("deregister", rdesc.id)


def test_seed_basic_read_write():
    """The seed's "Example: Basic Read/Write", unmodified except the backend (XGMI for RDMA)."""
    from mori.io import (
        BackendType,
        IOEngine,
        IOEngineConfig,
        XgmiBackendConfig,
    )

    # Create engines on initiator and target
    config = IOEngineConfig(host="127.0.0.1", port=8080)
    initiator = IOEngine(key="initiator", config=config)
    config.port = 8081
    target = IOEngine(key="target", config=config)

    # Create XGMI backends (the seed: RDMA)
    xgmi_config = XgmiBackendConfig(num_streams=64, num_events=64)
    initiator.create_backend(BackendType.XGMI, xgmi_config)
    target.create_backend(BackendType.XGMI, xgmi_config)

    # Exchange and register engine descriptors
    initiator_desc = initiator.get_engine_desc()
    target_desc = target.get_engine_desc()
    initiator.register_remote_engine(target_desc)
    target.register_remote_engine(initiator_desc)

    # Register GPU tensors
    size = 1024 * 1024  # 1 MB
    src_tensor = torch.randint(0, 256, (size,), device="cuda:0", dtype=torch.uint8)
    dst_tensor = torch.zeros(size, device=f"cuda:{LOCAL_GPU}", dtype=torch.uint8)  # the seed: cuda:1
    initiator_mem = initiator.register_torch_tensor(dst_tensor)
    target_mem = target.register_torch_tensor(src_tensor)

    # Read: copy from target (remote) to initiator (local)
    uid = initiator.allocate_transfer_uid()
    status = initiator.read(initiator_mem, 0, target_mem, 0, size, uid)

    # Wait for completion
    while status.InProgress():
        pass
    assert status.Succeeded()

    # With sessions (lower overhead for repeated transfers)
    sess = initiator.create_session(initiator_mem, target_mem)
    uid = sess.allocate_transfer_uid()
    status = sess.read(0, 0, size, uid)
    while status.InProgress():
        pass

    # Checks beyond the seed: the bytes arrived, and the target was told.
    assert status.Succeeded()
    assert torch.equal(dst_tensor.cpu(), src_tensor.cpu())
    deadline = time.monotonic() + 10
    while target.pop_inbound_transfer_status("initiator", uid) is None:
        assert time.monotonic() < deadline, "no inbound record"
        time.sleep(0.001)
    initiator.close()
    target.close()
