"""docs/ops.md's promise that vLLM's and SGLang's EP paths run unchanged names exactly what
mori.ops refuses: every kernel type and combine quantization the op refuses, the routing handles,
and nothing it accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import mori.shmem as shmem
from mori.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp

DOC = Path(__file__).resolve().parents[3] / "docs" / "ops.md"
#: MORI's quant_type strings.
QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")


def config(rank: int = 0, world: int = 2, **kw: object) -> EpDispatchCombineConfig:
    args: dict = dict(data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=64, scale_dim=0,
                      scale_type_size=0, max_token_type_size=2, max_num_inp_token_per_rank=4,
                      num_experts_per_rank=2, num_experts_per_token=2)
    args.update(kw)
    return EpDispatchCombineConfig(**args)


def refused(**kw: object) -> bool:
    """Whether building the op refuses ``kw`` as not implemented (before shmem init: the config is
    checked first, so an accepted config gets as far as the missing PE)."""
    try:
        EpDispatchCombineOp(config(**kw))
    except NotImplementedError:
        return True
    except shmem.ShmemNotInitializedError:
        return False
    raise AssertionError("the op was built without mori.shmem")


def promise() -> str:
    """The paragraph (with its list) that says the client paths run unchanged."""
    blocks = [b for b in DOC.read_text().split("\n\n") if "run unchanged" in b]
    assert len(blocks) == 1, "docs/ops.md: one paragraph says the client paths run unchanged"
    return blocks[0]


def test_the_promise_names_every_refused_kernel_type_and_no_other() -> None:
    named = set(re.findall(r"`(\w+)`", promise())) & {k.name for k in EpDispatchCombineKernelType}
    assert named == {k.name for k in EpDispatchCombineKernelType if refused(kernel_type=k)}
    assert not named  # every kernel type builds before init (the inter-node ones on a GPU heap are refused after)


def test_the_promise_names_every_refused_quantization_and_no_other() -> None:
    named = set(re.findall(r'quant_type="(\w+)"', promise()))
    assert named == {q for q in QUANT_TYPES if refused(quant_type=q)}


def pe_routing_refusals() -> list[str]:
    op = EpDispatchCombineOp(config(shmem.shmem_mype(), shmem.shmem_npes()))
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    calls = [lambda: op.dispatch(x, None, None, ids, routing=object()),
             lambda: op.dispatch(x, None, None, ids, return_routing=True),
             lambda: op.combine(x, None, ids, routing=object())]
    out = []
    for call in calls:
        with pytest.raises(NotImplementedError) as err:
            call()
        out.append(str(err.value))
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_the_promise_names_routing_handles_and_they_are_refused(pool) -> None:
    assert "routing=" in promise() and "return_routing=True" in promise()
    for messages in pool.run(pe_routing_refusals):
        assert all("routing handles" in m for m in messages), messages
