"""FedTrimmedAvg (Yin et al. 2018): coordinate-wise trimmed mean.

For each coordinate, sort the ``n`` client values, drop ``c = int(β·n)`` from each end
and average the remaining ``n − 2c`` (``0 ≤ β < 0.5``, so at least one value is
left). ``β·n < 1`` cuts nothing (plain unweighted mean). Unweighted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._common import Update, apply_step, stack_key

__all__ = ["trimmed_mean", "FedTrimmedAvgAggregator"]


def trimmed_mean(stacked: Tensor, beta: float) -> Tensor:
    """Mean over dim 0 after cutting ``int(beta·n)`` values from each end per coordinate."""
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed mean beta must be in [0, 0.5) (got {beta})")
    n = stacked.shape[0]
    if n == 0:
        raise ValueError("trimmed mean over zero updates")
    cut = int(beta * n)
    s, _ = torch.sort(stacked.to(torch.float64), dim=0)
    return s[cut : n - cut].mean(0)


class FedTrimmedAvgAggregator:
    name = "FedTrimmedAvg"

    def __init__(self, beta: float = 0.2) -> None:
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"FedTrimmedAvg beta must be in [0, 0.5) (got {beta})")
        self.beta = float(beta)

    def aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Sequence[Update],
        weights: Sequence[float],
    ) -> dict[str, Tensor]:
        if not updates:
            raise ValueError("aggregating zero client updates")
        step = {name: trimmed_mean(stack_key(updates, name), self.beta) for name in updates[0]}
        return apply_step(global_state, step)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
