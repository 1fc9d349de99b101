"""``{"method":"Threshold","threshold":t}``: keep the entries with |x_i| > t (strict).

C(x)_i = x_i if |x_i| > t else 0; NaN entries are kept (their magnitude is not <= t).
One cache-blocked pass (:func:`abs_above_indices`; ``hardshrink`` + ``nonzero`` off the
CPU) lists the survivors in ascending order. The number kept varies per tensor
and per rank, so in data parallelism the records travel by all-gather.
(Strom, "Scalable distributed DNN training using commodity GPU cloud computing", 2015.)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._kernels import abs_above_indices
from .base import CompressedTensor, EncodeContext

__all__ = ["ThresholdCodec", "threshold_indices", "representable_floor"]


_INT_VIEW = {
    torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
}


def representable_floor(t: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` that is <= t (t >= 0).

    Kernels compare in the input's precision, so the threshold is first rounded *down*
    to it: no value of that dtype lies in (floor(t), t], hence |x| > floor(t) is exactly
    |x| > t for every x of that dtype.
    """
    if dtype not in _INT_VIEW:
        return t
    td = torch.tensor([t], dtype=torch.float64).to(dtype)
    if float(td) > t:
        td = (td.view(_INT_VIEW[dtype]) - 1).view(dtype)
    return float(td)


def threshold_indices(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Ascending int64 indices of the entries with |x| > threshold (and NaN entries)."""
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=flat.device)
    return abs_above_indices(flat, representable_floor(threshold, flat.dtype))


class ThresholdCodec:
    """Keep |x| > threshold."""

    def __init__(self, threshold: float) -> None:
        if not math.isfinite(threshold) or threshold < 0:
            raise ValueError(f"Threshold.threshold must be finite and >= 0, got {threshold}")
        self.threshold = float(threshold)

    def encode(
        self, flat: torch.Tensor, shape: tuple[int, ...], ctx: EncodeContext
    ) -> CompressedTensor:
        idx = threshold_indices(flat, self.threshold)
        return CompressedTensor("Threshold", shape, flat.dtype, flat[idx], idx)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
