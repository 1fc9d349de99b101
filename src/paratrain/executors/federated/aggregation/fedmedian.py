"""FedMedian (Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal
Statistical Rates"): coordinate-wise median of the client models.

For each coordinate ``j``: ``step_j = median_i Δ_{i,j}``; with an even count the mean
of the two middle values (as ``numpy.median`` does). Unweighted: example counts are
ignored so that a client cannot buy influence by claiming many examples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import Aggregator, Update, stack_key, update_names

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


class FedMedianAggregator(Aggregator):
    name = "FedMedian"

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        return {name: coordinate_median(stack_key(updates, name)) for name in update_names(updates)}
