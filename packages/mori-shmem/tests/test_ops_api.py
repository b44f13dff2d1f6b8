"""mori.ops API surface (MORI's names, fields, defaults, enum values) and config validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mori
import mori.ops
from mori.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp
from mori.ops._config import capacities, normalize_quant_type, validate_config

#: MORI's EpDispatchCombineConfig: (field, default) in declaration order (MISSING: required).
MORI_FIELDS = [
    ("data_type", None),
    ("rank", None),
    ("world_size", None),
    ("hidden_dim", None),
    ("scale_dim", None),
    ("scale_type_size", None),
    ("max_token_type_size", None),
    ("max_num_inp_token_per_rank", None),
    ("num_experts_per_rank", None),
    ("num_experts_per_token", None),
    ("warp_num_per_block", 8),
    ("block_num", 80),
    ("max_total_recv_tokens", 0),
    ("use_external_inp_buf", True),
    ("kernel_type", EpDispatchCombineKernelType.IntraNode),
    ("gpu_per_node", 8),
    ("rdma_block_num", 0),
    ("num_qp_per_pe", 1),
    ("quant_type", "none"),
]

MORI_METHODS = [
    "dispatch",
    "combine",
    "dispatch_send",
    "dispatch_recv",
    "combine_send",
    "combine_recv",
    "reset",
    "get_dispatch_src_token_pos",
    "get_registered_combine_input_buffer",
    "max_num_tokens_to_recv",
    "max_num_tokens_to_recv_per_rank",
    "max_num_tokens_to_send",
    "max_num_tokens_to_send_per_rank",
    "decode_send_flat_idx",
    "get_launch_config",
]


def base(**kw):
    args = dict(
        data_type=torch.bfloat16,
        rank=0,
        world_size=8,
        hidden_dim=7168,
        scale_dim=0,
        scale_type_size=4,
        max_token_type_size=2,
        max_num_inp_token_per_rank=128,
        num_experts_per_rank=32,
        num_experts_per_token=8,
    )
    args.update(kw)
    return EpDispatchCombineConfig(**args)


def test_namespace_and_exports():
    assert mori.ops is mori.ops  # the lazy namespace hook knows "ops"
    for name in ("EpDispatchCombineConfig", "EpDispatchCombineKernelType", "EpDispatchCombineOp"):
        assert name in mori.ops.__all__ and getattr(mori.ops, name)


def test_config_fields_defaults_order():
    fields = dataclasses.fields(EpDispatchCombineConfig)
    got = [(f.name, None if f.default is dataclasses.MISSING else f.default) for f in fields]
    assert got == MORI_FIELDS


def test_kernel_type_values():
    assert {k.name: k.value for k in EpDispatchCombineKernelType} == {
        "IntraNode": 0,
        "InterNode": 1,
        "InterNodeV1": 2,
        "InterNodeV1LL": 3,
        "AsyncLL": 4,
        "IntraNodeLL": 5,
    }
    assert str(EpDispatchCombineKernelType.AsyncLL) == "AsyncLL"


def test_op_methods():
    for name in MORI_METHODS:
        assert callable(getattr(EpDispatchCombineOp, name)), name


def test_capacities():
    assert capacities(base()) == {
        "max_num_tokens_to_send_per_rank": 128,
        "max_num_tokens_to_send": 1024,
        "max_num_tokens_to_recv_per_rank": 128,
        "max_num_tokens_to_recv": 1024,
    }
    capped = capacities(base(max_total_recv_tokens=300))
    assert capped["max_num_tokens_to_recv_per_rank"] == 38 and capped["max_num_tokens_to_recv"] == 304
    assert capacities(base(max_total_recv_tokens=10**6))["max_num_tokens_to_recv_per_rank"] == 128


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"rank": 8}, ValueError, "rank=8"),
        ({"rank": -1}, ValueError, "rank=-1"),
        ({"world_size": 0}, ValueError, "world_size=0"),
        ({"world_size": 65, "rank": 0}, ValueError, "world_size=65"),
        ({"hidden_dim": 0}, ValueError, "hidden_dim=0"),
        ({"hidden_dim": 7168.0}, TypeError, "hidden_dim must be an int"),
        ({"num_experts_per_token": 33}, ValueError, "num_experts_per_token=33"),
        ({"num_experts_per_rank": 0}, ValueError, "num_experts_per_rank=0"),
        ({"max_token_type_size": 3}, ValueError, "max_token_type_size=3"),
        ({"scale_dim": 56, "scale_type_size": 3}, ValueError, "scale_type_size=3"),
        ({"warp_num_per_block": 33}, ValueError, "warp_num_per_block=33"),
        ({"block_num": 0}, ValueError, "block_num=0"),
        ({"max_num_inp_token_per_rank": 0}, ValueError, "max_num_inp_token_per_rank=0"),
        ({"max_total_recv_tokens": -1}, ValueError, "max_total_recv_tokens=-1"),
        ({"quant_type": "int4"}, ValueError, "quant_type='int4'"),
        ({"kernel_type": 9}, ValueError, "kernel_type=9"),
        ({"quant_type": "fp8_direct_cast", "use_external_inp_buf": False}, ValueError, "use_external_inp_buf"),
    ],
)
def test_config_rejects(kw, err, match):
    with pytest.raises(err, match=match):
        validate_config(base(**kw))


@pytest.mark.parametrize("q", ["fp8_blockwise", "fp4_blockwise"])
def test_blockwise_quant_accepted_with_external_input_buffer(q):
    assert validate_config(base(quant_type=q)) == EpDispatchCombineKernelType.IntraNode
    with pytest.raises(ValueError, match="needs use_external_inp_buf=True"):
        validate_config(base(quant_type=q, use_external_inp_buf=False))


def test_supported_types_accepted():
    for kt in ("IntraNode", "IntraNodeLL", "AsyncLL", "InterNode", "InterNodeV1", "InterNodeV1LL"):
        assert validate_config(base(kernel_type=EpDispatchCombineKernelType[kt])).name == kt
    assert normalize_quant_type(" FP8_Direct_Cast ").name == "Fp8DirectCast"


def test_op_before_shmem_init():
    from mori.shmem import ShmemNotInitializedError

    with pytest.raises(ShmemNotInitializedError):
        EpDispatchCombineOp(base(world_size=1))
    with pytest.raises(ValueError, match="use_external_inp_buf"):  # the config is checked first
        EpDispatchCombineOp(base(quant_type="fp8_blockwise", use_external_inp_buf=False))


def test_kernels_compile_with_nvrtc():
    """The kernels compile for sm_90 (NVRTC needs no GPU), export every kernel the backend launches,
    and lay out EpArgs as its ctypes mirror does."""
    import ctypes

    from mori.core import nvrtc
    from mori.ops._gpu import _KERNELS, EpArgs, kernel_source

    # The offsets only where this NVRTC has __builtin_offsetof (13.5 on; state.cuh sets
    # MORI_DEVICE_NO_OFFSETOF otherwise, and the newest torch's NVRTC may be older): the size always.
    checks = (
        [
            f'static_assert(sizeof(EpArgs) == {ctypes.sizeof(EpArgs)}, "EpArgs size");',
            "#if !defined(MORI_DEVICE_NO_OFFSETOF)",
        ]
        + [
            f'static_assert(__builtin_offsetof(EpArgs, {name}) == {getattr(EpArgs, name).offset}, "{name}");'
            for name, _ in EpArgs._fields_
        ]
        + ["#endif"]
    )
    source = kernel_source() + "\n" + "\n".join(checks)
    ptx = nvrtc.compile(source, name="mori_ops_ep.cu", arch="sm_90", output="ptx").decode()
    for name in _KERNELS:
        assert f".entry {name}(" in ptx, name


def test_node_plan_of_the_inter_node_kernel_types():
    """gpu_per_node splits the world into nodes (capped at the world), must divide it, and every PE of
    this PE's node must be mapped here; the payload layouts keep their rows aligned."""
    from mori.ops._config import combine_row_bytes
    from mori.ops._internode import node_plan, payload_layout

    plan = node_plan(base(rank=5, gpu_per_node=4), range(8))
    assert (plan.size, plan.node, plan.nodes, plan.first) == (4, 1, 2, 4)
    assert node_plan(base(rank=5, gpu_per_node=1), [5]).nodes == 8  # only itself mapped: fine with 1 a node
    assert node_plan(base(gpu_per_node=16), range(8)).nodes == 1
    with pytest.raises(ValueError, match="gpu_per_node=3: world_size=8 is not a whole number of nodes"):
        node_plan(base(gpu_per_node=3), range(8))
    with pytest.raises(ValueError, match="gpu_per_node=0"):
        node_plan(base(gpu_per_node=0), range(8))
    with pytest.raises(ValueError, match=r"PEs \[6\] share PE 5's node \(gpu_per_node=4\)"):
        node_plan(base(rank=5, gpu_per_node=4), [0, 1, 2, 3, 4, 5, 7])
    for cfg in (
        base(),
        base(hidden_dim=7, max_token_type_size=1, scale_dim=3, scale_type_size=1, num_experts_per_token=7),
        base(hidden_dim=48, quant_type="fp4_blockwise"),
    ):
        lay = payload_layout(cfg, 56)
        assert lay.comb_w_off >= combine_row_bytes(cfg, 56)
        row = cfg.hidden_dim * cfg.max_token_type_size
        assert lay.scale_off >= 32 + row and lay.idx_off >= lay.scale_off + cfg.scale_dim * cfg.scale_type_size
        assert lay.xfer % 16 == 0 and lay.xfer >= lay.w_off + 4 * cfg.num_experts_per_token
        assert lay.comb_xfer % 32 == 0 and lay.comb_w_off >= row
