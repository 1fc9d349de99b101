"""paratrain's Flower ClientApp (``paratrain.executors.federated.flower.clientapp:app``).

Handlers (Flower's Message API):

- ``@app.query()``: the node's ``partition-id`` and ``num-partitions`` (its ``--node-config``),
  which the server maps to the clients this node hosts (``c % num-partitions == partition-id``);
- ``@app.train()``: the local path's client step (:func:`.node.train_clients`) for the
  selected clients this node hosts; the reply carries each client's status (example count,
  loss, tensor headers) and the encoded updates (compression codecs included) as bytes;
- ``@app.evaluate()``: each hosted client's evaluation sums on its own test split, with its
  personal parts (:func:`.node.score_node`).

The node's clients' state lives in ``context.state["paratrain"]`` between messages of a run.
A wrong ``node_config`` or message is answered with a Flower error reply naming the problem
(the server records the node's clients as failed)."""

from __future__ import annotations

import json
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from . import protocol as P

__all__ = ["app"]

app = ClientApp()


def _partition(context: Context) -> tuple[int, int]:
    cfg = context.node_config
    try:
        p, n = int(cfg[P.PARTITION_ID]), int(cfg[P.NUM_PARTITIONS])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"this SuperNode's --node-config needs integer {P.PARTITION_ID} and "
                         f"{P.NUM_PARTITIONS} (got {dict(cfg)})") from None
    if not 0 <= p < n:
        raise ValueError(f"{P.PARTITION_ID} = {p} is outside [0, {P.NUM_PARTITIONS} = {n})")
    return p, n


def _state(context: Context) -> bytes | None:
    rec = context.state.config_records.get(P.STATE)
    blob = rec.get(P.HOST_STATE) if rec is not None else None
    return blob if isinstance(blob, bytes) else None


@app.query()
def query(msg: Message, context: Context) -> Message:
    p, n = _partition(context)
    return Message(RecordDict({P.NODE: ConfigRecord({P.PARTITION_ID: p, P.NUM_PARTITIONS: n})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from .node import train_clients

    p, n = _partition(context)
    plan: Any = msg.content.config_records[P.PLAN]
    glob = msg.content.array_records[P.GLOBAL].to_torch_state_dict()
    ctl = msg.content.array_records.get(P.CONTROL)
    statuses, payload, state = train_clients(
        str(plan[P.JOB]), round_idx=int(plan[P.ROUND]), clients=[int(c) for c in plan[P.CLIENTS]],
        lr_scale=float(plan[P.LR_SCALE]), global_state=glob,
        control=None if ctl is None else ctl.to_torch_state_dict(), partition=p, num_partitions=n,
        state=_state(context))
    if state is not None:
        context.state[P.STATE] = ConfigRecord({P.HOST_STATE: state, P.ROUND: int(plan[P.ROUND]) + 1})
    reply = ConfigRecord({P.STATUSES: json.dumps(statuses), P.PAYLOAD: payload, P.PARTITION_ID: p})
    return Message(RecordDict({P.RESULT: reply}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    from .node import score_node

    p, n = _partition(context)
    plan: Any = msg.content.config_records[P.PLAN]
    glob = msg.content.array_records[P.GLOBAL].to_torch_state_dict()
    sums = score_node(str(plan[P.JOB]), clients=[int(c) for c in plan[P.CLIENTS]], global_state=glob,
                      partition=p, num_partitions=n, state=_state(context))
    reply = ConfigRecord({P.SUMS: json.dumps({str(c): s for c, s in sums.items()})})
    return Message(RecordDict({P.RESULT: reply}), reply_to=msg)

