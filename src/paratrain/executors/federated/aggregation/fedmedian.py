"""FedMedian (Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal
Statistical Rates"): coordinate-wise median of the client models.

For each coordinate ``j``: ``step_j = median_i Δ_{i,j}``; with an even count the mean
of the two middle values (as ``numpy.median`` does). Unweighted: example counts are
ignored so that a client cannot buy influence by claiming many examples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._common import Update, apply_step, stack_key

__all__ = ["coordinate_median", "FedMedianAggregator"]


def coordinate_median(stacked: Tensor) -> Tensor:
    """Median over dim 0 of ``(n, *shape)``; even ``n`` averages the two middle values."""
    n = stacked.shape[0]
    if n == 0:
        raise ValueError("median over zero updates")
    s, _ = torch.sort(stacked.to(torch.float64), dim=0)
    if n % 2 == 1:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2.0


class FedMedianAggregator:
    name = "FedMedian"

    def aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Sequence[Update],
        weights: Sequence[float],
    ) -> dict[str, Tensor]:
        if not updates:
            raise ValueError("aggregating zero client updates")
        step = {name: coordinate_median(stack_key(updates, name)) for name in updates[0]}
        return apply_step(global_state, step)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
