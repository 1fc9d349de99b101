"""Coordinate-wise robust aggregators (Yin et al. 2018), unweighted so that a client cannot
buy influence by claiming many examples. FedMedian: per coordinate the median of the client
values (even count: the mean of the two middle ones). FedTrimmedAvg: per coordinate the
mean after dropping ``int(beta n)`` values from each end (``0 <= beta < 0.5``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import Aggregator, Update, stack_key, update_names


def coordinate_median(stacked: Tensor) -> Tensor:
    """Median over dim 0 of ``(n, *shape)``; even ``n`` averages the two middle values."""
    n = stacked.shape[0]
    if n == 0:
        raise ValueError("median over zero updates")
    s, _ = torch.sort(stacked.to(torch.float64), dim=0)
    if n % 2 == 1:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2.0


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


class FedMedianAggregator(Aggregator):
    name = "FedMedian"

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        return {name: coordinate_median(stack_key(updates, name)) for name in update_names(updates)}


class FedTrimmedAvgAggregator(Aggregator):
    name = "FedTrimmedAvg"
    spec_fields = ("beta",)

    def __init__(self, beta: float = 0.2) -> None:
        self.beta = float(beta)

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        return {name: trimmed_mean(stack_key(updates, name), self.beta) for name in update_names(updates)}
