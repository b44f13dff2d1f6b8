"""The public API surface of the seed: names, enums, configs, descriptors, TransferStatus, and
every IOEngine call not covered by the transfer tests."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mori.io as io
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
    TransferStatus,
    XgmiBackendConfig,
)
from mori.io.backends import Deferred, Outcome

SEED_NAMES = [
    "IOEngine",
    "IOEngineSession",
    "IOEngineConfig",
    "BackendType",
    "MemoryLocationType",
    "StatusCode",
    "PollCqMode",
    "RdmaBackendConfig",
    "XgmiBackendConfig",
    "EngineDesc",
    "MemoryDesc",
    "set_log_level",
]


def test_seed_names_and_enums():
    for name in SEED_NAMES:
        assert hasattr(io, name) and name in io.__all__
    assert {m.name for m in BackendType} >= {"Unknown", "XGMI", "RDMA", "TCP"}
    assert BackendType.NVLINK is BackendType.XGMI
    assert [m.name for m in MemoryLocationType] == ["Unknown", "CPU", "GPU"]
    # MORI's names and integers (include/mori/io/enum.hpp): clients may compare with literals.
    assert {m.name: int(m) for m in StatusCode} == {
        "SUCCESS": 0,
        "INIT": 1,
        "IN_PROGRESS": 2,
        "ERR_INVALID_ARGS": 11,
        "ERR_NOT_FOUND": 12,
        "ERR_RDMA_OP": 13,
        "ERR_BAD_STATE": 14,
        "ERR_GPU_OP": 15,
    }
    assert {m.name: int(m) for m in PollCqMode} == {"POLLING": 0, "EVENT": 1}
    r = RdmaBackendConfig()  # MORI's defaults (src/pybind/pybind_io.cpp), num_worker_threads -1 ("auto") too
    assert (r.qp_per_transfer, r.post_batch_size, r.num_worker_threads, r.poll_cq_mode, r.enable_notification) == (
        1,
        -1,
        -1,
        PollCqMode.POLLING,
        True,
    )
    x = XgmiBackendConfig()
    assert (x.num_streams, x.num_events) == (64, 64)
    with pytest.raises(ValueError, match="num_connections"):
        TcpBackendConfig(num_connections=0)
    io.set_log_level("error")
    with pytest.raises(ValueError):
        io.set_log_level("loud")


@settings(deadline=None)  # a loaded CI host is not what these check
@given(
    key=st.text(min_size=1, max_size=40),
    host=st.text(max_size=20),
    port=st.integers(0, 65535),
    pid=st.integers(0, 2**31),
    node_id=st.text(max_size=40),
)
def test_engine_desc_pack_roundtrip(key, host, port, pid, node_id):
    d = EngineDesc(key, host, port, "h", pid, node_id)
    assert EngineDesc.unpack(d.pack()) == d


@settings(deadline=None)
@given(
    mem_id=st.integers(0, 2**63),
    data=st.integers(1, 2**64 - 2**48),
    size=st.integers(1, 2**48),
    dev=st.integers(-1, 64),
    loc=st.sampled_from(list(MemoryLocationType)),
    extra=st.dictionaries(st.text(max_size=5), st.binary(max_size=16), max_size=3),
    bus=st.text(max_size=16),
    numa=st.integers(-1, 8),
)
def test_memory_desc_pack_roundtrip(mem_id, data, size, dev, loc, extra, bus, numa):
    d = MemoryDesc("e", mem_id, data, size, dev, loc, "host", extra, bus, numa)
    back = MemoryDesc.unpack(d.pack())
    assert back == d and back.extra == extra


@given(junk=st.binary(max_size=64))
def test_desc_unpack_rejects_junk(junk):
    for cls in (EngineDesc, MemoryDesc):
        with pytest.raises(ValueError):
            cls.unpack(junk)


def test_transfer_status_wait_and_waitfor():
    st_ = TransferStatus()
    # MORI: INIT is neither in progress nor failed, and waiting on it returns at once.
    assert not st_.InProgress() and st_.Init() and not st_.Failed() and st_.Code() == StatusCode.INIT
    assert st_.WaitFor(1000) == StatusCode.INIT
    st_.SetCode(StatusCode.IN_PROGRESS)
    t0 = time.monotonic()
    assert st_.WaitFor(200) == StatusCode.IN_PROGRESS and time.monotonic() - t0 >= 0.19
    assert st_.WaitFor(0) == StatusCode.IN_PROGRESS
    threading.Timer(0.1, lambda: st_.Update(StatusCode.ERR_GPU_OP, "boom")).start()
    st_.Wait()
    assert st_.Failed() and st_.Message() == "boom" and st_.Code() == StatusCode.ERR_GPU_OP
    st_.Update(StatusCode.SUCCESS, "")  # a failure sticks
    assert st_.Code() == StatusCode.ERR_GPU_OP
    with pytest.raises(TypeError, match="timeout_ms"):
        st_.WaitFor("1")


def test_transfer_status_finishes_in_submission_order():
    """A status reports finished only once the earlier transfers to the same engine have (what
    the engine links at submission); its own code stays its own."""
    first, second, third = TransferStatus(), TransferStatus(), TransferStatus()
    for st_, earlier in ((first, None), (second, first), (third, second)):
        st_._after(earlier)
        st_._set(StatusCode.IN_PROGRESS)
    third._set(StatusCode.SUCCESS)
    second._set(StatusCode.ERR_NOT_FOUND, "gone")
    assert third.InProgress() and second.InProgress() and third.WaitFor(50) == StatusCode.IN_PROGRESS
    threading.Timer(0.1, lambda: first._set(StatusCode.SUCCESS)).start()
    assert third.WaitFor(10_000) == StatusCode.SUCCESS and third._prev is None
    assert second.Code() == StatusCode.ERR_NOT_FOUND and first.Succeeded()
    # Linking to a finished chain keeps nothing alive.
    fourth = TransferStatus()
    fourth._after(third)
    assert fourth._prev is None


def test_status_reads_the_completion_a_backend_returns():
    """What Backend.submit returns (mori.io.backends): an Outcome ends at once with its code and
    message; a Deferred is IN_PROGRESS until a thread settles it, then reports what it follows."""
    refused = TransferStatus()
    refused._attach(Outcome(StatusCode.ERR_RDMA_OP, "SQ full (write)"))
    assert refused.Failed() and refused.Code() == StatusCode.ERR_RDMA_OP and refused.Message() == "SQ full (write)"
    assert refused.WaitFor(0) == StatusCode.ERR_RDMA_OP

    later, inner = Deferred(), Deferred()
    status = TransferStatus()
    status._set(StatusCode.IN_PROGRESS)
    status._attach(later)
    assert later.wait(0.02) is False and status.WaitFor(20) == StatusCode.IN_PROGRESS and status.Message() == ""
    later.follow(inner)  # settled, but what it follows still runs
    assert status.InProgress() and later.wait(0.02) is False
    threading.Timer(0.1, lambda: inner.finish(StatusCode.ERR_BAD_STATE, "peer lost")).start()
    t0 = time.monotonic()
    assert status.WaitFor(10_000) == StatusCode.ERR_BAD_STATE and time.monotonic() - t0 < 5
    assert status.Message() == "peer lost" and later.wait(0) and inner.code() == StatusCode.ERR_BAD_STATE


def test_a_waiter_before_the_completion_is_attached_gets_its_outcome():
    """The engine's status is IN_PROGRESS before the backend's completion is attached: a thread
    waiting then (a later transfer's wait, deregister_memory) sees the completion's outcome."""
    for delay in (0.0, 0.05):
        status = TransferStatus(StatusCode.IN_PROGRESS)
        threading.Timer(delay, lambda st=status: st._attach(Outcome(StatusCode.ERR_NOT_FOUND, "gone"))).start()
        assert status.WaitFor(10_000) == StatusCode.ERR_NOT_FOUND and status.Message() == "gone"


def test_engine_api_calls():
    with IOEngine("api-a", IOEngineConfig(port=0)) as a, IOEngine("api-b", IOEngineConfig(port=0)) as b:
        assert a.get_engine_desc().port > 0 and a.key == "api-a"
        with pytest.raises(ValueError):
            IOEngine("", IOEngineConfig())
        with pytest.raises(TypeError):
            a.create_backend("TCP")
        a.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))
        a.create_backend(BackendType.TCP)  # a second one of a type: ignored with a warning, as MORI does
        with pytest.raises(TypeError, match="TcpBackendConfig"):
            b.create_backend(BackendType.TCP, RdmaBackendConfig())
        arr = np.arange(1024, dtype=np.uint8)
        # Memory registered before the backend exists is handed to it when it is created.
        mb = b.register_memory(int(arr.ctypes.data), arr.size, -1, MemoryLocationType.CPU)
        b.create_backend(BackendType.TCP)
        with pytest.raises(ValueError):
            a.register_memory(0, 10, -1, MemoryLocationType.CPU)
        with pytest.raises(TypeError):
            a.register_memory(1.5, 10, -1, MemoryLocationType.CPU)
        out = np.zeros(1024, dtype=np.uint8)
        ma = a.register_memory(int(out.ctypes.data), out.size, -1, MemoryLocationType.CPU)
        assert a.create_session(ma, mb) is None  # b is not registered with a yet
        a.register_remote_engine(b.get_engine_desc())
        b.register_remote_engine(a.get_engine_desc())
        assert a.lookup_remote_memory("api-b", mb.id) == mb
        sess = a.create_session(ma, mb)
        assert sess is not None and sess.alive()
        uid = sess.allocate_transfer_uid()
        s = sess.read(0, 0, 1024, uid)
        s.Wait()
        assert s.Succeeded() and np.array_equal(out, arr)
        assert a.pop_inbound_transfer_status("api-b", uid) is None  # inbound records live at the target
        # A record sent over the control plane keeps its message in the target's one table.
        a._ctx.send_completions("api-b", [(77, StatusCode.ERR_GPU_OP, "copy failed on device 3")])
        inbound = b.pop_inbound_transfer_status("api-a", 77)
        assert inbound is not None and inbound.Code() == StatusCode.ERR_GPU_OP
        assert inbound.Message() == "copy failed on device 3" and b.pop_inbound_transfer_status("api-a", 77) is None
        # Batches given as lists, short and long (a long one is converted natively): the same
        # bytes, and the same clear errors for what is not an int.
        for n in (8, 128):
            out[:] = 0
            offs = list(range(0, 1024, 1024 // n))
            s = sess.batch_read(offs[::-1], offs, [1024 // n] * n, sess.allocate_transfer_uid())
            s.Wait()
            expect = np.concatenate([arr[o : o + 1024 // n] for o in offs][::-1])
            assert s.Succeeded() and np.array_equal(out, expect)
            with pytest.raises(TypeError, match="sizes must be a sequence of ints"):
                sess.batch_read(offs, offs, [1024 // n] * (n - 1) + [1.5], 1)
        b.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=2))  # ignored: the first stays
        s = sess.read(0, 0, 1024, sess.allocate_transfer_uid())
        s.Wait()
        assert s.Succeeded() and np.array_equal(out, arr)  # the target's first backend still serves
        a.remove_backend(BackendType.TCP)
        with pytest.raises(KeyError):
            a.remove_backend(BackendType.TCP)
        s = a.read(ma, 0, mb, 0, 8, a.allocate_transfer_uid())
        assert s.Code() == StatusCode.ERR_BAD_STATE and "no backend" in s.Message()
        a.deregister_remote_engine(b.get_engine_desc())
        assert not sess.alive()
        with pytest.raises(KeyError):
            a.deregister_remote_engine(b.get_engine_desc())
        a.deregister_memory(ma)
        with pytest.raises(KeyError):
            a.deregister_memory(ma)
        with pytest.raises(ValueError, match="belongs to engine"):
            a.deregister_memory(mb)
        uids = {a.allocate_transfer_uid() for _ in range(1000)}
        assert len(uids) == 1000


def test_a_reused_descriptor_pair_is_checked_again_after_any_registration_change():
    """A transfer on the pair of descriptors the last one used skips the registration checks only
    while nothing was registered or removed since: each change below fails the same pair at once."""
    with IOEngine("pair-a", IOEngineConfig(port=0)) as a, IOEngine("pair-b", IOEngineConfig(port=0)) as b:
        for e in (a, b):
            e.create_backend(BackendType.TCP)
        src, out = np.arange(256, dtype=np.uint8), np.zeros(256, dtype=np.uint8)
        mb = b.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        ma = a.register_memory(int(out.ctypes.data), out.size, -1, MemoryLocationType.CPU)
        a.register_remote_engine(b.get_engine_desc())

        def read() -> TransferStatus:
            s = a.read(ma, 0, mb, 0, 256, a.allocate_transfer_uid())
            assert s.WaitFor(30_000) != StatusCode.IN_PROGRESS
            return s

        for _ in range(3):
            assert read().Succeeded() and np.array_equal(out, src)
        a.remove_backend(BackendType.TCP)
        s = read()
        assert s.Code() == StatusCode.ERR_BAD_STATE and "no backend" in s.Message()
        a.create_backend(BackendType.TCP)
        out[:] = 0
        assert read().Succeeded() and np.array_equal(out, src)
        a.deregister_remote_engine(b.get_engine_desc())
        s = read()
        assert s.Code() == StatusCode.ERR_NOT_FOUND and "pair-b" in s.Message()
        a.register_remote_engine(b.get_engine_desc())
        assert read().Succeeded()
        a.deregister_memory(ma)
        s = read()
        assert s.Code() == StatusCode.ERR_NOT_FOUND and f"local memory {ma.id}" in s.Message()
        # A transfer past the end is refused on the cached pair too (rows are checked every time).
        ma2 = a.register_memory(int(out.ctypes.data), out.size, -1, MemoryLocationType.CPU)
        assert a.read(ma2, 0, mb, 0, 256, 1).WaitFor(30_000) == StatusCode.SUCCESS
        s = a.read(ma2, 8, mb, 0, 256, 2)
        assert s.Code() == StatusCode.ERR_INVALID_ARGS and "past the end of local memory" in s.Message()
        s = a.read(ma2, 0, mb, 8, 256, 3)
        assert s.Code() == StatusCode.ERR_INVALID_ARGS and "past the end of remote memory" in s.Message()
