"""The server side of a round: decode and validate updates, aggregate, evaluate.

``bytes_up_measured`` is the length of every selected client's encoded update,
``bytes_down_modelled`` the model's size times the clients selected, ``wire_bytes_*_measured``
what the transport counted.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ...config import ConfigError
from ...models.state import load_unique_state_dict
from ...task.steps import evaluate as evaluate_task
from ...training.checkpoint import check_model_state
from ...training.stepping import autocast, lr_factor
from .aggregation import Aggregator, MalformedUpdateError, build_aggregator
from .aggregation.drift import valid_norm
from .client import client_name
from .drift import control_reference, split_control
from .privacy import ServerPrivacy
from .wire import UpdateDecoder


class RoundSchedule:
    """The clients' learning rate over rounds: round ``r`` trains at ``lr * lr_factor(r)``
    (``train.warmup_steps`` in rounds); ``position``, the next round, is checkpointed."""

    def __init__(self, kind: str = "constant", warmup: int = 0, total: int = 1) -> None:
        self.kind, self.warmup, self.total = str(kind), int(warmup), int(total)
        self.position = 0

    def factor(self) -> float:
        return lr_factor(self.position, kind=self.kind, warmup_steps=self.warmup,
                         total_steps=self.total)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "kind": self.kind, "warmup_rounds": self.warmup,
                "total_rounds": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])


# the server's running totals, in its checkpoint
_COUNTERS = ("bytes_up", "bytes_down", "wire_bytes_down", "wire_bytes_up", "failures")


@dataclass
class _Received:
    """One round's client results, in client order."""

    updates: list[Mapping[str, Tensor]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    losses: list[tuple[float, float]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)  # per successful client: steps, norm, control (dc_i)
    up: int = 0  # the payloads' bytes, every selected client's


def mean_loss(losses: Sequence[tuple[float, float]]) -> float:
    """The mean of the clients' training losses ``(loss, n)`` weighted by ``n``."""
    return sum(v * n for v, n in losses) / sum(n for _, n in losses)


class FederatedServer:
    def __init__(self, aggregation: Any, global_state: Mapping[str, Tensor],
                 schedule: RoundSchedule | None = None, *, num_clients: int | None = None) -> None:
        self.aggregator: Aggregator = build_aggregator(aggregation, num_clients=num_clients)
        self.method = str(getattr(aggregation, "method", None) or self.aggregator.name)
        self.schedule = schedule if schedule is not None else RoundSchedule()
        self.global_state: dict[str, Tensor] = {k: v.detach().clone() for k, v in global_state.items()}
        self.round = 0
        self.stopped = False
        self.rounds_to_target: int | None = None
        self.bytes_up = self.bytes_down = self.wire_bytes_down = self.wire_bytes_up = self.failures = 0
        self.privacy: ServerPrivacy | None = None  # [federated.dp]: set_privacy
        self.buffered: Any = None  # FedBuff's buffer and clients in flight (.buffered.Buffered)

    def set_privacy(self, privacy: ServerPrivacy | None) -> None:
        """Run under ``[federated.dp]`` (before loading a checkpoint); a budget too small for
        one round stops the server at once."""
        self.privacy = privacy
        if privacy is not None and not privacy.allows_next_round():
            self.stopped = True

    def control(self) -> dict[str, Tensor]:
        """SCAFFOLD's server control variate ``c`` (sent with the model); {} otherwise."""
        ctl = getattr(self.aggregator, "control", None)
        return ctl(self.global_state) if callable(ctl) else {}

    def finish_round(self, round_idx: int, statuses: Sequence[Mapping[str, Any]],
                     payloads: Sequence[bytes | memoryview], *, wire_bytes_down: int = 0,
                     wire_bytes_up: int = 0) -> dict[str, Any]:
        """Aggregate one round (``statuses[i]`` describes ``payloads[i]``): malformed updates
        are rejected before any arithmetic (recorded failures naming client and tensor), the
        rest go through ``[federated.dp]`` and the aggregator."""
        got = _Received()
        reference = ({**self.global_state, **control_reference(self.global_state)}
                     if self.aggregator.sends_control else self.global_state)
        decode = UpdateDecoder(reference)
        for i in sorted(range(len(statuses)), key=lambda i: int(statuses[i]["client"])):
            self._receive(got, statuses[i], payloads[i], decode)
        updates: Sequence[Mapping[str, Tensor]] = got.updates
        weights, failed = got.weights, got.failed
        down = sum(t.numel() * t.element_size() for t in self.global_state.values()) * len(statuses)
        self.bytes_up += got.up
        self.bytes_down += down
        self.wire_bytes_down += int(wire_bytes_down)
        self.wire_bytes_up += int(wire_bytes_up)
        self.failures += len(failed)
        rec: dict[str, Any] = dict(
            round=round_idx + 1, clients_selected=len(statuses), clients_ok=len(updates),
            clients_failed=len(failed), bytes_up_measured=got.up, bytes_down_modelled=down,
            wire_bytes_down_measured=int(wire_bytes_down), wire_bytes_up_measured=int(wire_bytes_up))
        if failed:
            rec["failures"] = failed
        if updates and self.privacy is not None:  # [federated.dp]: clip, sum, noise (.privacy)
            updates, weights, dp_rec = self.privacy.privatize(round_idx, self.global_state, updates, weights)
            rec.update(dp_rec)
        if updates:
            self.global_state = self.aggregator.aggregate_round(self.global_state, updates, weights, got.infos)
            if got.losses:
                rec["train_loss"] = mean_loss(got.losses)
        else:
            rec["note"] = (f"round {round_idx + 1}: no successful client out of {len(statuses)} "
                           "selected; global model unchanged")
        self.round = round_idx + 1
        self.schedule.position += 1
        if self.privacy is not None:  # every round is booked, whatever came back
            rec.update(self.privacy.account(round_idx))
            self.stopped = self.stopped or not self.privacy.allows_next_round()
        return rec

    def _receive(self, got: _Received, st: Mapping[str, Any], payload: bytes | memoryview,
                 decode: UpdateDecoder) -> None:
        """Book one client's status and payload in ``got``: its update decoded against
        the round's reference (with SCAFFOLD's control deltas), or why it failed."""
        cid = client_name(int(st["client"]))
        got.up += len(payload)
        if not st.get("ok"):
            got.failed.append({"client": cid, "error": str(st.get("error"))})
            return
        try:
            upd, ctrl = split_control(decode(cid, st.get("headers", []), payload))
            n = int(st["n"])
            if n <= 0:
                raise MalformedUpdateError(cid, "<num_examples>", f"example count {n}")
            if self.method == "FedNova" and not valid_norm(st.get("norm")):
                raise MalformedUpdateError(cid, "<norm>", f"FedNova normaliser {st.get('norm')!r}")
        except MalformedUpdateError as e:
            got.failed.append({"client": cid, "error": f"rejected update: {e}"})
            return
        got.infos.append({"steps": st.get("steps"), "norm": st.get("norm"), "control": ctrl,
                          "staleness": st.get("staleness")})  # FedBuff's (.buffered)
        got.updates.append(upd)
        got.weights.append(float(n))
        if st.get("loss") is not None:
            got.losses.append((float(st["loss"]), float(n)))

    def evaluate(self, model: nn.Module, task: Any, test: Any, device: torch.device | None = None,
                 precision: str = "fp32") -> dict[str, float]:
        """The task's metrics of the global model on ``test`` (loaded into ``model``)."""
        load_unique_state_dict(model, self.global_state)
        with autocast(precision, device):
            return evaluate_task(model, task, test, device=device)

    def note_accuracy(self, acc: float | None, target: float | None) -> None:
        if target is not None and acc is not None and acc >= target and self.rounds_to_target is None:
            self.rounds_to_target = self.round
            self.stopped = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round, "model": {k: v.clone() for k, v in self.global_state.items()},
            "aggregation": self.method, "aggregator": self.aggregator.state_dict(),
            "client_schedule": self.schedule.state_dict(), "stopped": self.stopped,
            "rounds_to_target": -1 if self.rounds_to_target is None else self.rounds_to_target,
            **{k: getattr(self, k) for k in _COUNTERS},
            **({"privacy": self.privacy.state_dict()} if self.privacy is not None else {}),
            **({"buffered": self.buffered.state_dict()} if self.buffered is not None else {}),
            "saved_at": time.time(),
        }

    def check_state(self, state: Mapping[str, Any], *, source: Any) -> None:
        """A ConfigError when checkpoint ``state`` (from ``source``) was written with another
        aggregation method (older checkpoints: server state fields), DP setting or model."""
        saved = state.get("aggregation")
        agg_state = state.get("aggregator", {})
        fields = set(agg_state) if isinstance(agg_state, Mapping) else set()
        if saved is None and fields != set(self.aggregator.state_dict()):
            saved = f"another method (server optimizer state {sorted(fields)})"
        if saved is not None and saved != self.method:
            raise ConfigError([("strategy.aggregation.method", (
                f"checkpoint {source} was written with aggregation {saved}; this job's is "
                f"{self.method}, whose server state would start fresh: resume with the original "
                "strategy.aggregation, or start a fresh run with --overwrite"))])
        if (self.privacy is not None) != ("privacy" in state):
            raise ConfigError([("federated.dp", (
                f"checkpoint {source} was written {'without' if self.privacy else 'with'} "
                f"[federated.dp] and this job {'sets' if self.privacy else 'does not set'} it: "
                "the privacy spent would be miscounted; resume with the original [federated.dp], "
                "or start a fresh run with --overwrite"))])
        check_model_state(self.global_state, state["model"], source=source)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        model = dict(state["model"])
        if set(model) != set(self.global_state):
            raise ValueError("checkpoint model keys do not match the job's model")
        self.global_state = {k: model[k].to(self.global_state[k].dtype) for k in self.global_state}
        self.aggregator.load_state_dict(state.get("aggregator", {}))
        self.round = int(state["round"])
        # A checkpoint written before the schedule was saved: its position was the round.
        self.schedule.load_state_dict(state.get("client_schedule", {"position": self.round}))
        self.stopped = bool(state.get("stopped", False))
        rtt = int(state.get("rounds_to_target", -1))
        self.rounds_to_target = None if rtt < 0 else rtt
        for k in _COUNTERS:
            setattr(self, k, int(state.get(k, 0)))
        if self.privacy is not None:
            self.privacy.load_state_dict(state["privacy"])
        if self.buffered is not None:
            self.buffered.load_state_dict(state["buffered"])
