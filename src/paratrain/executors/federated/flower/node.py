"""A SuperNode's side of a round, without Flower: train the selected clients it hosts, or
score them on their test splits. :mod:`.clientapp` wraps these in Flower's
``@app.train()`` / ``@app.evaluate()`` handlers.

Each Flower message runs in a fresh ``flwr-clientapp`` process, so every call rebuilds the
job's model and data (:func:`~.side.build_side`, seeded as a worker of the local path does)
and restores the node's clients' state — error-feedback residuals, personal parts (Local
subgraphs), SCAFFOLD's ``c_i`` — from the blob the ClientApp keeps in Flower's
``context.state`` (:meth:`ClientHost.state_dict`, so whatever state another federated feature
adds to the host travels too). Training is :meth:`ClientHost.train_one`, the local path's
client step, at one intra-op thread (as the local path's worker processes run)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from ..client import ClientHost, client_name
from ..personal import score_clients
from .side import Side, build_side, from_blob, job_from_json, stateful, tensor_blob

__all__ = ["train_clients", "score_node", "NodeError"]


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


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _node(job_json: str, partition: int, num_partitions: int, state: bytes | None,
          global_state: Mapping[str, Tensor]) -> tuple[Side, ClientHost, dict[str, Tensor]]:
    """The job's side for this node's partition, its clients' state restored, and the
    server's model checked against the job's."""
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
    """Train ``clients`` (all hosted by this node) for round ``round_idx``; returns their
    statuses (the local path's), the concatenated payloads and the node's new state blob
    (None when the job's clients keep no state)."""
    with _one_thread():
        side, host, glob = _node(job_json, partition, num_partitions, state, global_state)
        keep = stateful(side.job, side.personal_keys)
        kw: dict[str, Any] = {} if control is None else {"control": dict(control)}
        statuses: list[dict[str, Any]] = []
        payloads: list[bytes] = []
        for c in clients:
            if not host.hosts(c):
                statuses.append({"client": c, "ok": False, "n": 0, "loss": None, "headers": [], "nbytes": 0,
                                 "error": f"{client_name(c)} is not hosted by partition {partition} of {num_partitions}"})
                continue
            res = host.train_one(c, round_idx, glob, lr_scale, **kw)
            statuses.append(res.status())
            payloads.append(res.payload)
        return statuses, b"".join(payloads), (tensor_blob(host.state_dict()) if keep else None)


def score_node(job_json: str, *, clients: list[int], global_state: Mapping[str, Tensor],
               partition: int, num_partitions: int, state: bytes | None) -> dict[int, dict[str, float]]:
    """The task's evaluation sums of each hosted client in ``clients`` on its own test split,
    with ``(w_G, w_P^c)`` (:func:`~paratrain.executors.federated.personal.score_clients`)."""
    with _one_thread():
        side, host, glob = _node(job_json, partition, num_partitions, state, global_state)
        mine = [c for c in clients if host.hosts(c)]
        return score_clients(side.model, host.personal, glob, mine, side.task, side.test_set, side.splits,
                             device=torch.device("cpu"), precision=side.job.train.precision)
