"""docs/ops.md's compatibility statement matches the code: every kernel type and combine
quantization MORI names builds (none is refused), routing handles are refused exactly for the
kernel types MORI refuses them for, and SGLang's EPv2 (``mori.cco``, ``dispatch_combine_v2``),
which mori does not provide, is named as such."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import mori.shmem as shmem
from mori.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp

DOC = Path(__file__).resolve().parents[3] / "docs" / "ops.md"
#: MORI's quant_type strings.
QUANT_TYPES = ("none", "fp8_direct_cast", "fp8_blockwise", "fp4_blockwise")


def config(rank: int = 0, world: int = 2, **kw: object) -> EpDispatchCombineConfig:
    args: dict = dict(
        data_type=torch.bfloat16,
        rank=rank,
        world_size=world,
        hidden_dim=64,
        scale_dim=0,
        scale_type_size=0,
        max_token_type_size=2,
        max_num_inp_token_per_rank=4,
        num_experts_per_rank=2,
        num_experts_per_token=2,
    )
    args.update(kw)
    return EpDispatchCombineConfig(**args)


def statement() -> str:
    """The paragraph of the guide that says what of the clients' EP paths runs."""
    blocks = [b for b in DOC.read_text().split("\n\n") if "dispatch_combine_v2" in b]
    assert len(blocks) == 1, "docs/ops.md: one paragraph names EPv2 (dispatch_combine_v2)"
    return blocks[0]


@pytest.mark.parametrize("kernel", list(EpDispatchCombineKernelType))
@pytest.mark.parametrize("quant", QUANT_TYPES)
def test_every_kernel_type_and_quantization_builds(kernel: EpDispatchCombineKernelType, quant: str) -> None:
    """Before mori.shmem is initialized the config is checked first: an accepted one gets as far as
    the missing PE."""
    with pytest.raises(shmem.ShmemNotInitializedError):
        EpDispatchCombineOp(config(kernel_type=kernel, quant_type=quant))


def test_epv2_is_named_as_not_provided() -> None:
    text = statement()
    assert "mori.cco" in text and "not provided" in text and "run unchanged" not in text
    for name in ("mori.cco", "mori.ops.dispatch_combine_v2"):
        with pytest.raises(ImportError):
            importlib.import_module(name)


def pe_routing_refusals() -> dict[str, str]:
    """Per kernel type, what dispatch(..., return_routing=True) raised ("" when it worked)."""
    out = {}
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    for kernel in EpDispatchCombineKernelType:
        op = EpDispatchCombineOp(config(shmem.shmem_mype(), shmem.shmem_npes(), kernel_type=kernel))
        try:
            res = op.dispatch(x, None, None, ids, return_routing=True)
        except NotImplementedError as exc:
            out[kernel.name] = str(exc)
        else:
            op.combine(res[0][: int(res[4])].clone(), None, ids, routing=res[5])
            out[kernel.name] = ""
    return out


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_routing_handles_refused_where_mori_refuses_them(pool) -> None:
    assert "return_routing=True" in DOC.read_text() and "IntraNode` and `InterNodeV1`" in DOC.read_text()
    for refusals in pool.run(pe_routing_refusals):
        assert {k for k, m in refusals.items() if not m} == {"IntraNode", "InterNodeV1"}, refusals
        assert all("only IntraNode and InterNodeV1" in m for m in refusals.values() if m), refusals
