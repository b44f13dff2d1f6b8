"""mori.core.codes: the one definition of comparison codes, signal ops, transfer codes and ops,
checked against the native planes' table (mori.core._native.codes, csrc/base/)."""

from __future__ import annotations

import itertools

import pytest

from mori.core import ucx_atomic
from mori.core._native import codes as native
from mori.core.codes import AtomicOp, Cmp, SignalOp, TransferCode, TransferOp


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
    ops = {
        Cmp.EQ: int.__eq__,
        Cmp.NE: int.__ne__,
        Cmp.GT: int.__gt__,
        Cmp.GE: int.__ge__,
        Cmp.LT: int.__lt__,
        Cmp.LE: int.__le__,
    }
    for (cmp, op), seen, value in itertools.product(ops.items(), (-1, 0, 1), (-1, 0, 1)):
        assert cmp.holds(seen, value) == op(seen, value), (cmp, seen, value)


@pytest.mark.parametrize("bad", [0, 1, 11, True, "set"])
def test_signal_op_parse_rejects_anything_else(bad: object) -> None:
    with pytest.raises(ValueError, match=r"not SIGNAL_SET \(9\) or SIGNAL_ADD \(10\)"):
        SignalOp.parse(bad)  # type: ignore[arg-type]
    assert SignalOp.parse(10) is SignalOp.ADD


def test_transfer_codes_are_the_native_planes() -> None:
    # base/transfer.hpp's Code, exported by the bindings, against the enum (names and values).
    assert {code.name: code.value for code in TransferCode} == native.TRANSFER_CODES
    # MORI-IO's StatusCode numbers: code written against MORI's literals means the same here.
    assert [int(c) for c in TransferCode] == [0, 1, 2, 11, 12, 13, 14, 15]


def test_transfer_ops_are_the_native_planes() -> None:
    # base/ops.hpp's Op: read and write are TransferOp's; notify and region travel between planes only.
    assert {op.name: op.value for op in TransferOp} == {k: native.OPS[k] for k in ("READ", "WRITE")}
    assert set(native.OPS) == {"READ", "WRITE", "NOTIFY", "REGION"}
    assert len(set(native.OPS.values())) == len(native.OPS)


def test_atomic_ops_are_the_native_planes() -> None:
    # base/ops.hpp's AtomicOp (against which the device proxy's kProxyAmo* are checked when it compiles).
    assert {op.name: op.value for op in AtomicOp} == native.ATOMIC_OPS
    assert ucx_atomic.OPS == {
        "fetch_add": 1,
        "compare_swap": 2,
        "swap": 3,
        "store": 4,
        "fetch_and": 5,
        "fetch_or": 6,
        "fetch_xor": 7,
    }
    assert all(
        f"kMori{op.name.title().replace('_', '')} = {op.value};" in ucx_atomic.GPU_WORD_KERNEL for op in AtomicOp
    )


def test_every_reason_has_its_text() -> None:
    # base/reasons.hpp: one enum for every plane's refusals, each with the text an initiator shows.
    assert sorted(native.REASONS) == list(range(len(native.REASONS)))
    assert "not registered at the target (ERR_NOT_FOUND)" in native.REASONS[1]
    assert all(native.REASONS[r] and "reason" not in native.REASONS[r] for r in native.REASONS if r)
