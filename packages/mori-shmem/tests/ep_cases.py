"""Test data and checks for mori.ops, shared by the CPU tests and the GPU scripts in ci/device/.

Every rank builds every rank's inputs from one seed, so a PE knows what its peers send. A round
returns, per PE, what the op produced; :func:`check_round` compares it with mori.ops._layout's
references: dispatch byte for byte (the set of received tokens, and each row, weight, scale and
top-k row at its slot), combine byte for byte (float32 sums in top-k order) or, for fp8 wires,
exactly as the reference rounds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from mori.ops._layout import reference_combine, reference_dispatch


@dataclass
class Case:
    world: int
    max_tokens: int
    hidden: int
    k: int
    experts_per_rank: int
    dtype: Any = torch.bfloat16
    scale_dim: int = 0
    scale_dtype: Any = torch.float32
    invalid: float = 0.1  # share of top-k entries made invalid (-1 or past the last expert)
    seed: int = 0
    combine_dtype: Any = None  # dtype of the expert outputs (default: dtype, or bf16 for fp8)
    full: bool = False  # every rank sends max_tokens tokens (fixed shapes, for CUDA graphs)
    hot: tuple[int, ...] = ()  # if given, every top-k id names an expert of one of these ranks


def rank_inputs(case: Case, rank: int, device: Any = "cpu") -> dict[str, Any]:
    """Rank ``rank``'s tokens, weights, scales and top-k ids (random, with repeated experts,
    repeated ranks and invalid ids); the same on every process for the same case."""
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    n = int(torch.randint(0, case.max_tokens + 1, (1,), generator=g))
    n = case.max_tokens if case.full else n
    experts = case.world * case.experts_per_rank
    ids = torch.randint(0, experts, (n, case.k), generator=g, dtype=torch.int64)
    if case.hot:  # hot experts: these ranks receive every token, the others none
        pick = torch.randint(0, len(case.hot), (n, case.k), generator=g)
        ids = torch.tensor(case.hot, dtype=torch.int64)[pick] * case.experts_per_rank + ids % case.experts_per_rank
    repeat = torch.rand(n, case.k, generator=g) < 0.2  # same expert as the entry before
    ids[:, 1:] = torch.where(repeat[:, 1:], ids[:, :-1], ids[:, 1:])
    bad = torch.rand(n, case.k, generator=g) < case.invalid
    junk = torch.where(
        torch.rand(n, case.k, generator=g) < 0.5,
        torch.full_like(ids, -1),
        experts + torch.randint(0, 7, (n, case.k), generator=g),
    )
    ids = torch.where(bad, junk, ids)
    x = torch.randn(n, case.hidden, generator=g) * 4
    out = {
        "input": x.to(case.dtype).to(device),
        "weights": torch.rand(n, case.k, generator=g).to(device),
        "indices": ids.to(torch.int32).to(device),
        "scales": None,
    }
    if case.scale_dim:
        out["scales"] = (torch.rand(n, case.scale_dim, generator=g) + 0.5).to(case.scale_dtype).to(device)
    return out


def combine_dtype(case: Case) -> Any:
    if case.combine_dtype is not None:
        return case.combine_dtype
    return torch.bfloat16 if case.dtype.itemsize == 1 else case.dtype


def expert_output(case: Case, received: Any, pe: int) -> Any:
    """What PE ``pe``'s "experts" return for its received rows: a deterministic function of the row
    and the PE, so that combine sums different values per destination."""
    out = combine_dtype(case)
    if out.itemsize == 1:  # fp8 sums stay below e4m3's 448, so the check is about rounding, not overflow
        return (received.to(torch.float32) * 0.25 + pe * 0.125).to(out)
    return (received.to(torch.float32) * (0.5 + pe) + pe).to(out)


def check_round(case: Case, results: list[dict[str, Any]], wire_dtype: Any = None) -> int:
    """Checks one dispatch + combine round; ``results[p]`` holds PE p's outputs as CPU tensors
    (``src_pos``, ``tokens``, ``weights``, ``scales``, ``indices``, ``total``, ``combine_in``,
    ``combined``, ``combined_weights`` and ``combine_weights``, the weights mode of
    :func:`pe_round`). Returns how many tokens were received in all."""
    world = case.world
    inputs = [rank_inputs(case, r) for r in range(world)]
    all_ids = [i["indices"] for i in inputs]
    max_send = world * case.max_tokens
    received = 0
    for p, res in enumerate(results):
        total = int(res["total"])
        src = [divmod(int(v), max_send) for v in res["src_pos"][:total].tolist()]
        assert sorted(src) == reference_dispatch(all_ids, case.experts_per_rank, p), f"PE {p}: received set"
        for s, (r, t) in enumerate(src):
            inp = inputs[r]
            assert torch.equal(res["tokens"][s].view(torch.uint8), inp["input"][t].view(torch.uint8)), (p, s)
            assert torch.equal(res["indices"][s], inp["indices"][t]), (p, s)
            assert torch.equal(res["weights"][s], inp["weights"][t]), (p, s)
            if case.scale_dim:
                assert torch.equal(res["scales"][s].view(torch.uint8), inp["scales"][t].view(torch.uint8)), (p, s)
        received += total
    src_pos = [res["src_pos"][: int(res["total"])] for res in results]
    stage = [res["combine_in"][: int(res["total"])] for res in results]
    for r, res in enumerate(results):
        n = inputs[r]["input"].shape[0]
        want = reference_combine(
            all_ids[r], r, case.experts_per_rank, stage, src_pos, max_send, combine_dtype(case), wire_dtype
        )
        got = res["combined"][:n]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
            f"PE {r}: combine differs in {(got.float() != want.float()).sum().item()} elements"
        )
        mode = res.get("combine_weights", "view")
        if mode == "none":
            assert res["combined_weights"] is None, f"PE {r}: combine without weights returned weights"
            continue
        # "empty": every PE gave weights with no rows, which count as zeros.
        w_stage = [res["weights"][: int(res["total"])] * (mode != "empty") for res in results]
        want_w = reference_combine(all_ids[r], r, case.experts_per_rank, w_stage, src_pos, max_send, torch.float32)
        got_w = res["combined_weights"][:n]
        assert torch.equal(got_w, want_w), (
            f"PE {r}: combined weights differ for {(got_w != want_w).any(dim=1).sum().item()} of {n} tokens"
        )
    return received


def same_outputs(case: Case, seeds: list[int], a: list[list[dict[str, Any]]], b: list[list[dict[str, Any]]]) -> None:
    """Two runs' outputs, PE by PE and round by round, byte for byte. A receiver's slots are handed
    out in the order senders reserve them, which no run fixes (IntraNode's own runs differ there),
    so dispatch outputs are compared token by token, ordered by source position; combine outputs
    over the PE's own tokens (the rows past them are the op's, left as they were)."""
    for pe, (ra, rb) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(ra, rb)):
            assert x["total"] == y["total"], (pe, i)
            order = [r["src_pos"][: r["total"]].argsort() for r in (x, y)]
            for key in ("src_pos", "tokens", "weights", "indices", "scales"):
                u, v = x[key], y[key]
                if u is None or v is None:
                    assert u is None and v is None, (pe, i, key)
                else:
                    assert torch.equal(u[order[0]].view(torch.uint8), v[order[1]].view(torch.uint8)), (pe, i, key)
            n = rank_inputs(dataclasses.replace(case, world=len(a), seed=seeds[i]), pe)["input"].shape[0]
            for key in ("combined", "combined_weights"):
                u, v = x[key], y[key]
                if u is None or v is None:
                    assert u is None and v is None, (pe, i, key)
                else:
                    assert torch.equal(u[:n].view(torch.uint8), v[:n].view(torch.uint8)), (pe, i, key)


def make_config(case: Case, rank: int, **overrides: Any) -> Any:
    """The op config of ``case`` for ``rank`` (IntraNode unless ``kernel_type`` is given)."""
    import mori.ops

    kw = dict(
        data_type=case.dtype,
        rank=rank,
        world_size=case.world,
        hidden_dim=case.hidden,
        scale_dim=case.scale_dim,
        scale_type_size=case.scale_dtype.itemsize if case.scale_dim else 0,
        max_token_type_size=max(case.dtype.itemsize, combine_dtype(case).itemsize),
        max_num_inp_token_per_rank=case.max_tokens,
        num_experts_per_rank=case.experts_per_rank,
        num_experts_per_token=case.k,
        warp_num_per_block=4,
        block_num=16,
    )
    kw.update(overrides)
    return mori.ops.EpDispatchCombineConfig(**kw)


#: How :func:`pe_round` passes weights to combine: dispatch's whole weights view, a copy of the
#: received rows only (no rows, data_ptr() 0 on the GPU, where nothing was received), a tensor of
#: no rows, or None.
COMBINE_WEIGHTS = ("view", "rows", "empty", "none")


def _refused(call: Any, *args: Any) -> str:
    """The message of the RuntimeError ``call(*args)`` raises ("no error" if it returns)."""
    try:
        call(*args)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def pe_round(
    case: Case,
    op: Any,
    device: Any = "cpu",
    split: bool = False,
    zero_copy: bool = False,
    combine_weights: str = "view",
    second_dispatch: bool = False,
    short_input: bool = False,
) -> dict[str, Any]:
    """One dispatch + combine on this PE (``split``: the AsyncLL send/recv calls; ``combine_weights``:
    one of :data:`COMBINE_WEIGHTS`; ``short_input``: combine is given the first half of the expert
    outputs only, the rows past it counting as zeros); CPU copies of everything :func:`check_round` needs.
    ``second_dispatch``: a second dispatch is tried before the combine (also between the AsyncLL send
    and recv), and what it raised is returned as ``refusals``."""
    rank = op.config.rank
    inp = rank_inputs(case, rank, device)
    args = (inp["input"], inp["weights"], inp["scales"], inp["indices"])
    refusals = []
    if split:
        tokens, weights, scales, indices, total = op.dispatch_send(*args)
        if second_dispatch:
            refusals.append(_refused(op.dispatch_send, *args))
        op.dispatch_recv()
    else:
        tokens, weights, scales, indices, total = op.dispatch(*args)
    if second_dispatch:
        refusals.append(_refused(op.dispatch_send if split else op.dispatch, *args))
    n = int(total.item())
    # Dispatch outputs are copied before combine: once this rank combined, its peers' next dispatch
    # may overwrite them.
    out = {
        "src_pos": op.get_dispatch_src_token_pos().cpu().clone(),
        "total": n,
        "tokens": tokens[:n].cpu().clone(),
        "weights": weights[:n].cpu().clone(),
        "indices": indices[:n].cpu().clone(),
        "scales": scales[:n].cpu().clone() if scales is not None else None,
    }
    y = expert_output(case, tokens[:n], rank)
    if zero_copy:
        buf = op.get_registered_combine_input_buffer(y.dtype, case.hidden)
        buf[:n].copy_(y)
        y = buf
    kwargs = {"use_external_inp_buf": 0} if zero_copy else {}
    given = y[: n // 2] if short_input else y
    w = {
        "view": weights,
        "rows": weights[:n].clone(),
        "none": None,
        "empty": torch.empty(0, case.k, dtype=torch.float32, device=weights.device),
    }[combine_weights]
    if split:
        combined, combined_w = op.combine_send(given, w, inp["indices"])
        op.combine_recv()
    else:
        combined, combined_w = op.combine(given, w, inp["indices"], **kwargs)
    staged = y[:n].cpu().clone()
    staged[given.shape[0] :] = 0  # what combine counts the rows past its input as
    out.update(
        combine_in=staged,
        combined=combined.cpu().clone(),
        combine_weights=combine_weights,
        refusals=refusals,
        combined_weights=combined_w.cpu().clone() if combined_w is not None else None,
    )
    return out
