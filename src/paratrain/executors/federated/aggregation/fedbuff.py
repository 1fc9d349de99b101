"""FedBuff's server step (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS, Alg. 1) on a full buffer of ``K`` client deltas ``D_k``, client ``k``
holding ``n_k`` examples and started ``s_k`` server versions ago:

    w <- w + eta * sum_k g(s_k) n_k D_k / sum_k n_k,    g(s) = 1/sqrt(1 + s)  ("sqrt")
                                                         g(s) = 1             ("constant")

The normaliser is the buffer's example count, not ``sum_k g(s_k) n_k``: a stale update is
down-weighted, not renormalised back. With every ``s_k = 0`` and ``eta = 1`` the weights are
exactly ``n_k`` and the step is :func:`.fedavg.fedavg_step` bit for bit (FedAvg's
example-weighted mean). Which updates fill a buffer is the runtime's business (.buffered).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from ._common import Aggregator, Update, apply_step, check_weights
from .fedavg import fedavg_step


def staleness_weight(staleness: int, kind: str = "sqrt") -> float:
    """``g(s)``: ``1/sqrt(1+s)`` ("sqrt", the paper's) or 1 ("constant"); 1.0 exactly at s = 0."""
    if staleness < 0:
        raise ValueError(f"staleness {staleness} < 0")
    return 1.0 if kind == "constant" or staleness == 0 else 1.0 / math.sqrt(1.0 + staleness)


class FedBuffAggregator(Aggregator):
    """Stateless: the buffer and the clients in flight are the runtime's (.buffered)."""

    name = "FedBuff"
    spec_fields = ("staleness", "eta")

    def __init__(self, *, staleness: str = "sqrt", eta: float = 1.0) -> None:
        self.kind, self.eta = str(staleness), float(eta)

    def buffered_step(self, updates: Sequence[Update], weights: Sequence[float],
                      staleness: Sequence[int]) -> dict[str, Tensor]:
        """The module docstring's step ``Δ`` (float64 by tensor name)."""
        n = check_weights(weights, len(updates)).tolist()
        scaled = [staleness_weight(int(s), self.kind) * ni for s, ni in zip(staleness, n, strict=True)]
        step = fedavg_step(updates, scaled)  # sum g n D / sum g n
        factor = self.eta * sum(scaled) / sum(n)  # 1.0 exactly when every s = 0 and eta = 1
        return step if factor == 1.0 else {k: v * factor for k, v in step.items()}

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        return self.buffered_step(updates, weights, [0] * len(updates))

    def aggregate_round(self, global_state: Mapping[str, Tensor], updates: Sequence[Update],
                        weights: Sequence[float], infos: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        return apply_step(global_state, self.buffered_step(
            updates, weights, [int(i.get("staleness") or 0) for i in infos]))
