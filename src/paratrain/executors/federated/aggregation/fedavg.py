"""FedAvg and the server optimizers on its step. FedAvg (McMahan et al. 2017): ``w <- w +
sum_i n_i D_i / sum_i n_i`` (``n_i`` the client's example count). FedProx (Li et al. 2020):
each client adds ``(mu/2) ||w - w_global||^2`` to its loss; the server is FedAvg's. FedAvgM
(Hsu et al. 2019): server momentum on FedAvg's step ``D_t``, ``v_t = beta v_{t-1} + D_t``
(``v_0 = 0``), ``w <- w + eta_s v_t``. Adaptive server optimizers (Reddi et al. 2021,
"Adaptive Federated Optimization", Algorithm 2) on ``D_t``:

    m_t = b1 m_{t-1} + (1 - b1) D_t
    v_t = v_{t-1} + D_t^2                                (FedAdagrad)
    v_t = b2 v_{t-1} + (1 - b2) D_t^2                    (FedAdam)
    v_t = v_{t-1} - (1 - b2) D_t^2 sign(v_{t-1} - D_t^2)   (FedYogi)
    w_{t+1} = w_t + eta m_t / (sqrt(v_t) + tau)

``m_0 = 0``, ``v_0 = tau^2``, no bias correction (as in the paper); ``m``, ``v`` are the
server state.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ._common import Aggregator, FlatUpdate, Update, check_weights, linear_combination


def fedavg_step(updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
    """The example-weighted mean of the updates per key, in float64, accumulated update by
    update in order (memory flat in the number of clients)."""
    n = len(updates)
    w = check_weights(weights, n)
    total = float(w.sum())
    first = updates[0]
    flats = [u.flat for u in updates if isinstance(u, FlatUpdate) and u.layout is getattr(first, "layout", None)]
    if isinstance(first, FlatUpdate) and first.layout and len(flats) == n:
        # one add per update, of its whole vector (the same sums as per key)
        acc = torch.zeros(first.flat.numel(), dtype=torch.float64)
        for f, wi in zip(flats, w.tolist(), strict=True):
            acc.add_(f, alpha=wi)
        return {name: acc[a:b].view(shape) / total for name, (a, b, shape) in first.layout.items()}
    return {name: acc / total for name, acc in linear_combination(updates, w.tolist()).items()}


class FedAvgAggregator(Aggregator):
    """Stateless FedAvg server."""

    name = "FedAvg"

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        return fedavg_step(updates, weights)


def proximal_term(params: Iterable[Tensor], global_params: Iterable[Tensor], mu: float) -> Tensor:
    """``(mu/2) sum_k ||w_k - w_global,k||^2`` (global weights detached)."""
    total: Tensor | None = None
    for p, g in zip(params, global_params, strict=True):
        sq = (p - g.detach()).pow(2).sum()
        total = sq if total is None else total + sq
    if total is None:
        return torch.zeros(())
    return 0.5 * mu * total


class FedProxAggregator(FedAvgAggregator):
    """FedAvg's server (``mu`` acts on the clients' loss)."""

    name = "FedProx"


class FedAvgMAggregator(Aggregator):
    name = "FedAvgM"
    spec_fields = ("server_momentum", "server_lr")

    def __init__(self, *, server_momentum: float = 0.9, server_lr: float = 1.0) -> None:
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


class AdaptiveServerOptimizer(Aggregator):

    spec_fields: ClassVar[tuple[str, ...]] = ("eta", "beta1", "beta2", "tau")

    def __init__(self, *, eta: float, beta1: float, beta2: float, tau: float) -> None:
        self.eta, self.beta1, self.beta2, self.tau = float(eta), float(beta1), float(beta2), float(tau)
        self.m: dict[str, Tensor] = {}
        self.v: dict[str, Tensor] = {}
        self.t = 0

    @abstractmethod
    def second_moment(self, v: Tensor, d2: Tensor) -> Tensor:
        """The method's second-moment update v_t from v_{t-1} and the squared step."""

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        delta = fedavg_step(updates, weights)
        step: dict[str, Tensor] = {}
        for name, d in delta.items():
            m = self.m.get(name, torch.zeros_like(d))
            v = self.v.get(name, torch.full_like(d, self.tau**2))
            m = self.beta1 * m + (1.0 - self.beta1) * d
            v = self.second_moment(v, d * d)
            self.m[name], self.v[name] = m, v
            step[name] = self.eta * m / (v.sqrt() + self.tau)
        self.t += 1
        return step

    def state_dict(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "m": {k: v.clone() for k, v in self.m.items()},
            "v": {k: v.clone() for k, v in self.v.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.t = int(state.get("t", 0))
        self.m = {k: v.to(torch.float64).clone() for k, v in dict(state.get("m", {})).items()}
        self.v = {k: v.to(torch.float64).clone() for k, v in dict(state.get("v", {})).items()}


class FedAdamAggregator(AdaptiveServerOptimizer):
    name = "FedAdam"

    def second_moment(self, v: Tensor, d2: Tensor) -> Tensor:
        return self.beta2 * v + (1.0 - self.beta2) * d2


class FedYogiAggregator(AdaptiveServerOptimizer):
    name = "FedYogi"

    def second_moment(self, v: Tensor, d2: Tensor) -> Tensor:
        return v - (1.0 - self.beta2) * d2 * torch.sign(v - d2)


class FedAdagradAggregator(AdaptiveServerOptimizer):
    name = "FedAdagrad"
    spec_fields = ("eta", "tau")

    def __init__(self, *, eta: float, tau: float, beta1: float = 0.0) -> None:
        super().__init__(eta=eta, beta1=beta1, beta2=0.0, tau=tau)

    def second_moment(self, v: Tensor, d2: Tensor) -> Tensor:
        return v + d2
