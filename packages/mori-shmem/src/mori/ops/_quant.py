"""How combine rows travel between PEs (the wire), in PyTorch: the CPU backend runs these, and the
GPU kernels (kernels/ep_wire.cuh, ep_intranode.cu) implement the same arithmetic operation for
operation.

- ``same``: the row as it is (bf16, float32, fp8 e4m3 / e4m3fnuz, packed fp4 e2m1).
- ``fp8_cast`` (``quant_type="fp8_direct_cast"``): bf16 cast to fp8 e4m3, round to nearest.
- ``fp8_blockwise`` / ``fp4_blockwise``: MORI's blockwise combine quantizations. A row of ``hidden``
  bf16 values is cut into ``scale_dim`` blocks of ``ceil(hidden / scale_dim)`` elements
  (``MORI_FP8_COMBINE_SCALE_DIM``, 56 by default: 128 at hidden 7168); each block gets one float32
  scale. fp8: a block whose largest magnitude ``m`` exceeds 448 is sent as ``x * (448 / m)`` with
  scale ``m * (1 / 448)``, any other block as ``x`` with scale 1 (MORI's rule). fp4: every block is
  sent as ``x * (6 / m)`` in e2m1 (round to nearest even, saturated at 6), two values a byte (low
  nibble first), with scale ``m / 6`` (1 for an all-zero block). The staged row is the codes
  (padded to 16 bytes), then the ``scale_dim`` float32 scales. The receiver sums ``code * scale``
  per source row in float32, in top-k order (a multiply, then an add, each rounded), and rounds once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CombineWire", "FP4_VALUES", "fp4_decode", "fp4_encode", "pack_fp4", "unpack_fp4"]

#: e2m1 values of the codes 0..7 (code | 8 is the negative value).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Midpoints between neighbouring e2m1 magnitudes; a tie goes to the even code.
_FP4_EDGES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
FP8_MAX = 448.0
FP4_MAX = 6.0


def _align(n: int, to: int = 16) -> int:
    return (n + to - 1) // to * to


def fp4_encode(x: Any) -> Any:
    """float32 values -> e2m1 codes (uint8 0..15): round to nearest even, saturated at +-6."""
    import torch

    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, edge in enumerate(_FP4_EDGES):
        # Past the midpoint, or on it when the upper neighbour's code (i + 1) is even.
        up = mag > edge if i % 2 == 0 else mag >= edge
        code += up.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def fp4_decode(code: Any) -> Any:
    """e2m1 codes (uint8 0..15) -> float32."""
    import torch

    lut = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32, device=code.device)
    return lut[code.long()]


def pack_fp4(code: Any) -> Any:
    """``[..., 2n]`` codes -> ``[..., n]`` bytes, element ``2i`` in the low nibble."""
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_fp4(packed: Any) -> Any:
    """``[..., n]`` bytes -> ``[..., 2n]`` codes."""
    import torch

    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


@dataclass(frozen=True)
class CombineWire:
    """The wire of one combine call: ``kind`` (see the module doc), the input dtype ``dtype`` and
    ``hidden`` columns of it, and ``scale_dim`` for the blockwise kinds. ``cols``/``storage`` shape
    the staged buffer's view of a row."""

    kind: str
    dtype: Any
    hidden: int
    scale_dim: int = 0

    @property
    def blockwise(self) -> bool:
        return self.kind in ("fp8_blockwise", "fp4_blockwise")

    @property
    def block_elems(self) -> int:
        return -(-self.hidden // self.scale_dim)

    @property
    def code_bytes(self) -> int:
        """Bytes of a blockwise row's codes (padded to 16, so that the scales are aligned)."""
        return _align(self.hidden if self.kind == "fp8_blockwise" else -(-self.hidden // 2))

    @property
    def storage(self) -> Any:
        import torch

        if self.blockwise:
            return torch.uint8
        return torch.float8_e4m3fn if self.kind == "fp8_cast" else self.dtype

    @property
    def cols(self) -> int:
        return self.code_bytes + 4 * self.scale_dim if self.blockwise else self.hidden

    @property
    def row_bytes(self) -> int:
        return self.cols * self.storage.itemsize  # per combine call: no tensor made to ask

    def _blocks(self, rows: Any) -> Any:
        """``rows`` in float32 as ``[n, scale_dim, block_elems]`` (zeros past ``hidden``)."""
        import torch

        x = rows.to(torch.float32)
        pad = self.scale_dim * self.block_elems - self.hidden
        if pad:
            x = torch.cat([x, x.new_zeros(x.shape[0], pad)], dim=1)
        return x.view(x.shape[0], self.scale_dim, self.block_elems)

    def encode(self, rows: Any) -> Any:
        """Caller rows ``[n, hidden]`` -> staged rows as bytes ``[n, row_bytes]``."""
        import torch

        if not self.blockwise:
            return (rows.to(self.storage) if rows.dtype != self.storage else rows).view(torch.uint8)
        x = self._blocks(rows)
        m = x.abs().amax(dim=2, keepdim=True)
        one = torch.ones_like(m)

        def div(a: float, b: Any) -> Any:  # IEEE a / b (a Python number over a tensor is b's reciprocal times a)
            return torch.div(torch.full_like(b, a), b)

        if self.kind == "fp8_blockwise":
            scaled = m > FP8_MAX
            scale = torch.where(scaled, m * torch.full_like(m, 1.0 / FP8_MAX), one)
            inv = torch.where(scaled, div(FP8_MAX, torch.where(scaled, m, one)), one)
            q = (x * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
            codes = q.flatten(1)[:, : self.hidden]
        else:
            live = m > 0
            scale = torch.where(live, torch.div(m, torch.full_like(m, FP4_MAX)), one)
            inv = torch.where(live, div(FP4_MAX, torch.where(live, m, one)), torch.zeros_like(m))
            codes = fp4_encode(x * inv).flatten(1)[:, : self.hidden]
            if self.hidden % 2:
                codes = torch.cat([codes, codes.new_zeros(codes.shape[0], 1)], dim=1)
            codes = pack_fp4(codes)
        out = torch.zeros(rows.shape[0], self.cols, dtype=torch.uint8, device=rows.device)
        out[:, : codes.shape[1]] = codes
        out[:, self.code_bytes :] = scale.view(rows.shape[0], self.scale_dim).contiguous().view(torch.uint8)
        return out

    def terms(self, staged: Any) -> Any:
        """Staged rows as bytes ``[n, row_bytes]`` -> the float32 values ``[n, elements]`` the
        receiver adds up (blockwise: each code's value times its block's scale, rounded to float32)."""
        import torch

        if self.kind == "fp8_blockwise":
            values = staged[:, : self.hidden].view(torch.float8_e4m3fn).to(torch.float32)
        elif self.kind == "fp4_blockwise":
            values = fp4_decode(unpack_fp4(staged[:, : self.code_bytes])[:, : self.hidden])
        elif self.dtype == torch.float4_e2m1fn_x2:
            return fp4_decode(unpack_fp4(staged))
        else:
            return staged.view(self.storage).to(torch.float32)
        scales = staged[:, self.code_bytes :].contiguous().view(torch.float32)
        return values * scales.repeat_interleave(self.block_elems, dim=1)[:, : self.hidden]

    def finish(self, acc: Any) -> Any:
        """float32 sums ``[..., elements]`` rounded once to the input dtype, as bytes."""
        import torch

        if self.dtype == torch.float4_e2m1fn_x2:
            return pack_fp4(fp4_encode(acc))
        return acc.to(self.dtype).view(torch.uint8)
