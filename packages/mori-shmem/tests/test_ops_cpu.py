"""mori.ops end to end on the CPU heap: real PE processes, every rank's outputs checked against the
PyTorch reference (ep_cases.check_round) for random routings with repeats and invalid ids."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from ep_cases import Case, check_round, make_config, pe_round
from hypothesis import given, settings
from hypothesis import strategies as st

import mori.shmem as shmem

_ops: dict[str, Any] = {}


def _op(case: Case, **overrides: Any) -> Any:
    import mori.ops

    cfg = make_config(case, shmem.shmem_mype(), **overrides)
    key = repr((dataclasses.replace(case, seed=0, invalid=0), sorted(overrides.items())))
    if key not in _ops:
        _ops[key] = mori.ops.EpDispatchCombineOp(cfg)
    return _ops[key]


def pe_rounds(case: Case, seeds: list[int], overrides: dict[str, Any], kw: dict[str, Any]) -> list[dict[str, Any]]:
    op = _op(case, **overrides)
    return [pe_round(dataclasses.replace(case, seed=s), op, **kw) for s in seeds]


def run(
    pool: Any, case: Case, seeds: list[int], wire: Any = None, overrides: Any = None, **kw: Any
) -> list[list[dict[str, Any]]]:
    """Rounds of ``case`` on every PE (``kw``: pe_round's options), each checked; returns the results."""
    per_pe = pool.run(pe_rounds, dataclasses.replace(case, world=pool.n), seeds, overrides or {}, kw)
    for i, seed in enumerate(seeds):
        check_round(dataclasses.replace(case, world=pool.n, seed=seed), [r[i] for r in per_pe], wire)
    return per_pe


BF16 = Case(world=0, max_tokens=9, hidden=48, k=4, experts_per_rank=3)


def test_bf16_repeated_rounds(pool):
    run(pool, BF16, [1, 2, 3, 4])


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10**6), invalid=st.sampled_from([0.0, 0.3, 1.0]), k=st.integers(1, 9))
def test_bf16_random_routings(pool, seed, invalid, k):
    run(pool, dataclasses.replace(BF16, k=k, invalid=invalid), [seed])


def test_fp8_per_token_scale(pool):
    run(
        pool,
        Case(world=0, max_tokens=8, hidden=64, k=6, experts_per_rank=2, dtype=torch.float8_e4m3fn, scale_dim=1),
        [5, 6],
    )


def test_fp8_per_128_scales(pool):
    run(
        pool,
        Case(world=0, max_tokens=8, hidden=256, k=8, experts_per_rank=4, dtype=torch.float8_e4m3fn, scale_dim=2),
        [7],
    )


def test_float32(pool):
    run(pool, dataclasses.replace(BF16, dtype=torch.float32), [8])


def test_async_ll_split(pool):
    from mori.ops import EpDispatchCombineKernelType

    run(pool, BF16, [9, 10], overrides={"kernel_type": EpDispatchCombineKernelType.AsyncLL}, split=True)


def test_zero_copy_combine(pool):
    run(pool, BF16, [11], overrides={"use_external_inp_buf": False}, zero_copy=True)


@pytest.mark.parametrize("split", [False, True])
def test_combine_input_shorter_than_the_rows_received(pool, split):
    """Rows past the combine input count as zeros (MORI's input may cover fewer rows than dispatch
    received)."""
    from mori.ops import EpDispatchCombineKernelType

    overrides = {"kernel_type": EpDispatchCombineKernelType.AsyncLL} if split else {}
    run(pool, dataclasses.replace(BF16, full=True), [13, 14], overrides=overrides, split=split, short_input=True)


def test_fp8_direct_cast_combine(pool):
    run(pool, BF16, [12], torch.float8_e4m3fn, overrides={"quant_type": "fp8_direct_cast"})


HOT = Case(world=0, max_tokens=6, hidden=32, k=4, experts_per_rank=2, invalid=0.0, full=True, hot=(0,))


@pytest.mark.parametrize("combine_weights", ["rows", "empty", "none"])
def test_hot_expert_rank(pool, combine_weights):
    """Every token to rank 0, which receives world_size * max_num_inp_token_per_rank rows; the others
    receive none and combine empty expert outputs (and weights of no rows, or none)."""
    run(pool, HOT, [41, 42], combine_weights=combine_weights)


def test_hot_expert_ranks_async_ll(pool):
    from mori.ops import EpDispatchCombineKernelType

    run(
        pool,
        dataclasses.replace(HOT, hot=(pool.n - 1, 0)),
        [43],
        overrides={"kernel_type": EpDispatchCombineKernelType.AsyncLL},
        split=True,
        combine_weights="rows",
    )


@pytest.mark.parametrize("split", [False, True], ids=["IntraNode", "AsyncLL"])
def test_second_dispatch_refused(pool, split):
    """A second dispatch before the combine raises and changes nothing: the combine then completes
    the first dispatch's round correctly."""
    from mori.ops import EpDispatchCombineKernelType

    overrides = {"kernel_type": EpDispatchCombineKernelType.AsyncLL} if split else {}
    per_pe = run(pool, BF16, [44], overrides=overrides, split=split, second_dispatch=True)
    refusals = [m for r in per_pe for m in r[0]["refusals"]]
    assert len(refusals) == pool.n * (2 if split else 1)
    after_recv = refusals[1::2] if split else refusals  # AsyncLL: each PE tried before and after dispatch_recv
    assert all(m.startswith("dispatch called twice without a combine") for m in after_recv), refusals
    if split:
        assert all("dispatch_send without its dispatch_recv" in m for m in refusals[::2]), refusals


def pe_bad_calls() -> list[str]:
    case = dataclasses.replace(BF16, world=shmem.shmem_npes())
    op = _op(case)
    good = make_config(case, shmem.shmem_mype())
    x = torch.zeros(2, good.hidden_dim, dtype=torch.bfloat16)
    ids = torch.zeros(2, good.num_experts_per_token, dtype=torch.int32)
    errors = []
    for args in (
        (x, None, None, ids.long()),
        (x, None, None, ids[:1]),
        (torch.zeros(99, 48, dtype=torch.bfloat16), None, None, torch.zeros(99, 4, dtype=torch.int32)),
        (x, torch.ones(2, 4, dtype=torch.float64), None, ids),
        (torch.zeros(2, 200, dtype=torch.bfloat16), None, None, ids),
    ):
        try:
            op.dispatch(*args)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc).split(":")[0])
    try:
        op.combine(x, None, ids)
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_bad_calls_change_nothing(pool):
    errors = pool.run(pe_bad_calls)
    assert all(len(e) == 6 for e in errors), errors
    assert "combine called without a preceding dispatch" in errors[0][-1]
    run(pool, BF16, [13])  # the op still works after the refused calls


def pe_expert_count(case: Case) -> tuple[list[int], list[int]]:
    from ep_cases import rank_inputs

    op = _op(case)
    inp = rank_inputs(case, op.config.rank)
    _, _, _, idx, total = op.dispatch(inp["input"], inp["weights"], None, inp["indices"], call_local_expert_count=True)
    got = op.local_expert_count.tolist()
    ids = idx[: int(total)].flatten().tolist()
    want = [
        sum(
            1 for e in ids if e >= 0 and e // case.experts_per_rank == op.config.rank and e % case.experts_per_rank == x
        )
        for x in range(case.experts_per_rank)
    ]
    op.combine(torch.zeros(int(total), case.hidden, dtype=case.dtype), None, inp["indices"])
    return got, want


def test_local_expert_count(pool):
    for got, want in pool.run(pe_expert_count, dataclasses.replace(BF16, world=pool.n, seed=14)):
        assert got == want


def pe_mismatched_config() -> str:
    import mori.ops

    case = dataclasses.replace(BF16, world=shmem.shmem_npes() + 1)
    with pytest.raises(ValueError, match="mori.shmem is PE") as info:
        mori.ops.EpDispatchCombineOp(make_config(case, shmem.shmem_mype()))
    return str(info.value)


def test_config_must_match_shmem(pool):
    assert all("build the op with the shmem PE numbering" in m for m in pool.run(pe_mismatched_config))


def pe_overflow(case: Case) -> str:
    op = _op(case, max_total_recv_tokens=case.world)  # one token from each rank at most
    n = case.max_tokens
    x = torch.zeros(n, case.hidden, dtype=case.dtype)
    ids = torch.zeros(n, case.k, dtype=torch.int32)  # every token to expert 0, on PE 0
    try:
        op.dispatch(x, None, None, ids)
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = "no error"
    # The op is usable again: a dispatch within the cap, then its combine.
    few = ids[:1]
    tokens, _, _, _, total = op.dispatch(x[:1], None, None, few)
    op.combine(tokens[: int(total)].clone(), None, few)
    return message


def test_receive_cap_overflow_fails_cleanly(pool):
    messages = pool.run(pe_overflow, dataclasses.replace(BF16, world=pool.n))
    assert all("max_num_tokens_to_recv" in m for m in messages[:1]), messages
    assert all("would receive more than" in m or m == "no error" for m in messages)


def pe_client_calls(case: Case) -> list[bool]:
    """The calls vLLM's MoriPrepareAndFinalize and SGLang's MoriEPDispatcher make, with their
    keyword names and config kwargs; identity experts, so each token comes back times the number
    of distinct ranks it went to."""
    from ep_cases import rank_inputs

    import mori.ops

    rank, world = shmem.shmem_mype(), shmem.shmem_npes()
    inp = rank_inputs(case, rank)
    x, w, ids = inp["input"], inp["weights"], inp["indices"]
    pes = [
        len({e // case.experts_per_rank for e in row if 0 <= e < case.experts_per_rank * world}) for row in ids.tolist()
    ]
    want = torch.stack([(x[t].float() * n).to(x.dtype) for t, n in enumerate(pes)]) if len(pes) else x
    common = dict(
        rank=rank,
        world_size=world,
        data_type=x.dtype,
        hidden_dim=case.hidden,
        scale_dim=0,
        scale_type_size=4,
        max_token_type_size=x.dtype.itemsize,
        max_num_inp_token_per_rank=case.max_tokens,
        num_experts_per_rank=case.experts_per_rank,
        num_experts_per_token=case.k,
        warp_num_per_block=16,
        block_num=80,
    )
    ok = []
    # vLLM: MoriAll2AllManager's kwargs, prepare() and finalize().
    vllm = mori.ops.EpDispatchCombineOp(
        mori.ops.EpDispatchCombineConfig(
            **common,
            kernel_type=mori.ops.EpDispatchCombineKernelType.IntraNode,
            rdma_block_num=0,
            gpu_per_node=min(8, world),
        )
    )
    out, out_w, out_s, out_i, count = vllm.dispatch(input=x, weights=w, scales=None, indices=ids)
    combined, _ = vllm.combine(input=out, weights=w, indices=ids)
    output = torch.empty_like(x)
    output.copy_(combined[: x.shape[0]])
    ok.append(torch.equal(output, want) and out_s is None)
    # SGLang: init_mori_op's kwargs (AsyncLL for low latency), dispatch_a/b and combine_a/b.
    sglang = mori.ops.EpDispatchCombineOp(
        mori.ops.EpDispatchCombineConfig(
            **common,
            max_total_recv_tokens=0,
            use_external_inp_buf=True,
            kernel_type=mori.ops.EpDispatchCombineKernelType.AsyncLL,
            gpu_per_node=world,
            rdma_block_num=32,
            num_qp_per_pe=2,
            quant_type="none",
        )
    )
    hidden, _, _, recv_ids, count = sglang.dispatch_send(x, w, None, ids)
    sglang.dispatch_recv(call_local_expert_count=True)
    mine = recv_ids[: int(count)].flatten()
    mine = mine[(mine >= 0) & (mine // case.experts_per_rank == rank)] % case.experts_per_rank
    counted = torch.equal(sglang.local_expert_count, mine.bincount(minlength=case.experts_per_rank).int())
    result = sglang.combine_send(hidden, None, ids)
    sglang.combine_recv()
    ok.append(torch.equal(result[0][: x.shape[0]], want) and counted)
    return ok


def test_vllm_and_sglang_call_patterns(pool):
    for ok in pool.run(pe_client_calls, dataclasses.replace(BF16, world=pool.n, seed=21)):
        assert ok == [True, True]
