"""Checks of each call's tensors, made before anything is launched (a bad call changes nothing)."""

from __future__ import annotations

from typing import Any

from ._config import EpDispatchCombineConfig

__all__ = ["check_combine", "check_dispatch", "check_packed_inputs", "combine_dtype_name"]


def _tensor(name: str, t: Any, device: Any) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but this PE's symmetric heap is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _rows(name: str, t: Any, cols: int, rows: int | None = None) -> None:
    if t.dim() != 2 or t.shape[1] != cols or (rows is not None and t.shape[0] != rows):
        want = f"[{rows if rows is not None else 'N'}, {cols}]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def _indices(cfg: EpDispatchCombineConfig, indices: Any, rows: int, device: Any) -> None:
    import torch

    _tensor("indices", indices, device)
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32 (MORI's top-k id dtype), got {indices.dtype}")
    _rows("indices", indices, cfg.num_experts_per_token, rows)


def _row_fits(cfg: EpDispatchCombineConfig, name: str, t: Any) -> None:
    if t.element_size() > cfg.max_token_type_size:
        raise ValueError(
            f"{name} dtype {t.dtype} has {t.element_size()}-byte elements but the op was sized for "
            f"max_token_type_size={cfg.max_token_type_size}"
        )
    if t.shape[1] * t.element_size() > cfg.hidden_dim * cfg.max_token_type_size:
        raise ValueError(
            f"{name} rows of {t.shape[1]} x {t.element_size()} bytes do not fit the op's "
            f"hidden_dim={cfg.hidden_dim} x max_token_type_size={cfg.max_token_type_size}"
        )


def check_dispatch(
    cfg: EpDispatchCombineConfig, device: Any, inp: Any, weights: Any, scales: Any, indices: Any
) -> bool:
    """Checks dispatch's arguments; returns whether scales are carried."""
    import torch

    _tensor("input", inp, device)
    if inp.dim() != 2:
        raise ValueError(f"input must be 2-D [num_tokens, hidden], got shape {list(inp.shape)}")
    n = inp.shape[0]
    if n > cfg.max_num_inp_token_per_rank:
        raise ValueError(
            f"input has {n} tokens; the op holds at most max_num_inp_token_per_rank={cfg.max_num_inp_token_per_rank}"
        )
    _row_fits(cfg, "input", inp)
    _indices(cfg, indices, n, device)
    if weights is not None:
        _tensor("weights", weights, device)
        if weights.dtype != torch.float32:
            raise TypeError(f"weights must be float32, got {weights.dtype}")
        _rows("weights", weights, cfg.num_experts_per_token, n)
    if scales is None or cfg.scale_dim == 0:
        return False
    _tensor("scales", scales, device)
    _rows("scales", scales, cfg.scale_dim, n)
    if scales.element_size() != cfg.scale_type_size:
        raise ValueError(
            f"scales dtype {scales.dtype} has {scales.element_size()}-byte elements; the config says "
            f"scale_type_size={cfg.scale_type_size}"
        )
    return True


#: Combine sums in float32 and rounds to the input's dtype: these are the dtypes it handles (the
#: suffix of the GPU kernels). ``float4_e2m1fn_x2`` holds two e2m1 values a byte (low nibble first).
_COMBINE_DTYPES = {
    "bfloat16": "bf16",
    "float32": "f32",
    "float8_e4m3fn": "fp8",
    "float8_e4m3fnuz": "fp8fnuz",
    "float4_e2m1fn_x2": "fp4",
}


def combine_dtype_name(dtype: Any) -> str:
    """The kernel suffix of a combine dtype (``bf16``, ``f32``, ``fp8``, ``fp8fnuz``, ``fp4``)."""
    name = str(dtype).replace("torch.", "")
    if name not in _COMBINE_DTYPES:
        raise TypeError(
            f"combine input dtype {dtype} is not supported: use bfloat16, float32, float8_e4m3fn, "
            "float8_e4m3fnuz or float4_e2m1fn_x2"
        )
    return _COMBINE_DTYPES[name]


def check_packed_inputs(cfg: EpDispatchCombineConfig, device: Any, x: Any, topk_idx: Any, max_recv: int) -> None:
    """Checks convert_dispatch_output's arguments (dispatch's token and top-k views, or tensors of
    their shapes)."""
    import torch

    _tensor("dispatch_out_x", x, device)
    _tensor("dispatch_out_topk_idx", topk_idx, device)
    if x.dim() != 2 or x.shape[0] != max_recv:
        raise ValueError(
            f"dispatch_out_x must be [max_num_tokens_to_recv={max_recv}, hidden] (dispatch's "
            f"output), got {list(x.shape)}"
        )
    if topk_idx.dtype != torch.int32:
        raise TypeError(f"dispatch_out_topk_idx must be int32, got {topk_idx.dtype}")
    _rows("dispatch_out_topk_idx", topk_idx, cfg.num_experts_per_token, max_recv)


def check_combine(
    cfg: EpDispatchCombineConfig, device: Any, inp: Any, weights: Any, indices: Any, dispatched: int
) -> None:
    """Checks combine's arguments against the preceding dispatch of ``dispatched`` tokens."""
    import torch

    _tensor("input", inp, device)
    if inp.dim() != 2:
        raise ValueError(f"input must be 2-D [num_recv_tokens, hidden], got shape {list(inp.shape)}")
    combine_dtype_name(inp.dtype)
    _row_fits(cfg, "input", inp)
    if indices.dim() != 2 or indices.shape[0] != dispatched:
        raise ValueError(
            f"combine() indices has {indices.shape[0] if indices.dim() else 0} rows but this rank "
            f"dispatched {dispatched} tokens: pass this rank's own [num_tokens, topk] routing (the "
            "tensor given to dispatch()), not dispatch()'s returned indices"
        )
    _indices(cfg, indices, dispatched, device)
    if weights is not None:
        _tensor("weights", weights, device)
        if weights.dtype != torch.float32:
            raise TypeError(f"weights must be float32, got {weights.dtype}")
        _rows("weights", weights, cfg.num_experts_per_token)
