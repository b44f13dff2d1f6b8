"""mori.core.codes: the one definition of comparison codes and signal ops."""

from __future__ import annotations

import itertools

import pytest

from mori.core import tcp
from mori.core.codes import Cmp, SignalOp, TransferCode, TransferOp


def test_values_are_the_contract() -> None:
    assert [(c.name, c.value) for c in Cmp] == [("EQ", 0), ("NE", 1), ("GT", 2), ("GE", 3), ("LT", 4), ("LE", 5)]
    assert (SignalOp.SET, SignalOp.ADD) == (9, 10)  # MORI's atomicType SIGNAL_SET / SIGNAL_ADD


@pytest.mark.parametrize("spelling", ["ge", "GE", "Ge", 3, Cmp.GE])
def test_cmp_parse_accepts_names_and_codes(spelling: int | str) -> None:
    assert Cmp.parse(spelling) is Cmp.GE


@pytest.mark.parametrize("bad", ["gte", "", 6, -1, True, 2.0, None])
def test_cmp_parse_rejects_with_the_accepted_spellings(bad: object) -> None:
    with pytest.raises(ValueError, match=r"not one of eq, ne, gt, ge, lt, le"):
        Cmp.parse(bad)  # type: ignore[arg-type]


def test_cmp_holds_matches_python_operators() -> None:
    ops = {Cmp.EQ: int.__eq__, Cmp.NE: int.__ne__, Cmp.GT: int.__gt__, Cmp.GE: int.__ge__,
           Cmp.LT: int.__lt__, Cmp.LE: int.__le__}
    for (cmp, op), seen, value in itertools.product(ops.items(), (-1, 0, 1), (-1, 0, 1)):
        assert cmp.holds(seen, value) == op(seen, value), (cmp, seen, value)


@pytest.mark.parametrize("bad", [0, 1, 11, True, "set"])
def test_signal_op_parse_rejects_anything_else(bad: object) -> None:
    with pytest.raises(ValueError, match=r"not SIGNAL_SET \(9\) or SIGNAL_ADD \(10\)"):
        SignalOp.parse(bad)  # type: ignore[arg-type]
    assert SignalOp.parse(10) is SignalOp.ADD


def test_transfer_codes_are_the_native_data_plane_s() -> None:
    # tcp/wire.hpp's Code, exported by the bindings, against the enum (names and values).
    assert {code.name: code.value for code in TransferCode} == tcp.TRANSFER_CODES
    # MORI-IO's StatusCode numbers: code written against MORI's literals means the same here.
    assert [int(c) for c in TransferCode] == [0, 1, 2, 11, 12, 13, 14, 15]


def test_transfer_ops_are_the_native_data_planes() -> None:
    # tcp/wire.hpp's Op (read and write), exported by the bindings, against the enum.
    assert {op.name: op.value for op in TransferOp} == tcp.OP_CODES
