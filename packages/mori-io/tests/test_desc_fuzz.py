"""Descriptor unpacking under fuzzed input (hypothesis, issue 23): ``EngineDesc.unpack`` and
``MemoryDesc.unpack`` either rebuild a descriptor whose every field is in its documented range,
or raise ``ValueError`` (never ``TypeError``, ``OverflowError`` or anything else) for any bytes.
Inputs: descriptors with some fields swapped for hostile values, missing or extra keys, random
bytes, and byte-level mutations of valid packs."""

from __future__ import annotations

import math
import re

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.io import EngineDesc, MemoryDesc, MemoryLocationType

U64 = 1 << 64
EXAMPLES = 3000  # per test; the outcomes are checked in-process, so this takes seconds

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), U64 - 1),
    st.floats(),
    st.sampled_from([math.inf, -math.inf, 65536, -1, 2**63, U64 - 1, 1e300]),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.just("x" * 5000),
)
_hostile = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6,
)

_engine_fields = st.fixed_dictionaries(
    {
        "key": st.text(min_size=1, max_size=12),
        "host": st.text(max_size=12),
        "port": st.integers(0, 65535),
        "hostname": st.text(max_size=12),
        "pid": st.integers(0, 2**63 - 1),
        "node_id": st.text(max_size=12),
    }
)
_memory_fields = st.fixed_dictionaries(
    {
        "engine_key": st.text(min_size=1, max_size=12),
        "id": st.integers(0, U64 - 1),
        "data": st.integers(0, 2**48),
        "size": st.integers(0, 2**48),
        "device_id": st.integers(-1, 64),
        "loc": st.sampled_from([int(m) for m in MemoryLocationType]),
        "hostname": st.text(max_size=12),
        "extra": st.dictionaries(st.text(max_size=4), st.binary(max_size=8), max_size=2),
        "device_bus_id": st.text(max_size=12),
        "numa_node": st.integers(-1, 8),
    }
)


@st.composite
def _packed(draw: st.DrawFn, valid: st.SearchStrategy[dict]) -> bytes:
    """A packed map: a valid descriptor's fields, then some replaced by hostile values, removed,
    or joined by unknown keys; or random bytes; or a valid pack with bytes flipped or cut."""
    fields = draw(valid)
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        data = bytearray(msgpack.packb(fields))
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data[: draw(st.integers(0, len(data)))])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        fields[name] = draw(_hostile)
    if draw(st.booleans()):
        fields.pop(draw(st.sampled_from(sorted(fields))))
    if draw(st.booleans()):
        fields[draw(st.text(max_size=6))] = draw(_hostile)
    return msgpack.packb(fields)


def _int_in(value: object, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


def _text(value: object, least: int = 0) -> bool:
    return type(value) is str and least <= len(value) <= 4096


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_packed(_engine_fields))
def test_engine_desc_unpack_raises_only_value_error(data: bytes) -> None:
    try:
        d = EngineDesc.unpack(data)
    except ValueError as err:
        assert str(err).startswith("EngineDesc.unpack: ")
        return
    assert _text(d.key, 1) and _text(d.host) and _text(d.hostname) and _text(d.node_id)
    assert _int_in(d.port, 0, 65535) and _int_in(d.pid, 0, 2**63 - 1)
    assert EngineDesc.unpack(d.pack()) == d


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_packed(_memory_fields))
def test_memory_desc_unpack_raises_only_value_error(data: bytes) -> None:
    try:
        d = MemoryDesc.unpack(data)
    except ValueError as err:
        assert str(err).startswith("MemoryDesc.unpack: ")
        return
    assert _text(d.engine_key, 1) and _text(d.hostname) and _text(d.device_bus_id)
    assert all(_int_in(v, 0, U64 - 1) for v in (d.id, d.data, d.size)) and d.data + d.size <= U64
    assert _int_in(d.device_id, -1, 2**31 - 1) and _int_in(d.numa_node, -1, 2**31 - 1)
    assert isinstance(d.loc, MemoryLocationType)
    assert type(d.extra) is dict and all(type(k) is str for k in d.extra)
    back = MemoryDesc.unpack(d.pack())
    assert back == d and back.extra == d.extra


@pytest.mark.parametrize(
    ("cls", "fields", "field"),
    [
        (EngineDesc, {"port": math.inf}, "port"),  # the example: was OverflowError
        (EngineDesc, {"port": 65536}, "port"),
        (EngineDesc, {"port": -1}, "port"),
        (EngineDesc, {"pid": -5}, "pid"),
        (EngineDesc, {"key": ""}, "key"),
        (EngineDesc, {"host": ["h"]}, "host"),
        (MemoryDesc, {"size": -1}, "size"),
        (MemoryDesc, {"id": -1}, "id"),
        (MemoryDesc, {"id": 1.5}, "id"),
        (MemoryDesc, {"loc": 7}, "loc"),
        (MemoryDesc, {"extra": [1]}, "extra"),
        (MemoryDesc, {"device_id": -2}, "device_id"),
        (MemoryDesc, {"data": U64 - 8, "size": 64}, "data + size"),
    ],
)
def test_out_of_range_fields_are_named(cls: type, fields: dict, field: str) -> None:
    good = EngineDesc("k", "h", 1, "", 0, "") if cls is EngineDesc else MemoryDesc("e", 1, 4096, 64)
    packed = msgpack.unpackb(good.pack())
    packed.update(fields)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.unpack: {re.escape(field)} "):
        cls.unpack(msgpack.packb(packed))


def test_unpack_of_a_non_bytes_object_is_a_type_error() -> None:
    for cls in (EngineDesc, MemoryDesc):
        with pytest.raises(TypeError, match="expects bytes"):
            cls.unpack("not bytes")  # type: ignore[arg-type]
