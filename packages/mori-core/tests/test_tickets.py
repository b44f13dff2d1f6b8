"""The one ticket table (csrc/base/tickets.hpp) as the planes use it: the TCP target's text
tickets (drawn or picked, one per key, 64 connections each) and the UCX engine's 64-bit ones
(one per key, at most max_tickets kept, the oldest dropped)."""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Iterator

import pytest

from mori.core import tcp, ucx

HELLO = struct.Struct("<IHHHH")  # magic, version, key, token and ticket lengths (tcp/wire.hpp)
HELLO_MAGIC, VERSION = 0x4F49524D, 3


@pytest.fixture()
def target() -> Iterator[tcp.Target]:
    t = tcp.Target("127.0.0.1", 0, "tok", 5.0)
    try:
        yield t
    finally:
        t.close()


def _hello(port: int, key: str, ticket: str) -> int:
    """The code a hello with ``ticket`` for ``key`` gets (0: admitted)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(HELLO.pack(HELLO_MAGIC, VERSION, len(key), 3, len(ticket)) + (key + "tok" + ticket).encode())
        magic, code = struct.unpack("<Ii", s.recv(8, socket.MSG_WAITALL))
        assert magic == HELLO_MAGIC
        return int(code)


def test_tcp_target_draws_one_ticket_per_key(target: tcp.Target) -> None:
    a = target.issue_ticket("a")
    assert re.fullmatch("[0-9a-f]{32}", a), a
    assert target.issue_ticket("a") == a  # the key's own, renewed
    b = target.issue_ticket("b")
    assert b != a
    assert _hello(target.port, "a", a) == 0 and _hello(target.port, "b", b) == 0
    before = target.stats()["bad_tickets"]
    assert _hello(target.port, "b", a) != 0  # another key's ticket
    assert _hello(target.port, "a", a) == 0  # ... which stays valid for its own
    assert target.stats()["bad_tickets"] == before + 1


def test_a_picked_ticket_replaces_the_keys_own(target: tcp.Target) -> None:
    drawn = target.issue_ticket("a")
    assert target.issue_ticket("a", "picked") == "picked"
    assert target.issue_ticket("a") == "picked"
    assert _hello(target.port, "a", drawn) != 0
    assert _hello(target.port, "a", "picked") == 0
    target.issue_ticket("b", "picked")  # taken from "a"
    assert _hello(target.port, "a", "picked") != 0 and _hello(target.port, "b", "picked") == 0
    with pytest.raises(ValueError, match="1..256 bytes"):
        target.issue_ticket("a", "x" * 257)
    with pytest.raises(ValueError, match="engine key"):
        target.issue_ticket("")


def test_a_ticket_admits_64_connections_until_issued_again(target: tcp.Target) -> None:
    ticket = target.issue_ticket("a")
    assert [_hello(target.port, "a", ticket) for _ in range(64)] == [0] * 64
    assert _hello(target.port, "a", ticket) != 0  # used up, and dropped
    renewed = target.issue_ticket("a")
    assert renewed != ticket and _hello(target.port, "a", renewed) == 0


def test_ucx_engine_keeps_max_tickets_dropping_the_oldest() -> None:
    engine = ucx.make_engine("tickets", {"TLS": "tcp"}, max_tickets=2)
    try:
        a, b = engine.admit("a"), engine.admit("b")
        assert 0 < a < 1 << 64 and 0 < b < 1 << 64 and a != b
        assert engine.admit("a") == a  # renewed: now the newest
        engine.admit("c")  # full: "b", the oldest, is dropped
        assert engine.admit("a") == a
        assert engine.admit("b") != b
        with pytest.raises(ValueError, match="engine key"):
            engine.admit("")
    finally:
        engine.close()
    with pytest.raises(ValueError, match="max_tickets"):
        ucx.make_engine("tickets", {"TLS": "tcp"}, max_tickets=0)
