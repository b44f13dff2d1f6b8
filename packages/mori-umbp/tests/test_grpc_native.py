"""The gRPC C++ transport (``mori.umbp._grpc``): its server and channel against grpcio's, over real
sockets, byte for byte; the statuses it answers; its bounds; and the master and its client on
either transport, each with the other's."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures
from unittest import mock

import grpc
import pytest
from _master_harness import running_master
from hypothesis import example, given
from hypothesis import strategies as st

from mori.umbp import _grpc
from mori.umbp._events import KvEvent, KvEventType
from mori.umbp._master._proto import umbp_pb2 as pb
from mori.umbp._master._proto import umbp_pb2_grpc as pb_grpc
from mori.umbp._master.service import MasterService, Rejected
from mori.umbp._master.settings import MasterSettings
from mori.umbp._master_client import EventBundle, MasterClient, MasterError, MasterUnavailableError

WAIT_S = 30.0  # every wait below is bounded by this
RESPONSES = _grpc.response_types(pb, "UMBPMaster")


def _grpc_cpp_installed() -> bool:
    pkg_config = shutil.which("pkg-config")
    return pkg_config is not None and subprocess.run([pkg_config, "--exists", "grpc++"]).returncode == 0


def test_the_native_transport_loads_where_grpc_cpp_is_installed(monkeypatch):
    """ci/setup.sh installs gRPC C++, so the module is built and loads there; elsewhere grpcio."""
    monkeypatch.delenv("MORI_UMBP_GRPC", raising=False)
    if _grpc_cpp_installed():
        assert _grpc.native() is not None and _grpc.transport_name() == "grpc++"
    else:
        assert _grpc.native() is None and _grpc.transport_name() == "grpcio"
    monkeypatch.setenv("MORI_UMBP_GRPC", "python")
    assert _grpc.native() is None and _grpc.transport_name() == "grpcio"
    monkeypatch.setenv("MORI_UMBP_GRPC", "fast")
    with pytest.raises(ValueError, match="MORI_UMBP_GRPC='fast' is not one of auto, python, native"):
        _grpc.native()


def test_native_asked_for_but_missing_says_why(monkeypatch):
    monkeypatch.setattr(_grpc, "_load_native", lambda: ImportError("libgrpc++.so.1.51: cannot open"))
    monkeypatch.setenv("MORI_UMBP_GRPC", "native")
    with pytest.raises(ImportError, match="does not load .libgrpc.+apt-get install libgrpc"):
        _grpc.native()
    monkeypatch.setenv("MORI_UMBP_GRPC", "auto")
    assert _grpc.native() is None  # auto falls back to grpcio


native = _grpc.native() if _grpc_cpp_installed() else None
needs_native = pytest.mark.skipif(native is None, reason="gRPC C++ is not installed (pkg-config grpc++)")


class Echo(pb_grpc.UMBPMasterServicer):
    """BatchLookupPacked answers each key's last byte; node_id steers the other outcomes."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def BatchLookupPacked(self, request, context):
        if request.node_id == "abort":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused: the node is abort")
        if request.node_id == "raise":
            raise KeyError("no such thing")
        if request.node_id == "wait":
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return pb.BatchLookupPackedResponse(found=bytes(k[-1] for k in request.keys.split(b"\0")[:-1]))


def _echo_server(workers: int) -> tuple[Echo, _grpc.NativeServer]:
    """An Echo servicer on the C++ transport's server, on loopback, at most 1 KiB messages."""
    assert native is not None
    servicer = Echo()
    add = pb_grpc.add_UMBPMasterServicer_to_server
    server = _grpc.NativeServer(
        native, "127.0.0.1:0", [(add, servicer)], workers=workers, max_message_bytes=1024, max_streams=8
    )
    return servicer, server


@pytest.fixture
def echo_server():
    servicer, server = _echo_server(workers=3)
    yield servicer, f"127.0.0.1:{server.port}", server
    servicer.release.set()
    server.stop(1.0)  # a second stop does nothing


def _packed(keys: list[bytes]) -> bytes:
    return b"".join(k + b"\0" for k in keys)


def _keys(n: int, salt: int) -> list[bytes]:
    return [f"key-{salt}-{i}-".encode() + bytes([(i * 7 + salt) % 255 + 1]) for i in range(n)]


@needs_native
def test_native_server_answers_grpcio_and_native_clients_byte_for_byte(echo_server):
    _, address, _ = echo_server
    keys = _keys(40, 3)
    expected = bytes(k[-1] for k in keys)
    request = pb.BatchLookupPackedRequest(node_id="n", keys=_packed(keys))
    with grpc.insecure_channel(address) as channel:
        assert pb_grpc.UMBPMasterStub(channel).BatchLookupPacked(request, timeout=WAIT_S).found == expected
    ours = _grpc.NativeChannel(native, address, 1 << 20)
    assert (
        ours.unary("/umbp.UMBPMaster/BatchLookupPacked", request, RESPONSES["BatchLookupPacked"], WAIT_S).found
        == expected
    )
    empty = pb.BatchLookupPackedRequest(node_id="n")  # an empty message is zero bytes on the wire
    assert ours.unary("/umbp.UMBPMaster/BatchLookupPacked", empty, RESPONSES["BatchLookupPacked"], WAIT_S).found == b""


@needs_native
def test_native_channel_calls_a_grpcio_server_byte_for_byte():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_UMBPMasterServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        keys = _keys(100, 9)
        channel = _grpc.NativeChannel(native, f"127.0.0.1:{port}", 1 << 20)
        request = pb.BatchLookupPackedRequest(node_id="n", keys=_packed(keys))
        answer = channel.unary("/umbp.UMBPMaster/BatchLookupPacked", request, RESPONSES["BatchLookupPacked"], WAIT_S)
        assert answer.found == bytes(k[-1] for k in keys)
        with pytest.raises(_grpc.RpcFailure) as e:  # Echo has no BatchLookup: the base class says so
            channel.unary("/umbp.UMBPMaster/BatchLookup", pb.BatchLookupRequest(), RESPONSES["BatchLookup"], WAIT_S)
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
        channel.close()
        with pytest.raises(_grpc.RpcFailure, match="CANCELLED: the channel is closed"):
            channel.unary("/umbp.UMBPMaster/BatchLookupPacked", request, RESPONSES["BatchLookupPacked"], WAIT_S)
    finally:
        server.stop(None)


@needs_native
@pytest.mark.parametrize("client", ["grpcio", "native"])
def test_native_server_answers_errors_as_grpcio_does(echo_server, client):
    _, address, _ = echo_server
    channel = grpc.insecure_channel(address)
    ours = _grpc.NativeChannel(native, address, 1 << 20)

    def call(method: str, request) -> tuple[grpc.StatusCode, str]:
        if client == "native":
            with pytest.raises(_grpc.RpcFailure) as e:
                ours.unary(f"/umbp.UMBPMaster/{method}", request, RESPONSES.get(method, pb.BatchLookupResponse), WAIT_S)
            return e.value.code, e.value.details
        stub = channel.unary_unary(f"/umbp.UMBPMaster/{method}")
        with pytest.raises(grpc.RpcError) as err:
            stub(request.SerializeToString(), timeout=WAIT_S)
        return err.value.code(), err.value.details()

    packed = pb.BatchLookupPackedRequest
    assert call("BatchLookupPacked", packed(node_id="abort", keys=b"a\0")) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "refused: the node is abort",
    )
    code, details = call("BatchLookupPacked", packed(node_id="raise", keys=b"a\0"))
    assert (code, details) == (grpc.StatusCode.UNKNOWN, "Exception calling application: 'no such thing'")
    assert call("BatchLookup", pb.BatchLookupRequest(keys=["a"]))[0] == grpc.StatusCode.UNIMPLEMENTED
    assert call("NoSuchRpc", packed())[0] == grpc.StatusCode.UNIMPLEMENTED
    # A request that is not a message: field 2 (keys) says 5 bytes and 2 follow.
    code, details = call("BatchLookupPacked", _Raw(b"\x12\x05ab"))
    assert (code, details) == (grpc.StatusCode.INTERNAL, "Exception deserializing request!")
    # Over the server's 1 KiB limit.
    assert (
        call("BatchLookupPacked", packed(node_id="n", keys=b"k" * 2000 + b"\0"))[0]
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    channel.close()


class _Raw:
    """A request already serialized (to send bytes that are not the method's message)."""

    def __init__(self, body: bytes) -> None:
        self.body = body

    def SerializeToString(self) -> bytes:
        return self.body


@needs_native
def test_deadlines_and_an_unreachable_server():
    servicer, server = _echo_server(workers=1)
    address = f"127.0.0.1:{server.port}"
    channel = _grpc.NativeChannel(native, address, 1 << 20)
    method, response = "/umbp.UMBPMaster/BatchLookupPacked", RESPONSES["BatchLookupPacked"]
    results: list[object] = []
    stuck = threading.Thread(
        target=lambda: results.append(
            channel.unary(method, pb.BatchLookupPackedRequest(node_id="wait"), response, WAIT_S)
        )
    )
    stuck.start()
    assert servicer.entered.wait(WAIT_S)
    # The one worker is busy: a call waits in gRPC until its deadline.
    with pytest.raises(_grpc.RpcFailure) as e:
        channel.unary(method, pb.BatchLookupPackedRequest(node_id="n", keys=b"a\1\0"), response, 0.2)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    servicer.release.set()
    stuck.join(WAIT_S)
    assert results and results[0].found == b""
    # The worker is free again and serves the next call.
    assert (
        channel.unary(method, pb.BatchLookupPackedRequest(node_id="n", keys=b"a\1\0"), response, WAIT_S).found == b"\1"
    )
    server.stop(1.0)
    with pytest.raises(_grpc.RpcFailure) as e:
        channel.unary(method, pb.BatchLookupPackedRequest(node_id="n", keys=b"a\0"), response, 1.0)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


@needs_native
def test_stop_lets_a_call_in_flight_finish_within_the_grace(echo_server):
    servicer, address, server = echo_server
    server_channel = _grpc.NativeChannel(native, address, 1 << 20)
    method, response = "/umbp.UMBPMaster/BatchLookupPacked", RESPONSES["BatchLookupPacked"]
    results: list[object] = []

    def slow_call() -> None:
        keys = pb.BatchLookupPackedRequest(node_id="wait", keys=b"z\7\0")
        results.append(server_channel.unary(method, keys, response, WAIT_S))

    t = threading.Thread(target=slow_call)
    t.start()
    assert servicer.entered.wait(WAIT_S)
    threading.Timer(0.2, servicer.release.set).start()  # released while stop waits for it
    server.stop(WAIT_S)
    t.join(WAIT_S)
    assert results and results[0].found == b"\7"


@needs_native
def test_many_threads_at_once_each_get_their_own_answer(echo_server):
    _, address, _ = echo_server
    channel = _grpc.NativeChannel(native, address, 1 << 20)
    method, response = "/umbp.UMBPMaster/BatchLookupPacked", RESPONSES["BatchLookupPacked"]

    def worker(salt: int) -> bool:
        for round_ in range(20):
            keys = _keys(1 + (salt + round_) % 30, salt * 100 + round_)
            got = channel.unary(method, pb.BatchLookupPackedRequest(node_id="n", keys=_packed(keys)), response, WAIT_S)
            if got.found != bytes(k[-1] for k in keys):
                return False
        return True

    with futures.ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(worker, range(8)))


class CountingEcho(Echo):
    """Echo that counts the calls its handler runs at once."""

    def __init__(self) -> None:
        super().__init__()
        self.running = self.most = 0
        self._lock = threading.Lock()

    def BatchLookupPacked(self, request, context):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return super().BatchLookupPacked(request, context)
        finally:
            with self._lock:
                self.running -= 1


@needs_native
def test_calls_beyond_the_workers_wait_for_one_to_end():
    """Three workers take three calls at once; the other three wait in gRPC, each taken as one
    ends, and all are answered byte for byte."""
    assert native is not None
    servicer = CountingEcho()
    server = _grpc.NativeServer(
        native,
        "127.0.0.1:0",
        [(pb_grpc.add_UMBPMasterServicer_to_server, servicer)],
        workers=3,
        max_message_bytes=1024,
        max_streams=8,
    )
    channel = _grpc.NativeChannel(native, f"127.0.0.1:{server.port}", 1 << 20)
    method, response = "/umbp.UMBPMaster/BatchLookupPacked", RESPONSES["BatchLookupPacked"]

    def call(salt: int) -> bool:
        keys = _keys(3, salt)
        got = channel.unary(method, pb.BatchLookupPackedRequest(node_id="wait", keys=_packed(keys)), response, WAIT_S)
        return got.found == bytes(k[-1] for k in keys)

    try:
        with futures.ThreadPoolExecutor(max_workers=6) as pool:
            calls = [pool.submit(call, salt) for salt in range(6)]
            deadline = time.monotonic() + WAIT_S
            while servicer.running < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # room for a fourth call to be taken, were the bound not kept
            assert (servicer.running, servicer.most) == (3, 3)
            servicer.release.set()
            assert all(c.result(WAIT_S) for c in calls)
        assert servicer.most == 3
    finally:
        servicer.release.set()
        server.stop(1.0)


@needs_native
def test_a_process_exits_with_a_server_never_stopped_and_a_call_in_flight():
    """The server is destroyed while Python finalizes, with a worker in a handler: it leaves its
    threads (a thread asking for the GIL then hangs on newer Pythons) and the process exits 0."""
    script = textwrap.dedent(
        """
        import threading
        from mori.umbp import _grpc
        from mori.umbp._master._proto import umbp_pb2 as pb, umbp_pb2_grpc as pb_grpc

        entered = threading.Event()

        class Slow(pb_grpc.UMBPMasterServicer):
            def BatchLookupPacked(self, request, context):
                entered.set()
                threading.Event().wait(2.0)
                return pb.BatchLookupPackedResponse(found=b"\\1")

        native = _grpc.native()
        add = pb_grpc.add_UMBPMasterServicer_to_server
        server = _grpc.NativeServer(
            native, "127.0.0.1:0", [(add, Slow())], workers=2, max_message_bytes=1 << 20, max_streams=8
        )
        channel = _grpc.NativeChannel(native, f"127.0.0.1:{server.port}", 1 << 20)
        request = pb.BatchLookupPackedRequest(keys=b"a\\0")
        call = lambda: channel.unary("/umbp.UMBPMaster/BatchLookupPacked", request, pb.BatchLookupPackedResponse, 30)
        threading.Thread(target=call, daemon=True).start()
        assert entered.wait(30)
        print("leaving", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "leaving\n"), proc.stderr


@pytest.mark.parametrize(("master_transport", "client_transport"), [("python", "native"), ("native", "python")])
def test_master_and_client_on_different_transports(monkeypatch, master_transport, client_transport):
    """The wire is the same: a grpcio master with the C++ client, and the other way round."""
    if native is None:
        pytest.skip("gRPC C++ is not installed (pkg-config grpc++)")
    with running_master({"MORI_UMBP_GRPC": master_transport}) as master:
        monkeypatch.setenv("MORI_UMBP_GRPC", client_transport)
        node = MasterClient(master.address, "node-a", "a.host:1", peer_address="a.host:2")
        node.register_client({2: (1 << 30, 1 << 30)})
        keys = [f"page-{i}" for i in range(300)]
        events = [KvEvent(KvEventType.ADD, k, 2, 4096) for k in keys[::2]]
        assert node.heartbeat([EventBundle(1, events)]).acked_seq == 1
        assert node.batch_lookup(keys) == [i % 2 == 0 for i in range(300)]
        route = node.route_get("page-0")
        assert route is not None and (route.node_id, route.size, route.peer_address) == ("node-a", 4096, "a.host:2")
        with pytest.raises(MasterError) as e:
            node.route_put("", 1)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        node.close()
    lost = MasterClient(master.address, "node-a", timeout_s=1.0)
    with pytest.raises(MasterUnavailableError):
        lost.batch_lookup(["page-0"])


_KEYS = st.lists(st.text(max_size=8) | st.sampled_from(["", "a\0b", "\ud800", "ключ", "x" * 7]), max_size=8)


@needs_native
@given(_KEYS)
@example(["a", "\ud800"])
def test_pack_keys_is_pythons_join_or_none(keys):
    assert native is not None
    packed = native.pack_keys(keys, 6)
    plain = all(k and "\0" not in k and len(k.encode(errors="replace")) <= 6 for k in keys)
    if plain and not any("\ud800" <= c <= "\udfff" for k in keys for c in k):
        assert packed == "".join(k + "\0" for k in keys).encode()
    else:
        assert packed is None


@needs_native
@given(_KEYS.map(lambda keys: "".join(k + "\0" for k in keys).encode(errors="surrogatepass")) | st.binary(max_size=40))
@example(b"a\0\0")
@example(b"\xff\0")
@example(b"a\0b")
def test_split_keys_answers_as_the_masters_python_checks(packed):
    """The master splits in C where it can; the same bytes checked in Python give the same keys,
    or the refusal that says what is wrong where C answered None."""
    assert native is not None
    service = MasterService(MasterSettings(max_batch=5, max_key_bytes=6), mock.Mock(), mock.Mock(), mock.Mock())
    keys = native.split_keys(packed, 5, 6)
    with mock.patch.object(_grpc, "split_keys", return_value=None):
        try:
            expected = service._packed_keys("keys", packed)
        except Rejected:
            expected = None
    assert keys == (expected if packed else None)


def test_lookups_see_each_acknowledged_change_while_others_look_up():
    """No cache anywhere: once the master acknowledges a heartbeat, every lookup sees its ADDs and
    REMOVEs, while other threads keep looking up the same keys at once."""
    keys = [f"page-{i}" for i in range(64)]
    with running_master() as master:
        node = MasterClient(master.address, "node-a", "a.host:1", peer_address="a.host:2")
        node.register_client({2: (1 << 30, 1 << 30)})
        observer = MasterClient(master.address, "observer")
        stop = threading.Event()
        answers: list[int] = []

        def look() -> None:
            while not stop.is_set():
                answers.append(len(observer.batch_lookup(keys)))

        readers = [threading.Thread(target=look) for _ in range(4)]
        for t in readers:
            t.start()
        try:
            held: set[str] = set()
            for seq in range(1, 41):
                # Each step adds the keys of one residue and removes those of another.
                adds = [k for i, k in enumerate(keys) if i % 8 == seq % 8]
                removes = [k for i, k in enumerate(keys) if i % 8 == (seq + 3) % 8]
                events = [KvEvent(KvEventType.ADD, k, 2, 4096) for k in adds if k not in held]
                events += [KvEvent(KvEventType.REMOVE, k, 2, 0) for k in removes if k in held]
                assert node.heartbeat([EventBundle(seq, events)]).acked_seq == seq
                held = (held | set(adds)) - set(removes)
                assert observer.batch_lookup(keys) == [k in held for k in keys], seq
        finally:
            stop.set()
            for t in readers:
                t.join(WAIT_S)
        assert answers and set(answers) == {len(keys)}  # every concurrent answer had one bool a key


@needs_native
def test_a_threads_queue_serves_its_calls_to_any_server_and_goes_with_the_thread():
    """A client thread keeps one completion queue for all its calls, to any channel, answered,
    refused or timed out; a server reuses the queues of answered calls. Short-lived threads each
    leave theirs behind them, and every answer is still the call's own."""
    servers = [_echo_server(workers=2) for _ in range(2)]
    channels = [_grpc.NativeChannel(native, f"127.0.0.1:{server.port}", 1 << 20) for _, server in servers]
    method, response = "/umbp.UMBPMaster/BatchLookupPacked", RESPONSES["BatchLookupPacked"]

    def short_lived(salt: int) -> bool:
        for round_ in range(6):
            channel = channels[(salt + round_) % 2]
            if round_ == 3:
                with pytest.raises(_grpc.RpcFailure) as e:
                    channel.unary(method, pb.BatchLookupPackedRequest(node_id="abort"), response, WAIT_S)
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
                continue
            keys = _keys(1 + round_, salt * 10 + round_)
            got = channel.unary(method, pb.BatchLookupPackedRequest(node_id="n", keys=_packed(keys)), response, WAIT_S)
            if got.found != bytes(k[-1] for k in keys):
                return False
        return True

    try:
        for batch in range(3):  # each batch's threads end before the next starts
            with futures.ThreadPoolExecutor(max_workers=4) as pool:
                assert all(pool.map(short_lived, range(batch * 4, batch * 4 + 4)))
        keys = _keys(5, 99)
        for channel in channels:
            got = channel.unary(method, pb.BatchLookupPackedRequest(node_id="n", keys=_packed(keys)), response, WAIT_S)
            assert got.found == bytes(k[-1] for k in keys)
    finally:
        for servicer, server in servers:
            servicer.release.set()
            server.stop(1.0)
