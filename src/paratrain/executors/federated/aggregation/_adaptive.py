"""Adaptive server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization",
Algorithm 2) on the example-weighted mean client delta ``D_t``:

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
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ._common import Aggregator, Update
from .fedavg import fedavg_step


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
