"""mori.ops' combine wires and EP settings on the CPU heap, real PE processes: the blockwise fp8 and
fp4 quantizations (byte for byte against a quantizer written here in numpy, and within the
tolerance MORI's own tests use against the unquantized sum), fp8 e4m3fnuz and packed fp4 combine
input, and the MORI_EP_* / MORI_FP8_COMBINE_SCALE_DIM / MORI_ENABLE_SDMA settings."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
import torch
from ep_cases import Case, make_config, rank_inputs
from pe_pool import PeError
from test_ops_cpu import BF16, run

import mori.shmem as shmem
from mori.ops._layout import plan_routing, reference_combine

# ---- the reference quantizers (numpy; torch only for the e4m3 cast) ---------------------------
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def fp4_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest e2m1 value (a tie to the even code), saturated at 6: by distance to
    every grid value, not by thresholds."""
    dist = np.abs(np.abs(x)[..., None] - FP4_GRID)
    best = dist.min(axis=-1, keepdims=True)
    ties = dist == best
    code = np.where(
        ties[..., 0::2].any(axis=-1), np.argmax(ties & (np.arange(8) % 2 == 0), axis=-1), np.argmax(ties, axis=-1)
    )
    return np.copysign(FP4_GRID[code], x).astype(np.float32)


def dequantized(rows: Any, kind: str, scale_dim: int) -> Any:
    """What a receiver adds up for bf16 ``rows`` [n, h] sent on the ``kind`` wire: MORI's rule."""
    x = rows.float().numpy()
    n, h = x.shape
    be = -(-h // scale_dim)
    out = np.zeros_like(x)
    for sb in range(scale_dim):
        blk = x[:, sb * be : (sb + 1) * be]
        if blk.shape[1] == 0:
            continue
        m = np.abs(blk).max(axis=1, keepdims=True).astype(np.float32)
        if kind == "fp8_blockwise":
            big = m > 448
            inv = np.where(big, np.float32(448) / np.where(big, m, 1), np.float32(1)).astype(np.float32)
            scale = np.where(big, m * np.float32(1 / 448), np.float32(1)).astype(np.float32)
            q = torch.from_numpy(np.clip(blk * inv, -448, 448)).to(torch.float8_e4m3fn).float().numpy()
        else:
            live = m > 0
            inv = np.where(live, np.float32(6) / np.where(live, m, 1), np.float32(0)).astype(np.float32)
            scale = np.where(live, m / np.float32(6), np.float32(1)).astype(np.float32)
            q = fp4_round((blk * inv).astype(np.float32))
        out[:, sb * be : (sb + 1) * be] = (q * scale).astype(np.float32)
    return torch.from_numpy(out)


# ---- rounds ------------------------------------------------------------------------------------
_ops: dict[Any, Any] = {}


def _op(case: Case, env: dict[str, str], **overrides: Any) -> Any:
    import mori.ops

    os.environ.update(env)
    key = repr((dataclasses.replace(case, seed=0), sorted(env.items()), sorted(overrides.items())))
    if key not in _ops:
        _ops[key] = mori.ops.EpDispatchCombineOp(make_config(case, shmem.shmem_mype(), **overrides))
    return _ops[key]


def pe_quant_round(
    case: Case, quant: str, scale_dim: int, identity: bool, device: str = "cpu", overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One round with ``quant_type=quant``: the experts scale alternate rows by 100 (blocks above
    and below fp8's 448), or return their rows (``identity``, MORI's check). CPU copies back."""
    op = _op(case, {"MORI_FP8_COMBINE_SCALE_DIM": str(scale_dim)}, quant_type=quant, **(overrides or {}))
    rank = op.config.rank
    inp = rank_inputs(case, rank, device)
    tokens, w, _, _, total = op.dispatch(inp["input"], inp["weights"], None, inp["indices"])
    n = int(total)
    gain = torch.ones(n, 1, device=device) if identity else 1 + 99 * (torch.arange(n, device=device) % 2)[:, None]
    y = (tokens[:n].float() * gain + (0 if identity else rank)).to(torch.bfloat16)
    src = op.get_dispatch_src_token_pos().cpu().clone()
    out, out_w = op.combine(y, w, inp["indices"])
    m = inp["input"].shape[0]
    return {
        "src_pos": src,
        "combine_in": y.cpu().clone(),
        "combined": out[:m].cpu().clone(),
        "weights": w[:n].cpu().clone(),
        "combined_weights": out_w[:m].cpu().clone(),
    }


QUANT = Case(world=0, max_tokens=8, hidden=256, k=6, experts_per_rank=2)


@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
@pytest.mark.parametrize("shape", [(256, 2), (100, 3), (48, 56)], ids=["blocks128", "ragged", "default56"])
def test_blockwise_combine_byte_for_byte(pool, quant, shape):
    """Every PE's combine equals the sum of the numpy-quantized rows, byte for byte; weights exact."""
    hidden, scale_dim = shape
    case = dataclasses.replace(QUANT, world=pool.n, hidden=hidden, seed=hidden, full=True)
    check_blockwise(case, pool.run(pe_quant_round, case, quant, scale_dim, False), quant, scale_dim)


def check_blockwise(case: Case, results: list[dict[str, Any]], quant: str, scale_dim: int) -> None:
    """Every PE's combine of a pe_quant_round (not identity) against the numpy quantizer."""
    world = case.world
    all_ids = [rank_inputs(case, r)["indices"] for r in range(world)]
    terms = [dequantized(res["combine_in"], quant, scale_dim) for res in results]
    src = [res["src_pos"] for res in results]
    max_send = world * case.max_tokens
    scaled_blocks = 0
    for r, res in enumerate(results):
        want = reference_combine(all_ids[r], r, case.experts_per_rank, terms, src, max_send, torch.bfloat16)
        assert torch.equal(res["combined"].view(torch.int16), want.view(torch.int16)), (
            f"PE {r}: {(res['combined'].float() != want.float()).sum()} elements differ"
        )
        want_w = reference_combine(
            all_ids[r], r, case.experts_per_rank, [x["weights"] for x in results], src, max_send, torch.float32
        )
        assert torch.equal(res["combined_weights"], want_w)
        scaled_blocks += int((res["combine_in"].float().abs() > 448).sum())
    assert scaled_blocks > 0  # the fp8 rule's scaled branch ran


@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
def test_blockwise_within_moris_tolerance(pool, quant):
    """Identity experts: each token comes back times its distinct ranks, within MORI's bounds
    (fp8: atol = rtol = 7e-2; fp4: block max / 6 per rank, + 5e-2 relative + 1e-2)."""
    case = dataclasses.replace(QUANT, world=pool.n, hidden=7168 // 28, seed=3, invalid=0.0)
    check_within_moris_tolerance(case, pool.run(pe_quant_round, case, quant, 2, True), quant, 2)


def check_within_moris_tolerance(case: Case, results: list[dict[str, Any]], quant: str, scale_dim: int) -> None:
    """An identity-expert pe_quant_round against the unquantized sum, with MORI's tolerances."""
    for r, res in enumerate(results):
        inp = rank_inputs(case, r)
        pes = (plan_routing(inp["indices"], case.experts_per_rank, case.world) >= 0).sum(dim=1)
        want = (inp["input"].float() * pes[:, None]).to(torch.bfloat16).float()
        got = res["combined"].float()
        if quant == "fp8_blockwise":
            assert torch.allclose(got, want, atol=7e-2, rtol=7e-2)
        else:
            x = inp["input"].float().abs()
            block_max = x.view(x.shape[0], scale_dim, -1).amax(dim=2).repeat_interleave(x.shape[1] // scale_dim, 1)
            tol = block_max / 6 * pes[:, None] + 5e-2 * want.abs() + 1e-2
            assert bool(((got - want).abs() <= tol).all())


def test_fp8_fnuz_combine_input(pool):
    """fp8 e4m3fnuz expert outputs: summed in float32, rounded once to e4m3fnuz, byte for byte."""
    run(
        pool,
        Case(world=0, max_tokens=8, hidden=64, k=5, experts_per_rank=2, combine_dtype=torch.float8_e4m3fnuz),
        [31, 32],
    )


def fp4_codes(x: Any) -> Any:
    """float32 [n, 2m] -> packed e2m1 bytes [n, m] (numpy reference encoder)."""
    v = fp4_round(x.numpy().astype(np.float32))
    code = np.searchsorted(FP4_GRID, np.abs(v)).astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)
    return torch.from_numpy(code[:, 0::2] | (code[:, 1::2] << 4))


def fp4_values(b: Any) -> Any:
    b = b.view(torch.uint8).numpy()
    codes = np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1)
    return torch.from_numpy(np.where(codes & 8, -1, 1) * FP4_GRID[codes & 7]).float()


def fp4_tokens(case: Case, rank: int) -> Any:
    """Rank ``rank``'s tokens as packed fp4 (``[n, hidden / 2]`` float4_e2m1fn_x2)."""
    return fp4_codes(rank_inputs(case, rank)["input"].float() * 0.25).view(torch.float4_e2m1fn_x2)


def pe_fp4_round(case: Case, device: str = "cpu", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Packed fp4 tokens dispatched (bytes moved as they are), fp4 expert outputs combined."""
    op = _op(case, {}, **(overrides or {}))
    rank = op.config.rank
    inp = rank_inputs(case, rank, device)
    x = fp4_tokens(case, rank).to(device)
    tokens, _, _, _, total = op.dispatch(x, None, None, inp["indices"])
    n = int(total)
    received = tokens[:n].view(torch.uint8).cpu().clone()
    y = fp4_codes(fp4_values(received) * 0.5 + 0.5 * rank).to(device).view(torch.float4_e2m1fn_x2)
    src = op.get_dispatch_src_token_pos().cpu().clone()
    out, _ = op.combine(y, None, inp["indices"])
    return {
        "src_pos": src,
        "tokens": received,
        "combine_in": y.view(torch.uint8).cpu().clone(),
        "combined": out[: x.shape[0]].view(torch.uint8).cpu().clone(),
    }


def test_fp4_dispatch_and_combine(pool):
    """Packed fp4 (float4_e2m1fn_x2) tokens dispatched byte for byte, and fp4 expert outputs: each
    element summed in float32 and rounded once to e2m1, two a byte, as the numpy reference."""
    case = Case(world=pool.n, max_tokens=7, hidden=64, k=4, experts_per_rank=2, seed=33)
    check_fp4(case, pool.run(pe_fp4_round, case))


def check_fp4(case: Case, results: list[dict[str, Any]]) -> None:
    all_ids = [rank_inputs(case, r)["indices"] for r in range(case.world)]
    sent = [fp4_tokens(case, r).view(torch.uint8) for r in range(case.world)]
    terms = [fp4_values(res["combine_in"]) for res in results]
    max_send = case.world * case.max_tokens
    for r, res in enumerate(results):
        for s, pos in enumerate(res["src_pos"].tolist()):
            assert torch.equal(res["tokens"][s], sent[pos // max_send][pos % max_send]), (r, s)
        sums = reference_combine(
            all_ids[r],
            r,
            case.experts_per_rank,
            terms,
            [x["src_pos"] for x in results],
            case.world * case.max_tokens,
            torch.float32,
        )
        assert torch.equal(res["combined"], fp4_codes(sums)), f"PE {r}"


# ---- settings ------------------------------------------------------------------------------------
def pe_settings(env: dict[str, str], kernel: str) -> Any:
    """Builds an op under ``env``; returns its launch config and settings, or the error's text."""
    from mori.ops import EpDispatchCombineKernelType

    saved = {k: os.environ.get(k) for k in env}
    try:
        op = _op(
            dataclasses.replace(BF16, world=shmem.shmem_npes()), env, kernel_type=EpDispatchCombineKernelType[kernel]
        )
        return op.get_launch_config(True, 3, 3, 3), op.settings.sdma
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.parametrize(
    ("kernel", "want"),
    [
        ("IntraNode", (128, 0, 16)),
        ("InterNodeV1", (96, 64, 8)),
        ("InterNodeV1LL", (256, 128, 8)),
        ("AsyncLL", (128, 0, 16)),
    ],
)
def test_launch_config_auto_is_moris_fallback(pool, kernel, want):
    for got in pool.run(pe_settings, {"MORI_EP_LAUNCH_CONFIG_MODE": "AUTO"}, kernel):
        assert got == (want, False)
    for got in pool.run(pe_settings, {"MORI_EP_LAUNCH_CONFIG_MODE": "MANUAL"}, kernel):
        assert got == ((3, 3, 3), False)


def test_rounds_under_auto_launch_and_sdma(pool):
    """AUTO geometry (16 warps a block) and MORI_ENABLE_SDMA=1: results as always."""
    pool.run(_setenv, {"MORI_EP_LAUNCH_CONFIG_MODE": "auto", "MORI_ENABLE_SDMA": "1"})
    try:
        run(pool, dataclasses.replace(BF16, hidden=40), [51, 52])
    finally:
        pool.run(_unsetenv, ["MORI_EP_LAUNCH_CONFIG_MODE", "MORI_ENABLE_SDMA"])


def _setenv(env: dict[str, str]) -> None:
    os.environ.update(env)


def _unsetenv(names: list[str]) -> None:
    for name in names:
        os.environ.pop(name, None)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MORI_EP_LAUNCH_CONFIG_MODE": "FAST"}, "ConfigError: MORI_EP_LAUNCH_CONFIG_MODE='FAST' is not accepted"),
        ({"MORI_EP_COMM": "cco"}, "ValueError: MORI_EP_COMM=cco: mori provides no mori.cco"),
        ({"MORI_EP_COMM": "nccl"}, "ConfigError: MORI_EP_COMM='nccl' is not accepted"),
        ({"MORI_ENABLE_SDMA": "maybe"}, "ConfigError: MORI_ENABLE_SDMA='maybe' is not a flag"),
        ({"MORI_FP8_COMBINE_SCALE_DIM": "0"}, "ConfigError: MORI_FP8_COMBINE_SCALE_DIM='0' is not accepted"),
    ],
)
def test_bad_settings_are_refused_before_allocating(pool, env, message):
    before = pool.run(_heap_used)
    for got in pool.run(pe_settings, env, "IntraNode"):
        assert isinstance(got, str) and got.startswith(message), got
    assert pool.run(_heap_used) == before


def _heap_used() -> int:
    return int(shmem.shmem_heap_info()["in_use"])


def test_sdma_flag_is_accepted(pool):
    for got in pool.run(pe_settings, {"MORI_ENABLE_SDMA": "1", "MORI_EP_COMM": "shmem"}, "AsyncLL"):
        assert got == ((3, 3, 3), True)


def pe_bad_wire() -> list[str]:
    case = dataclasses.replace(QUANT, world=shmem.shmem_npes())
    op = _op(case, {"MORI_FP8_COMBINE_SCALE_DIM": "2"}, quant_type="fp8_blockwise")
    inp = rank_inputs(case, op.config.rank)
    tokens, _, _, _, total = op.dispatch(inp["input"], None, None, inp["indices"])
    n = int(total)
    errors = []
    for y in (tokens[:n].to(torch.float8_e4m3fn), op.get_registered_combine_input_buffer(torch.bfloat16)):
        try:
            op.combine(y, None, inp["indices"])
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    op.combine(tokens[:n].clone(), None, inp["indices"])
    return errors


def test_blockwise_refuses_what_it_cannot_quantize(pool):
    for errors in pool.run(pe_bad_wire):
        assert "combines bfloat16 input, got torch.float8_e4m3fn" in errors[0]
        assert "cannot combine from the registered buffer itself" in errors[1]


def test_blockwise_needs_external_input_buffer(pool):
    with pytest.raises(PeError, match="needs use_external_inp_buf=True"):
        pool.run(pe_zero_copy_blockwise, dataclasses.replace(QUANT, world=pool.n))


def pe_zero_copy_blockwise(case: Case) -> None:
    _op(case, {}, quant_type="fp4_blockwise", use_external_inp_buf=False)
