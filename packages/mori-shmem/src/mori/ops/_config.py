"""MORI-EP's configuration: the kernel-type and quant-type enums, the config dataclass, its checks.

The dataclass keeps MORI's fields, defaults and order (``dataclasses.fields`` is part of the API:
SGLang drops keyword arguments the installed MORI does not know by reading it). MORI checks a
config in its C++ handle; here :func:`validate_config` does it before anything is allocated, so a
bad config raises with the field named and leaves nothing behind.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineQuantType",
    "EpSettings",
    "MAX_EXPERTS_PER_TOKEN",
    "INTER_NODE_KERNEL_TYPES",
    "INTRA_NODE_KERNEL_TYPES",
    "capacities",
    "combine_row_bytes",
    "ep_settings",
    "normalize_quant_type",
    "validate_config",
]

#: Top-k is handled one lane of a warp per expert slot, so it must fit in a warp.
MAX_EXPERTS_PER_TOKEN = 32
#: The same bound as mori.shmem's device state (one peer base per PE).
MAX_WORLD_SIZE = 64


class EpDispatchCombineKernelType(enum.IntEnum):
    """Which dispatch/combine kernels run; values are MORI's (``KernelType`` in its C++ header)."""

    IntraNode = 0
    InterNode = 1
    InterNodeV1 = 2
    InterNodeV1LL = 3
    AsyncLL = 4
    IntraNodeLL = 5

    def __str__(self) -> str:
        return self.name


class EpDispatchCombineQuantType(enum.IntEnum):
    """How combine moves tokens; ``quant_type`` strings map to these (MORI's values)."""

    None_ = 0
    Fp8DirectCast = 1
    Fp8BlockwiseQuant = 2
    Fp4BlockwiseQuant = 3

    def __str__(self) -> str:
        return self.name


_QUANT_NAMES = {
    "none": EpDispatchCombineQuantType.None_,
    "fp8_direct_cast": EpDispatchCombineQuantType.Fp8DirectCast,
    "fp8_blockwise": EpDispatchCombineQuantType.Fp8BlockwiseQuant,
    "fp4_blockwise": EpDispatchCombineQuantType.Fp4BlockwiseQuant,
}

#: Kernel types that need every PE's heap mapped (one node: NVLink, or several PEs on one GPU).
INTRA_NODE_KERNEL_TYPES = (
    EpDispatchCombineKernelType.IntraNode,
    EpDispatchCombineKernelType.IntraNodeLL,
    EpDispatchCombineKernelType.AsyncLL,
)
#: Kernel types that also reach PEs of other nodes (through mori.shmem's remote transport).
INTER_NODE_KERNEL_TYPES = (
    EpDispatchCombineKernelType.InterNode,
    EpDispatchCombineKernelType.InterNodeV1,
    EpDispatchCombineKernelType.InterNodeV1LL,
)


@dataclass
class EpDispatchCombineConfig:
    """Configuration of an :class:`~mori.ops.EpDispatchCombineOp` (MORI's fields, defaults, order).

    Args:
        data_type: token dtype the caller dispatches (kept for MORI compatibility: each call
            uses its input tensor's dtype, which must fit ``max_token_type_size`` bytes).
        rank: this process's rank in the expert-parallel group (its mori.shmem PE).
        world_size: ranks in the group (= mori.shmem PEs).
        hidden_dim: elements per token row.
        scale_dim: scale values per token that dispatch carries beside it (0: none; 1: per-token
            scale; ``hidden_dim // 128``: per-128-element block scales).
        scale_type_size: bytes per scale value (4 for float32 scales, 1 for e8m0/fp8).
        max_token_type_size: bytes per element of the widest dtype sent (2 for bf16); sizes
            the buffers, so fp8 dispatch and bf16 combine share one op.
        max_num_inp_token_per_rank: most tokens one rank dispatches in a call.
        num_experts_per_rank: experts each rank hosts; expert ``e`` lives on rank
            ``e // num_experts_per_rank``.
        num_experts_per_token: top-k (at most 32).
        warp_num_per_block: warps per block of the data kernels (default of each call).
        block_num: blocks of the data kernels (default of each call).
        max_total_recv_tokens: optional cap on tokens one rank receives (0: no cap; the receive
            buffers then hold ``world_size * max_num_inp_token_per_rank`` tokens).
        use_external_inp_buf: combine copies its input into the op's registered buffer (True),
            or the caller wrote it there already (False, zero copy: see
            ``get_registered_combine_input_buffer``).
        kernel_type: ``IntraNode``, ``IntraNodeLL`` or ``AsyncLL`` (every PE's heap mapped), or
            ``InterNode``, ``InterNodeV1``, ``InterNodeV1LL`` (PEs of other nodes too, through
            mori.shmem's device put-with-signal on GPUs, its host RMA on the CPU heap;
            ``InterNode`` runs the ``InterNodeV1`` kernels).
        gpu_per_node: PEs per node for the inter-node kernel types on GPUs: ranks
            ``[n * gpu_per_node, (n + 1) * gpu_per_node)`` form node ``n`` and must reach each other
            by P2P (capped at ``world_size``, which it must divide; 1 under ``MORI_DISABLE_P2P``).
            The CPU heap takes which PEs are remote from mori.shmem's topology instead.
        rdma_block_num: blocks of the inter-node kernels that forward received tokens and gather
            combine rows (0: ``block_num``).
        num_qp_per_pe: RDMA queue pairs per PE (kept for MORI; the transport picks its own).
        quant_type: combine transport: ``"none"``, ``"fp8_direct_cast"`` (bf16 combine input sent
            as fp8 e4m3 and summed in float32), ``"fp8_blockwise"`` or ``"fp4_blockwise"`` (bf16
            sent as fp8 e4m3 / e2m1 with a float32 scale per block of a row, dequantized and summed
            in float32 by the receiver; ``MORI_FP8_COMBINE_SCALE_DIM`` blocks a row, see _quant.py).
    """

    data_type: Any
    rank: int
    world_size: int
    hidden_dim: int
    scale_dim: int
    scale_type_size: int
    max_token_type_size: int
    max_num_inp_token_per_rank: int
    num_experts_per_rank: int
    num_experts_per_token: int
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"


def normalize_quant_type(quant_type: Any) -> EpDispatchCombineQuantType:
    """The quant type named by a string (``"none"``, ``"fp8_direct_cast"``, ...) or an enum member."""
    if isinstance(quant_type, EpDispatchCombineQuantType):
        return quant_type
    if isinstance(quant_type, str) and quant_type.strip().lower() in _QUANT_NAMES:
        return _QUANT_NAMES[quant_type.strip().lower()]
    raise ValueError(f"EpDispatchCombineConfig.quant_type={quant_type!r}: expected one of {sorted(_QUANT_NAMES)}")


def _kernel_type(value: Any) -> EpDispatchCombineKernelType:
    try:
        return EpDispatchCombineKernelType(int(getattr(value, "value", value)))
    except (TypeError, ValueError):
        raise ValueError(
            f"EpDispatchCombineConfig.kernel_type={value!r} is not an EpDispatchCombineKernelType"
        ) from None


def _int_field(config: EpDispatchCombineConfig, name: str, low: int, high: int | None = None) -> int:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"EpDispatchCombineConfig.{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"EpDispatchCombineConfig.{name}={value}: must be {bound}")
    return value


def validate_config(config: EpDispatchCombineConfig) -> EpDispatchCombineKernelType:
    """Checks every field; returns the kernel type. Raises TypeError/ValueError naming the field."""
    if not isinstance(config, EpDispatchCombineConfig):
        raise TypeError(f"expected an EpDispatchCombineConfig, got {type(config).__name__}")
    world = _int_field(config, "world_size", 1, MAX_WORLD_SIZE)
    _int_field(config, "rank", 0, world - 1)
    _int_field(config, "hidden_dim", 1)
    scale_dim = _int_field(config, "scale_dim", 0)
    _int_field(config, "scale_type_size", 0, 8)
    if scale_dim > 0 and config.scale_type_size not in (1, 2, 4, 8):
        raise ValueError(
            f"EpDispatchCombineConfig.scale_type_size={config.scale_type_size}: with scale_dim > 0 "
            "it must be 1, 2, 4 or 8"
        )
    if config.max_token_type_size not in (1, 2, 4):
        raise ValueError(
            f"EpDispatchCombineConfig.max_token_type_size={config.max_token_type_size!r}: must be "
            "1, 2 or 4 (bytes per element of the widest token dtype)"
        )
    _int_field(config, "max_num_inp_token_per_rank", 1)
    _int_field(config, "num_experts_per_rank", 1)
    _int_field(config, "num_experts_per_token", 1, MAX_EXPERTS_PER_TOKEN)
    _int_field(config, "warp_num_per_block", 1, 32)
    _int_field(config, "block_num", 1, 65535)
    _int_field(config, "max_total_recv_tokens", 0)
    for name in ("gpu_per_node", "rdma_block_num", "num_qp_per_pe"):
        _int_field(config, name, 0)
    if not isinstance(config.use_external_inp_buf, (bool, int)):
        raise TypeError("EpDispatchCombineConfig.use_external_inp_buf must be a bool")
    kernel_type = _kernel_type(config.kernel_type)
    quant = normalize_quant_type(config.quant_type)
    if quant != EpDispatchCombineQuantType.None_ and not config.use_external_inp_buf:
        raise ValueError(
            f"quant_type={config.quant_type!r} needs use_external_inp_buf=True (the rows are cast or "
            "quantized while combine copies its input into the registered buffer)"
        )
    cap = capacities(config)
    total = cap["max_num_tokens_to_recv"] * (config.hidden_dim * config.max_token_type_size)
    if total >= 1 << 40:
        raise ValueError(
            f"EpDispatchCombineConfig: receive buffer of {total} bytes is not plausible; "
            "check hidden_dim, max_num_inp_token_per_rank and world_size"
        )
    return kernel_type


@dataclass(frozen=True)
class EpSettings:
    """MORI-EP's environment settings, read once when an op is built (mori.core.config parses them:
    a malformed value raises ``ConfigError`` naming the variable)."""

    #: ``MORI_EP_LAUNCH_CONFIG_MODE``: "manual" or "auto".
    launch_mode: str
    #: ``(block_num, rdma_block_num, warp_per_block)`` in AUTO mode, else None.
    auto_launch: tuple[int, int, int] | None
    #: ``MORI_FP8_COMBINE_SCALE_DIM``: scales per row of the blockwise combine quantizations.
    combine_scale_dim: int
    #: ``MORI_ENABLE_SDMA``: accepted (no copy engines are driven by it on NVIDIA, see docs/ops.md).
    sdma: bool


#: MORI's fallback geometry of AUTO mode (no tuning tables exist for NVIDIA GPUs).
_AUTO_LAUNCH = {
    EpDispatchCombineKernelType.InterNodeV1: (96, 64, 8),
    EpDispatchCombineKernelType.InterNodeV1LL: (256, 128, 8),
}
_AUTO_LAUNCH_DEFAULT = (128, 0, 16)


def ep_settings(kernel_type: EpDispatchCombineKernelType) -> EpSettings:
    """The EP settings for an op of ``kernel_type``; raises ValueError for ``MORI_EP_COMM=cco``."""
    from mori.core import config as env

    if env.get("MORI_EP_COMM") == "cco":
        raise ValueError(
            "MORI_EP_COMM=cco: mori provides no mori.cco communicator (MORI's LSA windows for "
            "archs without shmem); mori.ops keeps its buffers on mori.shmem's heap: unset it or "
            "set MORI_EP_COMM=shmem"
        )
    mode = env.get("MORI_EP_LAUNCH_CONFIG_MODE")
    auto = _AUTO_LAUNCH.get(kernel_type, _AUTO_LAUNCH_DEFAULT) if mode == "auto" else None
    return EpSettings(
        launch_mode=mode,
        auto_launch=auto,
        combine_scale_dim=env.get("MORI_FP8_COMBINE_SCALE_DIM"),
        sdma=env.get("MORI_ENABLE_SDMA"),
    )


def combine_row_bytes(config: EpDispatchCombineConfig, scale_dim: int) -> int:
    """Bytes of one staged combine row: the widest token row, or a blockwise quantized row (codes
    then ``scale_dim`` float32 scales) where that is wider (small hidden sizes)."""
    from ._quant import CombineWire

    row = config.hidden_dim * config.max_token_type_size
    quant = normalize_quant_type(config.quant_type)
    if quant == EpDispatchCombineQuantType.Fp8BlockwiseQuant:
        return max(row, CombineWire("fp8_blockwise", None, config.hidden_dim, scale_dim).row_bytes)
    if quant == EpDispatchCombineQuantType.Fp4BlockwiseQuant:
        return max(row, CombineWire("fp4_blockwise", None, config.hidden_dim, scale_dim).row_bytes)
    return row


def capacities(config: EpDispatchCombineConfig) -> dict[str, int]:
    """MORI's capacity queries for ``config`` (``max_num_tokens_to_recv`` ... as in its C++ config)."""
    world, per_rank = config.world_size, config.max_num_inp_token_per_rank
    recv_per_rank = per_rank
    if config.max_total_recv_tokens > 0:
        recv_per_rank = min(-(-config.max_total_recv_tokens // world), per_rank)
    return {
        "max_num_tokens_to_send_per_rank": per_rank,
        "max_num_tokens_to_send": world * per_rank,
        "max_num_tokens_to_recv_per_rank": recv_per_rank,
        "max_num_tokens_to_recv": world * recv_per_rank,
    }
