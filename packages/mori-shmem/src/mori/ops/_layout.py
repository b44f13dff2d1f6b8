"""Where tokens go, in PyTorch: the routing rule every mori.ops backend implements, and references.

MORI's rule (its intra-node kernel and checker): expert ``e`` lives on rank
``e // num_experts_per_rank``; an id below 0 or naming a rank past the last is invalid and dropped;
a token goes once to each distinct destination rank of its top-k row, at the slot of the first
entry naming that rank, carrying its whole top-k row. Combine sums, for each of a rank's own
tokens, the rows its destinations send back, in float32, in top-k order, and rounds once.

The CPU backend runs these functions; the GPU kernels implement the same rule on the device and
are checked against :func:`reference_dispatch` / :func:`reference_combine`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["accumulate_rows", "plan_routing", "reference_combine", "reference_dispatch", "sent_destinations"]


def plan_routing(indices: Any, num_experts_per_rank: int, world_size: int) -> Any:
    """Destination rank of each top-k entry that sends, -1 where the entry sends nothing.

    ``indices``: int tensor ``[num_tokens, k]``. Returns an int64 tensor of the same shape: entry
    ``(t, j)`` holds rank ``indices[t, j] // num_experts_per_rank`` when that id is valid and no
    earlier entry of row ``t`` names the same rank, else -1.
    """
    import torch

    if indices.dim() != 2:
        raise ValueError(f"indices must be 2-D [num_tokens, k], got shape {tuple(indices.shape)}")
    ids = indices.to(torch.int64)
    pe = torch.div(ids, num_experts_per_rank, rounding_mode="floor")
    valid = (ids >= 0) & (pe < world_size)
    k = ids.shape[1]
    same = (pe.unsqueeze(2) == pe.unsqueeze(1)) & valid.unsqueeze(1)  # [t, j, m]: entry m names j's rank
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)  # m < j
    duplicate = (same & earlier).any(dim=2)
    return torch.where(valid & ~duplicate, pe, torch.full_like(pe, -1))


def sent_destinations(dest: Any) -> list[list[tuple[int, int]]]:
    """Per destination rank, the (token, top-k slot) pairs that go there, in token order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for t, row in enumerate(dest.tolist()):
        for j, pe in enumerate(row):
            if pe >= 0:
                out.setdefault(pe, []).append((t, j))
    return [out.get(pe, []) for pe in range(max(out, default=-1) + 1)]


def reference_dispatch(all_indices: list[Any], num_experts_per_rank: int, rank: int) -> list[tuple[int, int]]:
    """The (source rank, source token) pairs rank ``rank`` receives, sorted: the set any correct
    dispatch delivers (its order on the device depends on timing)."""
    world = len(all_indices)
    got: list[tuple[int, int]] = []
    for src, indices in enumerate(all_indices):
        dest = plan_routing(indices, num_experts_per_rank, world)
        got.extend((src, t) for t in (dest == rank).any(dim=1).nonzero().flatten().tolist())
    return sorted(got)


def accumulate_rows(rows: list[Any], like: Any) -> Any:
    """``rows`` summed in float32 in the order given and rounded once to ``like``'s dtype
    (zeros when ``rows`` is empty), as the combine kernels do."""
    import torch

    acc = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    for row in rows:
        acc = acc + row.to(torch.float32)
    return acc.to(like.dtype)


def reference_combine(
    indices: Any,
    rank: int,
    num_experts_per_rank: int,
    inputs: list[Any],
    src_pos: list[Any],
    max_num_tokens_to_send: int,
    out_dtype: Any,
    wire_dtype: Any = None,
) -> Any:
    """What combine must return on ``rank`` for its own ``indices``.

    ``inputs[p]`` is PE p's combine input (row ``s`` answers the token it received in slot ``s``) and
    ``src_pos[p]`` that PE's ``get_dispatch_src_token_pos()`` (slot -> ``src_rank *
    max_num_tokens_to_send + src_token``). ``wire_dtype`` models fp8 direct cast: each row is
    rounded to it before the sum.
    """
    import torch

    world = len(inputs)
    dest = plan_routing(indices, num_experts_per_rank, world)
    slot_of = [{int(pos): s for s, pos in enumerate(src_pos[p].tolist())} for p in range(world)]
    hidden = inputs[0].shape[1] if inputs and inputs[0].dim() == 2 else 0
    out = torch.zeros(indices.shape[0], hidden, dtype=out_dtype)
    for t, row in enumerate(dest.tolist()):
        rows = []
        for pe in row:
            if pe < 0:
                continue
            r = inputs[pe][slot_of[pe][rank * max_num_tokens_to_send + t]]
            rows.append(r.to(wire_dtype) if wire_dtype is not None else r)
        out[t] = accumulate_rows(rows, out[t])
    return out
