"""Byzantine-robust aggregators. Coordinate-wise (Yin et al. 2018), unweighted so that a
client cannot buy influence by claiming many examples: FedMedian, per coordinate the median
of the client values (even count: the mean of the two middle ones); FedTrimmedAvg, per
coordinate the mean after dropping ``int(beta n)`` values from each end (``0 <= beta < 0.5``).

Krum and Multi-Krum (Blanchard et al. 2017). With ``f = num_malicious`` and ``m = max(1, n
- f - 2)``, client ``i``'s score is ``s(i) = sum_{j in N_m(i)} ||x_i - x_j||^2`` over its ``m``
nearest others. Krum (``to_keep = 0``) steps by the lowest-scoring update, Multi-Krum by the
example-weighted mean of the ``to_keep`` lowest; ties go to the lowest client index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import Aggregator, Update, stack_key, update_names
from .fedavg import fedavg_step


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


def pairwise_squared_distances(x: Tensor) -> Tensor:
    """``d2[i, j] = sum_k (x[i, k] - x[j, k])^2`` (float64), summed directly: a squared square
    root or the ``|a|^2 + |b|^2 - 2ab`` shortcut would break exact ties. The upper triangle
    is mirrored (exactly symmetric); one ``(n, d)`` temporary per row."""
    n = x.shape[0]
    d2 = torch.zeros(n, n, dtype=x.dtype)
    for i in range(n - 1):
        row = (x[i + 1 :] - x[i]).square().sum(dim=1)
        d2[i, i + 1 :] = row
        d2[i + 1 :, i] = row
    return d2


def krum_scores(vectors: Tensor, num_malicious: int) -> Tensor:
    """Scores ``s(i)`` for the rows of ``vectors`` (``(n, d)``, float64)."""
    n = vectors.shape[0]
    if n == 0:
        raise ValueError("Krum over zero updates")
    x = vectors.to(torch.float64)
    d2 = pairwise_squared_distances(x)
    m = min(max(1, n - num_malicious - 2), n - 1)
    if m == 0:
        return torch.zeros(n, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.bool)
    d2 = d2.masked_fill(eye, float("inf"))
    nearest, _ = torch.sort(d2, dim=1)
    return nearest[:, :m].sum(1)


def krum_select(vectors: Tensor, num_malicious: int, to_keep: int) -> list[int]:
    """Indices chosen by Krum (``to_keep = 0``: one) or Multi-Krum (``to_keep`` lowest); a
    stable sort makes the lowest index win ties."""
    scores = krum_scores(vectors, num_malicious)
    order = torch.sort(scores, stable=True).indices.tolist()
    k = 1 if to_keep == 0 else min(to_keep, len(order))
    return [int(i) for i in order[:k]]


class KrumAggregator(Aggregator):
    name = "Krum"
    spec_fields = ("num_malicious", "to_keep")

    def __init__(self, *, num_malicious: int = 0, to_keep: int = 0) -> None:
        self.num_malicious = int(num_malicious)
        self.to_keep = int(to_keep)

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        names = update_names(updates)
        flat = torch.cat([stack_key(updates, k).reshape(len(updates), -1) for k in names], dim=1)
        chosen = krum_select(flat, self.num_malicious, self.to_keep)
        return fedavg_step([updates[i] for i in chosen], [weights[i] for i in chosen])
