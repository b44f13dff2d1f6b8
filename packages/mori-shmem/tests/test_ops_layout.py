"""mori.ops routing rule (``plan_routing``) against a plain loop, with hypothesis."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.ops._layout import accumulate_rows, plan_routing, reference_dispatch, sent_destinations


def loop_plan(ids: list[list[int]], per_rank: int, world: int) -> list[list[int]]:
    """MORI's kernel, one entry at a time: valid id, and no earlier valid entry on the same rank."""
    out = []
    for row in ids:
        dest = []
        for j, e in enumerate(row):
            pe = e // per_rank
            ok = e >= 0 and pe < world
            dup = any(row[m] >= 0 and row[m] // per_rank == pe for m in range(j))
            dest.append(pe if ok and not dup else -1)
        out.append(dest)
    return out


@st.composite
def routings(draw):
    world = draw(st.integers(1, 8))
    per_rank = draw(st.integers(1, 6))
    k = draw(st.integers(1, 9))
    n = draw(st.integers(0, 12))
    experts = world * per_rank
    entry = st.one_of(st.integers(0, experts - 1), st.integers(-5, -1), st.integers(experts, experts + 9))
    ids = draw(st.lists(st.lists(entry, min_size=k, max_size=k), min_size=n, max_size=n))
    return ids, per_rank, world, k


@settings(max_examples=300, deadline=None)
@given(routings())
def test_plan_matches_loop(case):
    ids, per_rank, world, k = case
    t = torch.tensor(ids, dtype=torch.int32).view(len(ids), k)
    assert plan_routing(t, per_rank, world).tolist() == loop_plan(ids, per_rank, world)


@settings(max_examples=100, deadline=None)
@given(routings())
def test_each_token_reaches_each_rank_once(case):
    ids, per_rank, world, k = case
    t = torch.tensor(ids, dtype=torch.int32).view(len(ids), k)
    dest = plan_routing(t, per_rank, world)
    for pe, pairs in enumerate(sent_destinations(dest)):
        tokens = [tok for tok, _ in pairs]
        assert len(tokens) == len(set(tokens))
        want = {tok for tok, row in enumerate(ids) if any(e >= 0 and e // per_rank == pe for e in row)}
        assert set(tokens) == want


@settings(max_examples=50, deadline=None)
@given(routings(), st.integers(0, 2**31 - 1))
def test_reference_dispatch_partitions_sends(case, seed):
    _, per_rank, world, k = case
    g = torch.Generator().manual_seed(seed)
    all_ids = [
        torch.randint(
            -2, world * per_rank + 2, (int(torch.randint(0, 6, (1,), generator=g)), k), generator=g, dtype=torch.int32
        )
        for _ in range(world)
    ]
    total = sum(len(reference_dispatch(all_ids, per_rank, pe)) for pe in range(world))
    assert total == sum(int((plan_routing(i, per_rank, world) >= 0).sum()) for i in all_ids)


def test_accumulate_rounds_once_in_order():
    rows = [
        torch.tensor([1.0], dtype=torch.bfloat16),
        torch.tensor([2.0**-9], dtype=torch.bfloat16),
        torch.tensor([2.0**-9], dtype=torch.bfloat16),
        torch.tensor([2.0**-9], dtype=torch.bfloat16),
    ]
    # In float32 the small terms add up to 3/4 of a bf16 ulp of 1.0 (rounds up); rounding each partial
    # sum to bf16 would drop every one of them.
    assert accumulate_rows(rows, rows[0]).item() == 1.0 + 2.0**-7
    assert accumulate_rows([], rows[0]).item() == 0.0


def test_plan_rejects_bad_shape():
    import pytest

    with pytest.raises(ValueError, match="2-D"):
        plan_routing(torch.zeros(3, dtype=torch.int32), 2, 2)
