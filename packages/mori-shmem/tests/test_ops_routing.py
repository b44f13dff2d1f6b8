"""mori.ops' routing handles and MORI's standard-MoE layout on the CPU heap, real PE processes,
every result checked against a PyTorch reference computed here (and mori.ops._layout's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from ep_cases import Case, expert_output, make_config, rank_inputs
from pe_pool import PeError
from test_ops_cpu import BF16

import mori.shmem as shmem
from mori.ops._layout import reference_combine, reference_dispatch

_ops: dict[Any, Any] = {}


def _op(case: Case, slot: int = 0, **overrides: Any) -> Any:
    """The op of ``case`` (``slot`` tells apart several ops of one case)."""
    import mori.ops

    key = repr((dataclasses.replace(case, seed=0), slot, sorted(overrides.items())))
    if key not in _ops:
        _ops[key] = mori.ops.EpDispatchCombineOp(make_config(case, shmem.shmem_mype(), **overrides))
    return _ops[key]


def _received(op: Any, out: tuple[Any, ...], n: int) -> dict[str, Any]:
    return {"src_pos": op.get_dispatch_src_token_pos().cpu().clone(), "tokens": out[0][:n].cpu().clone(), "total": n}


def _check_dispatch(case: Case, rank: int, got: dict[str, Any], inputs: list[Any]) -> None:
    """The rows this rank received are the reference set, each the sender's token byte for byte."""
    all_ids = [inputs_r["indices"] for inputs_r in inputs]
    max_send = case.world * case.max_tokens
    src = [divmod(int(v), max_send) for v in got["src_pos"][: got["total"]].tolist()]
    assert sorted(src) == reference_dispatch(all_ids, case.experts_per_rank, rank)
    for s, (r, t) in enumerate(src):
        assert torch.equal(got["tokens"][s], inputs[r]["input"][t]), (rank, s)


def pe_routing_rounds(
    case: Case, kernel: str, device: str = "cpu", replay: bool = True, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """MORI's routing-handle checks on one PE: parity with a plain round on another op, two
    dispatches in flight combined each with its handle, and (``replay``) a replay with new
    payloads, then one with the first payloads again. ``overrides``: more config fields
    (``gpu_per_node``). CPU copies of the results."""
    from mori.ops import EpDispatchCombineKernelType

    kt = EpDispatchCombineKernelType[kernel]
    rank = shmem.shmem_mype()
    fields = {**(overrides or {}), "kernel_type": kt}
    a, b = _op(case, 0, **fields), _op(case, 1, **fields)
    inp = rank_inputs(case, rank, device)
    x, w, ids = inp["input"], inp["weights"], inp["indices"]
    result: dict[str, Any] = {}
    # Parity: a plain round on op a, a routed round on op b.
    out = a.dispatch(x, w, None, ids)
    n = int(out[4].item())
    plain, _ = a.combine(expert_output(case, out[0][:n], rank), None, ids)
    result["plain"] = plain[: x.shape[0]].cpu().clone()
    out = b.dispatch(x, w, None, ids, return_routing=True)
    handle = out[5]
    n = int(out[4].item())
    result["first"] = _received(b, out, n)
    result["first"]["weights"], result["first"]["indices"] = out[1][:n].cpu().clone(), out[3][:n].cpu().clone()
    y0 = expert_output(case, out[0][:n], rank)
    # A second routed dispatch (other payloads, other routing) before the first one's combine.
    second = dataclasses.replace(case, seed=case.seed + 1)
    inp1 = rank_inputs(second, rank, device)
    out1 = b.dispatch(inp1["input"], inp1["weights"], None, inp1["indices"], return_routing=True)
    n1 = int(out1[4].item())
    result["second"] = _received(b, out1, n1)
    y1 = expert_output(second, out1[0][:n1], rank)
    w1 = out1[1][:n1].clone()
    routed, _ = b.combine(y0, None, ids, routing=handle)
    result["routed"] = routed[: x.shape[0]].cpu().clone()
    routed1, routed1_w = b.combine(y1, w1, inp1["indices"], routing=out1[5])
    result["second_combined"] = routed1[: inp1["input"].shape[0]].cpu().clone()
    result["second_weights"] = (w1.cpu(), routed1_w[: inp1["input"].shape[0]].cpu().clone())
    result["combine_in"], result["combine_in1"] = y0.cpu(), y1.cpu()
    if not replay:
        return result
    # Replay the first routing with new payloads: same slots, the handle unchanged.
    before = [t.clone() for t in handle.tensors()]
    x2 = (x.float() * -3 + 1).to(x.dtype)
    out2 = b.dispatch(x2, w, None, ids, routing=handle)
    result["replay_total"] = int(out2[4].item())
    result["replay_rows"] = out2[0][: result["replay_total"]].cpu().clone()
    result["handle_unchanged"] = all(torch.equal(u, v) for u, v in zip(before, handle.tensors()))
    y2 = expert_output(case, out2[0][: result["replay_total"]], rank)
    replayed, _ = b.combine(y2, None, ids, routing=handle)
    result["replayed"], result["combine_in2"] = replayed[: x.shape[0]].cpu().clone(), y2.cpu()
    result["x2"] = x2.cpu()
    # Replayed with the first payloads: every output row as the first dispatch's, byte for byte.
    out3 = b.dispatch(x, w, None, ids, routing=handle)
    n3 = int(out3[4].item())
    result["replay_again"] = _received(b, out3, n3)
    result["replay_again"]["weights"] = out3[1][:n3].cpu().clone()
    result["replay_again"]["indices"] = out3[3][:n3].cpu().clone()
    b.combine(y0, None, ids, routing=handle)
    return result


@pytest.mark.parametrize("kernel", ["IntraNode", "InterNodeV1"])
def test_routing_handles(pool, kernel):
    case = dataclasses.replace(BF16, world=pool.n, seed=61)
    check_routing_results(case, pool.run(pe_routing_rounds, case, kernel))


def check_routing_results(case: Case, results: list[dict[str, Any]], replay: bool = True) -> None:
    """pe_routing_rounds' results of every PE against the references."""
    second = dataclasses.replace(case, seed=case.seed + 1)
    inputs = [rank_inputs(case, r) for r in range(case.world)]
    inputs1 = [rank_inputs(second, r) for r in range(case.world)]
    max_send = case.world * case.max_tokens
    src = [res["first"]["src_pos"][: res["first"]["total"]] for res in results]
    src1 = [res["second"]["src_pos"][: res["second"]["total"]] for res in results]
    for r, res in enumerate(results):
        _check_dispatch(case, r, res["first"], inputs)
        _check_dispatch(second, r, res["second"], inputs1)
        want = reference_combine(
            inputs[r]["indices"],
            r,
            case.experts_per_rank,
            [x["combine_in"] for x in results],
            src,
            max_send,
            torch.bfloat16,
        )
        assert torch.equal(res["routed"], want), f"PE {r}: combine along the first handle"
        assert torch.equal(res["plain"], want), f"PE {r}: the plain round differs from the routed one"
        want1 = reference_combine(
            inputs1[r]["indices"],
            r,
            case.experts_per_rank,
            [x["combine_in1"] for x in results],
            src1,
            max_send,
            torch.bfloat16,
        )
        assert torch.equal(res["second_combined"], want1), f"PE {r}: combine along the second handle"
        want_w = reference_combine(
            inputs1[r]["indices"],
            r,
            case.experts_per_rank,
            [x["second_weights"][0] for x in results],
            src1,
            max_send,
            torch.float32,
        )
        assert torch.equal(res["second_weights"][1], want_w)
        if not replay:
            continue
        # Replay: the same slots, now holding the new payloads of the same source tokens.
        assert res["handle_unchanged"] and res["replay_total"] == res["first"]["total"]
        for s, pos in enumerate(src[r].tolist()):
            sr, st = divmod(pos, max_send)
            assert torch.equal(res["replay_rows"][s], results[sr]["x2"][st]), (r, s)
        want2 = reference_combine(
            inputs[r]["indices"],
            r,
            case.experts_per_rank,
            [x["combine_in2"] for x in results],
            src,
            max_send,
            torch.bfloat16,
        )
        assert torch.equal(res["replayed"], want2), f"PE {r}: combine after the replay"
        again, first = res["replay_again"], res["first"]
        for name in ("total", "src_pos", "tokens", "weights", "indices"):
            assert _same(again[name], first[name]), f"PE {r}: replayed with the first payloads, {name} differs"


def _same(a: Any, b: Any) -> bool:
    return a == b if isinstance(a, int) else torch.equal(a, b)


def _rerouted(indices: Any, experts_per_rank: int, world: int) -> Any:
    """``indices`` with token 0 sent elsewhere: its valid ids moved to the next rank's experts (or,
    with none valid, its first id made valid)."""
    ids = indices.clone()
    row = ids[0]
    valid = (row >= 0) & (row < experts_per_rank * world)
    if bool(valid.any()):
        row[valid] = (row[valid] + experts_per_rank) % (experts_per_rank * world)
    else:
        row[0] = 0
    return ids


def pe_routing_refusals(case: Case, device: str = "cpu", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the op refuses around routing handles (every refusal before anything is sent), and
    whether the received rows were left as they were."""
    from mori.ops import EpDispatchCombineKernelType

    rank = shmem.shmem_mype()
    inp = rank_inputs(case, rank, device)
    args = (inp["input"], inp["weights"], None, inp["indices"])
    errors = []
    op = _op(case, 0, **(overrides or {}))
    out = op.dispatch(*args, return_routing=True)
    handle = out[5]
    n = int(out[4].item())
    before = out[0][:n].cpu().clone()
    low_latency = {**(overrides or {}), "kernel_type": EpDispatchCombineKernelType.InterNodeV1LL}
    rerouted = _rerouted(inp["indices"], case.experts_per_rank, case.world)
    for call in (
        lambda: op.dispatch(*args, routing=handle, return_routing=True),
        lambda: op.dispatch(inp["input"][:0], None, None, inp["indices"][:0], routing=handle),
        lambda: _op(case, 0, **low_latency).dispatch(*args, return_routing=True),
        lambda: op.dispatch(inp["input"] * 2, inp["weights"], None, rerouted, routing=handle),
    ):
        try:
            call()
        except (ValueError, NotImplementedError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    unchanged = torch.equal(out[0][:n].cpu(), before)
    op.combine(out[0][:n].clone(), None, inp["indices"], routing=handle)
    return {"errors": errors, "unchanged": unchanged}


def check_routing_refusals(results: list[dict[str, Any]]) -> None:
    for res in results:
        errors = res["errors"]
        assert len(errors) == 4, errors
        assert errors[0].startswith("ValueError: pass either `routing=` (replay) or `return_routing=True`")
        assert errors[1].startswith("ValueError: replay dispatch input has 0 tokens")
        assert errors[2].startswith(
            "NotImplementedError: routing handle path not supported for kernel_type=InterNodeV1LL"
        )
        assert errors[3].startswith("ValueError: replay dispatch: indices route differently"), errors[3]
        assert res["unchanged"], "a refused replay changed the received rows"


def test_routing_refusals(pool):
    case = dataclasses.replace(BF16, world=pool.n, seed=63, full=True)
    check_routing_refusals(pool.run(pe_routing_refusals, case))


# ---- the standard-MoE layout ----------------------------------------------------------------------
def pe_standard_moe(case: Case, overrides: dict[str, Any], device: str = "cpu") -> list[dict[str, Any]]:
    """Two passes: dispatch_standard_moe, experts on the packed layout, combine_standard_moe; then a
    plain dispatch through convert_dispatch_output / convert_combine_input and combine, with
    launch_local_expert_count on its outputs."""
    import mori.ops

    op = _op(case, 0, **overrides)
    rank = op.config.rank
    inp = rank_inputs(case, rank, device)
    x, w, ids = inp["input"], inp["weights"], inp["indices"]
    passes = []
    for convert in (False, True):
        if convert:
            d = op.dispatch(x, w, None, ids)
            counted = torch.full((case.experts_per_rank,), 99, dtype=torch.int32, device=device)
            mori.ops.launch_local_expert_count(
                op.config, int(d[3].data_ptr()), int(d[4].data_ptr()), int(counted.data_ptr())
            )
            packed, count, src_info, layout = op.convert_dispatch_output(d[0], d[3])
        else:
            packed, count, src_info, layout = op.dispatch_standard_moe(x, w, None, ids)
            counted = count
        res: dict[str, Any] = {
            "count": count.cpu().clone(),
            "counted": counted.cpu().clone(),
            "src_info": src_info.cpu().clone(),
            "packed": packed.cpu().clone(),
            "layout": layout.cpu().clone(),
            "src_pos": op.get_dispatch_src_token_pos().cpu().clone(),
        }
        res["total"] = int(res["src_pos"].numel())
        # Each expert scales its rows by (expert + 1) / 2, then adds the rank.
        gain = (torch.arange(packed.shape[0], dtype=torch.float32, device=device)[:, None, None] + 1) / 2
        expert_out = (packed.float() * gain + rank).to(packed.dtype)
        if convert:
            rows = op.convert_combine_input(expert_out, src_info, layout)
            res["count_after"] = int(count.sum().item())  # convert_combine_input resets the counts
            out, out_w = op.combine(rows, None, ids)
        else:
            out, out_w = op.combine_standard_moe(expert_out, None, ids)
            res["count_after"] = 0
        res.update(combined=out[: x.shape[0]].cpu().clone(), out_w=out_w, expert_out=expert_out.cpu())
        passes.append(res)
    return passes


def test_standard_moe_layout(pool):
    check_standard_moe(pool)


def check_standard_moe(pool: Any, **overrides: Any) -> None:
    """Both passes of pe_standard_moe on every PE of ``pool``, checked."""
    case = dataclasses.replace(BF16, world=pool.n, seed=71)
    check_standard_moe_results(case, pool.run(pe_standard_moe, case, overrides))


def check_standard_moe_results(case: Case, results: list[list[dict[str, Any]]]) -> None:
    """pe_standard_moe's passes on every PE against the reference packing and sums."""
    world = case.world
    inputs = [rank_inputs(case, r) for r in range(world)]
    epr = case.experts_per_rank
    max_send = world * case.max_tokens
    for p in range(2):
        stage = []
        for r, per_pe in enumerate(results):
            res = per_pe[p]
            assert res["packed"].shape == (epr, max_send, case.hidden) and res["layout"].numel() == 0
            src = [divmod(int(v), max_send) for v in res["src_pos"].tolist()]
            # Reference packing: received rows in order, once per top-k entry naming a local expert.
            ids = [e - r * epr for sr, st in src for e in inputs[sr]["indices"][st].tolist()]
            want = [ids.count(le) for le in range(epr)]
            assert res["count"].tolist() == want and res["counted"].tolist() == want, (p, r)
            assert res["count_after"] == 0
            # Each (received row, top-k entry) of a local expert at the expert's next place.
            place = [0] * epr
            slot_of: dict[tuple[int, int], int] = {}
            for s, (sr, st) in enumerate(src):
                for j, e in enumerate(inputs[sr]["indices"][st].tolist()):
                    le = e - r * epr
                    if 0 <= le < epr:
                        i = slot_of[(s, j)] = place[le]
                        place[le] += 1
                        assert int(res["src_info"][le, i]) == sr * max_send + st
                        assert torch.equal(res["packed"][le, i], inputs[sr]["input"][st])
            # Combine input per received row: its entries' outputs times their weights, in top-k order.
            acc = torch.zeros(res["total"], case.hidden)
            for s, (sr, st) in enumerate(src):
                for j, e in enumerate(inputs[sr]["indices"][st].tolist()):
                    if (s, j) in slot_of:
                        acc[s] = (
                            acc[s]
                            + res["expert_out"][e - r * epr, slot_of[(s, j)]].float() * inputs[sr]["weights"][st, j]
                        )
            stage.append(acc.to(torch.bfloat16))
        src_pos = [per_pe[p]["src_pos"] for per_pe in results]
        for r, per_pe in enumerate(results):
            want_out = reference_combine(inputs[r]["indices"], r, epr, stage, src_pos, max_send, torch.bfloat16)
            assert torch.equal(per_pe[p]["combined"], want_out), f"pass {p}, PE {r}"
            assert per_pe[p]["out_w"] is None


def pe_warmup() -> Any:
    import mori.ops

    return mori.ops.warmup_jit_kernels(mori.ops.EpDispatchCombineKernelType.AsyncLL)


def test_warmup_jit_kernels_on_cpu(pool):
    import mori.ops

    assert pool.run(pe_warmup) == [None] * pool.n
    with pytest.raises(ValueError, match="is not an EpDispatchCombineKernelType"):
        mori.ops.warmup_jit_kernels(17)


def test_standard_moe_refused_without_dispatch(pool):
    with pytest.raises(PeError, match="convert_combine_input needs a dispatch awaiting its combine"):
        pool.run(pe_convert_without_dispatch, dataclasses.replace(BF16, world=pool.n))


def pe_convert_without_dispatch(case: Case) -> None:
    op = _op(case, 0)
    op.convert_combine_input(
        torch.zeros(case.experts_per_rank, op.max_num_tokens_to_send(), case.hidden, dtype=torch.bfloat16), None, None
    )


def test_a_handle_across_nodes_keeps_the_proxy_side_of_its_round():
    """The GPU heap's handle plumbing across nodes (_handles.py), on host tensors: a dispatch's
    return map and return rows go into the handle; a replay or a combine along it puts them back;
    a dispatch making a new handle starts them afresh; a handle without them is refused."""
    from types import SimpleNamespace

    from mori.ops._buffers import CONTROL, CONTROL_WORDS
    from mori.ops._handles import HandleRouting
    from mori.ops._internode import InterNodeBuffers, node_plan, return_map_size

    case = dataclasses.replace(BF16, world=4, max_tokens=3, k=2)
    cfg = make_config(case, 1, gpu_per_node=2)
    plan = node_plan(cfg, range(4))
    max_send = max_recv = case.world * case.max_tokens  # no max_total_recv_tokens: the same

    def ints(n: int, value: int = 0) -> Any:
        return torch.full((n,), value, dtype=torch.int32)

    bufs = SimpleNamespace(
        dest_map=ints(case.max_tokens * case.k), disp_src_pos=ints(max_recv), control=ints(CONTROL_WORDS)
    )
    inter = InterNodeBuffers(*(ints(1) for _ in range(4)), ret_map=ints(return_map_size(cfg, plan), -1))
    routing = HandleRouting(cfg, bufs, max_recv, "cpu", inter, plan)  # type: ignore[arg-type]
    rows = bufs.control[CONTROL["EP_RETURN_ROWS"] : CONTROL["EP_RETURN_ROWS"] + plan.nodes]
    # A dispatch of 2 tokens: entry (0, 0) to PE 1 slot 4, (1, 1) to PE 3's node, its combine row 0;
    # as proxy of node 1 this PE forwarded row 0 and 1 of that node to PE 0 slots 5 and 6.
    bufs.dest_map[:4] = torch.tensor([1 * max_send + 4, -1, -1, 3 * max_send + 0])
    inter.ret_map[plan.size * case.max_tokens + 0 : plan.size * case.max_tokens + 2] = torch.tensor([5, 6])
    rows[1] = 2
    handle = routing.allocate()
    routing.snapshot(handle, 2, torch.tensor([7], dtype=torch.int32))
    assert torch.equal(handle.inter_node_disp_dest_tok_id_map, inter.ret_map)
    assert handle.inter_node_disp_send_map.tolist() == [0, 2] and int(handle.total_recv_token_num) == 7
    # A later dispatch making a new handle: the proxy side starts afresh.
    bufs.dest_map.fill_(9)
    routing.restore(None)
    assert bool((inter.ret_map == -1).all()) and rows.tolist() == [0, 0]
    # A replay (or a combine) along the first handle: its routing back where the kernels read it.
    routing.restore(handle)
    assert torch.equal(bufs.dest_map[:4], handle.disp_dest_tok_id_map[:4])
    assert torch.equal(inter.ret_map, handle.inter_node_disp_dest_tok_id_map) and rows.tolist() == [0, 2]
    assert routing.check(handle) == 2
    mori_style = mori_handle_without_inter_node_maps(handle)
    with pytest.raises(
        ValueError, match=r"routing.inter_node_disp_dest_tok_id_map must be an int32 tensor of at least"
    ):
        routing.check(mori_style)


def mori_handle_without_inter_node_maps(handle: Any) -> Any:
    from mori.ops import EpDispatchRoutingHandle

    dest, _, _, total, src = handle.tensors()
    empty = torch.zeros(0, dtype=torch.int32)
    return EpDispatchRoutingHandle.from_tensors((dest, empty, empty, total, src), cur_rank_num_token=2)
