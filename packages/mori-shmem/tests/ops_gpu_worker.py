"""mori.ops on GPUs, one PE per process under torchrun (any GPU count: PEs may share a GPU).

Each case runs several dispatch + combine rounds with new random routings (repeated calls on one
op), gathers every PE's outputs on rank 0 and checks them there against the PyTorch reference
(ep_cases.check_round: byte for byte; fp8 wires as the reference rounds them). Then CUDA-graph
replays with new tokens, then the port of MORI's EP checker. Prints one "ok" line per check.
``MORI_OPS_CHECKS`` picks what runs: ``all`` (the default: the cases and the checker), ``checker``,
``edge`` (hot experts, refused second dispatches), ``internode`` (InterNodeV1, InterNodeV1LL and
AsyncLL with several ``gpu_per_node`` splits, byte for byte against IntraNode), ``surface`` (the
blockwise quantizations, fp8 e4m3fnuz / fp4 combine input, routing handles, the standard-MoE layout,
AUTO launch geometry: ops_gpu_surface.py) or ``graph_double_dispatch`` (ends the process).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from ep_cases import Case, check_round, expert_output, make_config, pe_round, rank_inputs, same_outputs
from gpu_world import init_world  # ci/device, on PYTHONPATH (test_gpu._torchrun)

import mori


def gather(obj: dict[str, Any]) -> list[Any] | None:
    """Every PE's results on rank 0. Tensors travel as uint8 bytes with their dtype (torch cannot
    unpickle float8 storages)."""
    packed = {k: (v.view(torch.uint8), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in obj.items()}
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(packed, out, dst=0)
    if out is None:
        return None
    return [{k: v[0].view(v[1]) if isinstance(v, tuple) else v for k, v in o.items()} for o in out]


def report(
    rank: int, what: str, results: list[Any] | None, case: Case, wire: Any = None, keep_going: bool = False
) -> bool:
    """Rank 0 checks a round and prints ok / FAILED; a failure raises unless ``keep_going``.
    Returns whether the round passed (on every rank)."""
    ok = True
    if rank == 0:
        assert results is not None
        try:
            n = check_round(case, results, wire)
            refused = [m for r in results for m in r.get("refusals", [])]
            assert all(
                m.startswith(("dispatch called twice", "dispatch: called after a dispatch_send")) for m in refused
            ), f"second dispatches: {refused}"
        except AssertionError as exc:
            print(f"FAILED  {what}: {exc}", flush=True)
            if not keep_going:
                raise
            ok = False
        else:
            print(
                f"ok  {what}: {n} tokens received in all"
                + (f", {len(refused)} second dispatches refused" if refused else ""),
                flush=True,
            )
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def rounds(
    rank: int,
    world: int,
    name: str,
    case: Case,
    seeds: list[int],
    split: bool = False,
    zero_copy: bool = False,
    wire: Any = None,
    keep_going: bool = False,
    combine_weights: str | list[str] = "view",
    second_dispatch: bool = False,
    short_input: bool = False,
    **overrides: Any,
) -> bool:
    """Rounds of ``case`` on one op, one per seed (``combine_weights``: one mode, or one per seed)."""
    op = mori.ops.EpDispatchCombineOp(make_config(case, rank, **overrides))
    modes = [combine_weights] * len(seeds) if isinstance(combine_weights, str) else combine_weights
    ok = True
    for seed, mode in zip(seeds, modes, strict=True):
        c = dataclasses.replace(case, seed=seed)
        res = pe_round(
            c,
            op,
            "cuda",
            split=split,
            zero_copy=zero_copy,
            combine_weights=mode,
            second_dispatch=second_dispatch,
            short_input=short_input,
        )
        ok = report(rank, f"{name} seed {seed}", gather(res), c, wire, keep_going) and ok
    return ok


def graph_rounds(
    rank: int, world: int, case: Case, seeds: list[int], name: str = "CUDA graph replay", **overrides: Any
) -> None:
    """Captures dispatch + experts + combine once, then replays it with each seed's tokens."""
    op = mori.ops.EpDispatchCombineOp(make_config(case, rank, **overrides))
    first = rank_inputs(dataclasses.replace(case, seed=seeds[0]), rank, "cuda")
    static = {k: v.clone() for k, v in first.items() if v is not None}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        tokens, weights, _, indices, total = op.dispatch(static["input"], static["weights"], None, static["indices"])
        y = expert_output(case, tokens, rank)
        combined, combined_w = op.combine(y, weights, static["indices"])
    for seed in seeds:
        c = dataclasses.replace(case, seed=seed)
        for k, v in rank_inputs(c, rank, "cuda").items():
            if v is not None:
                static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        n = int(total.item())
        res = {
            "src_pos": op.get_dispatch_src_token_pos().cpu().clone(),
            "total": n,
            "tokens": tokens[:n].cpu(),
            "weights": weights[:n].cpu(),
            "indices": indices[:n].cpu(),
            "scales": None,
            "combine_in": y[:n].cpu(),
            "combined": combined.cpu(),
            "combined_weights": combined_w.cpu(),
        }
        dist.barrier()  # every PE read its outputs before any replays the next round
        report(rank, f"{name}, seed {seed}", gather(res), c)


def edge_cases(rank: int, world: int) -> None:
    """Hot experts (ranks that receive every token, up to world_size * max_num_inp_token_per_rank
    rows, and ranks that receive none and combine empty expert outputs), and second dispatches
    refused before their combine. Every case runs; the failures are counted at the end."""
    hot = Case(world=world, max_tokens=64, hidden=7168, k=8, experts_per_rank=4, invalid=0.0, full=True, hot=(0,))
    last, mid = dataclasses.replace(hot, hot=(world - 1,)), dataclasses.replace(hot, hot=(world // 2,))
    mixed = Case(world=world, max_tokens=48, hidden=1024, k=8, experts_per_rank=max(1, 256 // world), invalid=0.1)
    async_ll = mori.ops.EpDispatchCombineKernelType.AsyncLL
    results = [
        rounds(
            rank,
            world,
            "hot rank 0 (bf16, hidden 7168, top-8, 64 tokens/rank), combine weights = received rows",
            hot,
            [31, 32],
            keep_going=True,
            combine_weights="rows",
        ),
        rounds(
            rank,
            world,
            "hot last rank, AsyncLL send/recv, combine weights = received rows",
            last,
            [33],
            keep_going=True,
            combine_weights="rows",
            split=True,
            kernel_type=async_ll,
        ),
        rounds(
            rank,
            world,
            "hot middle rank, combine weights = received rows, then with no rows (zeros)",
            mid,
            [34, 39],
            keep_going=True,
            combine_weights=["rows", "empty"],
        ),
        rounds(
            rank,
            world,
            "hot rank 0, fp8_direct_cast combine, combine weights = received rows",
            hot,
            [35],
            keep_going=True,
            wire=torch.float8_e4m3fn,
            combine_weights="rows",
            quant_type="fp8_direct_cast",
        ),
        rounds(
            rank,
            world,
            "hot ranks 0 and last, no combine weights",
            dataclasses.replace(hot, hot=(0, world - 1)),
            [36],
            keep_going=True,
            combine_weights="none",
        ),
        rounds(
            rank,
            world,
            "second dispatch before the combine refused, then the round completes",
            mixed,
            [37],
            keep_going=True,
            second_dispatch=True,
        ),
        rounds(
            rank,
            world,
            "second AsyncLL dispatch_send refused (before and after dispatch_recv)",
            mixed,
            [38],
            keep_going=True,
            second_dispatch=True,
            split=True,
            kernel_type=async_ll,
        ),
    ]
    if not all(results):
        raise AssertionError(f"{results.count(False)} of {len(results)} edge cases failed")


def graph_double_dispatch(rank: int, world: int) -> None:
    """A CUDA graph of dispatch alone and one of combine: replayed in turn they make a correct round;
    the dispatch graph replayed twice in a row (which no host check can see) must stop on the
    device with a message. The context is unusable after that, so the process ends here."""
    import ctypes

    case = Case(world=world, max_tokens=32, hidden=1024, k=8, experts_per_rank=max(1, 256 // world), full=True, seed=40)
    op = mori.ops.EpDispatchCombineOp(make_config(case, rank))
    static = {k: v.clone() for k, v in rank_inputs(case, rank, "cuda").items() if v is not None}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dispatch, stream=stream):
        tokens, weights, _, indices, total = op.dispatch(static["input"], static["weights"], None, static["indices"])
    with torch.cuda.graph(g_combine, stream=stream):
        y = expert_output(case, tokens, rank)
        combined, combined_w = op.combine(y, weights, static["indices"])
    g_dispatch.replay()
    g_combine.replay()
    torch.cuda.synchronize()
    n = int(total.item())
    res = {
        "src_pos": op.get_dispatch_src_token_pos().cpu().clone(),
        "total": n,
        "tokens": tokens[:n].cpu(),
        "weights": weights[:n].cpu(),
        "indices": indices[:n].cpu(),
        "scales": None,
        "combine_in": y[:n].cpu(),
        "combined": combined.cpu(),
        "combined_weights": combined_w.cpu(),
    }
    report(rank, "dispatch and combine as two CUDA graphs", gather(res), case)
    try:  # under MPS a peer's trap may reach this PE first, at any CUDA call
        g_dispatch.replay()
        g_dispatch.replay()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        print(
            f"ok  rank {rank}: dispatch graph replayed twice stopped on the device: {exc}".splitlines()[0], flush=True
        )
        ctypes.CDLL(None).fflush(None)  # the device's printf output, written through C stdio
        os._exit(0)
    raise AssertionError(f"rank {rank}: the dispatch graph replayed twice without a combine ran without an error")


def internode_cases(world: int) -> list[tuple[str, Case, list[int], dict[str, Any]]]:
    """(name, case, seeds, pe_round / config options) of the inter-node comparison: the CPU tests'
    edge cases (random, repeated and invalid ids, ranks receiving nothing, one rank receiving every
    token), fp8 with scales, bf16 and fp8 combine wires, zero copy."""
    bf16 = Case(world=world, max_tokens=48, hidden=1024, k=8, experts_per_rank=max(1, 256 // world), invalid=0.1)
    hot = Case(world=world, max_tokens=32, hidden=7168, k=8, experts_per_rank=4, invalid=0.0, full=True, hot=(0,))
    return [
        ("bf16", bf16, [1, 2], {}),
        ("bf16 top-7, 30% invalid ids", dataclasses.replace(bf16, k=7, invalid=0.3), [3], {}),
        ("every id invalid (no rank receives)", dataclasses.replace(bf16, invalid=1.0), [4], {}),
        ("fp8 e4m3 + per-128 fp32 scales", dataclasses.replace(bf16, dtype=torch.float8_e4m3fn, scale_dim=8), [5], {}),
        ("hot rank 0 (hidden 7168), combine weights = received rows", hot, [6], {"combine_weights": "rows"}),
        (
            "hot last rank, combine weights with no rows",
            dataclasses.replace(hot, hot=(world - 1,)),
            [7],
            {"combine_weights": "empty"},
        ),
        (
            "hot ranks 0 and last, no combine weights",
            dataclasses.replace(hot, hot=(0, world - 1)),
            [8],
            {"combine_weights": "none"},
        ),
        ("bf16 fp8_direct_cast combine", bf16, [9], {"quant_type": "fp8_direct_cast"}),
        ("bf16 zero-copy combine", bf16, [10], {"zero_copy": True, "use_external_inp_buf": False}),
    ]


def _round_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` split into pe_round's keywords and config overrides."""
    round_keys = ("combine_weights", "zero_copy")
    return (
        {k: v for k, v in options.items() if k in round_keys},
        {k: v for k, v in options.items() if k not in round_keys},
    )


def internode(rank: int, world: int) -> None:
    """InterNodeV1 and InterNodeV1LL with each ``gpu_per_node`` split of the world into two or more
    nodes: every round checked against the reference and byte for byte against IntraNode's round
    with the same inputs; then CUDA-graph replays; then InterNodeV1's routing handles (caching,
    two dispatches in flight, replays, refusals) against the references. PEs of other nodes are reached through the device
    API's put-with-signal (a copy where their heap is mapped, the remote transport where not)."""
    kinds = [
        mori.ops.EpDispatchCombineKernelType.InterNodeV1,
        mori.ops.EpDispatchCombineKernelType.InterNodeV1LL,
        mori.ops.EpDispatchCombineKernelType.AsyncLL,
    ]
    p2p = os.environ.get("MORI_DISABLE_P2P", "").upper() not in ("1", "ON", "TRUE", "YES")
    sizes = [g for g in (world // 2, world // 4) if g >= 1 and p2p] or [1]
    # IntraNode needs every PE mapped: through the proxy (MORI_DISABLE_P2P), or with PEs on two
    # hosts, its rounds come from the file an earlier run with P2P on one host wrote
    # (MORI_OPS_INTRA_REFERENCE; checks "intra_reference").
    saving = os.environ.get("MORI_OPS_CHECKS") == "intra_reference"
    reference = os.environ.get("MORI_OPS_INTRA_REFERENCE", "")
    if not p2p and not reference:
        raise RuntimeError(
            "with MORI_DISABLE_P2P the inter-node check compares against IntraNode rounds "
            "saved by a P2P run: set MORI_OPS_INTRA_REFERENCE (see test_ops_gpu.py)"
        )
    from_file = bool(reference) and not saving
    intra: dict[tuple[str, int], Any] = _load_intra(reference) if from_file and rank == 0 else {}
    for name, case, seeds, options in internode_cases(world) if not from_file else []:
        round_kw, overrides = _round_options(options)
        op = mori.ops.EpDispatchCombineOp(make_config(case, rank, **overrides))
        for seed in seeds:
            intra[name, seed] = gather(pe_round(dataclasses.replace(case, seed=seed), op, "cuda", **round_kw))
    if saving:
        if rank == 0:
            _save_intra(reference, intra)
            print(f"ok  IntraNode rounds of the inter-node cases saved to {reference}", flush=True)
        return
    failed = 0
    for kind in kinds:
        for g in sizes:
            for name, case, seeds, options in internode_cases(world):
                round_kw, overrides = _round_options(options)
                # AsyncLL between nodes: its send and recv halves (the waits for other nodes in recv).
                round_kw["split"] = kind == mori.ops.EpDispatchCombineKernelType.AsyncLL
                wire = torch.float8_e4m3fn if overrides.get("quant_type") == "fp8_direct_cast" else None
                op = mori.ops.EpDispatchCombineOp(
                    make_config(case, rank, kernel_type=kind, gpu_per_node=g, **overrides)
                )
                for seed in seeds:
                    c = dataclasses.replace(case, seed=seed)
                    res = gather(pe_round(c, op, "cuda", **round_kw))
                    what = f"{kind.name} gpu_per_node={g} ({world // g} nodes) {name} seed {seed}"
                    ok = report(rank, what, res, c, wire, keep_going=True)
                    if rank != 0:
                        continue
                    try:
                        assert ok, "the reference check failed"
                        same_outputs(case, [seed], [[r] for r in res], [[r] for r in intra[name, seed]])
                        print(f"ok  {what}: byte for byte as IntraNode", flush=True)
                    except AssertionError as exc:
                        print(f"FAILED  {what}: not as IntraNode: {exc}", flush=True)
                        failed += 1
            graph_rounds(
                rank,
                world,
                Case(world=world, max_tokens=48, hidden=1024, k=8, experts_per_rank=max(1, 256 // world), full=True),
                [15, 16],
                f"{kind.name} gpu_per_node={g} CUDA graph replay",
                kernel_type=kind,
                gpu_per_node=g,
            )
    flag = [failed]
    dist.broadcast_object_list(flag, src=0)
    if flag[0]:
        raise AssertionError(f"{flag[0]} inter-node rounds failed")
    # InterNodeV1's routing handles between the same nodes (raises on a failure).
    from ops_gpu_surface import routing_handles

    where = "" if p2p else ", through the proxy"
    routing_handles(rank, world, [("InterNodeV1", {"gpu_per_node": g}) for g in sizes], where)


def _save_intra(path: str, intra: dict[tuple[str, int], Any]) -> None:
    """Rank 0's gathered IntraNode rounds, tensors as uint8 bytes with their dtype's name (torch
    cannot unpickle float8 storages)."""

    def pack(v: Any) -> Any:
        return ("tensor", v.contiguous().view(torch.uint8).cpu(), str(v.dtype)) if isinstance(v, torch.Tensor) else v

    torch.save({key: [{k: pack(v) for k, v in pe.items()} for pe in pes] for key, pes in intra.items()}, path)


def _load_intra(path: str) -> dict[tuple[str, int], Any]:
    """What :func:`_save_intra` wrote."""

    def unpack(v: Any) -> Any:
        if isinstance(v, tuple) and len(v) == 3 and v[0] == "tensor":
            return v[1].view(getattr(torch, v[2].removeprefix("torch.")))
        return v

    saved = torch.load(path, weights_only=False)
    return {key: [{k: unpack(v) for k, v in pe.items()} for pe in pes] for key, pes in saved.items()}


def main() -> None:
    rank, world = init_world()
    mori.shmem.shmem_torch_process_group_init("default")
    t0 = time.time()
    checks = os.environ.get("MORI_OPS_CHECKS", "all")
    if checks == "graph_double_dispatch":
        graph_double_dispatch(rank, world)
    if checks == "edge":
        edge_cases(rank, world)
    if checks in ("internode", "intra_reference"):
        internode(rank, world)
    if checks == "surface":
        from ops_gpu_surface import surface

        surface(rank, world)
    if checks == "all":
        cases(rank, world)
    if checks in ("all", "checker"):
        checker(rank, world)
    dist.barrier()
    if rank == 0:
        print(f"ok  all mori.ops checks with {world} PEs in {time.time() - t0:.1f} s", flush=True)
    mori.shmem.shmem_finalize()
    dist.destroy_process_group()


def cases(rank: int, world: int) -> None:
    """Every case of the reference comparison, then the CUDA-graph replays."""
    experts = max(1, 256 // world)
    bf16 = Case(world=world, max_tokens=48, hidden=1024, k=8, experts_per_rank=experts, invalid=0.1)
    rounds(rank, world, "bf16 IntraNode", bf16, [1, 2, 3])
    rounds(
        rank,
        world,
        "fp8 e4m3 + per-token fp32 scale",
        dataclasses.replace(bf16, dtype=torch.float8_e4m3fn, scale_dim=1),
        [4, 5],
    )
    rounds(
        rank,
        world,
        "fp8 e4m3 + per-128 fp32 scales",
        dataclasses.replace(bf16, dtype=torch.float8_e4m3fn, scale_dim=1024 // 128),
        [6, 7],
    )
    rounds(
        rank,
        world,
        "fp8 e4m3 combine (fp8 expert outputs)",
        dataclasses.replace(bf16, dtype=torch.float8_e4m3fn, combine_dtype=torch.float8_e4m3fn, scale_dim=1),
        [8],
    )
    rounds(rank, world, "float32", dataclasses.replace(bf16, dtype=torch.float32), [9])
    rounds(
        rank,
        world,
        "bf16 AsyncLL send/recv",
        bf16,
        [10, 11],
        split=True,
        kernel_type=mori.ops.EpDispatchCombineKernelType.AsyncLL,
    )
    rounds(rank, world, "bf16 zero-copy combine", bf16, [12], zero_copy=True, use_external_inp_buf=False)
    rounds(
        rank, world, "bf16 fp8_direct_cast combine", bf16, [13], wire=torch.float8_e4m3fn, quant_type="fp8_direct_cast"
    )
    rounds(
        rank, world, "bf16 hidden 7168 top-8, 128 tokens", dataclasses.replace(bf16, hidden=7168, max_tokens=128), [14]
    )
    graph_rounds(rank, world, dataclasses.replace(bf16, full=True), [15, 16, 17])
    # A token for every warp of the grid (48 tokens, 4 blocks of 4 warps): each PE sums the rows it
    # sent itself from its combine input in place and stages only its peers' (_gpu.py).
    own = dict(block_num=4, warp_num_per_block=4)
    full = dataclasses.replace(bf16, full=True)
    rounds(rank, world, "bf16, own rows in place", full, [18, 19], combine_weights=["view", "rows"], **own)
    rounds(rank, world, "bf16, own rows in place, input of half the rows", full, [20], short_input=True, **own)
    rounds(
        rank,
        world,
        "fp8 combine, own rows in place",
        dataclasses.replace(full, dtype=torch.float8_e4m3fn, combine_dtype=torch.float8_e4m3fn, scale_dim=1),
        [21],
        **own,
    )
    rounds(rank, world, "float32, own rows in place", dataclasses.replace(full, dtype=torch.float32), [22], **own)
    rounds(
        rank,
        world,
        "bf16 zero-copy combine, 4 x 4 warps",
        full,
        [23],
        zero_copy=True,
        use_external_inp_buf=False,
        **own,
    )
    graph_rounds(rank, world, full, [24, 25], name="CUDA graph replay, own rows in place", **own)


def checker(rank: int, world: int) -> None:
    """The port of MORI's EP checker."""
    import mori_ep_checker

    experts = max(1, 256 // world)

    cfg = make_config(
        Case(world=world, max_tokens=32, hidden=4096, k=8, experts_per_rank=experts), rank, max_token_type_size=4
    )
    op = mori.ops.EpDispatchCombineOp(cfg)
    for seed, sentinel in ((123, None), (124, None), (125, "every_other"), (126, "first_only")):
        try:
            n = mori_ep_checker.check(op, seed, sentinel)
        except Exception as exc:
            import traceback

            print(
                f"FAILED  MORI EP checker seed {seed} sentinel {sentinel} on rank {rank} at {time.time():.3f}: "
                f"{exc!r}\n{traceback.format_exc()}",
                flush=True,
            )
            raise
        if rank == 0:
            print(f"ok  MORI EP checker seed {seed} sentinel {sentinel}: rank 0 received {n}", flush=True)


if __name__ == "__main__":
    main()
