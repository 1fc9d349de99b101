"""SCAFFOLD (Karimireddy et al. 2020), option II control variates, and FedNova (Wang et
al. 2020, normalised averaging). ``p_i = n_i / sum_S n_j`` weighs by example count, as
every paratrain aggregator (the papers' uniform means when the counts are equal).

SCAFFOLD: the selected clients ``S`` receive ``(x, c)``; each runs K local SGD steps
``y <- y - eta_l (g_i(y) + c - c_i)`` from ``y = x``, sets ``c_i+ = c_i - c + (x - y_i) / (K
eta_l)`` and sends ``dy_i = y_i - x``, ``dc_i = c_i+ - c_i``. The server applies ``x <- x +
eta_g sum_i p_i dy_i`` and ``c <- c + (|S| / N) sum_i p_i dc_i`` (``N`` clients; ``c`` starts
at zero and is kept in the global tensors' dtype, so every client receives the same ``c``).

FedNova: client ``i`` reports its normaliser ``a_i`` (``tau_i`` local steps; with heavy-ball
momentum ``rho``, ``a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)``); the server
applies ``x <- x + sum_i (p_i tau_eff / a_i) dy_i`` with ``tau_eff = sum_i p_i a_i`` (FedAvg
when every ``a_i`` is equal). Stateless on the server.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._common import Aggregator, Update, apply_step, check_weights, linear_combination
from .fedavg import fedavg_step


def control_keys(global_state: Mapping[str, Tensor]) -> list[str]:
    """The tensors that carry a control variate: the floating-point ones of the model."""
    return [k for k, v in global_state.items() if v.is_floating_point()]


def scaffold_client_control(c_i: Mapping[str, Tensor], c: Mapping[str, Tensor], x: Mapping[str, Tensor],
                            y: Mapping[str, Tensor], *, steps: int, lr: float) -> dict[str, Tensor]:
    """Option II: ``c_i+ = c_i - c + (x - y) / (K eta_l)`` per key of ``c`` (``K = steps``,
    ``eta_l = lr``), in float64, returned in ``c``'s dtype."""
    if steps <= 0 or not lr > 0:
        raise ValueError(f"SCAFFOLD control update needs K > 0 and eta_l > 0 (got {steps}, {lr})")
    scale = 1.0 / (float(steps) * float(lr))
    out: dict[str, Tensor] = {}
    for k, ck in c.items():
        new = (c_i[k].double() - ck.double()
               + (x[k].detach().double() - y[k].detach().double()) * scale)
        out[k] = new.to(ck.dtype)
    return out


class ScaffoldAggregator(Aggregator):
    """SCAFFOLD's server: the model step and the control variate ``c``."""

    name = "SCAFFOLD"
    sends_control = True

    def __init__(self, *, server_lr: float = 1.0, num_clients: int) -> None:
        self.server_lr = float(server_lr)
        self.num_clients = int(num_clients)
        self.c: dict[str, Tensor] = {}

    @classmethod
    def from_spec(cls, spec: Any, *, num_clients: int | None = None) -> ScaffoldAggregator:
        if num_clients is None:
            raise ValueError("SCAFFOLD's server needs num_clients (the job's N)")
        return cls(server_lr=spec.server_lr, num_clients=num_clients)

    def control(self, global_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The server control variate ``c`` (zeros at first), one per floating model tensor."""
        if not self.c:
            self.c = {k: torch.zeros_like(global_state[k]) for k in control_keys(global_state)}
        return self.c

    def step(self, updates: Sequence[Update], weights: Sequence[float]) -> dict[str, Tensor]:
        """The model step alone (``c`` unchanged): ``eta_g * sum p_i dy_i``."""
        step = fedavg_step(updates, weights)
        if self.server_lr != 1.0:
            step = {k: self.server_lr * v for k, v in step.items()}
        return step

    def aggregate_round(self, global_state: Mapping[str, Tensor], updates: Sequence[Update],
                        weights: Sequence[float], infos: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        """Both steps; ``infos[i]["control"]`` is client i's ``dc_i``."""
        c = self.control(global_state)
        w = check_weights(weights, len(updates))
        mean_dc = linear_combination([info["control"] for info in infos], (w / w.sum()).tolist())
        frac = len(updates) / self.num_clients
        new_c = {k: (ck.double() + frac * mean_dc[k]).to(ck.dtype) for k, ck in c.items()}
        out = self.aggregate(global_state, updates, weights)
        self.c = new_c
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"control": {k: v.clone() for k, v in self.c.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.c = {k: v.clone() for k, v in dict(state.get("control", {})).items()}


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
