"""FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization"): normalised averaging.

Client ``i`` runs ``tau_i`` local steps (its own count: more data, more steps) and reports
its normaliser ``a_i``: ``a_i = tau_i`` for plain SGD, and for SGD with heavy-ball momentum
``rho`` (the paper's momentum form)

    a_i = [tau_i - rho * (1 - rho^tau_i) / (1 - rho)] / (1 - rho).

The server normalises every delta and rescales by the effective step count:

    d_i     = (x - y_i) / a_i
    tau_eff = sum_i p_i a_i                 (= sum_i p_i tau_i for plain SGD)
    x      <- x - tau_eff * sum_i p_i d_i   = x + sum_i (p_i tau_eff / a_i) dy_i

with ``p_i = n_i / sum_S n_j`` (the selected clients' example shares) and ``dy_i = y_i - x``.
With equal ``a_i`` the coefficients are ``p_i``: FedAvg. Stateless on the server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._common import Aggregator, Update, apply_step, check_weights, linear_combination


def fednova_norm(steps: int, momentum: float = 0.0) -> float:
    """``a_i`` for ``steps`` local SGD steps with heavy-ball ``momentum`` (0: ``tau_i``)."""
    tau = int(steps)
    if tau < 1:
        raise ValueError(f"FedNova needs at least one local step (got {tau})")
    rho = float(momentum)
    if not 0.0 <= rho < 1.0:
        raise ValueError(f"FedNova momentum must be in [0, 1) (got {rho})")
    if rho == 0.0:
        return float(tau)
    return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)


def fednova_coefficients(weights: Sequence[float], norms: Sequence[float]) -> list[float]:
    """``p_i * tau_eff / a_i`` with ``tau_eff = sum p_i a_i`` (float64)."""
    n = len(norms)
    w = check_weights(weights, n)
    a = torch.tensor([float(v) for v in norms], dtype=torch.float64)
    if not bool(torch.isfinite(a).all()) or bool((a <= 0).any()):
        raise ValueError(f"FedNova normalisers must be finite and > 0 (got {list(norms)})")
    p = w / w.sum()
    tau_eff = float((p * a).sum())
    return (p * tau_eff / a).tolist()


class FedNovaAggregator(Aggregator):
    """FedNova's server: stateless; needs each client's ``a_i`` (``infos[i]["norm"]``)."""

    name = "FedNova"

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        raise ValueError("FedNova aggregates with each client's local step count (aggregate_round)")

    def aggregate_round(self, global_state: Mapping[str, Tensor], updates: Sequence[Update],
                        weights: Sequence[float], infos: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        """``x + Σ_i (p_i tau_eff / a_i) dy_i`` with ``a_i = infos[i]["norm"]``."""
        coef = fednova_coefficients(weights, [float(i["norm"]) for i in infos])
        return apply_step(global_state, linear_combination(updates, coef))


def valid_norm(value: Any) -> bool:
    """A reported ``a_i`` the server accepts: a finite number > 0."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
