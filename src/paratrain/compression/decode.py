"""D(c): the dense tensor a compressed record stands for, by the record's (leaf) method.

Reads only the record's fields, so it needs no record type and no codec: the same
function decodes what any rank's codec stack produced (DESIGN §3).
"""

from __future__ import annotations

from typing import Any

import torch

from ._kernels import scatter_dense
from .errors import CompressionError
from .quant_kernels import dequantize_packed

__all__ = ["decompress"]


def decompress(c: Any) -> torch.Tensor:
    """D(c): the dense tensor of ``c.shape`` and ``c.dtype`` (may share memory with ``c``)."""
    n = c.numel
    if c.method == "None":
        if c.values.numel() != n:
            raise CompressionError(f"None record holds {c.values.numel()} values, expected {n}")
        dense: torch.Tensor = c.values.to(c.dtype).reshape(c.shape)
        return dense
    if c.method in ("TopK", "Threshold", "RandomK"):
        if c.indices is None or c.indices.numel() != c.values.numel():
            raise CompressionError(f"{c.method} record needs one index per value")
        return scatter_dense(n, c.indices, c.values, c.dtype).reshape(c.shape)
    if c.method == "Quantization":
        return dequantize_packed(c.values, n, c.offset, c.scale, c.bits, c.dtype).reshape(c.shape)
    raise CompressionError(f"unknown method {c.method!r}")
