"""Federated aggregators: pure maths on lists of client updates (model deltas) + weights.

Every aggregator is an :class:`Aggregator` (``_common``): ``aggregate(global_state, updates,
weights) -> new_global_state`` applies its ``step`` (``updates[i]`` is client i's delta
``w_i − w_global`` by tensor name, ``weights[i]`` its example count) and ``state_dict()`` /
``load_state_dict()`` hold its server state (optimizer moments, momentum buffer), which the
round checkpoint stores. ``build_aggregator(spec)`` maps a contract ``FederatedAggregation``
to one through :data:`AGGREGATORS` (method name -> class).

Extension methods that need more of each client than its delta (SCAFFOLD: the control
delta ``dc_i``; FedNova: the normaliser ``a_i``) override
``aggregate_round(global_state, updates, weights, infos)``, ``infos[i]`` being client i's
``{"steps", "norm", "control"}``; the server always calls ``aggregate_round``.
"""

from __future__ import annotations

from typing import Any

from ._common import Aggregator, MalformedUpdateError
from .fedadagrad import FedAdagradAggregator
from .fedadam import FedAdamAggregator
from .fedavg import FedAvgAggregator, fedavg_step
from .fedavgm import FedAvgMAggregator
from .fedmedian import FedMedianAggregator, coordinate_median
from .fednova import FedNovaAggregator, fednova_norm
from .fedprox import FedProxAggregator, proximal_term
from .fedtrimmedavg import FedTrimmedAvgAggregator, trimmed_mean
from .fedyogi import FedYogiAggregator
from .krum import KrumAggregator, krum_select
from .scaffold import ScaffoldAggregator, control_keys, scaffold_client_control

__all__ = [
    "Aggregator", "AGGREGATORS", "build_aggregator", "MalformedUpdateError",
    "fedavg_step", "coordinate_median", "trimmed_mean", "krum_select", "proximal_term",
    "fednova_norm", "scaffold_client_control", "control_keys",
]

#: method name (the contract's ``method``) -> aggregator class
AGGREGATORS: dict[str, type[Aggregator]] = {cls.name: cls for cls in (
    FedAvgAggregator, FedProxAggregator, FedYogiAggregator, FedAdamAggregator,
    FedAdagradAggregator, FedAvgMAggregator, FedMedianAggregator, FedTrimmedAvgAggregator,
    KrumAggregator, ScaffoldAggregator, FedNovaAggregator,
)}


def build_aggregator(spec: Any, *, num_clients: int | None = None) -> Aggregator:
    """The aggregator for a contract ``FederatedAggregation`` value (``num_clients``: the
    job's N, which SCAFFOLD's server control variate needs)."""
    method = getattr(spec, "method", None)
    cls = AGGREGATORS.get(method) if isinstance(method, str) else None
    if cls is None:
        raise ValueError(f"unknown federated aggregation {method!r}; valid: {', '.join(AGGREGATORS)}")
    return cls.from_spec(spec, num_clients=num_clients)
