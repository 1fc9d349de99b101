"""The client parts of the drift-correcting methods (:mod:`.aggregation.drift`).

SCAFFOLD: each client's ``c_i`` lives on its hosting worker (:class:`ClientControls`, in that
worker's checkpoint); the server's ``c`` goes down with the model (:func:`broadcast_control`)
and ``dc_i`` goes up as float32 tensors ``scaffold.dc/<key>`` after the update's own
(:func:`pack_control`, :func:`split_control`). FedNova: the status carries ``steps`` and
``norm``. Both need SGD as the client optimizer (:func:`drift_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .aggregation import control_keys
from .personal import client_name
from .wire import broadcast_state

CONTROL_PREFIX = "scaffold.dc/"


def uses_control(aggregation: Any) -> bool:
    """Whether the method keeps control variates (SCAFFOLD)."""
    return getattr(aggregation, "method", None) == "SCAFFOLD"


def optimizer_momentum(spec: Any) -> float:
    """The heavy-ball momentum of the job's ``[train.optimizer]`` (0 when not set)."""
    return float(spec.kwargs.get("momentum", 0.0) or 0.0)


def drift_problems(job: Any) -> list[tuple[str, str]]:
    """The unsupported combinations of SCAFFOLD / FedNova with the job, naming the field."""
    method = getattr(job.strategy.aggregation, "method", None)
    if method not in ("SCAFFOLD", "FedNova"):
        return []
    opt = job.train.optimizer
    kw = opt.kwargs
    out: list[tuple[str, str]] = []
    if opt.name != "sgd":
        out.append(("train.optimizer.name", (
            f"{method} needs sgd as the client optimizer (got {opt.name!r}): its "
            + ("control variates estimate the mean gradient as (x - y_i)/(K*lr)"
               if method == "SCAFFOLD" else "normaliser a_i is defined for SGD and heavy-ball momentum"))))
    elif method == "SCAFFOLD" and optimizer_momentum(opt) != 0.0:
        out.append(("train.optimizer.momentum", (
            "SCAFFOLD (option II) needs plain SGD: with momentum (x - y_i)/(K*lr) is not the mean "
            "corrected gradient; set momentum = 0 or use FedNova")))
    elif kw.get("nesterov") or float(kw.get("dampening", 0.0) or 0.0) != 0.0:
        out.append(("train.optimizer", (
            f"{method}: nesterov and dampening are not supported (FedNova's a_i is the heavy-ball "
            "form)")))
    return out


def control_reference(global_state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The control delta's expected tensors (names and shapes) in an uplink."""
    return {CONTROL_PREFIX + k: global_state[k] for k in control_keys(global_state)}


def pack_control(dc: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``dc_i`` under the uplink names ``scaffold.dc/<key>`` (CPU float32)."""
    return {CONTROL_PREFIX + k: v.detach().to("cpu", torch.float32) for k, v in dc.items()}


def split_control(decoded: Mapping[str, Tensor]) -> tuple[Mapping[str, Tensor], dict[str, Tensor]]:
    """A decoded uplink as (the model delta, the control delta by model key)."""
    if not any(k.startswith(CONTROL_PREFIX) for k in decoded):  # no control: the update itself
        return decoded, {}
    upd = {k: v for k, v in decoded.items() if not k.startswith(CONTROL_PREFIX)}
    ctrl = {k.removeprefix(CONTROL_PREFIX): v for k, v in decoded.items() if k.startswith(CONTROL_PREFIX)}
    return upd, ctrl


class ClientControls:
    """Each hosted client's SCAFFOLD control variate ``c_i`` (CPU, the model's dtype; zeros
    before the client's first round)."""

    def __init__(self) -> None:
        self.of_client: dict[int, dict[str, Tensor]] = {}

    def get(self, client: int, c: Mapping[str, Tensor]) -> dict[str, Tensor]:
        own = self.of_client.get(client)
        return dict(own) if own is not None else {k: torch.zeros_like(v, device="cpu") for k, v in c.items()}

    def keep(self, client: int, c_i: Mapping[str, Tensor]) -> None:
        self.of_client[client] = {k: v.detach().cpu().clone() for k, v in c_i.items()}

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        return {client_name(c): {k: v.clone() for k, v in s.items()} for c, s in sorted(self.of_client.items())}

    def load_state_dict(self, state: Mapping[str, Any], hosts: Any) -> None:
        self.of_client = {}
        for name, s in state.items():
            c = int(str(name).removeprefix("client-"))
            if not hosts(c):
                raise ValueError(f"a worker checkpoint holds {name}'s control variate, hosted elsewhere")
            self.of_client[c] = {k: v.clone() for k, v in dict(s).items()}


def broadcast_control(server: Any, template: Mapping[str, Tensor], *, group: Any, device: torch.device,
                      counter: Any = None) -> dict[str, Tensor]:
    """The server's ``c`` on every rank (rank 0 holds ``server``; every rank, rank 0 included,
    uses the broadcast copy)."""
    keys = control_keys(template)
    src = server.control() if server is not None else {k: template[k] for k in keys}
    return broadcast_state({k: src[k] for k in keys}, {k: template[k] for k in keys}, device=device,
                           group=group, counter=counter)
