"""A port of MORI's EP checker (tests/python/ops: EpDispatchCombineTestCase's data, dispatch and
combine checks) to mori, run by ops_gpu_worker.py on every PE.

As in MORI: every rank draws every rank's data from one seed (a random token count per rank,
distinct random experts per token, optional -1 sentinels), dispatches, checks each received row
against its source through get_dispatch_src_token_pos / decode_send_flat_idx, combines the
dispatch output unchanged and expects each token times its number of distinct destination ranks
(weights likewise), within MORI's tolerances.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gen_data(cfg: Any, seed: int, sentinel: str | None) -> tuple[list[Any], ...]:
    g = torch.Generator().manual_seed(seed)
    world, k = cfg.world_size, cfg.num_experts_per_token
    experts = cfg.num_experts_per_rank * world
    counts = torch.randint(0, cfg.max_num_inp_token_per_rank + 1, (world,), generator=g).tolist()
    ids, xs, ws, ss = [], [], [], []
    for n in counts:
        rows = (
            torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
            if n
            else torch.empty(0, k, dtype=torch.int64)
        )
        if sentinel == "every_other":
            rows[:, 1::2] = -1
        elif sentinel == "first_only":
            rows[:, 1:] = -1
        ids.append(rows.to(torch.int32).cuda())
        ws.append(torch.rand(n, k, generator=g).cuda())
        ss.append(torch.rand(n, max(cfg.scale_dim, 0), generator=g).cuda())
        xs.append(torch.randn(n, cfg.hidden_dim, generator=g).to(cfg.data_type).cuda())
    return ids, xs, ws, ss


def check(op: Any, seed: int, sentinel: str | None = None) -> int:
    cfg, me = op.config, op.config.rank
    ids, xs, ws, ss = gen_data(cfg, seed, sentinel)
    out, out_w, out_s, out_i, total = op.dispatch(xs[me], ws[me], ss[me] if cfg.scale_dim else None, ids[me])
    torch.cuda.synchronize()
    dist.barrier()
    pos = op.get_dispatch_src_token_pos().tolist()
    assert len(pos) == int(total[0]) and len(set(pos)) == len(pos), "received positions"
    for i, p in enumerate(pos):
        r, t = op.decode_send_flat_idx(p)
        assert torch.equal(xs[r][t], out[i]), f"row {i} from rank {r} token {t}: token"
        assert torch.equal(ids[r][t], out_i[i]), f"row {i} from rank {r} token {t}: indices"
        assert torch.equal(ws[r][t], out_w[i]), f"row {i} from rank {r} token {t}: weights"
        if out_s is not None:
            assert torch.equal(ss[r][t], out_s[i]), f"row {i}: scales"
    # Beyond MORI's checks: every (token, top-k entry) that sent points at a slot its destination
    # received (what combine will read), and the others are -1.
    totals = [torch.zeros(1, dtype=torch.int64) for _ in range(cfg.world_size)]
    dist.all_gather(totals, total.cpu().to(torch.int64))
    from mori.ops._layout import plan_routing

    n, k, stride = xs[me].shape[0], cfg.num_experts_per_token, op.max_num_tokens_to_send()
    dest_map = op._bufs.dest_map[: n * k].view(n, k).cpu()
    want = plan_routing(ids[me].cpu(), cfg.num_experts_per_rank, cfg.world_size)
    for t in range(n):
        for j in range(k):
            d = int(dest_map[t, j])
            pe, slot = divmod(d, stride) if d >= 0 else (-1, -1)
            assert pe == int(want[t, j]) and (pe < 0 or slot < int(totals[pe])), (
                f"rank {me} token {t} entry {j}: recorded {d} (pe {pe} slot {slot}), want pe {int(want[t, j])}"
            )
    comb, comb_w = op.combine(out, out_w, ids[me])
    torch.cuda.synchronize()
    dist.barrier()
    for t in range(xs[me].shape[0]):
        pes = {e // cfg.num_experts_per_rank for e in ids[me][t].tolist() if e >= 0}
        want = (xs[me][t].float() * len(pes)).to(cfg.data_type)
        assert torch.allclose(comb[t].float(), want.float(), atol=1e-2, rtol=1e-2), (
            f"token {t} ({len(pes)} ranks): max diff {(comb[t].float() - want.float()).abs().max().item()}"
        )
        assert torch.allclose(comb_w[t], ws[me][t] * len(pes), atol=1e-5, rtol=1e-5), (
            f"weights {t}: {comb_w[t].tolist()} vs {(ws[me][t] * len(pes)).tolist()}"
        )
    return len(pos)
