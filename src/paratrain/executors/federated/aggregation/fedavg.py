"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks
from Decentralized Data").

Server step: ``w ← w + Σ_i n_i Δ_i / Σ_i n_i`` with ``n_i`` the client's example
count, i.e. the example-weighted mean of the client models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._common import Update, apply_step, check_weights

__all__ = ["fedavg_step", "FedAvgAggregator"]


def fedavg_step(updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
    """The example-weighted mean of the updates, per key, in float64.

    Accumulated update by update in the given order (one float64 buffer per key, no
    stacked copy), so memory stays flat in the number of clients.
    """
    n = len(updates)
    w = check_weights(weights, n)
    total = float(w.sum())
    out: dict[str, Tensor] = {}
    for name in updates[0]:
        acc = torch.zeros(updates[0][name].shape, dtype=torch.float64)
        for u, wi in zip(updates, w.tolist(), strict=True):
            acc.add_(u[name].detach(), alpha=wi)  # in float64: add_ promotes without a copy
        out[name] = acc / total
    return out


class FedAvgAggregator:
    """Stateless FedAvg server."""

    name = "FedAvg"

    def aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Sequence[Update],
        weights: Sequence[float],
    ) -> dict[str, Tensor]:
        return apply_step(global_state, fedavg_step(updates, weights))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None
