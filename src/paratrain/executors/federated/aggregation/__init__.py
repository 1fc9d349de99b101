"""Federated aggregators: pure maths on lists of client updates (model deltas) + weights.

Every aggregator has ``aggregate(global_state, updates, weights) -> new_global_state``
(``updates[i]`` is client i's delta ``w_i − w_global`` by tensor name, ``weights[i]``
its example count) and ``state_dict()`` / ``load_state_dict()`` for its server state
(optimizer moments, momentum buffer), which the round checkpoint stores.
``build_aggregator(spec)`` maps a contract ``FederatedAggregation`` to one.

Extension methods that need more of each client than its delta (SCAFFOLD: the control
delta ``dc_i``; FedNova: the normaliser ``a_i``) also have
``aggregate_round(global_state, updates, weights, infos)``, ``infos[i]`` being client i's
``{"steps", "norm", "control"}`` (:class:`RoundAggregator`); the server calls it when present.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from torch import Tensor

from ._common import (
    MalformedUpdateError,
    Update,
    apply_step,
    check_weights,
    stack_key,
    validate_updates,
    weighted_mean,
)
from .fedadagrad import FedAdagradAggregator
from .fedadam import FedAdamAggregator
from .fedavg import FedAvgAggregator, fedavg_step
from .fedavgm import FedAvgMAggregator
from .fedmedian import FedMedianAggregator, coordinate_median
from .fednova import FedNovaAggregator, fednova_coefficients, fednova_norm
from .fedprox import FedProxAggregator, proximal_term
from .fedtrimmedavg import FedTrimmedAvgAggregator, trimmed_mean
from .fedyogi import FedYogiAggregator
from .krum import KrumAggregator, krum_scores, krum_select
from .scaffold import ScaffoldAggregator, control_keys, scaffold_client_control

__all__ = [
    "Aggregator", "build_aggregator", "Update", "MalformedUpdateError", "validate_updates",
    "weighted_mean", "apply_step", "check_weights", "stack_key",
    "fedavg_step", "coordinate_median", "trimmed_mean", "krum_scores", "krum_select",
    "proximal_term", "fednova_norm", "fednova_coefficients", "scaffold_client_control",
    "control_keys", "RoundAggregator",
    "FedAvgAggregator", "FedProxAggregator", "FedYogiAggregator", "FedAdamAggregator",
    "FedAdagradAggregator", "FedAvgMAggregator", "FedMedianAggregator",
    "FedTrimmedAvgAggregator", "KrumAggregator", "ScaffoldAggregator", "FedNovaAggregator",
]


class Aggregator(Protocol):
    name: str

    def aggregate(
        self,
        global_state: Mapping[str, Tensor],
        updates: Sequence[Update],
        weights: Sequence[float],
    ) -> dict[str, Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class RoundAggregator(Aggregator, Protocol):
    """An aggregator that also takes each client's round info (steps, norm, control)."""

    def aggregate_round(self, global_state: Mapping[str, Tensor], updates: Sequence[Update],
                        weights: Sequence[float], infos: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]: ...


def build_aggregator(spec: Any, *, num_clients: int | None = None) -> Aggregator:
    """The aggregator for a contract ``FederatedAggregation`` value (``num_clients``: the
    job's N, which SCAFFOLD's server control variate needs)."""
    method = getattr(spec, "method", None)
    if method == "SCAFFOLD":
        if num_clients is None:
            raise ValueError("SCAFFOLD's server needs num_clients (the job's N)")
        return ScaffoldAggregator(server_lr=spec.server_lr, num_clients=num_clients)
    if method == "FedNova":
        return FedNovaAggregator()
    if method == "FedAvg":
        return FedAvgAggregator()
    if method == "FedProx":
        return FedProxAggregator(spec.mu)
    if method == "FedYogi":
        return FedYogiAggregator(eta=spec.eta, beta1=spec.beta1, beta2=spec.beta2, tau=spec.tau)
    if method == "FedAdam":
        return FedAdamAggregator(eta=spec.eta, beta1=spec.beta1, beta2=spec.beta2, tau=spec.tau)
    if method == "FedAdagrad":
        return FedAdagradAggregator(eta=spec.eta, tau=spec.tau)
    if method == "FedAvgM":
        return FedAvgMAggregator(server_momentum=spec.server_momentum, server_lr=spec.server_lr)
    if method == "FedMedian":
        return FedMedianAggregator()
    if method == "FedTrimmedAvg":
        return FedTrimmedAvgAggregator(spec.beta)
    if method == "Krum":
        return KrumAggregator(num_malicious=spec.num_malicious, to_keep=spec.to_keep)
    raise ValueError(
        f"unknown federated aggregation {method!r}; valid: FedAvg, FedProx, FedYogi, FedAdam, "
        "FedAdagrad, FedAvgM, FedMedian, FedTrimmedAvg, Krum, SCAFFOLD, FedNova"
    )
