"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks").

Client objective: ``h_i(w) = F_i(w) + (μ/2)·‖w − w_global‖²`` with ``w_global``
detached (the round's starting global model); the server aggregates like FedAvg.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .fedavg import FedAvgAggregator

__all__ = ["proximal_term", "FedProxAggregator"]


def proximal_term(params: Iterable[Tensor], global_params: Iterable[Tensor], mu: float) -> Tensor:
    """``(μ/2)·Σ_k ‖w_k − w_global,k‖²`` (squared L2 norm; global weights detached)."""
    total: Tensor | None = None
    for p, g in zip(params, global_params, strict=True):
        sq = (p - g.detach()).pow(2).sum()
        total = sq if total is None else total + sq
    if total is None:
        return torch.zeros(())
    return 0.5 * mu * total


class FedProxAggregator(FedAvgAggregator):
    """Server side of FedProx: example-weighted FedAvg. ``mu`` is used by the clients."""

    name = "FedProx"
    spec_fields = ("mu",)

    def __init__(self, mu: float) -> None:
        if mu < 0:
            raise ValueError(f"FedProx mu must be >= 0 (got {mu})")
        self.mu = float(mu)
