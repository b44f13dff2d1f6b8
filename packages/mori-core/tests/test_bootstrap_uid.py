"""The unique id's wire form, and the checks a Bootstrap makes before it touches the network."""

from __future__ import annotations

import socket
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mori.core import ConfigError
from mori.core.bootstrap import (
    UNIQUE_ID_BYTES,
    Bootstrap,
    BootstrapError,
    BootstrapTimeout,
    UniqueId,
    get_unique_id,
)

nonces = st.binary(min_size=16, max_size=16)
ports = st.integers(1, 65535)


def _resealed(raw: bytearray) -> bytes:
    """An id edited in place with its checksum recomputed, so only the edited field is wrong."""
    raw[124:] = struct.pack("!I", zlib.crc32(bytes(raw[:124])))
    return bytes(raw)


@given(st.ip_addresses(), ports, nonces)
def test_id_round_trips_through_bytes(addr, port, nonce):
    uid = UniqueId(str(addr), port, nonce)
    raw = uid.to_bytes()
    assert len(raw) == UNIQUE_ID_BYTES
    assert UniqueId.from_bytes(raw) == uid
    assert UniqueId.from_bytes(bytearray(raw)) == uid
    assert UniqueId.from_bytes(memoryview(raw)) == uid


def test_get_unique_id_reserves_where_it_says_and_rank_0_listens_there(monkeypatch):
    monkeypatch.setenv("MORI_BOOTSTRAP_HOST", "127.0.0.1")
    raw = get_unique_id()
    assert isinstance(raw, bytes) and len(raw) == UNIQUE_ID_BYTES
    uid = UniqueId.from_bytes(raw)
    assert uid.host == "127.0.0.1"
    with socket.socket() as other, pytest.raises(OSError):  # no other program can take the port
        other.bind((uid.host, uid.port))
    with Bootstrap(0, 1, raw, timeout=5), socket.create_connection((uid.host, uid.port), timeout=5):
        pass
    assert UniqueId.from_bytes(get_unique_id()).nonce != uid.nonce


def test_get_unique_id_defaults_to_an_address_of_this_host(monkeypatch):
    monkeypatch.delenv("MORI_BOOTSTRAP_HOST", raising=False)
    raw = get_unique_id()
    uid = UniqueId.from_bytes(raw)
    # Whatever address was picked, this host must be able to reach rank 0 there.
    with Bootstrap(0, 1, raw, timeout=5), socket.create_connection((uid.host, uid.port), timeout=5):
        pass


def test_unresolvable_host_names_the_variable(monkeypatch):
    monkeypatch.setenv("MORI_BOOTSTRAP_HOST", "no-such-host.invalid")
    with pytest.raises(ConfigError, match="MORI_BOOTSTRAP_HOST"):
        get_unique_id()


@pytest.mark.parametrize("length", [0, 1, 127, 129, 256])
def test_wrong_length_is_rejected(length):
    with pytest.raises(BootstrapError, match=f"128 bytes, got {length}"):
        UniqueId.from_bytes(bytes(length))


def test_wrong_magic_version_and_family_are_named():
    good = bytearray(UniqueId("10.1.2.3", 4000, bytes(range(16))).to_bytes())
    bad = bytearray(good)
    bad[0:4] = b"NCCL"
    with pytest.raises(BootstrapError, match="magic"):
        UniqueId.from_bytes(_resealed(bad))
    bad = bytearray(good)
    bad[4:6] = struct.pack("!H", 7)
    with pytest.raises(BootstrapError, match="version 7"):
        UniqueId.from_bytes(_resealed(bad))
    bad = bytearray(good)
    bad[6] = 5
    with pytest.raises(BootstrapError, match="family 5"):
        UniqueId.from_bytes(_resealed(bad))


@given(st.integers(4, UNIQUE_ID_BYTES - 1), st.integers(1, 255), nonces)
def test_any_garbled_byte_is_caught(index, flip, nonce):
    raw = bytearray(UniqueId("192.168.7.9", 29500, nonce).to_bytes())
    raw[index] ^= flip
    with pytest.raises(BootstrapError):
        UniqueId.from_bytes(bytes(raw))


def test_fields_are_checked():
    with pytest.raises(BootstrapError, match="not an IPv4 or IPv6"):
        UniqueId("node7", 1, bytes(16))
    with pytest.raises(BootstrapError, match="port 0"):
        UniqueId("127.0.0.1", 0, bytes(16))
    with pytest.raises(BootstrapError, match="16 bytes"):
        UniqueId("127.0.0.1", 1, bytes(8))
    with pytest.raises(TypeError, match="str"):
        UniqueId.coerce("abc")  # type: ignore[arg-type]


def test_bad_arguments_raise_before_any_network_use():
    uid = get_unique_id()
    for kwargs, error, text in [
        ({"rank": 2, "world": 2}, ValueError, "rank must be an int in 0..1"),
        ({"rank": -1, "world": 2}, ValueError, "rank"),
        ({"rank": 0, "world": 0}, ValueError, "world must be a positive int"),
        ({"rank": True, "world": 2}, ValueError, "rank"),
        ({"rank": 0, "world": 1, "timeout": 0}, ValueError, "timeout"),
        ({"rank": 0, "world": 1, "timeout": -3.0}, ValueError, "timeout"),
    ]:
        with pytest.raises(error, match=text):
            Bootstrap(uid=uid, **kwargs)
    with pytest.raises(BootstrapError, match="128 bytes"):
        Bootstrap(0, 1, uid[:64])
    # None of that consumed rank 0's listener: a real bootstrap still adopts it.
    with Bootstrap(0, 1, uid) as bs:
        assert bs.allgather(b"x") == [b"x"]


def test_world_of_one_does_every_collective_locally():
    data = bytes(range(256)) * 10
    with Bootstrap(0, 1, get_unique_id(), timeout=5) as bs:
        assert (bs.rank, bs.world) == (0, 1)
        assert bs.allgather(data) == [data]
        assert bs.allgather(memoryview(data)[3:9]) == [data[3:9]]
        assert bs.broadcast(bytearray(data)) == data
        assert bs.alltoall([data]) == [data]
        bs.barrier()


def test_bad_collective_input_changes_nothing():
    with Bootstrap(0, 1, get_unique_id(), timeout=5) as bs:
        with pytest.raises(TypeError, match="allgather data must be bytes-like"):
            bs.allgather("text")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="one chunk per rank: 1, got 2"):
            bs.alltoall([b"a", b"b"])
        with pytest.raises(TypeError, match="sequence"):
            bs.alltoall(b"ab")
        with pytest.raises(TypeError, match="alltoall chunk 0"):
            bs.alltoall([3])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="root must be an int in 0..0, got 1"):
            bs.broadcast(b"x", root=1)
        with pytest.raises(ValueError, match="must pass data"):
            bs.broadcast(None)
        # Still usable: the bad calls never reached the network.
        assert bs.allgather(b"ok") == [b"ok"]


def test_close_is_idempotent_and_final():
    bs = Bootstrap(0, 1, get_unique_id(), timeout=5)
    bs.close()
    bs.close()
    with pytest.raises(BootstrapError, match="closed"):
        bs.barrier()
    assert "closed" in repr(bs)


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MORI_BOOTSTRAP_TIMEOUT", "7.5")
    with Bootstrap(0, 1, get_unique_id()) as bs:
        assert bs.timeout == 7.5
    monkeypatch.setenv("MORI_BOOTSTRAP_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="MORI_BOOTSTRAP_TIMEOUT"):
        Bootstrap(0, 1, get_unique_id())


def test_nobody_listening_names_rank_0():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uid = UniqueId("127.0.0.1", port, bytes(16)).to_bytes()
    with pytest.raises(BootstrapTimeout, match=r"ranks \[0\] did not arrive within 0.5 s"):
        Bootstrap(1, 2, uid, timeout=0.5)


def test_rank_0_can_bind_the_port_of_an_id_made_elsewhere():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uid = UniqueId("127.0.0.1", port, bytes(range(16)))
    with Bootstrap(0, 1, uid, timeout=5) as bs:
        assert bs.broadcast(b"here") == b"here"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = UniqueId("127.0.0.1", s.getsockname()[1], bytes(16))
        with pytest.raises(BootstrapError, match="cannot listen"):
            Bootstrap(0, 1, taken, timeout=5)
