"""``{"method":"Quantization","bits":b}``: per-tensor min-max uniform quantization, packed.

With lo = min(x), hi = max(x), L = 2^b - 1 levels and s = (hi - lo) / L, each value
maps to a code q_i in {0..L} and back to D(q)_i = lo + s q_i:

* stochastic rounding (default): q_i = floor((x_i - lo)/s + u_i), u_i ~ U[0, 1), so
  E[D(q)_i] = x_i (unbiased) and |D(q)_i - x_i| < s (QSGD, Alistarh et al., NeurIPS
  2017; Gupta et al., "Deep learning with limited numerical precision", ICML 2015);
* deterministic: q_i = floor((x_i - lo)/s + 1/2), |D(q)_i - x_i| <= s/2.

A constant tensor has s = 0 and decodes exactly. Non-finite inputs cannot be quantized
and raise :class:`CompressionError`. The noise comes from a generator seeded by
(seed, step, key), so a resumed run draws the same noise.

Codes are **bit-packed** little-endian, least significant bit first: code i occupies
bits [i*b, (i+1)*b) of the payload, so n codes take exactly ceil(n*b/8) bytes
(4 bits: two codes per byte). Packing works on groups of 8/gcd(b, 8) codes that fill
b/gcd(b, 8) whole bytes, with one vectorised shift-or per (code, byte) overlap.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import CompressedTensor, CompressionError, EncodeContext

__all__ = [
    "QuantizationCodec",
    "pack_codes",
    "unpack_codes",
    "packed_nbytes",
    "quantize",
    "dequantize",
]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits: ceil(n*bits/8)."""
    return (n * bits + 7) // 8


def _code_dtype(bits: int) -> torch.dtype:
    if bits <= 8:
        return torch.uint8
    if bits <= 16:
        return torch.int32
    return torch.int64


def _compute_dtype(bits: int, dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if bits > 16 or dtype == torch.float64 else torch.float32


def _overlaps(bits: int) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(codes per group, bytes per group, [(code i, byte j, shift = i*bits - 8j)])."""
    g = 8 // math.gcd(bits, 8)
    nbytes = bits * g // 8
    pairs = []
    for j in range(nbytes):
        for i in range(g):
            if i * bits < 8 * (j + 1) and (i + 1) * bits > 8 * j:
                pairs.append((i, j, i * bits - 8 * j))
    return g, nbytes, pairs


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2^bits) into ceil(n*bits/8) uint8 (LSB first)."""
    n = codes.numel()
    if bits == 8:
        return codes.to(torch.uint8)
    if bits in (16, 32):
        # A narrowing integer cast keeps the low bits; the byte view is little-endian.
        wide = codes.to(torch.int16 if bits == 16 else torch.int32)
        return wide.view(torch.uint8).reshape(-1)
    g, nbytes, pairs = _overlaps(bits)
    groups = -(-n // g)
    work_dtype = _code_dtype(bits)
    q = codes.to(work_dtype)
    if groups * g != n:
        q = torch.cat([q, q.new_zeros(groups * g - n)])
    q = q.view(groups, g)
    out = torch.zeros((groups, nbytes), dtype=work_dtype, device=codes.device)
    for i, j, shift in pairs:
        col = q[:, i]
        out[:, j] |= (col << shift) if shift >= 0 else (col >> -shift)
    if work_dtype != torch.uint8:
        out &= 0xFF
    return out.to(torch.uint8).reshape(-1)[: packed_nbytes(n, bits)]


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``n`` codes (uint8/int32/int64 by bit width)."""
    if packed.numel() != packed_nbytes(n, bits):
        raise CompressionError(
            f"quantized payload has {packed.numel()} bytes, expected {packed_nbytes(n, bits)}"
        )
    if bits == 8:
        return packed.clone()
    if bits == 16:
        return packed.view(torch.int16).to(torch.int32) & 0xFFFF
    if bits == 32:
        return packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    g, nbytes, pairs = _overlaps(bits)
    groups = -(-n // g)
    work_dtype = _code_dtype(bits)
    b = packed.to(work_dtype)
    if groups * nbytes != b.numel():
        b = torch.cat([b, b.new_zeros(groups * nbytes - b.numel())])
    b = b.view(groups, nbytes)
    out = torch.zeros((groups, g), dtype=work_dtype, device=packed.device)
    for i, j, shift in pairs:
        col = b[:, j]
        out[:, i] |= (col >> shift) if shift >= 0 else (col << -shift)
    out &= (1 << bits) - 1
    return out.reshape(-1)[:n]


def quantize(
    flat: torch.Tensor, bits: int, *, stochastic: bool, generator: torch.Generator | None
) -> tuple[torch.Tensor, float, float]:
    """Codes (unpacked), lo and scale for a flat tensor; see the module docstring."""
    if not 1 <= bits <= 32:
        raise CompressionError(f"Quantization.bits must be in 1..32, got {bits}")
    n = flat.numel()
    if n == 0:
        return torch.zeros(0, dtype=_code_dtype(bits), device=flat.device), 0.0, 0.0
    cdt = _compute_dtype(bits, flat.dtype)
    lo_t, hi_t = torch.aminmax(flat)
    lo, hi = float(lo_t), float(hi_t)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise CompressionError(
            f"cannot quantize a tensor with non-finite values (min={lo}, max={hi})"
        )
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    if scale == 0.0 or not math.isfinite(1.0 / scale):
        return torch.zeros(n, dtype=_code_dtype(bits), device=flat.device), lo, 0.0
    inv = 1.0 / scale
    # y = (x - lo)/s + r with r = u or 1/2; the cast truncates toward zero = floor, y >= 0.
    if stochastic:
        y = torch.rand(n, generator=generator, dtype=cdt, device=flat.device)
        y.add_(flat, alpha=inv).add_(-lo * inv)
    else:
        y = torch.mul(flat, inv) if flat.dtype == cdt else flat.to(cdt).mul_(inv)
        y.add_(0.5 - lo * inv)
    y.clamp_(0.0, float(levels))
    return y.to(_code_dtype(bits)), lo, scale


def dequantize(
    codes: torch.Tensor, lo: float, scale: float, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """lo + scale * codes, computed in float32 (float64 above 16 bits) and cast to dtype."""
    cdt = _compute_dtype(bits, dtype)
    y = codes.to(cdt)
    if scale != 0.0:
        y.mul_(scale)
    y.add_(lo)
    return y if cdt == dtype else y.to(dtype)


class QuantizationCodec:
    """Min-max uniform quantization to ``bits`` bits, stochastic rounding by default."""

    def __init__(self, bits: int, *, stochastic: bool = True) -> None:
        if not 1 <= bits <= 32:
            raise ValueError(f"Quantization.bits must be in 1..32, got {bits}")
        self.bits = bits
        self.stochastic = stochastic

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        gen = ctx.generator("Quantization", flat.device) if self.stochastic else None
        codes, lo, scale = quantize(flat, self.bits, stochastic=self.stochastic, generator=gen)
        return CompressedTensor(
            "Quantization", shape, flat.dtype, pack_codes(codes, self.bits),
            bits=self.bits, offset=lo, scale=scale, stochastic=self.stochastic,
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
