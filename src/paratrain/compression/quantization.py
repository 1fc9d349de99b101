"""``{"method":"Quantization","bits":b}``: per-tensor min-max uniform quantization, packed.

With lo = min(x), hi = max(x), L = 2^b - 1 levels and s = (hi - lo) / L, each value
maps to a code q_i in {0..L} and back to D(q)_i = lo + s q_i:

* stochastic rounding (default): q_i = floor((x_i - lo)/s + u_i), u_i ~ U[0, 1), so
  E[D(q)_i] = x_i (unbiased) and |D(q)_i - x_i| < s (QSGD, Alistarh et al., NeurIPS
  2017; Gupta et al., "Deep learning with limited numerical precision", ICML 2015);
* deterministic: q_i = floor((x_i - lo)/s + 1/2), |D(q)_i - x_i| <= s/2.

A constant tensor has s = 0 and decodes exactly. Non-finite inputs cannot be quantized
and raise :class:`CompressionError`. The noise is a function of derive_seed(seed, step,
key) only (a counter-based hash of the element index on the CPU, a seeded torch
generator on other devices), so a resumed run draws the same noise.

On the CPU, quantization runs block by block in cache straight into the packed payload
(:func:`_quantize_blocked`) and decoding runs block by block from it
(:func:`dequantize_packed`); both give bit-identical results to the plain torch path
for deterministic rounding (tested).

Codes are **bit-packed** little-endian, least significant bit first: code i occupies
bits [i*b, (i+1)*b) of the payload, so n codes take exactly ceil(n*b/8) bytes
(4 bits: two codes per byte). Packing works on groups of 8/gcd(b, 8) codes that fill
b/gcd(b, 8) whole bytes, with one vectorised shift-or per (code, byte) overlap.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import CompressedTensor, EncodeContext
from .quant_kernels import (
    dequantize,
    dequantize_packed,
    pack_codes,
    packed_nbytes,
    quantize_packed,
    unpack_codes,
)

__all__ = [
    "QuantizationCodec",
    "pack_codes",
    "unpack_codes",
    "packed_nbytes",
    "quantize_packed",
    "dequantize",
    "dequantize_packed",
]


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
        packed, lo, scale = quantize_packed(
            flat, self.bits, stochastic=self.stochastic, seed=ctx.derived_seed("Quantization")
        )
        return CompressedTensor(
            "Quantization", shape, flat.dtype, packed,
            bits=self.bits, offset=lo, scale=scale, stochastic=self.stochastic,
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
