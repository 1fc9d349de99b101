"""Secure aggregation on Flower's runtime through Flower's own SecAgg+ (Bell et al. 2020):
``SecAggPlusWorkflow`` on the server, ``secaggplus_mod`` on every node; paratrain writes no
cryptography. Each node returns its clients' example-weighted mean update ``u_j`` with weight
``N_j = sum_c n_c``, which the mod masks; the server unmasks only ``sum_j N_j u_j / sum_j
N_j``, the FedAvg mean (to the fixed-point precision of ``clipping_range /
quantization_range``), and hands it to the FederatedServer as one update of weight ``sum_j
N_j``, so only aggregators acting on the mean compose. This module is the server's part.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerConfig
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from torch import Tensor

from . import protocol as P


class CountingGrid:
    """The Grid the workflow talks through: bytes counted, replies polled as a plain round's
    (:func:`.protocol.push_and_pull`, not ``send_and_receive``'s 3 s waits)."""

    def __init__(self, grid: Any, count: Any) -> None:
        self.grid, self.count = grid, count
        self.down = self.up = 0
        self.answered: list[int] = []  # nodes answering each SecAgg+ stage without an error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        msgs = list(messages)
        self.down += sum(self.count(m) for m in msgs)
        out = P.push_and_pull(self.grid, msgs, timeout)
        self.up += sum(self.count(m) for m in out)
        self.answered.append(sum(not m.has_error() for m in out))
        return out


class _Plan(Strategy):
    """The legacy Strategy the workflow asks for the round's FitIns and gives the unmasked mean."""

    def __init__(self, proxies: Sequence[ClientProxy], fitins: FitIns) -> None:
        self.proxies, self.fitins = list(proxies), fitins
        self.results: list[tuple[ClientProxy, FitRes]] = []

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        return [(p, self.fitins) for p in self.proxies]

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Any]]:
        self.results = list(results)
        return (results[0][1].parameters if results else None), {}

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[Any]:
        return []

    def aggregate_evaluate(self, server_round: int, results: list[Any], failures: list[Any]) -> tuple[None, dict[str, Any]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


def _count(v: float) -> int | float:
    """Flower reads an int as a count and a float as a fraction."""
    return int(v) if float(v).is_integer() and v > 1 else float(v)


def secure_round(grid: Any, nodes: Sequence[int], plan: Mapping[str, Any], global_state: Mapping[str, Tensor],
                 opts: Any, max_weight: float, count: Any,
                 ) -> tuple[dict[str, Tensor] | None, list[dict[str, Any]], int, int, list[int]]:
    """One SecAgg+ round over ``nodes``: ``(the unmasked mean update or None, the clients'
    statuses the nodes reported, bytes down, bytes up, nodes answering each stage)``."""
    sa = opts.secure_aggregation
    counting = CountingGrid(grid, count)
    run_id = int(grid.run.run_id)
    proxies = [GridClientProxy(int(n), counting, run_id) for n in nodes]  # type: ignore[arg-type]
    arrays = [t.detach().cpu().numpy() for t in global_state.values()]
    fitins = FitIns(ndarrays_to_parameters(arrays), {k: v for k, v in plan.items()})
    strategy = _Plan(proxies, fitins)
    manager = SimpleClientManager()
    for p in proxies:
        manager.register(p)
    base = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
    ctx = LegacyContext(base, ServerConfig(num_rounds=1), strategy, manager)
    ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: int(plan[P.ROUND]) + 1})
    ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord(numpy_ndarrays=arrays)
    workflow = SecAggPlusWorkflow(
        num_shares=_count(sa.num_shares), reconstruction_threshold=_count(sa.reconstruction_threshold),
        max_weight=float(max_weight), clipping_range=float(sa.clipping_range),
        quantization_range=int(sa.quantization_range), modulus_range=int(sa.modulus_range),
        timeout=float(opts.round_timeout))
    workflow(counting, ctx)  # type: ignore[arg-type]
    statuses: list[dict[str, Any]] = []
    for _, res in strategy.results:
        statuses.extend(json.loads(str(res.metrics.get(P.STATUSES, "[]"))))
    if not strategy.results:
        return None, statuses, counting.down, counting.up, counting.answered
    mean = parameters_to_ndarrays(strategy.results[0][1].parameters)
    out = {k: torch.from_numpy(np.asarray(a, dtype=np.float32).copy()).reshape(t.shape)
           for (k, t), a in zip(global_state.items(), mean, strict=True)}
    return out, statuses, counting.down, counting.up, counting.answered
