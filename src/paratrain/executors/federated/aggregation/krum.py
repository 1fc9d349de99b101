"""Krum and Multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries:
Byzantine Tolerant Gradient Descent").

Each update is flattened to a vector ``x_i``. With ``f`` = ``num_malicious`` and
``m = max(1, n − f − 2)``, the score of client ``i`` is the sum of squared distances
to its ``m`` nearest other clients: ``s(i) = Σ_{j ∈ N_m(i)} ‖x_i − x_j‖²``.
``to_keep = 0`` (Krum): the step is the single update with the lowest score.
``to_keep = k > 0`` (Multi-Krum): the ``k`` lowest-scoring updates are averaged,
weighted by their example counts. Ties are broken by the lowest client index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._common import Aggregator, Update, stack_key, update_names
from .fedavg import fedavg_step


def pairwise_squared_distances(x: Tensor) -> Tensor:
    """``d2[i, j] = Σ_k (x[i, k] − x[j, k])²`` for the rows of ``x`` (float64).

    Squared distances are summed directly — never a square root squared back
    (``sqrt(d)² ≠ d`` in floating point, which would break exact ties in either
    direction) nor the ``‖a‖² + ‖b‖² − 2ab`` matmul shortcut. Only the upper
    triangle is computed and mirrored, so ``d2`` is exactly symmetric; for
    integer-valued updates (below 2**53 after squaring) every entry is exact.
    Memory is one ``(n, d)`` temporary per row, not ``(n, n, d)``.
    """
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
    m = max(1, n - num_malicious - 2)
    m = min(m, n - 1)
    if m == 0:
        return torch.zeros(n, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.bool)
    d2 = d2.masked_fill(eye, float("inf"))
    nearest, _ = torch.sort(d2, dim=1)
    return nearest[:, :m].sum(1)


def krum_select(vectors: Tensor, num_malicious: int, to_keep: int) -> list[int]:
    """Indices chosen by Krum (``to_keep = 0``: one) or Multi-Krum (``to_keep`` lowest).

    A stable sort makes the lowest index win ties.
    """
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
        self.last_selected: list[int] = []

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        names = update_names(updates)
        flat = torch.cat([stack_key(updates, k).reshape(len(updates), -1) for k in names], dim=1)
        chosen = krum_select(flat, self.num_malicious, self.to_keep)
        self.last_selected = chosen
        return fedavg_step([updates[i] for i in chosen], [weights[i] for i in chosen])
