"""Federated aggregators: pure maths on client updates (model deltas) and weights, each an
:class:`Aggregator`; :data:`AGGREGATORS` (method name -> class) is the one registry.
"""

from __future__ import annotations

from typing import Any

from . import drift, fedavg, fedbuff, robust
from ._common import Aggregator, FlatUpdate, MalformedUpdateError
from .drift import control_keys, fednova_norm, scaffold_client_control
from .fedavg import fedavg_step, proximal_term
from .robust import coordinate_median, krum_select, trimmed_mean

__all__ = ["Aggregator", "AGGREGATORS", "FlatUpdate", "build_aggregator", "MalformedUpdateError", "fedavg_step",
           "coordinate_median", "trimmed_mean", "krum_select", "proximal_term", "fednova_norm",
           "scaffold_client_control", "control_keys"]

#: method name (the contract's ``method``) -> aggregator class
AGGREGATORS: dict[str, type[Aggregator]] = {cls.name: cls for cls in (
    fedavg.FedAvgAggregator, fedavg.FedProxAggregator, fedavg.FedYogiAggregator,
    fedavg.FedAdamAggregator, fedavg.FedAdagradAggregator, fedavg.FedAvgMAggregator,
    robust.FedMedianAggregator, robust.FedTrimmedAvgAggregator, robust.KrumAggregator,
    drift.ScaffoldAggregator, drift.FedNovaAggregator, fedbuff.FedBuffAggregator,
)}


def build_aggregator(spec: Any, *, num_clients: int | None = None) -> Aggregator:
    """The aggregator for a ``FederatedAggregation`` value (SCAFFOLD needs ``num_clients``)."""
    method = getattr(spec, "method", None)
    cls = AGGREGATORS.get(method) if isinstance(method, str) else None
    if cls is None:
        raise ValueError(f"unknown federated aggregation {method!r}; valid: {', '.join(AGGREGATORS)}")
    return cls.from_spec(spec, num_clients=num_clients)
