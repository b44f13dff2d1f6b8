"""Configuration parsing: sizes in every accepted form, and every variable's bad values rejected by name."""

from __future__ import annotations

import math
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mori.core import config
from mori.core.config import VARIABLES, ConfigError, parse_size

_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40, "p": 50}


def _any_case(text: str) -> st.SearchStrategy[str]:
    return st.tuples(*[st.sampled_from(sorted({c.lower(), c.upper()})) for c in text]).map("".join)


@st.composite
def size_strings(draw: st.DrawFn) -> tuple[str, int]:
    """A size in any accepted spelling, with the byte count it means."""
    unit = draw(st.sampled_from(sorted(_SHIFT)))
    if draw(st.booleans()):
        number = str(draw(st.integers(0, 10**12)))
    else:
        whole, frac = draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
        number = f"{whole}.{frac:0{draw(st.integers(len(str(frac)), 7))}d}"
    suffix = draw(st.sampled_from(["", "b", "ib"] if unit else ["", "b"]))
    space = st.sampled_from(["", " ", "  ", "\t"])
    text = draw(space) + number + draw(space) + draw(_any_case(unit + suffix)) + draw(space)
    expected = math.floor(Decimal(number) * (1 << _SHIFT[unit]))
    return text, expected


@given(size_strings())
def test_every_size_spelling_parses_to_its_byte_count(case: tuple[str, int]) -> None:
    text, expected = case
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("6G", 6 << 30),
        ("512M", 512 << 20),
        ("2GiB", 2 << 30),
        ("4096", 4096),
        ("1.5G", 3 << 29),
        ("64k", 65536),
        ("1T", 1 << 40),
        ("3 MB", 3 << 20),
        ("0", 0),
    ],
)
def test_documented_examples(text: str, value: int) -> None:
    assert parse_size(text) == value


_BAD_SIZES = [
    "",
    "   ",
    "G",
    "abc",
    "-1G",
    "+1G",
    "1.G",
    ".5G",
    "1e3",
    "0x10",
    "1X",
    "1GG",
    "5iB",
    "5i",
    "1 G B",
    "1,5G",
    "１G",
]


@pytest.mark.parametrize("text", _BAD_SIZES)
def test_bad_sizes_name_the_variable(text: str) -> None:
    with pytest.raises(ConfigError, match="MORI_SHMEM_HEAP_SIZE=") as info:
        parse_size(text, "MORI_SHMEM_HEAP_SIZE")
    assert "6G" in str(info.value)  # the message shows the accepted forms


# Bad values by the kind of parser a variable uses; a variable whose parser is not listed
# here fails test_every_variable_is_covered, so new variables cannot escape this test.
_BAD_BY_PARSER = {
    "_size": _BAD_SIZES,
    "_bool": ["maybe", "2", "enabled", "-1"],
    "_parse_seconds": ["0", "-3", "soon", "nan", "inf", "1e999", ""],
    "_positive_int": ["0", "-1", "1.5", "x", ""],
    "_device_list": ["", "^", ",", "mlx5_0,bad name", "mlx5_0;rm"],
    "_choice.<locals>.parse": ["definitely-not-an-option", "", "st atic"],
    "_host": ["not a host", "bad!host", "-leading-dash", "10.0.0.1/24", "a..b"],
    "_transport_list": ["", ",", "tcp;sm", "TCP", "rc x", "^tcp"],
}
# Free text: any string is a valid value (paths and secrets), so there is no bad form to reject.
_FREE_FORM = {"_text"}


def _parser(name: str) -> str:
    return VARIABLES[name].parse.__qualname__


def test_every_variable_is_covered() -> None:
    unknown = {n: _parser(n) for n in VARIABLES if _parser(n) not in _BAD_BY_PARSER and _parser(n) not in _FREE_FORM}
    assert not unknown, f"add bad values for these parsers to test_config.py: {unknown}"


@pytest.mark.parametrize("name", sorted(VARIABLES))
def test_bad_values_are_rejected_with_the_variables_name(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    var = VARIABLES[name]
    if _parser(name) in _FREE_FORM:
        for text in ["", "a b", "/tmp/x y", "ü-ñ", "--"]:
            monkeypatch.setenv(name, text)
            assert config.get(name) == text
        return
    for text in _BAD_BY_PARSER[_parser(name)]:
        monkeypatch.setenv(name, text)
        with pytest.raises(ConfigError) as info:
            config.get(name)
        assert f"{name}={text!r}" in str(info.value), str(info.value)
    monkeypatch.delenv(name)
    assert config.get(name) == var.default


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("MORI_SHMEM_HEAP_SIZE", "6G", 6 << 30),
        ("MORI_SHMEM_MODE", "VMM", "vmm"),
        ("MORI_SHMEM_MODE", "VMM_HEAP", "vmm"),  # MORI's spellings
        ("MORI_SHMEM_MODE", "static_heap", "static"),
        ("MORI_DISABLE_P2P", "On", True),
        ("MORI_DISABLE_P2P", "0", False),
        ("MORI_BOOTSTRAP_TIMEOUT", "2.5", 2.5),
        ("MORI_NUM_QP_PER_PE", "4", 4),
        ("MORI_RDMA_DEVICES", "^mlx5_2,mlx5_3", (True, ("mlx5_2", "mlx5_3"))),
        ("MORI_RDMA_DEVICES", "mlx5_0", (False, ("mlx5_0",))),
        ("MORI_BOOTSTRAP_HOST", " 10.1.2.3 ", "10.1.2.3"),
        ("MORI_BOOTSTRAP_HOST", "fe80::1", "fe80::1"),
        ("MORI_BOOTSTRAP_HOST", "node-7.cluster_a.local", "node-7.cluster_a.local"),
        ("MORI_LOG_LEVEL", "TRACE", "trace"),
    ],
)
def test_good_values_parse(name: str, text: str, value: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, text)
    assert config.get(name) == value


def test_unknown_variable_and_describe(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError, match="MORI_NOPE is not a mori variable"):
        config.get("MORI_NOPE")
    monkeypatch.setenv("MORI_SHMEM_HEAP_SIZE", "3G")
    table = config.describe()
    assert all(name in table for name in VARIABLES)
    assert any(line.startswith("MORI_SHMEM_HEAP_SIZE") and "3G" in line for line in table.splitlines())


def test_every_variable_is_documented() -> None:
    page = (Path(__file__).resolve().parents[3] / "docs" / "core-config.md").read_text()
    missing = [name for name in VARIABLES if f"| `{name}` |" not in page]
    assert not missing, f"add these variables to docs/core-config.md: {missing}"
