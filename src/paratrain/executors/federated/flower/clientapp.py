"""paratrain's Flower ClientApp (``paratrain.executors.federated.flower.clientapp:app``).

The node hosts the clients ``c % num-partitions == partition-id`` (its ``--node-config``):
``@app.train()`` runs the local path's client step for them (:func:`.node.train_clients`),
``@app.evaluate()`` scores them on their test splits (:func:`.node.score_node`). Their state
lives in ``context.state`` and, with a ``state-dir``, on the node's disk (:mod:`.node_state`).
A wrong ``node_config`` or message gets a Flower error reply naming the problem.
"""

from __future__ import annotations

import json
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS as SECAGG_CONFIGS
from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitins

from ....training.faults import maybe_drop_at
from ....training.gcfreeze import first_imports
from . import protocol as P
from .node_state import NodeStateFiles


def _secure(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's ``secaggplus_mod`` for a secure round's SecAgg+ messages, else the handler."""
    if msg.metadata.message_type == "train" and SECAGG_CONFIGS in msg.content.config_records:
        stage = str(msg.content.config_records[SECAGG_CONFIGS].get("stage", ""))
        maybe_drop_at(stage)  # fault injection (tests): this node drops out at that stage
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[_secure])


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


def _files(context: Context, plan: Any, p: int, n: int) -> NodeStateFiles | None:
    root = context.node_config.get(P.STATE_DIR)
    if not root or P.LINEAGE not in plan:
        return None
    from .side import job_from_json

    name = job_from_json(str(plan[P.JOB])).run.name
    return NodeStateFiles(str(root), name, str(plan[P.LINEAGE]), p, n)


def _state(context: Context, plan: Any, p: int, n: int) -> tuple[bytes | None, bool]:
    """The node's clients' state entering ``plan``'s round: from this run's context, else the
    node's disk (and whether it came from there)."""
    rec = context.state.config_records.get(P.STATE)
    blob = rec.get(P.HOST_STATE) if rec is not None else None
    if isinstance(blob, bytes):
        return blob, False
    files = _files(context, plan, p, n)
    got = files.load(int(plan[P.ROUND])) if files is not None and P.ROUND in plan else None
    return got, got is not None


def _keep(context: Context, plan: Any, p: int, n: int, state: bytes | None) -> None:
    """Keep the state entering the round after ``plan``'s in the context and (state-dir) on disk."""
    if state is None:
        return
    entering = int(plan[P.ROUND]) + 1
    context.state[P.STATE] = ConfigRecord({P.HOST_STATE: state, P.ROUND: entering})
    files = _files(context, plan, p, n)
    if files is not None:
        files.save(entering, state, int(plan.get(P.KEEP_FROM, 0)), int(plan.get(P.ATTEMPT, 0)))


@app.train()
def train(msg: Message, context: Context) -> Message:
    with first_imports():
        from .node import train_clients

    if "fitins.parameters" in msg.content.array_records:  # a secure round's masked-vector stage
        return _train_secure(msg, context)
    p, n = _partition(context)
    plan: Any = msg.content.config_records[P.PLAN]
    glob = msg.content.array_records[P.GLOBAL].to_torch_state_dict()
    ctl = msg.content.array_records.get(P.CONTROL)
    before, resumed = _state(context, plan, p, n)
    statuses, payload, state = train_clients(
        str(plan[P.JOB]), round_idx=int(plan[P.ROUND]), clients=[int(c) for c in plan[P.CLIENTS]],
        lr_scale=float(plan[P.LR_SCALE]), global_state=glob,
        control=None if ctl is None else ctl.to_torch_state_dict(), partition=p, num_partitions=n,
        state=before)
    _keep(context, plan, p, n, state)
    reply = ConfigRecord({P.STATUSES: json.dumps(statuses), P.PAYLOAD: payload, P.RESUMED: resumed,
                          P.CLIENTS: [int(st["client"]) for st in statuses], P.PARTITION_ID: p, P.NUM_PARTITIONS: n})
    return Message(RecordDict({P.RESULT: reply}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    with first_imports():
        from .node import score_node

    p, n = _partition(context)
    plan: Any = msg.content.config_records[P.PLAN]
    glob = msg.content.array_records[P.GLOBAL].to_torch_state_dict()
    sums = score_node(str(plan[P.JOB]), clients=[int(c) for c in plan[P.CLIENTS]], global_state=glob,
                      partition=p, num_partitions=n, state=_state(context, plan, p, n)[0])
    hosted = [int(c) for c in plan[P.CLIENTS] if int(c) % n == p]
    reply = ConfigRecord({P.SUMS: json.dumps({str(c): s for c, s in sums.items()}), P.CLIENTS: hosted,
                          P.PARTITION_ID: p, P.NUM_PARTITIONS: n})
    return Message(RecordDict({P.RESULT: reply}), reply_to=msg)


def _train_secure(msg: Message, context: Context) -> Message:
    """SecAgg+: the hosted clients' weighted mean update and weight as the legacy FitRes
    ``secaggplus_mod`` masks (the statuses travel without the updates)."""
    from flwr.common import parameters_to_ndarrays

    from .node import train_secure

    p, n = _partition(context)
    fitins = recorddict_to_fitins(msg.content, keep_input=True)
    plan: Any = fitins.config
    statuses, mean, weight, state = train_secure(
        str(plan[P.JOB]), round_idx=int(plan[P.ROUND]), clients=json.loads(str(plan[P.CLIENTS])),
        lr_scale=float(plan[P.LR_SCALE]), keys=json.loads(str(plan[P.KEYS])),
        arrays=parameters_to_ndarrays(fitins.parameters), partition=p,
        num_partitions=n, state=_state(context, plan, p, n)[0])
    _keep(context, plan, p, n, state)
    res = FitRes(Status(code=Code.OK, message="Success"), ndarrays_to_parameters(mean), int(weight),
                 {P.STATUSES: json.dumps(statuses), P.PARTITION_ID: p, P.NUM_PARTITIONS: n})
    return Message(fitres_to_recorddict(res, keep_input=True), reply_to=msg)
