"""Personal subgraphs of federated clients (FedPer, FedBN) and per-client evaluation.

A ``Local`` subgraph under a root ``Federated`` strategy is personal to each client: with
``P`` its state keys (parameters and buffers), the server's model is ``w_G`` alone; client
``c`` loads ``(w_G, w_P^c)``, trains both, keeps ``w_P^c`` (in its worker's checkpoint) and
sends only ``Delta_G^c``. FedPer (Arivazhagan et al. 2019) when ``P`` is the head, FedBN (Li
et al. 2021) when it is the normalisation layers.

Per-client evaluation scores client ``c`` on its test split with ``(w_G, w_P^c)``:
``personal_test_<m>`` is the mean over clients with a non-empty split, ``..._min`` the worst;
with a ``P``, ``test_<m>`` pools every split (exact sums: the same on any worker layout).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ...models.state import load_unique_state_dict, unique_state_dict
from ...task.steps import DEFAULT_EVAL_BATCH, call_model, fetch_batch
from ...training.stepping import autocast
from ...training.summary import tensor_bytes


def client_name(c: int) -> str:
    """Client ``c``'s name in records, checkpoints and messages."""
    return f"client-{c}"


class PersonalState:
    """The personal parts ``w_P^c`` of the clients one worker hosts (CPU tensors)."""

    def __init__(self, model: nn.Module, keys: Sequence[str], hosted: Collection[int]) -> None:
        own = unique_state_dict(model)
        self.keys = list(keys)
        self.initial = {k: own[k].detach().cpu().clone() for k in self.keys}
        self.hosted = sorted(hosted)
        self.clients: dict[int, dict[str, Tensor]] = {}

    def of(self, client: int) -> dict[str, Tensor]:
        """``w_P^c``: the client's, or the initial value before its first round."""
        return self.clients.get(client, self.initial)

    def keep(self, client: int, model: nn.Module) -> None:
        own = unique_state_dict(model)
        self.clients[client] = {k: own[k].detach().cpu().clone() for k in self.keys}

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        return {client_name(c): dict(s) for c, s in sorted(self.clients.items())}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]], *, rank: int) -> None:
        self.clients = {}
        for name, s in state.items():
            c = int(str(name).removeprefix("client-"))
            if c not in self.hosted:
                raise ValueError(f"worker checkpoint of rank {rank} holds {name}'s personal state, "
                                 "hosted elsewhere")
            if set(s) != set(self.keys):
                raise ValueError(f"worker checkpoint of rank {rank}: {name}'s personal keys "
                                 f"{sorted(s)} are not the job's {self.keys}")
            self.clients[c] = {k: s[k].clone() for k in self.keys}

    def _hash(self, h: Any, client: int) -> Any:
        h.update(client_name(client).encode())
        for k, t in self.of(client).items():
            h.update(k.encode())
            h.update(tensor_bytes(t))
        return h

    def digest(self) -> str:
        """SHA-256 over every hosted client's ``w_P^c`` (client order, then key order)."""
        h = hashlib.sha256()
        for c in self.hosted:
            self._hash(h, c)
        return str(h.hexdigest())

    def client_digests(self) -> dict[str, str]:
        """Each hosted client's own SHA-256 of ``w_P^c``: the same whichever worker hosts it."""
        return {client_name(c): str(self._hash(hashlib.sha256(), c).hexdigest()) for c in self.hosted}


@torch.no_grad()
def eval_sums(model: nn.Module, task: Any, dataset: Any, idx: np.ndarray, *,
              device: torch.device | None, precision: str = "fp32") -> dict[str, float]:
    """The task's summed ``eval_batch`` over examples ``idx`` of ``dataset`` (eval mode)."""
    bs = int(getattr(task, "eval_batch_size", None) or DEFAULT_EVAL_BATCH)
    order = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    try:
        for a in range(0, len(order), bs):
            batch = fetch_batch(dataset, order[a : a + bs], device, collate=getattr(task, "collate_fn", None))
            with autocast(precision, device):
                out = call_model(task, model, batch)
            for k, v in task.eval_batch(out, batch).items():
                sums[k] = sums.get(k, 0.0) + float(v)
    finally:
        model.train(was_training)
    return sums


def combine(task: Any, sums: Mapping[int, Mapping[str, float]]) -> tuple[dict[str, float], dict[str, Any]]:
    """``(pooled metrics over every split, personal_test_* summary)`` of per-client sums."""
    pooled: dict[str, float] = {}
    for s in sums.values():
        for k, v in s.items():
            pooled[k] = pooled.get(k, 0.0) + float(v)
    pooled.setdefault("count", 0.0)
    per = {c: task.finalize({"count": 0.0, **s}) for c, s in sums.items()}
    out: dict[str, Any] = {"clients_evaluated": len(per)}
    for m in (next(iter(per.values())) if per else {}):
        vals = [float(v[m]) for v in per.values()]
        out[f"personal_test_{m}"] = float(np.mean(vals))
        out[f"personal_test_{m}_min"] = float(np.min(vals))
    return task.finalize(pooled), out


def score_clients(side: Any, personal: PersonalState | None, global_state: Mapping[str, Tensor],
                  clients: Sequence[int], *, device: torch.device | None) -> dict[int, dict[str, float]]:
    """Each client's evaluation sums on its split of ``side.test_set``, with ``(w_G, w_P^c)``
    loaded into ``side.model``."""
    model, splits = side.model, side.splits
    out: dict[int, dict[str, float]] = {}
    dev_global = {k: v.to(device) for k, v in global_state.items()} if device is not None else dict(global_state)
    if personal is None:
        load_unique_state_dict(model, dev_global)
    for c in clients:
        if len(splits[c]) == 0:
            continue
        if personal is not None:
            load_unique_state_dict(model, {**dev_global, **personal.of(c)})
        out[c] = eval_sums(model, side.task, side.test_set, splits[c], device=device,
                           precision=side.job.train.precision)
    return out


def round_metrics(side: Any, server: Any, client_sums: Callable[[], Mapping[int, Mapping[str, float]]],
                  device: torch.device) -> tuple[dict[str, float], dict[str, Any]]:
    """Both runtimes' test metrics after a round (with personal parts the pooled score of the
    clients' own models, else the global model's) and :func:`combine`'s per-client summary
    of ``client_sums()`` (each scored client's sums, in client order)."""
    ev: dict[str, float] = {}
    if not side.personal_keys:
        ev = server.evaluate(side.model, side.task, side.test_set, device=device, precision=side.job.train.precision)
    if not side.per_client:
        return ev, {}
    pooled, per = combine(side.task, client_sums())
    return (pooled if side.personal_keys else ev), per
