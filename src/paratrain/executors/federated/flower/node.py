"""A SuperNode's side of a round, without Flower (:mod:`.clientapp` wraps it). Each message
runs in a fresh process, so every call rebuilds the job's model and data and restores the
node's clients' state from its blob; it trains at one intra-op thread, as local workers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ....training.threads import use_threads
from ..client import ClientHost
from ..personal import score_clients
from .side import Side, build_side, from_blob, job_from_json, stateful, tensor_blob


class NodeError(RuntimeError):
    """The node cannot take part (its node_config or the server's message is wrong)."""


def _check_global(template: Mapping[str, Tensor], got: Mapping[str, Tensor]) -> dict[str, Tensor]:
    if list(got) != list(template):
        raise NodeError(f"the server's model has keys {sorted(got)[:5]}..., this node's job builds "
                        f"{sorted(template)[:5]}... (another job or model version)")
    out: dict[str, Tensor] = {}
    for k, t in template.items():
        g = got[k]
        if tuple(g.shape) != tuple(t.shape) or g.dtype != t.dtype:
            raise NodeError(f"the server's {k} is {tuple(g.shape)} {g.dtype}, this node's {tuple(t.shape)} {t.dtype}")
        out[k] = g
    return out


def _node(job_json: str, partition: int, num_partitions: int, state: bytes | None,
          global_state: Mapping[str, Tensor]) -> tuple[Side, ClientHost, dict[str, Tensor]]:
    """The job's side for this partition, its clients' state restored, the server's model checked."""
    job = job_from_json(job_json)
    side = build_side(job, partition=partition, num_partitions=num_partitions)
    host = side.host
    assert host is not None
    if stateful(job, side.personal_keys) and state:
        host.load_state_dict(from_blob(state))
    return side, host, _check_global(side.template, global_state)


def train_clients(job_json: str, *, round_idx: int, clients: list[int], lr_scale: float,
                  global_state: Mapping[str, Tensor], control: Mapping[str, Tensor] | None,
                  partition: int, num_partitions: int, state: bytes | None,
                  ) -> tuple[list[dict[str, Any]], bytes, bytes | None]:
    """Train the selected ``clients`` this node hosts; returns their statuses, the concatenated
    payloads and the node's new state blob (None when the clients keep no state)."""
    with use_threads(1):
        side, host, glob = _node(job_json, partition, num_partitions, state, global_state)
        results = [host.train_one(c, round_idx, glob, lr_scale, control=control) for c in clients if host.hosts(c)]
        blob = tensor_blob(host.state_dict()) if stateful(side.job, side.personal_keys) else None
        return [res.status() for res in results], b"".join(res.payload for res in results), blob


def score_node(job_json: str, *, clients: list[int], global_state: Mapping[str, Tensor],
               partition: int, num_partitions: int, state: bytes | None) -> dict[int, dict[str, float]]:
    """Each hosted client's evaluation sums on its own test split (:func:`..personal.score_clients`)."""
    with use_threads(1):
        side, host, glob = _node(job_json, partition, num_partitions, state, global_state)
        mine = [c for c in clients if host.hosts(c)]
        return score_clients(side, host.personal, glob, mine, device=torch.device("cpu"))


def node_mean(statuses: list[dict[str, Any]], payload: bytes, template: Mapping[str, Tensor],
              ) -> tuple[list[Any], int]:
    """Secure rounds: ``u = sum_c n_c D_c / N`` over this node's successful clients (numpy, the
    model's key order) and ``N = sum_c n_c``; a client whose update fails the server's checks
    is marked failed here (the server never sees it alone)."""
    from ..aggregation import MalformedUpdateError
    from ..wire import UpdateDecoder, split_payload

    decode = UpdateDecoder(template)  # the node's clients share one layout: made once
    acc = {k: torch.zeros(t.shape, dtype=torch.float64) for k, t in template.items()}
    n_all = 0
    for st, chunk in zip(statuses, split_payload(statuses, payload), strict=True):
        if not st.get("ok"):
            continue
        try:
            upd = decode(f"client-{st['client']}", st.get("headers", []), chunk)
        except MalformedUpdateError as e:
            st.update(ok=False, error=f"rejected update: {e}")
            continue
        n = int(st["n"])
        for k, v in upd.items():
            acc[k] += n * v.double()
        n_all += n
    mean = [(acc[k] / max(n_all, 1)).float().numpy() for k in template]
    for st in statuses:  # the payload stays on the node
        st.update(headers=[], nbytes=0)
    return mean, n_all


def train_secure(job_json: str, *, round_idx: int, clients: list[int], lr_scale: float, keys: list[str],
                 arrays: list[Any], partition: int, num_partitions: int, state: bytes | None,
                 ) -> tuple[list[dict[str, Any]], list[Any], int, bytes | None]:
    """A secure round's client step (the model as arrays in the order of ``keys``): the
    statuses, the node's mean update, its weight and its new state blob."""
    if len(arrays) != len(keys):
        raise NodeError(f"the server sent {len(arrays)} arrays for {len(keys)} keys")
    glob = {k: torch.from_numpy(np.array(a, copy=True)) for k, a in zip(keys, arrays, strict=True)}
    statuses, payload, blob = train_clients(job_json, round_idx=round_idx, clients=clients, lr_scale=lr_scale,
                                            global_state=glob, control=None, partition=partition,
                                            num_partitions=num_partitions, state=state)
    mean, weight = node_mean(statuses, payload, glob)
    return statuses, mean, weight, blob
