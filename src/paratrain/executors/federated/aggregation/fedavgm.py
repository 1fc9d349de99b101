"""FedAvgM (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification"): server momentum.

    Δ_t = Σ n_i Δ_i / Σ n_i
    v_t = β·v_{t−1} + Δ_t            (v_0 = 0)
    w_{t+1} = w_t + η_s·v_t

With ``β = 0`` and ``η_s = 1`` this is FedAvg. The buffer ``v`` is the server state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._common import Aggregator, Update
from .fedavg import fedavg_step

__all__ = ["FedAvgMAggregator"]


class FedAvgMAggregator(Aggregator):
    name = "FedAvgM"
    spec_fields = ("server_momentum", "server_lr")

    def __init__(self, *, server_momentum: float = 0.9, server_lr: float = 1.0) -> None:
        if not 0.0 <= server_momentum < 1.0:
            raise ValueError(f"FedAvgM server_momentum must be in [0, 1) (got {server_momentum})")
        if server_lr <= 0:
            raise ValueError(f"FedAvgM server_lr must be > 0 (got {server_lr})")
        self.momentum = float(server_momentum)
        self.server_lr = float(server_lr)
        self.buf: dict[str, Tensor] = {}

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        delta = fedavg_step(updates, weights)
        step: dict[str, Tensor] = {}
        for name, d in delta.items():
            v = self.momentum * self.buf[name] + d if name in self.buf else d.clone()
            self.buf[name] = v
            step[name] = self.server_lr * v
        return step

    def state_dict(self) -> dict[str, Any]:
        return {"momentum_buffer": {k: v.clone() for k, v in self.buf.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.buf = {
            k: v.to(torch.float64).clone()
            for k, v in dict(state.get("momentum_buffer", {})).items()
        }
